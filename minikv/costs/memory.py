"""Memory: KV-cache bytes, parameter counts and weight bytes.

KV-cache bytes (multi-head, grouped-query and multi-query attention)::

    2 (K and V) x batch x layers x kv_heads x head_dim x (prompt + output) x dtype_bytes

Multi-head latent attention (MLA, DeepSeek-V2/V3) caches one compressed latent
of ``kv_lora_rank`` values plus one shared RoPE key of ``rope_dim`` values per
token and layer, for all heads together, and no separate V::

    batch x layers x (kv_lora_rank + rope_dim) x (prompt + output) x dtype_bytes

Parameters are counted matrix by matrix from the shape (``param_count``), and
weight bytes are that count times the dtype's bytes.
"""

from __future__ import annotations

from minikv.costs.shape import DTYPE_BITS, QUANTIZED_DTYPES, ModelShape, check_dtype
from minikv.errors import ConfigError, InvalidInputError, check_int
from minikv.paged.allocator import ceil_div


def check_count(name: str, val, minimum: int) -> int:
    """``val`` as a Python int >= ``minimum``, else InvalidInputError naming ``name``."""
    return check_int(name, val, minimum=minimum, error=InvalidInputError)


def _check_group(dtype: str, group_size: int | None, scale_bytes: int) -> None:
    if group_size is None:
        return
    if dtype not in QUANTIZED_DTYPES:
        raise ConfigError(f"group_size={group_size} given for dtype={dtype!r}; per-group scales only "
                          f"apply to quantized dtypes {QUANTIZED_DTYPES}; drop group_size")
    check_int("group_size", group_size, hint="e.g. 32, 64, 128")
    check_int("scale_bytes", scale_bytes,
              hint="2 for one fp16 scale, 4 for an fp16 scale plus an fp16 zero point")


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
    return shape.num_layers * shape.num_heads * (shape.head_dim + shape.rope_dim + shape.v_dim)


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
    check_dtype(dtype)
    _check_group(dtype, group_size, scale_bytes)
    batch = check_count("batch", batch, 1)
    prompt_len = check_count("prompt_len", prompt_len, 0)
    output_len = check_count("output_len", output_len, 0)
    tokens = batch * (prompt_len + output_len)
    bits = tokens * kv_values_per_token(shape) * DTYPE_BITS[dtype]
    if group_size is not None:
        group_size, scale_bytes = int(group_size), int(scale_bytes)
        groups = shape.num_layers * sum(count * ceil_div(length, group_size)
                                        for count, length in _kv_vectors_per_layer(shape))
        bits += tokens * groups * scale_bytes * 8
    return ceil_div(bits, 8)


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
        kv += s.kv_lora_rank * hq * (s.head_dim + s.v_dim)  # latent up to per-head K (no RoPE) and V
        return q + kv + hq * s.v_dim * h
    d, hkv = s.head_dim, s.num_kv_heads
    p = h * hq * d + 2 * h * hkv * d + hq * d * h
    if s.bias:
        p += hq * d + 2 * hkv * d + h
    return p


def _dense_mlp_params(s: ModelShape, width: int) -> int:
    mats = s.mlp_matrices
    p = mats * s.hidden_size * width
    if s.bias:
        p += (mats - 1) * width + s.hidden_size
    return p


def _mlp_params(s: ModelShape, layer: int, active: bool) -> int:
    if not s.is_moe_layer(layer):
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
        "mlp": sum(_mlp_params(s, layer, active) * count for layer, count in s.layer_runs()),
        "norms": (2 * s.num_layers + 1) * norm_vec,
        "lm_head": 0 if s.tie_embeddings else s.vocab_size * h,
    }
    parts["total"] = sum(parts.values())
    return parts


def weights_bytes(shape: ModelShape, dtype: str = "fp16", active: bool = False) -> int:
    """Parameter count x dtype bytes (no quantization scale overhead), rounded up to whole bytes."""
    return ceil_div(param_count(shape, active)["total"] * DTYPE_BITS[check_dtype(dtype)], 8)



# --- the quantized KV formats of minikv.quant (step 5) --------------------------------------------

# kv_dtype -> ((dtype, group, scale_bytes) of K, of V); group None: no scales, "G": the chosen group.
# q8_0/q4_0 carry one fp16 scale per 32 values, q4_1 and KIVI's asym codes an fp16 scale and an fp16
# zero point, fp8 one fp16 scale. KIVI's keys are grouped along G tokens of a channel instead of G
# values of a token: per token the average is the same (G divides head_dim and the residual).
KV_DTYPE_COSTS = {
    "fp32": (("fp32", None, 2),) * 2, "fp16": (("fp16", None, 2),) * 2, "bf16": (("bf16", None, 2),) * 2,
    "int8": (("int8", 32, 2),) * 2, "int4": (("int4", 32, 2),) * 2, "q4_1": (("int4", 32, 4),) * 2,
    "kivi2": (("int2", "G", 4),) * 2, "kivi4": (("int4", "G", 4),) * 2,
    "fp8": (("fp8", "G", 2),) * 2, "fp8_e5m2": (("fp8", "G", 2),) * 2,
    "k16v8": (("fp16", None, 2), ("int8", 32, 2)),
}


def kv_dtype_sides(kv_dtype: str, group: int = 32) -> tuple[tuple[str, int | None, int], ...]:
    """``KV_DTYPE_COSTS[kv_dtype]`` with the chosen ``group`` filled in (ConfigError for an unknown name)."""
    if kv_dtype not in KV_DTYPE_COSTS:
        raise ConfigError(f"kv_dtype={kv_dtype!r} is not known; use one of {', '.join(KV_DTYPE_COSTS)}")
    group = check_int("group", group, hint="values per scale, e.g. 32")
    return tuple((d, group if g == "G" else g, sb) for d, g, sb in KV_DTYPE_COSTS[kv_dtype])


def kv_dtype_bytes_per_token(shape: ModelShape, kv_dtype: str, group: int = 32) -> int:
    """Cache bytes per token of ``kv_dtype`` (``minikv.quant``), scales included: K's half plus V's half
    of ``kv_bytes_per_token`` at each side's dtype, group and scale bytes (K/V caches only, not MLA)."""
    if shape.is_mla:
        raise ConfigError(f"kv_dtype={kv_dtype!r}: the MLA latent cache is not quantized in minikv; use dtype")
    return sum(kv_bytes_per_token(shape, d, g, sb) // 2 for d, g, sb in kv_dtype_sides(kv_dtype, group))
