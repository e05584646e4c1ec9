// decode.cuh: one decode-attention block, v3 or v4, for any key policy (decode_core.cuh): the group's
// queries into registers (rotated by the policy where it rotates keys), the key loop of the version,
// then the merge and the write. Every register-resident decode kernel's body is one call of run<V>.

#pragma once

#include "decode_v3.cuh"
#include "decode_v4.cuh"
#include "online_softmax.cuh"

namespace decode {

// Attend keys [k_begin, k_end) of `pol` with the G queries at q_group ([G, HEAD_DIM] float32) and write
// the result to `dest`. All threads call it (one barrier, in finish); the caller has returned if the
// range is empty. opt: online_softmax.cuh's options for this block's query heads head0 .. head0 + G - 1:
// each score soft-capped in the key loop (per key, before the max), and the learned sinks merged once, in
// finish, by the block of split 0 only (the reduce's merge then counts each sink once, as kv_cache.cu's v2).
template <int V, class P>
__device__ __forceinline__ void run(const P& pol, const float* q_group, float scale, int k_begin, int k_end,
                                    const Dest& dest, const online_softmax::Options& opt = {}, int head0 = 0) {
    static_assert(V == 3 || V == 4, "the register-resident decode loops are v3 and v4");
    constexpr int DIMS = P::DIMS;
    const int d0 = ((threadIdx.x & 31) % (HEAD_DIM / DIMS)) * DIMS;
    float q[G][DIMS];
    load_queries(q_group, d0, q);
    pol.query(q, d0);
    scale_queries(q, scale);
    const float cap2 = opt.softcap > 0.0f ? opt.softcap * LOG2E : 0.0f;  // the scores are in log2 units
    State<DIMS> s;
    if constexpr (V == 4) s = decode_v4::attend(pol, q, k_begin, k_end, cap2);
    else s = decode_v3::attend(pol, q, k_begin, k_end, cap2);
    finish(s, dest, opt.use_sinks && dest.z == 0 ? opt.sinks + head0 : nullptr);
}

}  // namespace decode
