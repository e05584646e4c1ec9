"""The host offload tier on the GPU (mirrors ``minikv.tiers``): pinned host pools, copies on their own stream.

The bookkeeping is ``minikv.tiers.tier.OffloadTier``'s, unchanged; only the copy engine differs.
``OffloadTier(cache, policy, storage=AsyncCacheStorage(cache))`` over a ``minikv_gpu.paged.PagedKVCache``
(or the quantized ``minikv_gpu.quant.QuantizedPagedKVCache``):

* the host pools (K/V, and the codes of a quantized cache) are moved to pinned memory
  (``rt.pinned_empty``), so the DMA engine reads and writes them without a staging copy;
* a demotion or promotion is one batch of ``rt.copy_blocks_async`` on the copy stream (one 2D copy
  per block and pool, ``minikv_gpu.streams``) followed by one event; host-side flags (``quantized``)
  are bookkeeping and are copied when the batch is issued.

The ordering protocol (device blocks and host blocks, both directions)
----------------------------------------------------------------------
1. *A batch waits for the compute that last touched its device blocks.* A block that was free when
   the running step started is not touched by that step's kernels (a step's kernels only touch
   blocks its sequences hold), so a batch of such blocks waits on an event recorded at the step's
   start (``before_step``) and runs while the step computes; a batch touching a block held at that
   start waits for all compute issued so far. Compute outside a step (swaps, copy-on-write) makes
   the next batches wait for all compute, until the next step starts.
2. *The compute stream waits for the batches before it uses the pools.* The device cache calls
   ``before_step()`` at the end of ``_reserve`` (after the step's allocations demoted what they
   evict: ``write`` overwrites those blocks, ``attend`` reads promoted ones) and before its other
   uses of the pools (copy-on-write, swaps, ``read_kv``): the compute stream waits on every pending
   batch event.
3. *No host block is handed out again while a copy still uses it.* ``release_host`` gives a host block
   back to ``host_allocator`` only when the event of the last copy touching it (a promotion reading
   it, or a demotion still writing it) is done; until then it is held aside and reaped at the next
   call. If holding it would leave the host pool with no free block, the storage waits for the
   oldest held copy instead (so the tier never skips a demotion the NumPy storage would make).

On the simulator the same code runs with ``SimStream``: copies at once by default, or queued until
needed (``rt.stream(deferred=True)``), where a broken rule shows up as wrong numbers.
``synchronize()`` waits for every copy (tests and inspection of the host pools).
"""

from __future__ import annotations

from minikv.errors import ConfigError
from minikv.tiers.tier import CacheStorage
from minikv_gpu.paged import PagedKVCache, no_pending_copies

__all__ = ["AsyncCacheStorage", "HOST_POOLS"]

HOST_POOLS = (("k_pool", "host_k_pool"), ("v_pool", "host_v_pool"), ("k_codes", "host_k_codes"),
              ("v_codes", "host_v_codes"))  # (device, host) pools of one block layout [L, blocks, ...]
HOST_FLAGS = (("quantized", "host_quantized"),)  # host-side bookkeeping arrays [blocks]


