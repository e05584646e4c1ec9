// kv_cache.cu: step 2, the contiguous KV cache (minikv/kv_cache.py) on the GPU.
//
// Storage (one array for K, one for V):
//     cache[layer, slot, kv_head, position, dim]   shape [L, max_seqs, Hkv, max_len, D]
// of CACHE_T: float (CACHE_HALF=0) or __half (CACHE_HALF=1). One sequence's history for
// one KV head is a contiguous [len, D] block, so attention streams it with 16-byte loads.
//
// Tokens of all sequences in a step are packed along N. For every packed token n the
// host passes slot[n] (the sequence's cache slot) and pos[n] (its absolute position):
// token n's K/V go to position pos[n], and its query sees positions 0 .. pos[n].
//
// Kernels (llm.c style numbering):
//   cache_write_v1               append the step's new K/V rows
//   decode_attention_v1          attention of the step's queries over the cache (unfused:
//                                RoPE and the cache write are separate launches before it)
//   decode_attention_v2          the fused kernel: RoPE on q and k + cache write + attention
//                                in one launch, for decode steps (one new token per sequence)
//   decode_attention_combine_v1  merges the partial results of a split key range
//
// Offsets into the cache are computed in 64-bit: L*max_seqs*Hkv*max_len*D passes 2^31
// easily (30 layers * 64 seqs * 3 heads * 8192 positions * 64 dims = 3.0e9).
//
// nvcc-check: HEAD_DIM=64,128 CACHE_HALF=0,1

#include <cuda_fp16.h>
#include <math_constants.h>  // CUDART_INF_F: NVRTC (CuPy) has no <math.h>, so no INFINITY

#ifndef HEAD_DIM
#define HEAD_DIM 64
#endif
#ifndef CACHE_HALF
#define CACHE_HALF 0
#endif
#define KEY_TILE 32                          // keys per tile: lane j scores key j
#define DIMS_PER_LANE ((HEAD_DIM + 31) / 32) // output dims owned by each lane
#define VEC 8                                // elements per vector load/store (16 bytes of half)

static_assert(HEAD_DIM % VEC == 0 && HEAD_DIM <= 128,
              "HEAD_DIM must be a multiple of 8, at most 128 (static shared memory stays under 48 KB)");

#if CACHE_HALF
typedef __half cache_t;
#else
typedef float cache_t;
#endif

// --- conversions between 8 floats and 8 cache elements, with vector memory accesses ---

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
    for (int i = 0; i < VEC; ++i) h[i] = __float2half_rn(f[i]);  // round to nearest, as NumPy's astype
    *reinterpret_cast<uint4*>(dst) = raw;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// Element offset of cache[layer, slot, head, pos, 0], in 64 bits.
__device__ __forceinline__ long long cache_offset(int layer, int slot, int head, int pos, int max_seqs,
                                                  int n_kv_heads, int max_len) {
    return ((((long long)layer * max_seqs + slot) * n_kv_heads + head) * max_len + pos) * HEAD_DIM;
}

// ---------------------------------------------------------------------------
// cache_write_v1: cache[layer, slot[n], h, pos[n], :] = new[n, h, :] for K and V.
//
//   k_new, v_new: [N, Hkv, D] float32 (keys already rotated)
//   grid  = (ceil(N*Hkv*D/8 / 256)), block = (256): one thread per 8 consecutive dims
//   bytes: reads 2 * 4*N*Hkv*D, writes 2 * sizeof(CACHE_T)*N*Hkv*D (16-byte accesses).
// ---------------------------------------------------------------------------
extern "C" __global__ void cache_write_v1(const float* __restrict__ k_new, const float* __restrict__ v_new,
                                          cache_t* k_cache, cache_t* v_cache, const int* __restrict__ slot,
                                          const int* __restrict__ pos, int layer, int n_tokens, int n_kv_heads,
                                          int max_seqs, int max_len) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;  // which vector of 8
    const long long per_token = (long long)n_kv_heads * (HEAD_DIM / VEC);
    if (i >= n_tokens * per_token) return;
    const int n = (int)(i / per_token);
    const int h = (int)((i % per_token) / (HEAD_DIM / VEC));
    const int d = (int)(i % (HEAD_DIM / VEC)) * VEC;
    const long long src = ((long long)n * n_kv_heads + h) * HEAD_DIM + d;
    const long long dst = cache_offset(layer, slot[n], h, pos[n], max_seqs, n_kv_heads, max_len) + d;
    float f[VEC];
    load8(k_new + src, f);
    store8(k_cache + dst, f);
    load8(v_new + src, f);
    store8(v_cache + dst, f);
}

