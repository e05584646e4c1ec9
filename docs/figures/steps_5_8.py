"""The figures of steps 5 to 8: the quantized block and its residual, the ring with sinks, the tiers and the
speculative verify step, the ranks."""

from __future__ import annotations

import numpy as np
from kit import C, arrow, box, canvas, cell, cells, label, title

from minikv.parallel import head_plan
from minikv.parallel.context import striped_positions
from minikv.quant import codec

BS, DIM = 8, 8  # the drawn block: 8 tokens x 8 channels


def _codes_grid(ax, x, y, rng, cw=0.55):
    """A full block as int8 codes (shades of blue), one fp16 scale per token row."""
    shades = ["#deebf7", "#c6dbef", "#9ecae1", "#6baed6", "#4292c6"]
    for t in range(BS):
        for c in range(DIM):
            cell(ax, x + c * cw, y + t * cw, "", fc=shades[rng.integers(len(shades))], w=cw, h=cw, lw=0.3)
        cell(ax, x + DIM * cw + 0.1, y + t * cw, "", fc=C.YELLOW, w=cw, h=cw, lw=0.3)


def fig_quant():
    """Step 5: full blocks stored once as codes + scales, the open block in full precision; group axes."""
    fig, ax = canvas(33, 10.8)
    rng = np.random.default_rng(5)
    q8 = codec("q8_0")
    title(ax, 0, 0.4, "One sequence's K in a quantized paged cache (b = 8 tokens, D = 8 channels drawn)")
    for blk in range(3):
        x = 0.3 + blk * 6.2
        label(ax, x + 2.4, 1.3, f"block {blk}: full" if blk < 2 else "block 2: open", size=8.5, ha="center")
        if blk < 2:
            _codes_grid(ax, x, 1.9, rng)
            label(ax, x + 2.4, 6.7, "codes + scales,\nwritten once, never again", size=7.5, ha="center", color=C.MUTED)
        else:
            for t in range(BS):
                for c in range(DIM):
                    cell(ax, x + c * 0.55, 1.9 + t * 0.55, "", fc=C.LIGHT if t < 3 else C.WHITE, w=0.55, h=0.55,
                         lw=0.3, ec=C.INK if t < 3 else "#9ca3af")
            label(ax, x + 2.4, 6.7, "the residual: 3 tokens\nin full precision", size=7.5, ha="center",
                  color=C.MUTED)
    label(ax, 0.3, 8.2, f"q8_0: per 32 values one fp16 scale d = amax / 127 and 32 int8 codes: "
          f"{q8.group_bytes} bytes, {q8.bits} bits per value", size=8.5)
    label(ax, 0.3, 9.1, "A block is quantized by the step that fills it, once; a query at position p reads "
          "block j dequantized", size=8.5)
    label(ax, 0.3, 9.9, "iff (j + 1) x b <= p + 1, tile by tile inside the online softmax.", size=8.5)
    title(ax, 20.3, 0.4, "Which values share a scale")
    for i, (name, axis) in enumerate((("V, per token", "token"), ("K, per channel (KIVI)", "channel"))):
        x = 20.6 + i * 6.2
        label(ax, x + 2.2, 1.3, name, size=8.5, ha="center")
        for t in range(BS):
            for c in range(DIM):
                group = t if axis == "token" else c
                fc = ["#fde0dd", "#e0ecf4"][group % 2]
                if c == 5:
                    fc = C.RED if axis == "channel" else "#f4a582"
                cell(ax, x + c * 0.55, 1.9 + t * 0.55, "", fc=fc, w=0.55, h=0.55, lw=0.3)
        label(ax, x + 2.2, 6.7, "a group: one row" if axis == "token" else "a group: one column", size=7.5,
              ha="center", color=C.MUTED)
    label(ax, 20.6, 8.2, "Channel 5 is an outlier channel (red). Per token it sets", size=8.5)
    label(ax, 20.6, 9.0, "every row's scale; per channel it gets its own.", size=8.5)
    label(ax, 20.6, 9.8, "K per channel needs b tokens first: the residual.", size=8.5, color=C.MUTED)
    return fig


W, N_SINK, LAST = 8, 2, 12


def ring_slot(p: int) -> int:
    return p if p < N_SINK else N_SINK + (p - N_SINK) % (W - N_SINK)


