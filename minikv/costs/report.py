"""Reports and units: what ``minikv memory`` computes (``memory_report``) and prints (``render_report``).

Units: ``format_bytes`` prints decimal GB (10^9 bytes, what the seed articles
mostly mean by "GB") next to binary GiB (2^30 bytes); ``format_count`` uses SI
prefixes (3.49e11 FLOPs -> "349.0 GFLOP").
"""

from __future__ import annotations

import textwrap

from minikv.costs.flops import FLOP_PARTS, decode_flops, generation_flops, recompute_flops
from minikv.costs.memory import (
    expanded_kv_values_per_token,
    kv_bytes_per_token,
    kv_cache_bytes,
    kv_values_per_token,
    param_count,
    weights_bytes,
)
from minikv.costs.shape import ModelShape, dtype_bytes

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


# the fields weights and FLOPs need beyond what the KV cache needs
_FULL_SHAPE = ("hidden_size", "num_heads", "intermediate_size", "vocab_size")


def _shape_line(s: ModelShape) -> str:
    """One comma-separated description of the layers, attention, MLP and vocabulary."""
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
    return ", ".join(dims)


def _header_lines(rep: dict, shape: ModelShape) -> list[str]:
    """Model, source, shape and the run's lengths and dtypes."""
    lines = [f"minikv memory: {rep['model']} ({rep['attention']})"]
    if rep["source"]:
        lines += textwrap.wrap(rep["source"], 100, initial_indent="  source: ", subsequent_indent=" " * 10,
                               break_on_hyphens=False)
    lines += textwrap.wrap(_shape_line(shape), 100, initial_indent="  shape:  ", subsequent_indent=" " * 10)
    group = f", +{rep['scale_bytes']} B scale per {rep['group_size']} values" if rep["group_size"] else ""
    lines.append(f"  run:    batch B = {rep['batch']} x (prompt P = {rep['prompt_len']} + generated G = "
                 f"{rep['output_len']}) = {_plural(rep['tokens_per_sequence'], 'token')} per sequence")
    lines.append(f"          KV cache in {rep['dtype']} ({rep['dtype_bytes']:g} B/value{group}), "
                 f"weights in {rep['weights_dtype']}")
    if rep["beyond_max_context"]:
        lines.append(f"  note:   {rep['tokens_per_sequence']} tokens is beyond this model's "
                     f"max context of {rep['max_context']}")
    return lines


def _memory_lines(rep: dict) -> list[str]:
    """The bytes table (KV per token, KV total, weights) and the ratios under it."""
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
    lines = _table(rows, ("memory", "bytes", "decimal", "binary"))
    if rep["kv_to_weights"] is not None:
        lines.append(f"  KV cache / weights = {rep['kv_to_weights']:.3f}")
    if "expanded_kv_values_per_token" in rep:
        ratio = rep["expanded_kv_values_per_token"] / rep["kv_values_per_token"]
        lines.append(f"  MLA caches {rep['kv_values_per_token']:,} values per token; full per-head K and V "
                     f"would be {rep['expanded_kv_values_per_token']:,} ({ratio:.1f}x more)")
    return lines


def _flops_lines(rep: dict, shape: ModelShape) -> list[str]:
    """The FLOPs table for the last token, cached vs recomputed, and the whole generation's totals."""
    ctx = rep["flops_context"]
    lines = ["", f"FLOPs for the token at position {ctx - 1} of one sequence (multiply-add = 2 FLOPs)"]
    with_c, without = rep["flops_with_cache"], rep["flops_without_cache"]
    per_layer = dict(rep["flops_per_layer_with_cache"])
    per_layer["total"] = sum(per_layer.values())
    labels = {"projections": "projections (q, k, v, o)", "scores": f"attention scores (S = {ctx} keys)",
              "weighted_v": "attention-weighted V", "mlp": "MLP", "lm_head": "lm_head (one row of logits)",
              "total": "total"}
    rows = []
    for k, label in labels.items():
        pl = format_count(per_layer[k], "FLOP") if k in per_layer else "-"
        rows.append((label, pl, format_count(with_c[k], "FLOP"), format_count(without[k], "FLOP")))
    mean = " (mean)" if shape.is_moe else ""
    lines += _table(rows, ("", f"cached, per layer{mean}", f"cached, {shape.num_layers} layers",
                           f"no cache (rerun T = {ctx} tokens)"))
    ratio = without["total"] / with_c["total"]
    lines.append(f"  this token costs {ratio:,.1f}x more FLOPs without the cache")
    gen = rep["generation"]
    if gen:
        lines += ["", f"generating G = {_plural(gen['new_tokens'], 'token')} after a P = {rep['prompt_len']}-token "
                      "prompt, one sequence:",
                  f"  {format_count(gen['flops_with_cache'], 'FLOP')} with the cache, "
                  f"{format_count(gen['flops_without_cache'], 'FLOP')} without: "
                  f"{gen['speedup']:,.1f}x more work without it"]
    return lines


def render_report(rep: dict, shape: ModelShape, field_label=None) -> str:
    """The human-readable table of ``minikv memory`` for a ``memory_report`` dict.

    ``field_label(field) -> str`` says how the reader sets a ``ModelShape`` field
    (the CLI passes its flag names); by default the field names are printed.
    """
    lines = _header_lines(rep, shape) + [""] + _memory_lines(rep)
    if rep["flops_with_cache"] is None:
        if rep["params"] is None:
            label = field_label or str
            lines.append(f"  (weights and FLOPs need the whole shape: {', '.join(map(label, _FULL_SHAPE))})")
        return "\n".join(lines)
    return "\n".join(lines + _flops_lines(rep, shape))
