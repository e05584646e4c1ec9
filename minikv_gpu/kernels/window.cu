// window.cu: step 6, decode attention over an evicting cache's slots (minikv/window/) on the GPU.
//
// Storage (one layer of minikv.window.ring.EvictingKVCache, batched over sequences):
//     k, v   [B, Hkv, C, D] CACHE_T   slots in storage order (a wrapped ring is not time order)
//     pos    [B, Hkv, C] int32        each slot's absolute token position, -1 = empty
// One query token per sequence (decode) at position q_pos[b]; q: [B, Hq, D] float32, query head
// h*G + g reads KV head h. Slot j (position k) is visible to the query at q iff
//     k >= 0 && k <= q && (W == 0 || k < S || q - k < W - S)
// (WindowPolicy.visible; W = 0: no window rule, causal on the stored positions: the base Policy,
// H2O and SnapKV). The softmax does not care about the order of its keys, so slots are read in
// storage order and each key's visibility comes from its stored position.
//
// In-cache positions (rope_mode 1 = "half", 2 = "interleaved"; 0 = keys already rotated): the
// slots hold pre-RoPE keys and the kernel rotates each visible key by its rank among the visible
// keys, the query by its own rank. For the window policy the rank has a closed form,
//     rank(k) = k                                  if k < S
//             = S + k - max(S, q - (W - S) + 1)    otherwise
// (the visible keys are 0 .. min(S, q+1)-1 and max(S, q-(W-S)+1) .. q, all present in a ring
// that lost nothing else), which equals minikv.window.ring.rank_positions there; W = 0 rotates at the
// absolute position (rank(k) = k). cos/sin: [P, D/2] float32 tables, row = the rank. Keys are
// re-rotated from the stored pre-RoPE key every call (never compounded).
//
// Mass (want_mass != 0): also mass[b, h, j] = sum over the G query heads of exp(s_j - m) / l
// with the final running max m and sum l (0 for invisible or empty slots): attend_slots' mass,
// which H2O accumulates. A second pass over the keys recomputes the scores (v1: simple first).
//
// Kernels (<op>_v<N>; the same N means the same idea in every .cu: v1 one block per (sequence,
// KV head) over every slot, K/V tiles staged in shared memory; v3/v4 the register-resident loops):
//   window_decode_v1   attention (+ optional in-cache rotation, + optional mass) of one decode
//                      query per sequence over its slots
//   window_decode_v3   the same attention (no mass) in decode_v3.cuh's register-resident design
//   window_decode_v4   the same in decode_v4.cuh's loop: slot positions prefetched an iteration ahead
//
// Version log (llm.c style):
//   window_decode_v1: attend_tiles.cuh's scheme with a per-slot visibility and rank: one block of
//       G warps (one per query head) per (sequence, KV head); each tile of KEY_TILE = 32 slots is
//       loaded once for the group (invisible slots are never read: zero-filled), rotated in shared
//       memory when rope_mode != 0, scored lane j = slot j, folded by online_softmax::update.
//       The mass pass reloads K (and rotates again): 1.5x the bytes of the plain kernel.
//   window_decode_v3: decode_v3.cuh's design (D/8 lanes per key, 16-byte loads straight into
//       registers, the G queries in registers, no barrier in the key loop) with modular slot reads:
//       each key's position is read (4 bytes, the same word for the LANES lanes of a subgroup) before
//       its K/V; an invisible slot issues no K/V load (zero registers, score -inf). In-cache rotation
//       in registers: "interleaved" pairs lie inside a lane's 8 dims; "half" pairs dims d and d + D/2,
//       held by lanes l and l ^ LANES/2 of the same subgroup, exchanged by one shuffle per element.
//       One block per (sequence, KV head), no split-K yet (a window's C is small: W slots); the mass
//       variant stays v1's.
//   Measured: no GPU has run it yet. ptxas (nvcc 13.0, sm_80/sm_90, D 64/128, fp32/fp16 slots):
//       window_decode_v1 40-54 registers, 20736 (D=64) / 37120 (D=128) bytes static shared memory;
//       window_decode_v3 88-118 registers at G=1, 142-175 at G=4, 217-240 at G=8 (a first try held G=4
//       to 128 registers, __launch_bounds__(128, 4), and spilled 56 bytes on sm_90: hence 2 blocks/SM
//       from G=4); 0 spills, no stack frame anywhere; NVRTC compiles all 24 builds.
//       Fixed since: at head_dim 8 one lane holds a whole key (LANES = 1) and the 'half' rotation's partner
//       lane l ^ LANES/2 was the lane itself, so each dim rotated against itself (max |v3 - v1| = 0.33);
//       the pairs now lie inside the lane there. v3 runs through the key policy SlotKeys (decode_core.cuh)
//       like v4: ptxas 93-124 / 149-179 / 230-246 registers at G 1/4/8.
//   window_decode_v4: decode_v4.cuh's loop over SlotKeys: the positions of a warp's next slots loaded one
//       lane per slot an iteration ahead and shuffled to the lanes (a K/V load never waits for its
//       position), the next iteration's K/V in flight during this one's math, the transposed reduction,
//       the rescale skipped; 8 dims per lane and one key per buffer at G = 4, which keeps 4 blocks per SM
//       (128 registers, v3 needed 2 blocks per SM from G = 4); 2 keys at G = 1, 3 (fp16) and 8.
//       Predicted (results/gpu_model.json; B=64, W=4096, 32/8 heads, D=128, fp16, no rotation): 337 us,
//       78% of the copy, latency-bound (16 KB in flight per SM); v3 288 us, 91% (32 KB): the 4-blocks trim
//       costs bytes in flight at G = 4. ptxas: 112-128 registers at G=1, 128 at G=4, 241-255 at G=8;
//       0 spills. Measured: waits for a GPU (the first run decides between v3 and v4 here).
//
// Options (every version, last arguments): online_softmax.cuh's learned sink logits (sink_logits [Hq],
// use_sink_logits; gpt-oss; one block holds a whole row, so it starts from the sink) and softcap (Gemma 2).
// Not to be confused with `sinks`, StreamingLLM's count of always-visible sink *tokens*.
//
// nvcc-check: HEAD_DIM=64,128 CACHE_HALF=0,1 GQA_GROUP=1,3,4,8

