// attend_tiles.cuh: the key loop of every attention kernel (attention.cu, kv_cache.cu, paged.cu).
//
// A thread block holds up to 32 query rows, one per warp (the G query heads of one KV head, or
// 4 consecutive query positions), and walks the keys of one (sequence, KV head) in tiles of
// KEY_TILE = 32: all threads load a tile of K and V into shared memory with 16-byte accesses
// (converted to float), each warp scores its row against the tile (lane j: key j) and folds the
// tile into its online_softmax::State. Every tile is loaded once per block and read by every
// warp: this is where grouped-query attention saves memory traffic.
//
// Where a key's row lives is the caller's business, as a Rows object:
//     rows.begin_tile(k0, k_end)   called by all threads before tile k0 is loaded; it must contain a
//                                  block-wide barrier: the only one between the previous tile's reads
//                                  of k_s/v_s and this tile's loads (and, on the first tile, between
//                                  the caller's shared writes, e.g. the queries, and their reads)
//     rows(key)                    element offset of key's K (and V) row, for k0 <= key < k_end
// DenseRows (below) is a [keys, D] block; paged.cu's PagedRows goes through a block table.
//
// Shared memory the caller declares: k_s[KEY_TILE][HEAD_DIM + 1] (+1 float per row: lane j reads
// row j bank-free) and v_s[KEY_TILE][HEAD_DIM], 16-byte aligned (float4 stores).

#pragma once

#include "common.cuh"
#include "online_softmax.cuh"

// Rows of a contiguous [keys, HEAD_DIM] history starting at element `base`.
struct DenseRows {
    long long base;
    __device__ __forceinline__ void begin_tile(int, int) { __syncthreads(); }  // the tile barrier (above)
    __device__ __forceinline__ long long operator()(int key) const { return base + (long long)key * HEAD_DIM; }
};

// Copy `count` consecutive floats (a group's queries) from global memory into shared memory.
__device__ __forceinline__ void load_queries(const float* src, float* q_s, int count) {
    for (int i = threadIdx.x; i < count; i += blockDim.x) q_s[i] = src[i];
}

// Load keys [k0, k0 + KEY_TILE) into the tiles. Keys >= k_end are zero-filled and never read:
// a stale or never-written slot may hold NaN (and may lie outside the array).
template <class T, class Rows>
__device__ __forceinline__ void load_tile(const T* k, const T* v, const Rows& rows, int k0, int k_end,
                                          float (*k_s)[HEAD_DIM + 1], float (*v_s)[HEAD_DIM]) {
    for (int i = threadIdx.x; i < KEY_TILE * (HEAD_DIM / VEC); i += blockDim.x) {
        const int j = i / (HEAD_DIM / VEC), d = (i % (HEAD_DIM / VEC)) * VEC;
        float kf[VEC], vf[VEC];
        if (k0 + j < k_end) {
            const long long row = rows(k0 + j);
            load8(k + row + d, kf);
            load8(v + row + d, vf);
        } else {
#pragma unroll
            for (int e = 0; e < VEC; ++e) kf[e] = vf[e] = 0.0f;
        }
#pragma unroll
        for (int e = 0; e < VEC; ++e) k_s[j][d + e] = kf[e];
        store8(&v_s[j][d], vf);
    }
}

// Attend query row q_row (shared memory, HEAD_DIM floats) of this warp over keys [k_begin, k_end),
// of which the row may see those < row_end (row_end <= k_end; 0: a padding row that sees nothing),
// folding them into s. All threads of the block call it: it has barriers, two per tile (one in
// rows.begin_tile, one after the load), so shared writes made before the call (queries) are
// ordered before any read.
// softcap > 0 caps each scaled score (online_softmax::soft_cap) before the update, per tile.
template <class T, class Rows>
__device__ __forceinline__ void attend_tiles(const T* k, const T* v, Rows& rows, int k_begin, int k_end,
                                             int row_end, const float* q_row, float (*k_s)[HEAD_DIM + 1],
                                             float (*v_s)[HEAD_DIM], float scale, online_softmax::State& s,
                                             float softcap = 0.0f) {
    const int lane = threadIdx.x & 31;
    for (int k0 = k_begin; k0 < k_end; k0 += KEY_TILE) {
        rows.begin_tile(k0, k_end);  // includes the barrier: everyone is done with the previous tile
        load_tile(k, v, rows, k0, k_end, k_s, v_s);
        __syncthreads();
        const int key = k0 + lane;
        float score = -CUDART_INF_F;
        if (key < row_end) {
            float dot = 0.0f;
#pragma unroll 8
            for (int d = 0; d < HEAD_DIM; ++d) dot += q_row[d] * k_s[lane][d];
            score = online_softmax::soft_cap(dot * scale, softcap);
        }
        online_softmax::update(s, score, v_s);
    }
}
