"""The host tier's asynchronous copy engine (minikv_gpu.tiers.AsyncCacheStorage) and the copy API under it
(minikv_gpu.streams): the same tokens and bytes as the synchronous storage, and the ordering protocol read
from the simulator's stream log.

On the simulator a copy stream built with ``deferred=True`` runs its copies only when something waits
for them, so a missing wait gives wrong numbers here, as a race would on a GPU. Tests marked ``gpu``
check what only a GPU has: page-locked host memory, and copies that run beside a kernel.
"""

import numpy as np
import pytest

from minikv.bench.offload import ChatTrace, run_trace
from minikv.errors import ConfigError, DTypeError, InvalidInputError, ShapeError
from minikv.paged import PagedKVCache as NumpyPagedKVCache
from minikv.scheduler import Scheduler
from minikv.tiers import CacheStorage, OffloadPolicy, OffloadTier
from minikv.weights.random_models import random_model
from minikv_gpu import model as gpu_model
from minikv_gpu import paged as gpu
from minikv_gpu import quant as gpu_quant
from minikv_gpu.tiers import AsyncCacheStorage

BS = 8
TINY = dict(num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=48,
            vocab_size=61)
CPU_MODEL = random_model(seed=11, **TINY)
TRACE = ChatTrace(conversations=6, turns=3, system_prompts=2, system_len=16, user_len=(3, 7), reply_len=4,
                  think_steps=2, arrival_every=1, vocab_size=61, seed=1)


class HostLogits:
    """The GPU model for the scheduler, which samples from host rows."""

    def __init__(self, model):
        self.model = model

    def forward(self, tokens, cache, seq_ids=None, then=None):
        host = self.model.rt.asnumpy
        hook = None if then is None else (lambda logits: then(host(logits)))  # the scheduler samples host rows
        return host(self.model.forward(tokens, cache, seq_ids, then=hook))

    def __getattr__(self, name):
        return getattr(self.model, name)


def make_cache(rt, num_blocks, host_blocks=0, kv_dtype=None, dtype=np.float32):
    args = dict(**CPU_MODEL.new_cache_args(), num_blocks=num_blocks, block_size=BS, dtype=dtype,
                num_host_blocks=host_blocks, runtime=rt)
    if kv_dtype is None:
        return gpu.PagedKVCache(**args)
    return gpu_quant.QuantizedPagedKVCache(**args, kv_dtype=kv_dtype, group=8 if kv_dtype == "kivi2" else 32)


def chat(rt, storage=None, kv_dtype=None):
    """The trace's tokens: an unlimited pool (storage None) or 9 blocks + a 24-block host tier over ``storage``."""
    model = HostLogits(gpu_model.from_cpu(CPU_MODEL, runtime=rt))
    if storage is None:
        cache, policy, tier = make_cache(rt, 400, kv_dtype=kv_dtype), None, None
    else:
        cache = make_cache(rt, 9, 24, kv_dtype)
        tier = OffloadTier(cache, "lru", storage=storage(cache))
        policy = OffloadPolicy(tier, compute_s=lambda tokens, kv: 1e-3)
    out = run_trace(TRACE, Scheduler(model, cache, max_step_tokens=24, policy=policy))
    if tier is not None:
        tier.check()
    return out, tier


REFERENCE = {}


def reference(rt, kv_dtype=None):
    if (rt.name, kv_dtype) not in REFERENCE:
        REFERENCE[rt.name, kv_dtype] = chat(rt, kv_dtype=kv_dtype)[0]
    return REFERENCE[rt.name, kv_dtype]


# -- the copy API ---------------------------------------------------------------------------------

def test_block_copies_move_exactly_the_named_blocks_and_refuse_bad_pools(rt):
    rng = np.random.default_rng(0)
    dev = rt.asarray(rng.standard_normal((2, 5, 3, 4)).astype(np.float16))
    host = rt.pinned_empty((2, 7, 3, 4), np.float16)
    host[...] = 0
    assert rt.is_pinned(host) and rt.is_pinned(host[:, 2:]) and not rt.is_pinned(np.zeros_like(host))
    stream, done = rt.stream(), rt.event()
    rt.copy_blocks_async(host, [6, 1], dev, [0, 4], stream)
    done.record(stream)
    done.synchronize()
    want = rt.asnumpy(dev)
    assert np.array_equal(host[:, [6, 1]], want[:, [0, 4]]) and not host[:, [0, 2, 3, 4, 5]].any()
    back = rt.asarray(np.zeros((2, 5, 3, 4), np.float16))
    rt.copy_blocks_async(back, [3], host, [6], stream)
    stream.synchronize()
    assert np.array_equal(rt.asnumpy(back)[:, 3], want[:, 0]) and not rt.asnumpy(back)[:, [0, 1, 2, 4]].any()
    with pytest.raises(InvalidInputError, match="pinned"):
        rt.copy_blocks_async(np.zeros_like(host), [0], dev, [0], stream)
    with pytest.raises(InvalidInputError, match="outside"):
        rt.copy_blocks_async(host, [7], dev, [0], stream)
    with pytest.raises(InvalidInputError, match="distinct"):
        rt.copy_blocks_async(host, [1, 1], dev, [0, 2], stream)
    with pytest.raises(DTypeError):
        rt.copy_blocks_async(host, [0], rt.asarray(want.astype(np.float32)), [0], stream)
    with pytest.raises(ShapeError):
        rt.copy_blocks_async(host, [0], dev[:, :, :2], [0], stream)


