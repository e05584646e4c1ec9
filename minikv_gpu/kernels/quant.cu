// quant.cu: step 5, the quantized paged KV cache (minikv/quant/) on the GPU.
//
// Storage (one layer; the cache keeps [L, ...] and passes a layer's contiguous view):
//   k_pool, v_pool    [num_blocks, block_size, Hkv, D] CACHE_T   the residual: open blocks in full precision
//   k_codes, v_codes  [num_blocks, block_bytes] uint8            full blocks, minikv.quant.codecs' bytes
// A per-token side stores block b, token t, KV head h as one row of ROW_BYTES = D/GROUP records at
// codes[b] + (t*Hkv + h) * ROW_BYTES; kivi2's keys store channel c = h*D + d of block b as
// block_size/GROUP records of GROUP tokens at codes[b] + c * (block_size/GROUP) * CH_RECORD
// (minikv.quant.formats.Side's "channel" axis). QCODEC selects the format (kv_dtype: K / V):
//   0  int8   q8_0 / q8_0      GROUP 32: fp16 d = amax/127, 32 x int8 roundf(x * (1/d))
//   1  fp8    e4m3fn / e4m3fn  GROUP | D, 8 | GROUP: fp16 s = amax/448, GROUP x e4m3fn(clip(x * (1/s)))
//   2  kivi2  asym2 per channel (GROUP tokens) / asym2 per token (GROUP channels): fp16 s = (max-min)/3,
//             fp16 z = min, 2-bit clip(roundf((x - z) * (1/s)), 0, 3), value i at bits 2*(i%4) of byte i/4
//   3  int4   q4_0 / q4_0      GROUP 32: fp16 d = max/-8, byte i = q[i] | q[i+16] << 4, q = trunc(x/d + 8.5)
// All bit-exact against minikv.quant.codecs' encode: the same float32 operations in the same order
// (a float32 scale and its float32 reciprocal, 0 for a zero scale; fp8/asym2 quantize with the fp16-
// rounded scale, q8_0/q4_0 with the float32 one), roundf (ties away from zero, exact) where NumPy uses
// round_half_away, truncf for q4_0, __float2half_rn (nearest even) for the fp16 scales, saturation at
// +-448 before a nearest-even fp8 cast written by bit manipulation; __fmul_rn where an FMA could form.
// Saturation as in codecs (issue 25): a scale or zero point is clamped to fp16's +-65504 before it is
// stored or used, and every code to its range, so a huge finite value never turns its group into NaN.

// Kernels (<op>_v<N>; N as in every .cu: v1 the plain version, v3 the register-resident decode design):
//   quantize_blocks_v1          encode the blocks a step fills (K and V of one layer), from the residual
//   quant_decode_attention_v3   attention over codes (full blocks) and the residual (the open block),
//                               dequantized in registers; split partials for paged.cu's attention_reduce_v2
//   quant_decode_attention_v4   the same in decode_v4.cuh's loop: every code, scale and residual load of
//                               an iteration issued before any is converted
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
//       Since v4, v3 runs through the same key policy (QuantKeys): its loads are issued for the iteration's
//       keys before any is converted, too: ptxas 60-104 / 119-128 / 202-218 at G 1/4/8.
//   quant_decode_attention_v4: decode_v4.cuh's loop over QuantKeys: the block-table entries one iteration
//       ahead (one lane per entry, shuffled), all of an iteration's code, scale and residual loads issued
//       before the first conversion (a key no longer waits for two memory round trips in series), the next
//       iteration's loads in flight during this one's math; 16 dims per lane at head_dim 128 where a record
//       holds them (GROUP a multiple of 16), 2 keys per buffer where the registers allow (fp16 residual, not
//       kivi2). A planar layout (scales apart from 16-byte-aligned codes) would turn a lane's 8 two-byte code
//       loads into one 16-byte load; it changes the bytes minikv.quant.codecs defines, so it is left for a
//       step that changes both sides.
//       Predicted (results/gpu_model.json; B=16, S=8192, 32/8 heads, D=128, fp16 residual): int8 105 us,
//       1.3x the fp16 v4 kernel (v3: 0.88x), fp8 188 us, 0.72x (v3: 0.57x): both issue-bound (int8: 705
//       instructions per warp-iteration of 8 keys, fp8's bit-built e4m3 decode: 1292); the 1.6x goal is
//       not predicted. ptxas: 64-121 registers at G=1, 115-249 at G=4, 198-255 at G=8; 0 spills.
//       Measured: waits for a GPU.
//
// nvcc-check: HEAD_DIM=64,128 CACHE_HALF=0,1 GQA_GROUP=1,3,4,8 QCODEC=0,1,2,3 KV_BLOCK=16

