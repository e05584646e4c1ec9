// mla.cu: step 4, multi-head latent attention (minikv/mla/) on the GPU: the latent write and the
// absorbed decode attention, over either latent cache.
//
// Storage: one latent row [c_kv ; k_pe] of W = MLA_R + MLA_P elements per token and layer, of
// cache_t (float, or __half with CACHE_HALF=1):
//     contiguous  latent[layer, slot, 0, position, :]   [L, max_seqs, 1, max_len, W]
//     paged       pool[layer, block, offset, :]          [L, num_blocks, block_size, W]
// Both are addressed as rows of one layer's [rows, W] array. The host passes the write's 64-bit row
// per token (slot * max_len + pos, or the paged slot mapping), and for attention a block table:
// a contiguous cache is the paged case with one "block" of max_len rows per sequence (tables[b] =
// [slot], block_size = max_len), so one attention kernel serves both layouts.
//
// Absorbed decode (see minikv/mla/): every query head h scores the same W-wide latent row,
//     s_h(j) = q_abs[h] . latent[j],   q_abs[h] = [q_nope[h] W_UK[h]^T ; q_pe[h]]   (W numbers)
// and its value is the row's first R entries; out[h] = softmax(s_h) @ latent[:, :R] is [R] per
// head (the host applies W_UV after). MQA with one key head of width W and Hq query heads.
//
// Kernels (<op>_v<N>; N as in kv_cache.cu and paged.cu: v3 = the register-resident decode idea of
// decode_v3.cuh, v2's attention_reduce_v2 merges split partials):
//   latent_write_v1          new latents [N, W] float32 -> their cache rows (rounded for fp16)
//   mla_decode_attention_v3  absorbed attention of the step's queries over the latent rows
//   attention_reduce_v2      split_k.cuh's, with HEAD_DIM = the reduce chunk (see below)
//
// Version log (llm.c style):
//   latent_write_v1  one thread per 8 elements (two float4 loads, one 16-byte or two float4 stores).
//   mla_decode_attention_v3  first MLA attention kernel; there is no v1/v2 (shared-memory staged)
//       MLA kernel: the v3 design was known to be the one worth writing (DESIGN.md section 4).
//       Not yet timed on a GPU (no device in the session that wrote it). The estimate below says
//       it is compute-bound, not bandwidth-bound, at DeepSeek-V3's 128 heads.
//
// Compile-time sizes: MLA_R (kv_lora_rank) and MLA_P (qk_rope_head_dim), both multiples of 8 (the
// 16-byte loads and the value/RoPE boundary fall on whole 8-element vectors); MLA_HEADS_PER_WARP
// (1..4) query heads per warp. The Python side (minikv_gpu.mla.mla_defines) checks and refuses
// other sizes with a ConfigError naming them.

// nvcc-check: MLA_R=512 MLA_P=64 HEAD_DIM=128 CACHE_HALF=0,1 MLA_HEADS_PER_WARP=2
// nvcc-check: MLA_R=16 MLA_P=8 HEAD_DIM=16 CACHE_HALF=0,1 MLA_HEADS_PER_WARP=2

#include "common.cuh"
#include "split_k.cuh"

#ifndef MLA_R
#define MLA_R 512
#endif
#ifndef MLA_P
#define MLA_P 64
#endif
#ifndef MLA_HEADS_PER_WARP
#define MLA_HEADS_PER_WARP 2
#endif

namespace mla {

constexpr int R = MLA_R, P = MLA_P, W = MLA_R + MLA_P;   // the docs' r (kv_lora_rank), dr (RoPE dim), Dl = r + dr
constexpr int VECS = W / VEC;                    // 8-element vectors per latent row (DeepSeek-V3: 72)
constexpr int VALUE_VECS = R / VEC;              // ... of them values (64)
constexpr int QCH = (VECS + 31) / 32;            // vectors per lane: lane l holds l, l + 32, ... (3)
constexpr int VCH = (VALUE_VECS + 31) / 32;      // ... of which values (2)
constexpr int G = MLA_HEADS_PER_WARP;
constexpr int WARPS = 8;
constexpr int THREADS = 32 * WARPS;
constexpr int UNROLL = (CACHE_HALF && G == 1) ? 2 : 1;  // keys in flight per warp per iteration (2 spills at G=2)
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

static_assert(R % VEC == 0 && P % VEC == 0 && R > 0, "MLA_R and MLA_P must be multiples of 8");
static_assert(R % HEAD_DIM == 0, "HEAD_DIM (the reduce chunk) must divide MLA_R");
static_assert(G >= 1 && G <= 4, "MLA_HEADS_PER_WARP: 1..4 query heads per warp (registers)");

// Raw8, load_raw, zero_raw, unpack: common.cuh (8 elements loaded now, converted when used).

__device__ __forceinline__ float exp2_shifted(float x, float shift) {
    return exp2f(x - (shift == -CUDART_INF_F ? 0.0f : shift));  // never -inf - -inf
}

// a . b over one 8-element vector (a query vector against a key vector).
__device__ __forceinline__ float dot8(const float* a, const float* b) {
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < VEC; ++i) s += a[i] * b[i];
    return s;
}

