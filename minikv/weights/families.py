"""The model families beyond Llama, as data: each Hugging Face architecture's config.json -> ``ModelConfig`` fields.

Every family below is a Llama (``minikv.model``) with a few options turned on; what each changes,
and where transformers 5.24 defines it (``models/<family>/modeling_<family>.py``):

=====================  ==========================================================================
Qwen2ForCausalLM       ``qkv_bias``: q/k/v projections carry biases, added before RoPE (the cached key
                       carries its bias); every layer full attention unless ``use_sliding_window``:
                       then layers ``max_window_layers`` and up slide (``_qwen_window``)
Qwen3ForCausalLM       ``qk_norm`` (a plain RMSNorm over each head, before RoPE) and an explicit
                       ``head_dim`` that need not be hidden / heads; sliding layers as Qwen2's
LlamaForCausalLM       with ``rope_type: llama3`` (Llama 3.1+): ``Llama3Scaling`` (below); a plain Llama
                       stays with ``minikv.weights.checkpoints``
MistralForCausalLM     ``sliding_window`` on every layer (v0.1: 4096); null means full attention
Gemma2ForCausalLM      alternating sliding / full layers (``layer_types``), ``attn_softcap`` (per tile,
                       inside the online softmax) and ``final_softcap``, Gemma's four norms of 1 + w,
                       GeGLU, ``query_pre_attn_scalar``, the embedding scaled by sqrt(hidden)
Gemma3ForCausalLM      (text) Gemma 2 with QK-norm, every 6th layer full (``sliding_window_pattern``), a RoPE
                       base per layer type (10k sliding, 1M full); no attention soft-cap (transformers ignores it)
GptOssForCausalLM      learned ``sinks`` per head, biases on q/k/v/o, alternating 128-token sliding and
                       full layers, YaRN for every layer, and a mixture-of-experts MLP (``minikv.moe``:
                       top-k then softmax, interleaved gate/up, clamped SwiGLU)
DeepseekV3ForCausalLM  with MoE layers (``first_k_dense_replace`` < layers): MLA attention as
                       ``minikv.weights.checkpoints`` reads it, and DeepSeek's group-limited sigmoid
                       routing with a shared expert in the MoE layers
=====================  ==========================================================================

An option of a family that minikv does not implement (a Qwen3 with ``attention_bias``, a rope
type other than the family's, an MoE layer of the wrong expert count) is a ``ModelFormatError``
naming it. This module is reached through ``minikv.weights.checkpoints.load_checkpoint``, which hands
itself in as ``base`` (its tensor reader and the config/weight helpers shared with Llama and DeepSeek),
so that the two modules never import each other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from minikv.errors import ModelFormatError
from minikv.layers import ACTIVATIONS
from minikv.model import LayerWeights, ModelConfig
from minikv.moe import MoEConfig, MoEWeights
from minikv.weights.checks import Fields
from minikv.weights.gemma import gemma3_layer_types

FAMILIES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM", "Gemma2ForCausalLM",
            "Gemma3ForCausalLM", "GptOssForCausalLM")
GEMMAS = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")  # whose RMSNorms multiply by 1 + w


@dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3.1's RoPE frequencies (transformers' ``_compute_llama3_parameters``).

    Wavelengths 2 pi / f longer than original / low_freq_factor are stretched by ``factor`` (the slow
    dims that carry long-range position), shorter than original / high_freq_factor are kept, and the
    band between is interpolated. cos and sin are not rescaled (``cos_sin_factor`` 1).
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position: int
    cos_sin_factor: float = 1.0

    def inv_freq(self, head_dim: int, theta: float) -> np.ndarray:
        """[D/2] float64 frequencies."""
        f = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
        wavelen = 2 * math.pi / f
        old = self.original_max_position
        low, high = old / self.low_freq_factor, old / self.high_freq_factor
        scaled = np.where(wavelen > low, f / self.factor, f)
        smooth = (self.original_max_position / wavelen - self.low_freq_factor) / (self.high_freq_factor
                                                                                  - self.low_freq_factor)
        mixed = (1 - smooth) * scaled / self.factor + smooth * scaled
        return np.where((wavelen >= high) & (wavelen <= low), mixed, scaled)


def handles(arch: str, cfg: Fields) -> bool:
    """Whether this module loads ``arch`` (else ``minikv.weights.checkpoints`` does)."""
    if arch == "LlamaForCausalLM":
        return _rope_params(cfg).get("rope_type", _rope_params(cfg).get("type")) == "llama3"
    if arch == "DeepseekV3ForCausalLM":
        return bool(cfg.get("n_routed_experts")) and cfg.integer("first_k_dense_replace", 0, minimum=0) < \
            cfg.integer("num_hidden_layers")
    return arch in FAMILIES


def _rope_params(cfg: Fields) -> Fields:
    return cfg.obj("rope_parameters" if cfg.get("rope_parameters") else "rope_scaling")


def _refuse(cfg: Fields, *flags: str) -> None:
    for flag in flags:
        if cfg.get(flag):
            raise ModelFormatError(f"{flag}={cfg[flag]!r} in config.json: minikv's {cfg['architectures'][0]} does "
                                   "not implement it (use a checkpoint without it)")


def _layer_types(cfg: Fields, every: str | None, alternate: bool) -> tuple | None:
    """config.json's ``layer_types`` if given, else every layer ``every``, or sliding/full alternating."""
    n = cfg.integer("num_hidden_layers")
    if cfg.get("layer_types"):
        return tuple(cfg["layer_types"])
    if alternate:  # Gemma 2, gpt-oss: even layers slide
        return tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n))
    return None if every is None else (every,) * n


