// online_softmax.cuh: the online softmax of every attention kernel, name for name as
// minikv/online_softmax.py (State, start, update, merge, finish).
//
// One warp owns one query row. Its state is three running numbers, kept in registers:
//     m    running max of the scores seen so far           (the same in every lane)
//     l    running sum of exp(score - m)                   (the same in every lane)
//     acc  running sum of exp(score - m) * value           (lane owns dims lane, lane+32, ...)
// A tile of KEY_TILE = 32 keys arrives as one score per lane (lane j: key j, -inf = masked) and
// the tile's values in shared memory, values[j][d]:
//     m'   = max(m, max_j s_j)
//     a    = exp(m - m')                    rescales everything seen so far (0 while m = -inf)
//     l'   = a * l + sum_j exp(s_j - m')
//     acc' = a * acc + sum_j exp(s_j - m') * values[j]
// and finish returns acc / l. Two states over disjoint key ranges (split-K) merge with each side
// scaled by exp(m_i - m), m = max(m_1, m_2): see split_k.cuh, the one layout for split partials.
//
// The two traps, handled here once (as in the Python file):
//   * a row that has seen only -inf scores has m = -inf, and -inf - -inf is NaN: update leaves
//     such a row alone (l and acc stay 0) and merge shifts it by 0; finish returns 0 for l = 0;
//   * a masked key's value row may be stale memory, even NaN (a paged pool's partly filled last
//     block), and 0 * NaN = NaN: a key whose probability is 0 is skipped, never multiplied by 0.
//
// Two options (minikv/online_softmax.py's module docstring):
//   * a learned sink (gpt-oss): one logit per query head that joins the denominator and carries
//     no value. start(sink) is a state that has seen one key of score `sink` and value 0:
//     m = sink, l = 1, acc = 0. Split-K: exactly one split starts from it, and merge counts it once.
//   * tanh soft-capping (Gemma 2): soft_cap(score, cap) = cap * tanh(score / cap) on each raw score
//     before update takes the max; cap <= 0 means none, and a masked -inf stays -inf.

#pragma once

#include "common.cuh"

namespace online_softmax {

struct State {
    float m;                   // running max
    float l;                   // running sum of exp(score - m)
    float acc[DIMS_PER_LANE];  // this lane's dims lane + 32*c of the unnormalized output
};

// The empty state: m = -inf, l = 0, acc = 0.
__device__ __forceinline__ State start() {
    State s;
    s.m = -CUDART_INF_F;
    s.l = 0.0f;
#pragma unroll
    for (int c = 0; c < DIMS_PER_LANE; ++c) s.acc[c] = 0.0f;
    return s;
}

// The state of a row with a learned sink logit: as if one key of score `sink` and value 0 was seen.
__device__ __forceinline__ State start(float sink) {
    State s = start();
    s.m = sink;
    s.l = 1.0f;
    return s;
}

// cap * tanh(score / cap) for cap > 0 (else score unchanged); a masked key (-inf) stays masked.
__device__ __forceinline__ float soft_cap(float score, float cap) {
    return (cap > 0.0f && score != -CUDART_INF_F) ? cap * tanhf(score / cap) : score;
}

// The two options as kernels take them: sinks[Hq] when use_sinks (one logit per query head), softcap > 0
// to cap. A kernel that splits a row's keys starts exactly one split from the sink (or adds it at the merge).
struct Options {
    const float* sinks;
    int use_sinks;
    float softcap;
};

// Where query head `head`'s row starts: from its sink in the one split that carries it (carries_sink), else
// empty.
__device__ __forceinline__ State start(const Options& opt, int head, bool carries_sink) {
    return opt.use_sinks && carries_sink ? start(opt.sinks[head]) : start();
}

// Fold one tile of keys into s. Warp-collective (all 32 lanes call it with the same s.m):
// score is this lane's key's scaled score, -inf where masked; values: [KEY_TILE][HEAD_DIM] floats.
__device__ __forceinline__ void update(State& s, float score, const float (*values)[HEAD_DIM]) {
    const int lane = threadIdx.x & 31;
    const float m_new = fmaxf(s.m, warp_max(score));
    if (m_new == -CUDART_INF_F) return;  // nothing visible yet for this row (warp-uniform)
    const float p = expf(score - m_new);  // 0 for masked keys
    const float alpha = expf(s.m - m_new);  // 0 on the first visible tile (m = -inf)
    s.l = s.l * alpha + warp_sum(p);
    s.m = m_new;
#pragma unroll
    for (int c = 0; c < DIMS_PER_LANE; ++c) s.acc[c] *= alpha;
    for (int j = 0; j < KEY_TILE; ++j) {
        const float pj = __shfl_sync(0xffffffffu, p, j);
        if (pj == 0.0f) continue;  // a masked key (warp-uniform): its value row is never read
#pragma unroll
        for (int c = 0; c < DIMS_PER_LANE; ++c) {
            const int d = lane + 32 * c;
            if (d < HEAD_DIM) s.acc[c] += pj * values[j][d];
        }
    }
}

// Combine two states over disjoint key ranges: each side scaled by exp(m_i - m). Per thread.
__device__ __forceinline__ State merge(const State& a, const State& b) {
    State r;
    r.m = fmaxf(a.m, b.m);
    const float shift = r.m == -CUDART_INF_F ? 0.0f : r.m;  // both empty: shift by 0, not -inf
    const float sa = expf(a.m - shift), sb = expf(b.m - shift);
    r.l = sa * a.l + sb * b.l;
#pragma unroll
    for (int c = 0; c < DIMS_PER_LANE; ++c) r.acc[c] = sa * a.acc[c] + sb * b.acc[c];
    return r;
}

// out_row[d] = acc[d] / l for this lane's dims; a row that saw no key (l = 0) gets zeros, never NaN.
__device__ __forceinline__ void finish(const State& s, float* out_row) {
    const int lane = threadIdx.x & 31;
    const float inv_l = s.l > 0.0f ? 1.0f / s.l : 0.0f;
#pragma unroll
    for (int c = 0; c < DIMS_PER_LANE; ++c) {
        const int d = lane + 32 * c;
        if (d < HEAD_DIM) out_row[d] = s.acc[c] * inv_l;
    }
}

}  // namespace online_softmax
