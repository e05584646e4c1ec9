"""The figures of steps 1 to 4: the recompute, the contiguous cache, FlashAttention's I/O, the paged pool, MLA."""

from __future__ import annotations

from kit import C, arrow, box, canvas, cell, label, title

from minikv.costs import attention_hbm_bytes, expanded_kv_values_per_token, get_preset, kv_values_per_token

PROMPT, STEPS = 3, 5


def _generation_rows(ax, x0, y0, cached: bool):
    """Rows = forward passes of a generation (the prefill, then decode steps), cells = the tokens each pass holds."""
    for step in range(STEPS + 1):
        n = PROMPT + step
        y = y0 + step * 1.25
        label(ax, x0 - 0.3, y + 0.5, "prefill" if step == 0 else f"step {step}", size=8, ha="right", color=C.MUTED)
        for t in range(n):
            new = t >= n - 1 if step else True
            fc = C.BLUE if (new or not cached) else C.LIGHT
            cell(ax, x0 + t, y, "", fc=fc)
        if step:
            cell(ax, x0 + n - 1, y, "", fc="none", ec=C.ORANGE, lw=2.2)


def fig_recompute():
    """Step 1: a full pass is causal attention; without a cache every step reruns the whole prefix."""
    fig, ax = canvas(25, 11.2)
    title(ax, 0, 0.4, "One forward pass: causal attention")
    n = 7
    for q in range(n):
        for k in range(n):
            cell(ax, 1.2 + k * 0.8, 1.6 + q * 0.8, "", fc=C.BLUE if k <= q else C.GREY, w=0.8, h=0.8, lw=0.5)
    label(ax, 1.2 + n * 0.4, 1.2, "keys 0 .. S - 1", size=8, ha="center", color=C.MUTED)
    label(ax, 0.9, 1.6 + n * 0.4, "queries", size=8, ha="right", color=C.MUTED)
    label(ax, 1.2, 8.0, "query t sees keys 0 .. t\nsoftmax(q k^T / sqrt(D) + mask) v", size=8.5)
    title(ax, 10.5, 0.4, "Generating with no cache: every pass recomputes every K, V")
    _generation_rows(ax, 13.3, 1.3, cached=False)
    label(ax, 13.3, 9.3, "blue: K, V computed in this pass    orange: the newest token", size=8,
          color=C.MUTED)
    label(ax, 13.3, 10.3, "pass t reruns t tokens: matmuls O(t), attention O(t^2); n tokens: O(n^3) attention",
          size=8.5)
    return fig


def fig_kv_cache():
    """Step 2: with a cache only the new token is computed; the contiguous cache reserves a slab per sequence."""
    fig, ax = canvas(27, 11.2)
    title(ax, 0, 0.4, "Generating with a cache")
    _generation_rows(ax, 2.8, 1.3, cached=True)
    label(ax, 2.8, 9.3, "blue: computed and appended    light: read from the cache", size=8, color=C.MUTED)
    label(ax, 2.8, 10.3, "prefill writes P rows at once; a decode step writes 1 row and reads S", size=8.5)
    title(ax, 14, 0.4, "The contiguous cache: one slab of R positions per sequence")
    lengths, r = (9, 4, 7), 12
    for s, n in enumerate(lengths):
        y = 1.8 + s * 2.0
        label(ax, 16.6, y + 0.5, f"seq {s}", size=8, ha="right", color=C.MUTED)
        for p in range(r):
            cell(ax, 16.8 + p * 0.8, y, "", fc=C.LIGHT if p < n else C.WHITE, w=0.8, h=1.0, lw=0.6,
                 hatch=None if p < n else "///", ec=C.INK if p < n else "#9ca3af")
        label(ax, 16.8 + r * 0.8 + 0.3, y + 0.5, f"{n} of {r}", size=8, color=C.MUTED)
    label(ax, 16.8, 8.2, "k, v: [L, max_seqs, Hkv, R, D]; hatched: reserved, never used", size=8.5)
    label(ax, 16.8, 9.2, f"used {sum(lengths)} of {r * len(lengths)} positions: the reservation is the waste",
          size=8.5)
    label(ax, 16.8, 10.2, "that step 3 pages away", size=8.5)
    return fig


