"""Step 3, part 2: the block manager — per-sequence block tables, admission, fork, swap, step bookkeeping.

It answers the scheduler's questions (can this request be admitted? how many
blocks would this step take?) and keeps every sequence's **block table**: entry
j is the physical block holding positions ``j*bs .. j*bs + bs - 1``. Like the
allocator below it (``minikv.paged.allocator``), it never touches K/V numbers:
whenever blocks must be copied it *returns a copy plan*, and the cache that owns
the pools (``minikv.paged.cache.PagedKVCache``) carries it out.

* ``add_sequence(seq_id, prompt_ids)`` walks the prefix cache: leading full
  blocks already cached are shared (ref count + 1), and the caller runs the model
  on the rest only. ``can_admit`` and ``admit`` are the scheduler's two verbs:
  does a prompt's prefill fit in so many free blocks, and if so, take them.
* ``fork(parent, child)`` shares every block of the parent (parallel sampling,
  beam search): nothing is copied yet. Before the first write into a shared,
  partly filled last block, that one block is copied (copy-on-write). Full
  shared blocks are never written again, so they never need copying.
* ``reserve(step)`` takes the blocks a step needs, all or nothing, and returns
  the copy-on-write plan; ``commit`` advances lengths and registers newly full
  blocks in the prefix cache; ``rollback`` gives back exactly what ``reserve`` took.
* ``swap_out`` / ``swap_in`` move a sequence between the device pool and a host
  pool (preemption by swap) and return the (source, destination) block lists.

A block becomes shareable when the step that fills it commits, so requests
admitted in the same step as the first one carrying a prefix compute that
prefix themselves (the batching benchmark's hit rate shows the effect).

Later steps extend the manager without adding branches to it: step 6's evicting manager
(``minikv.window.manager``) overrides the three table hooks (``_held``, ``_remap``,
``_shareable``) to leave holes in a table; step 7's host tier installs ``extend_hit`` to continue
a prefix hit on the host, and ``minikv.paged.truncate`` cuts a table back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import numpy as np

from minikv.errors import InvalidInputError, OutOfBlocksError, check_int
from minikv.kv_cache import Step, lookup_sequence
from minikv.paged.allocator import BlockAllocator, HashFn, num_blocks_for


def _token_list(token_ids: Sequence[int]) -> list[int]:
    a = np.asarray(token_ids)
    if a.ndim != 1 or a.size == 0:
        raise InvalidInputError(f"prompt_ids has shape {a.shape}; pass a non-empty 1-D list of token ids")
    if a.dtype.kind not in "iu":
        raise InvalidInputError(f"prompt_ids.dtype={a.dtype}; token ids must be integers")
    return a.tolist()


def no_host_hit(tokens: list[int], hit: list[int]) -> list[int]:
    """The default ``extend_hit``: a prefix hit ends where the device's prefix cache ends."""
    return []


@dataclass
class SeqState:
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


@dataclass
class StepPlan:
    """What an open step needs from the storage, as computed by ``reserve``.

    copies: [(src, dst)] device blocks to copy before anything is written (copy-on-write)
    tables: the block tables (lists of block ids) of the step's sequences, in step order
    """

    copies: list
    tables: list


