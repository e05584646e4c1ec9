"""The figure of step 9: Gemma-3-270M's layer pattern, what each kind of layer keeps, the prefix-hit rule, and
the cache's size against the context, all-full against hybrid (from the lesson's ``layer_windows`` and
``kv_tokens``)."""

from __future__ import annotations

import numpy as np
from kit import C, canvas, cell, label, plt, title

from minikv.textbook.s9_hybrid import kv_tokens, layer_windows, needed_for_hit

LAYERS, W, HKV, D, BYTES = 18, 512, 1, 256, 2  # Gemma-3-270M; K/V in 16-bit
N, HIT = 2_000, 1_536                          # the query drawn, and a prefix hit point


def _span(ax, x0, y, scale, start, stop, fc, text=""):
    """Positions start .. stop - 1 as one bar on a line of ``scale`` cells per token."""
    cell(ax, x0 + start * scale, y, text, fc=fc, w=max((stop - start) * scale, 0.08), h=0.8, size=7.5, lw=0.5)


def fig_hybrid():
    """Step 9: the layer pattern; what a sliding and a full layer keep at position 2,000 and need for a prefix
    hit; bytes against context for all-full and hybrid."""
    fig, ax = canvas(40, 14)
    windows = layer_windows(LAYERS, W)
    title(ax, 0, 0.4, f"Gemma-3-270M: {LAYERS} layers, every 6th full, the others slide over W = {W}")
    for i, w in enumerate(windows):
        cell(ax, 0.3 + i * 0.95, 1.2, "F" if w is None else "S", fc=C.ORANGE if w is None else C.BLUE, w=0.95,
             h=0.95, size=8, color=C.WHITE)
        label(ax, 0.3 + i * 0.95 + 0.47, 2.5, str(i), size=6.5, ha="center", color=C.MUTED)
    scale = 15.0 / N
    x0 = 0.3
    label(ax, 0, 3.5, f"The query at position {N:,} sees (blue: kept and seen, grey: dropped)", size=8.5)
    for row, (name, w) in enumerate((("sliding layer (15)", W), ("full layer (3)", None))):
        y = 4.1 + row * 1.2
        lo = 0 if w is None else N - w + 1
        if lo:
            _span(ax, x0, y, scale, 0, lo, C.GREY)
        _span(ax, x0, y, scale, lo, N + 1, C.BLUE, "" if w is None else f"{N - lo + 1}")
        label(ax, x0 + 15.3, y + 0.4, name, size=8)
    label(ax, 0, 7.1, f"A prefix hit at h = {HIT:,}: what each layer needs before h (orange)", size=8.5)
    for row, (name, w) in enumerate((("sliding: the W - 1 keys before h", W), ("full: all h keys", None))):
        y = 7.7 + row * 1.2
        need = needed_for_hit(HIT, w)
        if need.start:
            _span(ax, x0, y, scale, 0, need.start, C.WHITE)
        _span(ax, x0, y, scale, need.start, need.stop, C.ORANGE)
        label(ax, x0 + 15.3, y + 0.4, name, size=8)
    label(ax, 0, 10.4, "A sliding layer that dropped the keys before h - W + 1 can still take the hit.", size=8.5)
    label(ax, 0, 11.2, "Rollback of K draft tokens after the ring wrapped: a ring of W + K slots.", size=8.5)
    label(ax, 0, 12.0, "Sized full, all 18 layers would grow like the full layer's bar (right: orange).", size=8.5,
          color=C.MUTED)

    plot = fig.add_axes((0.58, 0.12, 0.41, 0.72))
    n = np.array([256, 512, 1024, 2048, 4096, 8192, 16384, 32768])
    per_key = 2 * HKV * D * BYTES / 2 ** 20  # MiB per key row (K and V) of one layer
    full = np.array([sum(kv_tokens([None] * LAYERS, int(t))) for t in n]) * per_key
    hybrid = np.array([sum(kv_tokens(windows, int(t))) for t in n]) * per_key
    plot.plot(n, full, "o-", color=C.ORANGE, lw=1.5, ms=3.5, label="every layer full")
    plot.plot(n, hybrid, "o-", color=C.BLUE, lw=1.5, ms=3.5, label="hybrid (rings + 3 slabs)")
    plot.set_xscale("log", base=2)
    plot.set_xticks(n[::2], [f"{t // 1024}k" if t >= 1024 else str(t) for t in n[::2]])
    plot.set_xlabel("context (tokens)")
    plot.set_ylabel("KV cache of one sequence (MiB, 16-bit)")
    plot.set_title(f"{1 - hybrid[-1] / full[-1]:.0%} smaller at 32k", fontsize=10)
    plot.grid(True, color=C.GREY, lw=0.6)
    plot.legend(frameon=False, fontsize=8.5)
    for side in ("top", "right"):
        plot.spines[side].set_visible(False)
    plt.setp(plot.get_xticklabels() + plot.get_yticklabels(), fontsize=8)
    return fig
