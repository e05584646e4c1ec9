// quant.cu: step 5, the quantized paged KV cache (minikv/quant/) on the GPU.
//
// Storage (one layer; the cache keeps [L, ...] and passes a layer's contiguous view):
//   k_pool, v_pool    [num_blocks, block_size, Hkv, D] CACHE_T   the residual: open blocks in full precision
//   k_codes, v_codes  [num_blocks, block_bytes] uint8            full blocks, minikv.quant_codecs' bytes
// A per-token side stores block b, token t, KV head h as one row of ROW_BYTES = D/GROUP records at
// codes[b] + (t*Hkv + h) * ROW_BYTES; kivi2's keys store channel c = h*D + d of block b as
// block_size/GROUP records of GROUP tokens at codes[b] + c * (block_size/GROUP) * CH_RECORD
// (minikv.quant.Side's "channel" axis). QCODEC selects the format (kv_dtype: K / V):
//   0  int8   q8_0 / q8_0      GROUP 32: fp16 d = amax/127, 32 x int8 roundf(x * (1/d))
//   1  fp8    e4m3fn / e4m3fn  GROUP | D, 8 | GROUP: fp16 s = amax/448, GROUP x e4m3fn(clip(x * (1/s)))
//   2  kivi2  asym2 per channel (GROUP tokens) / asym2 per token (GROUP channels): fp16 s = (max-min)/3,
//             fp16 z = min, 2-bit clip(roundf((x - z) * (1/s)), 0, 3), value i at bits 2*(i%4) of byte i/4
//   3  int4   q4_0 / q4_0      GROUP 32: fp16 d = max/-8, byte i = q[i] | q[i+16] << 4, q = trunc(x/d + 8.5)
// All bit-exact against minikv.quant_codecs' encode: the same float32 operations in the same order
// (a float32 scale and its float32 reciprocal, 0 for a zero scale; fp8/asym2 quantize with the fp16-
// rounded scale, q8_0/q4_0 with the float32 one), roundf (ties away from zero, exact) where NumPy uses
// round_half_away, truncf for q4_0, __float2half_rn (nearest even) for the fp16 scales, saturation at
// +-448 before a nearest-even fp8 cast written by bit manipulation; __fmul_rn where an FMA could form.

// Kernels (<op>_v<N>; N as in every .cu: v1 the plain version, v3 the register-resident decode design):
//   quantize_blocks_v1          encode the blocks a step fills (K and V of one layer), from the residual
//   quant_decode_attention_v3   attention over codes (full blocks) and the residual (the open block),
//                               dequantized in registers; split partials for paged.cu's attention_reduce_v2
//
// Version log (llm.c style):
//   quantize_blocks_v1: one thread per record (GROUP values of one token and head), K and V;
//       a few blocks per step, so simple beats fast here.
//   quant_decode_attention_v3: decode_v3.cuh's design with a codec loader: D/8 lanes per key, each
//       lane dequantizes its 8 values (one record's scale and 8 codes) in registers, all G queries
//       of the group in registers, online softmax per subgroup, decode_v3::finish for the merge.
//       A key of block j is read from the codes iff the block is full at the row's position,
//       (j+1)*block_size <= pos+1 (minikv.quant.cache.QuantizedStore's rule), else from the residual pool.
//       Loss, known: a 34-byte record (q8_0, fp8 group 32) leaves the codes 2-byte aligned, so a lane
//       reads its 8 codes as four 2-byte loads plus one for the scale instead of one 16-byte load.
//       The bytes read are what counts for a bandwidth-bound kernel, but the load count is 5x.
//       kivi2's keys cost more: each of a lane's 8 channels is its own record (scale, zero, one code
//       byte: 8 x 3 small loads per key, the records of G consecutive tokens hitting L1); int4 (18-byte
//       q4_0 records) reads 8 nibbles as four 2-byte loads.
//   Measured: no GPU has run these kernels yet. ptxas (nvcc 13.0, sm_80/sm_90, the nvcc-check set):
//       quant_decode_attention_v3 72-102 registers at G=1, 119-128 at G=4, 186-244 at G=8;
//       quantize_blocks_v1 31-70; 0 spills, no stack frame; NVRTC compiles all 96 builds.
//
// nvcc-check: HEAD_DIM=64,128 CACHE_HALF=0,1 GQA_GROUP=1,4,8 QCODEC=0,1,2,3

