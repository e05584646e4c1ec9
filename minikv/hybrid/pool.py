"""Step 9, the pool: one set of block ids for every group of a hybrid model, and how layers form groups.

vLLM's hybrid KV-cache manager (``vllm/v1/core/kv_cache_utils.py``, ``_get_kv_cache_groups_uniform_page_size``)
cuts the layers of each kind into *groups of the same size* S and gives every group its own block
table over one shared pool of blocks. A block is storage for S layers x ``block_size`` tokens, so
any free block can serve any group: a full group's blocks grow with the text, a sliding group's
go back to the pool as the window slides, and the room they free admits other sequences.

    Gemma-3-270m: 15 sliding layers, 3 full ones -> S = 3, six groups of three layers:
    full (5, 11, 17) and five sliding groups; storage ``k_pool: [S, num_blocks, block_size, Hkv, D]``.

The group size (``group_layers``): the count of the rarest kind of layer, or that of the commonest
when the two are within 1.5x (vLLM's rule); a kind whose count S does not divide leaves its last
groups one layer short (vLLM pads them: the slots are allocated and never written). Layers join
the groups of their kind in turn (``layers[i::groups]``), as vLLM assigns them.

One pool, several prefix caches
-------------------------------
Each group keeps its own ``BlockAllocator`` (``GroupAllocator``): its own ``Block`` records, ref
counts and hash table, because a block's K/V belong to the layers of one group, and a hit must
find the same group's blocks. The free list and the cached-free LRU list are shared: every
allocator hands out the same ids, and a cached-free block of one group can be evicted by an
allocation of another. The pool remembers which group last took each block (``owner``), and
that group drops it from its hash table before the other takes it.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Sequence

from minikv.errors import check_int
from minikv.paged.allocator import Block, BlockAllocator


def group_layers(windows: Sequence[int | None]) -> list[tuple[int | None, tuple]]:
    """[(window W or None, layers)] per group: groups of one size S, layers of one window each.

    windows: [L] per layer (``ModelConfig.layer_windows``). Full groups come first: their blocks
    anchor the sliding groups' prefix cache (``minikv.hybrid.paged``).
    """
    kinds: dict = {}
    for layer, w in enumerate(windows):
        kinds.setdefault(w, []).append(layer)
    counts = [len(layers) for layers in kinds.values()]
    size = max(counts) if max(counts) < 1.5 * min(counts) else min(counts)
    groups = []
    for w in sorted(kinds, key=lambda w: (w is not None, w or 0)):
        layers = kinds[w]
        n = -(-len(layers) // size)
        groups += [(w, tuple(layers[i::n])) for i in range(n)]
    return groups


class SharedPool:
    """What every group allocator shares: the free list, the cached-free LRU list, the owner of each block."""

    def __init__(self, num_blocks: int):
        self.num_blocks = check_int("num_blocks", num_blocks)
        self.free: deque = deque(range(self.num_blocks))
        self.cached: OrderedDict = OrderedDict()  # cached-free block ids, least recently freed first
        self.owner: list = [None] * self.num_blocks  # the allocator that last handed out each block

    @property
    def num_free(self) -> int:
        return len(self.free) + len(self.cached)

    def check(self, allocators: Sequence["GroupAllocator"]) -> None:
        """Assert the pool's invariants (tests): every block is free, cached-free, or held by one group."""
        free, cached = list(self.free), list(self.cached)
        assert len(set(free)) == len(free) and not set(free) & set(cached), "a block is twice in the free lists"
        held: dict = {}
        for a in allocators:
            for b in a.blocks:
                if b.ref_count > 0:
                    assert b.block_id not in held, f"block {b.block_id} is held by two groups"
                    assert self.owner[b.block_id] is a, f"block {b.block_id} is held by a group that does not own it"
                    held[b.block_id] = a
            a.check()
        assert set(held) | set(free) | set(cached) == set(range(self.num_blocks)), "a block was lost"
        assert not set(held) & (set(free) | set(cached)), "a held block is also free"


class GroupAllocator(BlockAllocator):
    """A ``BlockAllocator`` for one group over a ``SharedPool``: its own blocks' records and hash table,
    the pool's free lists. ``hash_fn`` and prefix caching as in ``BlockAllocator``."""

    def __init__(self, pool: SharedPool, block_size: int, enable_prefix_caching: bool = True, hash_fn=None):
        super().__init__(pool.num_blocks, block_size, enable_prefix_caching, hash_fn)
        self.pool = pool
        self._free, self._cached_free = pool.free, pool.cached  # shared: a free block is free for every group

    def allocate(self) -> int:
        """A free block for this group; the least recently freed cached block of *any* group when none is plain free."""
        if not self._free and self._cached_free:
            owner = self.pool.owner[next(iter(self._cached_free))]
            if owner is not self:
                owner._give_back_lru()
        bid = super().allocate()
        self.pool.owner[bid] = self
        return bid

    def _give_back_lru(self) -> None:
        """Evict this group's block at the head of the shared LRU list to the front of the free list."""
        bid, _ = self._cached_free.popitem(last=False)
        b = self.blocks[bid]
        del self._table[b.hash]
        b.forget()
        self.evictions += 1
        self._free.appendleft(bid)

    def register_twin(self, block_id: int, anchor: Block, token_ids: Sequence[int]) -> None:
        """Enter a sliding group's full block under the hash of the anchor group's block at the same index.

        The anchor (a full group's block, registered) holds the same positions; its chain has proved
        the whole prefix. ``parent`` records the anchor's identity, which a hit compares (``twin``),
        so a hit never rests on a hash alone. An older entry under the same hash is dropped.
        """
        b = self.blocks[self._check_id(block_id)]
        if not self.enable_prefix_caching or b.hash is not None or anchor.hash is None:
            return
        old = self._table.get(anchor.hash)
        if old is not None:
            self.drop(old)
        b.hash, b.token_ids, b.parent, b.canon = anchor.hash, tuple(int(t) for t in token_ids), anchor.canon, b.identity
        self._table[b.hash] = b.block_id

    def drop(self, block_id: int) -> None:
        """Take a registered block out of this group's prefix cache: a cached-free one becomes plain free
        (as if the LRU list evicted it), one in use stays with its holders."""
        cached = block_id in self._cached_free
        self.forget(block_id)
        if cached:
            del self._cached_free[block_id]
            self._free.append(block_id)

    def twin(self, anchor: Block, token_ids: Sequence[int]) -> int | None:
        """The registered block of this group whose anchor is ``anchor`` and whose tokens are ``token_ids``, or None."""
        if not self.enable_prefix_caching or anchor.hash is None:
            return None
        bid = self._table.get(anchor.hash)
        if bid is None:
            return None
        b = self.blocks[bid]
        return bid if b.parent == anchor.canon and b.token_ids == tuple(int(t) for t in token_ids) else None

    def check(self) -> None:
        """This group's invariants: its hash table points at its registered blocks, and every block it
        holds or caches is one the pool says it owns."""
        for h, bid in self._table.items():
            assert self.blocks[bid].hash == h, "hash table points at a block with another hash"
            assert self.pool.owner[bid] is self, f"block {bid} is in the table of a group that does not own it"
        for bid in self._cached_free:
            if self.pool.owner[bid] is self:
                assert self._table.get(self.blocks[bid].hash) == bid, "a cached-free block left the hash table"