def family_config(arch: str, cfg: Fields, base) -> ModelConfig:
    """The ``ModelConfig`` of a family's config.json (module docstring); cfg: its ``Fields`` (a missing or
    mistyped field is a ModelFormatError naming it)."""
    if arch == "DeepseekV3ForCausalLM":
        dense = base._deepseek_config(Fields({**cfg, "first_k_dense_replace": cfg["num_hidden_layers"]}, cfg.where))
        return replace(dense, moe=_deepseek_moe(cfg), first_dense=cfg.integer("first_k_dense_replace", 0, minimum=0))
    heads = cfg.integer("num_attention_heads")
    head_dim = cfg.integer("head_dim", None) or cfg.integer("hidden_size") // heads
    rp = _rope_params(cfg)
    kind = rp.get("rope_type", rp.get("type", "default"))
    want = {"LlamaForCausalLM": "llama3", "GptOssForCausalLM": "yarn"}.get(arch, "default")
    if kind != want:
        raise ModelFormatError(f"rope_type {kind!r} in config.json: minikv reads {arch} with {want!r} only")
    scaling, theta = None, rp.number("rope_theta", cfg.number("rope_theta", 10000.0))
    if kind == "yarn":
        theta, scaling = base._rope(cfg)
    elif kind == "llama3":
        scaling = Llama3Scaling(rp.number("factor"), rp.number("low_freq_factor"), rp.number("high_freq_factor"),
                                rp.integer("original_max_position_embeddings"))
    geometry = dict(num_kv_heads=cfg.integer("num_key_value_heads", heads), head_dim=head_dim, rope_theta=theta,
                rope_layout="half", rope_scaling=scaling)
    extra = _FAMILY_OPTIONS[arch](cfg)  # (Gemma-3 names its own head_dim default and RoPE bases)
    if arch in GEMMAS:
        # _common checks a Llama's hidden_act; Gemma's is read above
        cfg = Fields({**cfg, "hidden_act": "silu"}, cfg.where)
    return ModelConfig(**base._common(cfg, **{**geometry, **extra}))


def qwen_layer_types(num_layers: int, window: int | None, use_sliding_window: bool,
                     max_window_layers: int = 28) -> tuple:
    """Qwen2/Qwen3's layer types when config.json names none: with ``use_sliding_window`` and a window, layers
    ``max_window_layers`` .. L - 1 slide and the first ones stay full; else every layer is full (transformers
    5.24, ``Qwen2Config.__post_init__``; Qwen3's is the same; Qwen2-MoE's differs and is not read here)."""
    slide = use_sliding_window and window is not None
    return tuple("sliding_attention" if slide and i >= max_window_layers else "full_attention"
                 for i in range(num_layers))