#include "decode.cuh"  // common.cuh, decode::run and the v3/v4 key loops

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

constexpr float F16_MAX = 65504.0f;  // the largest finite fp16: the most a stored scale or zero point holds

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
    float d = fminf(amax / (fp8 ? 448.0f : 127.0f), F16_MAX);
    if (fp8) d = fp16_round(d);  // fp8 quantizes with the stored fp16 scale, q8_0 with the float32 one
    const float inv = inverse(d);
    put_fp16(dst, d);
    for (int i = 0; i < GROUP; ++i) {
        const float y = as_float(src[i]) * inv;
        dst[2 + i] = fp8 ? (unsigned char)e4m3_of(fminf(fmaxf(y, -448.0f), 448.0f))        // saturate, cast
                         : (unsigned char)(signed char)(int)fminf(fmaxf(roundf(y), -127.0f), 127.0f);  // ties away
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
    const float s = fp16_round(fminf((hi - lo) / 3.0f, F16_MAX));  // hi - lo may overflow to inf: saturates
    const float z = fp16_round(fminf(fmaxf(lo, -F16_MAX), F16_MAX)), inv = inverse(s);
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
    const float d = fminf(fmaxf(big / -8.0f, -F16_MAX), F16_MAX), inv = inverse(d);
    put_fp16(dst, d);
    for (int i = 0; i < GROUP / 2; ++i) {  // a saturated d can put a code below 0: clamped, as np.clip
        const float qa = truncf(__fmul_rn(as_float(src[i]), inv) + 8.5f);
        const float qb = truncf(__fmul_rn(as_float(src[i + 16]), inv) + 8.5f);
        const unsigned int a = (unsigned int)fminf(fmaxf(qa, 0.0f), 15.0f);
        const unsigned int b = (unsigned int)fminf(fmaxf(qb, 0.0f), 15.0f);
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

// A code byte -> its value before the scale (q8_0: int8; fp8: e4m3fn).
__device__ __forceinline__ float value_of(unsigned int c) {
#if QCODEC == 0
    return (float)(signed char)(unsigned char)c;
#else
    return e4m3_value(c);
#endif
}

// One key's loads for DIMS dims of a lane, K and V, as 32-bit words: a coded key holds its two-byte code
// loads (CODES words) and the record's fp16 scale (and kivi2's zero) after them; a residual key (the open
// block) holds its DIMS cache_t elements. kivi2's keys (per-channel records) are dequantized at load:
// their DIMS floats. All of an iteration's loads are issued before any is converted.
template <int DIMS>
struct Raw {
    static constexpr int CODES = QCODEC == 2 ? DIMS / 8 : DIMS / 2;  // two-byte code loads per side
    static constexpr int RESIDUAL = DIMS * (int)sizeof(cache_t) / 4;
    static constexpr int A = CODES + 2 > RESIDUAL ? CODES + 2 : RESIDUAL;
    static constexpr int WORDS = K_CHANNEL && DIMS > A ? DIMS : A;
    unsigned k[WORDS], v[WORDS];
    bool coded, ok;
};

// A per-token record's codes (and scale, zero) for dims d0 .. d0+DIMS-1 of the row at `row` -> w.
// Records are 2-byte aligned at best (34, 12 or 18 bytes), so the loads are 2-byte ones.
template <int DIMS, int WORDS>
__device__ __forceinline__ void load_codes(const unsigned char* row, int d0, unsigned (&w)[WORDS]) {
    constexpr int CODES = Raw<DIMS>::CODES;
    const unsigned char* rec = row + (d0 / GROUP) * TOK_RECORD;
    const int off = d0 % GROUP;
    w[CODES] = *reinterpret_cast<const unsigned short*>(rec);
#if QCODEC == 2
    w[CODES + 1] = *reinterpret_cast<const unsigned short*>(rec + 2);
    const unsigned short* p = reinterpret_cast<const unsigned short*>(rec + 4 + off / 4);  // 8 two-bit codes each
#elif QCODEC == 3
    const unsigned short* p = reinterpret_cast<const unsigned short*>(rec + 2 + (off & 15));  // values 16.. high
#else
    const unsigned short* p = reinterpret_cast<const unsigned short*>(rec + 2 + off);
#endif
#pragma unroll
    for (int i = 0; i < CODES; ++i) w[i] = p[i];
}

// The words of load_codes -> DIMS dequantized values (bit for bit minikv.quant.codecs' decode).
template <int DIMS, int WORDS>
__device__ __forceinline__ void decode_codes(const unsigned (&w)[WORDS], int d0, float (&f)[DIMS]) {
    constexpr int CODES = Raw<DIMS>::CODES;
    const float d = __half2float(__ushort_as_half((unsigned short)w[CODES]));
#if QCODEC == 0 || QCODEC == 1
#pragma unroll
    for (int i = 0; i < CODES; ++i) {
        f[2 * i] = d * value_of(w[i] & 0xFFu);
        f[2 * i + 1] = d * value_of(w[i] >> 8);
    }
#elif QCODEC == 2
    const float z = __half2float(__ushort_as_half((unsigned short)w[CODES + 1]));
#pragma unroll
    for (int i = 0; i < DIMS; ++i) f[i] = __fmul_rn(d, (float)((w[i / 8] >> (2 * (i % 8))) & 3u)) + z;  // s q + z
#else
    const int shift = d0 % GROUP >= 16 ? 4 : 0;  // values 16..31 are the high nibbles
#pragma unroll
    for (int i = 0; i < CODES; ++i) {
        f[2 * i] = d * ((float)((w[i] >> shift) & 15u) - 8.0f);
        f[2 * i + 1] = d * ((float)((w[i] >> (8 + shift)) & 15u) - 8.0f);
    }
#endif
}

// DIMS residual elements at src -> words (16-byte loads), and back to floats.
template <int DIMS, int WORDS>
__device__ __forceinline__ void load_residual(const cache_t* src, unsigned (&w)[WORDS]) {
#pragma unroll
    for (int i = 0; i < Raw<DIMS>::RESIDUAL / 4; ++i) {
        const uint4 x = reinterpret_cast<const uint4*>(src)[i];
        w[4 * i] = x.x, w[4 * i + 1] = x.y, w[4 * i + 2] = x.z, w[4 * i + 3] = x.w;
    }
}

template <int DIMS, int WORDS>
__device__ __forceinline__ void unpack_residual(const unsigned (&w)[WORDS], float (&f)[DIMS]) {
#pragma unroll
    for (int i = 0; i < DIMS; ++i) {
#if CACHE_HALF
        f[i] = __half2float(__ushort_as_half((unsigned short)(w[i / 2] >> (16 * (i % 2)))));
#else
        f[i] = __uint_as_float(w[i]);
#endif
    }
}

// kivi2's keys: channels d0 .. d0+DIMS-1 of token `off` of a block, each from its own channel record.
template <int DIMS, int WORDS>
__device__ __forceinline__ void load_channels(const unsigned char* blk, int block_size, int h, int off, int d0,
                                              unsigned (&w)[WORDS]) {
    const int per_channel = block_size / GROUP, j = off / GROUP, t = off % GROUP;
#pragma unroll
    for (int i = 0; i < DIMS; ++i) {
        const unsigned char* rec = blk + ((long long)(h * HEAD_DIM + d0 + i) * per_channel + j) * CH_RECORD;
        const unsigned int c = (rec[4 + t / 4] >> (2 * (t % 4))) & 3u;
        w[i] = __float_as_uint(__fmul_rn(fp16_at(rec), (float)c) + fp16_at(rec + 2));
    }
}

// The key policy of the quantized paged cache (decode_core.cuh): key j of block b is read from the codes
// iff the block is full at the row's position, (b+1)*block_size <= ctx (minikv.quant.view_tables' rule),
// else from the residual pool (the open block, full precision). v3: each lane looks its keys up; v4
// (PREFETCH): the block-table entries come one iteration ahead, one lane per entry, by shuffle.
template <int DIMS_, int KEYS_, int DIV, bool PREFETCH>
struct QuantKeys {
    static constexpr int DIMS = DIMS_, KEYS = KEYS_;
    using Raw = quant::Raw<DIMS>;
    decode::Lookup<DIV, PREFETCH> table;
    const cache_t *k_res, *v_res;
    const unsigned char *k_codes, *v_codes;
    int n_kv_heads, h, ctx;  // ctx = pos + 1

    __device__ __forceinline__ int ahead(int w0, int) const {
        return table.ahead(w0, table.span(w0, decode::warp_keys<DIMS, KEYS>()));
    }
    __device__ __forceinline__ void load(int key, int k_end, int ahead_entry, int w0, int d0, Raw& r) const {
        const int phys = table.at(key, ahead_entry, w0);  // every lane: a shuffle on the v4 path
        const int bs = table.divisor(), off = table.offset(key);
        const long long slot = (long long)phys * bs + off;
        r.ok = key < k_end;
        r.coded = r.ok && (table.index(key) + 1) * bs <= ctx;
#pragma unroll
        for (int i = 0; i < Raw::WORDS; ++i) r.k[i] = r.v[i] = 0u;  // masked keys: zeros (p = 0 adds 0)
        if (r.coded) {
            const long long row = (slot * n_kv_heads + h) * ROW_BYTES;
#if K_CHANNEL
            const long long block_bytes = (long long)bs * n_kv_heads * ROW_BYTES;  // == K's for kivi2
            load_channels<DIMS>(k_codes + phys * block_bytes, bs, h, off, d0, r.k);
#else
            load_codes<DIMS>(k_codes + row, d0, r.k);
#endif
            load_codes<DIMS>(v_codes + row, d0, r.v);
        } else if (r.ok) {
            const long long row = (slot * n_kv_heads + h) * HEAD_DIM + d0;
            load_residual<DIMS>(k_res + row, r.k);
            load_residual<DIMS>(v_res + row, r.v);
        }
    }
    __device__ __forceinline__ bool visible(const Raw& r) const { return r.ok; }
    __device__ __forceinline__ void key(const Raw& r, int d0, float (&f)[DIMS]) const {
        if (!r.coded) unpack_residual<DIMS>(r.k, f);
        else if (K_CHANNEL) for (int i = 0; i < DIMS; ++i) f[i] = __uint_as_float(r.k[i]);
        else decode_codes<DIMS>(r.k, d0, f);
    }
    __device__ __forceinline__ void value(const Raw& r, int d0, float (&f)[DIMS]) const {
        if (r.coded) decode_codes<DIMS>(r.v, d0, f);
        else unpack_residual<DIMS>(r.v, f);
    }
    __device__ __forceinline__ void query(float (&)[decode::G][DIMS], int) const {}
};

// v4's dims per lane: 16 at head_dim 128 (G <= 4) where a lane's 16 values lie in one record.
constexpr int V4_DIMS = decode_v4::ROW_DIMS == 16 && GROUP % 16 == 0 ? 16 : VEC;
// Keys per subgroup and buffer: 2 where 2 blocks share an SM (G * DIMS > 32: twice the registers per thread)
// and a key's words fit them twice (fp16 residual or G = 8's 8 dims; not kivi2's dequantized channels), else
// 1. ptxas spilled at 2 with a float32 residual and 16 dims (16 words a side) and at G = 1 (4 blocks per SM).
constexpr int V4_KEYS = decode::G * V4_DIMS > 32 && !K_CHANNEL && (CACHE_HALF || decode::G > 4) && HEAD_DIM > VEC ? 2 : 1;
// v3: 2 keys per subgroup; 1 for G > 4, and for kivi2 from G = 3 (its channel keys, dequantized at load,
// spilled 4 bytes at 2 with G = 3, D = 64, a float32 residual on sm_90).
constexpr int V3_KEYS = decode::G > 4 || (K_CHANNEL && decode::G > 2) ? 1 : 2;

}  // namespace quant

#ifndef KV_BLOCK
#define KV_BLOCK 0  // v4's compile-time block size (a power of two); 0: the runtime block_size argument
#endif

// Block (n, h, z) of quant_decode_attention_v3/v4: the group's queries over its key range with loop V.
template <int V, int DIMS, int KEYS, int DIV>
__device__ __forceinline__ void quant_decode(const float* q, const cache_t* k_res, const cache_t* v_res,
                                             const unsigned char* k_codes, const unsigned char* v_codes,
                                             const int* block_tables, const int* token_seq, const int* token_pos,
                                             const decode::Dest& dest, int n_heads, int n_kv_heads,
                                             int block_size, int max_blocks, int keys_per_split, float scale) {
    if (n_heads != GQA_GROUP * n_kv_heads || (DIV > 0 && block_size != DIV)) __trap();  // a launcher bug
    const int n = blockIdx.x, ctx = token_pos[n] + 1;
    const int k_begin = blockIdx.z * keys_per_split, k_end = min(ctx, k_begin + keys_per_split);
    if (k_begin >= k_end) return;
    quant::QuantKeys<DIMS, KEYS, DIV, !!(V == 4)> pol;
    pol.table = {block_tables + (long long)token_seq[n] * max_blocks, block_size, (k_end - 1) / block_size + 1};
    pol.k_res = k_res, pol.v_res = v_res, pol.k_codes = k_codes, pol.v_codes = v_codes;
    pol.n_kv_heads = n_kv_heads, pol.h = blockIdx.y, pol.ctx = ctx;
    decode::run<V>(pol, q + dest.row0 * HEAD_DIM, scale, k_begin, k_end, dest);
}

// The parameters of quant_decode_attention_v3 and _v4 (one list, so that the two kernels cannot drift apart).
#define QUANT_DECODE_PARAMS                                                                                         \
    const float *__restrict__ q, const cache_t *__restrict__ k_res, const cache_t *__restrict__ v_res,             \
        const unsigned char *__restrict__ k_codes, const unsigned char *__restrict__ v_codes,                       \
        const int *__restrict__ block_tables, const int *__restrict__ token_seq, const int *__restrict__ token_pos, \
        float *__restrict__ out, float *__restrict__ part_m, float *__restrict__ part_l,                           \
        float *__restrict__ part_acc, int n_heads, int n_kv_heads, int block_size, int max_blocks,                 \
        int keys_per_split, int n_splits, float scale
#define QUANT_DECODE_ARGS                                                                                           \
    q, k_res, v_res, k_codes, v_codes, block_tables, token_seq, token_pos,                                          \
        decode::Dest{out, part_m, part_l, part_acc,                                                                 \
                     (long long)blockIdx.x * n_heads + (long long)blockIdx.y * GQA_GROUP, (int)blockIdx.z, n_splits}, \
        n_heads, n_kv_heads, block_size, max_blocks, keys_per_split, scale

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
extern "C" __global__ void V3_LAUNCH_BOUNDS quant_decode_attention_v3(QUANT_DECODE_PARAMS) {
    quant_decode<3, VEC, quant::V3_KEYS, 0>(QUANT_DECODE_ARGS);
}

// ---------------------------------------------------------------------------
// quant_decode_attention_v4 (decode_v4.cuh): v3's work, arguments and outputs; every code, scale and
// residual load of the next iteration is issued before this iteration converts any, the block-table entries
// one iteration earlier still (one lane per entry, shuffled), 16 dims per lane at head_dim 128 (G <= 4,
// GROUP a multiple of 16), the transposed reduction and the skipped rescale. KV_BLOCK as paged.cu's v4.
//
//   grid  = (N, Hkv, Z), block = (128); bytes: v3's, the block table once per block and iteration
// ---------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(128, V4_BLOCKS_PER_SM(quant::V4_DIMS))
    quant_decode_attention_v4(QUANT_DECODE_PARAMS) {
    quant_decode<4, quant::V4_DIMS, quant::V4_KEYS, KV_BLOCK>(QUANT_DECODE_ARGS);
}