def fig_flash_io():
    """FlashAttention's I/O argument: HBM bytes of one head's attention against the tile size (minikv.costs)."""
    import matplotlib.pyplot as plt

    n, tiles = 4096, [16, 32, 64, 128, 256, 512]
    fig, ax = plt.subplots(figsize=(7.2, 3.9))
    for d, dash in ((128, "-"), (64, "--")):
        mb = {o: [attention_hbm_bytes(n, d, b, b, o) / 1e6 for b in tiles] for o in ("standard", "flash1", "flash2")}
        ax.plot(tiles, mb["standard"], dash, color=C.RED, label=f"standard (scores in HBM), D = {d}")
        ax.plot(tiles, mb["flash1"], dash, color=C.BLUE, marker="o", ms=3.5,
                label=f"FlashAttention, Algorithm 1 order, D = {d}")
        ax.plot(tiles, mb["flash2"], dash, color=C.GREEN, marker="s", ms=3.5,
                label=f"FlashAttention-2 order, D = {d}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(tiles, [str(t) for t in tiles])
    ax.set_xlabel("tile size B (rows of Q and of K/V per tile)")
    ax.set_ylabel("HBM bytes read + written (MB)")
    ax.set_title(f"One head, S = {n} queries and keys, fp16: tiles turn $4S^2$ into $\\approx S^2 D\\,/\\,B$",
                 fontsize=10)
    ax.grid(True, which="major", color="#e5e7eb", lw=0.6)
    ax.legend(fontsize=7.5, frameon=False, loc="lower left")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return fig


POOL_ROWS, POOL_COLS, B = 2, 6, 4
TABLES = {"A": [7, 2, 9], "B": [7, 2, 4]}
LENGTHS = {"A": 10, "B": 9}


def _block_xy(block):
    return 9.0 + (block % POOL_COLS) * (B * 0.75 + 0.6), 2.1 + (block // POOL_COLS) * 2.9


def _slot_fill(name: str, j: int, offset: int, shared: bool):
    """(facecolor, text) of one slot of sequence ``name``'s j-th block."""
    pos = j * B + offset
    if pos >= LENGTHS[name]:
        return C.GREY, "stale"
    return (C.PALE_GREEN if shared else (C.LIGHT if name == "A" else C.YELLOW)), pos


def fig_paged():
    """Step 3: two sequences' block tables into one pool; a shared prefix, stale slots, the slot mapping."""
    fig, ax = canvas(33.5, 9.4)
    title(ax, 0, 0.4, "Block tables")
    title(ax, 9.0, 0.4, "One pool per layer: 12 blocks of b = 4 slots (a slot is one token row of the pool)")
    holders = {}
    for name, table in TABLES.items():
        for j, blk in enumerate(table):
            holders.setdefault(blk, []).append((name, j))
    for blk in range(POOL_ROWS * POOL_COLS):
        x, y = _block_xy(blk)
        held = holders.get(blk, [])
        who = "  ".join(f"{n}[{j}]" for n, j in held)
        label(ax, x + B * 0.375, y - 0.75, f"block {blk}", size=7.5, ha="center", color=C.MUTED)
        label(ax, x + B * 0.375, y - 0.3, who or "free", size=7.5, ha="center",
              color=C.GREEN if len(held) > 1 else (C.INK if held else C.MUTED))
        for o in range(B):
            fc, text = _slot_fill(*held[0], o, len(held) > 1) if held else (C.WHITE, "")
            cell(ax, x + o * 0.75, y, text, fc=fc, w=0.75, h=0.9, size=6.5 if text == "stale" else 7.5)
        if len(held) > 1:
            label(ax, x + B * 0.375, y + 1.25, "ref count 2", size=7.5, ha="center", color=C.GREEN)
    for row, (name, table) in enumerate(TABLES.items()):
        y = 2.1 + row * 2.9
        label(ax, 0.1, y + 0.45, f"seq {name}\n{LENGTHS[name]} tokens", size=8)
        for j, blk in enumerate(table):
            cell(ax, 2.8 + j * 1.2, y, blk, fc=C.PALE_GREEN if j < 2 else (C.LIGHT if name == "A" else C.YELLOW), w=1.2,
                 h=0.9, size=9)
            label(ax, 2.8 + j * 1.2 + 0.6, y - 0.35, f"[{j}]", size=7, ha="center", color=C.MUTED)
    label(ax, 0.1, 7.3, "slot(p) = table[p // b] x b + p % b      seq A, position 9: table[2] x 4 + 1 = 9 x 4 + 1 = "
          "slot 37", size=9)
    label(ax, 0.1, 8.3, "Blocks 7 and 2 hold a shared prefix (same tokens, so the same K/V): two tables point at "
          "them. Stale slots may hold NaN: the causal mask hides them.", size=8.5, color=C.MUTED)
    return fig


def fig_mla():
    """Step 4: the cached latent row, absorbed decode, and how much a token caches per layer."""
    fig, ax = canvas(35, 11)
    title(ax, 0, 0.4, "MLA: cache one latent row per token and layer, attend without decompressing it")
    box(ax, 0, 1.5, 3.2, 1.2, "h (hidden)", fc=C.GREY)
    arrow(ax, (3.2, 2.1), (5.0, 2.1), text="W_DKV", size=8)
    box(ax, 5.0, 1.5, 6.0, 1.2, "c_kv: r = 512", fc=C.PURPLE, color=C.WHITE)
    box(ax, 11.0, 1.5, 1.9, 1.2, "k_pe\n64", fc=C.ORANGE, color=C.WHITE, size=8)
    label(ax, 13.3, 1.75, "RMSNorm on c_kv, RoPE on k_pe", size=8, color=C.MUTED)
    label(ax, 13.3, 2.5, "cached: Dl = r + dr = 576 values, shared by all heads", size=8.5)
    title(ax, 0, 4.0, "Decode, one head h (absorbed: no per-head K or V is built)", size=9.5)
    box(ax, 0, 4.9, 3.0, 1.1, "q_nope_h\nDn = 128", fc=C.LIGHT, size=8)
    arrow(ax, (3.0, 5.45), (5.0, 5.45), text="x W_UK[h]^T", size=8)
    box(ax, 5.0, 4.9, 6.0, 1.1, "q_lat_h: 512", fc=C.LIGHT, size=8.5)
    box(ax, 11.0, 4.9, 1.9, 1.1, "q_pe\n64", fc=C.LIGHT, size=8)
    label(ax, 13.3, 5.45, "s_hj = scale x [q_lat_h ; q_pe_h] . [c_kv_j ; k_pe_j]\none 576-wide dot per cached key",
          size=8.5)
    box(ax, 5.0, 7.0, 6.0, 1.1, "o_lat_h = sum_j p_hj c_kv_j", fc=C.PURPLE, color=C.WHITE, size=8.5)
    arrow(ax, (11.0, 7.55), (13.3, 7.55), text="x W_UV[h]", size=8)
    box(ax, 13.3, 7.0, 3.0, 1.1, "o_h\nDv = 128", fc=C.LIGHT, size=8)
    arrow(ax, (16.3, 7.55), (18.2, 7.55), text="x W_O", size=8)
    label(ax, 18.4, 7.55, "out", size=8.5)
    label(ax, 0, 9.0, "Every head reads the same latent rows: decode is MQA with one 576-wide key head.", size=8.5)
    label(ax, 0, 9.8, "RoPE stays in the separate 64-wide part: a rotated nope part could not be absorbed.",
          size=8.5, color=C.MUTED)
    _mla_bars(ax, x0=22.5)
    return fig


def _mla_bars(ax, x0):
    """Values each token caches per layer, DeepSeek-V3's shapes, on a log scale drawn by hand."""
    import math

    v3 = get_preset("deepseek-v3")
    mha = expanded_kv_values_per_token(v3) // v3.num_layers
    gqa = 2 * 8 * 128
    mla = kv_values_per_token(v3) // v3.num_layers
    title(ax, x0, 0.4 + 3.6, "Values cached per token and layer", size=9.5)
    label(ax, x0, 4.75, "DeepSeek-V3 shapes, log scale", size=8, color=C.MUTED)
    rows = [("MHA equivalent (K 192, V 128 x 128 heads)", mha, C.RED),
            ("GQA, 8 KV heads of 128 (K and V)", gqa, C.BLUE), ("MLA latent [c_kv ; k_pe]", mla, C.PURPLE)]
    unit = 10.0 / math.log10(mha)
    for i, (name, n, color) in enumerate(rows):
        y = 5.4 + i * 2.0
        cell(ax, x0, y + 0.6, fc=color, w=math.log10(n) * unit, h=0.8, lw=0.6)
        label(ax, x0, y + 0.2, name, size=8)
        label(ax, x0 + math.log10(n) * unit + 0.2, y + 1.0, f"{n:,}", size=8.5, weight="bold")
    assert (mha, mla) == (40_960, 576)
