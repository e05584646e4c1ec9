// kv_cache.cu: step 2, the contiguous KV cache (minikv/kv_cache.py) on the GPU.
//
// Storage (one array for K, one for V):
//     cache[layer, slot, kv_head, position, dim]   shape [L, max_seqs, Hkv, max_len, D]
// of CACHE_T: float (CACHE_HALF=0) or __half (CACHE_HALF=1). One sequence's history for
// one KV head is a contiguous [len, D] block, so attention streams it with 16-byte loads.
//
// Tokens of all sequences in a step are packed along N. For every packed token n the
// host passes slot[n] (the sequence's cache slot) and pos[n] (its absolute position):
// token n's K/V go to position pos[n], and its query sees positions 0 .. pos[n].
//
// Kernels (<op>_v<N>; the same N means the same idea in every .cu: v1 one block per
// (token, KV head) over the whole history, v2 split-K + the shared reduce, v3 the
// register-resident, bandwidth-bound decode kernel of decode_v3.cuh):
//   cache_write_v1          append the step's new K/V rows
//   decode_attention_v1     attention of the step's queries over the cache, one block per
//                           (token, KV head) (RoPE and the cache write are separate launches)
//   decode_attention_v2     the same, split-K: block (token, KV head, split) attends one key
//                           range and writes a partial; attention_reduce_v2 merges them
//   rope_write_attend_v1    fused, for decode steps (one new token per sequence): RoPE on q
//                           and k + cache write + attention in one launch, one block per
//                           (token, KV head)
//   rope_write_attend_v2    the fused kernel, split-K (+ attention_reduce_v2)
//   decode_attention_v3     decode attention with K/V loaded straight into registers (16-byte
//                           loads, D/8 lanes per key, the GQA group's queries in registers, no
//                           barrier in the key loop); split by versions.split_plan (+ the reduce)
//   decode_attention_v4     the same with the next iteration's loads in flight (decode_v4.cuh)
//   attention_reduce_v2     split_k.cuh's, shared with paged.cu: merges split partials
// The key loop is attend_tiles.cuh's and the softmax online_softmax.cuh's, as in attention.cu
// and paged.cu.
//
// Every attention kernel here (decode v1-v4, fused v1/v2) takes online_softmax.cuh's two options as its
// last three arguments (sinks, use_sinks, softcap): learned sinks (gpt-oss) and tanh soft-capping
// (Gemma 2). v1/v2 start split 0's rows from the sink and cap each score in attend_tiles; v3/v4 cap in
// decode::softmax_update (log2 units) and merge the sink in decode::finish of split 0's block. Either
// way a split-K reduce counts each sink once.
//
// Version log (llm.c style):
//   v1  one block per (token, KV head), the G query heads of the GQA group one warp each, so each
//       K/V tile is read once per group. Before the renumbering, decode_attention_v1 did both v1 and
//       v2 (its grid z split the keys, merged by decode_attention_combine_v1, which took unnormalized
//       partials while paged.cu's reduce took normalized ones): both now share split_k.cuh's layout.
//   v2  split-K (flash-decoding, vLLM's v2): a decode step with few sequences still fills the GPU.
//   rope_write_attend_v1/v2 were decode_attention_v2 (one kernel, split by grid z): "fused" is an
//       op of its own, not a version of decode attention.
//   v3  register-resident decode (decode_v3.cuh), for decode steps. Why: v1/v2 stage K/V in shared
//       memory as fp32 and read one 4-byte word back per multiply-add; from the ptxas report that caps
//       them near 45% of the H200's copy bandwidth whatever the split count (prediction: fp16 and fp32
//       caches take about the same time there). v3 reads each K/V element once from HBM into registers:
//       bytes per key and KV head 2*D*sizeof(CACHE_T) (D=128: 512 fp16, 1024 fp32); each 16-byte fp16
//       load feeds 8*G multiply-adds (2*G*D FMAs per key: 2 FMA/byte at G=4 fp16); per lane 2*UNROLL
//       16-byte loads in flight before the first use (fp16 G<=4: 4 keys, 128 B; 16 warps per SM: 64 KB
//       in flight per SM against ~25 KB by Little's law at 4.8 TB/s and ~0.7 us). Expected on an H200,
//       goal case (B=64, S=4096, 32/8 heads, D=128, fp16: 1.07 GB of K/V): 512 blocks, one wave of
//       4 per SM, no split, >= 85% of the measured copy (~260 us at 4.1 TB/s); fp32 about twice fp16's
//       time. Risk: issue slots (~66 warp-instructions per key, about half the memory time).
//       ptxas (nvcc 13.0, sm_80/sm_90, D 64/128, fp32/fp16, G 1/3/4/8): decode_attention_v3 64-72
//       registers at G=1, 106-125 at G=3, 118-128 at G=4 (capped by __launch_bounds__(128, 4)),
//       205-245 at G=8 (__launch_bounds__(128, 2)); 0 spills, no stack frame; NVRTC compiles every
//       define set. No GPU has run it yet.
//   v4  decode_v4.cuh (paged.cu's log has the list): the next iteration's K/V loads issued before this
//       iteration's math, warps on contiguous keys, the transposed reduction, the rescale skipped where no
//       max moved, 16 dims per lane at head_dim 128 (G <= 4). v3 now runs the same per-iteration math
//       through a key policy (DenseKeys): ptxas 64-71 / 105-126 / 118-126 / 208-253 at G 1/3/4/8.
//       Predicted (results/gpu_model.json, goal case): 268 us, 98% of the copy (v3 the same: both copy-bound
//       by the model; v4 issues 522-622 instructions per warp-iteration of 8 keys against v3's 691).
//       ptxas: decode_attention_v4 66-112 registers at G=1, 101-219 at G=3, 120-245 at G=4, 196-244 at G=8;
//       0 spills. Measured: waits for a GPU.
//   options (issue 23): learned sinks and soft-capping reached v3/v4 and the fused kernels (before: v1/v2
//       only, and kv_cache.py refused them elsewhere). The cap is a uniform branch per score in the key loop;
//       the sink one more term in finish's cross-warp merge. ptxas (nvcc 13.0, sm_80/sm_90, every define set
//       above) against the committed nvcc_report.json: decode_attention_v3 68-252 registers (was 64-253; one
//       set +25), v4 68-250 (was 66-245), v1 32-40, v2 32-44, rope_write_attend_v1 39-44, _v2 39-44 (+5 at
//       most); paged.cu's v3 71-255 (was 69-246), v4 71-255; 0 spills and no stack frame anywhere. Time:
//       waits for a GPU (the cap's tanhf per score is the cost to watch on a decode step that uses it).
//   Measured: no GPU has run these kernels yet. ptxas (benchmarks/results/nvcc_report.json, nvcc
//   13.0, D=64/128, fp32/fp16 caches, sm_80/sm_90), registers: cache_write_v1 30,
//   decode_attention_v1 32-40 and v2 32-40 (before the shared core: 31-40 and, for the old fused
//   kernel, 32-40), rope_write_attend_v1 36-41, rope_write_attend_v2 34-44, attention_reduce_v2
//   31-32 (the old combine: 30-32); 0 spills and no stack frame anywhere.
//
// Offsets into the cache are computed in 64-bit: L*max_seqs*Hkv*max_len*D passes 2^31
// easily (30 layers * 64 seqs * 3 heads * 8192 positions * 64 dims = 3.0e9).
//
// nvcc-check: HEAD_DIM=64,128 CACHE_HALF=0,1 GQA_GROUP=1,3,4,8

