"""Kernel sources and launch helpers shared by the simulator's tests (test_cpu_sim*.py, test_sim_runtime.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

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


def check_warp_sums(rt) -> None:
    """warp_sums (a butterfly reduction by __shfl_xor_sync) over 3 warps gives each warp's sum in every lane."""
    x = np.arange(96, dtype=np.float32)
    out = dev(rt, np.zeros(96, np.float32))
    k(rt, "warp_sums")((3,), (32,), (dev(rt, x), out))
    np.testing.assert_array_equal(rt.asnumpy(out), np.repeat(x.reshape(3, 32).sum(axis=1), 32))


# --- AddressSanitizer runs (cpu_sim/README.md, "ASan mode") ---------------------------------------------

def asan_env() -> dict:
    """The environment of a child process whose simulator builds with -fsanitize=address (skips without
    libasan): the runtime preloaded, leaks not checked, the simulator backend forced."""
    lib = subprocess.run([os.environ.get("CXX") or "g++", "-print-file-name=libasan.so"], capture_output=True,
                         text=True).stdout.strip()
    if not os.path.isabs(lib) or not os.path.exists(lib):
        pytest.skip("g++ has no libasan.so (install libasan for the ASan tests)")
    return dict(os.environ, MINIKV_SIM_ASAN="1", LD_PRELOAD=lib, ASAN_OPTIONS="detect_leaks=0",
                MINIKV_GPU_BACKEND="sim", PYTHONPATH=str(ROOT))


def run_under_asan(test_file: str, select: str, at_least: int) -> None:
    """Run the tests ``select`` of ``test_file`` in a child process under ASan; assert no report and at
    least ``at_least`` of them passed."""
    if os.environ.get("MINIKV_SIM_ASAN") == "1":
        pytest.skip("already running under ASan")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-k", select],
                          env=asan_env(), capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "AddressSanitizer" not in proc.stderr
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= at_least and "failed" not in proc.stdout, proc.stdout[-2000:]