#include "common.cuh"
#include "online_softmax.cuh"
#include "decode.cuh"  // decode::run, the v3 and v4 key loops

namespace window {

// The scalars every block needs.
struct Args {
    int n_heads, n_kv_heads, n_slots, window, sinks, rope_mode;
    float scale;
};

// Is the key at position k visible to the query at q (WindowPolicy.visible; W = 0: causal only)?
__device__ __forceinline__ bool visible(int k, int q, int w, int s) {
    return k >= 0 && k <= q && (w == 0 || k < s || q - k < w - s);
}

// The in-cache rank of a visible key at position k for the query at q (closed form, see the header).
__device__ __forceinline__ int rank_of(int k, int q, int w, int s) {
    if (w == 0 || k < s) return k;
    return s + k - max(s, q - (w - s) + 1);
}

// Rotate the HEAD_DIM floats of x (stride 1) at table row r, pair p of this thread only:
// (a, b) -> (a c - b s, b c + a s); "half" pairs (p, p + D/2), "interleaved" (2p, 2p + 1).
__device__ __forceinline__ void rotate_pair(float* x, int p, const float* cos_t, const float* sin_t, long long r,
                                            int rope_mode) {
    const int ia = rope_mode == 1 ? p : 2 * p, ib = rope_mode == 1 ? p + HEAD_DIM / 2 : 2 * p + 1;
    const float c = cos_t[r * (HEAD_DIM / 2) + p], s = sin_t[r * (HEAD_DIM / 2) + p];
    const float a = x[ia], b = x[ib];
    x[ia] = a * c - b * s;
    x[ib] = b * c + a * s;
}

// The tile's slot facts, written by threads < KEY_TILE: rank_s[j] = the key's rank, -1 = invisible.
__device__ __forceinline__ void tile_ranks(const int* pos_head, int k0, int q, const Args& a, int* rank_s) {
    const int j = threadIdx.x;
    if (j < KEY_TILE) {
        const int k = k0 + j < a.n_slots ? pos_head[k0 + j] : -1;
        rank_s[j] = visible(k, q, a.window, a.sinks) ? rank_of(k, q, a.window, a.sinks) : -1;
    }
}

// Load (and rotate) tile k0's visible keys (and values, if v_s) into shared memory; zeros elsewhere.
// All threads call it; it ends with a barrier, so the tile is ready to read.
__device__ __forceinline__ void load_tile(const cache_t* k, const cache_t* v, int k0, const int* rank_s,
                                          const Args& a, const float* cos_t, const float* sin_t,
                                          float (*k_s)[HEAD_DIM + 1], float (*v_s)[HEAD_DIM]) {
    for (int i = threadIdx.x; i < KEY_TILE * (HEAD_DIM / VEC); i += blockDim.x) {
        const int j = i / (HEAD_DIM / VEC), d = (i % (HEAD_DIM / VEC)) * VEC;
        float kf[VEC], vf[VEC];
        const bool vis = rank_s[j] >= 0;
        if (vis) {
            const long long row = (long long)(k0 + j) * HEAD_DIM + d;
            load8(k + row, kf);
            if (v_s) load8(v + row, vf);
        }
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
            k_s[j][d + e] = vis ? kf[e] : 0.0f;
            if (v_s) v_s[j][d + e] = vis ? vf[e] : 0.0f;
        }
    }
    __syncthreads();
    if (a.rope_mode == 0) return;
    for (int i = threadIdx.x; i < KEY_TILE * (HEAD_DIM / 2); i += blockDim.x) {
        const int j = i / (HEAD_DIM / 2), p = i % (HEAD_DIM / 2);
        if (rank_s[j] >= 0) rotate_pair(k_s[j], p, cos_t, sin_t, rank_s[j], a.rope_mode);
    }
    __syncthreads();
}

