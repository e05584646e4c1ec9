"""KV-cache bytes of a hybrid model (step 9): full layers keep every token, sliding layers their window.

For one sequence of n tokens, between steps (what ``bytes_used`` of ``minikv.hybrid``'s caches counts)::

    full layer:               n tokens
    sliding layer (window W): min(n, W - 1 + K) tokens   (the next query brings its own key; K: rollback slots)
    bytes = 2 (K and V) x Hkv x D x dtype_bytes x sum over layers of their tokens, x batch

An all-full cache of the same model keeps n tokens in every layer. The saving is therefore
``1 - (L_full n + L_sliding min(n, W - 1 + K)) / (L n)``, which grows with n towards
``L_sliding / L``: Gemma-3-270m (15 of 18 layers slide over 512) saves 82% at 32k tokens, 0% at
500 tokens. Below the window a sliding layer keeps everything, like a full one.

Paged (``minikv.hybrid.blocks``), with block size b and groups of S layers (``group_layers``): a full
group holds ceil(n / b) blocks, a sliding group the blocks from the one of position
``floor = max(0, n - (W - 1) - K)`` on: ``ceil(n / b) - floor // b``; a block holds S layers x b
tokens. All-full paged: ceil(n / b) blocks of L layers.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from minikv.costs.memory import check_count, kv_bytes_per_token
from minikv.costs.shape import ModelShape
from minikv.errors import ConfigError
from minikv.paged.allocator import ceil_div

# Gemma-3-270m: layer i is full iff (i + 1) % 6 == 0, the rest slide over 512 (google/gemma-3-270m config.json:
# sliding_window 512, sliding_window_pattern 6; transformers' Gemma3TextConfig derives layer_types from them)
GEMMA3_270M = ModelShape(
    name="gemma3-270m", num_layers=18, hidden_size=640, num_heads=4, num_kv_heads=1, head_dim=256,
    intermediate_size=2048, vocab_size=262144, mlp="geglu", tie_embeddings=True, max_context=32768,
    published_params=270_000_000,
    source=("https://huggingface.co/google/gemma-3-270m/blob/main/config.json (18 layers, hidden 640, 4 query "
            "heads, 1 KV head of head_dim 256, intermediate 2048 (GeGLU), vocab 262144, sliding_window 512, "
            "every 6th layer full attention, max_position_embeddings 32768)"))
HYBRID_PRESETS = {"gemma3-270m": (GEMMA3_270M, tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18)))}


def sliding_tokens(tokens: int, window: int | None, rollback: int = 0) -> int:
    """Tokens one layer keeps for a sequence of ``tokens``: all of them (full), or the W - 1 + K newest."""
    return tokens if window is None else min(tokens, window - 1 + rollback)


def hybrid_kv_bytes(shape: ModelShape, windows: Sequence[int | None], tokens: int, dtype: str = "fp16",
                    batch: int = 1, rollback: int = 0, block_size: int | None = None) -> dict:
    """KV-cache bytes of a hybrid model per layer type, against the same model with every layer full.

    shape: the model (``num_kv_heads``, ``head_dim``); windows: [L] each layer's window (None: full);
    tokens: per sequence; rollback: K. Returns ``layer_types`` (one row per window: type, window,
    layers, tokens per layer, bytes), ``hybrid_bytes``, ``all_full_bytes``, ``saved_fraction`` and,
    with ``block_size``, ``paged`` (group size, blocks, bytes, against all-full paged).
    """
    from minikv.hybrid.pool import group_layers

    if shape.is_mla or len(windows) != shape.num_layers:
        raise ConfigError(f"{shape.name}: a hybrid cache needs one window per layer ({shape.num_layers}) and K/V "
                          f"heads (not MLA); got {len(windows)} windows")
    n, batch = check_count("tokens", tokens, 0), check_count("batch", batch, 1)
    per = kv_bytes_per_token(replace(shape, num_layers=1), dtype)  # one layer, one token: 2 Hkv D bytes
    rows = []
    for w in sorted(set(windows), key=lambda w: (w is not None, w or 0)):
        layers = sum(x == w for x in windows)
        kept = sliding_tokens(n, w, rollback)
        rows.append({"type": "full_attention" if w is None else "sliding_attention", "window": w,
                     "layers": layers, "tokens_per_layer": kept, "bytes": batch * layers * kept * per})
    hybrid, full = sum(r["bytes"] for r in rows), batch * shape.num_layers * n * per
    out = {"layer_types": rows, "hybrid_bytes": hybrid, "all_full_bytes": full,
           "saved_fraction": 1 - hybrid / full if full else 0.0, "rollback": rollback, "tokens": n, "batch": batch}
    if block_size is not None:
        b = check_count("block_size", block_size, 1)
        groups = group_layers(windows)
        size = max(len(layers) for _, layers in groups)
        blocks = sum(ceil_div(n, b) - (0 if w is None else max(0, n - (w - 1) - rollback) // b) for w, _ in groups)
        out["paged"] = {"block_size": b, "group_size": size, "groups": len(groups), "blocks": batch * blocks,
                        "bytes": batch * blocks * size * b * per, "all_full_blocks": batch * ceil_div(n, b),
                        "all_full_bytes": batch * ceil_div(n, b) * shape.num_layers * b * per}
    return out


def render_hybrid(rep: dict) -> str:
    """The lines ``minikv memory`` prints for a hybrid model (``hybrid_kv_bytes``' dict)."""
    lines = [f"hybrid KV cache at {rep['tokens']:,} tokens x {rep['batch']} (sliding layers keep W - 1 + K "
             f"newest, K = {rep['rollback']}):"]
    for r in rep["layer_types"]:
        what = r["type"] if r["window"] is None else f"{r['type']} (W={r['window']})"
        lines.append(f"  {what:32s} {r['layers']:3d} layers x {r['tokens_per_layer']:>9,} tokens = "
                     f"{r['bytes']:>16,} bytes")
    lines.append(f"  {'hybrid total':32s} {rep['hybrid_bytes']:>40,} bytes; all layers full: "
                 f"{rep['all_full_bytes']:,} bytes; saved {rep['saved_fraction']:.1%}")
    if "paged" in rep:
        p = rep["paged"]
        lines.append(f"  paged, blocks of {p['block_size']} tokens x {p['group_size']} layers ({p['groups']} groups): "
                     f"{p['blocks']:,} blocks = {p['bytes']:,} bytes; all-full paged {p['all_full_bytes']:,} bytes")
    return "\n".join(lines)
