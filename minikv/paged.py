"""Step 3: a paged KV cache — blocks, block tables, slot mapping, paged attention, prefix sharing.

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
  Offsets are 64-bit on purpose: the element offset ``slot * Hkv * D`` passes
  the int32 limit 2**31 - 1 long before memory runs out (2**18 blocks x 16 slots
  x 8 heads x 128 dims = 2**32 elements, 16 GiB in fp32, a modest pool on a large
  GPU), so a kernel must compute it as ``(int64)slot * stride``.

Who owns what
-------------
``BlockAllocator`` owns the block ids: a free list, ref counts, and the prefix
cache (hash table + LRU list of freed-but-still-valid blocks). It never
touches K/V numbers. ``PagedKVCache`` owns the pools, the per-sequence block
tables and lengths, and plugs into the model through ``KVCacheBase``'s
``step / write / attend`` seam like every other cache.

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

A block becomes shareable when the step that fills it commits, so requests
admitted in the same step as the first one carrying a prefix compute that
prefix themselves (the batching benchmark's hit rate shows the effect).

Freed full blocks keep their contents and hash in an LRU list. They count as
free, but until a new allocation evicts them (least recently freed first) a
later prefix hit revives them.

``fork(parent, child)`` shares every block of the parent (parallel sampling,
beam search): ref counts go up, nothing is copied. Before the first write into
a shared, partly filled last block, that one block is copied (copy-on-write).
Full shared blocks are never written again, so they never need copying.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import numpy as np

from minikv.errors import (
    ConfigError,
    InvalidInputError,
    OutOfBlocksError,
    ShapeError,
)
from minikv.kv_cache import KVCacheBase, Step, lookup_sequence

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


def _positive_int(name: str, val) -> int:
    if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < 1:
        raise ConfigError(f"{name}={val!r} must be a positive integer")
    return int(val)


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens: ceil(num_tokens / block_size)."""
    return -(-int(num_tokens) // int(block_size))


# --- the allocator ---------------------------------------------------------------------------

@dataclass
class Block:
    """Bookkeeping for one physical block: nano-vllm's ``Block(ref_count, hash, token_ids)`` + chain identity.

    ref_count:  how many block tables hold this block (0 = free or cached-free)
    hash:       chained hash once the block is full and registered, else None
    token_ids:  the block's tokens once registered (compared on every hit)
    parent:     identity ``(block_id, generation)`` of the previous block in its
                chain (None for a sequence's first block); compared on every hit
    canon:      the identity children should record as their parent: the block
                itself, or the equal block already in the hash table
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
        self.num_blocks = _positive_int("num_blocks", num_blocks)
        self.block_size = _positive_int("block_size", block_size)
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
        if isinstance(block_id, bool) or not isinstance(block_id, (int, np.integer)) \
                or not 0 <= block_id < self.num_blocks:
            raise InvalidInputError(f"block_id={block_id!r} is not a block of this pool "
                                    f"[0, {self.num_blocks})")
        return int(block_id)

    # -- allocation -----------------------------------------------------------------------------
    def allocate(self) -> int:
        """Hand out one block (ref_count 1): a plain free one if any, else evict the LRU cached one."""
        if self._free:
            bid = self._free.popleft()
        elif self._cached_free:
            bid, _ = self._cached_free.popitem(last=False)
            b = self.blocks[bid]
            del self._table[b.hash]  # a cached-free block is always its hash's table entry
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
            prefix_hash, parent = h, b.identity
        return out

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
            b.canon = w.identity if equal else b.identity  # a real collision: b stays unreachable

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


# --- paged attention ---------------------------------------------------------------------------

def slot_mapping(block_table: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """Slots of ``positions`` of one sequence: ``table[p // bs] * bs + p % bs`` as int64 ([T] -> [T])."""
    positions = np.asarray(positions, dtype=np.int64)
    table = np.asarray(block_table, dtype=np.int64)
    return table[positions // block_size] * block_size + positions % block_size


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
    tile = default_blocks_per_tile(bs) if blocks_per_tile is None else blocks_per_tile
    if isinstance(tile, bool) or not isinstance(tile, (int, np.integer)) or tile < 1:
        raise ConfigError(f"blocks_per_tile={blocks_per_tile!r} must be a positive integer")
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


def paged_attention(q: np.ndarray, k_pool: np.ndarray, v_pool: np.ndarray, block_tables: np.ndarray,
                    context_lens: np.ndarray, query_lens: np.ndarray | None = None,
                    blocks_per_tile: int | None = None) -> np.ndarray:
    """Attention of packed queries over each sequence's blocks, read through its block table.

    q:               [N, Hq, D] queries of B sequences, packed (sequence b owns query_lens[b] rows)
    k_pool:          [num_blocks, block_size, Hkv, D] (one layer's pool; v_pool the same)
    block_tables:    [B, max_blocks] int32; entries past a sequence's last block are ignored
    context_lens:    [B] tokens each sequence holds *including* this step's
    query_lens:      [B] new tokens per sequence (default all 1: pure decode); sum = N
    blocks_per_tile: blocks read per iteration (1 = strictly one block at a time;
                     default ``default_blocks_per_tile``: ~128 keys, fewer NumPy calls)
    returns:         [N, Hq, D] in q's dtype

    The t-th query of sequence b sits at position ``p = context_lens[b] -
    query_lens[b] + t`` and sees keys ``0..p`` (causal). Keys are walked in
    block order through the block table, a tile of blocks at a time for all
    queries together, with an *online softmax*: a running max m, a running sum
    l and a running output acc. When a tile raises the max, everything so far
    is rescaled by exp(m_old - m_new):

        s   = q . K_tile / sqrt(D)       (masked slots: -inf)
        m'  = max(m, max(s));  a = exp(m - m')
        l   = a l + sum exp(s - m');  acc = a acc + exp(s - m') V_tile
        out = acc / l                    (after the last tile)

    So the history is never gathered into one [S, D] array: at any moment one
    tile per query is in hand (a GPU kernel holds a block in shared memory).
    And every query attends over **all** blocks of its sequence. Contrast the
    "local page only" toy in some write-ups, which attends only within the
    current page: cheaper, but it silently drops every earlier page from the
    softmax, so its output is a different (wrong) model.

    Stale slots: a partly filled last block holds leftovers from whoever used
    it before (possibly NaN). Masking the scores is not enough, because the
    probability there is 0 and 0 * NaN = NaN; the V rows are selected away too.
    """
    block_tables, context_lens, query_lens, tile = check_paged_attention_args(
        q, k_pool, v_pool, block_tables, context_lens, query_lens, blocks_per_tile)
    n, hq, d = q.shape
    bsz = context_lens.size
    bs, hkv = k_pool.shape[1], k_pool.shape[2]
    need = -(-context_lens // bs)
    width = block_tables.shape[1]
    in_use = np.arange(width)[None, :] < need[:, None]
    # Unused entries may hold anything (-1 padding...): point them at block 0, whose slots the mask drops.
    # Pad the columns to whole tiles the same way.
    width_tiles = -(-width // tile) * tile
    safe = np.zeros((bsz, width_tiles), dtype=np.int64)
    safe[:, :width] = np.where(in_use, block_tables, 0)

    dt = q.dtype
    g = hq // hkv
    scale = dt.type(1.0 / np.sqrt(d))  # a float32 scalar keeps float32 math float32
    seq_of, pos = query_positions(context_lens, query_lens)                 # [N] sequence, position
    visible = pos + 1                                                        # [N] keys 0..pos
    tables = safe[seq_of]                                                    # [N, width_tiles]

    qg = q.reshape(n, hkv, g, d)  # a whole GQA group per KV head: K/V of a block read once per group
    m = np.full((n, hkv, g), -np.inf, dtype=dt)
    l = np.zeros((n, hkv, g), dtype=dt)
    acc = np.zeros((n, hkv, g, d), dtype=dt)
    span = tile * bs  # keys per tile
    key_offsets = np.arange(span)
    for start in range(0, int(visible.max()), span):
        j = start // bs  # first block index of this tile
        rows = np.flatnonzero(visible > start)  # queries that see at least one key of this tile
        r = rows.size
        if r == n:
            rows = slice(None)  # all of them: a view instead of a fancy-indexed copy
        valid = (start + key_offsets)[None, :] < visible[rows, None]        # [R, span]
        blk = tables[rows, j:j + tile]                                       # [R, tile] physical block ids
        kb = k_pool[blk].reshape(r, span, hkv, d).astype(dt, copy=False)     # [R, span, Hkv, D]
        vb = v_pool[blk].reshape(r, span, hkv, d).astype(dt, copy=False)
        vb = np.where(valid[:, :, None, None], vb, 0)                        # stale rows: select, no 0*NaN
        s = (qg[rows] @ kb.transpose(0, 2, 3, 1)) * scale                    # [R, Hkv, G, span]
        s = np.where(valid[:, None, None, :], s, -np.inf)
        m_old = m[rows]
        m_new = np.maximum(m_old, s.max(axis=-1))
        m_safe = np.where(np.isneginf(m_new), 0, m_new)  # a fully masked row: avoid -inf - -inf
        alpha = np.exp(m_old - m_safe)
        p = np.exp(s - m_safe[..., None])
        l[rows] = alpha * l[rows] + p.sum(axis=-1)
        acc[rows] = alpha[..., None] * acc[rows] + p @ vb.transpose(0, 2, 1, 3)  # [R,Hkv,G,span]@[R,Hkv,span,D]
        m[rows] = m_new
    out = (acc / l[..., None]).reshape(n, hq, d)  # l > 0: every query sees at least key 0
    assert out.dtype == dt, out.dtype
    return out


# --- the cache -----------------------------------------------------------------------------------

def _token_list(token_ids: Sequence[int]) -> list[int]:
    a = np.asarray(token_ids)
    if a.ndim != 1 or a.size == 0:
        raise InvalidInputError(f"prompt_ids has shape {a.shape}; pass a non-empty 1-D list of token ids")
    if a.dtype.kind not in "iu":
        raise InvalidInputError(f"prompt_ids.dtype={a.dtype}; token ids must be integers")
    return a.tolist()


@dataclass
class _SeqState:
    block_table: list            # physical block ids on the device pool
    length: int = 0              # tokens with K/V stored
    token_ids: list | None = None  # the sequence's tokens when known (for prefix registration)
    num_registered: int = 0      # leading full blocks already registered in the prefix cache
    host_table: list | None = None  # host block ids while swapped out, else None


@dataclass
class _Reservation:
    seq_id: Hashable
    new_blocks: list
    cow: tuple | None  # (table index, old block, new block) if the step copied a shared block


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

    A step (``with cache.step(seq_ids, num_new)``) first reserves what it
    needs: new blocks for positions past each sequence's last block, and a
    copy of a shared partly filled last block (copy-on-write). If the pool is
    short it raises ``OutOfBlocksError`` and changes nothing. ``write`` stores
    K/V through the slot mapping; ``attend`` runs ``paged_attention``. On
    success lengths advance and newly full blocks enter the prefix cache; on
    error the reserved blocks go back to the front of the free list and block
    tables and ref counts are as before (a cached-free block that the aborted
    step evicted stays evicted: a lost future hit, never a wrong one).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int = 16, dtype=np.float32, num_host_blocks: int = 0,
                 enable_prefix_caching: bool = True, hash_fn: HashFn | None = None,
                 blocks_per_tile: int | None = None):
        super().__init__(num_layers, num_kv_heads, head_dim, dtype)
        self.allocator = BlockAllocator(num_blocks, block_size, enable_prefix_caching, hash_fn)
        self.num_blocks, self.block_size = self.allocator.num_blocks, self.allocator.block_size
        if isinstance(num_host_blocks, bool) or not isinstance(num_host_blocks, (int, np.integer)) \
                or num_host_blocks < 0:
            raise ConfigError(f"num_host_blocks={num_host_blocks!r} must be a non-negative integer "
                              "(0: no swapping)")
        self.num_host_blocks = int(num_host_blocks)
        if blocks_per_tile is not None:
            _positive_int("blocks_per_tile", blocks_per_tile)
        self.blocks_per_tile = blocks_per_tile
        self.k_pool = self._new_pool(self.num_blocks, host=False)
        self.v_pool = self._new_pool(self.num_blocks, host=False)
        # the swap target: its own allocator (no prefix cache) and pools; a GPU build keeps them in host RAM
        self.host_allocator = None
        if self.num_host_blocks:
            self.host_allocator = BlockAllocator(self.num_host_blocks, self.block_size,
                                                 enable_prefix_caching=False)
        self.host_k_pool = self._new_pool(self.num_host_blocks, host=True)
        self.host_v_pool = self._new_pool(self.num_host_blocks, host=True)
        self._seqs: dict = {}
        self._pending: list = []
        self._slots: np.ndarray | None = None
        self._step_tables: np.ndarray | None = None
        # counters for benchmarks and tests
        self.cow_copies = 0
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.swap_outs = 0
        self.swap_ins = 0

    @property
    def enable_prefix_caching(self) -> bool:
        return self.allocator.enable_prefix_caching

    # -- storage hooks: the only places outside write/attend that touch K/V numbers ---------
    # The bookkeeping below never reads the pools; a device cache (minikv_gpu.paged) overrides
    # these four methods (and write/attend) and inherits everything else.
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

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    # -- sequences ------------------------------------------------------------------------------
    def _state(self, seq_id) -> _SeqState:
        return lookup_sequence(self._seqs, seq_id)

    def _resident(self, seq_id) -> _SeqState:
        s = self._state(seq_id)
        if s.host_table is not None:
            raise InvalidInputError(f"sequence {seq_id!r} is swapped out to the host pool; "
                                    f"swap_in({seq_id!r}) first")
        return s

    def _no_open_step(self, what: str) -> None:
        if self._step is not None:
            raise InvalidInputError(f"cannot {what} while a step is open; finish the step first")

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._seqs

    def seq_ids(self) -> list:
        return list(self._seqs)

    def length(self, seq_id) -> int:
        return self._state(seq_id).length

    def block_table(self, seq_id) -> np.ndarray:
        """The sequence's block table: int32 [ceil(length / block_size)] (empty while swapped out)."""
        return np.asarray(self._state(seq_id).block_table, dtype=np.int32)

    def host_block_table(self, seq_id) -> np.ndarray | None:
        """Host blocks holding the sequence while it is swapped out, else None."""
        s = self._state(seq_id)
        return None if s.host_table is None else np.asarray(s.host_table, dtype=np.int32)

    def is_swapped(self, seq_id) -> bool:
        return self._state(seq_id).host_table is not None

    def _prefix_hit(self, token_ids: Sequence[int]) -> list[int]:
        """Cached blocks to reuse for a prompt. At least one token is always left to compute."""
        hit = self.allocator.match(token_ids)
        # A prompt that is all cached and a whole number of blocks would leave
        # nothing to run, and the model needs one forward pass to produce the
        # next token's logits. Leave the last block out of the hit: it is
        # recomputed (bs tokens) into a fresh block. (Recomputing just the last
        # token would mean writing into a full cached block, which is shared.)
        if hit and len(hit) * self.block_size >= len(token_ids):
            hit = hit[:-1]
        return hit

    def add_sequence(self, seq_id, prompt_ids: Sequence[int] | None = None) -> int:
        """Start a sequence; return how many leading prompt tokens are already cached.

        With ``prompt_ids`` (the tokens you are about to feed) the prefix cache
        is searched: the returned ``n`` tokens already have K/V, so run the model
        on ``prompt_ids[n:]`` only. ``n`` is a multiple of ``block_size`` and
        always < len(prompt_ids). Without ids nothing is shared (returns 0).
        """
        self._no_open_step("add a sequence")
        try:
            hash(seq_id)
        except TypeError:
            raise InvalidInputError(f"seq_id={seq_id!r} is not hashable; use an int or a str") from None
        if seq_id in self._seqs:
            raise InvalidInputError(f"sequence {seq_id!r} is already in the cache; free it or pick a new id")
        tokens = None if prompt_ids is None else _token_list(prompt_ids)
        hit = self._prefix_hit(tokens) if tokens is not None else []
        for bid in hit:
            self.allocator.incref(bid)
        n = len(hit) * self.block_size
        self._seqs[seq_id] = _SeqState(block_table=list(hit), length=n, token_ids=tokens,
                                       num_registered=len(hit))
        if tokens is not None and self.enable_prefix_caching:
            self.prefix_query_tokens += len(tokens)
            self.prefix_hit_tokens += n
        return n

    def admission_cost(self, prompt_ids: Sequence[int]) -> int:
        """Free blocks that ``add_sequence(prompt_ids)`` plus a prefill of the rest would consume.

        New blocks for the uncached part, plus cached-free blocks a hit revives
        (they were counted as free). Blocks already in use by others are free of charge.
        """
        tokens = _token_list(prompt_ids)
        hit = self._prefix_hit(tokens)
        live = sum(1 for b in hit if self.allocator.blocks[b].ref_count > 0)
        return num_blocks_for(len(tokens), self.block_size) - live

    def extend_token_ids(self, seq_id, token_ids: Sequence[int]) -> None:
        """Declare the ids of tokens about to be fed (e.g. a sampled token) so full blocks can be shared."""
        s = self._state(seq_id)
        if s.token_ids is not None:
            s.token_ids.extend(int(t) for t in np.asarray(token_ids).reshape(-1))

    def fork(self, parent_id, child_id) -> None:
        """Make ``child_id`` a copy of ``parent_id`` that shares all its blocks (nothing is copied yet)."""
        self._no_open_step("fork")
        p = self._resident(parent_id)
        if child_id in self._seqs:
            raise InvalidInputError(f"sequence {child_id!r} already exists; fork into a new id")
        for bid in p.block_table:
            self.allocator.incref(bid)
        self._seqs[child_id] = _SeqState(block_table=list(p.block_table), length=p.length,
                                         token_ids=None if p.token_ids is None else list(p.token_ids),
                                         num_registered=p.num_registered)

    def free_sequence(self, seq_id) -> None:
        """Drop a sequence; its blocks return to the pool (full registered ones stay cached until evicted)."""
        self._no_open_step("free a sequence")
        s = self._state(seq_id)
        self._release(s)
        del self._seqs[seq_id]

    def _release(self, s: _SeqState) -> None:
        # Last block first: the LRU list then evicts a chain from its tail, and a
        # chain's first blocks (the ones every hit needs) survive the longest.
        for bid in reversed(s.block_table):
            self.allocator.decref(bid)
        s.block_table = []
        if s.host_table is not None:
            for bid in reversed(s.host_table):
                self.host_allocator.decref(bid)
            s.host_table = None

    # -- swapping -------------------------------------------------------------------------------
    def swap_out(self, seq_id) -> None:
        """Copy a sequence's blocks to the host pool and free its device blocks (preemption by swap).

        Raises OutOfBlocksError (changing nothing) if the host pool is too small.
        Each block is copied, shared or not; after ``swap_in`` the sequence owns
        private copies (a simplification: vLLM maps shared blocks once).
        """
        self._no_open_step("swap out")
        s = self._resident(seq_id)
        if self.host_allocator is None:
            raise OutOfBlocksError(f"cannot swap out {seq_id!r}: this cache has no host pool; "
                                   "build it with num_host_blocks > 0 or preempt by recompute")
        host = self.host_allocator.allocate_many(len(s.block_table))
        self._swap_out_blocks(list(s.block_table), host)
        for bid in reversed(s.block_table):
            self.allocator.decref(bid)
        s.block_table, s.host_table, s.num_registered = [], host, 0
        self.swap_outs += 1

    def swap_in(self, seq_id) -> None:
        """Bring a swapped-out sequence back into fresh device blocks. OutOfBlocksError changes nothing."""
        self._no_open_step("swap in")
        s = self._state(seq_id)
        if s.host_table is None:
            raise InvalidInputError(f"sequence {seq_id!r} is not swapped out")
        dev = self.allocator.allocate_many(len(s.host_table))
        self._swap_in_blocks(list(s.host_table), dev)
        for bid in reversed(s.host_table):
            self.host_allocator.decref(bid)
        s.block_table, s.host_table = dev, None
        self._register_full(s)
        self.swap_ins += 1

    # -- steps ----------------------------------------------------------------------------------
    def _needs(self, seq_ids: Sequence, num_new: Sequence[int]) -> list[tuple[int, bool]]:
        """Per sequence: (new blocks to allocate, whether the last block must be copied first)."""
        bs, refs, out = self.block_size, {}, []
        for sid, n in zip(seq_ids, num_new, strict=True):
            s = self._resident(sid)
            past = s.length
            new = num_blocks_for(past + int(n), bs) - len(s.block_table)
            cow = False
            if past % bs:  # the step writes into the partly filled last block
                last = s.block_table[past // bs]
                r = refs.get(last, self.allocator.blocks[last].ref_count)
                cow = r > 1  # shared: copy it; the others keep the original
                refs[last] = r - 1 if cow else r
            out.append((max(new, 0), cow))
        return out

    def blocks_needed(self, seq_ids: Sequence, num_new: Sequence[int]) -> int:
        """Free blocks a step with these sequences would consume (new blocks + copy-on-write copies)."""
        return sum(n + c for n, c in self._needs(seq_ids, num_new))

    def _reserve(self, step: Step) -> None:
        needs = self._needs(step.seq_ids, step.num_new)
        total = sum(n + c for n, c in needs)
        if total > self.allocator.num_free:
            raise OutOfBlocksError(
                f"this step needs {total} new blocks but only {self.allocator.num_free} of {self.num_blocks} "
                "are free; preempt a sequence (free_sequence or swap_out) and retry, or add blocks")
        bs, pending, copies = self.block_size, [], []
        for sid, (n, cow), past in zip(step.seq_ids, needs, step.past, strict=True):
            s = self._seqs[sid]
            copied = None
            if cow:
                idx = int(past) // bs
                old = s.block_table[idx]
                new = self.allocator.allocate()
                copies.append((old, new))  # copied below, all layers at once: the step writes every layer
                self.allocator.decref(old)
                s.block_table[idx] = new
                copied = (idx, old, new)
                self.cow_copies += 1
            fresh = [self.allocator.allocate() for _ in range(n)]
            s.block_table.extend(fresh)
            pending.append(_Reservation(sid, fresh, copied))
        if copies:  # `old` stays held by its other owners, so no source is reused as a destination
            self._copy_blocks(copies)
        self._pending = pending
        tables = [self._seqs[sid].block_table for sid in step.seq_ids]
        self._slots = np.concatenate([slot_mapping(t, np.arange(p, p + n), bs)
                                      for t, p, n in zip(tables, step.past, step.num_new, strict=True)])
        width = max(len(t) for t in tables)
        self._step_tables = np.zeros((len(tables), width), dtype=np.int32)
        for i, t in enumerate(tables):
            self._step_tables[i, :len(t)] = t

    def _commit(self, step: Step) -> None:
        for sid, n in zip(step.seq_ids, step.num_new, strict=True):
            s = self._seqs[sid]
            s.length += int(n)
            self._register_full(s)
        self._end()

    def _rollback(self, step: Step) -> None:
        for r in reversed(self._pending):
            s = self._seqs[r.seq_id]
            for bid in reversed(r.new_blocks):
                s.block_table.pop()
                self.allocator.unallocate(bid)
            if r.cow is not None:
                idx, old, new = r.cow
                self.allocator.incref(old)
                s.block_table[idx] = old
                self.allocator.unallocate(new)
                self.cow_copies -= 1
        self._end()

    def _end(self) -> None:
        self._pending, self._slots, self._step_tables = [], None, None

    def _register_full(self, s: _SeqState) -> None:
        """Enter the sequence's newly full blocks into the prefix cache (when its tokens are known)."""
        if not self.enable_prefix_caching or s.token_ids is None:
            return
        bs = self.block_size
        full = min(s.length, len(s.token_ids)) // bs
        for i in range(s.num_registered, full):
            self.allocator.register(s.block_table[i], s.block_table[i - 1] if i else None,
                                    s.token_ids[i * bs:(i + 1) * bs])
        s.num_registered = max(s.num_registered, full)

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
        self._check_layer(layer)
        step = self._require_step()
        if q.ndim != 3 or q.shape[0] != step.num_tokens or q.shape[2] != self.head_dim:
            raise ShapeError(f"q.shape={q.shape}, expected [N={step.num_tokens}, Hq, D={self.head_dim}]")
        return paged_attention(q, self.k_pool[layer], self.v_pool[layer], self._step_tables,
                               step.past + step.num_new, step.num_new, self.blocks_per_tile)

    # -- inspection -------------------------------------------------------------------------------
    def read_kv(self, seq_id, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """The sequence's stored history gathered into k, v: [length, Hkv, D] (tests and debugging only)."""
        self._check_layer(layer)
        s = self._state(seq_id)
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
        bs, filled = self.block_size, {}
        for s in self._seqs.values():
            for j, bid in enumerate(s.block_table):
                filled[bid] = max(filled.get(bid, 0), min(bs, s.length - j * bs))
        used = sum(filled.values())
        alloc = self.allocator.num_used * bs
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
