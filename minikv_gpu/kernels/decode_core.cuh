// decode_core.cuh: what the register-resident decode loops (v3: decode_v3.cuh, v4: decode_v4.cuh) share,
// and the contract of a key policy, the one thing that differs between cache kinds.
//
// A thread block (THREADS = 128, 4 warps) serves one (token, KV head, split): the G = GQA_GROUP query
// heads of the KV head over one key range. A key's D elements are split over LANES = D / DIMS lanes
// (a *subgroup*), DIMS = 8 or 16 per lane; every lane keeps its DIMS dims of all G queries (scaled by
// scale * log2 e) and its own online-softmax state (m, l, acc[DIMS]) per query head: no shared memory
// and no barrier in the key loop. After it, finish() merges the subgroups (shuffles, then one trip
// through shared memory) and writes the output or split_k.cuh's partials.
//
// A key policy P says what differs between the paged, contiguous, quantized and window caches:
//   static constexpr int DIMS                  dims per lane (8 or 16)
//   static constexpr int KEYS                  keys per subgroup per iteration of decode_v4's loop
//   struct Raw                                 one key's loads as they arrive (K, V, what visibility needs)
//   int ahead(int w0, int k_end) const         v4: lane e loads the e-th lookup entry (block-table entry,
//                                              slot position) the warp's keys w0 .. w0+KW-1 need; else 0
//   void load(int key, int k_end, int ahead, int w0, int d0, Raw&) const
//                                              where the key lives: issue its loads (nothing for a key
//                                              past k_end or invisible: zero registers). Warp-collective:
//                                              with prefetched lookups it broadcasts by shuffle.
//   bool visible(const Raw&) const             whether the key takes part (masked: score -inf, p = 0)
//   void key(const Raw&, int d0, float (&)[DIMS]) const    dequantize, unpack and rotate K (collective)
//   void value(const Raw&, int d0, float (&)[DIMS]) const  the same for V
// The v3 loop calls load with ahead = 0 and w0 = 0 and looks each key up itself; the v4 loop prefetches.
//
// Units: scores in log2 units (s2 = q.k * scale * log2 e), so exp(s - m) is exp2f(s2 - m2); l and acc
// are the same numbers in either unit, and partials are written with m in natural-log units (m2 * ln 2),
// as attention_reduce_v2 merges them with expf(m_i - m). A subgroup that has seen no key keeps m = -inf
// and every exp2f shifts by 0 there, never -inf - -inf.
//
// Options (online_softmax.cuh's, through decode::run): a soft cap applies to each score in log2 units,
// cap2 = cap * log2 e (cap2 * tanh(s2 / cap2) = log2 e * cap * tanh(s / cap)), before the max; learned
// sinks join in finish, once per row, in the block of split 0 only (a state m = sink, l = 1, acc = 0).

#pragma once

#include "common.cuh"

#ifndef GQA_GROUP
#define GQA_GROUP 1  // query heads per KV head, compile-time so that q and acc stay in registers
#endif

namespace decode {

constexpr int G = GQA_GROUP;
constexpr int WARPS = 4;
constexpr int THREADS = 32 * WARPS;
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;
constexpr unsigned FULL = 0xffffffffu;

static_assert(G >= 1 && G <= 8, "the decode loops keep at most 8 query heads per KV head in registers");

// One lane's online-softmax state for the G query heads (log2 units): m2, l and its DIMS dims of acc.
template <int DIMS>
struct State {
    float m[G], l[G], acc[G][DIMS];
};

template <int DIMS>
__device__ __forceinline__ State<DIMS> empty_state() {
    State<DIMS> s;
#pragma unroll
    for (int g = 0; g < G; ++g) {
        s.m[g] = -CUDART_INF_F;
        s.l[g] = 0.0f;
#pragma unroll
        for (int i = 0; i < DIMS; ++i) s.acc[g][i] = 0.0f;
    }
    return s;
}

// exp2f(x - shift), shifting by 0 where the shift is -inf (nothing seen yet), never -inf - -inf.
__device__ __forceinline__ float exp2_shifted(float x, float shift) {
    return exp2f(x - (shift == -CUDART_INF_F ? 0.0f : shift));
}

// The G query rows of [., HEAD_DIM] floats at q_group, this lane's DIMS dims from d0, unscaled.
template <int DIMS>
__device__ __forceinline__ void load_queries(const float* q_group, int d0, float (&q)[G][DIMS]) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
#pragma unroll
        for (int i = 0; i < DIMS; i += VEC) load8(q_group + g * HEAD_DIM + d0 + i, &q[g][i]);
    }
}

