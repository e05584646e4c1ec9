// paged.cu: step 3, the paged KV cache (minikv/paged/) on the GPU.
//
// Storage: one pool for K and one for V per layer, cut into fixed-size blocks of token slots:
//     k_pool[block, offset, kv_head, dim]   shape [num_blocks, block_size, Hkv, D]
// (the cache keeps all layers as [L, num_blocks, block_size, Hkv, D]; the attention and write
// kernels get one layer's pool, a contiguous view). Elements are CACHE_T: float (CACHE_HALF=0)
// or __half (CACHE_HALF=1); queries, new K/V and outputs are float32.
//
// A *slot* names one token row of a pool: slot = block_id * block_size + offset. Sequence b's
// position p lives in slot block_tables[b, p / block_size] * block_size + p % block_size, so a
// kernel reads a sequence's history through its block table, one table entry per block_size keys.
//
// Kernels (<op>_v<N>, vLLM's names; the same N means the same idea in every .cu: v1 one block
// per (token, KV head) over the whole context, v2 split-K + the shared reduce, v3 the
// register-resident, bandwidth-bound decode kernel of decode_v3.cuh, v4 v3 with the next iteration's
// loads in flight, decode_v4.cuh):
//   reshape_and_cache           write the step's new K/V rows through the slot mapping
//   paged_decode_attention_v1   one thread block per (query token, KV head) walks the whole context
//   paged_decode_attention_v2   split-K: one thread block per (query token, KV head, partition)
//   attention_reduce_v2         split_k.cuh's, shared with kv_cache.cu: merges v2's partitions,
//                               rescaling each by exp(m_i - m)
//   paged_decode_attention_v3   decode attention with K/V read through the block table straight
//                               into registers (decode_v3.cuh); split by versions.split_plan
//   paged_decode_attention_v4   the same, with the next iteration's block-table entries and K/V
//                               loads in flight during this one's math (decode_v4.cuh)
//   copy_blocks                 copies whole blocks, all layers, K and V (copy-on-write, swap)
// The key loop is attend_tiles.cuh's (with PagedRows, below) and the softmax online_softmax.cuh's,
// as in attention.cu and kv_cache.cu. Every attention kernel here takes online_softmax.cuh's options last
// (sinks [Hq], use_sinks, softcap), as kv_cache.cu's do: learned sinks (partition 0 carries them, so the
// reduce counts each once) and tanh soft-capping of each score before the max.
//
// Version log (llm.c style):
//   v1  one block per (token, KV head), the GQA group's G query heads one warp each: a group's
//       K/V is read once (FlashInfer's habit), not once per query head.
//   v2  split-K (vLLM's v2, flash-decoding). Its partitions used to write partials normalized by
//       their own sum, merged by paged_attention_reduce_v2 with weights exp(m_i - m) * l_i; they
//       now write split_k.cuh's unnormalized (m, l, acc), merged by the shared attention_reduce_v2.
//   v3  register-resident decode (decode_v3.cuh; kv_cache.cu's log has the reasoning): no shared-memory
//       staging, each key's row looked up in the block table by its lane group (one broadcast 4-byte
//       load per key, L1 after the first of a block), 16-byte loads of K/V straight into registers,
//       all G queries of the group in registers, no barrier in the key loop; the grid splits into
//       whole partitions, as many as bring N*Hkv blocks nearest one wave (4 per SM for G <= 4, 2 above).
//       Expected on an H200: as kv_cache.cu's decode_attention_v3 (>= 85% of the copy on the goal
//       case), the table lookups costing a few percent (a shift and a mask per key and lane for a
//       power-of-two block size, an integer division otherwise).
//       ptxas (nvcc 13.0): paged_decode_attention_v3 64-80 registers at G=1, 106-128 at G=3, 122-128
//       at G=4, 209-239 at G=8; 0 spills, no stack frame; NVRTC compiles. No GPU has run it yet.
//       Since v4: the same loop through a key policy (PagedKeys, decode_core.cuh), the split count by
//       versions.split_plan (even tile-aligned ranges, the count wasting the least of the last wave) instead
//       of whole 512-key partitions nearest one wave; ptxas 69-80 / 109-128 / 119-128 / 210-246.
//   v4  decode_v4.cuh: the block-table entries a warp's next keys need are loaded once, one lane per entry,
//       an iteration ahead of the K/V loads that use them (shuffled to the lanes), so a K/V load never waits
//       for a table load; the K/V loads of iteration i+1 are issued before iteration i's math (register
//       double-buffering); warps take contiguous keys; a transposed reduction of the partial dots (about 2
//       shuffles per value instead of log2 of the lanes); the rescale skipped where no max moved; 16 dims
//       per lane at head_dim 128 (G <= 4: 8 lanes per key), 2 keys per subgroup and buffer at 2 blocks per
//       SM; the block size a compile-time power of two (KV_BLOCK; 0 divides at run time).
//       Predicted (benchmarks/gpu_model.py, results/gpu_model.json, goal case B=64, S=4096, 32/8 heads,
//       D=128, fp16): 268 us, 98% of the copy, copy-bound like v3 (v3: 879 instructions and 64 shuffles per
//       warp-iteration of 8 keys; v4: 569-669 and 16), 2 blocks per SM at 247 registers (v3: 4 at 128).
//       ptxas: 72-115 registers at G=1, 112-223 at G=3, 122-254 at G=4, 204-250 at G=8; 0 spills, no stack
//       frame; NVRTC compiles. Measured: waits for a GPU (benchmarks/gpu_check.py times it beside v3).
//   Measured: no GPU has run these kernels yet. ptxas (benchmarks/results/nvcc_report.json, nvcc
//   13.0, D=64/128, fp32/fp16 pools, sm_80/sm_90), registers: paged_decode_attention_v1 31-40 and
//   v2 31-43 (before the shared core: 32-48 both), attention_reduce_v2 31-32 (the old
//   paged_attention_reduce_v2: 31-32), reshape_and_cache 30, copy_blocks 26-28; 0 spills and no
//   stack frame anywhere.
//
// Packed queries. The attention kernels take one query row per *token*, with the sequence it
// belongs to (token_seq[n]) and its position (token_pos[n]: it sees keys 0 .. token_pos[n]). In
// a decode step a token is a sequence, as in vLLM's decode kernels; a prefill step of T tokens
// runs T rows whose positions differ, which makes the same kernels causal prefill attention too.
//
// Offsets are 64-bit: slot * Hkv * D passes 2^31 long before memory runs out
// (2^18 blocks * 16 slots * 8 heads * 128 dims = 2^32 elements, past the int32 limit 2^31 - 1).
//
// Stale slots: the last block of a sequence is partly filled; its other slots hold whatever the
// block's previous owner left (possibly NaN). They are never read: a tile's rows past the
// context are zero-filled instead (attend_tiles.cuh), since 0 * NaN = NaN would poison the sum.
//
// nvcc-check: HEAD_DIM=64,128 CACHE_HALF=0,1 GQA_GROUP=1,3,4,8 KV_BLOCK=16
// nvcc-check: HEAD_DIM=128 CACHE_HALF=1 GQA_GROUP=4 KV_BLOCK=0,1

