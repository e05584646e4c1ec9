"""What a KV cache costs and what it saves: memory and FLOPs formulas, with model presets.

Everything here is exact integer arithmetic on a model's *shape*; nothing runs a
model. The formulas (all of them are also in ``docs/formulas.md``):

KV-cache bytes (multi-head, grouped-query and multi-query attention)::

    2 (K and V) x batch x layers x kv_heads x head_dim x (prompt + output) x dtype_bytes

Multi-head latent attention (MLA, DeepSeek-V2/V3) caches one compressed latent
of ``kv_lora_rank`` values plus one shared RoPE key of ``rope_dim`` values per
token and layer, for all heads together, and no separate V::

    batch x layers x (kv_lora_rank + rope_dim) x (prompt + output) x dtype_bytes

FLOPs count a multiply-add as 2 FLOPs. For one token that attends to ``ctx``
keys (itself included), one layer costs (H = hidden, Hq/Hkv = query/KV heads,
D = head_dim, I = MLP width)::

    projections    2 H (Hq + 2 Hkv) D  +  2 Hq D H      (q, k, v in; o out)
    scores         2 Hq D ctx                          (q . k for every key)
    weighted V     2 Hq D ctx                          (probabilities x V)
    MLP            2 x 3 H I  (SwiGLU: gate, up, down) or 2 x 2 H I (GELU: up, down)

and the output head adds ``2 H V`` per token whose logits are computed. Norms,
RoPE, softmax and residual adds are O(H) per token and are left out.

Without a cache, producing the token at position t means running the whole
prefix again: t + 1 tokens through every projection and MLP, plus causal
attention of every prefix position over its own prefix. With a cache only the
newest token runs. ``generation_flops`` and ``cache_speedup`` turn that into the
predicted speed-up that the step-2 notebook compares with a measured one.

Units: ``format_bytes`` prints decimal GB (10^9 bytes, what the seed articles
mostly mean by "GB") next to binary GiB (2^30 bytes).
"""

from __future__ import annotations

import dataclasses
import numbers
import textwrap
from dataclasses import dataclass

from minikv.errors import ConfigError, InvalidInputError

# --- dtypes ------------------------------------------------------------------------------------

DTYPE_BITS = {"fp32": 32, "fp16": 16, "bf16": 16, "fp8": 8, "int8": 8, "int4": 4}
QUANTIZED_DTYPES = ("fp8", "int8", "int4")  # the ones that may carry per-group scales


def _check_dtype(dtype: str) -> str:
    if dtype not in DTYPE_BITS:
        raise ConfigError(f"dtype={dtype!r} is not known; use one of {sorted(DTYPE_BITS)}")
    return dtype


def dtype_bytes(dtype: str) -> float:
    """Bytes per stored value: fp32 4, fp16/bf16 2, fp8/int8 1, int4 0.5 (no scale overhead)."""
    return DTYPE_BITS[_check_dtype(dtype)] / 8


def _check_group(dtype: str, group_size: int | None, scale_bytes: int) -> None:
    if group_size is None:
        return
    if dtype not in QUANTIZED_DTYPES:
        raise ConfigError(f"group_size={group_size} given for dtype={dtype!r}; per-group scales only "
                          f"apply to quantized dtypes {QUANTIZED_DTYPES}; drop group_size")
    if not _is_int(group_size) or group_size < 1:
        raise ConfigError(f"group_size={group_size!r} must be a positive integer (e.g. 32, 64, 128)")
    if not _is_int(scale_bytes) or scale_bytes < 1:
        raise ConfigError(f"scale_bytes={scale_bytes!r} must be a positive integer "
                          "(2 for one fp16 scale, 4 for an fp16 scale plus an fp16 zero point)")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _is_int(val) -> bool:
    return isinstance(val, numbers.Integral) and not isinstance(val, bool)


# --- model shapes ------------------------------------------------------------------------------

MLP_KINDS = ("swiglu", "gelu")
# the `minikv memory` flag that sets each field, for error messages
SHAPE_FLAGS = {"num_layers": "--layers", "num_kv_heads": "--kv-heads", "head_dim": "--head-dim",
               "hidden_size": "--hidden", "num_heads": "--heads", "intermediate_size": "--intermediate",
               "vocab_size": "--vocab"}
NORM_KINDS = ("rms", "layer")