// Attend the G queries in q_s (warp g owns query g) over cached keys [k_begin, k_end) of one
// (layer, slot, kv head), carrying the online-softmax state (m, l, acc) of each warp.
// All threads of the block call it (it has barriers). K/V tiles are loaded once per block and
// read by every warp: this is where grouped-query attention saves memory traffic.
__device__ __forceinline__ void attend_range(const cache_t* k_cache, const cache_t* v_cache, long long head_base,
                                             int k_begin, int k_end, const float* q_s,
                                             float (*k_s)[HEAD_DIM + 1], float (*v_s)[HEAD_DIM], float scale,
                                             float& m, float& l, float* acc) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int k0 = k_begin; k0 < k_end; k0 += KEY_TILE) {
        __syncthreads();  // everyone is done with the previous tile
        for (int i = threadIdx.x; i < KEY_TILE * (HEAD_DIM / VEC); i += blockDim.x) {
            const int j = i / (HEAD_DIM / VEC), d = (i % (HEAD_DIM / VEC)) * VEC;
            float kf[VEC], vf[VEC];
            if (k0 + j < k_end) {
                const long long off = head_base + (long long)(k0 + j) * HEAD_DIM + d;
                load8(k_cache + off, kf);
                load8(v_cache + off, vf);
            } else {
                // Positions past the end are never read: a stale or never-written slot may hold
                // NaN, and 0 * NaN = NaN would poison the sum even with probability 0.
#pragma unroll
                for (int e = 0; e < VEC; ++e) kf[e] = vf[e] = 0.0f;
            }
#pragma unroll
            for (int e = 0; e < VEC; ++e) k_s[j][d + e] = kf[e];
            store8(&v_s[j][d], vf);
        }
        __syncthreads();

        const int key = k0 + lane;
        float score = -CUDART_INF_F;
        if (key < k_end) {
            float dot = 0.0f;
#pragma unroll 8
            for (int d = 0; d < HEAD_DIM; ++d) dot += q_s[warp * HEAD_DIM + d] * k_s[lane][d];
            score = dot * scale;
        }
        // Every tile holds at least one key < k_end, so m_new is finite.
        const float m_new = fmaxf(m, warp_max(score));
        const float p = expf(score - m_new);  // 0 for keys past the end
        const float alpha = expf(m - m_new);  // rescales the old state; 0 on the first tile
        l = l * alpha + warp_sum(p);
        m = m_new;
#pragma unroll
        for (int c = 0; c < DIMS_PER_LANE; ++c) acc[c] *= alpha;
        for (int j = 0; j < KEY_TILE; ++j) {
            const float pj = __shfl_sync(0xffffffffu, p, j);
#pragma unroll
            for (int c = 0; c < DIMS_PER_LANE; ++c) {
                const int d = lane + 32 * c;
                if (d < HEAD_DIM) acc[c] += pj * v_s[j][d];
            }
        }
    }
}

