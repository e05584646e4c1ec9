// decode_v3.cuh: the v3 decode-attention core, register-resident and bandwidth-bound, shared by
// kv_cache.cu's decode_attention_v3 and paged.cu's paged_decode_attention_v3.
//
// One thread block (THREADS = 128 threads, 4 warps; names below are decode_v3::'s) serves one (token, KV head, split): the
// G = GQA_GROUP query heads of the KV head, over one key range. No shared-memory staging of K/V:
//
//   lanes      a key's D elements are split over LANES = D/8 lanes, 8 elements each (one
//              16-byte load for a half row slice, two 16-byte loads for float: the same lane
//              mapping for both caches, so fp32 simply moves twice the bytes per lane);
//              a warp holds 32/LANES such *subgroups* (D=128: 2, D=64: 4), the block 4x that;
//   queries    every lane keeps its 8 dims of all G queries in registers (pre-multiplied by
//              scale * log2(e)), so each K element loaded feeds G multiply-adds, each V element
//              another G: the group's sharing costs no extra traffic and no shared memory;
//   in flight  each subgroup takes UNROLL keys per iteration (keys base + u*SUBGROUPS + s,
//              so the lanes of a warp read consecutive rows) and issues all 2*UNROLL loads
//              (K and V) before the first multiply: 128 bytes per lane in flight for G <= 4
//              (fp16: 4 keys x 2 x 16 B; fp32: 2 keys x 2 x 32 B), half that for G > 4,
//              whose larger register state leaves fewer registers for loads;
//   reduce     the 8-element partial dots are summed over the LANES lanes of a subgroup by
//              __shfl_xor_sync; each subgroup keeps its own online-softmax state per query
//              head (m, l, acc[8] in registers): no barrier and no shared memory in the key loop;
//   merge      after the loop, the subgroups of a warp merge by shuffles, the 4 warps through
//              shared memory once (one __syncthreads), then the block writes out (unsplit) or
//              split partials in split_k.cuh's layout for attention_reduce_v2.
//
// Units. Scores are kept in log2 units: s2 = (q . k) * scale * log2(e), so exp(s - m) is
// exp2f(s2 - m2) (one MUFU.EX2, no multiply). l and acc are the same numbers in either unit;
// only m differs, m = m2 * ln(2). Partials are written in natural-log units (part_m = m2 * ln 2)
// because attention_reduce_v2 merges with expf(m_i - m), as it does for every v2 kernel.
//
// Masking. Keys at or past k_end are never loaded: their registers are zero and their score is
// -inf (probability exactly 0), so a stale slot holding NaN never reaches the sum. A subgroup
// that has seen no key keeps m = -inf; every exp2f here shifts by 0 instead of -inf there (the
// -inf - -inf = NaN trap of online_softmax.cuh, handled the same way).
//
// Limits: HEAD_DIM a power of two (LANES must divide 32), GQA_GROUP in 1..8 (the register
// budget: 16*G floats of queries and accumulators per lane). The Python side checks both.

#pragma once

#include "common.cuh"

#ifndef GQA_GROUP
#define GQA_GROUP 1  // query heads per KV head, compile-time so that q and acc stay in registers
#endif

// Occupancy: 4 blocks (16 warps) per multiprocessor for G <= 4, so ptxas keeps to 128 registers;
// 2 for G > 4 (up to 255). The launchers size the grid with the same numbers
// (minikv_gpu.kv_cache.v3_blocks_per_sm).
#define V3_BLOCKS_PER_SM (GQA_GROUP > 4 ? 2 : 4)
#define V3_LAUNCH_BOUNDS __launch_bounds__(128, V3_BLOCKS_PER_SM)

