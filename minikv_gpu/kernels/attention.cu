// attention.cu: step 1, attention without a cache (minikv/attention.py).
//
// Two versions, llm.c style:
//   v1  scores = q k^T * scale (xp.matmul), causal_softmax_v1 (below), out = probs v (xp.matmul).
//       The textbook: it materializes the [Hq, T, S] score matrix in device memory.
//   v2  causal_attention_v2 (below): one kernel, online softmax over tiles of keys, so the
//       scores never leave the chip (the FlashAttention idea without its matrix units).
//
// Shapes: q [B, Hq, T, D], k/v [B, Hkv, S, D], out [B, Hq, T, D], all float32, row-major.
// The T queries are the last T of the S positions ("bottom-right" causal mask): query t
// sees keys 0 .. S-T+t. GQA: query head h reads KV head h / (Hq/Hkv).
//
// nvcc-check: HEAD_DIM=64,128

#include <math_constants.h>  // CUDART_INF_F: NVRTC (CuPy) has no <math.h>, so no INFINITY

#ifndef HEAD_DIM
#define HEAD_DIM 64  // compile-time so that per-lane accumulators live in registers
#endif
#define KEY_TILE 32                       // keys per tile: lane j of a warp scores key j
#define ROWS_PER_BLOCK 4                  // query rows per block, one warp each
#define DIMS_PER_LANE ((HEAD_DIM + 31) / 32)

static_assert(HEAD_DIM % 8 == 0 && HEAD_DIM <= 128,
              "HEAD_DIM must be a multiple of 8, at most 128 (static shared memory stays under 48 KB)");

__device__ __forceinline__ float warp_max(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// Reduce over the whole block (max if is_max, else sum); every thread gets the result.
// scratch: 32 floats of shared memory. Two barriers; all threads of the block must call it.
__device__ float block_reduce(float v, float* scratch, bool is_max) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = (blockDim.x + 31) >> 5;
    v = is_max ? warp_max(v) : warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float r = is_max ? -CUDART_INF_F : 0.0f;
    for (int w = 0; w < n_warps; ++w) r = is_max ? fmaxf(r, scratch[w]) : r + scratch[w];
    __syncthreads();  // scratch may be reused by the next call
    return r;
}

// ---------------------------------------------------------------------------
// causal_softmax_v1: row softmax of scores x [R, S] with an optional bottom-right
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
extern "C" __global__ void causal_softmax_v1(const float* x, float* out, int n_rows, int T, int S, int causal) {
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
// causal_attention_v2: fused scaled-dot-product attention with online softmax.
//
//   grid  = (ceil(T / 4), Hq, B)   block (x, h, b) owns query rows 4x .. 4x+3 of head h
//   block = (128)                  warp w owns query row 4x + w
//   shared (static): q 4*D + K tile 32*(D+1) + V tile 32*D floats
//                    (D=64: 17.2 KB, D=128: 34.3 KB)
//   bytes: reads 4*B*Hq*T*D (q) + 2 * 4*B*Hq*ceil(T/4)*S_vis*D (K and V tiles, once per
//          block; S_vis <= S is what the block's last row sees), writes 4*B*Hq*T*D.
//          The four rows of a block share every K/V tile they load.
//
// Per tile of 32 keys, lane j computes the score of key j for its warp's row (the K tile
// row has D+1 floats so that 32 lanes reading 32 rows hit 32 different banks), the warp
// updates the running max m and sum l, rescales its accumulator by exp(m_old - m_new),
// and adds p_j * v_j with p_j broadcast by shuffle. Lane c owns output dims c, c+32, ...
// Keys beyond a row's limit score -inf and are never loaded (stale memory may be NaN).
// ---------------------------------------------------------------------------
extern "C" __global__ void causal_attention_v2(const float* __restrict__ q, const float* __restrict__ k,
                                               const float* __restrict__ v, float* __restrict__ out,
                                               int n_heads, int n_kv_heads, int T, int S, int causal,
                                               float scale) {
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
    const int row_limit = causal ? S - T + t + 1 : S;

    const long long q_row = (((long long)b * n_heads + head) * T + t) * HEAD_DIM;
    const long long kv_base = ((long long)b * n_kv_heads + kv_head) * S * HEAD_DIM;

    for (int d = lane; d < HEAD_DIM; d += 32) q_s[warp][d] = row_ok ? q[q_row + d] : 0.0f;

    float m = -CUDART_INF_F, l = 0.0f;
    float acc[DIMS_PER_LANE];
#pragma unroll
    for (int c = 0; c < DIMS_PER_LANE; ++c) acc[c] = 0.0f;

    for (int k0 = 0; k0 < block_limit; k0 += KEY_TILE) {
        __syncthreads();  // the previous tile is no longer being read
        // Cooperative load, 4 floats (16 bytes) per thread per step.
        for (int i = threadIdx.x; i < KEY_TILE * HEAD_DIM / 4; i += blockDim.x) {
            const int j = i / (HEAD_DIM / 4), d = (i % (HEAD_DIM / 4)) * 4;
            float4 kk = make_float4(0.f, 0.f, 0.f, 0.f), vv = kk;
            if (k0 + j < block_limit) {
                const long long off = kv_base + (long long)(k0 + j) * HEAD_DIM + d;
                kk = *reinterpret_cast<const float4*>(k + off);
                vv = *reinterpret_cast<const float4*>(v + off);
            }
            k_s[j][d] = kk.x; k_s[j][d + 1] = kk.y; k_s[j][d + 2] = kk.z; k_s[j][d + 3] = kk.w;
            *reinterpret_cast<float4*>(&v_s[j][d]) = vv;
        }
        __syncthreads();

        const int key = k0 + lane;
        float score = -CUDART_INF_F;
        if (row_ok && key < row_limit) {
            float dot = 0.0f;
#pragma unroll 8
            for (int d = 0; d < HEAD_DIM; ++d) dot += q_s[warp][d] * k_s[lane][d];
            score = dot * scale;
        }
        const float m_new = fmaxf(m, warp_max(score));
        if (m_new == -CUDART_INF_F) continue;  // nothing visible yet for this row (warp-uniform)
        const float p = expf(score - m_new);     // 0 for masked keys
        const float alpha = expf(m - m_new);     // 0 on the first visible tile (m = -inf)
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
    if (!row_ok) return;
    const float inv_l = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
    for (int c = 0; c < DIMS_PER_LANE; ++c) {
        const int d = lane + 32 * c;
        if (d < HEAD_DIM) out[q_row + d] = acc[c] * inv_l;
    }
}