// y += a * x over one 8-element vector (a value vector into an accumulator).
__device__ __forceinline__ void axpy8(float* y, float a, const float* x) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) y[i] += a * x[i];
}

}  // namespace mla

// ---------------------------------------------------------------------------
// latent_write_v1: cache[rows[n], :] = latent_new[n, :] for every n with rows[n] >= 0.
//
//   latent_new: [N, W] float32;  cache: one layer's [rows, W] (contiguous [max_seqs*max_len, W] or
//   paged [num_blocks*block_size, W]);  rows: [N] int64 row per token (-1: skip, padding)
//   grid = ceil(N * W/8 / 256), block = 256: thread i stores vector i % (W/8) of token i / (W/8)
//   bytes: reads 4*N*W + 8*N, writes N*W*sizeof(cache_t)
// ---------------------------------------------------------------------------
extern "C" __global__ void latent_write_v1(const float* __restrict__ latent_new, cache_t* __restrict__ cache,
                                           const long long* __restrict__ rows, int n_tokens) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n_tokens * mla::VECS) return;
    const long long n = i / mla::VECS, vec = i % mla::VECS;
    const long long row = rows[n];
    if (row < 0) return;
    float f[VEC];
    load8(latent_new + n * mla::W + vec * VEC, f);
    store8(cache + row * mla::W + vec * VEC, f);
}