namespace decode_v3 {

constexpr int G = GQA_GROUP;
constexpr int LANES = HEAD_DIM / VEC;                // lanes per key (8 elements each)
constexpr int WARPS = 4;
constexpr int THREADS = 32 * WARPS;
constexpr int SUB_PER_WARP = 32 / LANES;             // keys a warp works on side by side
constexpr int SUBGROUPS = WARPS * SUB_PER_WARP;      // ... and the block
constexpr int UNROLL = (CACHE_HALF ? 4 : 2) / (G > 4 ? 2 : 1);  // keys per subgroup per iteration
constexpr int KEYS_PER_ITER = SUBGROUPS * UNROLL;
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

static_assert(G >= 1 && G <= 8, "decode v3 keeps at most 8 query heads per KV head in registers");
static_assert(32 % LANES == 0, "decode v3 needs HEAD_DIM a power of two: D/8 lanes per key must divide a warp");

// Raw8, load_raw, zero_raw, unpack: common.cuh (8 elements loaded now, converted when used).

// One lane's online-softmax state for the G query heads (log2 units): m2, l and its 8 dims of acc.
struct State {
    float m[G], l[G], acc[G][VEC];
};

// exp2f(x - shift), shifting by 0 where the shift is -inf (nothing seen yet), never -inf - -inf.
__device__ __forceinline__ float exp2_shifted(float x, float shift) {
    return exp2f(x - (shift == -CUDART_INF_F ? 0.0f : shift));
}

// Fold (mo, lo, acco) into (m, l, acc) for query head g: both sides rescaled to the larger max.
__device__ __forceinline__ void merge_into(State& s, int g, float mo, float lo, const float* acco) {
    const float mm = fmaxf(s.m[g], mo);
    const float sa = exp2_shifted(s.m[g], mm), sb = exp2_shifted(mo, mm);  // 0 for a -inf side
    s.l[g] = sa * s.l[g] + sb * lo;
#pragma unroll
    for (int i = 0; i < VEC; ++i) s.acc[g][i] = sa * s.acc[g][i] + sb * acco[i];
    s.m[g] = mm;
}

// One iteration: UNROLL keys of this subgroup, key0 + u*SUBGROUPS for u < UNROLL (those >= k_end masked).
template <class Rows>
__device__ __forceinline__ void step(const cache_t* k, const cache_t* v, const Rows& rows, int key0, int k_end,
                                     int d0, const float (&q)[G][VEC], State& s) {
    Raw8 kr[UNROLL], vr[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {  // every load of the iteration is issued before the first use
        const int key = key0 + u * SUBGROUPS;
        if (key < k_end) {
            const long long row = rows(key) + d0;
            kr[u] = load_raw(k + row);
            vr[u] = load_raw(v + row);
        } else {
            kr[u] = zero_raw();
            vr[u] = zero_raw();
        }
    }
    float sc[UNROLL][G];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        float kf[VEC];
        unpack(kr[u], kf);
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float dot = 0.0f;
#pragma unroll
            for (int i = 0; i < VEC; ++i) dot += q[g][i] * kf[i];
            sc[u][g] = dot;
        }
    }
    subgroup_sum<LANES>(sc);  // sum over the subgroup's lanes (all lanes call it)
    float p[UNROLL][G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        float mx = s.m[g];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (key0 + u * SUBGROUPS >= k_end) sc[u][g] = -CUDART_INF_F;  // masked: probability 0
            mx = fmaxf(mx, sc[u][g]);
        }
        const float alpha = exp2_shifted(s.m[g], mx);  // 0 while m = -inf (l and acc are 0 then)
        float sum = 0.0f;
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            p[u][g] = exp2_shifted(sc[u][g], mx);  // exp2f(-inf) = 0 for masked keys
            sum += p[u][g];
        }
        s.l[g] = s.l[g] * alpha + sum;
        s.m[g] = mx;
#pragma unroll
        for (int i = 0; i < VEC; ++i) s.acc[g][i] *= alpha;
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {  // masked keys have zero registers and p = 0: they add exactly 0
        float vf[VEC];
        unpack(vr[u], vf);
#pragma unroll
        for (int g = 0; g < G; ++g) {
#pragma unroll
            for (int i = 0; i < VEC; ++i) s.acc[g][i] += p[u][g] * vf[i];
        }
    }
}

