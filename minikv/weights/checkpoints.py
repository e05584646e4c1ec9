"""Hugging Face checkpoint directories: ``config.json`` + ``*.safetensors`` -> a ``minikv.model.Model``.

    model = load_checkpoint("path/to/dir")            # float32; dtype=np.float64 for exactness proofs

Two architectures here (``config.json``'s ``architectures[0]``):

* ``LlamaForCausalLM``: GQA. transformers rotates with ``rotate_half``, so the weights are
  used as they are with ``rope_layout="half"`` (no Q/K permutation, unlike GGUF files).
  Biases (``attention_bias``/``mlp_bias``) and scaled RoPE types are refused.
* ``DeepseekV3ForCausalLM``: MLA (``minikv.mla``), dense layers only. ``q_lora_rank`` null or
  set, ``rope_interleave``, YaRN in ``rope_parameters`` (or the older ``rope_scaling``) and
  ``attention_bias`` are honoured. A layer that uses mixture-of-experts is refused: the KV cache
  does not depend on the MLP, and loading MoE layers is out of scope here.

The other families (Qwen2, Qwen3, Llama 3.1+ with ``llama3`` scaling, Mistral, Gemma 2, Gemma 3 text,
gpt-oss, DeepSeek-V3 with MoE layers) are data over the same helpers: ``minikv.weights.families``.

Tensors may sit in one ``model.safetensors`` or in shards listed by
``model.safetensors.index.json``. They are read with ``safetensors.safe_open(...,
framework="np")``; NumPy has no bfloat16, so BF16 tensors are read from the file's own
header and converted through ``ml_dtypes``. Everything becomes float32 (then the model's
dtype). torch's ``Linear`` stores [out, in]; minikv computes ``x @ W`` with [in, out], so
every projection is transposed once here.

A missing directory or ``config.json`` raises ``ModelFileNotFoundError``; an unknown
architecture, a MoE layer, a missing tensor or a wrong shape raises ``ModelFormatError``
naming it.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

from minikv.errors import ConfigError, ModelFileNotFoundError, ModelFormatError
from minikv.layers import YarnConfig
from minikv.mla.block import MLALayerWeights
from minikv.mla.latent import MLAConfig
from minikv.model import LayerWeights, Model, ModelConfig, ModelWeights
from minikv.weights import families
from minikv.weights.checks import (
    Fields,
    check_finite,
    check_layer_count,
    check_rope_memory,
    check_weights_memory,
)

SUPPORTED = ("LlamaForCausalLM", "DeepseekV3ForCausalLM")


class _Tensors:
    """The named tensors of a checkpoint directory, read on demand: ``get(name, shape)`` -> float32.

    Every failure to read a shard (safetensors' own ``SafetensorError``: a header of 2^62 bytes, random
    bytes, a truncated file, offsets past its end) is a ``ModelFormatError`` naming the file; so is a
    broken index, or an index entry that points outside the checkpoint folder.
    """

    def __init__(self, path: Path):
        self.path = path
        index = path / "model.safetensors.index.json"
        if index.is_file():
            self.file_of = {name: _inside(path, f, f"{index.name}: weight_map[{name!r}]")
                            for name, f in Fields(_json(index), str(index)).obj("weight_map").items()}
        else:
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise ModelFileNotFoundError(f"{path} has a config.json but no *.safetensors weights; "
                                             "save the model with save_pretrained(..., safe_serialization=True)")
            self.file_of = {}
            for f in files:
                self.file_of.update({name: f for name in _safetensors(f, "", _keys)})
        for f in sorted(set(self.file_of.values())):
            if not f.is_file():
                raise ModelFileNotFoundError(f"{f.name}, a shard named by {index.name}, is missing from {path}")

    def has(self, name: str) -> bool:
        return name in self.file_of

    def get(self, name: str, shape: tuple) -> np.ndarray:
        """The tensor ``name`` as float32, checked to be ``shape`` (torch's layout) and finite."""
        if name not in self.file_of:
            raise ModelFormatError(f"tensor {name!r} is missing from the checkpoint in {self.path}")
        a = _safetensors(self.file_of[name], name, _read)
        if a.shape != tuple(shape):
            raise ModelFormatError(f"tensor {name!r} has shape {list(a.shape)}, expected {list(shape)} "
                                   f"from config.json (checkpoint {self.path})")
        return check_finite(name, a, str(self.file_of[name]))

    def linear(self, name: str, n_in: int, n_out: int) -> np.ndarray:
        """A torch ``Linear`` weight [out, in], returned [in, out] for ``x @ W``."""
        return np.ascontiguousarray(self.get(name, (n_out, n_in)).T)


def _json(file: Path):
    """The JSON value in ``file``; ModelFormatError naming it if it cannot be read or parsed."""
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ModelFormatError(f"{file} is not valid JSON ({type(e).__name__}: {e}); re-save the checkpoint") from None


def _inside(folder: Path, entry, where: str) -> Path:
    """The shard file ``entry`` names, which must sit inside ``folder`` (no '..', no absolute path)."""
    target = (folder / entry).resolve() if isinstance(entry, str) and entry else None
    if target is None or folder.resolve() not in target.parents:
        raise ModelFormatError(f"{where}={entry!r} does not name a file inside the checkpoint folder {folder}; "
                               "an index lists shard file names such as model-00001-of-00002.safetensors")
    return target


def _safetensors(file: Path, name: str, read):
    """``read(file, name)``, every error of the safetensors reader turned into a ModelFormatError naming the file."""
    from safetensors import SafetensorError

    try:
        return read(file, name)
    except (SafetensorError, OSError, ValueError, KeyError, TypeError, struct.error) as e:
        what = f"tensor {name!r} of " if name else ""
        raise ModelFormatError(f"cannot read {what}{file} ({type(e).__name__}: {e}); the shard is corrupt or "
                               "truncated: re-save or re-download it") from None


def _keys(file: Path, name: str = "") -> list[str]:
    from safetensors import safe_open

    with safe_open(str(file), framework="np") as f:
        return list(f.keys())


def _read(file: Path, name: str) -> np.ndarray:
    from safetensors import safe_open

    with safe_open(str(file), framework="np") as f:
        if f.get_slice(name).get_dtype() != "BF16":
            return np.asarray(f.get_tensor(name), dtype=np.float32)
    # NumPy has no bfloat16: find the tensor's bytes through the file's header (u64 length + JSON)
    with open(file, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        entry = json.loads(fh.read(n))[name]
        start, end = entry["data_offsets"]
        fh.seek(8 + n + start)
        raw = np.frombuffer(fh.read(end - start), dtype=ml_dtypes.bfloat16)
    return raw.astype(np.float32).reshape(entry["shape"])


# --- config.json -> ModelConfig ---------------------------------------------------------------------

def _rope(cfg: Fields) -> tuple[float, YarnConfig | None]:
    """(rope_theta, YaRN or None) from ``rope_parameters`` (transformers 5) or ``rope_scaling`` (older files)."""
    rp = cfg.obj("rope_parameters" if cfg.get("rope_parameters") else "rope_scaling")
    theta = rp.number("rope_theta", cfg.number("rope_theta", 10000.0))
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "yarn":
        raise ModelFormatError(f"rope_type {kind!r} is not supported; minikv reads 'default' and 'yarn'")
    max_pos = cfg.integer("max_position_embeddings", 4096)
    original = (cfg.integer("original_max_position_embeddings", None)
                or rp.integer("original_max_position_embeddings", None) or max_pos)
    # transformers' fallback when factor is null; a factor that is given must be a positive number (0.0 is
    # refused: read with ``or`` it used to become the fallback silently)
    factor = max_pos / original if rp.get("factor") is None else rp.number("factor")
    fast, slow = rp.number("beta_fast", None), rp.number("beta_slow", None)
    return theta, YarnConfig(factor=factor, original_max_position=original, beta_fast=32.0 if fast is None else fast,
                             beta_slow=1.0 if slow is None else slow, mscale=rp.number("mscale", None, positive=False),
                             mscale_all_dim=rp.number("mscale_all_dim", None, positive=False),
                             attention_factor=rp.number("attention_factor", None), truncate=rp.flag("truncate", True))


def _common(cfg: Fields, **extra) -> dict:
    """The ModelConfig fields every architecture spells the same way, each checked for its JSON type."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelFormatError(f"hidden_act={cfg['hidden_act']!r}; minikv's MLP is SwiGLU (silu)")
    eos = cfg.get("eos_token_id")
    eos = Fields({"eos_token_id": eos[0] if isinstance(eos, list) and eos else eos}, cfg.where)
    return dict(vocab_size=cfg.integer("vocab_size"), hidden_size=cfg.integer("hidden_size"),
                intermediate_size=cfg.integer("intermediate_size"), num_layers=cfg.integer("num_hidden_layers"),
                num_heads=cfg.integer("num_attention_heads"), rms_eps=cfg.number("rms_norm_eps", 1e-6),
                max_position=cfg.integer("max_position_embeddings", 4096),
                tie_embeddings=cfg.flag("tie_word_embeddings", False),
                bos_token_id=cfg.integer("bos_token_id", None, minimum=0),
                eos_token_id=eos.integer("eos_token_id", None, minimum=0), **extra)


def _llama_config(cfg: Fields) -> ModelConfig:
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.flag(flag, False):
            raise ModelFormatError(f"{flag}=true: minikv's Llama blocks have no biases; use a checkpoint without them")
    theta, yarn = _rope(cfg)
    if yarn is not None:
        raise ModelFormatError("rope_type 'yarn' is read for DeepseekV3ForCausalLM only; this Llama uses it")
    heads = cfg.integer("num_attention_heads")  # (>= 1: no division by zero below)
    head_dim = cfg.integer("head_dim", None) or cfg.integer("hidden_size") // heads
    return ModelConfig(**_common(cfg, num_kv_heads=cfg.integer("num_key_value_heads", None) or heads,
                                 head_dim=head_dim, rope_theta=theta, rope_layout="half"))


def _deepseek_config(cfg: Fields) -> ModelConfig:
    layers, experts = cfg.integer("num_hidden_layers"), cfg.integer("n_routed_experts", None, minimum=0)
    first_dense = cfg.integer("first_k_dense_replace", None, minimum=0) or 0
    if experts and first_dense < layers:
        raise ModelFormatError(
            f"layer {first_dense} uses mixture-of-experts (first_k_dense_replace={first_dense} < num_hidden_layers="
            f"{layers}, n_routed_experts={experts}); the KV cache does not depend on the MLP and loading MoE layers "
            "is out of scope: use a dense checkpoint (first_k_dense_replace >= num_hidden_layers)")
    theta, yarn = _rope(cfg)
    mla = MLAConfig(kv_lora_rank=cfg.integer("kv_lora_rank"), qk_nope_head_dim=cfg.integer("qk_nope_head_dim"),
                    qk_rope_head_dim=cfg.integer("qk_rope_head_dim"), v_head_dim=cfg.integer("v_head_dim"),
                    q_lora_rank=cfg.integer("q_lora_rank", None), rope_interleave=cfg.flag("rope_interleave", True),
                    yarn=yarn)
    return ModelConfig(**_common(cfg, num_kv_heads=1, head_dim=mla.latent_dim, rope_theta=theta, mla=mla))


# --- tensors -> weights --------------------------------------------------------------------------------

def _mlp(t: _Tensors, p: str, c: ModelConfig, norm: np.ndarray | None = None) -> dict:
    """The gated MLP's matrices and its input norm (Llama and DeepSeek: ``post_attention_layernorm``; else ``norm``)."""
    h, i = c.hidden_size, c.intermediate_size
    return dict(mlp_norm=t.get(f"{p}.post_attention_layernorm.weight", (h,)) if norm is None else norm,
                w_gate=t.linear(f"{p}.mlp.gate_proj.weight", h, i), w_up=t.linear(f"{p}.mlp.up_proj.weight", h, i),
                w_down=t.linear(f"{p}.mlp.down_proj.weight", i, h))


def _gqa(t: _Tensors, p: str, c: ModelConfig) -> dict:
    """The GQA projections, named alike by Llama and the families of ``minikv.weights.families``."""
    h, q, kv, a = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, f"{p}.self_attn"
    return dict(wq=t.linear(f"{a}.q_proj.weight", h, q), wk=t.linear(f"{a}.k_proj.weight", h, kv),
                wv=t.linear(f"{a}.v_proj.weight", h, kv), wo=t.linear(f"{a}.o_proj.weight", q, h))


def _llama_layer(t: _Tensors, p: str, c: ModelConfig) -> LayerWeights:
    return LayerWeights(attn_norm=t.get(f"{p}.input_layernorm.weight", (c.hidden_size,)), **_gqa(t, p, c),
                        **_mlp(t, p, c))


def _deepseek_layer(t: _Tensors, p: str, c: ModelConfig, bias: bool, dense: bool = True) -> MLALayerWeights:
    m, h, hq, a = c.mla, c.hidden_size, c.num_heads, f"{p}.self_attn"
    q_out, r, w = hq * m.qk_head_dim, m.kv_lora_rank, m.latent_dim
    if m.q_lora_rank is None:
        q = dict(wq=t.linear(f"{a}.q_proj.weight", h, q_out))
    else:
        rq = m.q_lora_rank
        q = dict(wq_a=t.linear(f"{a}.q_a_proj.weight", h, rq), q_a_norm=t.get(f"{a}.q_a_layernorm.weight", (rq,)),
                 wq_b=t.linear(f"{a}.q_b_proj.weight", rq, q_out))
        if bias:
            q["bq_a"] = t.get(f"{a}.q_a_proj.bias", (rq,))
    if bias:
        q.update(bkv_a=t.get(f"{a}.kv_a_proj_with_mqa.bias", (w,)), bo=t.get(f"{a}.o_proj.bias", (h,)))
    return MLALayerWeights(attn_norm=t.get(f"{p}.input_layernorm.weight", (h,)),
                           wkv_a=t.linear(f"{a}.kv_a_proj_with_mqa.weight", h, w),
                           kv_a_norm=t.get(f"{a}.kv_a_layernorm.weight", (r,)),
                           wkv_b=t.linear(f"{a}.kv_b_proj.weight", r, hq * (m.qk_nope_head_dim + m.v_head_dim)),
                           wo=t.linear(f"{a}.o_proj.weight", hq * m.v_head_dim, h), **q,
                           **(_mlp(t, p, c) if dense else dict(  # an MoE layer: its MLP is minikv.weights.families'
                               mlp_norm=t.get(f"{p}.post_attention_layernorm.weight", (h,)),
                               w_gate=None, w_up=None, w_down=None)))


def load_checkpoint(path, dtype=np.float32) -> Model:
    """Load a Hugging Face checkpoint directory: ``LlamaForCausalLM``, ``DeepseekV3ForCausalLM`` or a family of
    ``minikv.weights.families`` (``FAMILIES``).

    path:  a directory with ``config.json`` and ``*.safetensors`` (one file or an indexed set of shards)
    dtype: the model's compute dtype, float32 (default) or float64
    Raises ModelFileNotFoundError (no directory / config.json / weights) or ModelFormatError
    (unknown architecture, MoE layers, a missing tensor, a wrong shape, unsupported options).
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        what = ("has no config.json" if path.is_dir() else "is not a directory" if path.exists()
                else "does not exist")
        raise ModelFileNotFoundError(f"checkpoint directory {path} {what}; pass a directory saved with "
                                     "transformers' save_pretrained (config.json + *.safetensors)")
    cfg = Fields(_json(path / "config.json"), str(path / "config.json"))
    archs = cfg.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs else None
    family = isinstance(arch, str) and families.handles(arch, cfg)  # the families of minikv.weights.families
    if arch not in SUPPORTED and not family:
        raise ModelFormatError(f"architecture {arch!r} in {path / 'config.json'} is not supported; "
                               f"minikv loads {', '.join(SUPPORTED + families.FAMILIES)}")
    reader = (lambda c: families.family_config(arch, c, sys.modules[__name__])) if family else {  # noqa: E731
        "LlamaForCausalLM": _llama_config, "DeepseekV3ForCausalLM": _deepseek_config}[arch]
    check_weights_memory("num_hidden_layers", cfg.integer("num_hidden_layers"), cfg.integer("hidden_size"),
                         cfg.integer("intermediate_size"), cfg.integer("vocab_size"), cfg.where)
    try:
        config = reader(cfg)
    except ConfigError as e:  # e.g. layer_types that do not name every layer, a window that is no positive int
        raise ModelFormatError(f"{path / 'config.json'}: {e}") from None
    t, moe = _Tensors(path), None  # (headers only) the tensors there bound how many layers the file can hold
    check_layer_count("num_hidden_layers", config.num_layers, len(t.file_of), cfg.where)
    rope = (config.mla.qk_rope_head_dim, 1) if config.mla else (config.head_dim, len(config.rope_thetas))
    check_rope_memory("max_position_embeddings", config.max_position, *rope, dtype)
    if family:
        layers, moe = families.family_layers(t, arch, config, cfg, sys.modules[__name__])
    elif arch == "DeepseekV3ForCausalLM":
        bias = cfg.flag("attention_bias", False)
        layers = [_deepseek_layer(t, f"model.layers.{i}", config, bias) for i in range(config.num_layers)]
    else:
        layers = [_llama_layer(t, f"model.layers.{i}", config) for i in range(config.num_layers)]
    v, h = config.vocab_size, config.hidden_size
    lm_head = None if config.tie_embeddings else t.get("lm_head.weight", (v, h))  # tied: the embedding is the head
    final_norm = t.get("model.norm.weight", (h,))
    if arch in families.GEMMAS:
        final_norm = np.float32(1.0) + final_norm  # Gemma3RMSNorm: x * (1 + w)
    weights = ModelWeights(embed=t.get("model.embed_tokens.weight", (v, h)), layers=layers, final_norm=final_norm,
                           lm_head=lm_head, moe=moe)
    return Model(config, weights, dtype=dtype)