template <int DIMS>
__device__ __forceinline__ void scale_queries(float (&q)[G][DIMS], float scale) {
    const float qs = scale * LOG2E;
#pragma unroll
    for (int g = 0; g < G; ++g) {
#pragma unroll
        for (int i = 0; i < DIMS; ++i) q[g][i] *= qs;
    }
}

// DIMS cache elements loaded now, converted when used (Raw8 of common.cuh, DIMS / 8 of them).
template <int DIMS>
struct RawN {
    Raw8 p[DIMS / VEC];
};

template <int DIMS>
__device__ __forceinline__ RawN<DIMS> load_raw_n(const cache_t* src) {
    RawN<DIMS> r;
#pragma unroll
    for (int i = 0; i < DIMS / VEC; ++i) r.p[i] = load_raw(src + i * VEC);
    return r;
}

template <int DIMS>
__device__ __forceinline__ RawN<DIMS> zero_raw_n() {
    RawN<DIMS> r;
#pragma unroll
    for (int i = 0; i < DIMS / VEC; ++i) r.p[i] = zero_raw();
    return r;
}

template <int DIMS>
__device__ __forceinline__ void unpack_n(const RawN<DIMS>& r, float (&f)[DIMS]) {
#pragma unroll
    for (int i = 0; i < DIMS / VEC; ++i) unpack(r.p[i], &f[i * VEC]);
}

// The policy's Raw for a plain cache row: K and V elements, and whether the key takes part.
template <int DIMS>
struct KVRaw {
    RawN<DIMS> k, v;
    bool ok;
};

// Keys a warp takes per iteration of decode_v4's loop: 32 / LANES side by side, KEYS each.
template <int DIMS, int KEYS>
__host__ __device__ constexpr int warp_keys() {
    return 32 / (HEAD_DIM / DIMS) * KEYS;
}

// The policy base of a plain K/V row (contiguous and paged caches): 16-byte loads, converted when used,
// no rotation. A derived policy adds where a key lives (ahead, load).
template <int DIMS_, int KEYS_>
struct PlainRows {
    static constexpr int DIMS = DIMS_, KEYS = KEYS_;
    using Raw = KVRaw<DIMS>;
    const cache_t *k, *v;

    // K and V elements row .. row + DIMS - 1 (zero registers and no load where !ok).
    __device__ __forceinline__ void load_row(long long row, bool ok, Raw& r) const {
        r.ok = ok;
        r.k = ok ? load_raw_n<DIMS>(k + row) : zero_raw_n<DIMS>();
        r.v = ok ? load_raw_n<DIMS>(v + row) : zero_raw_n<DIMS>();
    }
    __device__ __forceinline__ bool visible(const Raw& r) const { return r.ok; }
    __device__ __forceinline__ void key(const Raw& r, int, float (&f)[DIMS]) const { unpack_n(r.k, f); }
    __device__ __forceinline__ void value(const Raw& r, int, float (&f)[DIMS]) const { unpack_n(r.v, f); }
    __device__ __forceinline__ void query(float (&)[G][DIMS], int) const {}  // queries come rotated
};

// --- the reductions of the partial dot products over a subgroup's LANES lanes ---

// Butterfly (v3): every value is summed by log2(LANES) shuffles, N * log2(LANES) in all.
template <int LANES, int N>
__device__ __forceinline__ void butterfly_sum(float (&x)[N], int from_offset = LANES / 2) {
#pragma unroll
    for (int off = from_offset; off > 0; off >>= 1) {
#pragma unroll
        for (int i = 0; i < N; ++i) x[i] += __shfl_xor_sync(FULL, x[i], off);
    }
}

// Transposed (v4): while the count of values is even, a lane keeps half of them and sends the other half
// to its partner at offset OFF (a reduce-scatter), then gathers the finished halves back. Every lane ends
// with every sum, after about 2 N shuffles instead of N log2(LANES): the shuffle unit runs at a quarter
// of the FMA rate, so this is the loop's costliest step after the loads.
template <int OFF, int N>
__device__ __forceinline__ void transposed_sum(float (&x)[N], int lane) {
    if constexpr (OFF == 0) {
        return;
    } else if constexpr (N % 2 == 1) {
        butterfly_sum<2 * OFF, N>(x, OFF);  // an odd count: the plain butterfly for the offsets left
    } else {
        constexpr int H = N / 2;
        const bool low = (lane & OFF) == 0;
        float half[H];
#pragma unroll
        for (int i = 0; i < H; ++i) {
            const float keep = low ? x[i] : x[i + H], send = low ? x[i + H] : x[i];
            half[i] = keep + __shfl_xor_sync(FULL, send, OFF);
        }
        transposed_sum<OFF / 2, H>(half, lane);
#pragma unroll
        for (int i = 0; i < H; ++i) {
            const float other = __shfl_xor_sync(FULL, half[i], OFF);
            x[i] = low ? half[i] : other;
            x[i + H] = low ? other : half[i];
        }
    }
}

