// cuda_sim.h: the slice of CUDA C++ that minikv's kernels use, for g++ on the CPU.
//
// The simulator force-includes this header (g++ -include cuda_sim.h) before every .cu
// source. It turns CUDA's keywords into plain C++, declares the built-in variables
// (threadIdx, blockIdx, ...) and implements the device intrinsics. Anything that makes
// threads wait for each other (__syncthreads, __shfl_*_sync, __ballot_sync, ...) calls into
// sim_runtime.cpp, which runs every CUDA thread as a fiber. See README.md next to this folder.
//
// nvcc never sees this file: it sits on the simulator's include path only.
#ifndef MINIKV_CUDA_SIM_H
#define MINIKV_CUDA_SIM_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>

#define MINIKV_CPU_SIM 1
#define __CUDA_ARCH__ 800  // the lowest architecture the project targets (sm_80)

// ---- keywords -----------------------------------------------------------------------
// The simulator first preprocesses a source with MINIKV_SIM_SCAN defined to find the kernels
// and the `extern __shared__` arrays; those two keywords then stay visible as markers.
#ifdef MINIKV_SIM_SCAN
#define __global__ __minikv_kernel__
#else
#define __global__
#define __minikv_extern_shared__  // the simulator rewrites `extern __shared__` to this
#endif
#define __device__
#define __host__
#define __forceinline__
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __grid_constant__
#define __constant__
#define __align__(n) __attribute__((aligned(n)))
// __restrict__ is a g++ keyword already.

// Static shared memory is one variable shared by all fibers of the block: a `static`.
// Outside ASan it lives in its own section, so that the runtime can find it and fill it with
// 0xff bytes before every block (reading shared memory nobody wrote gives NaN or -1, as a
// reminder that a GPU does not initialize it). g++ does not guard globals in a named
// section with ASan redzones, so ASan builds use a plain static.
#if defined(MINIKV_SIM_SCAN) || defined(__SANITIZE_ADDRESS__)
#define __shared__ static
#else
#define __shared__ static __attribute__((section("minikv_shared")))
#endif

#define MINIKV_HIDDEN __attribute__((visibility("hidden")))

// ---- vector types ---------------------------------------------------------------------
// Same members, sizes and alignments as CUDA's vector_types.h.
#define MINIKV_VEC2(T, name, al)                                                           \
    struct __attribute__((aligned(al))) name { T x, y; };                                  \
    inline name make_##name(T x, T y) { return name{x, y}; }
#define MINIKV_VEC3(T, name)                                                               \
    struct name { T x, y, z; };                                                            \
    inline name make_##name(T x, T y, T z) { return name{x, y, z}; }
#define MINIKV_VEC4(T, name, al)                                                           \
    struct __attribute__((aligned(al))) name { T x, y, z, w; };                            \
    inline name make_##name(T x, T y, T z, T w) { return name{x, y, z, w}; }

MINIKV_VEC2(float, float2, 8)
MINIKV_VEC3(float, float3)
MINIKV_VEC4(float, float4, 16)
MINIKV_VEC2(double, double2, 16)
MINIKV_VEC2(int, int2, 8)
MINIKV_VEC3(int, int3)
MINIKV_VEC4(int, int4, 16)
MINIKV_VEC2(unsigned int, uint2, 8)
MINIKV_VEC3(unsigned int, uint3)
MINIKV_VEC4(unsigned int, uint4, 16)
MINIKV_VEC2(short, short2, 4)
MINIKV_VEC4(short, short4, 8)
MINIKV_VEC2(unsigned short, ushort2, 4)
MINIKV_VEC4(unsigned short, ushort4, 8)
MINIKV_VEC2(signed char, char2, 2)
MINIKV_VEC4(signed char, char4, 4)
MINIKV_VEC2(unsigned char, uchar2, 2)
MINIKV_VEC4(unsigned char, uchar4, 4)
MINIKV_VEC2(long long, longlong2, 16)
MINIKV_VEC2(unsigned long long, ulonglong2, 16)

struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
    constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
    constexpr operator uint3() const { return uint3{x, y, z}; }
};

