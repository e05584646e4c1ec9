"""The CPU simulator runs CUDA as CUDA does (minikv_gpu/cpu_sim/): barriers, shuffles, votes,
atomics, shared memory, vector and half types, math, and every project kernel compiles.

Kernels that are plain CUDA run on every backend (``rt``: the simulator, plus CuPy on a GPU);
tests of the simulator's own behaviour run on ``sim_rt``. What the simulator reports (deadlocks,
faults, launch checks) is in test_cpu_sim_reports.py; the runtime around it in test_sim_runtime.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from sim_sources import ROOT, check_warp_sums, dev, k, sim_k

from minikv_gpu import cpu_sim
from minikv_gpu.cpu_sim.signature import KERNEL_MARK, find_kernels

# ---- kernels: what works ---------------------------------------------------------------------

def test_block_reduction_with_shared_memory_and_syncthreads(rt):
    n, blocks = 1000, 3
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    out = dev(rt, np.zeros(blocks, np.float32))
    k(rt, "block_sum")((blocks,), (256,), (dev(rt, x), out, np.int32(n)))
    # a grid-stride loop: block b sums x[b*256 + t + j*768] over its threads t and strides j
    want = [x[np.arange(n) % 768 // 256 == b].astype(np.float64).sum() for b in range(blocks)]
    np.testing.assert_allclose(rt.asnumpy(out), want, rtol=1e-5)


def test_warp_reduction_with_shfl_xor(rt):
    check_warp_sums(rt)


def _shuffle_model(vals, mode, arg, width):
    """CUDA's documented results, lane by lane, for a full warp."""
    out = []
    for lane in range(32):
        seg = lane - lane % width  # first lane of this lane's segment of `width` lanes
        if mode == 0:
            src = seg + arg % width
        elif mode == 1:
            src = lane - arg if lane - arg >= seg else lane  # not below the segment: own value
        elif mode == 2:
            src = lane + arg if lane + arg < seg + width else lane
        else:
            src = lane ^ arg if (lane ^ arg) < seg + width else lane  # later segments: own value
        out.append(vals[src])
    return out


@pytest.mark.parametrize("mode", [0, 1, 2, 3], ids=["idx", "up", "down", "xor"])
@pytest.mark.parametrize("arg,width", [(0, 32), (1, 32), (5, 32), (31, 32), (3, 8), (9, 8), (1, 16), (16, 16)])
def test_shuffles_follow_cuda_semantics(rt, mode, arg, width):
    vals = np.arange(100, 132, dtype=np.int32)
    out = dev(rt, np.zeros(32, np.int32))
    k(rt, "shuffle")((1,), (32,), (dev(rt, vals), out, np.int32(mode), np.int32(arg), np.int32(width)))
    assert rt.asnumpy(out).tolist() == _shuffle_model(vals.tolist(), mode, arg, width)


def test_divergent_half_warp_shuffles_are_legal(rt):
    x = np.arange(64, dtype=np.float32)
    out = dev(rt, np.zeros(64, np.float32))
    k(rt, "half_warp_sums")((1,), (64,), (dev(rt, x), out))
    got = rt.asnumpy(out).reshape(2, 2, 16)
    np.testing.assert_array_equal(got[:, 0], np.repeat(x.reshape(2, 2, 16)[:, 0].sum(-1, keepdims=True), 16, -1))
    # the upper half used __shfl_down_sync with width 16: lane 16+j holds the sum of lanes 16+j .. 31
    upper = x.reshape(2, 2, 16)[:, 1]
    np.testing.assert_array_equal(got[:, 1, 0], upper.sum(-1))


