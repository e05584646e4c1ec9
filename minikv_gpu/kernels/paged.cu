// paged.cu: step 3, the paged KV cache (minikv/paged.py) on the GPU.
//
// Storage: one pool for K and one for V per layer, cut into fixed-size blocks of token slots:
//     k_pool[block, offset, kv_head, dim]   shape [num_blocks, block_size, Hkv, D]
// (the cache keeps all layers as [L, num_blocks, block_size, Hkv, D]; the attention and write
// kernels get one layer's pool, a contiguous view). Elements are CACHE_T: float (CACHE_HALF=0)
// or __half (CACHE_HALF=1); queries, new K/V and outputs are float32.
//
// A *slot* names one token row of a pool: slot = block_id * block_size + offset. Sequence b's
// position p lives in slot block_tables[b, p / block_size] * block_size + p % block_size, so a
// kernel reads a sequence's history through its block table, one table entry per block_size keys.
//
// Kernels (llm.c style numbering, vLLM's names):
//   reshape_and_cache           write the step's new K/V rows through the slot mapping
//   paged_decode_attention_v1   one thread block per (query token, KV head) walks the whole context
//   paged_decode_attention_v2   split-K: one thread block per (query token, KV head, partition)
//   paged_attention_reduce_v2   merges v2's partitions, rescaling each by exp(m_i - m)
//   copy_blocks                 copies whole blocks, all layers, K and V (copy-on-write, swap)
//
// Packed queries. The attention kernels take one query row per *token*, with the sequence it
// belongs to (token_seq[n]) and its position (token_pos[n]: it sees keys 0 .. token_pos[n]). In
// a decode step a token is a sequence, as in vLLM's decode kernels; a prefill step of T tokens
// runs T rows whose positions differ, which makes the same kernels causal prefill attention too.
//
// Offsets are 64-bit: slot * Hkv * D passes 2^31 long before memory runs out
// (2^18 blocks * 16 slots * 8 heads * 128 dims = 2^32 elements, past the int32 limit 2^31 - 1).
//
// Stale slots: the last block of a sequence is partly filled; its other slots hold whatever the
// block's previous owner left (possibly NaN). They are never read: a tile's rows past the
// context are zero-filled instead, since 0 * NaN = NaN would poison the sum.
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

// --- 8 floats <-> 8 cache elements, with 16-byte (or two 16-byte) memory accesses ---

__device__ __forceinline__ void load8(const float* src, float* f) {
    const float4 a = *reinterpret_cast<const float4*>(src);
    const float4 b = *reinterpret_cast<const float4*>(src + 4);
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
    f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}

