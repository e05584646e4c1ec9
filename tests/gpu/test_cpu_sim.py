"""The kernel runtime and the CPU simulator (minikv_gpu/runtime.py, minikv_gpu/cpu_sim/).

Kernels that are plain CUDA run on every backend (``rt``: the simulator, plus CuPy on a GPU);
the tests of the simulator's own error reports (deadlocks, faults, ASan) run on ``sim_rt``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from minikv.errors import (
    BackendUnavailableError,
    InvalidInputError,
    KernelCompileError,
    KernelDeadlockError,
    KernelFaultError,
    KernelLaunchError,
)
from minikv_gpu import cpu_sim, runtime
from minikv_gpu.cpu_sim.signature import KERNEL_MARK, find_kernels

ROOT = Path(__file__).resolve().parents[2]

# Kernels that any CUDA compiler accepts (NVRTC too: no #include).
SOURCE = r"""
#include <cuda_fp16.h>

extern "C" __global__ void __launch_bounds__(256) block_sum(const float* x, float* out, int n) {
    __shared__ float s[256];
    const int t = threadIdx.x;
    float v = 0.0f;
    for (int i = blockIdx.x * blockDim.x + t; i < n; i += gridDim.x * blockDim.x) v += x[i];
    s[t] = v;
    __syncthreads();
    for (int k = blockDim.x / 2; k > 0; k >>= 1) {
        if (t < k) s[t] += s[t + k];
        __syncthreads();
    }
    if (t == 0) out[blockIdx.x] = s[0];
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

extern "C" __global__ void warp_sums(const float* __restrict__ x, float* __restrict__ out) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    out[i] = warp_sum(__ldg(&x[i]));
}

// mode 0..3: __shfl_sync, __shfl_up_sync, __shfl_down_sync, __shfl_xor_sync
extern "C" __global__ void shuffle(const int* x, int* out, int mode, int arg, int width) {
    const int v = x[threadIdx.x];
    int r;
    if (mode == 0) r = __shfl_sync(0xffffffffu, v, arg, width);
    else if (mode == 1) r = __shfl_up_sync(0xffffffffu, v, arg, width);
    else if (mode == 2) r = __shfl_down_sync(0xffffffffu, v, arg, width);
    else r = __shfl_xor_sync(0xffffffffu, v, arg, width);
    out[threadIdx.x] = r;
}

// Lanes 0-15 and 16-31 reduce separately, each half with its own mask: legal, divergent code.
extern "C" __global__ void half_warp_sums(const float* x, float* out) {
    float v = x[threadIdx.x];
    if ((threadIdx.x & 31) < 16) {
        for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(0x0000ffffu, v, o);
    } else {
        for (int o = 8; o > 0; o >>= 1) v += __shfl_down_sync(0xffff0000u, v, o, 16);
    }
    out[threadIdx.x] = v;
}

extern "C" __global__ void votes(const int* pred, unsigned* ballot, int* any, int* all, int* count) {
    const int p = pred[blockIdx.x * blockDim.x + threadIdx.x];
    const unsigned b = __ballot_sync(0xffffffffu, p);
    const int a = __any_sync(0xffffffffu, p), l = __all_sync(0xffffffffu, p);
    const int c = __syncthreads_count(p), c_and = __syncthreads_and(p), c_or = __syncthreads_or(p);
    if ((threadIdx.x & 31) == 0) {
        const int w = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
        ballot[w] = b; any[w] = a; all[w] = l;
    }
    if (threadIdx.x == 0) {
        count[3 * blockIdx.x] = c; count[3 * blockIdx.x + 1] = c_and; count[3 * blockIdx.x + 2] = c_or;
    }
}

extern "C" __global__ void warp_misc(const int* x, unsigned* match, unsigned* sum, int* lowest, unsigned* active,
                                     float* swapped) {
    __shared__ float s[32];
    const int l = threadIdx.x;
    active[l] = __activemask();  // all 32 lanes run (the sim: none has exited yet)
    s[l] = (float)x[l];
    __syncwarp();  // the warp's writes to s are visible to the whole warp after this
    swapped[l] = s[31 - l];
    match[l] = __match_any_sync(0xffffffffu, x[l]);
    sum[l] = __reduce_add_sync(0xffffffffu, (unsigned)x[l]);
    lowest[l] = __reduce_min_sync(0xffffffffu, x[l] - 5);
}

