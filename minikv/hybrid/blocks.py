"""Step 9, the hybrid paged cache: one pool, a block table per group, the scheduler's questions over all groups.

``HybridPagedKVCache`` is vLLM's hybrid KV-cache manager in miniature: the layers form groups of one
size (``minikv.hybrid.pool.group_layers``), each group a paged cache with its own block tables
(``minikv.hybrid.paged``), all of them allocating from one pool. To the scheduler it is one
``PagedKVCache``: ``cache.blocks`` (a ``HybridBlocks``) answers its questions over every group:

* ``num_free``: the pool's free blocks (any group can take any of them);
* ``blocks_needed(seq_ids, num_new)``: the sum of every group's new blocks and copies for a step;
* ``admit(seq_id, prompt, free)``: the prefix hit chosen over all groups, and its cost in blocks
  (each group's new blocks for the uncached part, less the blocks a sliding group does not need);
* ``held(seq_id)``, ``extend_token_ids``: summed, or told to every group.

Preemption by recompute works as for any paged cache (``free_sequence`` gives every group's blocks
back); swapping is refused: the hybrid pool has no host pool (``preemption="recompute"``).

The prefix hit over all groups (``HybridBlocks.prefix_hit``)
------------------------------------------------------------
1. every full group matches its chain left to right (step 3b); the hit is the shortest of them, and
   leaves at least one token to run;
2. every sliding group needs only the blocks of the last W - 1 tokens before the hit point h, found as
   twins of the anchor's blocks (``GroupAllocator.twin``); the blocks before them are not needed;
3. if a sliding group misses a block at index j, no hit that needs block j can work: the hit drops to
   j blocks and the groups are asked again (vLLM scans the sliding window right to left the same way).

The hit (``HybridHit``) says which blocks each group reuses: a full group blocks 0 .. n - 1, a
sliding group blocks ``first`` .. n - 1 (the ones before are ``HOLE``s: kept blocks are reused,
nothing is recomputed; a window whose blocks were evicted makes the hit shorter).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from minikv.errors import ConfigError, InvalidInputError, OutOfBlocksError, check_int
from minikv.hybrid.groups import HybridKVCache
from minikv.hybrid.paged import GroupBlockManager, GroupPagedKVCache, SlidingBlockManager, SlidingPagedKVCache
from minikv.hybrid.pool import SharedPool, group_layers
from minikv.kv_cache import KVCacheBase
from minikv.paged.allocator import num_blocks_for
from minikv.paged.cache import PagedKVCache, check_pool_memory
from minikv.paged.manager import _token_list
from minikv.window.manager import HOLE


@dataclass
class HybridHit:
    """What a prefix hit reuses, group by group (in the order of ``HybridPagedKVCache.groups``).

    tokens: the cached tokens h, a multiple of block_size (the model runs the prompt from h on)
    tables: per group, its block table at the hit: block ids, ``HOLE`` where a sliding group needs none
    first:  per group, the first block reused (0 for a full group; the window's first for a sliding one)
    """

    tokens: int
    tables: list
    first: list

    def describe(self, block_size: int) -> list[str]:
        """One line per group: which blocks it reuses and which it does not need."""
        out = []
        for table, lo in zip(self.tables, self.first):
            n = len(table)
            kept = f"blocks {lo}..{n - 1} reused" if n > lo else "no block reused"
            skipped = f", blocks 0..{lo - 1} not needed (before the window)" if lo else ""
            out.append(f"{kept}{skipped} (tokens {lo * block_size}..{n * block_size - 1})")
        return out


class HybridBlocks:
    """``cache.blocks`` of a ``HybridPagedKVCache``: the scheduler's questions, answered over every group.

    managers: [(window W or None, the group's manager)], full groups first; the first full one is the anchor
    """

    host_allocator = None  # no host pool: the scheduler then preempts by recompute
    num_host_blocks = 0

    def __init__(self, pool: SharedPool, managers: list, block_size: int):
        self.pool, self.managers, self.block_size = pool, managers, block_size
        full = [m for w, m in managers if w is None]
        self.anchor = full[0] if full else None
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    @property
    def seqs(self) -> dict:
        return self.managers[0][1].seqs

    @property
    def num_free(self) -> int:
        """Blocks any group can take (plain free and cached-free)."""
        return self.pool.num_free

    def state(self, seq_id):
        return self.managers[0][1].state(seq_id)

    # -- the prefix hit over all groups (see the module docstring) ---------------------------------
    def prefix_hit(self, token_ids: Sequence[int]) -> HybridHit:
        """The blocks every group reuses for a prompt; at least one token is always left to run."""
        tokens, bs = _token_list(token_ids), self.block_size
        none = HybridHit(0, [[] for _ in self.managers], [0] * len(self.managers))
        if self.anchor is None or not self.anchor.allocator.enable_prefix_caching:
            return none
        chains = {id(m): m.allocator.match(tokens) for w, m in self.managers if w is None}
        n = min(len(chain) for chain in chains.values())
        n -= n * bs >= len(tokens)
        anchors = [self.anchor.allocator.blocks[b] for b in chains[id(self.anchor)][:n]]
        while n > 0:
            tables, first = [], []
            for w, m in self.managers:
                lo = 0 if w is None else m.first_needed(n)
                got, missing = (chains[id(m)][:n], n) if w is None else m.twins(anchors, tokens, lo, n)
                if got is None:
                    break
                tables.append([HOLE] * lo + got)
                first.append(lo)
            else:
                return HybridHit(n * bs, tables, first)
            n = missing  # every hit that needs block `missing` fails: try the longest that does not
        return none

    def _cost(self, tokens: list, hit: HybridHit) -> int:
        """Free blocks an admission takes: per group, blocks for the prompt, less the holes, less live hit blocks."""
        need, cost = num_blocks_for(len(tokens), self.block_size), 0
        for (_, m), table in zip(self.managers, hit.tables):
            live = sum(1 for b in table if b != HOLE and m.allocator.blocks[b].ref_count > 0)
            cost += need - table.count(HOLE) - live
        return cost

    def can_admit(self, prompt_ids: Sequence[int], free_blocks: int) -> bool:
        tokens = _token_list(prompt_ids)
        return self._cost(tokens, self.prefix_hit(tokens)) <= free_blocks

    def admit(self, seq_id, prompt_ids: Sequence[int], free_blocks: int) -> tuple[int, int] | None:
        """Add the sequence to every group if its prompt fits in ``free_blocks``: (cached tokens, blocks taken),
        or None (nothing changed)."""
        self.managers[0][1].check_new(seq_id)
        tokens = _token_list(prompt_ids)
        hit = self.prefix_hit(tokens)
        cost = self._cost(tokens, hit)
        if cost > free_blocks:
            return None
        return self._attach(seq_id, tokens, hit), cost

    def add_sequence(self, seq_id, prompt_ids: Sequence[int] | None = None) -> int:
        """Start a sequence in every group; with ``prompt_ids``, on its prefix hit. Returns the cached tokens."""
        self.managers[0][1].check_new(seq_id)
        if prompt_ids is None:
            return self._attach(seq_id, None, HybridHit(0, [[] for _ in self.managers], [0] * len(self.managers)))
        tokens = _token_list(prompt_ids)
        return self._attach(seq_id, tokens, self.prefix_hit(tokens))

    def _attach(self, seq_id, tokens: list | None, hit: HybridHit) -> int:
        for (_, m), table in zip(self.managers, hit.tables):
            m.attach(seq_id, None if tokens is None else list(tokens), table)  # each group extends its own list
        if tokens is not None and self.anchor is not None and self.anchor.allocator.enable_prefix_caching:
            self.prefix_query_tokens += len(tokens)
            self.prefix_hit_tokens += hit.tokens
        return hit.tokens

    # -- the rest of the scheduler's questions: summed over the groups -------------------------------
    def blocks_needed(self, seq_ids: Sequence, num_new: Sequence[int]) -> int:
        return sum(m.blocks_needed(seq_ids, num_new) for _, m in self.managers)

    def held(self, seq_id) -> int:
        return sum(m.held(seq_id) for _, m in self.managers)

    def extend_token_ids(self, seq_id, token_ids: Sequence[int]) -> None:
        for _, m in self.managers:
            m.extend_token_ids(seq_id, token_ids)

    def fork(self, parent_id, child_id) -> None:
        for _, m in self.managers:  # the first one checks both ids; a fork allocates nothing, so none can fail after
            m.fork(parent_id, child_id)

    def check(self) -> None:
        """Assert the pool's and every group's invariants (tests)."""
        self.pool.check([m.allocator for _, m in self.managers])


class HybridPagedKVCache(HybridKVCache, PagedKVCache):
    """A hybrid model's paged cache: groups of S layers (full groups first), one pool, a block table per group.

    windows:    [L] each layer's window (None: full attention), ``ModelConfig.layer_windows``
    num_blocks, block_size: the pool; a block holds S layers x block_size tokens of K and of V
    rollback:   K, the tokens a truncate may take back after a sliding ring wrapped (``minikv.hybrid.ring``)
    enable_prefix_caching, sliding_rule: the prefix cache, and its rule for sliding groups
    (False: step 6's "evicted means unshareable", for comparison)

    Storage: ``k_pool, v_pool: [S, num_blocks, block_size, Hkv, D]``; group g's layer j is ``k_pool[j]`` at its
    blocks. It is a ``PagedKVCache`` for the scheduler (``blocks``, ``num_blocks``, ``block_size``,
    ``peak_blocks``, ``memory_stats``) and a ``HybridKVCache`` for the model (one step over every group).
    """

    def __init__(self, windows: Sequence[int | None], num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int = 16, dtype=np.float32, rollback: int = 0, enable_prefix_caching: bool = True,
                 sliding_rule: bool = True, blocks_per_tile: int | None = None):
        windows = tuple(windows)
        KVCacheBase.__init__(self, len(windows), num_kv_heads, head_dim, dtype)  # checks the geometry first
        self.num_blocks = check_int("num_blocks", num_blocks)
        self.block_size = check_int("block_size", block_size)
        self.blocks_per_tile, self.num_host_blocks, self.rollback = blocks_per_tile, 0, rollback
        plan = group_layers(windows)
        depth = max(len(layers) for _, layers in plan)  # a block holds the largest group's layers
        check_pool_memory(depth, num_kv_heads, head_dim, self.num_blocks, self.block_size, self.dtype)
        pool = SharedPool(self.num_blocks)  # (its free list alone is 2^31 entries for num_blocks = 2^31 - 1)
        shape = (depth, self.num_blocks, self.block_size, num_kv_heads, head_dim)
        self.k_pool, self.v_pool = np.zeros(shape, self.dtype), np.zeros(shape, self.dtype)
        managers, groups, anchor = [], [], None
        for w, layers in plan:
            storage = (self.k_pool[:len(layers)], self.v_pool[:len(layers)])
            if w is None:
                m = GroupBlockManager(pool, self.block_size, enable_prefix_caching)
                anchor = anchor or m
                cache = GroupPagedKVCache(num_kv_heads, head_dim, storage, m, blocks_per_tile)
            else:
                m = SlidingBlockManager(pool, self.block_size, w, rollback, anchor, enable_prefix_caching,
                                        sliding_rule)
                cache = SlidingPagedKVCache(num_kv_heads, head_dim, storage, m, blocks_per_tile)
            managers.append((w, m))
            groups.append((layers, cache))
        HybridKVCache.__init__(self, groups, num_kv_heads, head_dim, dtype)
        self.blocks = HybridBlocks(pool, managers, self.block_size)

    def add_sequence(self, seq_id, prompt_ids: Sequence[int] | None = None) -> int:
        """Start a sequence in every group; with ``prompt_ids`` on its prefix hit (``HybridBlocks.prefix_hit``):
        returns the cached tokens n, so run the model on ``prompt_ids[n:]``."""
        return self.blocks.add_sequence(seq_id, prompt_ids)

    def fork(self, parent_id, child_id) -> None:
        self.blocks.fork(parent_id, child_id)

    def swap_out(self, seq_id) -> None:
        raise ConfigError("a hybrid paged cache has no host pool to swap to; preempt by recompute "
                          "(Scheduler(preemption='recompute'))")

    swap_in = swap_out

    def _truncate(self, seq_id, new_len: int) -> None:
        """Every group's refusal first, then the pool: shared last blocks to copy must fit after the drops."""
        caches = [cache for _, cache in self.groups]
        for cache in caches:
            error = cache.refusal(seq_id, new_len)
            if error is not None:
                raise error
        plans = [cache.copies_needed(seq_id, new_len) for cache in caches]
        copies, freed = sum(p[0] for p in plans), sum(p[1] for p in plans)
        if copies > self.blocks.num_free + freed:
            raise OutOfBlocksError(f"truncating {seq_id!r} to {new_len} tokens must copy {copies} shared last "
                                   f"blocks, but only {self.blocks.num_free + freed} would be free; free or preempt "
                                   "a sequence first")
        for cache, _ in sorted(zip(caches, plans), key=lambda cp: cp[1][0]):  # the groups that copy go last
            cache.truncate(seq_id, new_len)

    def peak_blocks(self, prompt_len: int, longest: int) -> int:
        """The most blocks one sequence holds at once, over every group (admission's bound)."""
        return sum(cache.peak_blocks(prompt_len, longest) for _, cache in self.groups)

    def read_kv(self, seq_id, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Layer ``layer``'s stored history of a sequence, [length, Hkv, D] each (a full layer's; tests)."""
        self._check_layer(layer)
        cache, j = self._where[layer]
        return cache.read_kv(seq_id, j)

    def memory_stats(self) -> dict:
        """The pool's picture in block rows (a row: one token of the S layers of a block).

        blocks_in_use, slots_allocated (blocks_in_use x block_size), slots_used (rows some sequence still
        reads: every token of a full group, the W - 1 + K newest of a sliding one; a shared block once),
        internal_waste (the rest of the blocks in use), utilization, cached_free_blocks, free_blocks,
        groups: per group its window, layers, blocks held and rows still read.
        """
        used = self.num_blocks - self.blocks.num_free
        groups = [{"window": getattr(getattr(c, "policy", None), "window", None), "layers": list(layers),
                   "blocks": len(c.blocks.slots_filled()), "slots_used": int(c.alive_slots().size)}
                  for layers, c in self.groups]
        rows, alloc = sum(g["slots_used"] for g in groups), used * self.block_size
        return {"blocks_in_use": used, "slots_allocated": alloc, "slots_used": rows, "internal_waste": alloc - rows,
                "utilization": rows / alloc if alloc else 1.0, "cached_free_blocks": len(self.blocks.pool.cached),
                "free_blocks": self.blocks.num_free, "groups": groups}

    def bytes_allocated(self) -> int:
        """Bytes of the whole pool (preallocated once, handed out block by block)."""
        return self.k_pool.nbytes + self.v_pool.nbytes

    def block_bytes(self) -> int:
        """Bytes of one block: K and V of S layers x block_size tokens."""
        return self.bytes_allocated() // self.num_blocks

    def slot_mapping(self) -> np.ndarray:
        raise InvalidInputError("a hybrid paged cache maps each group's tokens through its own table; ask a "
                                "group: cache.groups[g][1].slot_mapping()")