class BlockManager:
    """Block tables of every sequence over one device pool (and an optional host pool).

    num_blocks, block_size: the device pool; num_host_blocks: the swap target (0: none)
    enable_prefix_caching, hash_fn: passed to the device ``BlockAllocator``
    """

    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0,
                 enable_prefix_caching: bool = True, hash_fn: HashFn | None = None):
        self.allocator = BlockAllocator(num_blocks, block_size, enable_prefix_caching, hash_fn)
        self.block_size = self.allocator.block_size
        self.num_host_blocks = check_int("num_host_blocks", num_host_blocks, minimum=0, hint="0: no swapping")
        # the swap target has its own allocator, without a prefix cache
        self.host_allocator = (BlockAllocator(self.num_host_blocks, self.block_size, enable_prefix_caching=False)
                               if self.num_host_blocks else None)
        self.seqs: dict = {}
        self._pending: list | None = None  # reservations of the open step, None when no step is open
        # a hook for a later step: a host tier (minikv.tiers) continues prefix hits on the host
        self.extend_hit: Callable[[list[int], list[int]], list[int]] = no_host_hit
        # counters for benchmarks and tests
        self.cow_copies = 0
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.swap_outs = 0
        self.swap_ins = 0

    # -- questions ----------------------------------------------------------------------------
    def state(self, seq_id) -> SeqState:
        return lookup_sequence(self.seqs, seq_id)

    def resident(self, seq_id) -> SeqState:
        s = self.state(seq_id)
        if s.host_table is not None:
            raise InvalidInputError(f"sequence {seq_id!r} is swapped out to the host pool; "
                                    f"swap_in({seq_id!r}) first")
        return s

    def table(self, seq_id) -> np.ndarray:
        """The sequence's block table: int32 [ceil(length / block_size)] (empty while swapped out)."""
        return np.asarray(self.state(seq_id).block_table, dtype=np.int32)

    def host_table(self, seq_id) -> np.ndarray | None:
        """Host blocks holding the sequence while it is swapped out, else None."""
        s = self.state(seq_id)
        return None if s.host_table is None else np.asarray(s.host_table, dtype=np.int32)

    def is_swapped(self, seq_id) -> bool:
        return self.state(seq_id).host_table is not None

    def held(self, seq_id) -> int:
        """Blocks the sequence holds, on the device or (while swapped out) on the host."""
        s = self.state(seq_id)
        return len(self._held(s.block_table if s.host_table is None else s.host_table))

    @property
    def num_free(self) -> int:
        """Device blocks an allocation can take (plain free and cached-free)."""
        return self.allocator.num_free

    def _no_open_step(self, what: str) -> None:
        if self._pending is not None:
            raise InvalidInputError(f"cannot {what} while a step is open; finish the step first")

    def prefix_hit(self, token_ids: Sequence[int]) -> list[int]:
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

    def can_admit(self, prompt_ids: Sequence[int], free_blocks: int) -> bool:
        """Whether ``admit`` would take this prompt with ``free_blocks`` blocks to spare (nothing changes)."""
        tokens = _token_list(prompt_ids)
        return self._cost(tokens, self.prefix_hit(tokens)) <= free_blocks

    def _cost(self, tokens: list, hit: list[int]) -> int:
        # new blocks for the uncached part + cached-free blocks the hit revives; blocks in use by others are free
        live = sum(1 for b in hit if self.allocator.blocks[b].ref_count > 0)
        return num_blocks_for(len(tokens), self.block_size) - live

    def _needs(self, seq_ids: Sequence, num_new: Sequence[int]) -> list[tuple[int, bool]]:
        """Per sequence: (new blocks to allocate, whether the last block must be copied first)."""
        bs, refs, out = self.block_size, {}, []
        for sid, n in zip(seq_ids, num_new, strict=True):
            s = self.resident(sid)
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

    # -- the table hooks a later step overrides (step 6's holes, minikv.window.manager) ----------
    def _held(self, table: list) -> list:
        """The block ids a table holds (each one reference)."""
        return list(table)

    def _remap(self, table: list, fresh: list) -> list:
        """``table`` with its blocks replaced, in order, by the ``fresh`` ones of a swap."""
        return list(fresh)

    def _shareable(self, seq_id, s: SeqState) -> int:
        """How many leading blocks of the sequence may enter the prefix cache: its full, known ones."""
        return min(s.length, len(s.token_ids)) // self.block_size

    # -- sequences ------------------------------------------------------------------------------
    def add_sequence(self, seq_id, prompt_ids: Sequence[int] | None = None) -> int:
        """Start a sequence; return how many leading prompt tokens are already cached (see PagedKVCache)."""
        self._check_new(seq_id)
        tokens = None if prompt_ids is None else _token_list(prompt_ids)
        return self._add(seq_id, tokens, self.prefix_hit(tokens) if tokens is not None else [])

    def admit(self, seq_id, prompt_ids: Sequence[int], free_blocks: int) -> tuple[int, int] | None:
        """``add_sequence`` if the prompt's prefill fits in ``free_blocks`` blocks, with one prefix-cache walk.

        Returns (cached tokens, free blocks the admission and its prefill consume), or None
        (nothing changed) when it does not fit. The cost counts new blocks for the uncached
        part plus cached-free blocks the hit revives (they were counted as free).
        """
        self._check_new(seq_id)
        tokens = _token_list(prompt_ids)
        hit = self.prefix_hit(tokens)
        cost = self._cost(tokens, hit)
        if cost > free_blocks:
            return None
        return self._add(seq_id, tokens, hit), cost

    def _check_new(self, seq_id) -> None:
        self._no_open_step("add a sequence")
        try:
            hash(seq_id)
        except TypeError:
            raise InvalidInputError(f"seq_id={seq_id!r} is not hashable; use an int or a str") from None
        if seq_id in self.seqs:
            raise InvalidInputError(f"sequence {seq_id!r} is already in the cache; free it or pick a new id")

    def _add(self, seq_id, tokens: list | None, hit: list[int]) -> int:
        for bid in hit:
            self.allocator.incref(bid)
        if tokens is not None:
            hit = hit + self.extend_hit(tokens, hit)  # a host tier's promoted blocks, each already held once
        n = len(hit) * self.block_size
        self.seqs[seq_id] = SeqState(block_table=list(hit), length=n, token_ids=tokens, num_registered=len(hit))
        if tokens is not None and self.allocator.enable_prefix_caching:
            self.prefix_query_tokens += len(tokens)
            self.prefix_hit_tokens += n
        return n

    def extend_token_ids(self, seq_id, token_ids: Sequence[int]) -> None:
        """Declare the ids of tokens about to be fed (e.g. a sampled token) so full blocks can be shared."""
        s = self.state(seq_id)
        if s.token_ids is not None:
            s.token_ids.extend(int(t) for t in np.asarray(token_ids).reshape(-1))

    def fork(self, parent_id, child_id) -> None:
        """Make ``child_id`` a copy of ``parent_id`` that shares all its blocks (nothing is copied yet)."""
        self._no_open_step("fork")
        p = self.resident(parent_id)
        if child_id in self.seqs:
            raise InvalidInputError(f"sequence {child_id!r} already exists; fork into a new id")
        for bid in self._held(p.block_table):
            self.allocator.incref(bid)
        self.seqs[child_id] = SeqState(block_table=list(p.block_table), length=p.length,
                                       token_ids=None if p.token_ids is None else list(p.token_ids),
                                       num_registered=p.num_registered)

    def free_sequence(self, seq_id) -> None:
        """Drop a sequence; its blocks return to the pool (full registered ones stay cached until evicted)."""
        self._no_open_step("free a sequence")
        s = self.state(seq_id)
        # Last block first: the LRU list then evicts a chain from its tail, and a
        # chain's first blocks (the ones every hit needs) survive the longest.
        for bid in reversed(self._held(s.block_table)):
            self.allocator.decref(bid)
        if s.host_table is not None:
            for bid in reversed(self._held(s.host_table)):
                self.host_allocator.decref(bid)
        del self.seqs[seq_id]

    # -- swapping: each returns (source blocks, destination blocks) to copy, all layers, K and V ---
    def swap_out(self, seq_id) -> tuple[list[int], list[int]]:
        """Move a sequence's blocks to fresh host blocks; returns (device blocks, host blocks).

        Raises OutOfBlocksError (changing nothing) if the host pool is too small. The freed
        device blocks keep their contents until the next allocation, so the caller copies at once.
        """
        self._no_open_step("swap out")
        s = self.resident(seq_id)
        if self.host_allocator is None:
            raise OutOfBlocksError(f"cannot swap out {seq_id!r}: this cache has no host pool; "
                                   "build it with num_host_blocks > 0 or preempt by recompute")
        dev = self._held(s.block_table)
        fresh = self.host_allocator.allocate_many(len(dev))
        for bid in reversed(dev):
            self.allocator.decref(bid)
        s.host_table = self._remap(s.block_table, fresh)
        s.block_table, s.num_registered = [], 0
        self.swap_outs += 1
        return dev, fresh

    def swap_in(self, seq_id) -> tuple[list[int], list[int]]:
        """Bring a swapped-out sequence back into fresh device blocks; returns (host blocks, device blocks)."""
        self._no_open_step("swap in")
        s = self.state(seq_id)
        if s.host_table is None:
            raise InvalidInputError(f"sequence {seq_id!r} is not swapped out")
        host = self._held(s.host_table)
        fresh = self.allocator.allocate_many(len(host))
        for bid in reversed(host):
            self.host_allocator.decref(bid)
        s.block_table, s.host_table = self._remap(s.host_table, fresh), None
        self._register_full(seq_id, s)
        self.swap_ins += 1
        return host, fresh

    # -- steps ----------------------------------------------------------------------------------
    def reserve(self, step: Step) -> StepPlan:
        """Take the blocks ``step`` needs (all or nothing) and plan its writes; OutOfBlocksError changes nothing."""
        needs = self._needs(step.seq_ids, step.num_new)
        total = sum(n + c for n, c in needs)
        if total > self.allocator.num_free:
            raise OutOfBlocksError(
                f"this step needs {total} new blocks but only {self.allocator.num_free} of "
                f"{self.allocator.num_blocks} are free; preempt a sequence (free_sequence or swap_out) "
                "and retry, or add blocks")
        pending, copies = [], []
        for sid, (n, cow), past in zip(step.seq_ids, needs, step.past, strict=True):
            s = self.seqs[sid]
            copied = None
            if cow:
                idx = int(past) // self.block_size
                old, new = s.block_table[idx], self.allocator.allocate()
                copies.append((old, new))  # `old` stays held by its other owners: never reused as a destination
                self.allocator.decref(old)
                s.block_table[idx] = new
                copied = (idx, old, new)
                self.cow_copies += 1
            fresh = [self.allocator.allocate() for _ in range(n)]
            s.block_table.extend(fresh)
            pending.append(_Reservation(sid, fresh, copied))
        self._pending = pending
        return StepPlan(copies, [self.seqs[sid].block_table for sid in step.seq_ids])

    def commit(self, step: Step) -> None:
        """The step succeeded: lengths advance and newly full blocks enter the prefix cache."""
        for sid, n in zip(step.seq_ids, step.num_new, strict=True):
            s = self.seqs[sid]
            s.length += int(n)
            self._register_full(sid, s)
        self._pending = None

    def rollback(self) -> None:
        """The step failed: reserved blocks go back to the front of the free list, tables as before.

        A cached-free block that the aborted step evicted stays evicted: a lost future hit, never a wrong one.
        """
        for r in reversed(self._pending or []):
            s = self.seqs[r.seq_id]
            for bid in reversed(r.new_blocks):
                s.block_table.pop()
                self.allocator.unallocate(bid)
            if r.cow is not None:
                idx, old, new = r.cow
                self.allocator.incref(old)
                s.block_table[idx] = old
                self.allocator.unallocate(new)
                self.cow_copies -= 1
        self._pending = None

    def _register_full(self, seq_id, s: SeqState) -> None:
        """Enter the sequence's newly full blocks into the prefix cache (when its tokens are known)."""
        if not self.allocator.enable_prefix_caching or s.token_ids is None:
            return
        bs = self.block_size
        for i in range(s.num_registered, self._shareable(seq_id, s)):
            self.allocator.register(s.block_table[i], s.block_table[i - 1] if i else None,
                                    s.token_ids[i * bs:(i + 1) * bs])
            s.num_registered = i + 1

    def slots_filled(self) -> dict[int, int]:
        """Device block id -> token slots holding a real token (a shared block counted once)."""
        bs, filled = self.block_size, {}
        for s in self.seqs.values():
            held = set(self._held(s.block_table))
            for j, bid in enumerate(s.block_table):
                if bid in held:
                    filled[bid] = max(filled.get(bid, 0), min(bs, s.length - j * bs))
        return filled