#include "attend_tiles.cuh"  // common.cuh (cache_t, load8/store8, reductions), online_softmax.cuh
#include "split_k.cuh"       // write_partial, attention_reduce_v2
#include "decode.cuh"         // decode::run, the v3 and v4 key loops

// ---------------------------------------------------------------------------
// reshape_and_cache: pool[slot_mapping[n], h, :] = new[n, h, :] for K and V of one layer.
// (vLLM's name; its pools have a [.., D/x, block_size, x] key layout that needs the reshape.
// Here a slot's Hkv*D values are contiguous, so the "reshape" is the identity.)
//
//   k_new, v_new:  [N, Hkv, D] float32 (keys already rotated)
//   k_pool, v_pool: [num_blocks * block_size, Hkv, D] CACHE_T (one layer)
//   slot_mapping:  [N] int64; a negative slot is skipped (vLLM's padding tokens)
//   grid  = (ceil(N*Hkv*D/8 / 256)), block = (256): one thread per 8 consecutive dims
//   bytes: reads 8*N + 2 * 4*N*Hkv*D, writes 2 * sizeof(CACHE_T)*N*Hkv*D (skipped slots: none)
// ---------------------------------------------------------------------------
extern "C" __global__ void reshape_and_cache(const float* __restrict__ k_new, const float* __restrict__ v_new,
                                             cache_t* __restrict__ k_pool, cache_t* __restrict__ v_pool,
                                             const long long* __restrict__ slot_mapping, int n_tokens,
                                             int n_kv_heads) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;  // which vector of 8
    const long long per_token = (long long)n_kv_heads * (HEAD_DIM / VEC);
    if (i >= n_tokens * per_token) return;
    const long long n = i / per_token;
    const long long slot = slot_mapping[n];
    if (slot < 0) return;
    const long long within = (i % per_token) * VEC;  // h * D + d: a slot's Hkv*D values are contiguous
    const long long src = n * n_kv_heads * HEAD_DIM + within;
    const long long dst = slot * n_kv_heads * HEAD_DIM + within;
    write_kv8(k_new, v_new, src, k_pool, v_pool, dst);
}

