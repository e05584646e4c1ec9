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

The package, one module per concept:

    shape     ModelShape, shape_from_config, the dtype tables
    presets   PRESETS, get_preset: real models' shapes, with sources
    memory    KV-cache bytes, parameter counts, weight bytes
    flops     layer/forward/decode/recompute/generation FLOPs, cache_speedup, arithmetic_intensity
    report    memory_report, render_report, format_bytes, format_count

``from minikv.costs import X`` works for every public name of these modules.
"""

from minikv.costs.flops import (
    FLOP_PARTS,
    arithmetic_intensity,
    cache_speedup,
    decode_flops,
    forward_flops,
    generation_flops,
    layer_flops,
    recompute_flops,
)
from minikv.costs.memory import (
    expanded_kv_values_per_token,
    kv_bytes_per_token,
    kv_cache_bytes,
    kv_values_per_token,
    param_count,
    weights_bytes,
)
from minikv.costs.presets import PRESETS, get_preset
from minikv.costs.report import format_bytes, format_count, memory_report, render_report
from minikv.costs.shape import (
    DTYPE_BITS,
    MLP_KINDS,
    NORM_KINDS,
    QUANTIZED_DTYPES,
    ModelShape,
    dtype_bytes,
    shape_from_config,
)

__all__ = [
    "DTYPE_BITS", "FLOP_PARTS", "MLP_KINDS", "NORM_KINDS", "PRESETS", "QUANTIZED_DTYPES", "ModelShape",
    "arithmetic_intensity", "cache_speedup", "decode_flops", "dtype_bytes", "expanded_kv_values_per_token",
    "format_bytes", "format_count", "forward_flops", "generation_flops", "get_preset", "kv_bytes_per_token",
    "kv_cache_bytes", "kv_values_per_token", "layer_flops", "memory_report", "param_count", "recompute_flops",
    "render_report", "shape_from_config", "weights_bytes",
]
