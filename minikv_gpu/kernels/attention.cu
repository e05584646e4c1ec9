// attention.cu: step 1, attention without a cache (minikv/attention.py).
//
// Shapes: q [B, Hq, T, D], k/v [B, Hkv, S, D], out [B, Hq, T, D], all float32, row-major.
// The T queries are the last T of the S positions ("bottom-right" causal mask): query t
// sees keys 0 .. S-T+t. GQA: query head h reads KV head h / (Hq/Hkv).
//
// Kernels (<op>_v<N>; the same N means the same idea in every .cu: v0 the textbook, which materializes
// the scores; v1 one block per unit of work over its whole key range; v2 split-K + the shared reduce;
// v3/v4 the register-resident decode loops, which this step, with no cache, has no use for):
//   causal_softmax_v0    row softmax with the causal mask, for the textbook path
//                        (minikv_gpu.attention.causal_attention(version=0): scores = q k^T * scale
//                        by xp.matmul, this kernel, out = probs v by xp.matmul); it materializes
//                        the [Hq, T, S] score matrix in device memory.
//   causal_attention_v1  one kernel, online softmax over tiles of keys, so the scores never leave
//                        the chip (the FlashAttention idea without its matrix units); the fused
//                        path, causal_attention(version=1), the default. The key loop is
//                        attend_tiles.cuh's, the softmax online_softmax.cuh's, shared with
//                        kv_cache.cu and paged.cu.
//
// Version log (llm.c style):
//   causal_softmax_v0    the textbook: max pass, exp pass, normalize pass, block reductions. (It was
//                        causal_softmax_v1, selected by version=1, while the fused kernel was picked by
//                        version=2: now version=N runs the kernels named _vN, as in every other file.)
//   causal_attention_v1  (was causal_attention_v2 before the kernels were first renumbered.) Now through
//                        the shared core (attend_tiles.cuh, online_softmax.cuh); registers unchanged by it.
// Measured: no GPU has run these kernels yet. ptxas (benchmarks/results/nvcc_report.json, nvcc
// 13.0, D=64/128, sm_80/sm_90): causal_softmax_v0 27-28 registers, causal_attention_v1 32-38
// registers; 0 spills, no stack frame.
//
// nvcc-check: HEAD_DIM=64,128

#include "attend_tiles.cuh"  // common.cuh (sizes, loads, reductions), online_softmax.cuh

#define ROWS_PER_BLOCK 4  // query rows per block of causal_attention_v1, one warp each

// ---------------------------------------------------------------------------
// causal_softmax_v0: row softmax of scores x [R, S] with an optional bottom-right
// causal mask; row r is query t = r % T. Masked entries become exactly 0. A row whose
// maximum is not finite (e.g. all -inf) is shifted by 0 instead, and a row summing to 0
// returns zeros, as minikv.attention.softmax does.
//
//   grid  = (R)         one block per row
//   block = (128)
//   shared: 32 floats, static
//   bytes: reads 4*R*S twice (max pass, exp pass; the second mostly from L1/L2),
//          writes 4*R*S twice (exp values, then normalized). out may alias x.
// ---------------------------------------------------------------------------
extern "C" __global__ void causal_softmax_v0(const float* x, float* out, int n_rows, int T, int S, int causal) {
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    if (row >= n_rows) return;
    const int t = row % T;
    const int limit = causal ? S - T + t + 1 : S;  // keys 0 .. limit-1 are visible
    const float* xr = x + (long long)row * S;
    float* outr = out + (long long)row * S;

    float m = -CUDART_INF_F;
    for (int j = threadIdx.x; j < limit; j += blockDim.x) m = fmaxf(m, xr[j]);
    m = block_reduce(m, scratch, true);
    if (!isfinite(m)) m = 0.0f;  // fully masked row: avoid inf - inf

    float s = 0.0f;
    for (int j = threadIdx.x; j < S; j += blockDim.x) {
        const float e = j < limit ? expf(xr[j] - m) : 0.0f;
        outr[j] = e;
        s += e;
    }
    s = block_reduce(s, scratch, false);
    const float denom = s == 0.0f ? 1.0f : s;
    for (int j = threadIdx.x; j < S; j += blockDim.x) outr[j] = outr[j] / denom;
}

// ---------------------------------------------------------------------------
// causal_attention_v1: fused scaled-dot-product attention with online softmax.
//
//   grid  = (ceil(T / 4), Hq, B)   block (x, h, b) owns query rows 4x .. 4x+3 of head h
//   block = (128)                  warp w owns query row 4x + w
//   shared (static): q 4*D + K tile 32*(D+1) + V tile 32*D floats
//                    (D=64: 17.2 KB, D=128: 34.3 KB)
//   bytes: reads 4*B*Hq*T*D (q) + 2 * 4*B*Hq*ceil(T/4)*S_vis*D (K and V tiles, once per
//          block; S_vis <= S is what the block's last row sees), writes 4*B*Hq*T*D.
//          The four rows of a block share every K/V tile they load.
//
// Per tile of 32 keys, lane j computes the score of key j for its warp's row, and
// online_softmax::update folds the tile into the warp's state (m, l, acc); lane c owns output
// dims c, c+32, ... Keys beyond a row's limit score -inf; keys beyond the block's last row's
// limit are never loaded (stale memory may be NaN).
//   options: sinks [Hq] float32 learned sink logits (read iff use_sinks; one block holds a whole row, so
//            it starts from its sink), softcap > 0 caps each scaled score (online_softmax.cuh)
// ---------------------------------------------------------------------------
extern "C" __global__ void causal_attention_v1(const float* __restrict__ q, const float* __restrict__ k,
                                               const float* __restrict__ v, float* __restrict__ out,
                                               int n_heads, int n_kv_heads, int T, int S, int causal,
                                               float scale, const float* __restrict__ sinks, int use_sinks,
                                               float softcap) {
    __shared__ float q_s[ROWS_PER_BLOCK][HEAD_DIM];
    __shared__ float k_s[KEY_TILE][HEAD_DIM + 1];  // +1: conflict-free column reads
    __shared__ __align__(16) float v_s[KEY_TILE][HEAD_DIM];  // float4 stores: 16-byte aligned rows

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int head = blockIdx.y, b = blockIdx.z;
    const int kv_head = head / (n_heads / n_kv_heads);
    const int t = blockIdx.x * ROWS_PER_BLOCK + warp;  // this warp's query row
    const bool row_ok = t < T;
    const int t_last = min((int)(blockIdx.x + 1) * ROWS_PER_BLOCK, T) - 1;
    const int block_limit = causal ? S - T + t_last + 1 : S;  // the most keys any row here sees
    const int row_limit = row_ok ? (causal ? S - T + t + 1 : S) : 0;

    const long long q_row = row_offset((long long)b * n_heads + head, T, t);
    for (int d = lane; d < HEAD_DIM; d += 32) q_s[warp][d] = row_ok ? q[q_row + d] : 0.0f;

    DenseRows rows{row_offset((long long)b * n_kv_heads + kv_head, S, 0)};
    online_softmax::State st = online_softmax::start(online_softmax::Options{sinks, use_sinks, softcap}, head, true);
    attend_tiles(k, v, rows, 0, block_limit, row_limit, q_s[warp], k_s, v_s, scale, st, softcap);
    if (row_ok) online_softmax::finish(st, out + q_row);
}