// Where the block's results go: out rows (n_splits == 1, normalized) or split partials.
struct Sink {
    float *out, *part_m, *part_l, *part_acc;
    long long row0;  // (n, h*G): the row of query head g is row0 + g, in [N, Hq]
    int z, n_splits;
};

// Merge the block's SUBGROUPS states and write them (one __syncthreads; all threads call it).
__device__ __forceinline__ void finish(State& s, const Sink& sink) {
    __shared__ float s_m[WARPS][G], s_l[WARPS][G];
    __shared__ __align__(16) float s_acc[WARPS][G][HEAD_DIM];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int off = LANES; off < 32; off <<= 1) {  // the warp's subgroups, by shuffles
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const float mo = __shfl_xor_sync(0xffffffffu, s.m[g], off);
            const float lo = __shfl_xor_sync(0xffffffffu, s.l[g], off);
            float acco[VEC];
#pragma unroll
            for (int i = 0; i < VEC; ++i) acco[i] = __shfl_xor_sync(0xffffffffu, s.acc[g][i], off);
            merge_into(s, g, mo, lo, acco);
        }
    }
    if (lane < LANES) {  // subgroup 0 holds the warp's state now
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float* dst = &s_acc[warp][g][lane * VEC];
            *reinterpret_cast<float4*>(dst) = make_float4(s.acc[g][0], s.acc[g][1], s.acc[g][2], s.acc[g][3]);
            *reinterpret_cast<float4*>(dst + 4) = make_float4(s.acc[g][4], s.acc[g][5], s.acc[g][6], s.acc[g][7]);
            if (lane == 0) {
                s_m[warp][g] = s.m[g];
                s_l[warp][g] = s.l[g];
            }
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < G * HEAD_DIM; i += THREADS) {
        const int g = i / HEAD_DIM, d = i % HEAD_DIM;
        float mm = -CUDART_INF_F;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) mm = fmaxf(mm, s_m[w][g]);
        float l = 0.0f, a = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float sw = exp2_shifted(s_m[w][g], mm);
            l += sw * s_l[w][g];
            a += sw * s_acc[w][g][d];
        }
        const long long row = sink.row0 + g;
        if (sink.n_splits == 1) {
            sink.out[row * HEAD_DIM + d] = l > 0.0f ? a / l : 0.0f;  // no key seen: zeros, never NaN
        } else {
            const long long p = row * sink.n_splits + sink.z;
            sink.part_acc[p * HEAD_DIM + d] = a;
            if (d == 0) {
                sink.part_m[p] = mm * LN2;  // natural-log units, as attention_reduce_v2 reads them
                sink.part_l[p] = l;
            }
        }
    }
}

// Walk keys [k_begin, k_end) of `rows` for the group's queries and return this lane's state (then
// finish(state, sink): the sink is built after the loop, so its pointers hold no register during it).
// q_group: the G query rows (n, h*G .. h*G+G-1) of [N, Hq, D] float32. The caller returns before
// calling it if the range is empty (the whole block leaves together).
template <class Rows>
__device__ __forceinline__ State attend(const float* q_group, const cache_t* k, const cache_t* v, const Rows& rows,
                                        int k_begin, int k_end, float scale) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int sub = warp * SUB_PER_WARP + lane / LANES;  // this lane's subgroup in the block
    const int d0 = (lane % LANES) * VEC;                  // ... and its 8 dims
    float q[G][VEC];
    const float qs = scale * LOG2E;
#pragma unroll
    for (int g = 0; g < G; ++g) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) q[g][i] = q_group[g * HEAD_DIM + d0 + i] * qs;
    }
    State s;
#pragma unroll
    for (int g = 0; g < G; ++g) {
        s.m[g] = -CUDART_INF_F;
        s.l[g] = 0.0f;
#pragma unroll
        for (int i = 0; i < VEC; ++i) s.acc[g][i] = 0.0f;
    }
    for (int base = k_begin; base < k_end; base += KEYS_PER_ITER)  // warp-uniform trip count: no barrier inside
        step(k, v, rows, base + sub, k_end, d0, q, s);
    return s;
}

}  // namespace decode_v3