def test_votes_and_syncthreads_count(rt):
    pred = (np.arange(128) % 3 == 0).astype(np.int32)
    pred[64:96] = 1  # warp 2: all true
    pred[96:128] = 0  # warp 3: all false
    ballot, anyv, allv = (dev(rt, np.zeros(4, t)) for t in (np.uint32, np.int32, np.int32))
    count = dev(rt, np.zeros(6, np.int32))
    k(rt, "votes")((2,), (64,), (dev(rt, pred), ballot, anyv, allv, count))
    bits = pred.reshape(4, 32)
    want_ballot = [int(sum(int(b) << i for i, b in enumerate(w))) for w in bits]
    assert rt.asnumpy(ballot).tolist() == want_ballot
    assert rt.asnumpy(anyv).tolist() == [int(w.any()) for w in bits]
    assert rt.asnumpy(allv).tolist() == [int(w.all()) for w in bits]
    blocks = pred.reshape(2, 64)
    want_count = [[int(b.sum()), int(b.all()), int(b.any())] for b in blocks]
    assert rt.asnumpy(count).reshape(2, 3).tolist() == want_count


def test_syncwarp_match_reduce_and_activemask(rt):
    x = np.array([3, 1, 3, 2] * 8, np.int32)
    match, total, active = (dev(rt, np.zeros(32, np.uint32)) for _ in range(3))
    lowest, swapped = dev(rt, np.zeros(32, np.int32)), dev(rt, np.zeros(32, np.float32))
    k(rt, "warp_misc")((1,), (32,), (dev(rt, x), match, total, lowest, active, swapped))
    same = [sum(1 << j for j in range(32) if x[j] == x[i]) for i in range(32)]
    assert rt.asnumpy(match).tolist() == same
    assert rt.asnumpy(total).tolist() == [int(x.sum())] * 32
    assert rt.asnumpy(lowest).tolist() == [int(x.min()) - 5] * 32
    assert rt.asnumpy(active).tolist() == [0xFFFFFFFF] * 32
    np.testing.assert_array_equal(rt.asnumpy(swapped), x[::-1].astype(np.float32))


def test_atomics(rt):
    n = 300
    x = np.random.default_rng(1).integers(0, 100, n).astype(np.int32)
    hist, fsum = dev(rt, np.zeros(8, np.int32)), dev(rt, np.zeros(1, np.float32))
    imax, imin = dev(rt, np.array([-1000], np.int32)), dev(rt, np.array([1000], np.int32))
    umax, exch, cas = dev(rt, np.zeros(1, np.uint32)), dev(rt, np.zeros(1, np.int32)), dev(rt, np.zeros(1, np.int32))
    k(rt, "atomics")((3,), (128,), (dev(rt, x), np.int32(n), hist, fsum, imax, imin, umax, exch, cas))
    assert rt.asnumpy(hist).tolist() == np.bincount(x & 7, minlength=8).tolist()
    assert rt.asnumpy(fsum)[0] == 0.5 * n
    assert rt.asnumpy(imax)[0] == x.max() - 50 and rt.asnumpy(imin)[0] == x.min() - 50
    assert rt.asnumpy(umax)[0] == x.max() and rt.asnumpy(exch)[0] == 7 and rt.asnumpy(cas)[0] == n


def test_dynamic_shared_memory(rt):
    x = np.arange(3 * 48, dtype=np.float32)
    out = dev(rt, np.zeros_like(x))
    k(rt, "reverse_dynamic")((3,), (48,), (dev(rt, x), out), shared_mem=48 * 4)
    np.testing.assert_array_equal(rt.asnumpy(out), x.reshape(3, 48)[:, ::-1].ravel())


def test_missing_syncthreads_reads_what_was_not_written_yet(sim_rt, default_schedule):
    """The simulator runs thread 0, 1, 2, ... each up to its next barrier. Without the barrier,
    thread t < n/2 reads buf[n-1-t] before its owner wrote it, and shared memory starts as
    0xff bytes (NaN), so the race shows as NaN in the first half, on every run. (A GPU gives
    some mix of stale and fresh values instead: the bug is the same, the symptom varies.)"""
    x = np.arange(64, dtype=np.float32)
    racy, fixed = np.zeros_like(x), np.zeros_like(x)
    k(sim_rt, "reverse_racy")((1,), (64,), (x, racy), shared_mem=64 * 4)
    k(sim_rt, "reverse_dynamic")((1,), (64,), (x, fixed), shared_mem=64 * 4)
    np.testing.assert_array_equal(fixed, x[::-1])
    assert np.isnan(racy[:32]).all()
    np.testing.assert_array_equal(racy[32:], x[::-1][32:])