#include "attend_tiles.cuh"  // common.cuh (cache_t, load8/store8, reductions), online_softmax.cuh
#include "split_k.cuh"       // write_partial, attention_reduce_v2
#include "decode.cuh"         // decode::run, the v3 and v4 key loops

// Element offset of cache[layer, slot, head, 0, 0], in 64 bits.
__device__ __forceinline__ long long cache_offset(int layer, int slot, int head, int max_seqs, int n_kv_heads,
                                                  int max_len) {
    return row_offset(((long long)layer * max_seqs + slot) * n_kv_heads + head, max_len, 0);
}

// ---------------------------------------------------------------------------
// cache_write_v1: cache[layer, slot[n], h, pos[n], :] = new[n, h, :] for K and V.
//
//   k_new, v_new: [N, Hkv, D] float32 (keys already rotated)
//   grid  = (ceil(N*Hkv*D/8 / 256)), block = (256): one thread per 8 consecutive dims
//   bytes: reads 2 * 4*N*Hkv*D, writes 2 * sizeof(CACHE_T)*N*Hkv*D (16-byte accesses).
// ---------------------------------------------------------------------------
extern "C" __global__ void cache_write_v1(const float* __restrict__ k_new, const float* __restrict__ v_new,
                                          cache_t* k_cache, cache_t* v_cache, const int* __restrict__ slot,
                                          const int* __restrict__ pos, int layer, int n_tokens, int n_kv_heads,
                                          int max_seqs, int max_len) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;  // which vector of 8
    const long long per_token = (long long)n_kv_heads * (HEAD_DIM / VEC);
    if (i >= n_tokens * per_token) return;
    const int n = (int)(i / per_token);
    const int h = (int)((i % per_token) / (HEAD_DIM / VEC));
    const int d = (int)(i % (HEAD_DIM / VEC)) * VEC;
    const long long src = ((long long)n * n_kv_heads + h) * HEAD_DIM + d;
    const long long head = cache_offset(layer, slot[n], h, max_seqs, n_kv_heads, max_len);
    const long long dst = head + (long long)pos[n] * HEAD_DIM + d;
    write_kv8(k_new, v_new, src, k_cache, v_cache, dst);
}

