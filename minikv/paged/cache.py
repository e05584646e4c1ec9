"""Step 3, the cache: pools of fixed-size blocks, written through the slot mapping, read by paged attention.

Why pages
---------
A contiguous cache (step 2) gives every sequence one slab of ``max_len``
positions up front. Most of that slab waits for tokens that may never come
(*reservation* waste), and slabs of different sizes leave holes between them
(*external* fragmentation). A paged cache cuts memory into small fixed-size
**blocks** of ``block_size`` token slots and hands them out one at a time, as a
sequence grows. The only waste left is the unfilled tail of each sequence's
last block (*internal* waste, fewer than ``block_size`` slots per sequence).

Who owns what
-------------
Short modules, each with one job:

* ``minikv.paged.allocator``: block ids, ref counts, chained hashes, the prefix
  cache and its LRU list (prefix sharing is explained there);
* ``minikv.paged.manager``: per-sequence block tables, admission, fork with
  copy-on-write, swap plans, step reserve/commit/rollback. It returns copy plans;
* ``minikv.paged.attention``: the layout, the slot mapping and ``paged_attention``;
* this module: the pools and the only code that touches K/V numbers — the
  storage hooks, ``write`` (through the slot mapping) and ``attend``
  (``paged_attention``). ``PagedKVCache`` plugs into the model through
  ``KVCacheBase``'s ``step / write / attend`` seam like every other cache, and
  forwards the bookkeeping questions to its ``BlockManager``.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from minikv.errors import check_int, check_memory
from minikv.kv_cache import KVCacheBase, Step
from minikv.paged.allocator import HashFn, num_blocks_for
from minikv.paged.attention import paged_attention, slot_mapping
from minikv.paged.manager import BlockManager
from minikv.paged.truncate import truncate_table

# what one block costs in Python besides its K/V numbers: a ``Block`` object and its place in the free list
BLOCK_BOOKKEEPING_BYTES = 256


def check_pool_memory(num_layers: int, num_kv_heads: int, head_dim: int, num_blocks, block_size, dtype,
                      num_host_blocks=0, names: dict | None = None) -> None:
    """Refuse (ConfigError) pools that would not fit in the memory available now, before anything per block
    is built, naming the argument that outgrew it: ``block_size`` (one block alone), then ``num_blocks``,
    then ``num_host_blocks`` on top of the device pool. ``names`` maps those arguments to what the user
    typed (a CLI flag)."""
    names = {"block_size": "block_size", "num_blocks": "num_blocks", "num_host_blocks": "num_host_blocks",
             **(names or {})}
    block_size, num_blocks = check_int(names["block_size"], block_size), check_int(names["num_blocks"], num_blocks)
    num_host_blocks = check_int(names["num_host_blocks"], num_host_blocks, minimum=0)
    per_slot = 2 * num_layers * num_kv_heads * head_dim * np.dtype(dtype).itemsize  # K and V, every layer
    check_memory(names["block_size"], block_size, per_slot, fixed=BLOCK_BOOKKEEPING_BYTES, what="one K/V block")
    per_block = per_slot * block_size + BLOCK_BOOKKEEPING_BYTES
    check_memory(names["num_blocks"], num_blocks, per_block, what=f"a pool of {num_blocks:,} K/V blocks")
    check_memory(names["num_host_blocks"], num_host_blocks, per_block, fixed=num_blocks * per_block,
                 what=f"K/V pools of {num_blocks:,} device + {num_host_blocks:,} host blocks")


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
        check_pool_memory(num_layers, num_kv_heads, head_dim, num_blocks, block_size, self.dtype, num_host_blocks)
        self.blocks = self._new_manager(num_blocks, block_size, num_host_blocks, enable_prefix_caching, hash_fn)
        self.num_blocks, self.block_size = self.blocks.allocator.num_blocks, self.blocks.block_size
        self.num_host_blocks = self.blocks.num_host_blocks
        if blocks_per_tile is not None:
            check_int("blocks_per_tile", blocks_per_tile)
        self.blocks_per_tile = blocks_per_tile
        self.k_pool, self.v_pool = self._new_store(self.num_blocks, host=False)
        self.host_k_pool, self.host_v_pool = self._new_store(self.num_host_blocks, host=True)
        self._slots: np.ndarray | None = None        # [N] int64 slots of the open step's new tokens
        self._step_tables: np.ndarray | None = None  # [B, max_blocks] int32 block tables of the open step

    def _new_manager(self, *args) -> BlockManager:
        """The bookkeeping (a step-6 cache gives it holes: ``minikv.window.manager``)."""
        return BlockManager(*args)

    # -- storage hooks: the only places outside write/attend that touch K/V numbers ---------
    # A device cache (minikv_gpu.paged) overrides these four (and write/attend), inheriting the rest.
    def _new_store(self, num_blocks: int, host: bool) -> tuple:
        """The zeroed K and V pools, each ``[L, num_blocks, block_size, Hkv, D]`` (``host``: the swap target)."""
        shape = (self.num_layers, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        return np.zeros(shape, dtype=self.dtype), np.zeros(shape, dtype=self.dtype)

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

    def _truncate(self, seq_id, new_len: int) -> None:
        """Step 7's rollback (``minikv.paged.truncate``): the table's bookkeeping, then a shared last block's copy."""
        for pair in truncate_table(self.blocks, seq_id, new_len):
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

    def attend(self, layer: int, q: np.ndarray, sinks: np.ndarray | None = None,
               softcap: float | None = None) -> np.ndarray:
        """Paged attention of the step's queries (q: [N, Hq, D]) over each sequence's blocks -> [N, Hq, D]
        (sinks [Hq], softcap: ``minikv.online_softmax``'s options)."""
        step = self._check_query(layer, q)
        return paged_attention(q, self.k_pool[layer], self.v_pool[layer], self._step_tables,
                               step.past + step.num_new, step.num_new, self.blocks_per_tile,
                               sinks=sinks, softcap=softcap)

    # -- sequences: bookkeeping by the block manager (``cache.blocks``: ask it the scheduler's questions),
    #    block copies here
    def add_sequence(self, seq_id, prompt_ids: Sequence[int] | None = None) -> int:
        """Start a sequence; return how many leading prompt tokens are already cached.

        With ``prompt_ids`` (the tokens you are about to feed) the prefix cache
        is searched: the returned ``n`` tokens already have K/V, so run the model
        on ``prompt_ids[n:]`` only. ``n`` is a multiple of ``block_size`` and
        always < len(prompt_ids). Without ids nothing is shared (returns 0).
        """
        return self.blocks.add_sequence(seq_id, prompt_ids)

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

    def peak_blocks(self, prompt_len: int, longest: int) -> int:
        """The most blocks one sequence can hold at once on its way to ``longest`` tokens (admission's bound)."""
        return num_blocks_for(longest, self.block_size)

    def __contains__(self, seq_id) -> bool:
        return seq_id in self.blocks.seqs

    def seq_ids(self) -> list:
        return list(self.blocks.seqs)

    def length(self, seq_id) -> int:
        return self.blocks.state(seq_id).length

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
        a = self.blocks.allocator
        used = sum(self.blocks.slots_filled().values())
        alloc = a.num_used * self.block_size
        return {"blocks_in_use": a.num_used, "slots_allocated": alloc, "slots_used": used,
                "internal_waste": alloc - used, "utilization": used / alloc if alloc else 1.0,
                "cached_free_blocks": len(a.cached_block_ids()), "free_blocks": a.num_free}

    def bytes_allocated(self) -> int:
        """Bytes of the whole device pool (preallocated once, handed out block by block)."""
        return self.k_pool.nbytes + self.v_pool.nbytes

    def bytes_used(self) -> int:
        """Bytes holding real tokens (shared blocks counted once)."""
        return self.memory_stats()["slots_used"] * self.bytes_per_token()