// Write one warp's result: the normalized output when the key range was not split, else the
// unnormalized accumulator and (m, l) for decode_attention_combine_v1.
__device__ __forceinline__ void write_result(float* out, float* part_acc, float* part_ml, int n, int q_head,
                                             int n_heads, int split, int n_splits, float m, float l,
                                             const float* acc) {
    const int lane = threadIdx.x & 31;
    if (n_splits == 1) {
        const long long o = ((long long)n * n_heads + q_head) * HEAD_DIM;
        const float inv_l = 1.0f / l;  // l >= 1: the running max itself contributes exp(0)
#pragma unroll
        for (int c = 0; c < DIMS_PER_LANE; ++c) {
            const int d = lane + 32 * c;
            if (d < HEAD_DIM) out[o + d] = acc[c] * inv_l;
        }
        return;
    }
    const long long p = ((long long)n * n_heads + q_head) * n_splits + split;
#pragma unroll
    for (int c = 0; c < DIMS_PER_LANE; ++c) {
        const int d = lane + 32 * c;
        if (d < HEAD_DIM) part_acc[p * HEAD_DIM + d] = acc[c];
    }
    if (lane == 0) {
        part_ml[2 * p] = m;
        part_ml[2 * p + 1] = l;
    }
}

// ---------------------------------------------------------------------------
// decode_attention_v1: out[n, h*G + g, :] = attention of query (n, h*G+g) over cache
// positions 0 .. pos[n] of slot[n], KV head h.
//
//   q:    [N, Hq, D] float32, already rotated;   G = Hq / Hkv query heads per KV head
//   grid  = (N, Hkv, n_splits)   block (n, h, z) serves the whole GQA group of KV head h,
//                                keys [z*keys_per_split, (z+1)*keys_per_split) ∩ [0, pos[n]]
//   block = (32 * G)             warp g owns query head h*G + g
//   shared: static K tile 32*(D+1) + V tile 32*D floats (D=64: 16.3 KB, D=128: 32.5 KB),
//           dynamic G*D floats for the queries (launch with shared_mem = 4*G*D)
//   bytes: reads 4*N*Hq*D (q) + 2 * sizeof(CACHE_T) * Hkv*D * sum_n (pos[n]+1) (K and V, each
//          element once per GQA group, not once per query head), writes 4*N*Hq*D; with
//          n_splits > 1 it writes 4*N*Hq*n_splits*(D+2) partials instead (read back by combine).
//
// Splitting the key range (vLLM's v2, flash-decoding) gives a long sequence more than one
// block, so a decode step with few sequences still fills the GPU.
// ---------------------------------------------------------------------------
extern "C" __global__ void decode_attention_v1(const float* __restrict__ q, const cache_t* __restrict__ k_cache,
                                               const cache_t* __restrict__ v_cache, const int* __restrict__ slot,
                                               const int* __restrict__ pos, float* out, float* part_acc,
                                               float* part_ml, int layer, int n_heads, int n_kv_heads,
                                               int max_seqs, int max_len, int keys_per_split, int n_splits,
                                               float scale) {
    __shared__ float k_s[KEY_TILE][HEAD_DIM + 1];  // +1 float per row: lane j reads row j bank-free
    __shared__ __align__(16) float v_s[KEY_TILE][HEAD_DIM];  // float4 stores: 16-byte aligned rows
    extern __shared__ float q_s[];                  // [G][D]

    const int n = blockIdx.x, h = blockIdx.y, z = blockIdx.z;
    const int group = n_heads / n_kv_heads, warp = threadIdx.x >> 5;
    const int k_begin = z * keys_per_split;
    const int k_end = min(pos[n] + 1, k_begin + keys_per_split);
    if (k_begin >= k_end) return;  // this split lies past the sequence's end (whole block leaves)

    const long long q_base = ((long long)n * n_heads + (long long)h * group) * HEAD_DIM;
    for (int i = threadIdx.x; i < group * HEAD_DIM; i += blockDim.x) q_s[i] = q[q_base + i];

    float m = -CUDART_INF_F, l = 0.0f, acc[DIMS_PER_LANE];
#pragma unroll
    for (int c = 0; c < DIMS_PER_LANE; ++c) acc[c] = 0.0f;
    const long long head_base = cache_offset(layer, slot[n], h, 0, max_seqs, n_kv_heads, max_len);
    attend_range(k_cache, v_cache, head_base, k_begin, k_end, q_s, k_s, v_s, scale, m, l, acc);
    write_result(out, part_acc, part_ml, n, h * group + warp, n_heads, z, n_splits, m, l, acc);
}