class AsyncCacheStorage(CacheStorage):
    """A tier's copies on a copy stream, ordered by events (see the module docstring).

    cache:  a fresh GPU ``PagedKVCache`` (or its quantized subclass) with a host pool
    stream:  the copy stream (default ``cache.rt.stream()``; tests pass ``rt.stream(deferred=True)``)
    """

    def __init__(self, cache, stream=None):
        if not isinstance(cache, PagedKVCache):
            raise ConfigError(f"AsyncCacheStorage needs a minikv_gpu.paged.PagedKVCache, got {type(cache).__name__}; "
                              "a NumPy cache takes minikv.tiers.tier.CacheStorage")
        if cache.seq_ids() or cache.wait_for_copies is not no_pending_copies:
            raise ConfigError("build AsyncCacheStorage on a fresh cache (no sequences, no tier yet)")
        super().__init__(cache)
        cache.wait_for_copies = self.before_step  # the cache waits on this storage's copies before using its pools
        self.rt = rt = cache.rt
        self.stream = rt.stream() if stream is None else stream
        self.pools = [(d, h) for d, h in HOST_POOLS if getattr(cache, h, None) is not None]
        self.flags = [(d, h) for d, h in HOST_FLAGS if getattr(cache, h, None) is not None]
        for _, h in self.pools:  # the cache is fresh: nothing on the host yet, pinning keeps the contents anyway
            a = getattr(cache, h)
            if not rt.is_pinned(a):
                pinned = rt.pinned_empty(a.shape, a.dtype)
                pinned[...] = a
                setattr(cache, h, pinned)
        self._fence = rt.event()       # re-recorded on the compute stream before a batch that needs it
        self._step_start = None        # compute event at the running step's start (None: not usable)
        self._cold: set = set()        # device blocks free when that step started
        self._pending: list = []       # batch events the compute stream has not waited on
        self._last: dict = {}          # host block -> event of the last copy touching it
        self._held: list = []          # (host block, event): released, their copy still runs
        self.batches = 0            # copy batches issued (one event each)
        self.beside_step = 0        # of those, batches free to run while the running step computes (rule 1)
        self.deferred_releases = 0  # host blocks held aside by release_host (rule 3)
        self.forced_waits = 0       # times release_host waited for a copy to keep a host block free

    # -- copies ----------------------------------------------------------------------------------------
    def demote(self, dev: list[int], host: list[int]) -> None:
        self._issue(dev, host, to_host=True)

    def promote(self, host: list[int], dev: list[int], prefetch: bool) -> None:
        self._issue(dev, host, to_host=False)

    def _issue(self, dev: list[int], host: list[int], to_host: bool) -> None:
        """One batch: wait for the compute that touched ``dev`` (rule 1), copy every pool, record an event."""
        if not dev:
            return
        self._reap()
        cache, rt = self.cache, self.rt
        if self._step_start is not None and self._cold.issuperset(dev):
            self.stream.wait_event(self._step_start)
            self.beside_step += 1
        else:
            self._fence.record(rt.current_stream())
            self.stream.wait_event(self._fence)
        for d, h in self.pools:
            dev_pool, host_pool = getattr(cache, d), getattr(cache, h)
            if to_host:
                rt.copy_blocks_async(host_pool, host, dev_pool, dev, self.stream)
            else:
                rt.copy_blocks_async(dev_pool, dev, host_pool, host, self.stream)
        for d, h in self.flags:
            if to_host:
                getattr(cache, h)[host] = getattr(cache, d)[dev]
            else:
                getattr(cache, d)[dev] = getattr(cache, h)[host]
        event = rt.event()
        event.record(self.stream)
        self._pending.append(event)
        for h in host:
            self._last[h] = event
        self.batches += 1

    # -- ordering ----------------------------------------------------------------------------------------
    def before_step(self) -> None:
        """The compute stream waits on every pending batch (rule 2); a step's start is noted for rule 1."""
        compute = self.rt.current_stream()
        for event in self._pending:
            compute.wait_event(event)
        self._pending = []
        self._reap()
        if getattr(self.cache, "_step_tables", None) is None:
            self._step_start = None  # compute outside a step (swap, copy-on-write): no step to run beside
            return
        allocator = self.cache.blocks.allocator
        self._cold = set(allocator.free_block_ids()) | set(allocator.cached_block_ids())
        if self._step_start is None:
            self._step_start = self.rt.event()
        self._step_start.record(compute)

    def release_host(self, host_id: int) -> None:
        """Give ``host_id`` back once the last copy touching it is done (rule 3)."""
        self._reap()
        event = self._last.pop(host_id, None)
        if event is None or event.done:
            self.cache.blocks.host_allocator.decref(host_id)
            return
        self._held.append((host_id, event))
        self.deferred_releases += 1
        if self.cache.blocks.host_allocator.num_free == 0:
            self.forced_waits += 1
            self._held[0][1].synchronize()
            self._reap()

    def _reap(self) -> None:
        """Return held host blocks whose copies are done."""
        still = []
        for host_id, event in self._held:
            if event.done:
                self.cache.blocks.host_allocator.decref(host_id)
            else:
                still.append((host_id, event))
        self._held = still

    def held_host_blocks(self) -> list[int]:
        """Host blocks released by the tier but not yet given back (their copies still run)."""
        return [h for h, _ in self._held]

    def synchronize(self) -> None:
        """Wait for every copy issued so far; order the compute stream after them; reap held host blocks."""
        self.stream.synchronize()
        self.before_step()