// ---- the runtime's interface (sim_runtime.cpp) ----------------------------------------
namespace minikv_sim {

// Describes one kernel parameter for the launch checks (filled from the C++ type itself).
struct ParamInfo {
    int is_pointer;      // 1 for T*, 0 for a value
    int is_const;        // pointee is const
    const char* dtype;   // NumPy dtype name of T (or of the pointee); "void", "char" or nullptr (unsupported)
    int lanes;           // 4 for float4, 2 for __half2, 1 for scalars
    unsigned long size;  // sizeof the parameter itself
};

// What each fiber sees of itself; the scheduler points g_regs at the running fiber's copy.
struct ThreadRegs {
    uint3 thread_idx;
    unsigned int linear;  // x + y*Dx + z*Dx*Dy
    unsigned int lane;    // linear % 32
    unsigned int warp;    // linear / 32
};
extern ThreadRegs* g_regs MINIKV_HIDDEN;
extern uint3 g_block_idx MINIKV_HIDDEN;
extern dim3 g_block_dim MINIKV_HIDDEN;
extern dim3 g_grid_dim MINIKV_HIDDEN;

// Where in the source a barrier or warp collective was called, for error messages.
struct Site { const char* file; int line; };

enum BarrierOp { BAR_SYNC, BAR_COUNT, BAR_AND, BAR_OR };
enum WarpOp {
    WARP_SYNC, SHFL_IDX, SHFL_UP, SHFL_DOWN, SHFL_XOR, VOTE_BALLOT, VOTE_ANY, VOTE_ALL,
    MATCH_ANY, REDUCE_ADD, REDUCE_MIN_I, REDUCE_MAX_I, REDUCE_MIN_U, REDUCE_MAX_U,
    REDUCE_AND, REDUCE_OR, REDUCE_XOR
};

int barrier(BarrierOp op, int predicate, Site site) MINIKV_HIDDEN;
uint64_t warp_collective(WarpOp op, unsigned int mask, uint64_t value, int arg, int width,
                         Site site) MINIKV_HIDDEN;
unsigned int active_mask() MINIKV_HIDDEN;
void yield() MINIKV_HIDDEN;
[[noreturn]] void trap(const char* what, Site site) MINIKV_HIDDEN;
// How a launch orders its blocks and the fibers of a block (module.py fills it from
// MINIKV_SIM_BLOCKS and MINIKV_SIM_SCHEDULE).
struct Schedule {
    unsigned long long block_order;  // 0 blockIdx order (x fastest), 1 reversed, 2 random (block_seed)
    unsigned long long block_seed;
    unsigned long long random_fibers;  // 0 FIFO, 1 a random READY fiber at each switch (fiber_seed)
    unsigned long long fiber_seed;
};
// Entry points for the generated launch wrapper (see build.py).
int launch(void (*entry)(void**), void** args, const unsigned grid[3], const unsigned block[3],
           char* const* dyn_buffers, int n_dyn_buffers, size_t dyn_bytes, size_t dyn_capacity,
           const Schedule* sched, char* err, size_t err_len) MINIKV_HIDDEN;
size_t static_shared_bytes() MINIKV_HIDDEN;

template <class T>
inline uint64_t to_bits(T v) {
    static_assert(std::is_trivially_copyable<T>::value && sizeof(T) <= 8,
                  "warp shuffles move values of at most 8 bytes");
    uint64_t b = 0;
    memcpy(&b, &v, sizeof(T));
    return b;
}
template <class T>
inline T from_bits(uint64_t b) {
    T v;
    memcpy(&v, &b, sizeof(T));
    return v;
}

}  // namespace minikv_sim

#define MINIKV_SITE (::minikv_sim::Site{__FILE__, __LINE__})

// ---- built-in variables ------------------------------------------------------------------
// Read-only, as in CUDA.
#define threadIdx (static_cast<const uint3&>(::minikv_sim::g_regs->thread_idx))
#define blockIdx (static_cast<const uint3&>(::minikv_sim::g_block_idx))
#define blockDim (static_cast<const dim3&>(::minikv_sim::g_block_dim))
#define gridDim (static_cast<const dim3&>(::minikv_sim::g_grid_dim))
static const int warpSize = 32;