// What block (n, h, z) of every attention kernel here works on: the key range
// [z * keys_per_split, min(pos[n] + 1, (z + 1) * keys_per_split)) of cache (layer, slot[n], h).
// v1 kernels pass keys_per_split = max_len (one range, z = 0).
struct CacheBlock {
    int n, h, z, group, k_begin, k_end;
    long long head_base;  // element offset of cache[layer, slot[n], h, 0, 0]
    long long q_base;     // element offset of query (n, h*G) in [N, Hq, D]
};

__device__ __forceinline__ CacheBlock cache_block(const int* slot, const int* pos, int layer, int n_heads,
                                                  int n_kv_heads, int max_seqs, int max_len, int keys_per_split) {
    CacheBlock c;
    c.n = blockIdx.x, c.h = blockIdx.y, c.z = blockIdx.z;
    c.group = n_heads / n_kv_heads;
    c.k_begin = c.z * keys_per_split;
    c.k_end = min(pos[c.n] + 1, c.k_begin + keys_per_split);
    c.head_base = cache_offset(layer, slot[c.n], c.h, max_seqs, n_kv_heads, max_len);
    c.q_base = row_offset(c.n, n_heads, (long long)c.h * c.group);
    return c;
}

// The fused prologue's inputs (rope_write_attend_v1/v2); q_raw == nullptr: not fused.
struct RopeWrite {
    const float *q_raw, *k_raw, *v_new, *cos_t, *sin_t;
    int half_layout;
    cache_t *k_cache, *v_cache;  // the same arrays the block then reads
};

__device__ __forceinline__ void rope_and_write(const CacheBlock& c, const RopeWrite& f, int p_n, int n_kv_heads,
                                               float* q_s);

// The body of every attention kernel here, block (n, h, z): the group's G queries into shared
// memory (copied from q, or rotated by the fused prologue, which also appends the new K/V row),
// attention over the block's key range, and each warp's result written normalized into out (v1)
// or as split partial (n, h*G + warp, z) (v2, part_m != nullptr). opt: the learned sinks (split 0
// starts from them, so the reduce's merge counts each once) and the soft cap (per tile, attend_tiles).
__device__ __forceinline__ void cache_attention(const CacheBlock& c, const float* q, const RopeWrite& f,
                                                const cache_t* k_cache, const cache_t* v_cache, const int* pos,
                                                int n_kv_heads, float scale, float* out, float* part_m,
                                                float* part_l, float* part_acc, int n_splits,
                                                const online_softmax::Options& opt) {
    __shared__ float k_s[KEY_TILE][HEAD_DIM + 1];            // +1 float per row: lane j reads row j bank-free
    __shared__ __align__(16) float v_s[KEY_TILE][HEAD_DIM];  // float4 stores: 16-byte aligned rows
    extern __shared__ float q_s[];                            // [G][D]
    const int warp = threadIdx.x >> 5;
    if (f.q_raw != nullptr) rope_and_write(c, f, pos[c.n], n_kv_heads, q_s);
    else load_queries(q + c.q_base, q_s, c.group * HEAD_DIM);
    DenseRows rows{c.head_base};
    const long long row = c.q_base / HEAD_DIM + warp;  // (n, h*G + warp)
    online_softmax::State s = online_softmax::start(opt, c.h * c.group + warp, c.z == 0);  // one split: the sink once
    attend_tiles(k_cache, v_cache, rows, c.k_begin, c.k_end, c.k_end, q_s + warp * HEAD_DIM, k_s, v_s, scale, s,
                 opt.softcap);
    if (part_m == nullptr) online_softmax::finish(s, out + row * HEAD_DIM);
    else write_partial(s, part_m, part_l, part_acc, row * n_splits + c.z);
}