def _qwen_window(cfg: Fields) -> dict:
    """Qwen2/Qwen3's sliding layers (``qwen_layer_types``); without ``use_sliding_window`` the window is None. A
    ``layer_types`` in config.json wins; a sliding layer with no window is refused (``check_layer_types``), as
    transformers' mask refuses it."""
    w = cfg.integer("sliding_window", None) if cfg.flag("use_sliding_window", False) else None
    types = _layer_types(cfg, None, False) or qwen_layer_types(
        cfg.integer("num_hidden_layers"), w, w is not None, cfg.integer("max_window_layers", 28, minimum=0))
    return dict(layer_types=types, sliding_window=w) if "sliding_attention" in types else {}


def _qwen2(cfg: Fields) -> dict:
    return dict(qkv_bias=True, **_qwen_window(cfg))


def _qwen3(cfg: Fields) -> dict:
    _refuse(cfg, "attention_bias")
    return dict(qk_norm=True, **_qwen_window(cfg))


def _llama3(cfg: Fields) -> dict:
    _refuse(cfg, "attention_bias", "mlp_bias")
    return {}


def _mistral(cfg: Fields) -> dict:
    w = cfg.get("sliding_window")
    return {} if w is None else dict(layer_types=_layer_types(cfg, "sliding_attention", False), sliding_window=w)


def _gemma(cfg: Fields, softcaps: tuple) -> dict:
    """What Gemma 2 and Gemma 3 share: the four norms of 1 + w, GeGLU, the embedding scaled by sqrt(hidden), the
    attention scale 1/sqrt(query_pre_attn_scalar), and the two soft-caps (``softcaps``: the config class's
    defaults for (attention, final) where config.json leaves them out)."""
    _refuse(cfg, "attention_bias", "use_bidirectional_attention")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if not isinstance(act, str) or act not in ACTIVATIONS:
        raise ModelFormatError(f"hidden_activation={act!r}; minikv's gated MLPs use {sorted(ACTIVATIONS)}")
    return dict(hidden_act=act, sandwich_norms=True, embed_scale=cfg.integer("hidden_size") ** 0.5,
                query_pre_attn_scalar=cfg.number("query_pre_attn_scalar", 256.0),
                # a JSON null turns a cap off; an absent key takes the class default
                **{ours: cfg.number(key, None) if key in cfg else default for ours, key, default in (
                    ("attn_softcap", "attn_logit_softcapping", softcaps[0]),
                    ("final_softcap", "final_logit_softcapping", softcaps[1]))})


def _gemma2(cfg: Fields) -> dict:
    return dict(layer_types=_layer_types(cfg, None, True), sliding_window=cfg.get("sliding_window", 4096),
                **_gemma(cfg, (50.0, 30.0)))  # Gemma2Config's defaults


def _gemma3(cfg: Fields) -> dict:
    """Gemma 3 text: Gemma 2 with QK-norm (of 1 + w), every ``sliding_window_pattern``-th layer full (default 6),
    and a RoPE base per layer type (``rope_parameters``, or the older ``rope_theta``/``rope_local_base_freq``;
    transformers 5.24's ``Gemma3TextConfig`` and its defaults). The final soft-cap applies as Gemma 2's; the
    attention one is refused: ``Gemma3Attention`` does not pass it to its attention function."""
    if cfg.get("attn_logit_softcapping") is not None:  # Gemma3Attention keeps it but never passes it on
        raise ModelFormatError(f"attn_logit_softcapping={cfg['attn_logit_softcapping']!r}: transformers 5.24's "
                               "Gemma-3 reads it but does not apply it, so minikv refuses to guess (set it to null)")
    rp = cfg.obj("rope_parameters")
    full, sliding = rp.obj("full_attention"), rp.obj("sliding_attention")
    if full.get("rope_type", "default") != "default" or sliding.get("rope_type", "default") != "default":
        raise ModelFormatError(f"rope_parameters={dict(rp)}: minikv reads Gemma-3 with rope_type 'default' only")
    types = _layer_types(cfg, None, False) or gemma3_layer_types(cfg.integer("num_hidden_layers"),
                                                                 cfg.integer("sliding_window_pattern", 6))
    return dict(layer_types=types, sliding_window=cfg.integer("sliding_window", None), qk_norm=True,
                head_dim=cfg.integer("head_dim", None) or 256,
                rope_theta=full.number("rope_theta", cfg.number("rope_theta", 1_000_000.0)),
                sliding_rope_theta=sliding.number("rope_theta", cfg.number("rope_local_base_freq", 10_000.0)),
                **_gemma(cfg, (None, None)))