@dataclass(frozen=True)
class ModelShape:
    """The numbers that decide a decoder's memory and FLOPs (one dataclass, nanoGPT style).

    Only ``num_layers`` plus either ``num_kv_heads`` and ``head_dim`` (MHA/GQA/MQA)
    or ``kv_lora_rank`` (MLA) are needed for the KV cache. Weights and FLOPs also
    need ``hidden_size``, ``num_heads``, ``intermediate_size`` and ``vocab_size``;
    a function that needs a missing one raises ``ConfigError`` naming it.

    Attention:
      * MHA: ``num_kv_heads == num_heads``; GQA: fewer KV heads, each shared by
        ``num_heads // num_kv_heads`` query heads; MQA: ``num_kv_heads == 1``.
      * MLA (``kv_lora_rank > 0``): ``head_dim`` is the per-head query/key dim
        without RoPE (DeepSeek's qk_nope_head_dim), ``rope_dim`` the decoupled
        RoPE dim, ``v_head_dim`` the value dim, ``q_lora_rank`` the query
        compression (0 = none). ``num_kv_heads`` plays no part in MLA's cache.
    MLP: ``mlp`` is "swiglu" (3 matrices) or "gelu" (2 matrices). Mixture of
    experts: ``num_experts`` routed experts of width ``moe_intermediate_size``,
    ``experts_per_token`` of them active, plus ``shared_experts`` always active;
    the first ``first_dense_layers`` layers keep a dense MLP of width
    ``intermediate_size``.
    Bookkeeping: ``bias`` (linear biases, GPT-style), ``norm`` ("rms" or
    "layer"), ``learned_positions`` (rows of a learned position table, 0 for
    RoPE), ``tie_embeddings`` (the output head reuses the embedding matrix).
    Provenance: ``source`` says where the numbers come from,
    ``published_params`` is the parameter count the source states, and
    ``max_context`` the longest context the model was built for.
    """

    name: str
    num_layers: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    hidden_size: int | None = None
    num_heads: int | None = None
    intermediate_size: int | None = None
    vocab_size: int | None = None
    mlp: str = "swiglu"
    tie_embeddings: bool = False
    bias: bool = False
    norm: str = "rms"
    learned_positions: int = 0
    kv_lora_rank: int = 0
    rope_dim: int = 0
    q_lora_rank: int = 0
    v_head_dim: int | None = None
    num_experts: int = 0
    experts_per_token: int = 0
    shared_experts: int = 0
    moe_intermediate_size: int = 0
    first_dense_layers: int = 0
    source: str = ""
    published_params: int | None = None
    max_context: int | None = None

    def __post_init__(self):
        def positive(name, allow_none=True, allow_zero=False):
            val = getattr(self, name)
            if val is None and allow_none:
                return
            ok = _is_int(val) and (val >= 0 if allow_zero else val >= 1)
            if not ok:
                want = "a non-negative" if allow_zero else "a positive"
                raise ConfigError(f"{self.name}: {name}={val!r} must be {want} integer")
            # NumPy integers become Python ints: products of sizes overflow int64 (uncached FLOPs reach 1e19)
            object.__setattr__(self, name, int(val))

        positive("num_layers", allow_none=False)
        for name in ("num_kv_heads", "head_dim", "hidden_size", "num_heads", "intermediate_size",
                     "vocab_size", "v_head_dim", "published_params", "max_context"):
            positive(name)
        for name in ("learned_positions", "kv_lora_rank", "rope_dim", "q_lora_rank", "num_experts",
                     "experts_per_token", "shared_experts", "moe_intermediate_size", "first_dense_layers"):
            positive(name, allow_none=False, allow_zero=True)
        if self.mlp not in MLP_KINDS:
            raise ConfigError(f"{self.name}: mlp={self.mlp!r}; use one of {MLP_KINDS}")
        if self.norm not in NORM_KINDS:
            raise ConfigError(f"{self.name}: norm={self.norm!r}; use one of {NORM_KINDS}")
        if not self.is_mla:
            missing = [n for n in ("num_kv_heads", "head_dim") if getattr(self, n) is None]
            if missing:
                raise ConfigError(f"{self.name}: the KV cache needs {missing} (or kv_lora_rank for MLA)")
            if self.num_heads is not None and self.num_heads % self.num_kv_heads:
                raise ConfigError(f"{self.name}: num_heads={self.num_heads} is not a multiple of "
                                  f"num_kv_heads={self.num_kv_heads}; each KV head serves a whole group")
        if self.num_experts:
            if not 1 <= self.experts_per_token <= self.num_experts:
                raise ConfigError(f"{self.name}: experts_per_token={self.experts_per_token} must be in "
                                  f"[1, num_experts={self.num_experts}]")
            if self.moe_intermediate_size < 1:
                raise ConfigError(f"{self.name}: a mixture of experts needs moe_intermediate_size > 0")
        if self.first_dense_layers > self.num_layers:
            raise ConfigError(f"{self.name}: first_dense_layers={self.first_dense_layers} > "
                              f"num_layers={self.num_layers}")

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def attention_kind(self) -> str:
        """"MLA", "MHA", "MQA" or "GQA" (the last two need ``num_heads``)."""
        if self.is_mla:
            return "MLA"
        if self.num_heads is None or self.num_kv_heads == self.num_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"

    def need(self, *names: str, what: str = "this") -> None:
        """Raise ConfigError if any of ``names`` is None."""
        missing = [n for n in names if getattr(self, n) is None]
        if missing:
            flags = ", ".join(SHAPE_FLAGS.get(n, n) for n in missing)
            raise ConfigError(f"{self.name}: {what} needs {missing}; pick a preset or give them ({flags})")

    def replace(self, **changes) -> "ModelShape":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    # derived dimensions
    @property
    def _v_dim(self) -> int:
        return self.v_head_dim if self.v_head_dim is not None else self.head_dim

    def _is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer >= self.first_dense_layers


