// cuda_fp16.h for the CPU simulator: __half and __half2 with CUDA's names.
//
// A __half is 16 bits of IEEE binary16, like numpy.float16. Arithmetic converts to float,
// computes, and rounds back to nearest-even; for + - * / that equals the GPU's native half
// arithmetic (float has more than twice half's precision, so the double rounding is exact).
// nvcc and NVRTC use the real header; this one sits on the simulator's include path only.
#ifndef MINIKV_CUDA_FP16_H
#define MINIKV_CUDA_FP16_H

#include "cuda_sim.h"

namespace minikv_sim {

// float -> binary16, round to nearest, ties to even (what numpy's astype(float16) does).
inline unsigned short float_to_half_bits(float f) {
    const uint32_t x = to_bits(f);
    const unsigned short sign = (unsigned short)((x >> 16) & 0x8000u);
    const uint32_t mag = x & 0x7fffffffu;
    if (mag > 0x7f800000u) return sign | 0x7e00u | ((mag >> 13) & 0x1ffu);  // NaN stays (quiet) NaN
    if (mag >= 0x477ff000u) return sign | 0x7c00u;  // |f| >= 65520 rounds to infinity
    if (mag < 0x38800000u) {                        // |f| < 2^-14: a subnormal half, in units of 2^-24
        return sign | (unsigned short)nearbyintf(from_bits<float>(mag) * 16777216.0f);
    }
    uint32_t h = (mag - 0x38000000u) >> 13;  // rebias the exponent (127 -> 15), keep 10 mantissa bits
    const uint32_t rest = mag & 0x1fffu;     // the 13 bits that are dropped
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h += 1;  // a carry may bump the exponent: fine
    return sign | (unsigned short)h;
}

inline float half_bits_to_float(unsigned short h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in float
        const float v = (float)mant * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    if (exp == 31) return from_bits<float>(sign | 0x7f800000u | (mant << 13));  // inf or NaN
    return from_bits<float>(sign | ((exp + 112u) << 23) | (mant << 13));
}

// double -> binary16 with one rounding: round to float "to odd" first (keeps the sticky bit),
// then float -> half to nearest even. Rounding twice to nearest could be off by one ulp.
inline unsigned short double_to_half_bits(double d) {
    float f = (float)d;
    if ((double)f != d && f == f && std::fabs(f) <= FLT_MAX) {
        if (std::fabs((double)f) > std::fabs(d)) f = nextafterf(f, 0.0f);  // truncate toward zero
        f = from_bits<float>((uint32_t)to_bits(f) | 1u);                    // then mark it inexact
    }
    return float_to_half_bits(f);
}

}  // namespace minikv_sim

struct __half_raw { unsigned short x; };
struct __half2_raw { unsigned short x, y; };

struct __attribute__((aligned(2))) __half {
    unsigned short __x;
    __half() = default;
    constexpr __half(const __half_raw& r) : __x(r.x) {}
    __half(float f) : __x(minikv_sim::float_to_half_bits(f)) {}
    __half(double d) : __x(minikv_sim::double_to_half_bits(d)) {}
    __half(short i) : __half((float)i) {}
    __half(unsigned short i) : __half((float)i) {}
    __half(int i) : __half((double)i) {}
    __half(unsigned int i) : __half((double)i) {}
    __half(long i) : __half((double)i) {}
    __half(unsigned long i) : __half((double)i) {}
    __half(long long i) : __half((double)i) {}
    __half(unsigned long long i) : __half((double)i) {}
    operator float() const { return minikv_sim::half_bits_to_float(__x); }
    operator __half_raw() const { return __half_raw{__x}; }
};

struct __attribute__((aligned(4))) __half2 {
    __half x, y;
    __half2() = default;
    constexpr __half2(const __half& a, const __half& b) : x(a), y(b) {}
    __half2(const __half2_raw& r) : x(__half_raw{r.x}), y(__half_raw{r.y}) {}
};

typedef __half half;
typedef __half2 half2;

namespace minikv_sim {
MINIKV_TYPE_CODE(__half, "float16", 1)
MINIKV_TYPE_CODE(__half2, "float16", 2)
}  // namespace minikv_sim

// ---- conversions ------------------------------------------------------------------------
inline __half __float2half(float f) { return __half(f); }
inline __half __float2half_rn(float f) { return __half(f); }
inline __half __double2half(double d) { return __half(d); }
inline float __half2float(__half h) { return (float)h; }
inline __half __int2half_rn(int i) { return __half(i); }
inline int __half2int_rz(__half h) { return (int)(float)h; }
inline int __half2int_rn(__half h) { return (int)nearbyintf((float)h); }
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline short __half_as_short(__half h) { return (short)h.__x; }
inline __half __ushort_as_half(unsigned short u) { return __half(__half_raw{u}); }
inline __half __short_as_half(short s) { return __half(__half_raw{(unsigned short)s}); }