// ---- barriers and warp collectives -------------------------------------------------------
// Macros so that each call carries its file and line into error messages.
#define __syncthreads() ((void)::minikv_sim::barrier(::minikv_sim::BAR_SYNC, 0, MINIKV_SITE))
#define __syncthreads_count(p) ::minikv_sim::barrier(::minikv_sim::BAR_COUNT, (p) != 0, MINIKV_SITE)
#define __syncthreads_and(p) ::minikv_sim::barrier(::minikv_sim::BAR_AND, (p) != 0, MINIKV_SITE)
#define __syncthreads_or(p) ::minikv_sim::barrier(::minikv_sim::BAR_OR, (p) != 0, MINIKV_SITE)
#define __syncwarp(...) ::minikv_sim::syncwarp(MINIKV_SITE __VA_OPT__(, ) __VA_ARGS__)
#define __shfl_sync(...) ::minikv_sim::shfl(::minikv_sim::SHFL_IDX, MINIKV_SITE, __VA_ARGS__)
#define __shfl_up_sync(...) ::minikv_sim::shfl(::minikv_sim::SHFL_UP, MINIKV_SITE, __VA_ARGS__)
#define __shfl_down_sync(...) ::minikv_sim::shfl(::minikv_sim::SHFL_DOWN, MINIKV_SITE, __VA_ARGS__)
#define __shfl_xor_sync(...) ::minikv_sim::shfl(::minikv_sim::SHFL_XOR, MINIKV_SITE, __VA_ARGS__)
#define __ballot_sync(mask, p) ::minikv_sim::vote(::minikv_sim::VOTE_BALLOT, MINIKV_SITE, mask, p)
#define __any_sync(mask, p) ((int)::minikv_sim::vote(::minikv_sim::VOTE_ANY, MINIKV_SITE, mask, p))
#define __all_sync(mask, p) ((int)::minikv_sim::vote(::minikv_sim::VOTE_ALL, MINIKV_SITE, mask, p))
#define __match_any_sync(mask, v) ::minikv_sim::match_any(MINIKV_SITE, mask, v)
#define __reduce_add_sync(mask, v) ::minikv_sim::reduce(::minikv_sim::REDUCE_ADD, MINIKV_SITE, mask, v)
#define __reduce_min_sync(mask, v) ::minikv_sim::reduce_minmax(false, MINIKV_SITE, mask, v)
#define __reduce_max_sync(mask, v) ::minikv_sim::reduce_minmax(true, MINIKV_SITE, mask, v)
#define __reduce_and_sync(mask, v) ::minikv_sim::reduce(::minikv_sim::REDUCE_AND, MINIKV_SITE, mask, v)
#define __reduce_or_sync(mask, v) ::minikv_sim::reduce(::minikv_sim::REDUCE_OR, MINIKV_SITE, mask, v)
#define __reduce_xor_sync(mask, v) ::minikv_sim::reduce(::minikv_sim::REDUCE_XOR, MINIKV_SITE, mask, v)
#define __activemask() ::minikv_sim::active_mask()
#define __trap() ::minikv_sim::trap("__trap() called", MINIKV_SITE)

namespace minikv_sim {
inline void syncwarp(Site site, unsigned int mask = 0xffffffffu) {
    warp_collective(WARP_SYNC, mask, 0, 0, 32, site);
}
template <class T>
inline T shfl(WarpOp op, Site site, unsigned int mask, T var, int lane_arg, int width = 32) {
    return from_bits<T>(warp_collective(op, mask, to_bits(var), lane_arg, width, site));
}
inline unsigned int vote(WarpOp op, Site site, unsigned int mask, int predicate) {
    return (unsigned int)warp_collective(op, mask, predicate != 0, 0, 32, site);
}
template <class T>
inline unsigned int match_any(Site site, unsigned int mask, T value) {
    static_assert(std::is_integral<T>::value, "__match_any_sync takes an integer");
    return (unsigned int)warp_collective(MATCH_ANY, mask, to_bits(value), 0, 32, site);
}
inline unsigned int reduce(WarpOp op, Site site, unsigned int mask, unsigned int v) {
    return (unsigned int)warp_collective(op, mask, v, 0, 32, site);
}
inline int reduce_minmax(bool is_max, Site site, unsigned int mask, int v) {
    return (int)warp_collective(is_max ? REDUCE_MAX_I : REDUCE_MIN_I, mask, (uint64_t)(int64_t)v, 0, 32, site);
}
inline unsigned int reduce_minmax(bool is_max, Site site, unsigned int mask, unsigned int v) {
    return (unsigned int)warp_collective(is_max ? REDUCE_MAX_U : REDUCE_MIN_U, mask, v, 0, 32, site);
}
}  // namespace minikv_sim