// ---------------------------------------------------------------------------
// mla_decode_attention_v3: out[n, h, :R] = softmax_j(scale * q_abs[n, h] . latent[j]) @ latent[j, :R]
// over keys j = 0 .. token_pos[n] of sequence token_seq[n].
//
//   q_abs: [N, Hq, W] float32 (not yet scaled);  cache: one layer's [rows, W] cache_t
//   tables: [B, max_blocks] int32 block ids (contiguous: [B, 1] slots, block_size = max_len);
//   token_seq, token_pos: [N] int32;  out: [N, Hq, R] float32 (unsplit)
//   partials (n_splits > 1), split_k.cuh's layout with the R values cut into C = R / RD chunks of
//   RD = HEAD_DIM (the reduce's; the largest of 128, 64, .., 8 dividing R) so attention_reduce_v2 runs unchanged over Hq*C "heads":
//       part_m, part_l [N, Hq*C, Z] (the same m, l written for each chunk), part_acc [N, Hq*C, Z, RD]
//
//   grid  = (N, ceil(Hq / (8 * G)), Z), block = 256 threads (8 warps), G = MLA_HEADS_PER_WARP.
//   Warp w of block (n, b, z) serves query heads (8b + w) * G .. + G - 1 over split z's keys; a warp
//   whose heads are all >= Hq returns at once. No shared memory, no barrier: warps are independent.
//   lanes     a key's W/8 vectors are spread over the 32 lanes of the warp (lane l: vectors l, l+32,
//             ...; DeepSeek-V3: 72 vectors, lanes 0..7 take 3, the others 2), one 16-byte load each
//             (two for float); all lanes of the warp work on the same key;
//   queries   each lane keeps its vectors of the G queries in registers (times scale * log2 e) and
//             an accumulator for its value vectors: G * 8 * (QCH + VCH) floats (DeepSeek-V3, G = 2:
//             80) plus UNROLL keys of loads in flight (fp16: 2 keys x 3 x 16 B);
//   reduce    the partial dots are summed over the warp by __shfl_xor_sync (5 steps per key and
//             head); every lane then holds the score and runs the same online softmax (m, l);
//   sharing   the 8 warps of a block read the same rows in the same order, so after the first
//             warp they hit L1; blocks of other head groups of the same token re-read them from L2.
//   bytes: reads per token ctx * W * sizeof(cache_t) from HBM once (ceil(Hq/(8G)) times from L2),
//          4*Hq*W of queries; writes 4*Hq*R (unsplit) or 4*Hq*Z*(R + 2C) of partials.
//   work:  Hq * (W + R) multiply-adds per key: DeepSeek-V3 (Hq = 128, W = 576, R = 512) does 139 k
//          FMAs per 1152-byte fp16 row, about 240 flop/byte: far past an H200's fp32 CUDA-core ridge
//          (~67 Tflop/s over 4.8 TB/s, ~14 flop/byte). On CUDA cores (no mma here) this kernel is
//          compute-bound at that head count; the register design still matters for small Hq.
// Masking: keys past k_end are never loaded (zero registers, score -inf, probability 0).
// ---------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(256, 2)
    mla_decode_attention_v3(const float* __restrict__ q_abs, const cache_t* __restrict__ cache,
                            const int* __restrict__ tables, const int* __restrict__ token_seq,
                            const int* __restrict__ token_pos, float* __restrict__ out,
                            float* __restrict__ part_m, float* __restrict__ part_l, float* __restrict__ part_acc,
                            int n_heads, int block_size, int max_blocks, int keys_per_split, int n_splits,
                            float scale) {
    using namespace mla;
    const int n = blockIdx.x, z = blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int h0 = (blockIdx.y * WARPS + warp) * G;
    const int k_end_all = token_pos[n] + 1;
    const int k_begin = z * keys_per_split, k_end = min(k_end_all, k_begin + keys_per_split);
    if (h0 >= n_heads || k_begin >= k_end) return;  // warp-uniform: the whole warp leaves
    const int* table = tables + (long long)token_seq[n] * max_blocks;

    float q[G][QCH][VEC], acc[G][VCH][VEC], m[G], l[G];
    const float qs = scale * LOG2E;
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const int h = min(h0 + g, n_heads - 1);  // a missing head repeats the last one, never written
        const float* qrow = q_abs + ((long long)n * n_heads + h) * W;
#pragma unroll
        for (int c = 0; c < QCH; ++c) {
            const int v = lane + 32 * c;
#pragma unroll
            for (int i = 0; i < VEC; ++i) q[g][c][i] = v < VECS ? qrow[v * VEC + i] * qs : 0.0f;
        }
#pragma unroll
        for (int c = 0; c < VCH; ++c) {
#pragma unroll
            for (int i = 0; i < VEC; ++i) acc[g][c][i] = 0.0f;
        }
        m[g] = -CUDART_INF_F;
        l[g] = 0.0f;
    }

    for (int base = k_begin; base < k_end; base += UNROLL) {  // warp-uniform trip count
        Raw8 raw[UNROLL][QCH];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {  // every load of the iteration before the first use
            const int key = base + u;
            const cache_t* row = cache;
            if (key < k_end) row += ((long long)table[key / block_size] * block_size + key % block_size) * W;
#pragma unroll
            for (int c = 0; c < QCH; ++c) {
                const int v = lane + 32 * c;
                raw[u][c] = (key < k_end && v < VECS) ? load_raw(row + v * VEC) : zero_raw();
            }
        }
        float sc[UNROLL][G];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
            for (int g = 0; g < G; ++g) sc[u][g] = 0.0f;
#pragma unroll
            for (int c = 0; c < QCH; ++c) {
                float f[VEC];
                unpack(raw[u][c], f);
#pragma unroll
                for (int g = 0; g < G; ++g) sc[u][g] += mla::dot8(q[g][c], f);
            }
        }
        subgroup_sum<32>(sc);
        float p[UNROLL][G];
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float mx = m[g];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                if (base + u >= k_end) sc[u][g] = -CUDART_INF_F;
                mx = fmaxf(mx, sc[u][g]);
            }
            const float alpha = exp2_shifted(m[g], mx);
            float sum = 0.0f;
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                p[u][g] = exp2_shifted(sc[u][g], mx);
                sum += p[u][g];
            }
            l[g] = l[g] * alpha + sum;
            m[g] = mx;
#pragma unroll
            for (int c = 0; c < VCH; ++c) {
#pragma unroll
                for (int i = 0; i < VEC; ++i) acc[g][c][i] *= alpha;
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {  // the value vectors are the row's first R/8: c < VCH
#pragma unroll
            for (int c = 0; c < VCH; ++c) {
                float f[VEC];
                unpack(raw[u][c], f);
#pragma unroll
                for (int g = 0; g < G; ++g) mla::axpy8(acc[g][c], p[u][g], f);
            }
        }
    }

    constexpr int RD = HEAD_DIM, C = R / RD;  // the reduce's chunk (static_assert below)
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const int h = h0 + g;
        if (h >= n_heads) break;
        const long long head = (long long)n * n_heads + h;
#pragma unroll
        for (int c = 0; c < VCH; ++c) {
            const int v = lane + 32 * c;
            if (v >= VALUE_VECS) break;
            float f[VEC];
            if (n_splits == 1) {
#pragma unroll
                for (int i = 0; i < VEC; ++i) f[i] = l[g] > 0.0f ? acc[g][c][i] / l[g] : 0.0f;
                store8(out + head * R + v * VEC, f);
            } else {
                const int d = v * VEC;
                const long long p = (head * C + d / RD) * n_splits + z;
                store8(part_acc + p * RD + d % RD, acc[g][c]);
            }
        }
        for (int k = lane; n_splits > 1 && k < C; k += 32) {
            const long long p = (head * C + k) * n_splits + z;
            part_m[p] = m[g] * LN2;  // natural-log units, as attention_reduce_v2 reads them
            part_l[p] = l[g];
        }
    }
}
