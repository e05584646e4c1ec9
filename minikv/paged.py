"""Step 3: a paged KV cache — the layout, the slot mapping, paged attention, the cache.

Why pages
---------
A contiguous cache (step 2) gives every sequence one slab of ``max_len``
positions up front. Most of that slab waits for tokens that may never come
(*reservation* waste), and slabs of different sizes leave holes between them
(*external* fragmentation). A paged cache cuts memory into small fixed-size
**blocks** of ``block_size`` token slots and hands them out one at a time, as a
sequence grows. The only waste left is the unfilled tail of each sequence's
last block (*internal* waste, fewer than ``block_size`` slots per sequence).

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

Who owns what
-------------
Three short modules, each with one job:

* ``minikv.block_allocator``: block ids, ref counts, chained hashes, the prefix
  cache and its LRU list (prefix sharing is explained there);
* ``minikv.block_manager``: per-sequence block tables, admission, fork with
  copy-on-write, swap plans, step reserve/commit/rollback. It returns copy plans;
* this module: the pools and the only code that touches K/V numbers — the
  storage hooks, ``write`` (through the slot mapping) and ``attend``
  (``paged_attention``). ``PagedKVCache`` plugs into the model through
  ``KVCacheBase``'s ``step / write / attend`` seam like every other cache, and
  forwards the bookkeeping questions to its ``BlockManager``.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from minikv import online_softmax
from minikv.block_allocator import Block, BlockAllocator, HashFn, chain_hash, num_blocks_for
from minikv.block_manager import HOLE, BlockManager
from minikv.errors import ConfigError, InvalidInputError, ShapeError, check_int
from minikv.kv_cache import KVCacheBase, Step

__all__ = ["Block", "BlockAllocator", "BlockManager", "HashFn", "chain_hash", "num_blocks_for", "slot_mapping",
           "paged_attention", "PagedKVCache", "default_blocks_per_tile", "query_positions",
           "check_paged_attention_args", "gather_blocks", "TileLoader"]


def slot_mapping(block_table: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """Slots of ``positions`` of one sequence: ``table[p // bs] * bs + p % bs`` as int64 ([T] -> [T])."""
    positions = np.asarray(positions, dtype=np.int64)
    table = np.asarray(block_table, dtype=np.int64)
    return table[positions // block_size] * block_size + positions % block_size


TileLoader = Callable[[np.ndarray, np.ndarray], np.ndarray]


def gather_blocks(pool: np.ndarray, blk: np.ndarray) -> np.ndarray:
    """The default tile loader: blocks ``blk`` [R, tile] of ``pool`` -> [R, tile, block_size, Hkv, D]."""
    return pool[blk]


def paged_attention(q: np.ndarray, k_pool: np.ndarray, v_pool: np.ndarray, block_tables: np.ndarray,
                    context_lens: np.ndarray, query_lens: np.ndarray | None = None,
                    blocks_per_tile: int | None = None, load_tile: TileLoader | None = None) -> np.ndarray:
    """Attention of packed queries over each sequence's blocks, read through its block table.

    q:               [N, Hq, D] queries of B sequences, packed (sequence b owns query_lens[b] rows)
    k_pool:          [num_blocks, block_size, Hkv, D] (one layer's pool; v_pool the same)
    block_tables:    [B, max_blocks] int32; entries past a sequence's last block are ignored
    context_lens:    [B] tokens each sequence holds *including* this step's
    query_lens:      [B] new tokens per sequence (default all 1: pure decode); sum = N
    blocks_per_tile: blocks read per iteration (1 = one block at a time; default ~128 keys)
    load_tile:       ``load_tile(pool, blk) -> [*blk.shape, block_size, Hkv, D]``, the blocks ``blk`` of a
                     pool (default ``pool[blk]``); a quantized cache dequantizes there (``minikv.quant``)
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
    load = gather_blocks if load_tile is None else load_tile
    state = online_softmax.start((n, hkv, g), d, dt)
    for start in range(0, int(visible.max()), span):
        rows = np.flatnonzero(visible > start)  # queries that see at least one key of this tile
        r = rows.size
        rows = slice(None) if r == n else rows  # all of them: views instead of fancy-indexed copies
        blk = tables[rows, start // bs:start // bs + tile]                   # [R, tile]
        kb = load(k_pool, blk).reshape(r, span, hkv, d).astype(dt, copy=False)  # [R, span, Hkv, D]
        vb = load(v_pool, blk).reshape(r, span, hkv, d).astype(dt, copy=False)
        scores = (qg[rows] @ kb.transpose(0, 2, 3, 1)) * scale               # [R, Hkv, G, span]
        valid = (start + np.arange(span))[None, :] < visible[rows, None]     # [R, span]
        state[rows] = online_softmax.update(state[rows], scores, vb.transpose(0, 2, 1, 3),
                                            valid[:, None, None, :], overwrite=True)
    out = online_softmax.finish(state).reshape(n, hq, d)
    assert out.dtype == dt, out.dtype
    return out


def _whole_tiles(block_tables: np.ndarray, context_lens: np.ndarray, bs: int, tile: int) -> np.ndarray:
    """Block tables [B, width] padded to whole tiles, unused entries pointing at block 0.

    Unused entries may hold anything (-1 padding...); block 0's slots there are masked.
    """
    bsz, width = block_tables.shape
    in_use = np.arange(width)[None, :] < (-(-context_lens // bs))[:, None]
    safe = np.zeros((bsz, -(-width // tile) * tile), dtype=np.int64)
    safe[:, :width] = np.where(in_use, block_tables, 0)
    return safe


class PagedKVCache(KVCacheBase):
    """A KV cache of fixed-size blocks, shared between sequences through block tables.

    num_layers, num_kv_heads, head_dim: the model's geometry (``model.new_cache_args()``)
    num_blocks:       device blocks in the pool (the memory budget)
    block_size:       token slots per block
    dtype:            storage dtype (float64/float32/float16); attention computes in q's dtype
    num_host_blocks:  size of the host-side pool for ``swap_out`` (0: no swapping)
    enable_prefix_caching: reuse cached full blocks across sequences (needs prompt ids)
    hash_fn:          ``hash_fn(prefix_hash, token_ids) -> int`` for prefix blocks (default ``chain_hash``)
    blocks_per_tile:  blocks per online-softmax iteration in ``attend`` (None: ~128 keys; 1: one block)

    Storage: ``k_pool, v_pool: [L, num_blocks, block_size, Hkv, D]`` and the same
    with ``num_host_blocks`` for ``host_k_pool, host_v_pool``.

    A step (``with cache.step(seq_ids, num_new)``) first reserves what it needs
    (``BlockManager.reserve``: new blocks, and a copy of a shared partly filled last
    block); if the pool is short it raises ``OutOfBlocksError`` and changes nothing.
    ``write`` stores K/V through the slot mapping; ``attend`` runs ``paged_attention``.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int = 16, dtype=np.float32, num_host_blocks: int = 0,
                 enable_prefix_caching: bool = True, hash_fn: HashFn | None = None,
                 blocks_per_tile: int | None = None):
        super().__init__(num_layers, num_kv_heads, head_dim, dtype)
        self.blocks = BlockManager(num_blocks, block_size, num_host_blocks, enable_prefix_caching, hash_fn)
        self.allocator, self.host_allocator = self.blocks.allocator, self.blocks.host_allocator
        self.num_blocks, self.block_size = self.allocator.num_blocks, self.allocator.block_size
        self.num_host_blocks = self.blocks.num_host_blocks
        if blocks_per_tile is not None:
            check_int("blocks_per_tile", blocks_per_tile)
        self.blocks_per_tile = blocks_per_tile
        self.k_pool = self._new_pool(self.num_blocks, host=False)
        self.v_pool = self._new_pool(self.num_blocks, host=False)
        self.host_k_pool = self._new_pool(self.num_host_blocks, host=True)
        self.host_v_pool = self._new_pool(self.num_host_blocks, host=True)
        self._slots: np.ndarray | None = None        # [N] int64 slots of the open step's new tokens
        self._step_tables: np.ndarray | None = None  # [B, max_blocks] int32 block tables of the open step

    # -- storage hooks: the only places outside write/attend that touch K/V numbers ---------
    # A device cache (minikv_gpu.paged) overrides these four (and write/attend), inheriting the rest.
    def _new_pool(self, num_blocks: int, host: bool):
        """A zeroed pool ``[L, num_blocks, block_size, Hkv, D]`` (``host``: the swap target)."""
        shape = (self.num_layers, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        return np.zeros(shape, dtype=self.dtype)

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: device block ``src`` -> ``dst`` for every (src, dst) pair, all layers, K and V.

        No block is both a source and a destination (a destination is freshly allocated).
        """
        src, dst = (np.asarray(ids, dtype=np.int64) for ids in zip(*pairs))
        self.k_pool[:, dst] = self.k_pool[:, src]
        self.v_pool[:, dst] = self.v_pool[:, src]

    def _swap_out_blocks(self, dev: list[int], host: list[int]) -> None:
        """Copy device blocks ``dev[i]`` to host blocks ``host[i]`` (all layers, K and V)."""
        self.host_k_pool[:, host] = self.k_pool[:, dev]
        self.host_v_pool[:, host] = self.v_pool[:, dev]

    def _swap_in_blocks(self, host: list[int], dev: list[int]) -> None:
        """Copy host blocks ``host[i]`` to device blocks ``dev[i]`` (all layers, K and V)."""
        self.k_pool[:, dev] = self.host_k_pool[:, host]
        self.v_pool[:, dev] = self.host_v_pool[:, host]

    # -- the step: reserve through the manager, then write and attend -----------------------------
    def _reserve(self, step: Step) -> None:
        plan = self.blocks.reserve(step)
        if plan.copies:  # before any write: the step writes every layer of the copied block
            self._copy_blocks(plan.copies)
        self._slots = np.concatenate([slot_mapping(t, np.arange(p, p + n), self.block_size)
                                      for t, p, n in zip(plan.tables, step.past, step.num_new, strict=True)])
        self._step_tables = np.zeros((len(plan.tables), max(len(t) for t in plan.tables)), dtype=np.int32)
        for i, t in enumerate(plan.tables):
            self._step_tables[i, :len(t)] = t

    def _commit(self, step: Step) -> None:
        self.blocks.commit(step)
        self._end()

    def _rollback(self, step: Step) -> None:
        self.blocks.rollback()
        self._end()

    def _end(self) -> None:
        self._slots, self._step_tables = None, None

    def _truncate(self, seq_id, new_len: int) -> None:  # the manager's bookkeeping, then a shared last block's copy
        for pair in self.blocks.truncate(seq_id, new_len):
            self._copy_blocks([pair])

    def slot_mapping(self) -> np.ndarray:
        """Slots of the open step's packed new tokens: int64 [N]."""
        self._require_step()
        return self._slots

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store the step's new K/V (k, v: [N, Hkv, D]) into their slots of layer ``layer``'s pool."""
        self._check_layer(layer)
        self._check_rows("k", k, self.num_kv_heads)
        self._check_rows("v", v, self.num_kv_heads)
        flat = (self.num_blocks * self.block_size, self.num_kv_heads, self.head_dim)
        # a reshape of one layer of a C-contiguous pool is a view: these stores land in the pool
        self.k_pool[layer].reshape(flat)[self._slots] = k
        self.v_pool[layer].reshape(flat)[self._slots] = v

    def attend(self, layer: int, q: np.ndarray) -> np.ndarray:
        """Paged attention of the step's queries (q: [N, Hq, D]) over each sequence's blocks -> [N, Hq, D]."""
        step = self._check_query(layer, q)
        return paged_attention(q, self.k_pool[layer], self.v_pool[layer], self._step_tables,
                               step.past + step.num_new, step.num_new, self.blocks_per_tile)

    # -- sequences: bookkeeping by the block manager, block copies here ---------------------------
    def add_sequence(self, seq_id, prompt_ids: Sequence[int] | None = None) -> int:
        """Start a sequence; return how many leading prompt tokens are already cached.

        With ``prompt_ids`` (the tokens you are about to feed) the prefix cache
        is searched: the returned ``n`` tokens already have K/V, so run the model
        on ``prompt_ids[n:]`` only. ``n`` is a multiple of ``block_size`` and
        always < len(prompt_ids). Without ids nothing is shared (returns 0).
        """
        return self.blocks.add_sequence(seq_id, prompt_ids)

    def try_add_sequence(self, seq_id, prompt_ids: Sequence[int], free_blocks: int) -> tuple[int, int] | None:
        """``add_sequence`` only if its prefill fits in ``free_blocks``: (cached tokens, blocks consumed) or None."""
        return self.blocks.admit(seq_id, prompt_ids, free_blocks)

    def free_sequence(self, seq_id) -> None:
        """Drop a sequence; its blocks return to the pool (full registered ones stay cached until evicted)."""
        self.blocks.free_sequence(seq_id)

    def fork(self, parent_id, child_id) -> None:
        """Make ``child_id`` share all of ``parent_id``'s blocks (copy-on-write on the first write)."""
        self.blocks.fork(parent_id, child_id)

    def swap_out(self, seq_id) -> None:
        """Copy a sequence's blocks to the host pool and free its device blocks (preemption by swap).

        Raises OutOfBlocksError (changing nothing) if the host pool is too small.
        Each block is copied, shared or not; after ``swap_in`` the sequence owns
        private copies (a simplification: vLLM maps shared blocks once).
        """
        self._swap_out_blocks(*self.blocks.swap_out(seq_id))

    def swap_in(self, seq_id) -> None:
        """Bring a swapped-out sequence back into fresh device blocks. OutOfBlocksError changes nothing."""
        self._swap_in_blocks(*self.blocks.swap_in(seq_id))

    def extend_token_ids(self, seq_id, token_ids: Sequence[int]) -> None:
        """Declare the ids of tokens about to be fed (e.g. a sampled token) so full blocks can be shared."""
        self.blocks.extend_token_ids(seq_id, token_ids)

    def admission_cost(self, prompt_ids: Sequence[int]) -> int:
        """Free blocks that ``add_sequence(prompt_ids)`` plus a prefill of the rest would consume."""
        return self.blocks.admission_cost(prompt_ids)

    def num_blocks_held(self, seq_id) -> int:
        """Blocks the sequence holds (on the device, or on the host while swapped out); a block an evicting
        cache gave back (a hole in its table) does not count."""
        s = self.blocks.state(seq_id)
        table = s.block_table if s.host_table is None else s.host_table
        return sum(1 for b in table if b != HOLE)

    def peak_blocks(self, prompt_len: int, longest: int) -> int:
        """The most blocks one sequence can hold at once on its way to ``longest`` tokens (admission's bound)."""
        return num_blocks_for(longest, self.block_size)

    def blocks_needed(self, seq_ids: Sequence, num_new: Sequence[int]) -> int:
        """Free blocks a step with these sequences would consume (new blocks + copy-on-write copies)."""
        return self.blocks.blocks_needed(seq_ids, num_new)

    def __contains__(self, seq_id) -> bool:
        return seq_id in self.blocks.seqs

    def seq_ids(self) -> list:
        return list(self.blocks.seqs)

    def length(self, seq_id) -> int:
        return self.blocks.state(seq_id).length

    def block_table(self, seq_id) -> np.ndarray:
        """The sequence's block table: int32 [ceil(length / block_size)] (empty while swapped out)."""
        return np.asarray(self.blocks.state(seq_id).block_table, dtype=np.int32)

    def host_block_table(self, seq_id) -> np.ndarray | None:
        """Host blocks holding the sequence while it is swapped out, else None."""
        s = self.blocks.state(seq_id)
        return None if s.host_table is None else np.asarray(s.host_table, dtype=np.int32)

    def is_swapped(self, seq_id) -> bool:
        return self.blocks.state(seq_id).host_table is not None

    @property
    def enable_prefix_caching(self) -> bool:
        return self.allocator.enable_prefix_caching

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    # counters kept by the manager, read here by benchmarks and tests
    cow_copies = property(lambda self: self.blocks.cow_copies)
    prefix_query_tokens = property(lambda self: self.blocks.prefix_query_tokens)
    prefix_hit_tokens = property(lambda self: self.blocks.prefix_hit_tokens)
    swap_outs = property(lambda self: self.blocks.swap_outs)
    swap_ins = property(lambda self: self.blocks.swap_ins)

    # -- inspection -------------------------------------------------------------------------------
    def read_kv(self, seq_id, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """The sequence's stored history gathered into k, v: [length, Hkv, D] (tests and debugging only)."""
        self._check_layer(layer)
        s = self.blocks.state(seq_id)
        table, kp, vp = s.block_table, self.k_pool, self.v_pool
        if s.host_table is not None:
            table, kp, vp = s.host_table, self.host_k_pool, self.host_v_pool
        slots = slot_mapping(table, np.arange(s.length), self.block_size)
        flat = (-1, self.num_kv_heads, self.head_dim)
        return kp[layer].reshape(flat)[slots], vp[layer].reshape(flat)[slots]

    def memory_stats(self) -> dict:
        """Where the device pool's token slots are right now.

        blocks_in_use:   blocks held by at least one sequence
        slots_allocated: blocks_in_use * block_size
        slots_used:      slots holding a real token (a shared block counts once)
        internal_waste:  slots_allocated - slots_used (empty tails of last blocks)
        utilization:     slots_used / slots_allocated (1.0 when nothing is allocated)
        cached_free_blocks: freed blocks still in the prefix cache (free, but reusable by a hit)
        """
        used = sum(self.blocks.slots_filled().values())
        alloc = self.allocator.num_used * self.block_size
        return {"blocks_in_use": self.allocator.num_used, "slots_allocated": alloc, "slots_used": used,
                "internal_waste": alloc - used, "utilization": used / alloc if alloc else 1.0,
                "cached_free_blocks": len(self.allocator.cached_block_ids()),
                "free_blocks": self.allocator.num_free}

    def bytes_allocated(self) -> int:
        """Bytes of the whole device pool (preallocated once, handed out block by block)."""
        return self.k_pool.nbytes + self.v_pool.nbytes

    def bytes_used(self) -> int:
        """Bytes holding real tokens (shared blocks counted once)."""
        return self.memory_stats()["slots_used"] * self.bytes_per_token()


# --- the small pieces paged_attention is made of --------------------------------------------------

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
    need = -(-context_lens // bs)
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