// Memory fences order memory between threads; fibers never run at the same time.
inline void __threadfence() {}
inline void __threadfence_block() {}
inline void __threadfence_system() {}
// A thread that sleeps lets the others run (a spin-wait then makes progress).
inline void __nanosleep(unsigned int) { ::minikv_sim::yield(); }

// ---- atomics -----------------------------------------------------------------------------
// Fibers switch only inside barriers and warp collectives, so a plain read-modify-write is
// already atomic. The overload sets follow CUDA's.
#define MINIKV_ATOMIC(name, T, expr)                                                       \
    inline T name(T* address, T val) {                                                     \
        T old = *address;                                                                  \
        *address = (expr);                                                                 \
        return old;                                                                        \
    }
#define MINIKV_ATOMIC_INT_TYPES(name, expr)                                                \
    MINIKV_ATOMIC(name, int, expr)                                                         \
    MINIKV_ATOMIC(name, unsigned int, expr)                                                \
    MINIKV_ATOMIC(name, unsigned long long, expr)
MINIKV_ATOMIC_INT_TYPES(atomicAdd, old + val)
MINIKV_ATOMIC(atomicAdd, float, old + val)
MINIKV_ATOMIC(atomicAdd, double, old + val)
MINIKV_ATOMIC(atomicSub, int, old - val)
MINIKV_ATOMIC(atomicSub, unsigned int, old - val)
MINIKV_ATOMIC_INT_TYPES(atomicExch, val)
MINIKV_ATOMIC(atomicExch, float, val)
MINIKV_ATOMIC_INT_TYPES(atomicMax, old > val ? old : val)
MINIKV_ATOMIC(atomicMax, long long, old > val ? old : val)
MINIKV_ATOMIC_INT_TYPES(atomicMin, old < val ? old : val)
MINIKV_ATOMIC(atomicMin, long long, old < val ? old : val)
MINIKV_ATOMIC_INT_TYPES(atomicAnd, old & val)
MINIKV_ATOMIC_INT_TYPES(atomicOr, old | val)
MINIKV_ATOMIC_INT_TYPES(atomicXor, old ^ val)
MINIKV_ATOMIC(atomicInc, unsigned int, old >= val ? 0u : old + 1u)
MINIKV_ATOMIC(atomicDec, unsigned int, (old == 0u || old > val) ? val : old - 1u)
#undef MINIKV_ATOMIC_INT_TYPES
#undef MINIKV_ATOMIC

// A failed compare-and-swap usually means a spin lock held by another thread: let it run.
#define MINIKV_ATOMIC_CAS(T)                                                               \
    inline T atomicCAS(T* address, T compare, T val) {                                     \
        T old = *address;                                                                  \
        if (old == compare) *address = val;                                                \
        else ::minikv_sim::yield();                                                        \
        return old;                                                                        \
    }
MINIKV_ATOMIC_CAS(int)
MINIKV_ATOMIC_CAS(unsigned int)
MINIKV_ATOMIC_CAS(unsigned long long)
MINIKV_ATOMIC_CAS(unsigned short)
#undef MINIKV_ATOMIC_CAS

// ---- min / max with CUDA's overloads (mixed signed/unsigned pick the unsigned type) --------
#define MINIKV_MINMAX(R, A, B)                                                             \
    inline R min(A a, B b) { return (R)a < (R)b ? (R)a : (R)b; }                           \
    inline R max(A a, B b) { return (R)a > (R)b ? (R)a : (R)b; }
MINIKV_MINMAX(int, int, int)
MINIKV_MINMAX(unsigned int, unsigned int, unsigned int)
MINIKV_MINMAX(unsigned int, int, unsigned int)
MINIKV_MINMAX(unsigned int, unsigned int, int)
MINIKV_MINMAX(long, long, long)
MINIKV_MINMAX(unsigned long, unsigned long, unsigned long)
MINIKV_MINMAX(unsigned long, long, unsigned long)
MINIKV_MINMAX(unsigned long, unsigned long, long)
MINIKV_MINMAX(long long, long long, long long)
MINIKV_MINMAX(unsigned long long, unsigned long long, unsigned long long)
MINIKV_MINMAX(unsigned long long, long long, unsigned long long)
MINIKV_MINMAX(unsigned long long, unsigned long long, long long)
#undef MINIKV_MINMAX
// Floating point min/max follow fminf/fmaxf (a NaN operand loses), as CUDA's do.
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }
inline double min(float a, double b) { return fmin(a, b); }
inline double max(float a, double b) { return fmax(a, b); }
inline double min(double a, float b) { return fmin(a, b); }
inline double max(double a, float b) { return fmax(a, b); }

