"""A host offload tier for paged blocks: demote on eviction, promote on a prefix hit, prefetch, a link cost model.

Two pools of the same layout (``minikv.paged``): the device pool of N blocks and the cache's host
pool of M blocks (``num_host_blocks``; for a quantized cache its codes and scales come along,
for an MLA cache its latent pool). ``OffloadTier(cache, policy)`` attaches to a fresh cache.

What moves, and when
--------------------
* **Demote** (device -> host). Only a block that no sequence holds can leave the device: a
  full, registered block whose last holder freed it (the allocator's cached-free list, see
  ``minikv.paged.allocator``). When an allocation evicts such a block, the allocator's
  ``on_evict`` hook hands it here *before* anything overwrites it; the policy decides whether to
  store it (``minikv.tiers.policies``) and which host block to give up for it. A block held by a
  running sequence (ref count >= 1: shared prefixes, forks, copy-on-write) is never a candidate;
  a sequence that stops running gives its blocks up by being preempted or finishing.
* **Promote** (host -> device). The host tier is keyed by the block's chain hash, so the prefix
  cache extends across it: ``BlockManager._add`` walks the device prefix cache, then asks
  ``extend_hit`` to continue the walk on the host. Each host hit is copied into a fresh device
  block before the sequence's first step and registered again, so the next request finds it on
  the device. The host copy stays (an inclusive tier): demoting it again costs no copy.
* **Prefetch**. The scheduler knows which waiting requests come next; ``OffloadPolicy.account``
  promotes their host blocks into free device blocks (as cached-free blocks, so they cost nothing
  if never used) while the step computes.

A hit is never wrong: like the device table, a host entry is checked against the block's token
ids *and* its parent's identity. Each block carries a ``stamp``, the identity of its first life on
the device; a promoted block keeps it (``Block.canon``), so a chain stays linked through any number
of round trips, and a hash collision only costs a miss. (A block recomputed while its twin sits on
the host, e.g. one the "leave a token to run" rule recomputes, keeps an identity of its own: its
children on the host are found only while it is on the device. A lost hit, never a wrong one.)

The cost model
--------------
``Link`` prices a copy at ``bytes / bandwidth``. Per scheduler step (``end_step``): prefetch
copies overlap the step's compute, ``hidden = min(prefetch, compute)``, and what is left over
stalls the next step; a promotion that was not prefetched and every demotion stall the step
(the step writes into the evicted block, and reads the promoted one). The step's compute time
comes from the caller (``OffloadPolicy(compute_s=...)``); this module knows no model.

The GPU wing (where a subclass hooks in)
----------------------------------------
Every copy goes through ``CacheStorage``: ``demote(dev, host)``, ``promote(host, dev, prefetch)``,
``release_host(host_id)`` and ``before_step()``. The NumPy storage copies at once through the
cache's ``_swap_out_blocks``/``_swap_in_blocks`` (``minikv_gpu.paged`` overrides those with
synchronous staged copies, so a tier already runs there). An asynchronous version subclasses
``CacheStorage`` and is passed as ``OffloadTier(..., storage=...)``: the storage moves the host
pools (codes included) into pinned memory, both copy kinds are issued on a copy stream with one
event recorded per batch; ``before_step`` makes the compute stream wait on the pending events, and
the storage installs it as the device cache's ``wait_for_copies``, which the cache calls at the end of its ``_reserve``
(after the step's allocations demoted what they evict, before ``write`` overwrites those blocks
or ``attend`` reads promoted ones); ``release_host`` keeps a host block out of ``host_allocator``
until the event of the last copy reading or writing it has completed. ``minikv_gpu.tiers`` is that
subclass (``AsyncCacheStorage``). The bookkeeping here stays as it is.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

from minikv.errors import ConfigError, InvalidInputError, check_choice, check_int
from minikv.paged.allocator import Block
from minikv.paged.cache import PagedKVCache
from minikv.paged.manager import no_host_hit
from minikv.tiers.policies import LRU, POLICIES, SeenTwice, make_policy


@dataclass(frozen=True)
class Link:
    """A host <-> device link: ``seconds(nbytes) = nbytes / bytes_per_s`` (one direction)."""

    name: str
    bytes_per_s: float

    def seconds(self, nbytes: int) -> float:
        return nbytes / self.bytes_per_s


LINKS = {
    # PCIe 4.0 x16: 16 GT/s x 16 lanes x 128b/130b = 31.5 GB/s per direction (PCI-SIG, PCIe Base Spec 4.0)
    "pcie4": Link("pcie4", 31.5e9),
    # PCIe 5.0 x16: 32 GT/s x 16 lanes x 128b/130b = 63.0 GB/s per direction (PCI-SIG, PCIe Base Spec 5.0)
    "pcie5": Link("pcie5", 63.0e9),
    # NVLink-C2C (Grace Hopper): 900 GB/s total, 450 GB/s per direction (NVIDIA GH200 Superchip datasheet)
    "nvlink-c2c": Link("nvlink-c2c", 450e9),
}


@dataclass
class TierStats:
    """Counters of a tier (blocks unless named otherwise); times in seconds under the link model."""

    host_lookups: int = 0      # full prompt blocks the device prefix cache missed at admission
    host_hits: int = 0         # of those, found on the host and promoted
    demoted: int = 0           # device -> host copies
    promoted: int = 0          # host -> device copies on the critical path (not prefetched)
    prefetched: int = 0        # host -> device copies ahead of time
    prefetch_used: int = 0     # prefetched blocks a later request found on the device
    host_evictions: int = 0    # host entries the policy gave up
    bytes_d2h: int = 0
    bytes_h2d: int = 0
    steps: int = 0
    compute_s: float = 0.0
    hidden_s: float = 0.0      # transfer time under compute
    stall_s: float = 0.0       # transfer time the steps waited for

    bytes_moved = property(lambda self: self.bytes_d2h + self.bytes_h2d)

    def summary(self) -> dict:
        return {**asdict(self), "bytes_moved": self.bytes_moved}


@dataclass
class HostEntry:
    """One full block on the host: where, its tokens, its parent's identity and its own stamp."""

    host_id: int
    token_ids: tuple
    parent: tuple | None
    stamp: tuple