def _gpt_oss(cfg: Fields) -> dict:
    if not cfg.flag("attention_bias", True):
        raise ModelFormatError("attention_bias=false in config.json: minikv reads gpt-oss with its q/k/v/o biases")
    moe = MoEConfig(num_experts=cfg.integer("num_local_experts"), top_k=cfg.integer("num_experts_per_tok"),
                    intermediate_size=cfg.integer("intermediate_size"), router="topk_softmax", norm_topk_prob=False,
                    activation="gpt_oss", swiglu_limit=cfg.number("swiglu_limit", 7.0))
    return dict(layer_types=_layer_types(cfg, None, True), sliding_window=cfg.get("sliding_window", 128),
                qkv_bias=True, o_bias=True, sinks=True, moe=moe)


_FAMILY_OPTIONS = {"Qwen2ForCausalLM": _qwen2, "Qwen3ForCausalLM": _qwen3, "LlamaForCausalLM": _llama3,
                   "MistralForCausalLM": _mistral, "Gemma2ForCausalLM": _gemma2, "Gemma3ForCausalLM": _gemma3,
                   "GptOssForCausalLM": _gpt_oss}


def _deepseek_moe(cfg: Fields) -> MoEConfig:
    if cfg.get("topk_method", "noaux_tc") != "noaux_tc" or cfg.get("scoring_func", "sigmoid") != "sigmoid":
        raise ModelFormatError(f"topk_method={cfg.get('topk_method')!r}, scoring_func={cfg.get('scoring_func')!r}: "
                               "minikv routes DeepSeek-V3 as 'noaux_tc' with 'sigmoid' scores only")
    width = cfg.integer("moe_intermediate_size")
    return MoEConfig(num_experts=cfg.integer("n_routed_experts"), top_k=cfg.integer("num_experts_per_tok"),
                     intermediate_size=width, router="sigmoid_group",
                     norm_topk_prob=cfg.flag("norm_topk_prob", True),
                     routed_scaling_factor=cfg.number("routed_scaling_factor", 1.0),
                     n_group=cfg.integer("n_group", 1), topk_group=cfg.integer("topk_group", 1),
                     shared_intermediate_size=width * cfg.integer("n_shared_experts", 0, minimum=0),
                     router_dtype="float32")


# --- tensors -> weights ------------------------------------------------------------------------------


def family_layer(t, p: str, c: ModelConfig, arch: str, base) -> LayerWeights:
    """One GQA layer of a family: Llama's tensors plus the family's biases, norms and sinks."""
    h, d, a = c.hidden_size, c.head_dim, f"{p}.self_attn"
    gemma = arch in GEMMAS  # Gemma's RMSNorm multiplies by 1 + w (Gemma3RMSNorm): loaded so, in float32
    norm = (lambda name, n: np.float32(1.0) + t.get(name, (n,))) if gemma else (lambda name, n: t.get(name, (n,)))
    w = dict(attn_norm=norm(f"{p}.input_layernorm.weight", h), **base._gqa(t, p, c))
    if gemma:
        w.update(base._mlp(t, p, c, norm=norm(f"{p}.pre_feedforward_layernorm.weight", h)),
                 post_attn_norm=norm(f"{p}.post_attention_layernorm.weight", h),
                 post_mlp_norm=norm(f"{p}.post_feedforward_layernorm.weight", h))
    elif c.moe is not None:  # gpt-oss: the MLP is ModelWeights.moe
        w["mlp_norm"] = norm(f"{p}.post_attention_layernorm.weight", h)
    else:
        w.update(base._mlp(t, p, c))
    if c.qk_norm:
        w.update(q_norm=norm(f"{a}.q_norm.weight", d), k_norm=norm(f"{a}.k_norm.weight", d))
    if c.qkv_bias:
        w.update(bq=t.get(f"{a}.q_proj.bias", (c.num_heads * d,)), bk=t.get(f"{a}.k_proj.bias", (c.num_kv_heads * d,)),
                 bv=t.get(f"{a}.v_proj.bias", (c.num_kv_heads * d,)))
    if c.o_bias:
        w["bo"] = t.get(f"{a}.o_proj.bias", (h,))
    if c.sinks:
        w["sinks"] = t.get(f"{a}.sinks", (c.num_heads,))
    return LayerWeights(**w)


