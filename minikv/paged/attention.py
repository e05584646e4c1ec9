"""Step 3, the attention: the paged layout, the slot mapping, and attention that reads blocks through a block table.

The data layout (the GPU wing ``minikv_gpu.paged`` mirrors it exactly)
--------------------------------------------------------------------------
* Pools, one per layer, preallocated once::

      k_pool[layer]: [num_blocks, block_size, Hkv, D]      (v_pool the same)

  Stored together as ``cache.k_pool: [L, num_blocks, block_size, Hkv, D]``.
* A **block table** per sequence: ``int32 [num_blocks_of_seq]``; entry j is the
  physical block holding the sequence's positions ``j*bs .. j*bs + bs - 1``.
* A **slot** names one token row of a pool: ``slot = block_id * block_size + offset``.
  The token at position ``p`` of a sequence lives in slot
  ``table[p // bs] * bs + p % bs``. Writes go through a per-step **slot
  mapping** ``[N] int64`` (one slot per packed new token) into the pool viewed
  as ``[num_blocks * block_size, Hkv, D]``.
  Offsets are 64-bit on purpose. Within one layer's pool the element offset is
  ``slot * Hkv * D + head * D + dim``: 32 bits hold it while ``num_blocks * block_size
  * Hkv * D <= 2**31`` (Hkv 8, D 128: 2**21 slots per layer). A large GPU passes that with
  a shallow model or a 1-byte cache, and a kernel indexing across layers (``copy_blocks``)
  passes it L times sooner, so kernels compute ``(int64)slot * stride`` (Q17 of
  docs/interview.md has the numbers).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from minikv import online_softmax
from minikv.errors import ConfigError, InvalidInputError, ShapeError, check_int
from minikv.paged.allocator import ceil_div


def slot_mapping(block_table: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """Slots of ``positions`` of one sequence: ``table[p // bs] * bs + p % bs`` as int64 ([T] -> [T])."""
    positions = np.asarray(positions, dtype=np.int64)
    table = np.asarray(block_table, dtype=np.int64)
    return table[positions // block_size] * block_size + positions % block_size


TileLoader = Callable[[np.ndarray, np.ndarray], np.ndarray]  # (blk [R, tile], full [R, tile]) -> [R, tile, bs, Hkv, D]


def gather_blocks(pool: np.ndarray) -> TileLoader:
    """The default tile loader of ``pool``: blocks ``blk`` -> ``pool[blk]`` [R, tile, block_size, Hkv, D]."""
    return lambda blk, full: pool[blk]


def paged_attention(q: np.ndarray, k_pool: np.ndarray, v_pool: np.ndarray, block_tables: np.ndarray,
                    context_lens: np.ndarray, query_lens: np.ndarray | None = None,
                    blocks_per_tile: int | None = None, load_k: TileLoader | None = None,
                    load_v: TileLoader | None = None, sinks: np.ndarray | None = None,
                    softcap: float | None = None) -> np.ndarray:
    """Attention of packed queries over each sequence's blocks, read through its block table.

    q:               [N, Hq, D] queries of B sequences, packed (sequence b owns query_lens[b] rows)
    k_pool:          [num_blocks, block_size, Hkv, D] (one layer's pool; v_pool the same)
    block_tables:    [B, max_blocks] int32; entries past a sequence's last block are ignored
    context_lens:    [B] tokens each sequence holds *including* this step's
    query_lens:      [B] new tokens per sequence (default all 1: pure decode); sum = N
    blocks_per_tile: blocks read per iteration (1 = one block at a time; default ~128 keys)
    load_k, load_v:  ``load(blk, full) -> [*blk.shape, block_size, Hkv, D]``: the blocks ``blk`` [R, tile]
                     of the tile for R queries, where ``full`` [R, tile] says which of them are full at
                     each query's position (default: ``k_pool[blk]``, ignoring ``full``; a quantized
                     cache reads the full ones from their codes: ``minikv.quant.cache``)
    sinks, softcap:  learned sink logits [Hq] and tanh soft-capping (``minikv.online_softmax``)
    returns:         [N, Hq, D] in q's dtype

    The t-th query of sequence b sits at ``p = context_lens[b] - query_lens[b] + t`` and sees
    keys ``0..p``. Keys are walked in block order, a tile of blocks at a time for all queries
    together, through the online softmax (``minikv.online_softmax``): the history is never
    gathered into one [S, D] array. Every query attends over **all** blocks of its sequence
    (the "local page only" toy of some write-ups silently drops earlier pages: another model).
    Stale slots of a partly filled last block (possibly NaN) are masked, and the core selects
    their V rows away rather than multiplying them by 0.
    """
    block_tables, context_lens, query_lens, tile = check_paged_attention_args(
        q, k_pool, v_pool, block_tables, context_lens, query_lens, blocks_per_tile)
    n, hq, d = q.shape
    bs, hkv = k_pool.shape[1], k_pool.shape[2]
    dt, g, span = q.dtype, hq // hkv, tile * bs  # span: keys per tile
    scale = dt.type(1.0 / np.sqrt(d))  # a float32 scalar keeps float32 math float32
    seq_of, pos = query_positions(context_lens, query_lens)                 # [N] sequence, position
    visible = pos + 1                                                        # [N] keys 0..pos
    tables = _whole_tiles(block_tables, context_lens, bs, tile)[seq_of]      # [N, width] physical ids
    qg = q.reshape(n, hkv, g, d)  # a whole GQA group per KV head: K/V of a block read once per group
    load_k = gather_blocks(k_pool) if load_k is None else load_k
    load_v = gather_blocks(v_pool) if load_v is None else load_v
    state = online_softmax.start((n, hkv, g), d, dt, None if sinks is None else np.reshape(sinks, (hkv, g)))
    for start in range(0, int(visible.max()), span):
        # Only the queries that see a key of this tile take part: a prefill's early queries skip the
        # later tiles (1.7x faster for a 512-token prefill, 2.1x for a batch of 8 decodes of 64..1024
        # tokens: benchmarks/results/fast_paths.json); when all do, views replace fancy-indexed copies.
        rows = np.flatnonzero(visible > start)
        r = rows.size
        rows = slice(None) if r == n else rows
        blk = tables[rows, start // bs:start // bs + tile]                   # [R, tile]
        full = (start // bs + np.arange(tile) + 1) * bs <= visible[rows, None]  # [R, tile] block full at the query
        valid = (start + np.arange(span))[None, :] < visible[rows, None]     # [R, span]
        if r > 1 and (blk == blk[0]).all() and (full == full[0]).all():
            # Every query reads the same blocks alike (the queries of one sequence: a verify pass, a chunk):
            # load them once, not once per query (a verify pass of 8 queries copied the history 8 times;
            # ``benchmarks/decode_profile.py --cache paged`` times the attention per T).
            kb = load_k(blk[:1], full[:1]).reshape(span, hkv, d).astype(dt, copy=False)  # [span, Hkv, D]
            vb = load_v(blk[:1], full[:1]).reshape(span, hkv, d).astype(dt, copy=False)
            state[rows] = _shared_tile(state[rows], qg[rows], kb, vb, valid, scale, softcap)
            continue
        kb = load_k(blk, full).reshape(r, span, hkv, d).astype(dt, copy=False)  # [R, span, Hkv, D]
        vb = load_v(blk, full).reshape(r, span, hkv, d).astype(dt, copy=False)
        scores = (qg[rows] @ kb.transpose(0, 2, 3, 1)) * scale               # [R, Hkv, G, span]
        state[rows] = online_softmax.update(state[rows], scores, vb.transpose(0, 2, 1, 3),
                                            valid[:, None, None, :], overwrite=True, softcap=softcap)
    out = online_softmax.finish(state).reshape(n, hq, d)
    assert out.dtype == dt, out.dtype
    return out


def _shared_tile(state: online_softmax.State, q: np.ndarray, kb: np.ndarray, vb: np.ndarray, valid: np.ndarray,
                 scale, softcap: float | None) -> online_softmax.State:
    """Fold one tile that R queries read alike into their state, as one product per KV head.

    state: [R, Hkv, G] rows; q: [R, Hkv, G, D]; kb, vb: [span, Hkv, D] the tile's keys and values;
    valid: [R, span] the keys each query may see. The R queries' G heads become R*G rows of one
    [R*G, D] x [D, span] product per KV head instead of R products of G rows, and a stale key that no
    query sees has its value row selected away once, not once per query.
    """
    r, hkv, g, d = q.shape

    def rows(a):  # [R, Hkv, G, ...] -> [Hkv, R*G, ...]: row i*G + j is query i, head j
        return np.swapaxes(a, 0, 1).reshape(hkv, r * g, *a.shape[3:])

    def back(a):
        return np.swapaxes(a.reshape(hkv, r, g, *a.shape[2:]), 0, 1)

    scores = online_softmax.tile_scores(rows(q), np.swapaxes(kb, 0, 1))  # [Hkv, R*G, span]
    scores *= scale
    sub = online_softmax.State(rows(state.m), rows(state.l), rows(state.acc))
    online_softmax.update(sub, scores, np.swapaxes(vb, 0, 1), np.repeat(valid, g, axis=0), overwrite=True,
                          softcap=softcap)
    return online_softmax.State(back(sub.m), back(sub.l), back(sub.acc))


def _whole_tiles(block_tables: np.ndarray, context_lens: np.ndarray, bs: int, tile: int) -> np.ndarray:
    """Block tables [B, width] padded to whole tiles, unused entries pointing at block 0.

    Unused entries may hold anything (-1 padding...); block 0's slots there are masked.
    """
    bsz, width = block_tables.shape
    in_use = np.arange(width)[None, :] < ceil_div(context_lens, bs)[:, None]
    safe = np.zeros((bsz, ceil_div(width, tile) * tile), dtype=np.int64)
    safe[:, :width] = np.where(in_use, block_tables, 0)
    return safe


def default_blocks_per_tile(block_size: int, tile_tokens: int = 128) -> int:
    """Blocks walked per online-softmax iteration by default: about ``tile_tokens`` keys per tile."""
    return max(1, tile_tokens // int(block_size))


def query_positions(context_lens: np.ndarray, query_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For every packed query: the sequence it belongs to and its position, both int64 [N].

    Sequence b owns ``query_lens[b]`` consecutive rows; its t-th query sits at
    ``context_lens[b] - query_lens[b] + t`` (the new tokens are the last ones).
    """
    context_lens = np.asarray(context_lens, dtype=np.int64)
    query_lens = np.asarray(query_lens, dtype=np.int64)
    seq_of = np.repeat(np.arange(query_lens.size), query_lens)
    first = np.repeat(np.cumsum(query_lens) - query_lens, query_lens)  # each query's sequence's first row
    pos = np.repeat(context_lens - query_lens, query_lens) + np.arange(seq_of.size) - first
    return seq_of, pos


def check_paged_attention_args(q, k_pool, v_pool, block_tables, context_lens, query_lens=None,
                                blocks_per_tile=None) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Validate ``paged_attention``'s arguments; raise ShapeError/ConfigError/InvalidInputError.

    Only the shapes of ``q`` and the pools are read (so device arrays pass too); the index
    arrays are read on the host. Returns ``(block_tables, context_lens [B] int64,
    query_lens [B] int64, blocks_per_tile)`` with the defaults filled in.
    """
    if q.ndim != 3 or k_pool.ndim != 4 or v_pool.shape != k_pool.shape:
        raise ShapeError(f"q.shape={q.shape}, k_pool.shape={k_pool.shape}, v_pool.shape={v_pool.shape}; "
                         "expected q [N, Hq, D] and pools [num_blocks, block_size, Hkv, D]")
    n, hq, d = q.shape
    num_blocks, bs, hkv, dk = k_pool.shape
    if dk != d:
        raise ShapeError(f"head_dim differs: q has {d}, the pool {dk}")
    if hq % hkv:
        raise ConfigError(f"Hq={hq} is not a multiple of Hkv={hkv}")
    tile = default_blocks_per_tile(bs) if blocks_per_tile is None else check_int("blocks_per_tile", blocks_per_tile)
    context_lens = np.asarray(context_lens, dtype=np.int64).reshape(-1)
    bsz = context_lens.size
    query_lens = np.ones(bsz, np.int64) if query_lens is None else np.asarray(query_lens, np.int64).ravel()
    block_tables = np.asarray(block_tables)
    if block_tables.ndim != 2 or block_tables.shape[0] != bsz or query_lens.size != bsz:
        raise ShapeError(f"block_tables.shape={block_tables.shape}, {query_lens.size} query_lens and "
                         f"{bsz} context_lens; expected [B, max_blocks], [B], [B]")
    if int(query_lens.sum()) != n or np.any(query_lens < 1) or np.any(query_lens > context_lens):
        raise InvalidInputError(f"query_lens={query_lens.tolist()} with context_lens={context_lens.tolist()} "
                                f"and N={n} queries: each sequence needs 1 <= query_len <= context_len, "
                                "summing to N")
    need = ceil_div(context_lens, bs)
    width = block_tables.shape[1]
    if np.any(need > width):
        raise ShapeError(f"block_tables has {width} columns but a context of "
                         f"{int(context_lens.max())} tokens needs {int(need.max())} blocks of {bs}")
    in_use = np.arange(width)[None, :] < need[:, None]
    used = block_tables[in_use]
    if used.size and (used.min() < 0 or used.max() >= num_blocks):
        raise InvalidInputError(f"block table entry {int(used.min() if used.min() < 0 else used.max())} is "
                                f"outside the pool [0, {num_blocks})")
    return block_tables, context_lens, query_lens, tile