def test_a_deferred_stream_copies_only_when_something_waits(sim_rt):
    rt = sim_rt
    dev, host = np.arange(12.0).reshape(1, 3, 4), rt.pinned_empty((1, 2, 4), np.float64)
    host[...] = -1
    stream, done = rt.stream(deferred=True), rt.event()
    start = len(rt.stream_log)
    rt.copy_blocks_async(host, [1], dev, [2], stream)
    done.record(stream)
    assert not done.done and (host == -1).all()  # issued, not run
    rt.current_stream().wait_event(done)
    assert done.done and np.array_equal(host[0, 1], dev[0, 2])
    assert rt.stream_log[start:] == [("copy", stream.name, "d2h", (2,), (1,)), ("record", stream.name, done.id),
                                     ("wait", "compute", done.id), ("ran", stream.name, 1)]


# -- the same tokens and bytes as the synchronous storage ---------------------------------------------

def test_a_tiny_pool_with_an_async_tier_gives_the_tokens_of_an_unlimited_pool(rt):
    got, tier = chat(rt, AsyncCacheStorage)
    assert got == reference(rt)
    assert tier.stats.host_hits > 0 and tier.stats.prefetched > 0
    assert all(rt.is_pinned(getattr(tier.cache, h)) for h in ("host_k_pool", "host_v_pool"))
    sync, sync_tier = chat(rt, CacheStorage)
    assert sync == got
    if rt.name == "sim":  # copies done at once: the bookkeeping is the same, copy for copy (on a GPU a
        assert sync_tier.stats == tier.stats  # host block held for a running copy may cost a demotion)


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_deferred_copies_still_give_the_unlimited_tokens(sim_rt, kv_dtype):
    got, tier = chat(sim_rt, lambda c: AsyncCacheStorage(c, sim_rt.stream(deferred=True)), kv_dtype)
    assert got == reference(sim_rt, kv_dtype) and tier.stats.host_hits > 0
    assert tier.storage.batches == tier.stats.demoted + tier.stats.promoted + tier.stats.prefetched


def block_bytes(cache, bid: int, host: bool = False) -> bytes:
    """Every stored byte of a block: K/V rows, codes (with their scales) and the quantized flag."""
    pre, get, out = "host_" if host else "", (np.asarray if host else cache.rt.asnumpy), b""
    for name in ("k_pool", "v_pool", "k_codes", "v_codes"):
        arr = getattr(cache, pre + name, None)
        if arr is not None:
            out += np.ascontiguousarray(get(arr[:, bid])).tobytes()
    flags = getattr(cache, pre + "quantized", None)
    return out + (b"" if flags is None else bytes([bool(flags[bid])]))


@pytest.mark.parametrize("kv_dtype, dtype", [(None, np.float32), (None, np.float16), ("int8", np.float32),
                                             ("kivi2", np.float16)], ids=["f32", "f16", "int8", "kivi2"])
@pytest.mark.parametrize("deferred", [False, True], ids=["at-once", "deferred"])
def test_offload_then_reload_is_bit_identical(sim_rt, kv_dtype, dtype, deferred):
    rt = sim_rt
    model = gpu_model.from_cpu(CPU_MODEL, runtime=rt)
    cache = make_cache(rt, 6, 12, kv_dtype, dtype)
    storage = AsyncCacheStorage(cache, rt.stream(deferred=deferred))
    tier = OffloadTier(cache, "lru", storage=storage)
    rng = np.random.default_rng(0)
    p = rng.integers(0, 60, 4 * BS + 1).tolist()  # 4 full blocks + 1 token
    cache.add_sequence("a", p)
    model.forward([p], cache, ["a"])
    before = [block_bytes(cache, b) for b in cache.blocks.table("a").tolist()[:4]]
    cache.free_sequence("a")
    other = rng.integers(0, 60, 6 * BS).tolist()  # 6 blocks: evicts all four
    cache.add_sequence("b", other)
    model.forward([other], cache, ["b"])
    assert tier.stats.demoted == 4
    storage.synchronize()
    on_host = {e.token_ids: e.host_id for e in tier.entries.values()}
    for j in range(4):
        assert block_bytes(cache, on_host[tuple(p[j * BS:(j + 1) * BS])], host=True) == before[j]
    cache.free_sequence("b")
    assert cache.add_sequence("c", p) == 4 * BS and tier.stats.promoted == 4
    storage.before_step()  # what the next step's _reserve does: raw reads of the pools come after the copies
    assert [block_bytes(cache, b) for b in cache.blocks.table("c").tolist()] == before