def test_three_d_grid_and_block_indexing(rt):
    grid, block = (3, 2, 2), (4, 3, 2)
    n = int(np.prod(grid) * np.prod(block))
    out = dev(rt, np.full(n, -1, np.int32))
    k(rt, "grid_ids")(grid, block, (out,))
    want = [b * 1000 + t for b in range(int(np.prod(grid))) for t in range(int(np.prod(block)))]
    assert rt.asnumpy(out).tolist() == want


def test_half_conversions_match_numpy(rt):
    # every binary16 bit pattern, widened to float32
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    h = bits.view(np.float16)
    widened = dev(rt, np.zeros(65536, np.float32))
    k(rt, "half_widen")((256,), (256,), (dev(rt, h), widened, np.int32(65536)))
    want = h.astype(np.float32)
    got = rt.asnumpy(widened)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    # float32 -> half rounding: ties to even, subnormals, overflow, +-0, inf, nan
    rng = np.random.default_rng(2)
    specials = [0.0, -0.0, 65504.0, 65519.99, 65520.0, 1e6, -1e6, 6e-8, 2.9e-8, 3e-8, 1e-9, np.inf, -np.inf,
                np.nan, 1.0 + 2**-11, 1.0 + 3 * 2**-11, 2**-14, 2**-14 - 2**-25, 0.1]
    # the exact halfway points between neighbouring halves: each must round to the even one
    mids = (h[:31743:97].astype(np.float64) + h[1:31744:97].astype(np.float64)) / 2
    x = np.concatenate([specials, mids, rng.standard_normal(2000) * 10 ** rng.uniform(-8, 5, 2000)]).astype(np.float32)
    hd, back = dev(rt, np.zeros(x.size, np.float16)), dev(rt, np.zeros(x.size, np.float32))
    k(rt, "half_roundtrip")(((x.size + 127) // 128,), (128,), (dev(rt, x), hd, back, np.int32(x.size)))
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    got = rt.asnumpy(hd)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint16), want[~nan].view(np.uint16))
    np.testing.assert_array_equal(rt.asnumpy(back)[~nan], want[~nan].astype(np.float32))


def test_vector_types(rt):
    x = np.arange(40, dtype=np.float32)
    h = np.linspace(-3, 3, 20).astype(np.float16)
    out, hsum = dev(rt, np.zeros(40, np.float32)), dev(rt, np.zeros(10, np.float32))
    k(rt, "vectors")((1,), (16,), (dev(rt, x), out, dev(rt, h), hsum, np.int32(10)))
    np.testing.assert_array_equal(rt.asnumpy(out), 2 * x)
    np.testing.assert_array_equal(rt.asnumpy(hsum), h.astype(np.float32).reshape(10, 2).sum(1))


def test_cuda_min_max_overloads(rt):
    a = np.array([-1, 0, 5, -7, 3], np.int32)
    b = np.array([1, 0, 3, 7, 4], np.uint32)
    outs = [dev(rt, np.zeros(5, t)) for t in (np.uint32, np.uint32, np.int32, np.float32)]
    k(rt, "minmax")((1,), (5,), (dev(rt, a), dev(rt, b), *outs))
    ua = a.astype(np.uint32)  # -1 becomes 0xffffffff, as in C++
    assert rt.asnumpy(outs[0]).tolist() == np.maximum(ua, b).tolist()
    assert rt.asnumpy(outs[1]).tolist() == np.minimum(ua, b).tolist()
    assert rt.asnumpy(outs[2]).tolist() == np.abs(a).tolist()
    assert rt.asnumpy(outs[3]).tolist() == np.maximum(a.astype(np.float32), 0.5).tolist()