// ---------------------------------------------------------------------------
// decode_attention_v2, the fused kernel: for decode steps (one new token per sequence) it
// does in one launch what v1 needs three for (rope_v1 on q and k, cache_write_v1,
// decode_attention_v1):
//   1. rotate the G raw queries of the group into shared memory;
//   2. the block whose split holds position pos[n] rotates the raw key, and writes key and
//      value into the cache (rounded to CACHE_T, exactly as cache_write_v1 stores them);
//   3. attend over the cache, the new row included, read back like any other row.
//
//   q_raw: [N, Hq, D], k_raw/v_new: [N, Hkv, D] float32 (pre-RoPE q and k)
//   cos, sin: [N, D/2] float32 at each token's position; half_layout as in rope_v1
//   grid, block, shared: as decode_attention_v1 (shared_mem = 4*G*D)
//   bytes: v1's, plus reads 4*N*D (cos, sin per block) and 2 * 4*N*Hkv*D (new K/V, only by
//          the writing block), writes 2 * sizeof(CACHE_T)*N*Hkv*D; saves v1's round trips of
//          the rotated q and k through device memory and two launches.
//
// Why one token per sequence: block (n, h, z) reads keys of its own sequence only up to
// pos[n]. Two new tokens of one sequence would need each other's keys, written by another
// block of the same launch, and blocks of one launch are not ordered.
// Why k_cache/v_cache are neither const nor __restrict__ here: the block reads back what it
// wrote, and a const __restrict__ pointer lets the compiler use the read-only data path,
// which is not coherent with writes made during the kernel. The __syncthreads() after the
// write makes the block's global writes visible to all its threads.
// ---------------------------------------------------------------------------
extern "C" __global__ void decode_attention_v2(const float* __restrict__ q_raw, const float* __restrict__ k_raw,
                                               const float* __restrict__ v_new, const float* __restrict__ cos_t,
                                               const float* __restrict__ sin_t, int half_layout,
                                               cache_t* k_cache, cache_t* v_cache, const int* __restrict__ slot,
                                               const int* __restrict__ pos, float* out, float* part_acc,
                                               float* part_ml, int layer, int n_heads, int n_kv_heads,
                                               int max_seqs, int max_len, int keys_per_split, int n_splits,
                                               float scale) {
    __shared__ float k_s[KEY_TILE][HEAD_DIM + 1];
    __shared__ __align__(16) float v_s[KEY_TILE][HEAD_DIM];  // float4 stores: 16-byte aligned rows
    extern __shared__ float q_s[];  // [G][D]

    const int n = blockIdx.x, h = blockIdx.y, z = blockIdx.z;
    const int group = n_heads / n_kv_heads, warp = threadIdx.x >> 5;
    const int p_n = pos[n];
    const int k_begin = z * keys_per_split;
    const int k_end = min(p_n + 1, k_begin + keys_per_split);
    if (k_begin >= k_end) return;
    const int half = HEAD_DIM / 2;
    const float* cs = cos_t + (long long)n * half;
    const float* sn = sin_t + (long long)n * half;

    // 1. rotated queries -> shared, one thread per (query, pair)
    const long long q_base = ((long long)n * n_heads + (long long)h * group) * HEAD_DIM;
    for (int i = threadIdx.x; i < group * half; i += blockDim.x) {
        const int g = i / half, j = i % half;
        const int ia = half_layout ? j : 2 * j, ib = half_layout ? j + half : 2 * j + 1;
        const float a = q_raw[q_base + g * HEAD_DIM + ia], b = q_raw[q_base + g * HEAD_DIM + ib];
        q_s[g * HEAD_DIM + ia] = a * cs[j] - b * sn[j];
        q_s[g * HEAD_DIM + ib] = b * cs[j] + a * sn[j];
    }

    // 2. the split that holds position p_n appends the new key (rotated) and value
    const long long head_base = cache_offset(layer, slot[n], h, 0, max_seqs, n_kv_heads, max_len);
    if (p_n < k_end) {  // i.e. p_n == k_end - 1: only the last non-empty split
        const long long src = ((long long)n * n_kv_heads + h) * HEAD_DIM;
        const long long dst = head_base + (long long)p_n * HEAD_DIM;
        for (int j = threadIdx.x; j < half; j += blockDim.x) {
            const int ia = half_layout ? j : 2 * j, ib = half_layout ? j + half : 2 * j + 1;
            const float a = k_raw[src + ia], b = k_raw[src + ib];
#if CACHE_HALF
            k_cache[dst + ia] = __float2half_rn(a * cs[j] - b * sn[j]);
            k_cache[dst + ib] = __float2half_rn(b * cs[j] + a * sn[j]);
            v_cache[dst + ia] = __float2half_rn(v_new[src + ia]);
            v_cache[dst + ib] = __float2half_rn(v_new[src + ib]);
#else
            k_cache[dst + ia] = a * cs[j] - b * sn[j];
            k_cache[dst + ib] = b * cs[j] + a * sn[j];
            v_cache[dst + ia] = v_new[src + ia];
            v_cache[dst + ib] = v_new[src + ib];
#endif
        }
    }
    // (attend_range starts with __syncthreads(): it orders both writes above before any read)

    // 3. attention over positions [k_begin, k_end), the new one included
    float m = -CUDART_INF_F, l = 0.0f, acc[DIMS_PER_LANE];
#pragma unroll
    for (int c = 0; c < DIMS_PER_LANE; ++c) acc[c] = 0.0f;
    attend_range(k_cache, v_cache, head_base, k_begin, k_end, q_s, k_s, v_s, scale, m, l, acc);
    write_result(out, part_acc, part_ml, n, h * group + warp, n_heads, z, n_splits, m, l, acc);
}

