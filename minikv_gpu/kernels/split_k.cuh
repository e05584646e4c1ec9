// split_k.cuh: the one layout for split partials and the one reduce kernel, used by every
// split-K (v2) kernel: kv_cache.cu's decode_attention_v2 / rope_write_attend_v2 and paged.cu's
// paged_decode_attention_v2.
//
// A v2 kernel cuts the keys of token n into splits of keys_per_split keys (a multiple of
// KEY_TILE); block (n, kv head, z) attends split z and writes, for each query head h it serves,
// its online_softmax::State *unnormalized*, at p = (n * Hq + h) * n_splits + z:
//     part_m[p], part_l[p]             the split's running max and sum     [N, Hq, Z] float32
//     part_acc[p * HEAD_DIM + d]       its sum of exp(s - m_z) * v          [N, Hq, Z, D] float32
// attention_reduce_v2 merges the splits that hold keys, z < ceil((pos[n] + 1) / keys_per_split),
// with online_softmax::merge (each scaled by exp(m_z - m)) and finishes: acc / l.

#pragma once

#include "common.cuh"
#include "online_softmax.cuh"

// This warp's state as split partial p (lane 0 writes m and l).
__device__ __forceinline__ void write_partial(const online_softmax::State& s, float* part_m, float* part_l,
                                              float* part_acc, long long p) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int c = 0; c < DIMS_PER_LANE; ++c) {
        const int d = lane + 32 * c;
        if (d < HEAD_DIM) part_acc[p * HEAD_DIM + d] = s.acc[c];
    }
    if (lane == 0) {
        part_m[p] = s.m;
        part_l[p] = s.l;
    }
}

// Split partial p as this lane's share of a State.
__device__ __forceinline__ online_softmax::State read_partial(const float* part_m, const float* part_l,
                                                              const float* part_acc, long long p) {
    const int lane = threadIdx.x & 31;
    online_softmax::State s;
    s.m = part_m[p];
    s.l = part_l[p];
#pragma unroll
    for (int c = 0; c < DIMS_PER_LANE; ++c) {
        const int d = lane + 32 * c;
        s.acc[c] = d < HEAD_DIM ? part_acc[p * HEAD_DIM + d] : 0.0f;
    }
    return s;
}

// ---------------------------------------------------------------------------
// attention_reduce_v2: out[n, h, :] = finish(merge over the used splits z of partial (n, h, z)).
//
//   part_m, part_l: [N, Hq, Z], part_acc: [N, Hq, Z, D] float32 (the layout above)
//   pos: [N] int32, token n sees keys 0 .. pos[n];  out: [N, Hq, D] float32
//   grid  = (N, Hq), block = (32): lane c owns dims c, c+32, ... (the State layout)
//   bytes: reads 4*N*Hq*Zu*(D+2) (Zu = splits holding keys), writes 4*N*Hq*D.
// ---------------------------------------------------------------------------
extern "C" __global__ void attention_reduce_v2(const float* __restrict__ part_m, const float* __restrict__ part_l,
                                               const float* __restrict__ part_acc, const int* __restrict__ pos,
                                               float* __restrict__ out, int n_heads, int keys_per_split,
                                               int n_splits) {
    const int n = blockIdx.x, head = blockIdx.y;
    const int used = min(n_splits, (pos[n] + keys_per_split) / keys_per_split);
    const long long p0 = ((long long)n * n_heads + head) * n_splits;
    online_softmax::State s = online_softmax::start();
    for (int z = 0; z < used; ++z) s = online_softmax::merge(s, read_partial(part_m, part_l, part_acc, p0 + z));
    online_softmax::finish(s, out + ((long long)n * n_heads + head) * HEAD_DIM);
}