// This lane's scaled score against tile slot `lane` (-inf where invisible), soft-capped when softcap > 0;
// q_row in shared memory.
__device__ __forceinline__ float score_of(const float* q_row, const float (*k_s)[HEAD_DIM + 1], const int* rank_s,
                                          float scale, float softcap) {
    const int lane = threadIdx.x & 31;
    if (rank_s[lane] < 0) return -CUDART_INF_F;
    float dot = 0.0f;
#pragma unroll 8
    for (int d = 0; d < HEAD_DIM; ++d) dot += q_row[d] * k_s[lane][d];
    return online_softmax::soft_cap(dot * scale, softcap);
}

}  // namespace window

// ---------------------------------------------------------------------------
// window_decode_v1: out[b, h*G + g] = softmax over the visible slots of (b, h), one decode query each.
//
//   q:      [B, Hq, D] float32 (pre-RoPE when rope_mode != 0)      out: [B, Hq, D] float32
//   k, v:   [B, Hkv, C, D] CACHE_T slots                           pos: [B, Hkv, C] int32 (-1 empty)
//   q_pos:  [B] int32        cos_t, sin_t: [P, D/2] float32 (read iff rope_mode != 0; P > max rank)
//   mass:   [B, Hkv, C] float32, written iff want_mass (see the header)
//   options: sink_logits [Hq] float32 (learned sinks, read iff use_sink_logits; not the StreamingLLM sink
//          *tokens* `sinks`), softcap > 0 caps each scaled score (online_softmax.cuh); the mass is each
//          key's probability under the same softmax (the sink in its denominator)
//   grid  = (B, Hkv), block = (32*G): warp g owns query head h*G + g; dynamic shared G*D floats
//   bytes: reads 4*C per (b, h) of positions and 2*C_vis*D*sizeof(CACHE_T) of K/V (the visible
//          slots only; + C_vis*D*sizeof(CACHE_T) again with mass), 4*G*D of queries (+ 2*4*D/2 per
//          rotated key of tables); writes 4*Hq*D per sequence (+ 4*C*Hkv of mass)
// ---------------------------------------------------------------------------
extern "C" __global__ void window_decode_v1(const float* __restrict__ q, const cache_t* __restrict__ k,
                                            const cache_t* __restrict__ v, const int* __restrict__ pos,
                                            const int* __restrict__ q_pos, const float* __restrict__ cos_t,
                                            const float* __restrict__ sin_t, float* __restrict__ out,
                                            float* __restrict__ mass, int want_mass, int n_heads, int n_kv_heads,
                                            int n_slots, int window_size, int sinks, int rope_mode, float scale,
                                            const float* __restrict__ sink_logits, int use_sink_logits,
                                            float softcap) {
    __shared__ float k_s[KEY_TILE][HEAD_DIM + 1];            // +1 float per row: lane j reads row j bank-free
    __shared__ __align__(16) float v_s[KEY_TILE][HEAD_DIM];
    __shared__ int rank_s[KEY_TILE];
    __shared__ float p_s[32][KEY_TILE];                      // mass pass: one row per warp
    extern __shared__ float q_s[];                           // [G][D]
    const window::Args a{n_heads, n_kv_heads, n_slots, window_size, sinks, rope_mode, scale};
    const int b = blockIdx.x, h = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int group = n_heads / n_kv_heads, qp = q_pos[b];
    const long long head = (long long)b * n_kv_heads + h;  // (b, h) in [B, Hkv]
    const cache_t* k_head = k + head * n_slots * HEAD_DIM;
    const cache_t* v_head = v + head * n_slots * HEAD_DIM;
    const int* pos_head = pos + head * n_slots;
    const float* q_group = q + row_offset(b, n_heads, (long long)h * group);
    for (int i = threadIdx.x; i < group * HEAD_DIM; i += blockDim.x) q_s[i] = q_group[i];
    if (rope_mode != 0) {  // the query sits at its own rank
        __syncthreads();
        const int r = window::rank_of(qp, qp, window_size, sinks);
        for (int i = threadIdx.x; i < group * (HEAD_DIM / 2); i += blockDim.x)
            window::rotate_pair(q_s + (i / (HEAD_DIM / 2)) * HEAD_DIM, i % (HEAD_DIM / 2), cos_t, sin_t, r, rope_mode);
    }
    const float* q_row = q_s + warp * HEAD_DIM;
    const online_softmax::Options opt{sink_logits, use_sink_logits, softcap};
    online_softmax::State s = online_softmax::start(opt, h * group + warp, true);  // one block: the sink once
    for (int k0 = 0; k0 < n_slots; k0 += KEY_TILE) {
        __syncthreads();  // everyone is done with the previous tile (and the queries are written)
        window::tile_ranks(pos_head, k0, qp, a, rank_s);
        __syncthreads();
        window::load_tile(k_head, v_head, k0, rank_s, a, cos_t, sin_t, k_s, v_s);
        online_softmax::update(s, window::score_of(q_row, k_s, rank_s, scale, softcap), v_s);
    }
    online_softmax::finish(s, out + row_offset(b, n_heads, (long long)h * group + warp));
    if (!want_mass) return;  // block-uniform
    const float inv_l = s.l > 0.0f ? 1.0f / s.l : 0.0f;
    for (int k0 = 0; k0 < n_slots; k0 += KEY_TILE) {
        __syncthreads();
        window::tile_ranks(pos_head, k0, qp, a, rank_s);
        __syncthreads();
        window::load_tile(k_head, v_head, k0, rank_s, a, cos_t, sin_t, k_s, nullptr);
        const float sc = window::score_of(q_row, k_s, rank_s, scale, softcap);
        p_s[warp][lane] = sc == -CUDART_INF_F ? 0.0f : expf(sc - s.m) * inv_l;
        __syncthreads();
        if (threadIdx.x < KEY_TILE && k0 + threadIdx.x < n_slots) {
            float total = 0.0f;
            for (int g = 0; g < group; ++g) total += p_s[g][threadIdx.x];
            mass[head * n_slots + k0 + threadIdx.x] = total;
        }
    }
}