#include "decode_v3.cuh"  // common.cuh, decode_v3::State / merge_into / finish / exp2_shifted

#ifndef QCODEC
#define QCODEC 0
#endif
#ifndef GROUP
#define GROUP 32
#endif

#define K_CHANNEL (QCODEC == 2)  // kivi2: keys per channel, groups of GROUP tokens of a block
// A per-token record: GROUP values of one token and KV head along D.
#if QCODEC == 0 || QCODEC == 1
#define TOK_RECORD (2 + GROUP)       // fp16 scale, GROUP one-byte codes
#elif QCODEC == 2
#define TOK_RECORD (4 + GROUP / 4)   // fp16 scale, fp16 zero, GROUP two-bit codes
#else
#define TOK_RECORD (2 + GROUP / 2)   // q4_0: fp16 d, 16 bytes of nibbles
#endif
#define ROW_BYTES (HEAD_DIM / GROUP * TOK_RECORD)  // one token and KV head
#define CH_RECORD (4 + GROUP / 4)                  // kivi2's keys: one channel, GROUP tokens

static_assert(GROUP % VEC == 0 && HEAD_DIM % GROUP == 0, "GROUP must be a multiple of 8 that divides HEAD_DIM");
static_assert((QCODEC != 0 && QCODEC != 3) || GROUP == 32, "q8_0 and q4_0 are llama.cpp's blocks of 32 values");