def test_math_intrinsics(rt):
    x = np.linspace(-4, 4, 32).astype(np.float32)
    out = dev(rt, np.zeros(32 * 8, np.float32))
    k(rt, "math")((1,), (32,), (dev(rt, x), out))
    got = rt.asnumpy(out).reshape(32, 8)
    ax = np.abs(x) + np.float32(1)
    want = np.stack([np.exp(x), np.log(ax), 1 / np.sqrt(ax), x / np.float32(3), 1 / (x + np.float32(10)), x,
                     x, np.clip(x, 0, 1)], axis=1)
    # the GPU's fast intrinsics (__expf, __fdividef...) are a few ulp off; the sim is exact
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)


def test_shuffle_of_double_and_half(rt):
    d = np.arange(32, dtype=np.float64) + 0.25
    h = np.arange(32).astype(np.float16)
    d_out, h_out = dev(rt, np.zeros(32, np.float64)), dev(rt, np.zeros(32, np.float16))
    k(rt, "shfl_types")((1,), (32,), (dev(rt, d), dev(rt, h), d_out, h_out))
    np.testing.assert_array_equal(rt.asnumpy(d_out), d[::-1])
    np.testing.assert_array_equal(rt.asnumpy(h_out), h[np.arange(32) ^ 1])


def test_spin_lock_with_atomic_cas_makes_progress(sim_rt):
    lock, total = np.zeros(1, np.int32), np.zeros(1, np.float32)
    sim_k(sim_rt, "spin_lock_sum")((2,), (64,), (lock, total))
    assert total[0] == 128 and lock[0] == 0


def test_shared_memory_starts_as_nan_bytes(sim_rt):
    if cpu_sim.BuildOptions.from_env().asan:
        pytest.skip("ASan builds guard static __shared__ arrays with redzones instead (see cpu_sim/README.md)")
    out = np.zeros(32, np.float32)
    sim_k(sim_rt, "uninitialized_shared")((1,), (32,), (out,))
    assert np.isnan(out).all()


def test_math_constants(sim_rt):
    out = np.zeros(3, np.float32)
    sim_k(sim_rt, "constants")((1,), (1,), (out,))
    assert out[0] == np.inf and out[1] == -np.inf and out[2] == np.float32(np.pi)


def test_printf_comes_out_in_thread_order(sim_rt, default_schedule, capfd):
    sim_k(sim_rt, "say")((2,), (4,), (np.int32(2),))
    lines = capfd.readouterr().out.splitlines()
    assert lines == ["thread 0 of block 0", "thread 1 of block 0", "thread 0 of block 1", "thread 1 of block 1"]


def test_project_kernels_compile_on_the_simulator(sim_rt):
    """Every .cu file in minikv_gpu/kernels loads, and the text parser (which CuPy's argument
    checks rely on) reads the same parameter types as the C++ compiler."""
    files = sorted((ROOT / "minikv_gpu" / "kernels").glob("*.cu"))
    assert files
    for path in files:
        module = cpu_sim.load_module(path.read_text(), f"minikv_gpu/kernels/{path.name}", None, path.parent)
        scanned = cpu_sim.build.scan_source(path.read_text(), path.name, None, [path.parent])
        parsed = {decl.name: decl.params for decl in find_kernels(scanned, marker=KERNEL_MARK)}
        assert set(parsed) == set(module.kernel_names)
        for name in module.kernel_names:
            real = module.get_function(name).params
            text = parsed[name]
            assert [(p.name, p.pointer, p.const, p.dtype, p.lanes) for p in text] == \
                   [(p.name, p.pointer, p.const, p.dtype, p.lanes) for p in real], (path.name, name)