// ---------------------------------------------------------------------------
// decode_attention_combine_v1: merge the n_splits partial results of each (token, query
// head): with m = max_z m_z,
//     out = sum_z exp(m_z - m) acc_z / sum_z exp(m_z - m) l_z
// Only splits that held keys (z < ceil((pos[n]+1) / keys_per_split)) are read.
//
//   grid  = (N, Hq), block = (D): thread d owns output dim d
//   bytes: reads 4*N*Hq*Z*(D+2) (Z = splits used), writes 4*N*Hq*D.
// ---------------------------------------------------------------------------
extern "C" __global__ void decode_attention_combine_v1(const float* __restrict__ part_acc,
                                                       const float* __restrict__ part_ml,
                                                       const int* __restrict__ pos, float* __restrict__ out,
                                                       int n_heads, int keys_per_split, int n_splits) {
    const int n = blockIdx.x, head = blockIdx.y, d = threadIdx.x;
    if (d >= HEAD_DIM) return;
    const int used = min(n_splits, (pos[n] + keys_per_split) / keys_per_split);
    const long long p0 = ((long long)n * n_heads + head) * n_splits;
    float m = -CUDART_INF_F;
    for (int z = 0; z < used; ++z) m = fmaxf(m, part_ml[2 * (p0 + z)]);
    float num = 0.0f, den = 0.0f;
    for (int z = 0; z < used; ++z) {
        const float w = expf(part_ml[2 * (p0 + z)] - m);
        num += w * part_acc[(p0 + z) * HEAD_DIM + d];
        den += w * part_ml[2 * (p0 + z) + 1];
    }
    out[((long long)n * n_heads + head) * HEAD_DIM + d] = num / den;
}