// ---------------------------------------------------------------------------
// decode_attention_v1: out[n, h*G + g, :] = attention of query (n, h*G+g) over cache
// positions 0 .. pos[n] of slot[n], KV head h.
//
//   q:    [N, Hq, D] float32, already rotated;   G = Hq / Hkv query heads per KV head
//   grid  = (N, Hkv)       block (n, h) serves the whole GQA group of KV head h
//   block = (32 * G)       warp g owns query head h*G + g
//   shared: static K tile 32*(D+1) + V tile 32*D floats (D=64: 16.3 KB, D=128: 32.5 KB),
//           dynamic G*D floats for the queries (launch with shared_mem = 4*G*D)
//   bytes: reads 4*N*Hq*D (q) + 2 * sizeof(CACHE_T) * Hkv*D * sum_n (pos[n]+1) (K and V, each
//          element once per GQA group, not once per query head), writes 4*N*Hq*D.
//   options: sinks [Hq] float32 (read when use_sinks), softcap (> 0: cap each scaled score); every
//            kernel below takes them last, the same way
// ---------------------------------------------------------------------------
extern "C" __global__ void decode_attention_v1(const float* __restrict__ q, const cache_t* __restrict__ k_cache,
                                               const cache_t* __restrict__ v_cache, const int* __restrict__ slot,
                                               const int* __restrict__ pos, float* __restrict__ out, int layer,
                                               int n_heads, int n_kv_heads, int max_seqs, int max_len, float scale,
                                               const float* __restrict__ sinks, int use_sinks, float softcap) {
    const CacheBlock c = cache_block(slot, pos, layer, n_heads, n_kv_heads, max_seqs, max_len, max_len);
    cache_attention(c, q, RopeWrite{}, k_cache, v_cache, pos, n_kv_heads, scale, out, nullptr, nullptr, nullptr, 1,
                    online_softmax::Options{sinks, use_sinks, softcap});
}

// ---------------------------------------------------------------------------
// decode_attention_v2 (split-K, flash-decoding): as v1, but block (n, h, z) attends keys
// [z*keys_per_split, (z+1)*keys_per_split) ∩ [0, pos[n]] only and writes split partials
// (split_k.cuh's layout); attention_reduce_v2 merges them. A long sequence gets more than one
// block, so a decode step with few sequences still fills the GPU.
//
//   grid  = (N, Hkv, Z)    splits past a token's history leave at once (write nothing)
//   block, shared: as v1
//   bytes: v1's reads; writes 4*N*Hq*Zu*(D+2) partials (Zu = splits holding keys), read back
//          by attention_reduce_v2.
// ---------------------------------------------------------------------------
extern "C" __global__ void decode_attention_v2(const float* __restrict__ q, const cache_t* __restrict__ k_cache,
                                               const cache_t* __restrict__ v_cache, const int* __restrict__ slot,
                                               const int* __restrict__ pos, float* __restrict__ part_m,
                                               float* __restrict__ part_l, float* __restrict__ part_acc, int layer,
                                               int n_heads, int n_kv_heads, int max_seqs, int max_len,
                                               int keys_per_split, int n_splits, float scale,
                                               const float* __restrict__ sinks, int use_sinks, float softcap) {
    const CacheBlock c = cache_block(slot, pos, layer, n_heads, n_kv_heads, max_seqs, max_len, keys_per_split);
    if (c.k_begin >= c.k_end) return;  // this split lies past the sequence's end (whole block leaves)
    cache_attention(c, q, RopeWrite{}, k_cache, v_cache, pos, n_kv_heads, scale, nullptr, part_m, part_l, part_acc,
                    n_splits, online_softmax::Options{sinks, use_sinks, softcap});
}