def shape_from_config(config, name: str = "model") -> ModelShape:
    """The ``ModelShape`` of a ``minikv.model.ModelConfig`` (a Llama-style SwiGLU decoder with RMSNorm)."""
    c = config
    return ModelShape(name=name, num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                      hidden_size=c.hidden_size, num_heads=c.num_heads, intermediate_size=c.intermediate_size,
                      vocab_size=c.vocab_size, tie_embeddings=c.tie_embeddings, max_context=c.max_position)


# --- presets -------------------------------------------------------------------------------------

_PRESET_LIST = (
    ModelShape(
        name="gpt3-175b", num_layers=96, hidden_size=12288, num_heads=96, num_kv_heads=96, head_dim=128,
        intermediate_size=4 * 12288, vocab_size=50257, mlp="gelu", tie_embeddings=True, bias=True,
        norm="layer", learned_positions=2048, max_context=2048, published_params=175_000_000_000,
        source=("Brown et al. 2020, 'Language Models are Few-Shot Learners', arXiv:2005.14165, Table 2.1 "
                "(n_layers 96, d_model 12288, n_heads 96, d_head 128, n_ctx 2048); GPT-2 architecture "
                "(Radford et al. 2019): d_ff = 4 d_model, GELU MLP, LayerNorm, biases, learned positions, "
                "50257-token BPE vocabulary with tied input/output embeddings")),
    ModelShape(
        name="llama2-7b", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=32, head_dim=128,
        intermediate_size=11008, vocab_size=32000, max_context=4096, published_params=7_000_000_000,
        source=("https://huggingface.co/meta-llama/Llama-2-7b-hf/blob/main/config.json; Touvron et al. 2023, "
                "'Llama 2', arXiv:2307.09288, Table 1 (7B: MHA, context 4k)")),
    ModelShape(
        name="llama2-13b", num_layers=40, hidden_size=5120, num_heads=40, num_kv_heads=40, head_dim=128,
        intermediate_size=13824, vocab_size=32000, max_context=4096, published_params=13_000_000_000,
        source=("https://huggingface.co/meta-llama/Llama-2-13b-hf/blob/main/config.json; "
                "Touvron et al. 2023, 'Llama 2', arXiv:2307.09288, Table 1 (13B: MHA, context 4k)")),
    ModelShape(
        name="llama3-8b", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
        intermediate_size=14336, vocab_size=128256, max_context=8192, published_params=8_000_000_000,
        source=("https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json "
                "(32 layers, 32 query heads, 8 KV heads: GQA); Llama Team 2024, "
                "'The Llama 3 Herd of Models', arXiv:2407.21783, Table 3")),
    ModelShape(
        name="deepseek-7b", num_layers=30, hidden_size=4096, num_heads=32, num_kv_heads=32, head_dim=128,
        intermediate_size=11008, vocab_size=102400, max_context=4096, published_params=7_000_000_000,
        source=("https://huggingface.co/deepseek-ai/deepseek-llm-7b-base/blob/main/config.json "
                "(num_hidden_layers 30, hidden 4096, 32 heads, 32 KV heads, max_position_embeddings 4096); "
                "DeepSeek-AI 2024, 'DeepSeek LLM', arXiv:2401.02954, Table 2. "
                "Note: 30 layers, not the 32 some articles assume")),
    ModelShape(
        name="deepseek-v3", num_layers=61, hidden_size=7168, num_heads=128, num_kv_heads=128, head_dim=128,
        intermediate_size=18432, vocab_size=129280, kv_lora_rank=512, rope_dim=64, q_lora_rank=1536,
        v_head_dim=128, num_experts=256, experts_per_token=8, shared_experts=1, moe_intermediate_size=2048,
        first_dense_layers=3, max_context=163840, published_params=671_000_000_000,
        source=("https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json and "
                "inference/configs/config_671B.json (61 layers, hidden 7168, 128 heads, kv_lora_rank 512, "
                "qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128, q_lora_rank 1536, 256 routed + 1 "
                "shared experts of width 2048, 8 active, first 3 layers dense of width 18432); DeepSeek-AI "
                "2024, 'DeepSeek-V3 Technical Report', arXiv:2412.19437, Sec. 2.1 and 4.2 (671B total, 37B "
                "active; the 14B multi-token-prediction module is not counted)")),
    ModelShape(
        name="smollm2-135m", num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64,
        intermediate_size=1536, vocab_size=49152, tie_embeddings=True, max_context=8192,
        published_params=135_000_000,
        source=("https://huggingface.co/HuggingFaceTB/SmolLM2-135M/blob/main/config.json; "
                "the same shapes are in the SmolLM2-135M-Instruct GGUF that minikv runs "
                "(llama.block_count 30, head_count 9, head_count_kv 3, embedding_length 576, "
                "feed_forward_length 1536)")),
)
PRESETS: dict[str, ModelShape] = {shape.name: shape for shape in _PRESET_LIST}


