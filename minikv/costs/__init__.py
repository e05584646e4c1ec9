"""What a KV cache costs and what it saves: memory and FLOPs formulas, with model presets.

Everything here is exact integer arithmetic on a model's *shape*; nothing runs a
model, and no formula knows a CLI flag (the CLI maps its flags onto ``ModelShape``
fields). One concept per module, each with its formulas in its docstring (all of
them are also in ``docs/formulas.md``):

    shape.py    ModelShape (MHA/GQA/MQA, MLA, MoE), shape_from_config, dtype sizes
    presets.py  published models with their sources (PRESETS, get_preset)
    memory.py   KV-cache bytes (per token, per batch), parameter counts, weight bytes
    flops.py    FLOPs per layer / forward / decode / recompute / generation, the cache speed-up
    report.py   memory_report and its rendering; decimal GB next to binary GiB
    attention_io.py  FlashAttention's I/O argument: HBM bytes of one head's attention against the tile size

This package re-exports the public names, so ``from minikv.costs import X`` works for all of them.
"""

from minikv.costs.attention_io import ATTENTION_ORDERS, attention_hbm_bytes
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
    KV_DTYPE_COSTS,
    expanded_kv_values_per_token,
    kv_bytes_per_token,
    kv_cache_bytes,
    kv_dtype_bytes_per_token,
    kv_dtype_sides,
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
    "ATTENTION_ORDERS", "attention_hbm_bytes",
    "DTYPE_BITS", "FLOP_PARTS", "KV_DTYPE_COSTS", "kv_dtype_bytes_per_token", "kv_dtype_sides",
    "MLP_KINDS", "NORM_KINDS", "PRESETS", "QUANTIZED_DTYPES", "ModelShape",
    "arithmetic_intensity", "cache_speedup", "decode_flops", "dtype_bytes", "expanded_kv_values_per_token",
    "format_bytes", "format_count", "forward_flops", "generation_flops", "get_preset", "kv_bytes_per_token",
    "kv_cache_bytes", "kv_values_per_token", "layer_flops", "memory_report", "param_count", "recompute_flops",
    "render_report", "shape_from_config", "weights_bytes",
]