// The fused prologue (rope_write_attend_v1/v2):
//   1. rotate the G raw queries of the group into shared memory, one thread per (query, pair);
//   2. the block whose key range holds position p_n = pos[n] rotates the raw key and writes key
//      and value into the cache (rounded to CACHE_T, exactly as cache_write_v1 stores them).
// (attend_tiles starts with __syncthreads(): it orders both writes before any read.)
__device__ __forceinline__ void rope_and_write(const CacheBlock& c, const RopeWrite& f, int p_n, int n_kv_heads,
                                               float* q_s) {
    const int half = HEAD_DIM / 2;
    const float* cs = f.cos_t + (long long)c.n * half;
    const float* sn = f.sin_t + (long long)c.n * half;
    for (int i = threadIdx.x; i < c.group * half; i += blockDim.x) {
        const int g = i / half, j = i % half;
        const int ia = f.half_layout ? j : 2 * j, ib = f.half_layout ? j + half : 2 * j + 1;
        const float a = f.q_raw[c.q_base + g * HEAD_DIM + ia], b = f.q_raw[c.q_base + g * HEAD_DIM + ib];
        q_s[g * HEAD_DIM + ia] = a * cs[j] - b * sn[j];
        q_s[g * HEAD_DIM + ib] = b * cs[j] + a * sn[j];
    }
    if (p_n >= c.k_end) return;  // i.e. p_n == k_end - 1: only the last non-empty range writes
    const long long src = row_offset(c.n, n_kv_heads, c.h);
    const long long dst = c.head_base + (long long)p_n * HEAD_DIM;
    for (int j = threadIdx.x; j < half; j += blockDim.x) {
        const int ia = f.half_layout ? j : 2 * j, ib = f.half_layout ? j + half : 2 * j + 1;
        const float a = f.k_raw[src + ia], b = f.k_raw[src + ib];
        f.k_cache[dst + ia] = to_cache(a * cs[j] - b * sn[j]);
        f.k_cache[dst + ib] = to_cache(b * cs[j] + a * sn[j]);
        f.v_cache[dst + ia] = to_cache(f.v_new[src + ia]);
        f.v_cache[dst + ib] = to_cache(f.v_new[src + ib]);
    }
}

// ---------------------------------------------------------------------------
// rope_write_attend_v1, the fused kernel: for decode steps (one new token per sequence) it
// does in one launch what the unfused path needs three for (rope_v1 on q and k, cache_write_v1,
// decode_attention_v1): rope_and_write (above), then attention over the cache, the new row
// included, read back like any other row.
//
//   q_raw: [N, Hq, D], k_raw/v_new: [N, Hkv, D] float32 (pre-RoPE q and k)
//   cos, sin: [N, D/2] float32 at each token's position; half_layout as in rope_v1
//   grid, block, shared: as decode_attention_v1 (shared_mem = 4*G*D)
//   bytes: decode_attention_v1's, plus reads 4*N*D (cos, sin per block) and 2 * 4*N*Hkv*D (new
//          K/V, only by the writing block), writes 2 * sizeof(CACHE_T)*N*Hkv*D; saves the round
//          trips of the rotated q and k through device memory and two launches.
//
// Why one token per sequence: block (n, h) reads keys of its own sequence only up to pos[n].
// Two new tokens of one sequence would need each other's keys, written by another block of
// the same launch, and blocks of one launch are not ordered.
// Why k_cache/v_cache are neither const nor __restrict__ here: the block reads back what it
// wrote, and a const __restrict__ pointer lets the compiler use the read-only data path,
// which is not coherent with writes made during the kernel. The __syncthreads() after the
// write makes the block's global writes visible to all its threads.
// ---------------------------------------------------------------------------
extern "C" __global__ void rope_write_attend_v1(const float* __restrict__ q_raw, const float* __restrict__ k_raw,
                                                const float* __restrict__ v_new, const float* __restrict__ cos_t,
                                                const float* __restrict__ sin_t, int half_layout, cache_t* k_cache,
                                                cache_t* v_cache, const int* __restrict__ slot,
                                                const int* __restrict__ pos, float* __restrict__ out, int layer,
                                                int n_heads, int n_kv_heads, int max_seqs, int max_len, float scale,
                                                const float* __restrict__ sinks, int use_sinks, float softcap) {
    const CacheBlock c = cache_block(slot, pos, layer, n_heads, n_kv_heads, max_seqs, max_len, max_len);
    const RopeWrite f{q_raw, k_raw, v_new, cos_t, sin_t, half_layout, k_cache, v_cache};
    cache_attention(c, nullptr, f, k_cache, v_cache, pos, n_kv_heads, scale, out, nullptr, nullptr, nullptr, 1,
                    online_softmax::Options{sinks, use_sinks, softcap});
}