namespace quant {

// float32 (|x| <= 448, not NaN) -> OCP E4M3FN, round to nearest even (ml_dtypes' cast after the clip).
__device__ __forceinline__ unsigned int e4m3_of(float x) {
    const unsigned int sign = (__float_as_uint(x) >> 31) << 7;
    const float a = fabsf(x);
    if (a < 0.015625f) return sign | (unsigned int)rintf(a * 512.0f);  // subnormal step 2^-9; 8 is 2^-6
    const unsigned int bits = __float_as_uint(a);
    unsigned int code = ((((bits >> 23) & 0xFFu) - 120u) << 3) | ((bits >> 20) & 7u);  // bias 127 -> 7
    const unsigned int rest = bits & 0xFFFFFu, half = 0x80000u;
    if (rest > half || (rest == half && (code & 1u))) ++code;  // a carry moves into the exponent, as it should
    return sign | code;
}

// E4M3FN code -> float32 (exact; 0x7F/0xFF, NaN, is never written by the encoder).
__device__ __forceinline__ float e4m3_value(unsigned int c) {
    const unsigned int e = (c >> 3) & 15u, m = c & 7u;
    const float a = e ? __uint_as_float(((e + 120u) << 23) | (m << 20)) : (float)m * 0.001953125f;
    return (c & 0x80u) ? -a : a;
}

__device__ __forceinline__ float as_float(float x) { return x; }
__device__ __forceinline__ float as_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float fp16_round(float x) { return __half2float(__float2half_rn(x)); }
__device__ __forceinline__ float fp16_at(const unsigned char* p) {
    return __half2float(__ushort_as_half(*reinterpret_cast<const unsigned short*>(p)));
}
__device__ __forceinline__ void put_fp16(unsigned char* dst, float x) {
    const unsigned int hs = __half_as_ushort(__float2half_rn(x));
    dst[0] = (unsigned char)(hs & 0xFFu);
    dst[1] = (unsigned char)(hs >> 8);
}
__device__ __forceinline__ float inverse(float d) { return d == 0.0f ? 0.0f : 1.0f / d; }

// q8_0 (fp8 = false) or fp8 e4m3fn: GROUP values src[i * stride] -> 2 + GROUP bytes at dst.
__device__ __forceinline__ void encode_scaled(const cache_t* src, bool fp8, unsigned char* dst) {
    float amax = 0.0f;
    for (int i = 0; i < GROUP; ++i) amax = fmaxf(amax, fabsf(as_float(src[i])));
    float d = amax / (fp8 ? 448.0f : 127.0f);
    if (fp8) d = fp16_round(d);  // fp8 quantizes with the stored fp16 scale, q8_0 with the float32 one
    const float inv = inverse(d);
    put_fp16(dst, d);
    for (int i = 0; i < GROUP; ++i) {
        const float y = as_float(src[i]) * inv;
        dst[2 + i] = fp8 ? (unsigned char)e4m3_of(fminf(fmaxf(y, -448.0f), 448.0f))        // saturate, cast
                         : (unsigned char)(signed char)(int)roundf(y);                        // ties away, as ggml
    }
}

// asym 2-bit (KIVI): GROUP values src[i * stride] -> fp16 s, fp16 z, GROUP/4 bytes (value i at bits 2*(i%4)).
__device__ __forceinline__ void encode_asym2(const cache_t* src, long long stride, unsigned char* dst) {
    float lo = CUDART_INF_F, hi = -CUDART_INF_F;
    for (int i = 0; i < GROUP; ++i) {
        const float x = as_float(src[i * stride]);
        lo = fminf(lo, x);
        hi = fmaxf(hi, x);
    }
    const float s = fp16_round((hi - lo) / 3.0f), z = fp16_round(lo), inv = inverse(s);
    put_fp16(dst, s);
    put_fp16(dst + 2, z);
    for (int b = 0; b < GROUP / 4; ++b) {
        unsigned int byte = 0;
        for (int j = 0; j < 4; ++j) {
            const float q = fminf(fmaxf(roundf((as_float(src[(4 * b + j) * stride]) - z) * inv), 0.0f), 3.0f);
            byte |= (unsigned int)q << (2 * j);
        }
        dst[4 + b] = (unsigned char)byte;
    }
}

// q4_0 (llama.cpp): 32 values -> fp16 d = max/-8 (signed largest |x|, first on ties), 16 bytes
// q[i] | q[i+16] << 4 with q = min(trunc(x * (1/d) + 8.5), 15) (no FMA: the product is rounded first).
__device__ __forceinline__ void encode_q4_0(const cache_t* src, unsigned char* dst) {
    float big = as_float(src[0]), amax = fabsf(big);  // the first index wins a tie, as np.argmax
    for (int i = 1; i < GROUP; ++i) {
        const float x = as_float(src[i]);
        if (fabsf(x) > amax) {
            amax = fabsf(x);
            big = x;
        }
    }
    const float d = big / -8.0f, inv = inverse(d);
    put_fp16(dst, d);
    for (int i = 0; i < GROUP / 2; ++i) {
        const unsigned int a = (unsigned int)fminf(truncf(__fmul_rn(as_float(src[i]), inv) + 8.5f), 15.0f);
        const unsigned int b = (unsigned int)fminf(truncf(__fmul_rn(as_float(src[i + 16]), inv) + 8.5f), 15.0f);
        dst[2 + i] = (unsigned char)(a | (b << 4));
    }
}

// One per-token record (GROUP consecutive values) of the codec.
__device__ __forceinline__ void encode_token_record(const cache_t* src, unsigned char* dst) {
#if QCODEC == 0 || QCODEC == 1
    encode_scaled(src, QCODEC == 1, dst);
#elif QCODEC == 2
    encode_asym2(src, 1, dst);
#else
    encode_q4_0(src, dst);
#endif
}

}  // namespace quant