// The rows of one sequence and KV head, through the sequence's block table (attend_tiles.cuh's
// Rows). Per tile, the first warp looks the tile's 32 keys up in the block table once
// (row_s[j] = element offset of key k0+j's K row); then all threads load the tile with 16-byte
// accesses. Keys of one block are consecutive slots, so a tile of 32 keys touches
// ceil(32 / block_size) + 1 blocks at most, each read as contiguous rows.
struct PagedRows {
    const int* table;  // block_tables[token_seq[n]]
    int block_size, n_kv_heads, kv_head, k0;
    long long* row_s;  // [KEY_TILE] in shared memory
    __device__ __forceinline__ void begin_tile(int tile_k0, int k_end) {
        k0 = tile_k0;
        if (threadIdx.x < KEY_TILE) {
            const int key = k0 + threadIdx.x;
            long long row = -1;
            if (key < k_end) {
                const long long slot = (long long)table[key / block_size] * block_size + key % block_size;
                row = (slot * n_kv_heads + kv_head) * HEAD_DIM;
            }
            row_s[threadIdx.x] = row;
        }
        // The tile barrier of attend_tiles.cuh's contract, and needed here anyway: row_s is read by every
        // thread in load_tile. Its writes above are safe: every read of the previous tile's row_s ended
        // before the barrier that follows load_tile. (Paged tiles used to pay a third barrier at the top
        // of the loop; the simulator's schedules showed it redundant, see cpu_sim/README.md, barriers.)
        __syncthreads();
    }
    __device__ __forceinline__ long long operator()(int key) const { return row_s[key - k0]; }
};