def get_preset(name: str) -> ModelShape:
    """The preset called ``name`` (see ``PRESETS``); ConfigError lists the choices otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)} "
                          "or describe the model with shape flags") from None


# --- KV-cache memory -----------------------------------------------------------------------------

def _kv_vectors_per_layer(shape: ModelShape) -> list[tuple[int, int]]:
    """(count, length) of the vectors one token stores in one layer's cache.

    MHA/GQA/MQA: 2 Hkv vectors (a K and a V per KV head) of head_dim values.
    MLA: one latent of kv_lora_rank values and one RoPE key of rope_dim values.
    """
    if shape.is_mla:
        return [(1, shape.kv_lora_rank)] + ([(1, shape.rope_dim)] if shape.rope_dim else [])
    return [(2 * shape.num_kv_heads, shape.head_dim)]


def kv_values_per_token(shape: ModelShape) -> int:
    """Values cached per token over all layers: 2 L Hkv D, or L (kv_lora_rank + rope_dim) for MLA."""
    return shape.num_layers * sum(count * length for count, length in _kv_vectors_per_layer(shape))


def expanded_kv_values_per_token(shape: ModelShape) -> int:
    """Values per token if the model cached full per-head K and V (what MLA avoids).

    For MLA that is L x Hq x (key dim head_dim + rope_dim, plus value dim v_head_dim):
    the cache an MHA model with the same heads would need. For other models it
    equals ``kv_values_per_token``.
    """
    if not shape.is_mla:
        return kv_values_per_token(shape)
    shape.need("num_heads", what="the expanded MHA cache")
    return shape.num_layers * shape.num_heads * (shape.head_dim + shape.rope_dim + shape._v_dim)


def _check_count(name: str, val, minimum: int) -> int:
    if not _is_int(val) or val < minimum:
        raise InvalidInputError(f"{name}={val!r} must be an integer >= {minimum}")
    return int(val)


def kv_cache_bytes(shape: ModelShape, batch: int = 1, prompt_len: int = 0, output_len: int = 0,
                   dtype: str = "fp16", group_size: int | None = None, scale_bytes: int = 2) -> int:
    """Bytes of K and V for ``batch`` sequences of ``prompt_len + output_len`` tokens.

        2 x batch x layers x kv_heads x head_dim x (prompt + output) x dtype_bytes    (MHA/GQA/MQA)
        batch x layers x (kv_lora_rank + rope_dim) x (prompt + output) x dtype_bytes  (MLA)

    ``group_size``: for quantized dtypes (fp8, int8, int4), also count one scale of
    ``scale_bytes`` bytes per group of ``group_size`` values within each cached
    vector (a K or V head vector, an MLA latent). Default: no scale overhead,
    which is what the seed articles' formulas assume. Example: int8 with fp16
    scales per 64 values adds 2/64 bytes per value (3%). A partial last group
    still needs a whole scale. Packed sub-byte totals are rounded up to whole bytes.
    """
    _check_dtype(dtype)
    _check_group(dtype, group_size, scale_bytes)
    batch = _check_count("batch", batch, 1)
    prompt_len = _check_count("prompt_len", prompt_len, 0)
    output_len = _check_count("output_len", output_len, 0)
    tokens = batch * (prompt_len + output_len)
    bits = tokens * kv_values_per_token(shape) * DTYPE_BITS[dtype]
    if group_size is not None:
        group_size, scale_bytes = int(group_size), int(scale_bytes)
        groups = shape.num_layers * sum(count * _ceil_div(length, group_size)
                                        for count, length in _kv_vectors_per_layer(shape))
        bits += tokens * groups * scale_bytes * 8
    return _ceil_div(bits, 8)


def kv_bytes_per_token(shape: ModelShape, dtype: str = "fp16", group_size: int | None = None,
                       scale_bytes: int = 2) -> int:
    """Bytes one token of one sequence adds to the cache, over all layers."""
    return kv_cache_bytes(shape, 1, 1, 0, dtype, group_size, scale_bytes)


# --- parameters and weights ----------------------------------------------------------------------

def _attention_params(s: ModelShape) -> int:
    h, hq = s.hidden_size, s.num_heads
    if s.is_mla:
        qk = s.head_dim + s.rope_dim  # each query head: a non-rotated part and a rotated part
        if s.q_lora_rank:
            q = h * s.q_lora_rank + s.q_lora_rank + s.q_lora_rank * hq * qk  # down, its RMSNorm, up
        else:
            q = h * hq * qk
        kv = h * (s.kv_lora_rank + s.rope_dim) + s.kv_lora_rank  # down to latent + RoPE key, latent RMSNorm
        kv += s.kv_lora_rank * hq * (s.head_dim + s._v_dim)  # latent up to per-head K (no RoPE) and V
        return q + kv + hq * s._v_dim * h
    d, hkv = s.head_dim, s.num_kv_heads
    p = h * hq * d + 2 * h * hkv * d + hq * d * h
    if s.bias:
        p += hq * d + 2 * hkv * d + h
    return p


def _dense_mlp_params(s: ModelShape, width: int) -> int:
    mats = 3 if s.mlp == "swiglu" else 2
    p = mats * s.hidden_size * width
    if s.bias:
        p += (mats - 1) * width + s.hidden_size
    return p


def _mlp_params(s: ModelShape, layer: int, active: bool) -> int:
    if not s._is_moe_layer(layer):
        return _dense_mlp_params(s, s.intermediate_size)
    experts = (s.experts_per_token if active else s.num_experts) + s.shared_experts
    router = s.num_experts * s.hidden_size
    return experts * _dense_mlp_params(s, s.moe_intermediate_size) + router


def param_count(shape: ModelShape, active: bool = False) -> dict:
    """Parameter count by part, computed from the shapes.

    Returns ``{"embedding", "positions", "attention", "mlp", "norms", "lm_head", "total"}``.
    ``active=True`` counts only the experts one token uses (MoE). The output head
    is 0 when tied to the embedding. Attention and MLP are summed over layers.
    """
    s = shape
    s.need("hidden_size", "num_heads", "intermediate_size", "vocab_size", what="the parameter count")
    if s.is_moe and s.moe_intermediate_size < 1:
        raise ConfigError(f"{s.name}: a mixture of experts needs moe_intermediate_size")
    h = s.hidden_size
    norm_vec = h if s.norm == "rms" else 2 * h  # RMSNorm has a scale; LayerNorm a scale and a shift
    parts = {
        "embedding": s.vocab_size * h,
        "positions": s.learned_positions * h,
        "attention": s.num_layers * _attention_params(s),
        "mlp": sum(_mlp_params(s, layer, active) for layer in range(s.num_layers)),
        "norms": (2 * s.num_layers + 1) * norm_vec,
        "lm_head": 0 if s.tie_embeddings else s.vocab_size * h,
    }
    parts["total"] = sum(parts.values())
    return parts


def weights_bytes(shape: ModelShape, dtype: str = "fp16", active: bool = False) -> int:
    """Parameter count x dtype bytes (no quantization scale overhead), rounded up to whole bytes."""
    return _ceil_div(param_count(shape, active)["total"] * DTYPE_BITS[_check_dtype(dtype)], 8)


# --- FLOPs ------------------------------------------------------------------------------------------

FLOP_PARTS = ("projections", "scores", "weighted_v", "mlp")


def _attended_keys(num_tokens: int, past: int, dense_mask: bool) -> int:
    """Sum over the new tokens of the number of keys each one is scored against.

    Causal: new token i (0-based) sees past + i + 1 keys, so the sum is
    n past + n (n + 1) / 2. ``dense_mask``: an implementation that computes the
    whole n x (past + n) score block and masks it afterwards (like step 1's
    ``causal_attention``) pays for n (past + n) scores.
    """
    n = num_tokens
    return n * (past + n) if dense_mask else n * past + n * (n + 1) // 2


def _layer_rates(s: ModelShape, layer: int) -> dict:
    """FLOPs of one layer per new token (projections, mlp) and per attended key (scores, weighted_v)."""
    h, hq = s.hidden_size, s.num_heads
    if s.is_mla:
        r, dr, dn, dv = s.kv_lora_rank, s.rope_dim, s.head_dim, s._v_dim
        if s.q_lora_rank:
            q = 2 * h * s.q_lora_rank + 2 * s.q_lora_rank * hq * (dn + dr)
        else:
            q = 2 * h * hq * (dn + dr)
        proj = q + 2 * h * (r + dr) + 2 * hq * dn * r + 2 * hq * r * dv + 2 * hq * dv * h
        scores, weighted = 2 * hq * (r + dr), 2 * hq * r
    else:
        d, hkv = s.head_dim, s.num_kv_heads
        proj = 2 * h * (hq + 2 * hkv) * d + 2 * hq * d * h
        scores = weighted = 2 * hq * d
    mats = 3 if s.mlp == "swiglu" else 2
    if s._is_moe_layer(layer):
        experts = s.experts_per_token + s.shared_experts
        mlp = experts * 2 * mats * h * s.moe_intermediate_size + 2 * h * s.num_experts
    else:
        mlp = 2 * mats * h * s.intermediate_size
    return {"projections": proj, "scores": scores, "weighted_v": weighted, "mlp": mlp}


def _model_rates(s: ModelShape) -> dict:
    """``_layer_rates`` summed over all layers."""
    s.need("hidden_size", "num_heads", "intermediate_size", "vocab_size", "head_dim", what="FLOPs")
    total = dict.fromkeys(FLOP_PARTS, 0)
    for layer in range(s.num_layers):
        for k, v in _layer_rates(s, layer).items():
            total[k] += v
    return total


def _combine(rates: dict, tokens: int, keys: int) -> dict:
    """Rates x counts: projections and MLP scale with tokens, scores and weighted V with keys."""
    return {"projections": rates["projections"] * tokens, "scores": rates["scores"] * keys,
            "weighted_v": rates["weighted_v"] * keys, "mlp": rates["mlp"] * tokens}


def layer_flops(shape: ModelShape, layer: int = 0, num_tokens: int = 1, past: int = 0,
                dense_mask: bool = False) -> dict:
    """FLOPs of one layer for ``num_tokens`` new tokens after ``past`` cached ones.

    Per new token (multiply-add = 2 FLOPs; H hidden, Hq/Hkv heads, D head_dim, I MLP width):

        projections  2 H (Hq + 2 Hkv) D + 2 Hq D H
        scores       2 Hq D x keys        (keys = tokens this token attends to, itself included)
        weighted_v   2 Hq D x keys
        mlp          2 x 3 H I (SwiGLU) or 2 x 2 H I (GELU); MoE: active experts x that + router 2 H E

    Query heads, not KV heads, set the attention cost: GQA shrinks the cache
    and the K/V projections but every query head still scores every key.
    MLA is counted in its absorbed form (what a cached decode runs, step 4): the
    query is mapped into latent space (2 Hq D r), scores are dot products with
    the cached latent and RoPE key (2 Hq (r + dr) per key), the probabilities
    weight the latent (2 Hq r per key), and the result goes up to V and out
    (2 Hq r Dv + 2 Hq Dv H); plus the down-projections 2 H (r + dr) and the
    query path.
    Returns ``{"projections", "scores", "weighted_v", "mlp", "total"}``.
    """
    shape.need("hidden_size", "num_heads", "intermediate_size", "head_dim", what="FLOPs")
    num_tokens = _check_count("num_tokens", num_tokens, 1)
    past = _check_count("past", past, 0)
    if not _is_int(layer) or not 0 <= layer < shape.num_layers:
        raise InvalidInputError(f"layer={layer!r} out of range [0, {shape.num_layers})")
    out = _combine(_layer_rates(shape, layer), num_tokens, _attended_keys(num_tokens, past, dense_mask))
    out["total"] = sum(out.values())
    return out


def _forward(rates: dict, shape: ModelShape, num_tokens: int, past: int, logit_rows: int,
             dense_mask: bool) -> dict:
    out = _combine(rates, num_tokens, _attended_keys(num_tokens, past, dense_mask))
    out["lm_head"] = logit_rows * 2 * shape.hidden_size * shape.vocab_size
    out["total"] = sum(out.values())
    return out


def forward_flops(shape: ModelShape, num_tokens: int, past: int = 0, logits: str = "last",
                  dense_mask: bool = False) -> dict:
    """FLOPs of one forward pass of one sequence: ``num_tokens`` new tokens after ``past`` cached.

    Sums ``layer_flops`` over the layers and adds the output head: 2 H V per
    token whose logits are computed (``logits="last"``: one, as generation
    does; ``"all"``: every new token). Returns the parts of ``layer_flops``
    plus ``"lm_head"`` and ``"total"``.
    """
    if logits not in ("last", "all"):
        raise InvalidInputError(f"logits={logits!r}; use 'last' (one row, as generation does) or 'all'")
    num_tokens = _check_count("num_tokens", num_tokens, 1)
    past = _check_count("past", past, 0)
    rows = 1 if logits == "last" else num_tokens
    return _forward(_model_rates(shape), shape, num_tokens, past, rows, dense_mask)


def decode_flops(shape: ModelShape, context: int, dense_mask: bool = False) -> dict:
    """With a cache: one token at position ``context - 1`` attends to ``context`` keys."""
    context = _check_count("context", context, 1)
    return forward_flops(shape, 1, past=context - 1, dense_mask=dense_mask)


def recompute_flops(shape: ModelShape, context: int, dense_mask: bool = False) -> dict:
    """Without a cache: the token at position ``context - 1`` needs all ``context`` tokens run again."""
    context = _check_count("context", context, 1)
    return forward_flops(shape, context, past=0, dense_mask=dense_mask)


def generation_flops(shape: ModelShape, prompt_len: int, new_tokens: int, cache: bool = True,
                     dense_mask: bool = False) -> int:
    """Total FLOPs to generate ``new_tokens`` tokens after a prompt of ``prompt_len`` (one sequence).

    The loop of ``minikv.generate``: the prompt's forward pass yields the first
    new token; each further token needs one more pass.
      * cache=True:  prefill of prompt_len tokens, then new_tokens - 1 decode
        steps of one token each (the k-th sees prompt_len + k keys).
      * cache=False: the k-th new token (k = 0..new_tokens-1) needs a forward
        pass over all prompt_len + k tokens, recomputing every K and V.
    Each pass computes logits for its last token only.
    """
    prompt_len = _check_count("prompt_len", prompt_len, 1)
    new_tokens = _check_count("new_tokens", new_tokens, 0)
    if new_tokens == 0:
        return 0
    rates = _model_rates(shape)
    if cache:
        passes = [(prompt_len, 0)] + [(1, prompt_len + k - 1) for k in range(1, new_tokens)]
    else:
        passes = [(prompt_len + k, 0) for k in range(new_tokens)]
    return sum(_forward(rates, shape, n, past, 1, dense_mask)["total"] for n, past in passes)


def cache_speedup(shape: ModelShape, prompt_len: int, new_tokens: int, dense_mask: bool = False) -> float:
    """Predicted FLOP ratio (no cache) / (cache) for a whole generation."""
    new_tokens = _check_count("new_tokens", new_tokens, 1)
    return (generation_flops(shape, prompt_len, new_tokens, False, dense_mask)
            / generation_flops(shape, prompt_len, new_tokens, True, dense_mask))


def arithmetic_intensity(shape: ModelShape, num_tokens: int, past: int = 0, batch: int = 1,
                         weights_dtype: str = "fp16", kv_dtype: str = "fp16") -> float:
    """FLOPs per byte moved for one forward step of ``batch`` sequences.

    Bytes = the weights read once (for MoE only the experts one token uses, a
    lower bound) + every sequence's K/V read and written
    (``past + num_tokens`` tokens each). Activations are ignored. Decode
    (num_tokens = 1, batch 1) lands near 1 FLOP/byte in fp16, far below what a
    GPU can do per byte of bandwidth (hundreds), so decode is memory-bound;
    a long prefill reuses each weight for every prompt token and is compute-bound.
    """
    batch = _check_count("batch", batch, 1)
    flops = batch * forward_flops(shape, num_tokens, past)["total"]
    moved = (weights_bytes(shape, weights_dtype, active=True)
             + kv_cache_bytes(shape, batch, past + num_tokens, 0, kv_dtype))
    return flops / moved


# --- reports and units ---------------------------------------------------------------------------

def _scaled(n: float, base: int, units: tuple) -> str:
    for i in range(len(units) - 1, 0, -1):
        if n >= base ** i:
            return f"{n / base ** i:,.2f} {units[i]}"
    return f"{n:,.0f} {units[0]}"


def format_bytes(n: float) -> str:
    """'164.28 GB (153.00 GiB)': decimal GB (10^9) first, binary GiB (2^30) in brackets."""
    dec = _scaled(n, 1000, ("B", "kB", "MB", "GB", "TB"))
    return dec if n < 1000 else f"{dec} ({_scaled(n, 1024, ('B', 'KiB', 'MiB', 'GiB', 'TiB'))})"


def format_count(n: float, unit: str = "") -> str:
    """SI prefixes: 3.49e11 -> '349.0 G' (+ unit)."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:,.1f} {prefix}{unit}"
    return f"{n:,.0f} {unit}".rstrip()