# -- the ordering protocol ------------------------------------------------------------------------------

def test_the_compute_stream_waits_for_every_batch_before_write_and_attend(sim_rt):
    rt = sim_rt
    cache = make_cache(rt, 9, 24)
    log = rt.stream_log

    class Logged(type(cache)):
        def write(self, layer, k, v):
            log.append(("write", layer))
            super().write(layer, k, v)

        def attend(self, layer, q, **kw):
            log.append(("attend", layer))
            return super().attend(layer, q, **kw)

    cache.__class__ = Logged
    storage = AsyncCacheStorage(cache, rt.stream(deferred=True))
    start = len(log)
    chat_on(rt, cache, storage)
    entries = log[start:]
    name = storage.stream.name
    batches = [i for i, e in enumerate(entries) if e[:2] == ("record", name)]
    assert len(batches) == storage.batches > storage.beside_step > 0  # some prefetches run beside a step
    for i in batches:  # the next use of the pools comes after the compute stream waited on this batch
        use = next((j for j in range(i, len(entries)) if entries[j][0] in ("write", "attend")), None)
        if use is not None:
            assert ("wait", "compute", entries[i][2]) in entries[i:use], entries[i:use]
    copies = [i for i, e in enumerate(entries) if e[:2] == ("copy", name)]
    for i in copies:  # and every copy was ordered after the compute it depends on
        last_wait = max(j for j in range(i) if entries[j][0] in ("wait", "record") and entries[j][1] == name)
        assert entries[last_wait][0] == "wait"


def chat_on(rt, cache, storage):
    tier = OffloadTier(cache, "lru", storage=storage)
    model = HostLogits(gpu_model.from_cpu(CPU_MODEL, runtime=rt))
    out = run_trace(TRACE, Scheduler(model, cache, max_step_tokens=24,
                                     policy=OffloadPolicy(tier, compute_s=lambda t, kv: 1e-3)))
    assert out == reference(rt)
    return tier


def test_a_host_block_is_not_handed_out_again_before_the_copy_reading_it_ran(sim_rt):
    rt = sim_rt
    cache = make_cache(rt, 4, 3)
    storage = AsyncCacheStorage(cache, rt.stream(deferred=True))
    hosts = cache.blocks.host_allocator
    h = hosts.allocate()
    storage.demote([0], [h])
    storage.promote([h], [1], prefetch=False)  # the host block is read by a copy that has not run
    storage.release_host(h)
    assert storage.held_host_blocks() == [h] and hosts.ref_count(h) == 1
    assert sorted(hosts.allocate() for _ in range(hosts.num_free)) == sorted(set(range(3)) - {h})
    storage.stream.synchronize()  # the copy ran (on a GPU: the engine got there)
    storage.before_step()
    assert storage.held_host_blocks() == [] and hosts.ref_count(h) == 0 and hosts.allocate() == h


def test_release_waits_for_the_copy_when_the_host_pool_would_run_dry(sim_rt):
    rt = sim_rt
    cache = make_cache(rt, 4, 1)
    storage = AsyncCacheStorage(cache, rt.stream(deferred=True))
    h = cache.blocks.host_allocator.allocate()
    storage.demote([2], [h])  # a demotion still writing the block counts too
    assert storage.stream.ran == 0
    storage.release_host(h)
    assert storage.forced_waits == 1 and storage.stream.ran == storage.stream.issued
    assert cache.blocks.host_allocator.num_free == 1 and storage.held_host_blocks() == []


def test_a_missing_wait_gives_wrong_numbers_on_a_deferred_stream(sim_rt):
    """The simulator's deferred stream catches a broken protocol: a storage whose compute never waits."""
    class NoWait(AsyncCacheStorage):
        def before_step(self):
            self._pending = []

    rt = sim_rt
    model = gpu_model.from_cpu(CPU_MODEL, runtime=rt)
    cache = make_cache(rt, 6, 12)
    OffloadTier(cache, "lru", storage=NoWait(cache, rt.stream(deferred=True)))
    rng = np.random.default_rng(1)
    p, other = rng.integers(0, 60, 2 * BS + 1).tolist(), rng.integers(0, 60, 6 * BS).tolist()
    cache.add_sequence("a", p)
    model.forward([p], cache, ["a"])
    before = cache.read_kv("a", 0)[0][:2 * BS]
    cache.free_sequence("a")
    cache.add_sequence("b", other)  # evicts a's blocks: their demotions wait in the queue
    model.forward([other], cache, ["b"])  # ... while b's writes overwrite the blocks they were to read
    cache.free_sequence("b")
    assert cache.add_sequence("c", p) == 2 * BS  # promoted, in the queue too: attention would read stale rows
    assert not np.array_equal(cache.read_kv("c", 0)[0], before)