namespace window {

// Rotate a lane's DIMS dims x (dims d0 .. d0+DIMS-1) at table row r. "interleaved" (mode 2) pairs (2p, 2p+1)
// lie inside a lane; "half" (mode 1) pairs dims d and d + D/2: inside the lane when one lane holds the whole
// key (LANES = 1, head_dim = DIMS), else held by lanes l and l ^ LANES/2 of the subgroup and exchanged by
// one shuffle per element. Warp-collective in the second case: every lane calls it.
template <int DIMS>
__device__ __forceinline__ void rotate(float (&x)[DIMS], int d0, int r, const float* cos_t, const float* sin_t,
                                       int rope_mode) {
    constexpr int HALF = HEAD_DIM / 2, LANES = HEAD_DIM / DIMS;
    const float* c = cos_t + (long long)r * HALF;
    const float* s = sin_t + (long long)r * HALF;
    if (rope_mode == 2) {
#pragma unroll
        for (int i = 0; i < DIMS / 2; ++i) {
            const int p = d0 / 2 + i;
            const float a = x[2 * i], b = x[2 * i + 1];
            x[2 * i] = a * c[p] - b * s[p];
            x[2 * i + 1] = b * c[p] + a * s[p];
        }
    } else if (rope_mode == 1 && LANES == 1) {
#pragma unroll
        for (int p = 0; p < HALF; ++p) {
            const float a = x[p], b = x[p + HALF];
            x[p] = a * c[p] - b * s[p];
            x[p + HALF] = b * c[p] + a * s[p];
        }
    } else if (rope_mode == 1) {
        const bool low = d0 < HALF;
#pragma unroll
        for (int i = 0; i < DIMS; ++i) {
            const float other = __shfl_xor_sync(decode::FULL, x[i], LANES / 2 > 0 ? LANES / 2 : 1);
            const int p = (low ? d0 : d0 - HALF) + i;
            x[i] = low ? x[i] * c[p] - other * s[p] : x[i] * c[p] + other * s[p];
        }
    }
}

// One slot's loads: K and V (zero where invisible) and the key's rank (-1: invisible or empty).
template <int DIMS>
struct SlotRaw {
    decode::RawN<DIMS> k, v;
    int rank;
};

// The key policy of a window's slots (decode_core.cuh): slot j of (b, h) is row j, visible by its stored
// position (WindowPolicy.visible), rotated by its rank when the slots hold pre-RoPE keys. v3: each lane
// reads its slots' positions before their K/V; v4 (PREFETCH): the positions of a warp's next slots come one
// iteration ahead, one lane per slot, by shuffle, so a K/V load never waits for its position.
template <int DIMS_, int KEYS_, bool PREFETCH>
struct SlotKeys {
    static constexpr int DIMS = DIMS_, KEYS = KEYS_;
    using Raw = SlotRaw<DIMS>;
    const cache_t *k, *v;
    decode::Lookup<1, PREFETCH> pos;  // pos[b, h, :], n_slots entries
    const float *cos_t, *sin_t;
    Args a;
    int qp;