def memory_report(shape: ModelShape, batch: int = 1, prompt_len: int = 1024, output_len: int = 0,
                  dtype: str = "fp16", weights_dtype: str | None = None, group_size: int | None = None,
                  scale_bytes: int = 2) -> dict:
    """Everything ``minikv memory`` prints, as a JSON-ready dict (None where the shape lacks a field).

    FLOPs are per sequence, for the last token of the run (position
    prompt + output - 1): with the cache it attends to the cached context; without
    it the whole context is run again. ``generation`` covers producing the
    ``output_len`` new tokens after the prompt.
    """
    weights_dtype = weights_dtype or dtype
    tokens = prompt_len + output_len
    rep = {
        "model": shape.name,
        "attention": shape.attention_kind,
        "source": shape.source,
        "batch": batch, "prompt_len": prompt_len, "output_len": output_len, "tokens_per_sequence": tokens,
        "dtype": dtype, "dtype_bytes": dtype_bytes(dtype), "group_size": group_size,
        "scale_bytes": scale_bytes if group_size else None,
        "kv_values_per_token": kv_values_per_token(shape),
        "kv_bytes_per_token": kv_bytes_per_token(shape, dtype, group_size, scale_bytes),
        "kv_cache_bytes": kv_cache_bytes(shape, batch, prompt_len, output_len, dtype, group_size,
                                         scale_bytes),
        "weights_dtype": weights_dtype,
        "params": None, "active_params": None, "published_params": shape.published_params,
        "weights_bytes": None, "kv_to_weights": None,
        "max_context": shape.max_context,
        "beyond_max_context": bool(shape.max_context and tokens > shape.max_context),
        "flops_context": tokens, "flops_with_cache": None, "flops_without_cache": None,
        "flops_per_layer_with_cache": None, "generation": None,
    }
    if shape.is_mla and shape.num_heads is not None and shape.head_dim is not None:
        rep["expanded_kv_values_per_token"] = expanded_kv_values_per_token(shape)
    complete = all(getattr(shape, n) is not None
                   for n in ("hidden_size", "num_heads", "intermediate_size", "vocab_size", "head_dim"))
    if not complete:
        return rep
    rep["params"] = param_count(shape)["total"]
    rep["active_params"] = param_count(shape, active=True)["total"]
    rep["weights_bytes"] = weights_bytes(shape, weights_dtype)
    rep["kv_to_weights"] = rep["kv_cache_bytes"] / rep["weights_bytes"]
    if tokens >= 1:
        rep["flops_with_cache"] = decode_flops(shape, tokens)
        rep["flops_without_cache"] = recompute_flops(shape, tokens)
        rep["flops_per_layer_with_cache"] = {k: rep["flops_with_cache"][k] / shape.num_layers
                                             for k in FLOP_PARTS}
    if prompt_len >= 1 and output_len >= 1:
        cached = generation_flops(shape, prompt_len, output_len, cache=True)
        uncached = generation_flops(shape, prompt_len, output_len, cache=False)
        rep["generation"] = {"new_tokens": output_len, "flops_with_cache": cached,
                             "flops_without_cache": uncached, "speedup": uncached / cached}
    return rep


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}" + ("" if n == 1 else "s")