def _experts(t, name: str, want: tuple, e: int) -> np.ndarray:
    """A fused experts tensor, its leading dim checked against the config's expert count first."""
    if t.has(name):
        from safetensors import safe_open

        with safe_open(str(t.file_of[name]), framework="np") as f:
            got = f.get_slice(name).get_shape()
        if got and got[0] != e:
            raise ModelFormatError(f"tensor {name!r} holds {got[0]} experts; config.json says {e} "
                                   f"(n_routed_experts / num_local_experts)")
    return t.get(name, want)


def gpt_oss_moe(t, p: str, c: ModelConfig) -> MoEWeights:
    """gpt-oss's router and experts: gate_up_proj [E, H, 2I] with gate and up interleaved, biases on both."""
    m, h = c.moe, c.hidden_size
    e, i, x = m.num_experts, m.intermediate_size, f"{p}.mlp.experts"
    gu, gub = _experts(t, f"{x}.gate_up_proj", (e, h, 2 * i), e), t.get(f"{x}.gate_up_proj_bias", (e, 2 * i))
    return MoEWeights(router=np.ascontiguousarray(t.get(f"{p}.mlp.router.weight", (e, h)).T),
                      router_bias=t.get(f"{p}.mlp.router.bias", (e,)), gate=gu[..., ::2].copy(),
                      up=gu[..., 1::2].copy(),
                      down=_experts(t, f"{x}.down_proj", (e, i, h), e), gate_bias=gub[:, ::2].copy(),
                      up_bias=gub[:, 1::2].copy(), down_bias=t.get(f"{x}.down_proj_bias", (e, h)))


def deepseek_moe(t, p: str, c: ModelConfig) -> MoEWeights:
    """DeepSeek-V3's experts as save_pretrained writes them: one gate/up/down Linear per expert."""
    m, h = c.moe, c.hidden_size
    e, i, s = m.num_experts, m.intermediate_size, m.shared_intermediate_size
    x = f"{p}.mlp.experts"
    if t.has(f"{x}.{e}.gate_proj.weight"):
        raise ModelFormatError(f"tensor '{x}.{e}.gate_proj.weight' exists: the checkpoint has more experts than "
                               f"config.json's n_routed_experts={e}")
    stack = lambda kind, n_in, n_out: np.stack([t.linear(f"{x}.{j}.{kind}.weight", n_in, n_out)  # noqa: E731
                                                for j in range(e)])
    shared = {}
    if s:
        y = f"{p}.mlp.shared_experts"
        shared = dict(shared_gate=t.linear(f"{y}.gate_proj.weight", h, s),
                      shared_up=t.linear(f"{y}.up_proj.weight", h, s),
                      shared_down=t.linear(f"{y}.down_proj.weight", s, h))
    return MoEWeights(router=np.ascontiguousarray(t.get(f"{p}.mlp.gate.weight", (e, h)).T),
                      router_bias=t.get(f"{p}.mlp.gate.e_score_correction_bias", (e,)), gate=stack("gate_proj", h, i),
                      up=stack("up_proj", h, i), down=stack("down_proj", i, h), **shared)


def family_layers(t, arch: str, c: ModelConfig, cfg: dict, base) -> tuple[list, list | None]:
    """(layers, moe) of a family's checkpoint: ``ModelWeights.layers`` and ``ModelWeights.moe``."""
    prefixes = [f"model.layers.{i}" for i in range(c.num_layers)]
    if arch == "DeepseekV3ForCausalLM":
        bias = bool(cfg.get("attention_bias", False))
        layers = [base._deepseek_layer(t, p, c, bias, dense=not c.is_moe(i)) for i, p in enumerate(prefixes)]
        return layers, [deepseek_moe(t, p, c) if c.is_moe(i) else None for i, p in enumerate(prefixes)]
    layers = [family_layer(t, p, c, arch, base) for p in prefixes]
    return layers, None if c.moe is None else [gpt_oss_moe(t, p, c) for p in prefixes]