// Block (n, h, z) of v1 or v2: attend the G queries of token n, KV head h, over keys
// [k_begin, k_end) and write each warp's result, normalized into out (v1, part_m == nullptr)
// or as split partial (n, h*G + warp, z) (v2). The caller has returned if the range is empty.
// opt: learned sinks (partition 0 starts from them: the reduce counts each once) and the soft cap.
__device__ __forceinline__ void paged_block(const float* q, const cache_t* k_pool, const cache_t* v_pool,
                                            const int* block_tables, const int* token_seq, int n_heads,
                                            int n_kv_heads, int block_size, int max_blocks, int k_begin,
                                            int k_end, float scale, float* out, float* part_m, float* part_l,
                                            float* part_acc, int n_partitions, const online_softmax::Options& opt) {
    __shared__ float k_s[KEY_TILE][HEAD_DIM + 1];            // +1 float per row: lane j reads row j bank-free
    __shared__ __align__(16) float v_s[KEY_TILE][HEAD_DIM];  // float4 stores: 16-byte aligned rows
    __shared__ long long row_s[KEY_TILE];                     // element offset of each key's row
    extern __shared__ float q_s[];                            // [G][D]
    const int n = blockIdx.x, h = blockIdx.y, warp = threadIdx.x >> 5, group = n_heads / n_kv_heads;
    const long long row = (long long)n * n_heads + (long long)h * group + warp;  // (n, h*G + warp)
    load_queries(q + (row - warp) * HEAD_DIM, q_s, group * HEAD_DIM);  // attend_tiles' first barrier orders it
    PagedRows rows{block_tables + (long long)token_seq[n] * max_blocks, block_size, n_kv_heads, h, 0, row_s};
    online_softmax::State s = online_softmax::start(opt, h * group + warp, blockIdx.z == 0);
    attend_tiles(k_pool, v_pool, rows, k_begin, k_end, k_end, q_s + warp * HEAD_DIM, k_s, v_s, scale, s,
                 opt.softcap);
    if (part_m == nullptr) online_softmax::finish(s, out + row * HEAD_DIM);
    else write_partial(s, part_m, part_l, part_acc, row * n_partitions + blockIdx.z);
}

// ---------------------------------------------------------------------------
// paged_decode_attention_v1: out[n, h*G + g, :] = attention of query (n, h*G+g) over keys
// 0 .. token_pos[n] of sequence token_seq[n], KV head h, read through its block table.
//
//   q:            [N, Hq, D] float32, already rotated;   G = Hq / Hkv query heads per KV head
//   k_pool/v_pool: [num_blocks, block_size, Hkv, D] CACHE_T (one layer)
//   block_tables: [B, max_blocks] int32; token_seq, token_pos: [N] int32
//   grid  = (N, Hkv)   block (n, h) serves the whole GQA group of KV head h (FlashInfer's
//                      habit: K/V of a group read once, not once per query head)
//   block = (32 * G)   warp g owns query head h*G + g
//   shared: static K tile 32*(D+1) + V tile 32*D floats + 32 int64 row offsets (D=64: 16,768 B,
//           D=128: 33,152 B); dynamic G*D floats for the queries (shared_mem = 4*G*D)
//   bytes: reads 4*N*Hq*D (q) + 2 * sizeof(CACHE_T) * Hkv*D * sum_n (token_pos[n]+1) (K and V)
//          + 4 * sum_n ceil((token_pos[n]+1)/block_size) (block table entries; the 32 lookups of a
//          tile hit the same few entries, so they come from L1), writes 4*N*Hq*D.
// ---------------------------------------------------------------------------
extern "C" __global__ void paged_decode_attention_v1(const float* __restrict__ q, const cache_t* __restrict__ k_pool,
                                                     const cache_t* __restrict__ v_pool,
                                                     const int* __restrict__ block_tables,
                                                     const int* __restrict__ token_seq,
                                                     const int* __restrict__ token_pos, float* __restrict__ out,
                                                     int n_heads, int n_kv_heads, int block_size, int max_blocks,
                                                     float scale, const float* __restrict__ sinks, int use_sinks,
                                                     float softcap) {
    paged_block(q, k_pool, v_pool, block_tables, token_seq, n_heads, n_kv_heads, block_size, max_blocks, 0,
                token_pos[blockIdx.x] + 1, scale, out, nullptr, nullptr, nullptr, 1,
                online_softmax::Options{sinks, use_sinks, softcap});
}

