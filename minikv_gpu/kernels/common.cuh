// common.cuh: what every attention source needs, written once.
//
//   HEAD_DIM, KEY_TILE, DIMS_PER_LANE, VEC    compile-time sizes (HEAD_DIM set by the launcher)
//   cache_t                                   the cache element type: float (CACHE_HALF=0) or __half
//   load8 / store8, write_kv8, to_cache       8 elements <-> 8 floats with 16-byte vector accesses
//   Raw8, load_raw, zero_raw, unpack          the same load, kept raw until used (keys in flight)
//   warp_max / warp_sum                       butterfly reductions by shuffle, every lane gets the result
//   block_reduce                              max or sum over a whole block (two barriers)
//   row_offset                                64-bit element offsets (sizes pass 2^31 long before memory does)
//
// Plain CUDA C: no inline PTX, no <math.h> (NVRTC has no host headers; CUDART_INF_F comes from
// <math_constants.h>). The CPU simulator compiles this file with g++ unchanged.

#pragma once

#include <cuda_fp16.h>
#include <math_constants.h>  // CUDART_INF_F: NVRTC (CuPy) has no <math.h>, so no INFINITY

#ifndef HEAD_DIM
#define HEAD_DIM 64  // compile-time so that per-lane accumulators live in registers
#endif
#ifndef CACHE_HALF
#define CACHE_HALF 0
#endif
#define KEY_TILE 32                          // keys per tile: lane j of a warp scores key j
#define DIMS_PER_LANE ((HEAD_DIM + 31) / 32) // output dims owned by each lane: lane + 32*c
#define VEC 8                                // elements per vector load/store (16 bytes of half)

static_assert(HEAD_DIM % VEC == 0 && HEAD_DIM <= 128,
              "HEAD_DIM must be a multiple of 8, at most 128 (static shared memory stays under 48 KB)");

#if CACHE_HALF
typedef __half cache_t;
#else
typedef float cache_t;
#endif

// --- 8 floats <-> 8 elements, with 16-byte (or two 16-byte) memory accesses ---

__device__ __forceinline__ void load8(const float* src, float* f) {
    const float4 a = *reinterpret_cast<const float4*>(src);
    const float4 b = *reinterpret_cast<const float4*>(src + 4);
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
    f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}

__device__ __forceinline__ void load8(const __half* src, float* f) {
    const uint4 raw = *reinterpret_cast<const uint4*>(src);  // one 16-byte load
    const __half* h = reinterpret_cast<const __half*>(&raw);
#pragma unroll
    for (int i = 0; i < VEC; ++i) f[i] = __half2float(h[i]);
}

__device__ __forceinline__ void store8(float* dst, const float* f) {
    *reinterpret_cast<float4*>(dst) = make_float4(f[0], f[1], f[2], f[3]);
    *reinterpret_cast<float4*>(dst + 4) = make_float4(f[4], f[5], f[6], f[7]);
}

__device__ __forceinline__ void store8(__half* dst, const float* f) {
    uint4 raw;
    __half* h = reinterpret_cast<__half*>(&raw);
#pragma unroll
    for (int i = 0; i < VEC; ++i) h[i] = __float2half_rn(f[i]);  // round to nearest even, as NumPy's astype
    *reinterpret_cast<uint4*>(dst) = raw;
}

// K and V elements src .. src+7 of float rows -> dst .. dst+7 of the cache (the write kernels).
__device__ __forceinline__ void write_kv8(const float* k_new, const float* v_new, long long src, cache_t* k_cache,
                                          cache_t* v_cache, long long dst) {
    float f[VEC];
    load8(k_new + src, f);
    store8(k_cache + dst, f);
    load8(v_new + src, f);
    store8(v_cache + dst, f);
}

// One float as a cache element (rounded to nearest even for __half, as store8 does).
__device__ __forceinline__ cache_t to_cache(float x) {
#if CACHE_HALF
    return __float2half_rn(x);
#else
    return x;
#endif
}

// --- reductions ---

__device__ __forceinline__ float warp_max(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// Sum every score sc[u][g] over the LANES lanes of a subgroup (LANES a power of two <= 32; the warp's
// lanes l and l ^ off, off < LANES, share a subgroup). All 32 lanes must call it: no barrier, shuffles only.
template <int LANES, int U, int G>
__device__ __forceinline__ void subgroup_sum(float (&sc)[U][G]) {
#pragma unroll
    for (int off = LANES / 2; off > 0; off >>= 1) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
#pragma unroll
            for (int g = 0; g < G; ++g) sc[u][g] += __shfl_xor_sync(0xffffffffu, sc[u][g], off);
        }
    }
}

// Reduce over the whole block (max if is_max, else sum); every thread gets the result.
// scratch: 32 floats of shared memory. Two barriers; all threads of the block must call it.
__device__ float block_reduce(float v, float* scratch, bool is_max) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = (blockDim.x + 31) >> 5;
    v = is_max ? warp_max(v) : warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float r = is_max ? -CUDART_INF_F : 0.0f;
    for (int w = 0; w < n_warps; ++w) r = is_max ? fmaxf(r, scratch[w]) : r + scratch[w];
    __syncthreads();  // scratch may be reused by the next call
    return r;
}

// --- deferred 8-element loads (decode v3, MLA): issue the 16-byte load(s) now, convert later ---
// so that several keys' loads are in flight before the first multiply.
#if CACHE_HALF
struct Raw8 {
    uint4 a;
};
__device__ __forceinline__ Raw8 load_raw(const cache_t* p) {
    Raw8 r;
    r.a = *reinterpret_cast<const uint4*>(p);
    return r;
}
__device__ __forceinline__ Raw8 zero_raw() {
    Raw8 r;
    r.a = make_uint4(0u, 0u, 0u, 0u);  // eight +0.0 halves
    return r;
}
__device__ __forceinline__ void unpack(const Raw8& r, float* f) {
    const __half2* h = reinterpret_cast<const __half2*>(&r.a);
#pragma unroll
    for (int i = 0; i < VEC / 2; ++i) {
        const float2 t = __half22float2(h[i]);
        f[2 * i] = t.x;
        f[2 * i + 1] = t.y;
    }
}
#else
struct Raw8 {
    float4 a, b;
};
__device__ __forceinline__ Raw8 load_raw(const cache_t* p) {
    Raw8 r;
    r.a = *reinterpret_cast<const float4*>(p);
    r.b = *reinterpret_cast<const float4*>(p + 4);
    return r;
}
__device__ __forceinline__ Raw8 zero_raw() {
    Raw8 r;
    r.a = r.b = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    return r;
}
__device__ __forceinline__ void unpack(const Raw8& r, float* f) {
    f[0] = r.a.x; f[1] = r.a.y; f[2] = r.a.z; f[3] = r.a.w;
    f[4] = r.b.x; f[5] = r.b.y; f[6] = r.b.z; f[7] = r.b.w;
}
#endif

// --- 64-bit offsets ---

// Element offset of row `row` of a [..., rows, HEAD_DIM] array whose leading index is `outer`:
// (outer * rows + row) * HEAD_DIM, computed in 64 bits.
__device__ __forceinline__ long long row_offset(long long outer, int rows, long long row) {
    return (outer * rows + row) * HEAD_DIM;
}