    __device__ __forceinline__ int ahead(int w0, int) const {
        return pos.ahead(w0, decode::warp_keys<DIMS, KEYS>());
    }
    __device__ __forceinline__ void load(int key, int k_end, int ahead_pos, int w0, int d0, Raw& r) const {
        const int kp = pos.at(key, ahead_pos, w0);  // every lane: a shuffle on the v4 path
        const bool vis = key < k_end && window::visible(kp, qp, a.window, a.sinks);
        r.rank = vis ? rank_of(kp, qp, a.window, a.sinks) : -1;
        const long long row = (long long)key * HEAD_DIM + d0;
        r.k = vis ? decode::load_raw_n<DIMS>(k + row) : decode::zero_raw_n<DIMS>();
        r.v = vis ? decode::load_raw_n<DIMS>(v + row) : decode::zero_raw_n<DIMS>();
    }
    __device__ __forceinline__ bool visible(const Raw& r) const { return r.rank >= 0; }
    __device__ __forceinline__ void key(const Raw& r, int d0, float (&f)[DIMS]) const {
        decode::unpack_n(r.k, f);
        rotate<DIMS>(f, d0, max(r.rank, 0), cos_t, sin_t, a.rope_mode);  // zeros stay zeros
    }
    __device__ __forceinline__ void value(const Raw& r, int, float (&f)[DIMS]) const { decode::unpack_n(r.v, f); }
    __device__ __forceinline__ void query(float (&q)[decode::G][DIMS], int d0) const {
        const int q_rank = rank_of(qp, qp, a.window, a.sinks);  // the query at its own rank
#pragma unroll
        for (int g = 0; g < decode::G; ++g) rotate<DIMS>(q[g], d0, q_rank, cos_t, sin_t, a.rope_mode);
    }
};

// v4 keeps 8 dims per lane here (the rank, rotation and positions cost registers over a plain row's), and
// one key per subgroup and buffer at G = 4 (and G = 3 over float32 slots: 140 bytes spilled at two), so that
// it fits 4 blocks per SM (128 registers); G = 1, G = 3 over fp16 and G = 8 (2 blocks per SM) hold two
// (but one at head_dim 8, where a warp takes 32 keys side by side: all its lanes).
constexpr int V4_KEYS = (decode::G == 1 || decode::G > 4 || (decode::G < 4 && CACHE_HALF)) && HEAD_DIM > VEC ? 2 : 1;

}  // namespace window

