// decode_v4.cuh: the v4 key loop, v3's design with the loads of one iteration in flight while the
// previous one computes. Shared by every v4 decode kernel (kv_cache.cu, paged.cu, quant.cu, window.cu);
// what differs between them is the key policy P (decode_core.cuh: where a key lives, whether it is
// visible, how it is rotated and dequantized).
//
// What changes from v3 (decode_v3.cuh):
//   * register double-buffering: the loads of iteration i+1 are issued before iteration i's math, so a
//     warp has loads in flight while it multiplies, not only between iterations;
//   * contiguous keys per warp: warp w takes keys w0 .. w0 + KW - 1 of each iteration (KW = 32/LANES *
//     P::KEYS <= 32), so the lookups an iteration needs (the block-table entries of its few blocks, or
//     the slots' positions) are loaded once, one lane per entry, one iteration ahead of the K/V loads that
//     need them, and handed to the lanes by __shfl_sync: a K/V load never waits for a lookup load;
//   * fewer instructions per byte: the partial dot products are summed by a transposed reduction
//     (decode::transposed_sum: ~2 shuffles per value instead of log2(LANES)), the rescale of l and acc is
//     skipped when no running max moved, and a plain row spreads 16 dims per lane at head_dim 128 (8
//     lanes per key: one shuffle step less, the per-key overhead over twice the bytes).

#pragma once

#include "decode_core.cuh"

// Resident blocks per multiprocessor: 4 where the G queries and accumulators (2*G*DIMS floats per lane)
// leave room under 128 registers, else 2 (255 registers). minikv_gpu.kv_cache.blocks_per_sm mirrors it.
#define V4_BLOCKS_PER_SM(dims) (GQA_GROUP * (dims) > 32 ? 2 : 4)

namespace decode_v4 {

// Dims per lane of a plain K/V row: 16 at head_dim 128 while the group's registers allow it.
constexpr int ROW_DIMS = (HEAD_DIM == 128 && decode::G <= 4) ? 16 : VEC;

// Keys per subgroup and iteration for a key of `bytes` per lane (K and V): about 64 bytes per lane and
// buffer at 4 blocks per SM, 128 at 2 (half the warps, so twice the bytes each for the same bytes in flight
// per SM), halved for G > 4, at most LANES (so that a warp's keys fit 32 lanes). Two buffers are live.
__host__ __device__ constexpr int keys_for(int dims, int bytes) {
    const int budget = decode::G * dims > 32 ? 128 : 64;
    const int want = (budget / bytes > 1 ? budget / bytes : 1) / (decode::G > 4 ? 2 : 1);
    const int lanes = HEAD_DIM / dims;
    return want < 1 ? 1 : want > lanes ? lanes : want;
}

template <class P, int U>
__device__ __forceinline__ void load_keys(const P& pol, int w0, int k_end, int ahead, int j, int d0,
                                          typename P::Raw (&raw)[U]) {
    constexpr int SPW = 32 / (HEAD_DIM / P::DIMS);
#pragma unroll
    for (int u = 0; u < U; ++u) pol.load(w0 + u * SPW + j, k_end, ahead, w0, d0, raw[u]);
}

// This lane's first dim for policy P.
template <class P>
__device__ __forceinline__ int dim0() {
    constexpr int LANES = HEAD_DIM / P::DIMS;
    return ((threadIdx.x & 31) % LANES) * P::DIMS;
}

// Walk keys [k_begin, k_end) of policy `pol` for the group's queries (scaled, this lane's dims), each score
// soft-capped at cap2 (log2 units; 0: none; decode::softmax_update), and return this lane's state; then
// decode::finish(state, dest, sinks). The caller returns first if the range is empty.
template <class P>
__device__ __forceinline__ decode::State<P::DIMS> attend(const P& pol, const float (&q)[decode::G][P::DIMS],
                                                         int k_begin, int k_end, float cap2) {
    constexpr int DIMS = P::DIMS, LANES = HEAD_DIM / DIMS, SPW = 32 / LANES, U = P::KEYS, KW = SPW * U;
    constexpr int PER_ITER = decode::WARPS * KW;
    static_assert(32 % LANES == 0 && KW <= 32, "a warp's keys of one iteration must fit its 32 lanes");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int j = lane / LANES, d0 = dim0<P>();
    decode::State<DIMS> s = decode::empty_state<DIMS>();
    int w0 = k_begin + warp * KW;  // this warp's first key of the current iteration
    typename P::Raw cur[U], nxt[U];
    int ahead = pol.ahead(w0, k_end);
    load_keys(pol, w0, k_end, ahead, j, d0, cur);
    ahead = pol.ahead(w0 + PER_ITER, k_end);  // one iteration ahead of the loads that need it
    for (int base = k_begin; base < k_end; base += PER_ITER) {  // warp-uniform trip count: no barrier inside
        w0 += PER_ITER;
        load_keys(pol, w0, k_end, ahead, j, d0, nxt);  // past k_end: masked, no memory traffic
        ahead = pol.ahead(w0 + PER_ITER, k_end);
        decode::consume<LANES, true>(pol, cur, d0, q, s, cap2);
#pragma unroll
        for (int u = 0; u < U; ++u) cur[u] = nxt[u];
    }
    return s;
}

}  // namespace decode_v4