// ---------------------------------------------------------------------------
// quantize_blocks_v1: codes[blocks[i]] = encode(pool[blocks[i]]) for K and V of one layer.
//
//   k_pool, v_pool:   [num_blocks, block_size, Hkv, D] CACHE_T (the residual rows, all written)
//   k_codes, v_codes: [num_blocks, block bytes] uint8: per token [block_size, Hkv, ROW_BYTES];
//                     kivi2's keys per channel [Hkv, D, block_size/GROUP, CH_RECORD]
//   blocks:           [M] int32, the blocks this step fills (distinct)
//   grid  = (M, ceil(R / 128)), block = (128): thread r encodes K record r and V record r
//           (R = block_size*Hkv*D/GROUP records per side; the same count for both layouts)
//   bytes: reads 2 * M * block_size*Hkv*D*sizeof(CACHE_T), writes M * (K + V block bytes)
// ---------------------------------------------------------------------------
extern "C" __global__ void quantize_blocks_v1(const cache_t* __restrict__ k_pool, const cache_t* __restrict__ v_pool,
                                              unsigned char* __restrict__ k_codes,
                                              unsigned char* __restrict__ v_codes, const int* __restrict__ blocks,
                                              int block_size, int n_kv_heads) {
    const long long records = (long long)block_size * n_kv_heads * (HEAD_DIM / GROUP);
    const long long r = (long long)blockIdx.y * blockDim.x + threadIdx.x;
    if (r >= records) return;
    const long long b = blocks[blockIdx.x];
    const long long values = b * records * GROUP;  // the block's first element
    quant::encode_token_record(v_pool + values + r * GROUP, v_codes + b * records * TOK_RECORD + r * TOK_RECORD);
#if K_CHANNEL
    const int per_channel = block_size / GROUP;
    const long long chan = r / per_channel, j = r % per_channel;  // chan = h * D + d
    quant::encode_asym2(k_pool + values + j * GROUP * n_kv_heads * HEAD_DIM + chan, (long long)n_kv_heads * HEAD_DIM,
                        k_codes + b * records * CH_RECORD + r * CH_RECORD);
#else
    quant::encode_token_record(k_pool + values + r * GROUP, k_codes + b * records * TOK_RECORD + r * TOK_RECORD);
#endif
}

namespace quant {

using decode_v3::G;
using decode_v3::LANES;
using decode_v3::SUBGROUPS;
using decode_v3::SUB_PER_WARP;
using decode_v3::State;
constexpr int UNROLL = G > 4 ? 1 : 2;  // keys per subgroup per iteration
constexpr int KEYS_PER_ITER = SUBGROUPS * UNROLL;

// Where key `key` of one (sequence, KV head) lives: its block table, both pools, and the rule.
struct Rows {
    const int* table;
    const cache_t *k_res, *v_res;
    const unsigned char *k_codes, *v_codes;
    int block_size, n_kv_heads, h, ctx;  // ctx = pos + 1: block j is coded iff (j+1)*bs <= ctx
};

// A code byte -> its value before the scale (q8_0: int8; fp8: e4m3fn).
__device__ __forceinline__ float value_of(unsigned int c) {
#if QCODEC == 0
    return (float)(signed char)(unsigned char)c;
#else
    return e4m3_value(c);
#endif
}

// 8 values d0 .. d0+7 of one token's per-token row (ROW_BYTES at `row`), dequantized to float.
// Records are 2-byte aligned at best (34, 12 or 18 bytes), so the loads are 2-byte ones.
__device__ __forceinline__ void load8_token(const unsigned char* row, int d0, float* f) {
    const unsigned char* rec = row + (d0 / GROUP) * TOK_RECORD;
    const int w = d0 % GROUP;
    const float d = fp16_at(rec);
#if QCODEC == 0 || QCODEC == 1
    const unsigned short* p = reinterpret_cast<const unsigned short*>(rec + 2 + w);
    unsigned int c[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) c[i] = p[i];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = d * value_of(c[i] & 0xFFu);
        f[2 * i + 1] = d * value_of(c[i] >> 8);
    }
#elif QCODEC == 2
    const float z = fp16_at(rec + 2);
    const unsigned int c = *reinterpret_cast<const unsigned short*>(rec + 4 + w / 4);  // 8 two-bit codes
#pragma unroll
    for (int i = 0; i < VEC; ++i) f[i] = __fmul_rn(d, (float)((c >> (2 * i)) & 3u)) + z;  // s q + z, as NumPy
#else
    const unsigned short* p = reinterpret_cast<const unsigned short*>(rec + 2 + (w & 15));
    const int shift = w >= 16 ? 4 : 0;  // values 16..31 are the high nibbles
    unsigned int c[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) c[i] = p[i];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = d * ((float)((c[i] >> shift) & 15u) - 8.0f);
        f[2 * i + 1] = d * ((float)((c[i] >> (8 + shift)) & 15u) - 8.0f);
    }