// --- one iteration's math over U loaded keys: scores, online softmax, values ---

template <int DIMS, int U>
__device__ __forceinline__ void score_keys(const float (&q)[G][DIMS], const float (&k)[DIMS], float (&sc)[U * G],
                                           int u) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < DIMS; ++i) dot += q[g][i] * k[i];
        sc[u * G + g] = dot;
    }
}

// Fold U scores per query head into s; sc[u*G+g] becomes p = exp2(s - m'). SKIP (v4): the rescale of l
// and acc by exp2(m - m') = 1 is skipped where no running max moved (most keys, once a max is found).
// cap2 > 0: each score is soft-capped first, before the max (online_softmax.cuh's soft_cap in log2 units:
// log2e * cap * tanh(s / cap) = cap2 * tanh(s2 / cap2) with cap2 = cap * log2e); cap2 is block-uniform.
template <int DIMS, int U, bool SKIP>
__device__ __forceinline__ void softmax_update(State<DIMS>& s, float (&sc)[U * G], const bool (&ok)[U], float cap2) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
        float mx = s.m[g];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (cap2 > 0.0f) sc[u * G + g] = cap2 * tanhf(sc[u * G + g] / cap2);
            if (!ok[u]) sc[u * G + g] = -CUDART_INF_F;  // masked: probability exactly 0
            mx = fmaxf(mx, sc[u * G + g]);
        }
        if (!SKIP || mx != s.m[g]) {
            const float alpha = exp2_shifted(s.m[g], mx);  // 0 while m = -inf (l and acc are 0 then)
            s.l[g] *= alpha;
#pragma unroll
            for (int i = 0; i < DIMS; ++i) s.acc[g][i] *= alpha;
            s.m[g] = mx;
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            sc[u * G + g] = exp2_shifted(sc[u * G + g], mx);
            s.l[g] += sc[u * G + g];
        }
    }
}

// The iteration's math on keys raw[0 .. U): K converted first, scores reduced over the subgroup (all lanes
// call this: shuffles), the softmax folded, then V converted and accumulated (masked keys: zero registers
// and p = 0, so they add exactly 0; a stale NaN slot is never loaded).
template <int LANES, bool V4, class P, int U>
__device__ __forceinline__ void consume(const P& pol, const typename P::Raw (&raw)[U], int d0,
                                        const float (&q)[G][P::DIMS], State<P::DIMS>& s, float cap2) {
    constexpr int DIMS = P::DIMS;
    float sc[U * G];
    bool ok[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
        float kf[DIMS];
        pol.key(raw[u], d0, kf);
        ok[u] = pol.visible(raw[u]);
        score_keys<DIMS, U>(q, kf, sc, u);
    }
    if constexpr (V4) transposed_sum<LANES / 2, U * G>(sc, threadIdx.x & 31);
    else butterfly_sum<LANES, U * G>(sc);
    softmax_update<DIMS, U, V4>(s, sc, ok, cap2);
#pragma unroll
    for (int u = 0; u < U; ++u) {
        float vf[DIMS];
        pol.value(raw[u], d0, vf);
#pragma unroll
        for (int g = 0; g < G; ++g) {
#pragma unroll
            for (int i = 0; i < DIMS; ++i) s.acc[g][i] += sc[u * G + g] * vf[i];
        }
    }
}

// --- after the loop: merge the block's subgroups and write ---

// Fold (mo, lo, acco) into (m, l, acc) for query head g: both sides rescaled to the larger max.
template <int DIMS>
__device__ __forceinline__ void merge_into(State<DIMS>& s, int g, float mo, float lo, const float (&acco)[DIMS]) {
    const float mm = fmaxf(s.m[g], mo);
    const float sa = exp2_shifted(s.m[g], mm), sb = exp2_shifted(mo, mm);  // 0 for a -inf side
    s.l[g] = sa * s.l[g] + sb * lo;
#pragma unroll
    for (int i = 0; i < DIMS; ++i) s.acc[g][i] = sa * s.acc[g][i] + sb * acco[i];
    s.m[g] = mm;
}

// Where the block's results go: out rows (n_splits == 1, normalized) or split partials.
struct Dest {
    float *out, *part_m, *part_l, *part_acc;
    long long row0;  // (n, h*G): the row of query head g is row0 + g, in [N, Hq]
    int z, n_splits;
};

