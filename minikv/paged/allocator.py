"""Step 3, part 1: the block allocator — block ids, ref counts, chained hashes, the prefix cache.

A paged KV cache (``minikv.paged``) cuts memory into fixed-size blocks of
``block_size`` token slots. This module owns the *ids* of those blocks and
nothing else: it never sees a K or V number. ``block_manager`` builds the
per-sequence block tables on top of it, and ``paged`` stores and attends.

Prefix sharing
--------------
A block that is *full* never changes again (sequences only append), so its K/V
depend only on the tokens up to its end. Full blocks are therefore
content-addressed: ``hash = hash_fn(prefix_hash, token_ids_of_block)``, chained
so that a block's hash covers its whole prefix (nano-vllm's scheme). A new
sequence walks its prompt block by block through the hash table and reuses
every hit; the model then only runs the tokens after the last hit.

A hash match alone proves nothing (hashes collide). On a hit we compare the
stored token ids *and* the identity of the previous block in the chain. Token
ids alone are not enough: a block holding the same 16 tokens at a different
position, or after a different prefix, has different K/V (RoPE and attention
mix in the prefix). By induction along the chain, a hit means the whole prefix
is token-for-token identical, whatever ``hash_fn`` does.

Freed full blocks keep their contents and hash in an LRU list. They count as
free, but until a new allocation evicts them (least recently freed first) a
later prefix hit revives them. ``on_evict(block)``, when set (a host tier,
``minikv.tiers``), sees each evicted block while its contents are still valid.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from minikv.errors import ConfigError, InvalidInputError, OutOfBlocksError, check_int

HashFn = Callable[["int | None", tuple], int]


def chain_hash(prefix_hash: int | None, token_ids: Sequence[int]) -> int:
    """Hash of a full block chained with its prefix: 64-bit BLAKE2b of (prefix_hash, token ids).

    Deterministic across processes (unlike ``hash()`` of a str), so cache hits
    are reproducible. ``prefix_hash`` is None for a sequence's first block.
    """
    h = hashlib.blake2b(digest_size=8)
    h.update(b"-" if prefix_hash is None else int(prefix_hash).to_bytes(8, "little", signed=False))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return int.from_bytes(h.digest(), "little")


def ceil_div(a: int, b: int) -> int:
    """ceil(a / b) for integers a >= 0, b > 0, exactly (no float): the one place this rounding is written."""
    return -(-a // b)


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens: ceil(num_tokens / block_size)."""
    return ceil_div(int(num_tokens), int(block_size))


@dataclass
class Block:
    """Bookkeeping for one physical block: nano-vllm's ``Block(ref_count, hash, token_ids)`` + chain identity.

    ref_count:  how many block tables hold this block (0 = free or cached-free)
    hash:       chained hash once the block is full and registered, else None
    token_ids:  the block's tokens once registered (compared on every hit)
    parent:     identity ``(block_id, generation)`` of the previous block in its
                chain (None for a sequence's first block); compared on every hit
    canon:      the identity children should record as their parent: the block
                itself, or the equal block already in the hash table (a block
                promoted from a host tier keeps the stamp of its first life)
    generation: bumped on every (re)allocation, so an identity recorded before
                a block was recycled can never match its new contents
    """

    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple | None = None
    parent: tuple | None = None
    canon: tuple | None = None
    generation: int = 0

    @property
    def identity(self) -> tuple:
        return (self.block_id, self.generation)

    def forget(self) -> None:
        self.hash = self.token_ids = self.parent = self.canon = None