#endif
}

// kivi2's keys: channels d0 .. d0+7 of token `off` of a block, each from its own channel record.
__device__ __forceinline__ void load8_channel(const unsigned char* blk, int block_size, int h, int off, int d0,
                                              float* f) {
    const int per_channel = block_size / GROUP, j = off / GROUP, t = off % GROUP;
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
        const unsigned char* rec = blk + ((long long)(h * HEAD_DIM + d0 + i) * per_channel + j) * CH_RECORD;
        const unsigned int c = (rec[4 + t / 4] >> (2 * (t % 4))) & 3u;
        f[i] = __fmul_rn(fp16_at(rec), (float)c) + fp16_at(rec + 2);
    }
}

__device__ __forceinline__ void load_kv(const Rows& r, int key, int d0, float* kf, float* vf) {
    const int blk = key / r.block_size, off = key - blk * r.block_size;
    const long long phys = r.table[blk];
    const long long slot = phys * r.block_size + off;
    if ((blk + 1) * r.block_size <= r.ctx) {
        const long long row = (slot * r.n_kv_heads + r.h) * ROW_BYTES;
#if K_CHANNEL
        const long long block_bytes = (long long)r.block_size * r.n_kv_heads * ROW_BYTES;  // == K's for kivi2
        load8_channel(r.k_codes + phys * block_bytes, r.block_size, r.h, off, d0, kf);
#else
        load8_token(r.k_codes + row, d0, kf);
#endif
        load8_token(r.v_codes + row, d0, vf);
    } else {
        const long long row = (slot * r.n_kv_heads + r.h) * HEAD_DIM + d0;
        load8(r.k_res + row, kf);
        load8(r.v_res + row, vf);
    }
}

// decode_v3::step with the codec loader: UNROLL keys key0 + u*SUBGROUPS (those >= k_end masked).
__device__ __forceinline__ void step(const Rows& rows, int key0, int k_end, int d0, const float (&q)[G][VEC],
                                     State& s) {
    float kf[UNROLL][VEC], vf[UNROLL][VEC];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const int key = key0 + u * SUBGROUPS;
        if (key < k_end) {
            load_kv(rows, key, d0, kf[u], vf[u]);
        } else {
#pragma unroll
            for (int i = 0; i < VEC; ++i) kf[u][i] = vf[u][i] = 0.0f;
        }
    }
    float sc[UNROLL][G];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float dot = 0.0f;
#pragma unroll
            for (int i = 0; i < VEC; ++i) dot += q[g][i] * kf[u][i];
            sc[u][g] = dot;
        }
    }
    subgroup_sum<LANES>(sc);
#pragma unroll
    for (int g = 0; g < G; ++g) {
        float mx = s.m[g];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (key0 + u * SUBGROUPS >= k_end) sc[u][g] = -CUDART_INF_F;
            mx = fmaxf(mx, sc[u][g]);
        }
        const float alpha = decode_v3::exp2_shifted(s.m[g], mx);
        float sum = 0.0f;
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            sc[u][g] = decode_v3::exp2_shifted(sc[u][g], mx);
            sum += sc[u][g];
        }
        s.l[g] = s.l[g] * alpha + sum;
        s.m[g] = mx;