// ---- math intrinsics -----------------------------------------------------------------------
// glibc's math.h already declares __expf, __logf, ... (its internal names), so the fast
// intrinsics are macros onto the accurate functions. The GPU's fast versions are less
// accurate, so tests compare with tolerances.
#define __expf(x) expf(x)
#define __exp10f(x) exp10f(x)
#define __logf(x) logf(x)
#define __log2f(x) log2f(x)
#define __log10f(x) log10f(x)
#define __sinf(x) sinf(x)
#define __cosf(x) cosf(x)
#define __tanf(x) tanf(x)
#define __powf(x, y) powf(x, y)
#define __sincosf(x, s, c) sincosf(x, s, c)
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __frsqrt_rn(float x) { return 1.0f / sqrtf(x); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __fma_rn(double a, double b, double c) { return fma(a, b, c); }
inline float __saturatef(float x) { return x != x ? 0.0f : fminf(fmaxf(x, 0.0f), 1.0f); }

inline float __int_as_float(int x) { return ::minikv_sim::from_bits<float>((uint32_t)x); }
inline int __float_as_int(float x) { return (int)(uint32_t)::minikv_sim::to_bits(x); }
inline float __uint_as_float(unsigned int x) { return ::minikv_sim::from_bits<float>(x); }
inline unsigned int __float_as_uint(float x) { return (unsigned int)::minikv_sim::to_bits(x); }
inline double __longlong_as_double(long long x) { return ::minikv_sim::from_bits<double>((uint64_t)x); }
inline long long __double_as_longlong(double x) { return (long long)::minikv_sim::to_bits(x); }
inline int __float2int_rn(float x) { return (int)nearbyintf(x); }
inline int __float2int_rz(float x) { return (int)x; }
inline int __float2int_rd(float x) { return (int)floorf(x); }
inline int __float2int_ru(float x) { return (int)ceilf(x); }
inline unsigned int __float2uint_rn(float x) { return (unsigned int)nearbyintf(x); }
inline float __int2float_rn(int x) { return (float)x; }
inline float __uint2float_rn(unsigned int x) { return (float)x; }
inline long long __float2ll_rn(float x) { return (long long)nearbyintf(x); }
inline float __ll2float_rn(long long x) { return (float)x; }

inline int __popc(unsigned int x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned int)x); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned int __brev(unsigned int x) {
    unsigned int r = 0;
    for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
    return r;
}
inline int __mul24(int a, int b) { return (int)((unsigned)a * (unsigned)b); }
inline int __mulhi(int a, int b) { return (int)(((long long)a * b) >> 32); }
inline unsigned int __umulhi(unsigned int a, unsigned int b) {
    return (unsigned int)(((unsigned long long)a * b) >> 32);
}
inline long long __mul64hi(long long a, long long b) { return (long long)(((__int128)a * b) >> 64); }
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}

// Cache-hint loads and stores are plain memory accesses here.
template <class T> inline T __ldg(const T* p) { return *p; }
template <class T> inline T __ldcg(const T* p) { return *p; }
template <class T> inline T __ldca(const T* p) { return *p; }
template <class T> inline T __ldcs(const T* p) { return *p; }
template <class T> inline T __ldlu(const T* p) { return *p; }
template <class T> inline T __ldcv(const T* p) { return *p; }
template <class T> inline void __stwb(T* p, T v) { *p = v; }
template <class T> inline void __stcg(T* p, T v) { *p = v; }
template <class T> inline void __stcs(T* p, T v) { *p = v; }
template <class T> inline void __stwt(T* p, T v) { *p = v; }