def fig_window():
    """Step 6: the ring with sinks after 13 tokens, positions stored per slot; which keys each query sees."""
    fig, ax = canvas(31, 12)
    title(ax, 0, 0.4, f"The ring: W = {W} slots, n_sink = {N_SINK}, after positions 0 .. {LAST} were written")
    held = {}
    for p in range(LAST + 1):
        held[ring_slot(p)] = p
    for s in range(W):
        p = held[s]
        sink = s < N_SINK
        expired = not sink and LAST + 1 - p >= W - N_SINK
        fc = C.PURPLE if sink else (C.GREY if expired else C.BLUE)
        cell(ax, 0.5 + s * 1.5, 1.8, f"pos {p}", fc=fc, w=1.5, h=1.2, size=8, color=C.WHITE if not expired else C.INK)
        label(ax, 0.5 + s * 1.5 + 0.75, 3.4, f"slot {s}", size=7.5, ha="center", color=C.MUTED)
    label(ax, 0.5, 4.5, "sinks (purple) stay; token p >= n_sink goes to slot n_sink + (p - n_sink) mod (W - n_sink)",
          size=8.5)
    label(ax, 0.5, 5.3, f"grey: position 7 is outside the next query's window: token {LAST + 1} overwrites its slot",
          size=8.5)
    label(ax, 0.5, 6.1, "Slot order is not time order once the ring wraps: positions are stored per slot.", size=8.5)
    label(ax, 0.5, 6.9, "original positions: keys rotated at p when written; in-cache: re-rotated by rank.", size=8.5,
          color=C.MUTED)
    title(ax, 16.5, 0.4, "Query q sees key k iff k < n_sink or q - k < W - n_sink")
    c = 0.62
    for q in range(LAST + 1):
        for k in range(LAST + 1):
            seen = k <= q and (k < N_SINK or q - k < W - N_SINK)
            fc = (C.PURPLE if k < N_SINK else C.BLUE) if seen else (C.GREY if k <= q else C.WHITE)
            cell(ax, 17.6 + k * c, 1.3 + q * c, "", fc=fc, w=c, h=c, lw=0.3)
    label(ax, 17.6 + (LAST + 1) * c / 2, 9.7, "keys 0 .. 12", size=8, ha="center", color=C.MUTED)
    label(ax, 17.3, 1.3 + (LAST + 1) * c / 2, "queries", size=8, ha="right", color=C.MUTED)
    label(ax, 17.6, 10.6, "grey: evicted. The cache equals one masked forward with this mask.", size=8.5)
    return fig