// Block (b, h) of window_decode_v3/v4: the group's query over every slot of (b, h) with loop V.
template <int V, int KEYS>
__device__ __forceinline__ void window_decode(const float* q, const cache_t* k, const cache_t* v, const int* pos,
                                              const int* q_pos, const float* cos_t, const float* sin_t, float* out,
                                              const window::Args& a, const online_softmax::Options& opt) {
    if (a.n_heads != GQA_GROUP * a.n_kv_heads) __trap();  // compiled for another group size: a launcher bug
    const long long head = (long long)blockIdx.x * a.n_kv_heads + blockIdx.y;
    window::SlotKeys<VEC, KEYS, !!(V == 4)> pol;
    pol.k = k + head * a.n_slots * HEAD_DIM, pol.v = v + head * a.n_slots * HEAD_DIM;
    pol.pos = {pos + head * a.n_slots, 1, a.n_slots};
    pol.cos_t = cos_t, pol.sin_t = sin_t, pol.a = a, pol.qp = q_pos[blockIdx.x];
    const long long row0 = (long long)blockIdx.x * a.n_heads + (long long)blockIdx.y * GQA_GROUP;
    const decode::Dest dest{out, nullptr, nullptr, nullptr, row0, 0, 1};
    decode::run<V>(pol, q + row0 * HEAD_DIM, a.scale, 0, a.n_slots, dest, opt, blockIdx.y * GQA_GROUP);
}

// The parameters of window_decode_v3 and _v4 (one list, so that the two kernels cannot drift apart).
#define WINDOW_DECODE_PARAMS                                                                                        \
    const float *__restrict__ q, const cache_t *__restrict__ k, const cache_t *__restrict__ v,                     \
        const int *__restrict__ pos, const int *__restrict__ q_pos, const float *__restrict__ cos_t,                \
        const float *__restrict__ sin_t, float *__restrict__ out, int n_heads, int n_kv_heads, int n_slots,        \
        int window_size, int sinks, int rope_mode, float scale, const float *__restrict__ sink_logits,             \
        int use_sink_logits, float softcap
#define WINDOW_DECODE_ARGS                                                                              \
    q, k, v, pos, q_pos, cos_t, sin_t, out,                                                             \
        window::Args{n_heads, n_kv_heads, n_slots, window_size, sinks, rope_mode, scale},               \
        online_softmax::Options{sink_logits, use_sink_logits, softcap}

// ---------------------------------------------------------------------------
// window_decode_v3: window_decode_v1's attention (no mass), register-resident (decode_v3.cuh).
//
//   arguments as window_decode_v1 without mass/want_mass (the options included); GQA_GROUP = G at compile time
//   grid  = (B, Hkv), block = (128): subgroups of D/8 lanes take keys sub, sub + SUBGROUPS, ...
//   bytes: reads 4*C per (b, h) of positions, 2*C_vis*D*sizeof(CACHE_T) of K/V, 4*G*D of queries
//          (+ 2*4*8 of tables per lane and rotated key); writes 4*G*D per (b, h)
// ---------------------------------------------------------------------------
// The per-key position, rank and rotation cost registers over decode_v3's: 4 blocks per SM (128
// registers) for G < 4 only, 2 from G = 4 (G = 4 spilled at 128 on sm_90).
extern "C" __global__ void __launch_bounds__(128, GQA_GROUP >= 4 ? 2 : 4) window_decode_v3(WINDOW_DECODE_PARAMS) {
    window_decode<3, decode_v3::ROW_KEYS>(WINDOW_DECODE_ARGS);
}

// ---------------------------------------------------------------------------
// window_decode_v4 (decode_v4.cuh): v3's work, arguments and outputs; each warp's next slot positions
// loaded an iteration ahead (one lane per slot, shuffled), the K/V loads of the next iteration in flight
// during this one's math, the transposed reduction and the skipped rescale; 8 dims and one key per lane
// and buffer, so that G <= 4 keeps 4 blocks per SM.
//
//   grid  = (B, Hkv), block = (128); bytes: as window_decode_v3
// ---------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(128, V4_BLOCKS_PER_SM(VEC)) window_decode_v4(WINDOW_DECODE_PARAMS) {
    window_decode<4, window::V4_KEYS>(WINDOW_DECODE_ARGS);
}