// ---------------------------------------------------------------------------
// paged_decode_attention_v2 (split-K, vLLM's v2 / flash-decoding): the context of token n is
// cut into partitions of partition_size keys; block (n, h, z) attends its G queries over
// partition z only and writes, per query head, the partition's online-softmax state as a split
// partial (split_k.cuh: m_z, l_z and the unnormalized acc_z). attention_reduce_v2 merges them.
// A long context thus gets several blocks, so a step with few sequences still fills the GPU.
//
//   q, pools, block_tables, token_seq, token_pos: as v1
//   part_m, part_l: [N, Hq, P], part_acc: [N, Hq, P, D] float32  (P = n_partitions)
//   grid  = (N, Hkv, P)   partitions past a token's context leave at once (write nothing)
//   block = (32 * G), shared: as v1
//   bytes: v1's K/V/q/table reads; writes 4*N*Hq*Pn*(D+2) (Pn = partitions holding keys)
// ---------------------------------------------------------------------------
extern "C" __global__ void paged_decode_attention_v2(const float* __restrict__ q, const cache_t* __restrict__ k_pool,
                                                     const cache_t* __restrict__ v_pool,
                                                     const int* __restrict__ block_tables,
                                                     const int* __restrict__ token_seq,
                                                     const int* __restrict__ token_pos, float* __restrict__ part_m,
                                                     float* __restrict__ part_l, float* __restrict__ part_acc,
                                                     int n_heads, int n_kv_heads, int block_size, int max_blocks,
                                                     int partition_size, int n_partitions, float scale,
                                                     const float* __restrict__ sinks, int use_sinks, float softcap) {
    const int k_begin = blockIdx.z * partition_size;
    const int k_end = min(token_pos[blockIdx.x] + 1, k_begin + partition_size);
    if (k_begin >= k_end) return;  // the whole block leaves together, before any barrier
    paged_block(q, k_pool, v_pool, block_tables, token_seq, n_heads, n_kv_heads, block_size, max_blocks, k_begin,
                k_end, scale, nullptr, part_m, part_l, part_acc, n_partitions,
                online_softmax::Options{sinks, use_sinks, softcap});
}

// ---------------------------------------------------------------------------
// copy_blocks: for each pair i, block pairs[i][0] of the source pools -> block pairs[i][1] of
// the destination pools, in every layer, K and V. The bytes are copied as they are (16 at a
// time), so the CACHE_T of both sides is the same.
//   copy-on-write: source and destination are the same pools (a destination is a freshly
//                  allocated block, never a source of the same launch);
//   swap out/in:   the device pools and a staging buffer of n blocks, gathered/scattered
//                  here and moved to/from host memory in one transfer.
//
//   src_k/src_v: [L, src_blocks, block_size, Hkv, D]; dst_k/dst_v: [L, dst_blocks, ...]
//   pairs: [P, 2] int32 (src, dst)
//   grid  = (P, L), block = (128): threads stride over the block's 16-byte chunks
//   bytes: reads and writes 2 * L * P * block_size*Hkv*D*sizeof(CACHE_T) each, + 8*P*L (pairs)
// Not __restrict__: for copy-on-write src and dst are the same arrays.
// ---------------------------------------------------------------------------
extern "C" __global__ void copy_blocks(const cache_t* src_k, const cache_t* src_v, cache_t* dst_k, cache_t* dst_v,
                                       const int* __restrict__ pairs, int src_blocks, int dst_blocks, int block_size,
                                       int n_kv_heads) {
    const int pair = blockIdx.x, layer = blockIdx.y;
    const long long block_elems = (long long)block_size * n_kv_heads * HEAD_DIM;  // a multiple of VEC
    const long long src = ((long long)layer * src_blocks + pairs[2 * pair]) * block_elems;
    const long long dst = ((long long)layer * dst_blocks + pairs[2 * pair + 1]) * block_elems;
    const long long chunks = block_elems * (long long)sizeof(cache_t) / 16;  // D % 8 == 0: whole chunks
    const uint4* sk = reinterpret_cast<const uint4*>(src_k + src);
    const uint4* sv = reinterpret_cast<const uint4*>(src_v + src);
    uint4* dk = reinterpret_cast<uint4*>(dst_k + dst);
    uint4* dv = reinterpret_cast<uint4*>(dst_v + dst);
    for (long long i = threadIdx.x; i < chunks; i += blockDim.x) {
        dk[i] = sk[i];
        dv[i] = sv[i];
    }
}