// ---------------------------------------------------------------------------
// rope_write_attend_v2: the fused kernel, split-K. Every block (n, h, z) rotates the queries,
// the block whose range holds pos[n] writes the new row, and each attends its own range and
// writes split partials (split_k.cuh) for attention_reduce_v2. The ranges before the last
// never need the new row, so the blocks stay independent.
//
//   grid  = (N, Hkv, Z), block, shared: as rope_write_attend_v1
//   bytes: rope_write_attend_v1's reads (cos, sin, q per block); writes as decode_attention_v2.
// ---------------------------------------------------------------------------
extern "C" __global__ void rope_write_attend_v2(const float* __restrict__ q_raw, const float* __restrict__ k_raw,
                                                const float* __restrict__ v_new, const float* __restrict__ cos_t,
                                                const float* __restrict__ sin_t, int half_layout, cache_t* k_cache,
                                                cache_t* v_cache, const int* __restrict__ slot,
                                                const int* __restrict__ pos, float* __restrict__ part_m,
                                                float* __restrict__ part_l, float* __restrict__ part_acc, int layer,
                                                int n_heads, int n_kv_heads, int max_seqs, int max_len,
                                                int keys_per_split, int n_splits, float scale,
                                                const float* __restrict__ sinks, int use_sinks, float softcap) {
    const CacheBlock c = cache_block(slot, pos, layer, n_heads, n_kv_heads, max_seqs, max_len, keys_per_split);
    if (c.k_begin >= c.k_end) return;
    const RopeWrite f{q_raw, k_raw, v_new, cos_t, sin_t, half_layout, k_cache, v_cache};
    cache_attention(c, nullptr, f, k_cache, v_cache, pos, n_kv_heads, scale, nullptr, part_m, part_l, part_acc,
                    n_splits, online_softmax::Options{sinks, use_sinks, softcap});
}

// The key policy of a contiguous history (decode_core.cuh): key j of (slot, head) is row base + j*D.
template <int DIMS, int KEYS>
struct DenseKeys : decode::PlainRows<DIMS, KEYS> {
    long long base;  // element offset of cache[layer, slot[n], h, 0, 0]
    __device__ __forceinline__ int ahead(int, int) const { return 0; }  // nothing to look up
    __device__ __forceinline__ void load(int key, int k_end, int, int, int d0,
                                         typename DenseKeys::Raw& r) const {
        this->load_row(base + (long long)key * HEAD_DIM + d0, key < k_end, r);
    }
};

// Block (n, h, z) of decode_attention_v3/v4: the group's queries over its key range with loop V.
template <int V, int DIMS, int KEYS>
__device__ __forceinline__ void dense_decode(const float* q, const cache_t* k_cache, const cache_t* v_cache,
                                             const int* slot, const int* pos, const decode::Dest& dest, int layer,
                                             int n_heads, int n_kv_heads, int max_seqs, int max_len,
                                             int keys_per_split, float scale, const online_softmax::Options& opt) {
    if (n_heads != GQA_GROUP * n_kv_heads) __trap();  // compiled for another group size: a launcher bug
    const CacheBlock c = cache_block(slot, pos, layer, n_heads, n_kv_heads, max_seqs, max_len, keys_per_split);
    if (c.k_begin >= c.k_end) return;  // the whole block leaves together, before the one barrier
    DenseKeys<DIMS, KEYS> pol;
    pol.k = k_cache, pol.v = v_cache, pol.base = c.head_base;
    decode::run<V>(pol, q + c.q_base, scale, c.k_begin, c.k_end, dest, opt, c.h * GQA_GROUP);
}