def test_the_storage_refuses_what_it_cannot_serve(sim_rt):
    with pytest.raises(ConfigError, match="minikv_gpu.paged"):
        AsyncCacheStorage(NumpyPagedKVCache(1, 1, 8, num_blocks=4, num_host_blocks=2))
    cache = make_cache(sim_rt, 4, 2)
    cache.add_sequence("a")
    with pytest.raises(ConfigError, match="fresh"):
        AsyncCacheStorage(cache)


# -- on a GPU --------------------------------------------------------------------------------------------

SPIN = r"""
extern "C" __global__ void spin(long long cycles, int* out) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
    if (threadIdx.x == 0) out[0] = 1;
}
"""


@pytest.mark.gpu
def test_the_host_pools_are_page_locked(cupy_rt):
    cache = make_cache(cupy_rt, 6, 12, "int8")
    AsyncCacheStorage(cache)
    attrs = cupy_rt.xp.cuda.runtime.pointerGetAttributes
    for name in ("host_k_pool", "host_v_pool", "host_k_codes", "host_v_codes"):
        assert attrs(getattr(cache, name).ctypes.data).type == 1, name  # cudaMemoryTypeHost
    assert attrs(np.zeros(1024).ctypes.data).type == 0  # pageable memory is unregistered


@pytest.mark.gpu
def test_a_copy_on_the_copy_stream_finishes_while_a_kernel_still_runs(cupy_rt):
    rt = cupy_rt
    dev = rt.asarray(np.ones((4, 64, 1024), np.float32))
    host = rt.pinned_empty(dev.shape, dev.dtype)
    flag = rt.xp.zeros(1, np.int32)
    kernel = rt.kernel_from_source(SPIN, "spin")
    copy, copied, computed = rt.stream(), rt.event(), rt.event()
    rt.synchronize()
    kernel((1,), (32,), (np.int64(2_000_000_000), flag))  # about a second on a 2 GHz SM clock
    computed.record(rt.current_stream())
    rt.copy_blocks_async(host, list(range(64)), dev, list(range(64)), copy)
    copied.record(copy)
    copied.synchronize()
    assert not computed.done, "the copy waited for the kernel: the copy stream is not independent"
    computed.synchronize()
    assert int(flag.get()[0]) == 1 and np.array_equal(host, rt.asnumpy(dev))


def test_the_cupy_copy_path_computes_its_pointers_and_pitches_right():
    """CupyCopies.copy_blocks_async with stand-ins for cupy.ndarray and cudaMemcpy2DAsync (a row-by-row memmove):
    the offsets, pitches and widths a GPU would get, checked here without one."""
    import ctypes
    from types import SimpleNamespace

    from test_cupy_runtime import FakeDeviceArray

    from minikv_gpu.streams import CupyCopies

    calls = []

    def memcpy2d(dst, dpitch, src, spitch, width, height, kind, stream):
        calls.append((width, height, kind, stream))
        for r in range(height):
            ctypes.memmove(dst + r * dpitch, src + r * spitch, width)

    pinned = np.zeros((3, 6, 2, 4), np.float16)
    lo, hi = pinned.ctypes.data, pinned.ctypes.data + pinned.nbytes
    cuda = SimpleNamespace(runtime=SimpleNamespace(
        memcpy2DAsync=memcpy2d, memcpyDefault=4,
        pointerGetAttributes=lambda ptr: SimpleNamespace(type=1 if lo <= ptr < hi else 0)))
    rt = type("FakeCupy", (CupyCopies,), {"xp": SimpleNamespace(ndarray=FakeDeviceArray, cuda=cuda)})()
    memory = np.random.default_rng(0).standard_normal((3, 5, 2, 4)).astype(np.float16)
    dev, stream = FakeDeviceArray(memory), SimpleNamespace(ptr=77)
    assert rt.is_pinned(pinned) and not rt.is_pinned(np.zeros(4))
    rt.copy_blocks_async(pinned, [5, 0], dev, [1, 3], stream)
    assert np.array_equal(pinned[:, [5, 0]], memory[:, [1, 3]]) and not pinned[:, 1:5].any()
    assert calls == [(2 * 4 * 2, 3, 4, 77)] * 2  # one 2D copy per block: L rows of one layer's block
    memory[...] = 0
    rt.copy_blocks_async(dev, [4], pinned, [5], stream)
    assert np.array_equal(memory[:, 4], pinned[:, 5]) and not memory[:, :4].any()