def fig_tiers():
    """Step 7: device and host pools with demote / promote / prefetch; a verify pass and its rollback."""
    fig, ax = canvas(35, 12)
    title(ax, 0, 0.4, "Two tiers, one block layout")
    kinds = [C.BLUE] * 5 + [C.PALE_GREEN] * 3 + [C.WHITE] * 4
    box(ax, 0, 1.3, 10.4, 3.3, "", fc="#f8fafc", ec=C.MUTED, round_=False)
    label(ax, 0.3, 1.8, "device pool (HBM)", size=8.5, weight="bold")
    for i, fc in enumerate(kinds):
        cell(ax, 0.4 + (i % 6) * 1.65, 2.4 + (i // 6) * 1.0, "", fc=fc, w=1.5, h=0.8)
    box(ax, 0, 7.0, 10.4, 2.4, "", fc="#f8fafc", ec=C.MUTED, round_=False)
    label(ax, 0.3, 7.5, "host pool (pinned memory)", size=8.5, weight="bold")
    for i, fc in enumerate([C.GREEN] * 4 + [C.WHITE] * 2):
        cell(ax, 0.4 + i * 1.65, 8.1, "", fc=fc, w=1.5, h=0.8)
    arrow(ax, (6.0, 4.6), (4.0, 7.0), color=C.RED, text="demote: a cached-free\nblock evicted (ref 0)", size=7.5,
          offset=(-2.6, 0))
    arrow(ax, (7.5, 7.0), (8.3, 4.6), color=C.GREEN, text="promote: prefix hit\nprefetch: next requests", size=7.5,
          offset=(2.7, 0))
    label(ax, 11.0, 2.6, "held by a sequence\n(ref >= 1): stays", size=7.5, color=C.BLUE)
    label(ax, 11.0, 3.9, "cached-free: ref 0,\nhash kept", size=7.5, color=C.GREEN)
    label(ax, 0, 10.4, "Only blocks no sequence holds can leave: a held block is read by every step.", size=8.5)
    label(ax, 0, 11.2, "Policies choose what the host keeps: LRU, ARC, seen-twice.", size=8.5, color=C.MUTED)
    _verify(ax, x0=17.0)
    return fig


def _verify(ax, x0):
    title(ax, x0, 0.4, "Speculative decoding: one pass verifies K = 4 drafts")
    fed = [("t0", C.LIGHT), ("d1", C.LIGHT), ("d2", C.LIGHT), ("d3", C.LIGHT), ("d4", C.LIGHT)]
    label(ax, x0, 1.8, "fed in one pass (T = K + 1):", size=8.5)
    cells(ax, x0 + 0.2, 2.4, fed, w=1.6, h=1.0, size=9)
    label(ax, x0, 4.0, "target's pick after each:", size=8.5)
    picks = [("d1", C.GREEN), ("d2", C.GREEN), ("g3", C.ORANGE), ("-", C.GREY), ("-", C.GREY)]
    cells(ax, x0 + 0.2, 4.6, picks, w=1.6, h=1.0, size=9)
    for i in range(4):
        arrow(ax, (x0 + 1.0 + i * 1.6, 3.4), (x0 + 1.0 + i * 1.6, 4.6), color=C.MUTED, lw=0.8)
    label(ax, x0, 6.3, "kept: d1 d2 (they equal the target's picks), plus the bonus g3", size=8.5)
    label(ax, x0, 7.1, "d3, d4 rejected: their K/V were written by the pass and must go", size=8.5)
    box(ax, x0, 7.9, 12.5, 1.1, "cache.truncate(seq, length - 2)", fc=C.YELLOW, size=9)
    label(ax, x0, 9.8, "greedy: keep d_i while d_i = argmax(row i - 1); sampling: keep d_i with", size=8.5,
          color=C.MUTED)
    label(ax, x0, 10.6, "probability min(1, p/q), else draw from max(0, p - q) and stop", size=8.5, color=C.MUTED)


def fig_parallel():
    """Step 8: tensor parallelism over SmolLM2's heads at tp = 3, and MLA's tokens striped over cp = 3."""
    fig, ax = canvas(35, 10.6)
    plan = head_plan(9, 3, 3)
    title(ax, 0, 0.4, "Tensor parallelism, tp = 3 (SmolLM2: 9 query heads, 3 KV heads)")
    for r, share in enumerate(plan):
        x = 0.2 + r * 6.2
        box(ax, x, 1.3, 5.7, 5.6, "", fc="#f8fafc", ec=C.MUTED, round_=False)
        label(ax, x + 0.3, 1.8, f"rank {r}", size=9, weight="bold")
        label(ax, x + 0.3, 2.7, "query heads", size=7.5, color=C.MUTED)
        cells(ax, x + 0.3, 3.1, [(str(h), C.LIGHT) for h in share.q], w=1.0, h=0.8, size=8)
        label(ax, x + 0.3, 4.4, "KV head and its cache", size=7.5, color=C.MUTED)
        cells(ax, x + 0.3, 4.8, [(str(h), C.BLUE) for h in share.kv], w=1.0, h=0.8, size=8, color=C.WHITE)
        label(ax, x + 0.3, 6.2, "x: [T, H] on every rank", size=7.5)
    box(ax, 0.2, 7.6, 17.9, 1.0, "all-reduce (sum) of [T, H] after Wo and after W_down: 2 per layer", fc=C.YELLOW,
        size=8.5)
    label(ax, 0.2, 9.6, "A GQA group stays on one rank: no rank reads another's K or V, the cache is never gathered.",
          size=8.5)
    title(ax, 20.4, 0.4, "MLA: one latent head, so split tokens (cp = 3)")
    cp, n = 3, 12
    colors = [C.PURPLE, C.ORANGE, C.GREEN]
    for p in range(n):
        cell(ax, 20.6 + p * 1.1, 1.8, p, fc=colors[p % cp], w=1.1, h=0.9, size=8, color=C.WHITE)
    label(ax, 20.6, 3.4, "position p lives on rank p mod cp", size=8.5)
    for r in range(cp):
        pos = striped_positions(r, cp, n // cp)
        y = 4.2 + r * 1.1
        label(ax, 20.6, y + 0.45, f"rank {r}", size=8, color=colors[r], weight="bold")
        cells(ax, 22.3, y, [(int(p), colors[r]) for p in pos], w=1.1, h=0.9, size=8, color=C.WHITE)
        label(ax, 22.3 + len(pos) * 1.1 + 0.3, y + 0.45, "-> (m, l, acc)", size=8)
    box(ax, 20.6, 7.6, 13.5, 1.0, "all-gather the states, merge by exp(m_i - m): split-K across ranks",
        fc=C.YELLOW, size=8.5)
    label(ax, 20.6, 9.6, "Each rank holds 1/cp of the latent; head sharding would copy all of it.", size=8.5)
    return fig