inline __half2 make_half2(__half a, __half b) { return __half2(a, b); }
inline __half2 __halves2half2(__half lo, __half hi) { return __half2(lo, hi); }
inline __half2 __half2half2(__half a) { return __half2(a, a); }
inline __half2 __float2half2_rn(float f) { return __half2(__half(f), __half(f)); }
inline __half2 __floats2half2_rn(float lo, float hi) { return __half2(__half(lo), __half(hi)); }
inline __half2 __float22half2_rn(float2 f) { return __half2(__half(f.x), __half(f.y)); }
inline float2 __half22float2(__half2 h) { return make_float2((float)h.x, (float)h.y); }
inline float __low2float(__half2 h) { return (float)h.x; }
inline float __high2float(__half2 h) { return (float)h.y; }
inline __half __low2half(__half2 h) { return h.x; }
inline __half __high2half(__half2 h) { return h.y; }
inline __half2 __low2half2(__half2 h) { return __half2(h.x, h.x); }
inline __half2 __high2half2(__half2 h) { return __half2(h.y, h.y); }
inline __half2 __lows2half2(__half2 a, __half2 b) { return __half2(a.x, b.x); }
inline __half2 __highs2half2(__half2 a, __half2 b) { return __half2(a.y, b.y); }
inline __half2 __lowhigh2highlow(__half2 h) { return __half2(h.y, h.x); }

// ---- arithmetic and comparisons ----------------------------------------------------------
#define MINIKV_HALF_BINARY(op, name)                                                         \
    inline __half operator op(const __half& a, const __half& b) { return __half((float)a op (float)b); } \
    inline __half& operator op##=(__half& a, const __half& b) { return a = a op b; }          \
    inline __half name(__half a, __half b) { return a op b; }                                 \
    inline __half2 operator op(const __half2& a, const __half2& b) { return __half2(a.x op b.x, a.y op b.y); } \
    inline __half2& operator op##=(__half2& a, const __half2& b) { return a = a op b; }       \
    inline __half2 name##2(__half2 a, __half2 b) { return a op b; }
MINIKV_HALF_BINARY(+, __hadd)
MINIKV_HALF_BINARY(-, __hsub)
MINIKV_HALF_BINARY(*, __hmul)
#undef MINIKV_HALF_BINARY
inline __half operator/(const __half& a, const __half& b) { return __half((float)a / (float)b); }
inline __half& operator/=(__half& a, const __half& b) { return a = a / b; }
inline __half __hdiv(__half a, __half b) { return a / b; }
inline __half2 __h2div(__half2 a, __half2 b) { return __half2(a.x / b.x, a.y / b.y); }
inline __half operator-(const __half& a) { return __half(__half_raw{(unsigned short)(a.__x ^ 0x8000u)}); }
inline __half operator+(const __half& a) { return a; }
inline __half __hneg(__half a) { return -a; }
inline __half2 __hneg2(__half2 a) { return __half2(-a.x, -a.y); }
inline __half __habs(__half a) { return __half(__half_raw{(unsigned short)(a.__x & 0x7fffu)}); }
inline __half2 __habs2(__half2 a) { return __half2(__habs(a.x), __habs(a.y)); }
// a*b+c with a single rounding: the float product of two halves is exact.
inline __half __hfma(__half a, __half b, __half c) { return __half(fmaf((float)a, (float)b, (float)c)); }
inline __half2 __hfma2(__half2 a, __half2 b, __half2 c) { return __half2(__hfma(a.x, b.x, c.x), __hfma(a.y, b.y, c.y)); }
inline __half __hmax(__half a, __half b) { return __half(fmaxf((float)a, (float)b)); }
inline __half __hmin(__half a, __half b) { return __half(fminf((float)a, (float)b)); }
inline __half2 __hmax2(__half2 a, __half2 b) { return __half2(__hmax(a.x, b.x), __hmax(a.y, b.y)); }
inline __half2 __hmin2(__half2 a, __half2 b) { return __half2(__hmin(a.x, b.x), __hmin(a.y, b.y)); }

#define MINIKV_HALF_COMPARE(op, name)                                                        \
    inline bool operator op(const __half& a, const __half& b) { return (float)a op (float)b; } \
    inline bool name(__half a, __half b) { return (float)a op (float)b; }
MINIKV_HALF_COMPARE(==, __heq)
MINIKV_HALF_COMPARE(!=, __hne)
MINIKV_HALF_COMPARE(<, __hlt)
MINIKV_HALF_COMPARE(<=, __hle)
MINIKV_HALF_COMPARE(>, __hgt)
MINIKV_HALF_COMPARE(>=, __hge)
#undef MINIKV_HALF_COMPARE
inline bool __hisnan(__half a) { return (a.__x & 0x7fffu) > 0x7c00u; }
inline int __hisinf(__half a) { return (a.__x & 0x7fffu) == 0x7c00u ? ((a.__x & 0x8000u) ? -1 : 1) : 0; }

inline __half hsqrt(__half a) { return __half(sqrtf((float)a)); }
inline __half hrsqrt(__half a) { return __half(1.0f / sqrtf((float)a)); }
inline __half hrcp(__half a) { return __half(1.0f / (float)a); }
inline __half hexp(__half a) { return __half(expf((float)a)); }
inline __half hlog(__half a) { return __half(logf((float)a)); }
inline __half2 h2sqrt(__half2 a) { return __half2(hsqrt(a.x), hsqrt(a.y)); }
inline __half2 h2exp(__half2 a) { return __half2(hexp(a.x), hexp(a.y)); }

inline __half atomicAdd(__half* address, __half val) {
    const __half old = *address;
    *address = old + val;
    return old;
}
inline __half2 atomicAdd(__half2* address, __half2 val) {
    const __half2 old = *address;
    *address = old + val;
    return old;
}

#endif  // MINIKV_CUDA_FP16_H