extern "C" __global__ void atomics(const int* x, int n, int* hist, float* fsum, int* imax, int* imin,
                                   unsigned* umax, int* exch, int* cas_count) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    atomicAdd(&hist[x[i] & 7], 1);
    atomicAdd(fsum, 0.5f);
    atomicMax(imax, x[i] - 50);
    atomicMin(imin, x[i] - 50);
    atomicMax(umax, (unsigned)x[i]);
    atomicExch(exch, 7);
    int old = *cas_count, assumed;  // an increment built from compare-and-swap
    do {
        assumed = old;
        old = atomicCAS(cas_count, assumed, assumed + 1);
    } while (old != assumed);
}

// Dynamic shared memory: the launch sets its size (blockDim.x floats here).
extern "C" __global__ void reverse_dynamic(const float* x, float* out) {
    extern __shared__ float buf[];
    const int t = threadIdx.x, base = blockIdx.x * blockDim.x;
    buf[t] = x[base + t];
    __syncthreads();
    out[base + t] = buf[blockDim.x - 1 - t];
}

// The same without the barrier: thread t reads buf[n-1-t] before thread n-1-t wrote it.
extern "C" __global__ void reverse_racy(const float* x, float* out) {
    extern __shared__ float buf[];
    const int t = threadIdx.x, base = blockIdx.x * blockDim.x;
    buf[t] = x[base + t];
    out[base + t] = buf[blockDim.x - 1 - t];
}

extern "C" __global__ void grid_ids(int* out) {
    const int bx = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    const int tx = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    const int threads = blockDim.x * blockDim.y * blockDim.z;
    out[bx * threads + tx] = bx * 1000 + tx;
}

extern "C" __global__ void half_roundtrip(const float* x, __half* h, float* back, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    h[i] = __float2half_rn(x[i]);
    back[i] = __half2float(h[i]);
}

extern "C" __global__ void half_widen(const __half* h, float* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = __half2float(h[i]);
}

// float4 and __half2 vectors: out[i] = x[i] * 2 as float4, and the pairwise sums of a __half2.
extern "C" __global__ void vectors(const float4* x, float4* out, const __half2* h, float* hsum, int n4) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n4) return;
    const float4 v = x[i];
    out[i] = make_float4(2.0f * v.x, 2.0f * v.y, 2.0f * v.z, 2.0f * v.w);
    const __half2 p = h[i];
    hsum[i] = __low2float(p) + __high2float(p);
}

// CUDA's min/max: a signed/unsigned mix compares as unsigned, like C++ promotion.
extern "C" __global__ void minmax(const int* a, const unsigned* b, unsigned* umax, unsigned* umin, int* imax,
                                  float* fmax) {
    const int i = threadIdx.x;
    umax[i] = max(a[i], b[i]);
    umin[i] = min(a[i], b[i]);
    imax[i] = max(a[i], -a[i]);
    fmax[i] = max((float)a[i], 0.5f);
}

extern "C" __global__ void math(const float* x, float* out) {
    const int i = threadIdx.x;
    const float v = x[i];
    out[8 * i + 0] = __expf(v);
    out[8 * i + 1] = __logf(fabsf(v) + 1.0f);
    out[8 * i + 2] = rsqrtf(fabsf(v) + 1.0f);
    out[8 * i + 3] = __fdividef(v, 3.0f);
    out[8 * i + 4] = __frcp_rn(v + 10.0f);
    out[8 * i + 5] = fmaxf(v, 0.0f) + fminf(v, 0.0f);
    out[8 * i + 6] = __int_as_float(__float_as_int(v));
    out[8 * i + 7] = __saturatef(v);
}