#pragma unroll
        for (int i = 0; i < VEC; ++i) s.acc[g][i] *= alpha;
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
#pragma unroll
            for (int i = 0; i < VEC; ++i) s.acc[g][i] += sc[u][g] * vf[u][i];
        }
    }
}

}  // namespace quant

// ---------------------------------------------------------------------------
// quant_decode_attention_v3: block (n, h, z) attends the GQA_GROUP queries of row n, KV head h,
// over keys [z*keys_per_split, (z+1)*keys_per_split) ∩ [0, token_pos[n]] of sequence token_seq[n]:
// full blocks from the codes, the open block from the residual (as minikv.quant.cache.QuantizedStore).
// Rows may be prefill rows too (each has its own position). n_splits == 1: out normalized; else
// split partials (split_k.cuh's layout) for attention_reduce_v2.
//
//   q: [N, Hq, D] float32; pools/codes: one layer (see quantize_blocks_v1); block_tables [B, W] int32
//   grid  = (N, Hkv, Z), block = (128): 4 warps, D/8 lanes per key (decode_v3.cuh)
//   bytes: per coded key and KV head 2*ROW_BYTES (int8/fp8 group 32, D=128: 272, fp16 512), per
//          residual key 2*D*sizeof(CACHE_T), q 4*N*Hq*D, 4 bytes of table per key and lane group
//          (L1), writes 4*N*Hq*D or 4*N*Hq*Z*(D+2)
// ---------------------------------------------------------------------------
extern "C" __global__ void V3_LAUNCH_BOUNDS quant_decode_attention_v3(
    const float* __restrict__ q, const cache_t* __restrict__ k_res, const cache_t* __restrict__ v_res,
    const unsigned char* __restrict__ k_codes, const unsigned char* __restrict__ v_codes,
    const int* __restrict__ block_tables, const int* __restrict__ token_seq, const int* __restrict__ token_pos,
    float* __restrict__ out, float* __restrict__ part_m, float* __restrict__ part_l, float* __restrict__ part_acc,
    int n_heads, int n_kv_heads, int block_size, int max_blocks, int keys_per_split, int n_splits, float scale) {
    if (n_heads != GQA_GROUP * n_kv_heads) __trap();
    const int n = blockIdx.x, h = blockIdx.y, z = blockIdx.z;
    const int ctx = token_pos[n] + 1;
    const int k_begin = z * keys_per_split, k_end = min(ctx, k_begin + keys_per_split);
    if (k_begin >= k_end) return;
    const quant::Rows rows{block_tables + (long long)token_seq[n] * max_blocks, k_res, v_res, k_codes, v_codes,
                           block_size, n_kv_heads, h, ctx};
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int sub = warp * quant::SUB_PER_WARP + lane / quant::LANES, d0 = (lane % quant::LANES) * VEC;
    const long long row0 = (long long)n * n_heads + (long long)h * GQA_GROUP;
    float qr[quant::G][VEC];
    const float qs = scale * decode_v3::LOG2E;
#pragma unroll
    for (int g = 0; g < quant::G; ++g) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) qr[g][i] = q[(row0 + g) * HEAD_DIM + d0 + i] * qs;
    }
    decode_v3::State s;
#pragma unroll
    for (int g = 0; g < quant::G; ++g) {
        s.m[g] = -CUDART_INF_F;
        s.l[g] = 0.0f;
#pragma unroll
        for (int i = 0; i < VEC; ++i) s.acc[g][i] = 0.0f;
    }
    for (int base = k_begin; base < k_end; base += quant::KEYS_PER_ITER) quant::step(rows, base + sub, k_end, d0, qr, s);
    decode_v3::finish(s, decode_v3::Sink{out, part_m, part_l, part_acc, row0, z, n_splits});
}