class BlockAllocator:
    """A fixed pool of ``num_blocks`` block ids with ref counts and a prefix cache.

    Three disjoint places hold a block:
      * in use: ref_count >= 1 (held by one or more block tables);
      * the free list: ref_count 0, contents meaningless;
      * the cached-free LRU list: ref_count 0, full and registered in the hash
        table, contents still valid; a prefix hit revives it, an allocation
        that finds the free list empty evicts the least recently freed one.

    ``num_free`` counts both free kinds, because both can be handed out.
    ``hash_fn(prefix_hash, token_ids) -> int`` can be injected (tests inject a
    colliding one to show that collisions cannot corrupt).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_fn: HashFn | None = None):
        self.num_blocks = check_int("num_blocks", num_blocks)
        self.block_size = check_int("block_size", block_size)
        self.enable_prefix_caching = bool(enable_prefix_caching)
        if hash_fn is not None and not callable(hash_fn):
            raise ConfigError(f"hash_fn={hash_fn!r} must be callable as "
                              "hash_fn(prefix_hash, token_ids) -> int")
        self.hash_fn = chain_hash if hash_fn is None else hash_fn
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        self._free: deque = deque(range(self.num_blocks))
        self._cached_free: OrderedDict = OrderedDict()  # block_id -> None, least recently freed first
        self._table: dict = {}  # hash -> block_id (only blocks in use or cached-free)
        self.evictions = 0
        self.on_evict: Callable[[Block], None] | None = None  # called before an evicted block is reused

    # -- queries ------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._cached_free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def ref_count(self, block_id: int) -> int:
        return self.blocks[self._check_id(block_id)].ref_count

    def free_block_ids(self) -> list[int]:
        """Free blocks with no valid contents, in the order they will be handed out."""
        return list(self._free)

    def cached_block_ids(self) -> list[int]:
        """Freed blocks still in the prefix cache, least recently freed (next to be evicted) first."""
        return list(self._cached_free)

    def _check_id(self, block_id) -> int:
        return check_int("block_id", block_id, minimum=0, maximum=self.num_blocks - 1, error=InvalidInputError,
                         hint="not a block of this pool")

    # -- allocation -----------------------------------------------------------------------------
    def allocate(self) -> int:
        """Hand out one block (ref_count 1): a plain free one if any, else evict the LRU cached one."""
        if self._free:
            bid = self._free.popleft()
        elif self._cached_free:
            bid, _ = self._cached_free.popitem(last=False)
            b = self.blocks[bid]
            del self._table[b.hash]  # a cached-free block is always its hash's table entry
            if self.on_evict is not None:
                self.on_evict(b)  # e.g. copied to a host tier: nothing has overwritten it yet
            b.forget()
            self.evictions += 1
        else:
            raise OutOfBlocksError(f"all {self.num_blocks} blocks are in use; free or preempt a sequence, "
                                   "or build the cache with more blocks")
        b = self.blocks[bid]
        b.generation += 1
        b.ref_count = 1
        return bid

    def allocate_many(self, n: int) -> list[int]:
        """Allocate ``n`` blocks, all or nothing."""
        if n > self.num_free:
            raise OutOfBlocksError(f"need {n} blocks but only {self.num_free} of {self.num_blocks} are free; "
                                   "free or preempt a sequence, or build the cache with more blocks")
        return [self.allocate() for _ in range(n)]

    def incref(self, block_id: int) -> None:
        """One more owner. Reviving a cached-free block takes it out of the LRU list."""
        b = self.blocks[self._check_id(block_id)]
        if b.ref_count == 0:
            if b.block_id not in self._cached_free:
                raise InvalidInputError(f"block {block_id} is free (not cached); allocate it, "
                                        "do not incref it")
            del self._cached_free[b.block_id]
        b.ref_count += 1

    def decref(self, block_id: int) -> None:
        """One owner fewer. At zero a registered block joins the LRU list, any other the free list."""
        b = self.blocks[self._check_id(block_id)]
        if b.ref_count <= 0:
            raise InvalidInputError(f"block {block_id} is already free; a block table freed it twice")
        b.ref_count -= 1
        if b.ref_count == 0:
            if b.hash is not None and self._table.get(b.hash) == b.block_id:
                self._cached_free[b.block_id] = None  # most recently freed: evicted last
            else:
                b.forget()  # a duplicate or unregistered block can never be hit: plain free
                self._free.append(b.block_id)

    def unallocate(self, block_id: int) -> None:
        """Undo ``allocate`` for a block of an aborted step: back to the *front* of the free list."""
        b = self.blocks[self._check_id(block_id)]
        if b.ref_count != 1 or b.hash is not None:
            raise InvalidInputError(f"block {block_id} (ref_count={b.ref_count}) was not freshly allocated")
        b.ref_count = 0
        self._free.appendleft(b.block_id)

    # -- prefix cache ----------------------------------------------------------------------------
    def match(self, token_ids: Sequence[int]) -> list[int]:
        """Longest chain of cached full blocks equal to the start of ``token_ids``; no side effects.

        A hit must match the stored token ids and the previous block of the
        chain, so hash collisions only cost a miss (see the module docstring).
        """
        if not self.enable_prefix_caching:
            return []
        bs, out = self.block_size, []
        prefix_hash, parent = None, None
        for i in range(len(token_ids) // bs):
            toks = tuple(int(t) for t in token_ids[i * bs:(i + 1) * bs])
            h = self.hash_fn(prefix_hash, toks)
            bid = self._table.get(h)
            if bid is None:
                break
            b = self.blocks[bid]
            if b.token_ids != toks or b.parent != parent:
                break  # a collision: same hash, other contents or other prefix
            out.append(bid)
            prefix_hash, parent = h, b.canon  # a table entry's canon: itself (or its host-tier stamp)
        return out

    def lookup(self, hash_value: int) -> int | None:
        """The block registered under ``hash_value`` (in use or cached-free), or None."""
        return self._table.get(hash_value)

    def register(self, block_id: int, prev_id: int | None, token_ids: Sequence[int]) -> None:
        """Record that full block ``block_id`` holds ``token_ids`` after ``prev_id`` (None: first block).

        The first block registered for a (prefix, tokens) wins the hash table
        entry; an equal later one is a duplicate that points its children at
        the winner, so chains built by different sequences stay findable.
        """
        b = self.blocks[self._check_id(block_id)]
        if not self.enable_prefix_caching or b.hash is not None:
            return
        toks = tuple(int(t) for t in token_ids)
        if len(toks) != self.block_size:
            raise InvalidInputError(f"register got {len(toks)} token ids; only full blocks "
                                    f"({self.block_size} tokens) are registered")
        prev = None if prev_id is None else self.blocks[self._check_id(prev_id)]
        if prev is not None and prev.hash is None:
            raise InvalidInputError(f"block {prev_id} is not registered; "
                                    "register a chain from its first block on")
        parent = None if prev is None else prev.canon
        h = self.hash_fn(None if prev is None else prev.hash, toks)
        b.hash, b.token_ids, b.parent = int(h), toks, parent
        winner = self._table.get(b.hash)
        if winner is None:
            self._table[b.hash] = b.block_id
            b.canon = b.identity
        else:
            w = self.blocks[winner]
            equal = w.token_ids == toks and w.parent == parent
            b.canon = w.canon if equal else b.identity  # a real collision: b stays unreachable

    def forget(self, block_id: int) -> None:
        """Take a block that is still handed out out of the prefix cache (its contents are about to change).

        Its generation moves on, so an identity a child recorded as its chain parent never matches the
        block's new contents. A block that was never registered is left as it is.
        """
        b = self.blocks[self._check_id(block_id)]
        if b.hash is None:
            return
        if self._table.get(b.hash) == b.block_id:
            del self._table[b.hash]
        b.forget()
        b.generation += 1

    def check(self) -> None:
        """Assert the allocator's own invariants (for tests and debugging)."""
        free, cached = list(self._free), list(self._cached_free)
        assert len(set(free)) == len(free), "a block is twice in the free list"
        assert not set(free) & set(cached), "a block is both free and cached-free"
        zero = {b.block_id for b in self.blocks if b.ref_count == 0}
        assert zero == set(free) | set(cached), "ref_count 0 <=> free or cached-free"
        assert all(b.ref_count >= 0 for b in self.blocks)
        for h, bid in self._table.items():
            assert self.blocks[bid].hash == h, "hash table points at a block with another hash"
        for bid in cached:
            assert self._table.get(self.blocks[bid].hash) == bid, "a cached-free block left the hash table"