extern "C" __global__ void shfl_types(const double* d, const __half* h, double* d_out, __half* h_out) {
    const int l = threadIdx.x;
    d_out[l] = __shfl_sync(0xffffffffu, d[l], 31 - l);
    h_out[l] = __shfl_xor_sync(0xffffffffu, h[l], 1);
}
"""

# Kernels that only make sense on the simulator (they fail on purpose, or use host headers).
SIM_SOURCE = r"""
#include <cassert>
#include <math_constants.h>

extern "C" __global__ void barrier_after_exit(float* out) {
    if (threadIdx.x >= 16) return;  // the classic bug: an early return before a barrier
    __syncthreads();
    out[threadIdx.x] = 1.0f;
}

extern "C" __global__ void barrier_in_branch(float* out) {
    if (threadIdx.x < 16) {
        __syncthreads();
    } else {
        __syncthreads();
    }
    out[threadIdx.x] = 1.0f;
}

extern "C" __global__ void shuffle_exited_lane(float* out) {
    float v = threadIdx.x;
    if (threadIdx.x >= 16) return;
    v = __shfl_sync(0xffffffffu, v, threadIdx.x + 16);
    out[threadIdx.x] = v;
}

extern "C" __global__ void shuffle_then_barrier(float* out) {
    float v = threadIdx.x;
    if (threadIdx.x == 0) __syncthreads();  // lane 0 waits here while lanes 1-31 wait in the shuffle
    else v = __shfl_xor_sync(0xffffffffu, v, 1);
    out[threadIdx.x] = v;
}

extern "C" __global__ void shuffle_foreign_mask(float* out) {
    out[threadIdx.x] = __shfl_sync(0x0000ffffu, 1.0f, 0);  // lanes 16-31 call with a mask without them
}

extern "C" __global__ void mixed_collectives(unsigned* out) {
    if (threadIdx.x < 16) out[threadIdx.x] = __ballot_sync(0xffffffffu, 1);
    else out[threadIdx.x] = __shfl_sync(0xffffffffu, 1u, 0);
}

__device__ int deep(int n) {
    volatile char frame[512];
    frame[n & 511] = (char)n;
    return deep(n + 1) + frame[(n * 7) & 511];  // not a tail call: every level keeps its frame
}

extern "C" __global__ void recurse(int* out) { out[threadIdx.x] = deep(0); }

extern "C" __global__ void wild_write(float* out) { out[threadIdx.x + (1ll << 42)] = 1.0f; }

extern "C" __global__ void checks(const int* x, int* out) {
    assert(x[threadIdx.x] >= 0);
    out[threadIdx.x] = x[threadIdx.x] / x[0];
}

extern "C" __global__ void spin_forever(volatile int* flag) {
    if (threadIdx.x == 0) while (*flag == 0) {}  // waits for thread 1, which the sim never runs
    else *flag = 1;
}

// A spin lock around a float add: atomicCAS yields when it fails, so the holder gets to run.
extern "C" __global__ void spin_lock_sum(int* lock, float* total) {
    __shared__ float contrib[64];
    contrib[threadIdx.x] = 1.0f;
    __syncthreads();
    while (atomicCAS(lock, 0, 1) != 0) {}
    *total += contrib[threadIdx.x];
    __threadfence();
    atomicExch(lock, 0);
}

extern "C" __global__ void uninitialized_shared(float* out) {
    __shared__ float s[32];
    out[threadIdx.x] = s[threadIdx.x];  // nobody wrote s: the sim fills it with 0xff bytes (NaN)
}

extern "C" __global__ void constants(float* out) {
    out[0] = INFINITY;
    out[1] = -CUDART_INF_F;
    out[2] = CUDART_PI_F;
}