class CacheStorage:
    """The copies of a tier, through the cache's swap hooks (see the module docstring for a GPU subclass)."""

    def __init__(self, cache: PagedKVCache):
        self.cache = cache

    def demote(self, dev: list[int], host: list[int]) -> None:
        self.cache._swap_out_blocks(dev, host)

    def promote(self, host: list[int], dev: list[int], prefetch: bool) -> None:
        self.cache._swap_in_blocks(host, dev)

    def before_step(self) -> None:
        """Order the next step after the copies it depends on (NumPy copies are already done)."""

    def release_host(self, host_id: int) -> None:
        """A host block leaves the tier; give it back once no copy still reads it (here: at once)."""
        self.cache.blocks.host_allocator.decref(host_id)


@dataclass
class _StepBytes:
    sync_h2d: int = 0  # promotions at admission
    d2h: int = 0       # demotions caused by the step's own allocations
    prefetch: int = 0  # prefetch copies and the demotions they caused (both under compute)


class OffloadTier:
    """A host tier over ``cache``'s host pool (see the module docstring).

    cache:           a fresh ``PagedKVCache`` (or subclass) with prefix caching and ``num_host_blocks`` > 0
    policy:          a name of ``minikv.tiers.policies.POLICIES`` or a policy object
    capacity:        host blocks the tier may hold (default ``num_host_blocks``; the rest stays for swapping)
    link:            a key of ``LINKS`` or a ``Link``
    bytes_per_block: what one block costs on the link (default: the cache's device bytes per block)
    storage:         the copy engine (default ``CacheStorage(cache)``)
    """

    def __init__(self, cache: PagedKVCache, policy="lru", capacity: int | None = None, link="pcie4",
                 bytes_per_block: int | None = None, storage: CacheStorage | None = None):
        self._check_cache(cache)
        self.capacity = check_int("capacity", cache.num_host_blocks if capacity is None else capacity,
                                  maximum=cache.num_host_blocks, hint="the tier lives in the host pool")
        if isinstance(policy, str):
            policy = make_policy(check_choice("policy", policy, POLICIES), self.capacity)
        if not isinstance(policy, (LRU, SeenTwice)) or policy.capacity != self.capacity:
            raise ConfigError(f"policy={policy!r}: pass a name of {POLICIES} or a policy of capacity {self.capacity}")
        self.link = LINKS[check_choice("link", link, tuple(LINKS))] if isinstance(link, str) else link
        if not isinstance(self.link, Link):
            raise ConfigError(f"link={link!r}: pass one of {tuple(LINKS)} or a minikv.tiers.tier.Link")
        self.bytes_per_block = check_int("bytes_per_block", bytes_per_block if bytes_per_block is not None
                                         else cache.bytes_allocated() // cache.num_blocks)
        self.cache, self.policy = cache, policy
        self.storage = CacheStorage(cache) if storage is None else storage
        self.allocator, self.host_allocator = cache.blocks.allocator, cache.blocks.host_allocator
        self.entries: dict = {}        # chain hash -> HostEntry
        self._prefetched: set = set()  # chain hashes promoted ahead of time, not yet used
        self._step = _StepBytes()
        self._in_prefetch = False
        self._carry_s = 0.0            # prefetch time the last step could not hide
        self.stats = TierStats()
        cache.blocks.extend_hit = self.extend_hit  # the tier installs its two hooks: hits continue on the host,
        self.allocator.on_evict = self._on_evict  # and evicted blocks come here before they are overwritten

    @staticmethod
    def _check_cache(cache) -> None:
        if not isinstance(cache, PagedKVCache):
            raise ConfigError(f"an offload tier needs a PagedKVCache, got {type(cache).__name__}")
        if cache.num_host_blocks < 1 or not cache.blocks.allocator.enable_prefix_caching:
            raise ConfigError("an offload tier needs a host pool and prefix caching: build the cache with "
                              "num_host_blocks > 0 and enable_prefix_caching=True")
        if cache.seq_ids() or cache.blocks.extend_hit is not no_host_hit or cache.blocks.allocator.on_evict is not None:
            raise ConfigError("attach the offload tier to a fresh cache (no sequences, no other tier)")

    # -- demote: the allocator evicts a cached-free block ----------------------------------------
    def _on_evict(self, b: Block) -> None:
        if b.ref_count:
            raise RuntimeError(f"block {b.block_id} is held ({b.ref_count}) but was evicted; this is a bug")
        key, e = b.hash, self.entries.get(b.hash)
        self._prefetched.discard(key)
        if e is not None:
            if e.stamp == b.canon:
                self.policy.access(key)  # the host copy is the same block: a reference, no copy
            return  # else another chain under a colliding hash holds the key: keep it
        evicted = self.policy.insert(key)
        if evicted is None:
            return  # refused by the admission filter
        for victim in evicted:
            self.storage.release_host(self.entries.pop(victim).host_id)
            self.stats.host_evictions += 1
        if self.host_allocator.num_free == 0:  # swapped-out sequences hold the rest of the pool
            self.policy.remove(key)
            return
        hid = self.host_allocator.allocate()
        self.storage.demote([b.block_id], [hid])
        self.entries[key] = HostEntry(hid, b.token_ids, b.parent, b.canon)
        self.stats.demoted += 1
        self.stats.bytes_d2h += self.bytes_per_block
        if self._in_prefetch:
            self._step.prefetch += self.bytes_per_block
        else:
            self._step.d2h += self.bytes_per_block

    # -- promote: a prefix walk continues on the host ----------------------------------------------
    def _walk(self, tokens: Sequence[int], hit: list[int]):
        """Yield (key, entry) of the host chain continuing device blocks ``hit``, leaving >= 1 token to run."""
        bs = self.cache.block_size
        last = self.allocator.blocks[hit[-1]] if hit else None
        prefix, parent = (None, None) if last is None else (last.hash, last.canon)
        for i in range(len(hit), (len(tokens) - 1) // bs):
            toks = tuple(int(t) for t in tokens[i * bs:(i + 1) * bs])
            key = self.allocator.hash_fn(prefix, toks)
            if self.allocator.lookup(key) is not None:
                return  # a device block under this hash (a collision): do not shadow it
            e = self.entries.get(key)
            if e is None or e.token_ids != toks or e.parent != parent:
                return
            yield key, e
            prefix, parent = key, e.stamp

    def _promote(self, key, e: HostEntry, prev: int | None, prefetch: bool) -> int | None:
        """Copy host entry ``e`` into a fresh device block after ``prev``; its id (held once), or None."""
        if self.allocator.num_free == 0:
            return None
        bid = self.allocator.allocate()  # may evict (and demote) another block: check e is still here
        if self.entries.get(key) is not e:
            self.allocator.unallocate(bid)
            return None
        self.storage.promote([e.host_id], [bid], prefetch)
        self.allocator.register(bid, prev, e.token_ids)
        b = self.allocator.blocks[bid]
        if self.allocator.lookup(key) == bid:
            b.canon = e.stamp  # children on the host name the stamp as their parent
        self.policy.access(key)
        return bid

    def extend_hit(self, tokens: Sequence[int], hit: list[int]) -> list[int]:
        """Promote the host blocks that continue device prefix hit ``hit``; their device ids, each held once.

        Called by ``BlockManager._add`` after ``hit`` is held, so no eviction can take those blocks.
        """
        for bid in hit:
            key = self.allocator.blocks[bid].hash
            if key in self._prefetched:
                self._prefetched.discard(key)
                self.stats.prefetch_used += 1
        self.stats.host_lookups += max(0, (len(tokens) - 1) // self.cache.block_size - len(hit))
        out = []
        for key, e in self._walk(tokens, hit):
            bid = self._promote(key, e, (hit + out)[-1] if hit or out else None, prefetch=False)
            if bid is None:
                break
            out.append(bid)
            self.stats.host_hits += 1
            self.stats.promoted += 1
            self.stats.bytes_h2d += self.bytes_per_block
            self._step.sync_h2d += self.bytes_per_block
        return out

    def prefetch(self, prompts: Sequence[Sequence[int]], max_blocks: int) -> int:
        """Promote the host blocks of ``prompts`` (the next requests) into at most ``max_blocks`` free
        device blocks, left there as cached-free blocks; returns how many were copied.

        Copies made here, and the demotions their allocations cause, overlap the step's compute.
        The prompt's own device hits are held meanwhile, so the prefetch never evicts them.
        """
        check_int("max_blocks", max_blocks, minimum=0, error=InvalidInputError, hint="0 prefetches nothing")
        done, self._in_prefetch = 0, True
        try:
            for tokens in prompts:
                hit = self.allocator.match(tokens)
                for bid in hit:
                    self.allocator.incref(bid)
                chain = []
                for key, e in self._walk(tokens, hit):
                    if done >= max_blocks:
                        break
                    bid = self._promote(key, e, (hit + chain)[-1] if hit or chain else None, prefetch=True)
                    if bid is None:
                        break
                    chain.append(bid)
                    self._prefetched.add(key)
                    done += 1
                for bid in reversed(hit + chain):  # last block first: the chain's head is evicted last
                    self.allocator.decref(bid)
        finally:
            self._in_prefetch = False
        self.stats.prefetched += done
        self.stats.bytes_h2d += done * self.bytes_per_block
        self._step.prefetch += done * self.bytes_per_block
        return done

    # -- the step-level accounting -------------------------------------------------------------------
    def end_step(self, compute_s: float) -> None:
        """Close a step that computed for ``compute_s`` seconds: price its copies (module docstring)."""
        if not compute_s >= 0:
            raise InvalidInputError(f"compute_s={compute_s!r}; pass the step's compute time in seconds (>= 0)")
        st, s, link = self.stats, self._step, self.link
        prefetch = link.seconds(s.prefetch)
        hidden = min(prefetch, compute_s)
        # the previous step's unhidden prefetch, then this step's own blocking copies
        st.stall_s += self._carry_s + link.seconds(s.sync_h2d) + link.seconds(s.d2h)
        st.hidden_s += hidden
        st.compute_s += compute_s
        st.steps += 1
        self._carry_s, self._step = prefetch - hidden, _StepBytes()

    def finish(self) -> None:
        """End of a run: the last step's unhidden prefetch counts as a stall."""
        self.stats.stall_s += self._carry_s
        self._carry_s = 0.0

    # -- inspection ------------------------------------------------------------------------------------
    def host_block_ids(self) -> list[int]:
        return [e.host_id for e in self.entries.values()]

    def check(self) -> None:
        """Assert the tier's invariants (tests): policy and entries agree; every host block has one owner."""
        self.policy.check()
        assert set(self.entries) == set(self.policy.resident()), "the policy and the host entries disagree"
        assert len(self.entries) <= self.capacity
        ids = self.host_block_ids()
        assert len(set(ids)) == len(ids), "a host block holds two entries"
        swapped = [b for s in self.cache.blocks.seqs.values() if s.host_table is not None
                   for b in s.host_table if b >= 0]
        assert not set(ids) & set(swapped), "a tier block is also a swapped-out sequence's"
        assert all(self.host_allocator.ref_count(h) == 1 for h in ids + swapped)
        assert self.host_allocator.num_used == len(ids) + len(swapped), "a host block is lost"


__all__ = ["CacheStorage", "HostEntry", "LINKS", "Link", "OffloadTier", "TierStats"]