// The key policy of a paged history (decode_core.cuh): key j of sequence b, KV head h, is row
// (table[j / bs] * bs + j % bs) * Hkv*D + h*D of the pool. v3 (PREFETCH false): each lane looks its keys
// up itself (the lanes of a subgroup read the same entry: one broadcast load, from L1 after a block's
// first key). v4 (PREFETCH): the entries a warp's keys need are loaded one lane per entry, one iteration
// early, and shuffled to the lanes; the block size is a compile-time power of two on that fast path
// (KV_BLOCK; 0 = the runtime block_size, an integer division per key).
template <int DIMS, int KEYS, int DIV, bool PREFETCH>
struct PagedKeys : decode::PlainRows<DIMS, KEYS> {
    decode::Lookup<DIV, PREFETCH> table;  // block_tables[token_seq[n]], entries < ceil(k_end / bs)
    long long slot_stride, head_offset;  // Hkv*D, h*D

    __device__ __forceinline__ int ahead(int w0, int) const {
        return table.ahead(w0, table.span(w0, decode::warp_keys<DIMS, KEYS>()));
    }
    __device__ __forceinline__ void load(int key, int k_end, int ahead_entry, int w0, int d0,
                                         typename PagedKeys::Raw& r) const {
        const int entry = table.at(key, ahead_entry, w0);  // every lane: a shuffle on the v4 path
        const long long slot = (long long)entry * table.divisor() + table.offset(key);
        this->load_row(slot * slot_stride + head_offset + d0, key < k_end, r);
    }
};

#ifndef KV_BLOCK
#define KV_BLOCK 0  // v4's compile-time block size (a power of two); 0: the runtime block_size argument
#endif

// Block (n, h, z) of paged_decode_attention_v3/v4: the group's queries over its key range with loop V.
template <int V, int DIMS, int KEYS, int DIV>
__device__ __forceinline__ void paged_decode(const float* q, const cache_t* k_pool, const cache_t* v_pool,
                                             const int* block_tables, const int* token_seq, const int* token_pos,
                                             const decode::Dest& dest, int n_heads, int n_kv_heads,
                                             int block_size, int max_blocks, int keys_per_split, float scale,
                                             const online_softmax::Options& opt) {
    if (n_heads != GQA_GROUP * n_kv_heads || (DIV > 0 && block_size != DIV)) __trap();  // a launcher bug
    const int n = blockIdx.x, h = blockIdx.y;
    const int k_begin = blockIdx.z * keys_per_split;
    const int k_end = min(token_pos[n] + 1, k_begin + keys_per_split);
    if (k_begin >= k_end) return;  // the whole block leaves together, before the one barrier
    PagedKeys<DIMS, KEYS, DIV, !!(V == 4)> pol;
    pol.k = k_pool, pol.v = v_pool;
    pol.table = {block_tables + (long long)token_seq[n] * max_blocks, block_size, (k_end - 1) / block_size + 1};
    pol.slot_stride = (long long)n_kv_heads * HEAD_DIM, pol.head_offset = (long long)h * HEAD_DIM;
    decode::run<V>(pol, q + dest.row0 * HEAD_DIM, scale, k_begin, k_end, dest, opt, h * GQA_GROUP);
}