// Merge the block's subgroups (LANES lanes of DIMS dims each) and write them (one __syncthreads; all
// threads call it). sinks: the G query heads' learned sink logits (natural-log units, as given), merged here
// once as one more state (m = sink, l = 1, acc = 0: online_softmax.cuh's start(sink)); nullptr when there are
// none, or in a split other than the one that carries them.
template <int DIMS>
__device__ __forceinline__ void finish(State<DIMS>& s, const Dest& dest, const float* sinks) {
    constexpr int LANES = HEAD_DIM / DIMS;
    __shared__ float s_m[WARPS][G], s_l[WARPS][G];
    __shared__ __align__(16) float s_acc[WARPS][G][HEAD_DIM];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int off = LANES; off < 32; off <<= 1) {  // the warp's subgroups, by shuffles
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const float mo = __shfl_xor_sync(FULL, s.m[g], off);
            const float lo = __shfl_xor_sync(FULL, s.l[g], off);
            float acco[DIMS];
#pragma unroll
            for (int i = 0; i < DIMS; ++i) acco[i] = __shfl_xor_sync(FULL, s.acc[g][i], off);
            merge_into(s, g, mo, lo, acco);
        }
    }
    if (lane < LANES) {  // subgroup 0 holds the warp's state now
#pragma unroll
        for (int g = 0; g < G; ++g) {
#pragma unroll
            for (int i = 0; i < DIMS; i += VEC) store8(&s_acc[warp][g][lane * DIMS + i], &s.acc[g][i]);
            if (lane == 0) {
                s_m[warp][g] = s.m[g];
                s_l[warp][g] = s.l[g];
            }
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < G * HEAD_DIM; i += THREADS) {
        const int g = i / HEAD_DIM, d = i % HEAD_DIM;
        const float sink2 = sinks != nullptr ? sinks[g] * LOG2E : -CUDART_INF_F;  // log2 units, as s_m
        float mm = sink2;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) mm = fmaxf(mm, s_m[w][g]);
        float l = sinks != nullptr ? exp2_shifted(sink2, mm) : 0.0f, a = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float sw = exp2_shifted(s_m[w][g], mm);
            l += sw * s_l[w][g];
            a += sw * s_acc[w][g][d];
        }
        const long long row = dest.row0 + g;
        if (dest.n_splits == 1) {
            dest.out[row * HEAD_DIM + d] = l > 0.0f ? a / l : 0.0f;  // no key seen: zeros, never NaN
        } else {
            const long long p = row * dest.n_splits + dest.z;
            dest.part_acc[p * HEAD_DIM + d] = a;
            if (d == 0) {
                dest.part_m[p] = mm * LN2;  // natural-log units, as attention_reduce_v2 reads them
                dest.part_l[p] = l;
            }
        }
    }
}

// --- where a key lives: a lookup through an int array (block table, slot positions) ---

// entry(key) = arr[key / DIV] (DIV: a compile-time divisor, a power of two on the fast path; 0: the
// runtime div). PREFETCH (v4): the entries the warp's KW keys from w0 need are loaded one lane per entry
// by ahead(), one iteration early, and handed to each lane by a shuffle; else every lane loads its own.
template <int DIV, bool PREFETCH>
struct Lookup {
    const int* arr;
    int div, limit;  // runtime divisor (DIV == 0); entries >= limit are never read (0 instead)

    __device__ __forceinline__ int index(int key) const {
        if constexpr (DIV > 0) return (int)((unsigned)key / (unsigned)DIV);  // a shift for a power of two
        else return key / div;
    }
    __device__ __forceinline__ int divisor() const { return DIV > 0 ? DIV : div; }
    __device__ __forceinline__ int offset(int key) const { return key - index(key) * divisor(); }
    // The number of entries the KW keys from w0 touch (ahead's count).
    __device__ __forceinline__ int span(int w0, int kw) const { return index(w0 + kw - 1) - index(w0) + 1; }
    __device__ __forceinline__ int ahead(int w0, int count) const {
        if constexpr (!PREFETCH) {
            return 0;
        } else {
            const int lane = threadIdx.x & 31, i = index(w0) + lane;
            return lane < count && i < limit ? arr[i] : 0;  // one lane per entry, no load past the end
        }
    }
    // All lanes call it (a shuffle when PREFETCH); the value is used only for keys that load.
    __device__ __forceinline__ int at(int key, int ahead_entry, int w0) const {
        if constexpr (PREFETCH) {
            return __shfl_sync(FULL, ahead_entry, index(key) - index(w0));
        } else {
            const int i = index(key);
            return i < limit ? arr[i] : 0;
        }
    }
};

}  // namespace decode