// The parameters of decode_attention_v3 and _v4 (one list, so that the two kernels cannot drift apart).
#define DENSE_DECODE_PARAMS                                                                                          \
    const float *__restrict__ q, const cache_t *__restrict__ k_cache, const cache_t *__restrict__ v_cache,          \
        const int *__restrict__ slot, const int *__restrict__ pos, float *__restrict__ out,                          \
        float *__restrict__ part_m, float *__restrict__ part_l, float *__restrict__ part_acc, int layer, int n_heads, \
        int n_kv_heads, int max_seqs, int max_len, int keys_per_split, int n_splits, float scale,                   \
        const float *__restrict__ sinks, int use_sinks, float softcap
#define DENSE_DECODE_DEST \
    decode::Dest{out, part_m, part_l, part_acc, (long long)blockIdx.x * n_heads + (long long)blockIdx.y * GQA_GROUP, \
                 (int)blockIdx.z, n_splits}
#define DENSE_DECODE_ARGS \
    q, k_cache, v_cache, slot, pos, DENSE_DECODE_DEST, layer, n_heads, n_kv_heads, max_seqs, max_len, keys_per_split, \
        scale, online_softmax::Options{sinks, use_sinks, softcap}

// ---------------------------------------------------------------------------
// decode_attention_v3 (register-resident, bandwidth-bound; decode_v3.cuh): block (n, h, z) attends
// the GQA_GROUP queries of token n, KV head h, over keys [z*keys_per_split, (z+1)*keys_per_split)
// ∩ [0, pos[n]], K and V loaded straight into registers with 16-byte loads (D/8 lanes per key),
// no shared-memory staging and no barrier in the key loop. n_splits == 1: out is written
// normalized; else split partials (split_k.cuh's layout, natural-log m) for attention_reduce_v2.
//
//   q: [N, Hq, D] float32, already rotated; Hq = GQA_GROUP * Hkv (compile-time group size)
//   part_m, part_l: [N, Hq, Z], part_acc: [N, Hq, Z, D] float32 (Z = n_splits; unused when 1)
//   grid  = (N, Hkv, Z)   splits past a token's history leave at once (write nothing)
//   block = (128)         4 warps; lane group of D/8 lanes per key (see decode_v3.cuh)
//   shared: static 4*G*(D+2) floats for the one cross-warp merge; no dynamic shared memory
//   bytes: reads 4*N*Hq*D (q) + 2 * sizeof(CACHE_T) * Hkv*D * sum_n (pos[n]+1) (each K/V element
//          once per GQA group), writes 4*N*Hq*D (unsplit) or 4*N*Hq*Zu*(D+2) partials.
// ---------------------------------------------------------------------------
extern "C" __global__ void V3_LAUNCH_BOUNDS decode_attention_v3(DENSE_DECODE_PARAMS) {
    dense_decode<3, decode_v3::DIMS, decode_v3::ROW_KEYS>(DENSE_DECODE_ARGS);
}

// ---------------------------------------------------------------------------
// decode_attention_v4 (decode_v4.cuh): decode_attention_v3's work, arguments and outputs, with the next
// iteration's K/V loads in flight during this one's math, a transposed reduction, the rescale skipped
// where no max moved, and 16 dims per lane at head_dim 128 (G <= 4).
//
//   grid  = (N, Hkv, Z), block = (128): warp w takes keys w0 .. w0 + KW - 1 of each iteration
//   shared, bytes: as decode_attention_v3 (the same K/V bytes: each element once per GQA group)
// ---------------------------------------------------------------------------
constexpr int DENSE_V4_KEYS = decode_v4::keys_for(decode_v4::ROW_DIMS, 2 * decode_v4::ROW_DIMS * (int)sizeof(cache_t));

extern "C" __global__ void __launch_bounds__(128, V4_BLOCKS_PER_SM(decode_v4::ROW_DIMS))
    decode_attention_v4(DENSE_DECODE_PARAMS) {
    dense_decode<4, decode_v4::ROW_DIMS, DENSE_V4_KEYS>(DENSE_DECODE_ARGS);
}
