// decode_v3.cuh: the v3 key loop, register-resident and bandwidth-bound, shared by every v3 decode
// kernel (kv_cache.cu, paged.cu, quant.cu, window.cu). What it shares with v4 is decode_core.cuh's: the
// State, the per-iteration math (decode::consume), finish and the key-policy contract.
//
// v3's mapping: a key's D elements over LANES = D/8 lanes, 8 each (one 16-byte load for a half row
// slice, two for float); a warp holds 32/LANES subgroups, the block 4x that, and subgroup `sub` takes
// keys base + u*SUBGROUPS + sub for u < P::KEYS, issuing all their loads before the first multiply
// (fp16: 4 keys, 128 bytes per lane in flight for G <= 4; half that above, whose larger register
// state leaves fewer registers for loads). Each lane looks its own keys up (block table, slot
// position); the partial dots are summed by a butterfly of __shfl_xor_sync; every key rescales.
//
// Limits: HEAD_DIM a power of two (LANES must divide 32), GQA_GROUP in 1..8. The Python side checks both.

#pragma once

#include "decode_core.cuh"

// Occupancy: 4 blocks (16 warps) per multiprocessor for G <= 4, so ptxas keeps to 128 registers;
// 2 for G > 4 (up to 255). The launchers size the grid with the same numbers
// (minikv_gpu.kv_cache.blocks_per_sm).
#define V3_BLOCKS_PER_SM (GQA_GROUP > 4 ? 2 : 4)
#define V3_LAUNCH_BOUNDS __launch_bounds__(128, V3_BLOCKS_PER_SM)

namespace decode_v3 {

constexpr int DIMS = VEC;
constexpr int LANES = HEAD_DIM / DIMS;                      // lanes per key
constexpr int SUB_PER_WARP = 32 / LANES;                    // keys a warp works on side by side
constexpr int SUBGROUPS = decode::WARPS * SUB_PER_WARP;     // ... and the block
constexpr int ROW_KEYS = (CACHE_HALF ? 4 : 2) / (decode::G > 4 ? 2 : 1);  // keys per subgroup, plain rows

static_assert(32 % LANES == 0, "decode v3 needs HEAD_DIM a power of two: D/8 lanes per key must divide a warp");

// This lane's first dim.
__device__ __forceinline__ int dim0() { return ((threadIdx.x & 31) % LANES) * DIMS; }

// Walk keys [k_begin, k_end) of policy `pol` for the group's queries (scaled, this lane's dims), each score
// soft-capped at cap2 (log2 units; 0: none; decode::softmax_update), and return this lane's state; then
// decode::finish(state, dest, sinks). The caller returns before calling it if the range is empty (the whole
// block leaves together).
template <class P>
__device__ __forceinline__ decode::State<DIMS> attend(const P& pol, const float (&q)[decode::G][DIMS], int k_begin,
                                                      int k_end, float cap2) {
    static_assert(P::DIMS == DIMS, "v3 spreads 8 dims per lane");
    constexpr int U = P::KEYS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int sub = warp * SUB_PER_WARP + lane / LANES, d0 = dim0();
    decode::State<DIMS> s = decode::empty_state<DIMS>();
    for (int base = k_begin; base < k_end; base += SUBGROUPS * U) {  // warp-uniform trip count: no barrier inside
        typename P::Raw raw[U];
#pragma unroll
        for (int u = 0; u < U; ++u) pol.load(base + u * SUBGROUPS + sub, k_end, 0, 0, d0, raw[u]);
        decode::consume<LANES, false>(pol, raw, d0, q, s, cap2);
    }
    return s;
}

}  // namespace decode_v3