// The parameters of paged_decode_attention_v3 and _v4 (one list, so that the two kernels cannot drift apart).
#define PAGED_DECODE_PARAMS                                                                                        \
    const float *__restrict__ q, const cache_t *__restrict__ k_pool, const cache_t *__restrict__ v_pool,          \
        const int *__restrict__ block_tables, const int *__restrict__ token_seq,                                   \
        const int *__restrict__ token_pos, float *__restrict__ out, float *__restrict__ part_m,                    \
        float *__restrict__ part_l, float *__restrict__ part_acc, int n_heads, int n_kv_heads, int block_size,     \
        int max_blocks, int keys_per_split, int n_splits, float scale, const float *__restrict__ sinks,           \
        int use_sinks, float softcap
#define PAGED_DECODE_ARGS                                                                                          \
    q, k_pool, v_pool, block_tables, token_seq, token_pos,                                                          \
        decode::Dest{out, part_m, part_l, part_acc,                                                                \
                     (long long)blockIdx.x * n_heads + (long long)blockIdx.y * GQA_GROUP, (int)blockIdx.z, n_splits}, \
        n_heads, n_kv_heads, block_size, max_blocks, keys_per_split, scale,                                      \
        online_softmax::Options{sinks, use_sinks, softcap}

// ---------------------------------------------------------------------------
// paged_decode_attention_v3 (register-resident, bandwidth-bound; decode_v3.cuh): block (n, h, z)
// attends the GQA_GROUP queries of token n, KV head h, over keys [z*keys_per_split,
// (z+1)*keys_per_split) ∩ [0, token_pos[n]] of sequence token_seq[n], read through its block
// table straight into registers (16-byte loads, D/8 lanes per key), no barrier in the key loop.
// n_splits == 1: out is written normalized; else split partials for attention_reduce_v2.
//
//   q, pools, block_tables, token_seq, token_pos: as v1; Hq = GQA_GROUP * Hkv
//   part_m, part_l: [N, Hq, Z], part_acc: [N, Hq, Z, D] float32 (unused when n_splits == 1)
//   grid  = (N, Hkv, Z)   splits past a token's context leave at once (write nothing)
//   block = (128)         4 warps (decode_v3.cuh); static shared 4*G*(D+2) floats, no dynamic
//   bytes: v1's K/V/q reads, + 4 bytes of block table per key and lane group (L1 hits after the
//          first per block), writes 4*N*Hq*D (unsplit) or 4*N*Hq*Zu*(D+2) partials.
// ---------------------------------------------------------------------------
extern "C" __global__ void V3_LAUNCH_BOUNDS paged_decode_attention_v3(PAGED_DECODE_PARAMS) {
    paged_decode<3, decode_v3::DIMS, decode_v3::ROW_KEYS, 0>(PAGED_DECODE_ARGS);
}

// ---------------------------------------------------------------------------
// paged_decode_attention_v4 (decode_v4.cuh): v3's work, arguments and outputs, with the block-table
// entries of each iteration loaded once (one lane per entry) an iteration ahead and shuffled to the lanes,
// the K/V loads of the next iteration in flight during this one's math, a transposed reduction, the
// rescale skipped where no max moved, 16 dims per lane at head_dim 128 (G <= 4). KV_BLOCK = block_size
// (a power of two) at compile time, or 0.
//
//   grid  = (N, Hkv, Z), block = (128): warp w takes keys w0 .. w0 + KW - 1 of each iteration
//   bytes: v3's K/V/q bytes; the block table once per block and iteration (a few entries per warp)
// ---------------------------------------------------------------------------
constexpr int PAGED_V4_KEYS = decode_v4::keys_for(decode_v4::ROW_DIMS, 2 * decode_v4::ROW_DIMS * (int)sizeof(cache_t));

extern "C" __global__ void __launch_bounds__(128, V4_BLOCKS_PER_SM(decode_v4::ROW_DIMS))
    paged_decode_attention_v4(PAGED_DECODE_PARAMS) {
    paged_decode<4, decode_v4::ROW_DIMS, PAGED_V4_KEYS, KV_BLOCK>(PAGED_DECODE_ARGS);
}