extern "C" __global__ void say(int n) {
    if ((int)threadIdx.x < n) printf("thread %d of block %d\n", threadIdx.x, blockIdx.x);
}
"""


def k(rt, name):
    return rt.kernel_from_source(SOURCE, name)


def sim_k(sim_rt, name):
    return sim_rt.kernel_from_source(SIM_SOURCE, name)


def dev(rt, a):
    return rt.asarray(np.asarray(a))


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
    x = np.arange(96, dtype=np.float32)
    out = dev(rt, np.zeros(96, np.float32))
    k(rt, "warp_sums")((3,), (32,), (dev(rt, x), out))
    want = np.repeat(x.reshape(3, 32).sum(axis=1), 32)
    np.testing.assert_array_equal(rt.asnumpy(out), want)


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


def test_missing_syncthreads_reads_what_was_not_written_yet(sim_rt):
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


def test_printf_comes_out_in_thread_order(sim_rt, capfd):
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


# ---- what the simulator reports ------------------------------------------------------------------

def test_barrier_after_early_return_is_a_deadlock(sim_rt):
    with pytest.raises(KernelDeadlockError, match=r"never reached by threads 16-31.*threads 0-15 wait"):
        sim_k(sim_rt, "barrier_after_exit")((1,), (32,), (np.zeros(32, np.float32),))


def test_barriers_in_divergent_branches_are_a_deadlock(sim_rt):
    with pytest.raises(KernelDeadlockError, match=r"different barriers: threads 0-15 at __syncthreads\(\) .*"
                                                  r"threads 16-31 at __syncthreads\(\)"):
        sim_k(sim_rt, "barrier_in_branch")((1,), (32,), (np.zeros(32, np.float32),))


def test_shuffle_waiting_on_a_barrier_is_a_deadlock(sim_rt):
    with pytest.raises(KernelDeadlockError, match=r"lane 0 waits at __syncthreads\(\)"):
        sim_k(sim_rt, "shuffle_then_barrier")((1,), (32,), (np.zeros(32, np.float32),))


def test_shuffle_from_an_exited_lane_is_a_fault(sim_rt):
    with pytest.raises(KernelFaultError, match=r"exited: lanes 16-31") as info:
        sim_k(sim_rt, "shuffle_exited_lane")((1,), (32,), (np.zeros(32, np.float32),))
    assert not isinstance(info.value, KernelDeadlockError)


def test_shuffle_with_a_mask_without_the_caller_is_a_fault(sim_rt):
    with pytest.raises(KernelFaultError, match=r"thread \(16,0,0\).*does not include the calling lane 16"):
        sim_k(sim_rt, "shuffle_foreign_mask")((1,), (32,), (np.zeros(32, np.float32),))


def test_lanes_in_different_collectives_with_one_mask_is_a_fault(sim_rt):
    with pytest.raises(KernelFaultError, match=r"meet in different collectives.*__shfl_sync.*__ballot_sync"):
        sim_k(sim_rt, "mixed_collectives")((1,), (32,), (np.zeros(32, np.uint32),))


def test_stack_overflow_is_reported_and_the_interpreter_survives(sim_rt):
    with pytest.raises(KernelFaultError, match="stack overflow"):
        sim_k(sim_rt, "recurse")((1,), (4,), (np.zeros(4, np.int32),))
    test_warp_reduction_with_shfl_xor(sim_rt)  # and the simulator still works


def test_wild_pointer_is_reported(sim_rt):
    with pytest.raises(KernelFaultError, match=r"invalid memory access"):
        sim_k(sim_rt, "wild_write")((1,), (1,), (np.zeros(1, np.float32),))


def test_assert_and_integer_division_by_zero_are_reported(sim_rt):
    out = np.zeros(4, np.int32)
    with pytest.raises(KernelFaultError, match=r"thread \(2,0,0\): assertion `x\[threadIdx.x\] >= 0` failed"):
        sim_k(sim_rt, "checks")((1,), (4,), (np.array([1, 2, -3, 4], np.int32), out))
    with pytest.raises(KernelFaultError, match="division by zero"):
        sim_k(sim_rt, "checks")((1,), (4,), (np.array([0, 2, 3, 4], np.int32), out))


def test_a_spin_wait_that_cannot_end_hits_the_watchdog(sim_rt, monkeypatch):
    monkeypatch.setenv("MINIKV_SIM_TIMEOUT", "0.3")  # seconds of CPU time
    with pytest.raises(KernelDeadlockError, match="CPU time limit"):
        sim_k(sim_rt, "spin_forever")((1,), (2,), (np.zeros(1, np.int32),))


def test_compile_error_carries_the_gcc_message(sim_rt):
    src = 'extern "C" __global__ void broken(float* x) {\n    x[0] = undeclared_name;\n}\n'
    with pytest.raises(KernelCompileError, match=r"<source>:2:12: error: .undeclared_name. was not declared"):
        sim_rt.kernel_from_source(src, "broken")


# ---- launch checks -------------------------------------------------------------------------------

def test_arguments_are_checked_against_the_real_parameter_types(rt):
    kern = k(rt, "block_sum")  # (const float* x, float* out, int n)
    x, out = dev(rt, np.zeros(8, np.float32)), dev(rt, np.zeros(1, np.float32))
    with pytest.raises(KernelLaunchError, match=r"argument 0 'x' \(const float\*\) needs a float32 array, got float64"):
        kern((1,), (32,), (dev(rt, np.zeros(8)), out, np.int32(8)))
    with pytest.raises(KernelLaunchError, match=r"argument 2 'n' \(int\) is a scalar: pass an exact NumPy scalar"):
        kern((1,), (32,), (x, out, 8))
    with pytest.raises(KernelLaunchError, match=r"'n' \(int\) needs np.int32, got np.int64"):
        kern((1,), (32,), (x, out, np.int64(8)))
    with pytest.raises(KernelLaunchError, match=r"block_sum takes 3 arguments \(x, out, n\), got 2"):
        kern((1,), (32,), (x, out))
    with pytest.raises(KernelLaunchError, match=r"'out' \(float\*\) is a pointer"):
        kern((1,), (32,), (x, np.float32(0), np.int32(8)))
    with pytest.raises(KernelLaunchError, match="not C-contiguous"):
        kern((1,), (32,), (dev(rt, np.zeros(16, np.float32))[::2], out, np.int32(8)))


def test_vector_pointer_checks(rt):
    kern = k(rt, "vectors")  # (const float4* x, float4* out, const __half2* h, float* hsum, int n4)
    h, hsum = dev(rt, np.zeros(20, np.float16)), dev(rt, np.zeros(10, np.float32))
    with pytest.raises(KernelLaunchError, match="not a multiple of 4"):
        kern((1,), (16,), (dev(rt, np.zeros(10, np.float32)), dev(rt, np.zeros(40, np.float32)), h, hsum, np.int32(2)))
    buf = dev(rt, np.zeros(44, np.float32))
    with pytest.raises(KernelLaunchError, match="16-byte aligned"):
        kern((1,), (16,), (buf[1:41], dev(rt, np.zeros(40, np.float32)), h, hsum, np.int32(10)))


def test_read_only_array_for_a_writable_pointer(sim_rt):
    out = np.zeros(1, np.float32)
    out.flags.writeable = False
    with pytest.raises(KernelLaunchError, match="read-only"):
        k(sim_rt, "block_sum")((1,), (32,), (np.zeros(8, np.float32), out, np.int32(8)))


@pytest.mark.parametrize("grid,block,shared,match", [
    ((1,), (1025,), 0, r"block.x = 1025 is outside 1..1024"),
    ((1,), (33, 32), 0, "1056 threads"),
    ((1,), (32, 32, 2), 0, "2048 threads"),
    ((0,), (32,), 0, r"grid.x = 0 is outside"),
    ((1, 70000), (32,), 0, r"grid.y = 70000"),
    ((1,), (1, 1, 65), 0, r"block.z = 65"),
    ((1, 1, 1, 1), (32,), 0, "tuple of 1 to 3 ints"),
    ((1,), (32,), 227 * 1024 + 1, "227 KiB"),
    ((1,), (32.0,), 0, "tuple of 1 to 3 ints"),
])
def test_launch_configuration_limits(rt, grid, block, shared, match):
    x, out = dev(rt, np.zeros(8, np.float32)), dev(rt, np.zeros(1, np.float32))
    with pytest.raises(KernelLaunchError, match=match):
        k(rt, "block_sum")(grid, block, (x, out, np.int32(8)), shared_mem=shared)


def test_ints_are_accepted_as_one_dimensional_grid_and_block(rt):
    x = np.arange(64, dtype=np.float32)
    out = dev(rt, np.zeros(64, np.float32))
    k(rt, "warp_sums")(2, 32, (dev(rt, x), out))
    assert rt.asnumpy(out)[0] == x[:32].sum()


# ---- runtime ---------------------------------------------------------------------------------------

def test_backend_selection(monkeypatch):
    monkeypatch.setenv("MINIKV_GPU_BACKEND", "sim")
    assert runtime.default_runtime().name == "sim" and runtime.default_runtime().xp is np
    assert runtime.get_runtime("sim") is runtime.get_runtime("sim")
    monkeypatch.setenv("MINIKV_GPU_BACKEND", "tpu")
    with pytest.raises(InvalidInputError, match="MINIKV_GPU_BACKEND='tpu'"):
        runtime.default_runtime()
    with pytest.raises(InvalidInputError, match="backend must be one of"):
        runtime.get_runtime("opencl")


def test_asking_for_cupy_without_a_gpu_raises(monkeypatch):
    cupy, reason = runtime._cupy_or_reason()
    if cupy is not None:
        pytest.skip("this machine has a usable GPU")
    with pytest.raises(BackendUnavailableError, match="backend 'cupy' cannot run here"):
        runtime.get_runtime("cupy")


def test_kernel_files_and_names_are_validated(sim_rt):
    with pytest.raises(InvalidInputError, match="available stems"):
        sim_rt.kernel("no_such_step", "k")
    with pytest.raises(InvalidInputError, match="plain name"):
        sim_rt.kernel("../secrets", "k")
    with pytest.raises(InvalidInputError, match=r"no kernel 'warp_sum' in .* it has \['block_sum'"):
        sim_rt.kernel_from_source(SOURCE, "warp_sum")  # a __device__ function, not a kernel
    with pytest.raises(InvalidInputError, match="not a C identifier"):
        sim_rt.kernel_from_source(SOURCE, "block_sum", defines={"A-B": 1})


def test_asarray_copies_like_a_transfer(sim_rt):
    host = np.arange(4, dtype=np.float32)
    d = sim_rt.asarray(host)
    d[0] = 9
    assert host[0] == 0 and sim_rt.asnumpy(d)[0] == 9 and sim_rt.asnumpy(d) is not d


def test_defines_reach_the_source(sim_rt):
    src = 'extern "C" __global__ void fill(int* out) { out[threadIdx.x] = VALUE * SCALE; }'
    out = np.zeros(2, np.int32)
    sim_rt.kernel_from_source(src, "fill", defines={"VALUE": 7, "SCALE": True})((1,), (2,), (out,))
    assert out.tolist() == [7, 7]


def test_compiled_modules_are_cached_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIKV_CACHE_DIR", str(tmp_path))
    src = 'extern "C" __global__ void one(int* out) { out[0] = 1; }'
    first = cpu_sim.build.build(src, "<cache test>")
    assert first.path.exists() and first.path.parent == tmp_path / "cpu_sim"

    def no_compiler(*args, **kwargs):
        raise AssertionError(f"recompiled: {args}")
    monkeypatch.setattr(cpu_sim.build.subprocess, "run", no_compiler)  # the compiler id stays cached
    second = cpu_sim.build.build(src, "<cache test>")
    assert second.path == first.path and second.kernels == first.kernels


def test_portable_ucontext_switch_gives_the_same_results(sim_rt, monkeypatch):
    monkeypatch.setenv("MINIKV_SIM_UCONTEXT", "1")
    module = cpu_sim.load_module(SOURCE, "ucontext.cu")
    x = np.arange(96, dtype=np.float32)
    out = np.zeros(96, np.float32)
    module.get_function("warp_sums")((3,), (32,), (x, out))
    np.testing.assert_array_equal(out, np.repeat(x.reshape(3, 32).sum(1), 32))
    with pytest.raises(KernelDeadlockError):
        cpu_sim.load_module(SIM_SOURCE, "ucontext.cu").get_function("barrier_after_exit")(
            (1,), (32,), (np.zeros(32, np.float32),))


# ---- AddressSanitizer ---------------------------------------------------------------------------

def _asan_env():
    lib = subprocess.run([os.environ.get("CXX") or "g++", "-print-file-name=libasan.so"], capture_output=True,
                         text=True).stdout.strip()
    if not os.path.isabs(lib) or not os.path.exists(lib):
        pytest.skip("g++ has no libasan.so (install libasan for the ASan tests)")
    env = dict(os.environ, MINIKV_SIM_ASAN="1", LD_PRELOAD=lib, ASAN_OPTIONS="detect_leaks=0",
               MINIKV_GPU_BACKEND="sim", PYTHONPATH=str(ROOT))
    return env


def test_asan_catches_an_out_of_bounds_write():
    script = textwrap.dedent("""
        import numpy as np
        from minikv_gpu import runtime
        src = 'extern "C" __global__ void oob(float* out) { out[threadIdx.x + 1] = 1.0f; }'
        out = np.zeros(32, np.float32)
        runtime.get_runtime("sim").kernel_from_source(src, "oob")((1,), (32,), (out,))
        print("not caught")
    """)
    proc = subprocess.run([sys.executable, "-c", script], env=_asan_env(), capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "AddressSanitizer: heap-buffer-overflow" in proc.stderr and "WRITE of size 4" in proc.stderr
    assert re.search(r"in oob .*<source>:1", proc.stderr)
    assert "not caught" not in proc.stdout


def test_asan_catches_dynamic_shared_memory_beyond_the_launch_size():
    script = textwrap.dedent("""
        import numpy as np
        from minikv_gpu import runtime
        src = 'extern "C" __global__ void k(float* out) { extern __shared__ float s[]; s[threadIdx.x] = 1.0f; }'
        runtime.get_runtime("sim").kernel_from_source(src, "k")((1,), (32,), (np.zeros(1, np.float32),),
                                                                shared_mem=31 * 4)
        print("not caught")
    """)
    proc = subprocess.run([sys.executable, "-c", script], env=_asan_env(), capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert proc.returncode != 0 and "AddressSanitizer: use-after-poison" in proc.stderr, proc.stderr[-3000:]


def test_asan_run_of_the_simulator_tests():
    """The kernel tests above, compiled with -fsanitize=address: no report, same results."""
    selected = ("(block_reduction or warp_reduction or divergent_half or votes or atomics or dynamic_shared or "
                "missing_syncthreads or three_d or half_conversions or vector_types or spin_lock or barrier_after or "
                "shuffle_from_an_exited or stack_overflow or wild_pointer or arguments_are_checked) "
                "and not asan")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", selected],
                          env=_asan_env(), capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "AddressSanitizer" not in proc.stderr
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= 16 and "failed" not in proc.stdout, proc.stdout[-2000:]


def test_signature_parser_reads_raw_source():
    """What CuPy's argument checks use where no g++ is around to preprocess the source."""
    src = textwrap.dedent("""
        typedef float real;
        // extern "C" __global__ void commented_out(int* x) {}
        extern "C" __global__ void __launch_bounds__(256, 2)
        k1(const real* __restrict__ a, float4* b, unsigned n, long long m, const __half2* h, int arr[],
           unsigned char* bytes, volatile int* flag, float** table) {}
        extern "C" __global__ void k2() {}
        extern "C" __global__ void k3(void);
        extern "C" __global__ void k3(void) {}
    """)
    decls = {d.name: d.params for d in find_kernels(src)}
    assert list(decls) == ["k1", "k2", "k3"] and decls["k2"] == () and decls["k3"] == ()
    got = [(p.name, p.pointer, p.const, p.dtype, p.lanes) for p in decls["k1"]]
    assert got == [("a", True, True, "float32", 1), ("b", True, False, "float32", 4), ("n", False, False, "uint32", 1),
                   ("m", False, False, "int64", 1), ("h", True, True, "float16", 2), ("arr", True, False, "int32", 1),
                   ("bytes", True, False, "uint8", 1), ("flag", True, False, "int32", 1),
                   ("table", True, False, None, 1)]
    assert decls["k1"][0].ctype == "const real*"