__device__ __forceinline__ void load8(const __half* src, float* f) {
    const uint4 raw = *reinterpret_cast<const uint4*>(src);
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

__device__ __forceinline__ float warp_max(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// ---------------------------------------------------------------------------
// reshape_and_cache: pool[slot_mapping[n], h, :] = new[n, h, :] for K and V of one layer.
// (vLLM's name; its pools have a [.., D/x, block_size, x] key layout that needs the reshape.
// Here a slot's Hkv*D values are contiguous, so the "reshape" is the identity.)
//
//   k_new, v_new:  [N, Hkv, D] float32 (keys already rotated)
//   k_pool, v_pool: [num_blocks * block_size, Hkv, D] CACHE_T (one layer)
//   slot_mapping:  [N] int64; a negative slot is skipped (vLLM's padding tokens)
//   grid  = (ceil(N*Hkv*D/8 / 256)), block = (256): one thread per 8 consecutive dims
//   bytes: reads 8*N + 2 * 4*N*Hkv*D, writes 2 * sizeof(CACHE_T)*N*Hkv*D (skipped slots: none)
// ---------------------------------------------------------------------------
extern "C" __global__ void reshape_and_cache(const float* __restrict__ k_new, const float* __restrict__ v_new,
                                             cache_t* __restrict__ k_pool, cache_t* __restrict__ v_pool,
                                             const long long* __restrict__ slot_mapping, int n_tokens,
                                             int n_kv_heads) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;  // which vector of 8
    const long long per_token = (long long)n_kv_heads * (HEAD_DIM / VEC);
    if (i >= n_tokens * per_token) return;
    const long long n = i / per_token;
    const long long slot = slot_mapping[n];
    if (slot < 0) return;
    const long long within = (i % per_token) * VEC;  // h * D + d: a slot's Hkv*D values are contiguous
    const long long src = n * n_kv_heads * HEAD_DIM + within;
    const long long dst = slot * n_kv_heads * HEAD_DIM + within;
    float f[VEC];
    load8(k_new + src, f);
    store8(k_pool + dst, f);
    load8(v_new + src, f);
    store8(v_pool + dst, f);
}

// Attend the G queries in q_s (warp g owns query g) over keys [k_begin, k_end) of one sequence
// and KV head, read through the sequence's block table; carries each warp's online-softmax
// state (m, l, acc). All threads of the block call it (it has barriers). Each K/V tile is
// loaded once into shared memory and read by all G warps: a GQA group shares its K/V reads.
//
// Per tile, the first warp looks the tile's 32 keys up in the block table once
// (row_s[j] = element offset of key j's K row, or -1 past k_end); then all threads load the
// tile with 16-byte accesses. Keys of one block are consecutive slots, so a tile of 32 keys
// touches ceil(32 / block_size) + 1 blocks at most, each read as contiguous rows.
__device__ __forceinline__ void attend_keys(const cache_t* k_pool, const cache_t* v_pool, const int* table,
                                            int block_size, int n_kv_heads, int kv_head, int k_begin, int k_end,
                                            const float* q_s, float (*k_s)[HEAD_DIM + 1], float (*v_s)[HEAD_DIM],
                                            long long* row_s, float scale, float& m, float& l, float* acc) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int k0 = k_begin; k0 < k_end; k0 += KEY_TILE) {
        __syncthreads();  // everyone is done with the previous tile (and its row offsets)
        if (threadIdx.x < KEY_TILE) {
            const int key = k0 + threadIdx.x;
            long long row = -1;
            if (key < k_end) {
                const long long slot = (long long)table[key / block_size] * block_size + key % block_size;
                row = (slot * n_kv_heads + kv_head) * HEAD_DIM;
            }
            row_s[threadIdx.x] = row;
        }
        __syncthreads();
        for (int i = threadIdx.x; i < KEY_TILE * (HEAD_DIM / VEC); i += blockDim.x) {
            const int j = i / (HEAD_DIM / VEC), d = (i % (HEAD_DIM / VEC)) * VEC;
            float kf[VEC], vf[VEC];
            const long long row = row_s[j];
            if (row >= 0) {
                load8(k_pool + row + d, kf);
                load8(v_pool + row + d, vf);
            } else {  // past the context: a stale slot (maybe NaN) is never read
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

// The shared setup of v1 and v2: copy the group's G queries into shared memory.
__device__ __forceinline__ void load_queries(const float* q, float* q_s, int n, int n_heads, int kv_head,
                                             int group) {
    const long long base = ((long long)n * n_heads + (long long)kv_head * group) * HEAD_DIM;
    for (int i = threadIdx.x; i < group * HEAD_DIM; i += blockDim.x) q_s[i] = q[base + i];
}

// ---------------------------------------------------------------------------
// paged_decode_attention_v1: out[n, h*G + g, :] = attention of query (n, h*G+g) over keys
// 0 .. token_pos[n] of sequence token_seq[n], KV head h, read through its block table.
//
//   q:            [N, Hq, D] float32, already rotated;   G = Hq / Hkv query heads per KV head
//   k_pool/v_pool: [num_blocks, block_size, Hkv, D] CACHE_T (one layer)
//   block_tables: [B, max_blocks] int32; token_seq, token_pos: [N] int32
//   grid  = (N, Hkv)   block (n, h) serves the whole GQA group of KV head h (FlashInfer's
//                      habit: K/V of a group read once, not once per query head)
//   block = (32 * G)   warp g owns query head h*G + g
//   shared: static K tile 32*(D+1) + V tile 32*D floats + 32 int64 row offsets (D=64: 16,768 B,
//           D=128: 33,152 B); dynamic G*D floats for the queries (shared_mem = 4*G*D)
//   bytes: reads 4*N*Hq*D (q) + 2 * sizeof(CACHE_T) * Hkv*D * sum_n (token_pos[n]+1) (K and V)
//          + 4 * sum_n ceil((token_pos[n]+1)/block_size) (block table entries; the 32 lookups of a
//          tile hit the same few entries, so they come from L1), writes 4*N*Hq*D.
// ---------------------------------------------------------------------------
extern "C" __global__ void paged_decode_attention_v1(const float* __restrict__ q, const cache_t* __restrict__ k_pool,
                                                     const cache_t* __restrict__ v_pool,
                                                     const int* __restrict__ block_tables,
                                                     const int* __restrict__ token_seq,
                                                     const int* __restrict__ token_pos, float* __restrict__ out,
                                                     int n_heads, int n_kv_heads, int block_size, int max_blocks,
                                                     float scale) {
    __shared__ float k_s[KEY_TILE][HEAD_DIM + 1];            // +1 float per row: lane j reads row j bank-free
    __shared__ __align__(16) float v_s[KEY_TILE][HEAD_DIM];  // float4 stores: 16-byte aligned rows
    __shared__ long long row_s[KEY_TILE];                     // element offset of each key's row
    extern __shared__ float q_s[];                            // [G][D]

    const int n = blockIdx.x, h = blockIdx.y;
    const int group = n_heads / n_kv_heads, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    load_queries(q, q_s, n, n_heads, h, group);  // attend_keys' first barrier orders these writes

    float m = -CUDART_INF_F, l = 0.0f, acc[DIMS_PER_LANE];
#pragma unroll
    for (int c = 0; c < DIMS_PER_LANE; ++c) acc[c] = 0.0f;
    const int* table = block_tables + (long long)token_seq[n] * max_blocks;
    attend_keys(k_pool, v_pool, table, block_size, n_kv_heads, h, 0, token_pos[n] + 1, q_s, k_s, v_s, row_s,
                scale, m, l, acc);

    const long long o = ((long long)n * n_heads + (long long)h * group + warp) * HEAD_DIM;
    const float inv_l = 1.0f / l;  // l >= 1: the running max itself contributes exp(0)
#pragma unroll
    for (int c = 0; c < DIMS_PER_LANE; ++c) {
        const int d = lane + 32 * c;
        if (d < HEAD_DIM) out[o + d] = acc[c] * inv_l;
    }
}

// ---------------------------------------------------------------------------
// paged_decode_attention_v2 (split-K, vLLM's v2 / flash-decoding): the context of token n is
// cut into partitions of partition_size keys; block (n, h, z) attends its G queries over
// partition z only and writes, per query head, the partition's result *normalized by its own
// sum* (o_z = acc_z / l_z), its running max m_z and its sum l_z. paged_attention_reduce_v2
// merges them. A long context thus gets several blocks, so a step with few sequences still
// fills the GPU.
//
//   q, pools, block_tables, token_seq, token_pos: as v1
//   part_out: [N, Hq, P, D] float32; part_m, part_l: [N, Hq, P] float32  (P = n_partitions)
//   grid  = (N, Hkv, P)   partitions past a token's context leave at once (write nothing)
//   block = (32 * G), shared: as v1
//   bytes: v1's K/V/q/table reads; writes 4*N*Hq*Pn*(D+2) (Pn = partitions holding keys)
// ---------------------------------------------------------------------------
extern "C" __global__ void paged_decode_attention_v2(const float* __restrict__ q, const cache_t* __restrict__ k_pool,
                                                     const cache_t* __restrict__ v_pool,
                                                     const int* __restrict__ block_tables,
                                                     const int* __restrict__ token_seq,
                                                     const int* __restrict__ token_pos,
                                                     float* __restrict__ part_out, float* __restrict__ part_m,
                                                     float* __restrict__ part_l, int n_heads, int n_kv_heads,
                                                     int block_size, int max_blocks, int partition_size,
                                                     int n_partitions, float scale) {
    __shared__ float k_s[KEY_TILE][HEAD_DIM + 1];
    __shared__ __align__(16) float v_s[KEY_TILE][HEAD_DIM];
    __shared__ long long row_s[KEY_TILE];
    extern __shared__ float q_s[];  // [G][D]

    const int n = blockIdx.x, h = blockIdx.y, z = blockIdx.z;
    const int group = n_heads / n_kv_heads, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int k_begin = z * partition_size;
    const int k_end = min(token_pos[n] + 1, k_begin + partition_size);
    if (k_begin >= k_end) return;  // the whole block leaves together, before any barrier
    load_queries(q, q_s, n, n_heads, h, group);

    float m = -CUDART_INF_F, l = 0.0f, acc[DIMS_PER_LANE];
#pragma unroll
    for (int c = 0; c < DIMS_PER_LANE; ++c) acc[c] = 0.0f;
    const int* table = block_tables + (long long)token_seq[n] * max_blocks;
    attend_keys(k_pool, v_pool, table, block_size, n_kv_heads, h, k_begin, k_end, q_s, k_s, v_s, row_s, scale,
                m, l, acc);

    const long long p = ((long long)n * n_heads + (long long)h * group + warp) * n_partitions + z;
    const float inv_l = 1.0f / l;
#pragma unroll
    for (int c = 0; c < DIMS_PER_LANE; ++c) {
        const int d = lane + 32 * c;
        if (d < HEAD_DIM) part_out[p * HEAD_DIM + d] = acc[c] * inv_l;
    }
    if (lane == 0) {
        part_m[p] = m;
        part_l[p] = l;
    }
}

// ---------------------------------------------------------------------------
// paged_attention_reduce_v2: merge the partitions of each (token, query head). Partition i
// computed its softmax against its own max m_i; against the global max m = max_i m_i its
// sum becomes exp(m_i - m) * l_i, so
//     w_i = exp(m_i - m) * l_i,     out = sum_i w_i o_i / sum_i w_i
// (o_i is already divided by l_i). Only partitions holding keys are read:
// i < ceil((token_pos[n] + 1) / partition_size).
//
//   grid  = (N, Hq), block = (D): thread d owns output dim d (each thread recomputes the
//           weights: P broadcast loads and exps, small next to the attention itself)
//   bytes: reads 4*N*Hq*Pn*(D+2), writes 4*N*Hq*D.
// ---------------------------------------------------------------------------
extern "C" __global__ void paged_attention_reduce_v2(const float* __restrict__ part_out,
                                                     const float* __restrict__ part_m,
                                                     const float* __restrict__ part_l,
                                                     const int* __restrict__ token_pos, float* __restrict__ out,
                                                     int n_heads, int partition_size, int n_partitions) {
    const int n = blockIdx.x, head = blockIdx.y, d = threadIdx.x;
    if (d >= HEAD_DIM) return;
    const int used = min(n_partitions, (token_pos[n] + partition_size) / partition_size);
    const long long p0 = ((long long)n * n_heads + head) * n_partitions;
    float m = -CUDART_INF_F;
    for (int i = 0; i < used; ++i) m = fmaxf(m, part_m[p0 + i]);
    float num = 0.0f, den = 0.0f;
    for (int i = 0; i < used; ++i) {
        const float w = expf(part_m[p0 + i] - m) * part_l[p0 + i];
        num += w * part_out[(p0 + i) * HEAD_DIM + d];
        den += w;
    }
    out[((long long)n * n_heads + head) * HEAD_DIM + d] = num / den;  // den >= 1: the max partition's l_i
}

// ---------------------------------------------------------------------------
// copy_blocks: for each pair i, block pairs[i][0] of the source pools -> block pairs[i][1] of
// the destination pools, in every layer, K and V. The bytes are copied as they are (16 at a
// time), so the CACHE_T of both sides is the same.
//   copy-on-write: source and destination are the same pools (a destination is a freshly
//                  allocated block, never a source of the same launch);
//   swap out/in:   the device pools and a staging buffer of n blocks, gathered/scattered
//                  here and moved to/from host memory in one transfer.
//
//   src_k/src_v: [L, src_blocks, block_size, Hkv, D]; dst_k/dst_v: [L, dst_blocks, ...]
//   pairs: [P, 2] int32 (src, dst)
//   grid  = (P, L), block = (128): threads stride over the block's 16-byte chunks
//   bytes: reads and writes 2 * L * P * block_size*Hkv*D*sizeof(CACHE_T) each, + 8*P*L (pairs)
// Not __restrict__: for copy-on-write src and dst are the same arrays.
// ---------------------------------------------------------------------------
extern "C" __global__ void copy_blocks(const cache_t* src_k, const cache_t* src_v, cache_t* dst_k, cache_t* dst_v,
                                       const int* __restrict__ pairs, int src_blocks, int dst_blocks, int block_size,
                                       int n_kv_heads) {
    const int pair = blockIdx.x, layer = blockIdx.y;
    const long long block_elems = (long long)block_size * n_kv_heads * HEAD_DIM;  // a multiple of VEC
    const long long src = ((long long)layer * src_blocks + pairs[2 * pair]) * block_elems;
    const long long dst = ((long long)layer * dst_blocks + pairs[2 * pair + 1]) * block_elems;
    const long long chunks = block_elems * (long long)sizeof(cache_t) / 16;  // D % 8 == 0: whole chunks
    const uint4* sk = reinterpret_cast<const uint4*>(src_k + src);
    const uint4* sv = reinterpret_cast<const uint4*>(src_v + src);
    uint4* dk = reinterpret_cast<uint4*>(dst_k + dst);
    uint4* dv = reinterpret_cast<uint4*>(dst_v + dst);
    for (long long i = threadIdx.x; i < chunks; i += blockDim.x) {
        dk[i] = sk[i];
        dv[i] = sv[i];
    }
}