def _table(rows: list[tuple], header: tuple) -> list[str]:
    """Left-align the first column, right-align the others."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    out = []
    for r in [header, *rows]:
        cells = [str(r[0]).ljust(widths[0])] + [str(r[i]).rjust(widths[i]) for i in range(1, len(r))]
        out.append("  " + "   ".join(cells).rstrip())
    return out


def render_report(rep: dict, shape: ModelShape) -> str:
    """The human-readable table of ``minikv memory`` for a ``memory_report`` dict."""
    s = shape
    lines = [f"minikv memory: {rep['model']} ({rep['attention']})"]
    if rep["source"]:
        lines += textwrap.wrap(rep["source"], 100, initial_indent="  source: ", subsequent_indent=" " * 10,
                               break_on_hyphens=False)
    if s.is_mla:
        attn = f"MLA latent {s.kv_lora_rank} + RoPE key {s.rope_dim} cached per token and layer"
        attn += f", {s.num_heads} query heads" if s.num_heads else ""
    else:
        attn = f"{s.num_heads} query heads, " if s.num_heads else ""
        attn += f"{s.num_kv_heads} KV heads x head_dim {s.head_dim}"
    dims = [f"{s.num_layers} layers", attn]
    if s.hidden_size:
        dims.append(f"hidden {s.hidden_size}")
    if s.is_moe:
        dims.append(f"MoE {s.experts_per_token}+{s.shared_experts} of {s.num_experts} experts x "
                    f"{s.moe_intermediate_size} (first {s.first_dense_layers} layers dense, "
                    f"{s.intermediate_size})")
    elif s.intermediate_size:
        dims.append(f"MLP {s.intermediate_size} ({s.mlp})")
    if s.vocab_size:
        dims.append(f"vocab {s.vocab_size}")
    lines += textwrap.wrap(", ".join(dims), 100, initial_indent="  shape:  ", subsequent_indent=" " * 10)
    group = f", +{rep['scale_bytes']} B scale per {rep['group_size']} values" if rep["group_size"] else ""
    lines.append(f"  run:    batch {rep['batch']} x (prompt {rep['prompt_len']} + output {rep['output_len']})"
                 f" = {_plural(rep['tokens_per_sequence'], 'token')} per sequence")
    lines.append(f"          KV cache in {rep['dtype']} ({rep['dtype_bytes']:g} B/value{group}), "
                 f"weights in {rep['weights_dtype']}")
    if rep["beyond_max_context"]:
        lines.append(f"  note:   {rep['tokens_per_sequence']} tokens is beyond this model's "
                     f"max context of {rep['max_context']}")
    lines.append("")

    def mem_row(label, n):
        return (label, f"{n:,}", _scaled(n, 1000, ("B", "kB", "MB", "GB", "TB")),
                _scaled(n, 1024, ("B", "KiB", "MiB", "GiB", "TiB")))

    rows = [mem_row("KV cache per token (one sequence)", rep["kv_bytes_per_token"]),
            mem_row("KV cache total", rep["kv_cache_bytes"])]
    if rep["weights_bytes"] is not None:
        label = f"weights ({format_count(rep['params'])} params"
        if rep["active_params"] != rep["params"]:
            label += f", {format_count(rep['active_params'])} active"
        rows.append(mem_row(label + ")", rep["weights_bytes"]))
    lines += _table(rows, ("memory", "bytes", "decimal", "binary"))
    if rep["kv_to_weights"] is not None:
        lines.append(f"  KV cache / weights = {rep['kv_to_weights']:.3f}")
    if "expanded_kv_values_per_token" in rep:
        ratio = rep["expanded_kv_values_per_token"] / rep["kv_values_per_token"]
        lines.append(f"  MLA caches {rep['kv_values_per_token']:,} values per token; full per-head K and V "
                     f"would be {rep['expanded_kv_values_per_token']:,} ({ratio:.1f}x more)")
    if rep["flops_with_cache"] is None:
        if rep["params"] is None:
            lines.append("  (weights and FLOPs need the whole shape: --hidden, --heads, --intermediate, "
                         "--vocab)")
        return "\n".join(lines)

    ctx = rep["flops_context"]
    lines += ["", f"FLOPs for the token at position {ctx - 1} of one sequence (multiply-add = 2 FLOPs)"]
    with_c, without = rep["flops_with_cache"], rep["flops_without_cache"]
    per_layer = dict(rep["flops_per_layer_with_cache"])
    per_layer["total"] = sum(per_layer.values())
    labels = {"projections": "projections (q, k, v, o)", "scores": f"attention scores ({ctx} keys)",
              "weighted_v": "attention-weighted V", "mlp": "MLP", "lm_head": "lm_head (one row of logits)",
              "total": "total"}
    rows = []
    for k, label in labels.items():
        pl = format_count(per_layer[k], "FLOP") if k in per_layer else "-"
        rows.append((label, pl, format_count(with_c[k], "FLOP"), format_count(without[k], "FLOP")))
    mean = " (mean)" if s.is_moe else ""
    lines += _table(rows, ("", f"cached, per layer{mean}", f"cached, {s.num_layers} layers",
                           f"no cache (rerun {ctx} tokens)"))
    ratio = without["total"] / with_c["total"]
    lines.append(f"  this token costs {ratio:,.1f}x more FLOPs without the cache")
    gen = rep["generation"]
    if gen:
        lines += ["", f"generating {_plural(gen['new_tokens'], 'token')} after a {rep['prompt_len']}-token prompt, "
                      "one sequence:",
                  f"  {format_count(gen['flops_with_cache'], 'FLOP')} with the cache, "
                  f"{format_count(gen['flops_without_cache'], 'FLOP')} without: "
                  f"{gen['speedup']:,.1f}x more work without it"]
    return "\n".join(lines)