// ---- parameter descriptions for the launch checks -------------------------------------------
namespace minikv_sim {
// Functions, not static data members: the simulator compiles with -fno-weak, which
// mishandles C++17 inline variables.
template <class T> struct TypeCode {
    static constexpr const char* dtype() { return nullptr; }
    static constexpr int lanes() { return 0; }
};
#define MINIKV_TYPE_CODE(T, name, n)                                                       \
    template <> struct TypeCode<T> {                                                       \
        static constexpr const char* dtype() { return name; }                              \
        static constexpr int lanes() { return n; }                                         \
    };
MINIKV_TYPE_CODE(void, "void", 1)
MINIKV_TYPE_CODE(bool, "bool", 1)
MINIKV_TYPE_CODE(char, "char", 1)
MINIKV_TYPE_CODE(signed char, "int8", 1)
MINIKV_TYPE_CODE(unsigned char, "uint8", 1)
MINIKV_TYPE_CODE(short, "int16", 1)
MINIKV_TYPE_CODE(unsigned short, "uint16", 1)
MINIKV_TYPE_CODE(int, "int32", 1)
MINIKV_TYPE_CODE(unsigned int, "uint32", 1)
MINIKV_TYPE_CODE(long, "int64", 1)
MINIKV_TYPE_CODE(unsigned long, "uint64", 1)
MINIKV_TYPE_CODE(long long, "int64", 1)
MINIKV_TYPE_CODE(unsigned long long, "uint64", 1)
MINIKV_TYPE_CODE(float, "float32", 1)
MINIKV_TYPE_CODE(double, "float64", 1)
MINIKV_TYPE_CODE(float2, "float32", 2)
MINIKV_TYPE_CODE(float3, "float32", 3)
MINIKV_TYPE_CODE(float4, "float32", 4)
MINIKV_TYPE_CODE(double2, "float64", 2)
MINIKV_TYPE_CODE(int2, "int32", 2)
MINIKV_TYPE_CODE(int3, "int32", 3)
MINIKV_TYPE_CODE(int4, "int32", 4)
MINIKV_TYPE_CODE(uint2, "uint32", 2)
MINIKV_TYPE_CODE(uint3, "uint32", 3)
MINIKV_TYPE_CODE(uint4, "uint32", 4)
MINIKV_TYPE_CODE(short2, "int16", 2)
MINIKV_TYPE_CODE(short4, "int16", 4)
MINIKV_TYPE_CODE(ushort2, "uint16", 2)
MINIKV_TYPE_CODE(ushort4, "uint16", 4)
MINIKV_TYPE_CODE(char2, "int8", 2)
MINIKV_TYPE_CODE(char4, "int8", 4)
MINIKV_TYPE_CODE(uchar2, "uint8", 2)
MINIKV_TYPE_CODE(uchar4, "uint8", 4)
MINIKV_TYPE_CODE(longlong2, "int64", 2)
MINIKV_TYPE_CODE(ulonglong2, "uint64", 2)

template <class T>
constexpr ParamInfo describe_param() {
    if constexpr (std::is_pointer<T>::value) {
        using P = typename std::remove_pointer<T>::type;
        using E = typename std::remove_cv<P>::type;
        return ParamInfo{1, std::is_const<P>::value, TypeCode<E>::dtype(), TypeCode<E>::lanes(), sizeof(T)};
    } else {
        return ParamInfo{0, 0, TypeCode<T>::dtype(), TypeCode<T>::lanes(), sizeof(T)};
    }
}
// Writes up to `capacity` parameter descriptions of kernel to out; returns the parameter count.
template <class... A>
int describe_params(void (*)(A...), ParamInfo* out, int capacity) {
    const ParamInfo table[] = {describe_param<A>()..., ParamInfo{0, 0, nullptr, 0, 0}};
    for (int i = 0; i < (int)sizeof...(A) && i < capacity; ++i) out[i] = table[i];
    return (int)sizeof...(A);
}

// Calls kernel(args...) where args[i] points at the i-th argument's bytes (as cuLaunchKernel).
template <class... A, std::size_t... I>
void invoke_unpacked(void (*kernel)(A...), void** args, std::index_sequence<I...>) {
    kernel(*static_cast<A*>(args[I])...);
}
template <class... A>
void invoke(void (*kernel)(A...), void** args) {
    invoke_unpacked(kernel, args, std::index_sequence_for<A...>{});
}
}  // namespace minikv_sim

#endif  // MINIKV_CUDA_SIM_H
