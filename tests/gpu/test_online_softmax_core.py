"""kernels/online_softmax.cuh and split_k.cuh against minikv/online_softmax.py, name for name.

One warp folds tiles of 32 scores (lane j: key j; -inf = masked) into an ``online_softmax::State``
with ``update`` and ``finish``es it; the same keys cut in two are written as split partials
(``write_partial``) and merged by the shared ``attention_reduce_v2``. The NumPy core's
``start/update/merge/finish`` on the same scores must agree. Masked keys carry NaN values, and
whole tiles are masked (the first ones included): nothing may leak, and a row with no visible
key at all returns zeros, not NaN.
"""

from __future__ import annotations

import numpy as np
import pytest

from minikv import online_softmax as ref
from minikv.bench.equivalence import KERNEL_RTOL, rel_err

D = 64
SOURCE = r"""
#include "online_softmax.cuh"
#include "split_k.cuh"

// Keys [k_begin, k_end) of scores [tiles*32] / values [tiles*32, D] through update; returns the state.
__device__ online_softmax::State fold(const float* scores, const float* values, int k_begin, int k_end,
                                      float (*v_s)[HEAD_DIM]) {
    const int lane = threadIdx.x;
    online_softmax::State s = online_softmax::start();
    for (int k0 = k_begin; k0 < k_end; k0 += KEY_TILE) {
        __syncwarp();
        for (int d = 0; d < HEAD_DIM; ++d) v_s[lane][d] = values[(long long)(k0 + lane) * HEAD_DIM + d];
        __syncwarp();
        online_softmax::update(s, scores[k0 + lane], v_s);
    }
    return s;
}

// grid (1), block (32): out = finish(all keys); partials of [0, split) and [split, n_keys).
extern "C" __global__ void core(const float* scores, const float* values, int n_keys, int split, float* out,
                                float* part_m, float* part_l, float* part_acc) {
    __shared__ float v_s[KEY_TILE][HEAD_DIM];
    online_softmax::finish(fold(scores, values, 0, n_keys, v_s), out);
    write_partial(fold(scores, values, 0, split, v_s), part_m, part_l, part_acc, 0);
    write_partial(fold(scores, values, split, n_keys, v_s), part_m, part_l, part_acc, 1);
}
"""


def _case(rng, tiles: int, masked_tiles: list[int]):
    scores = (rng.standard_normal(32 * tiles) * 3).astype(np.float32)
    values = rng.standard_normal((32 * tiles, D)).astype(np.float32)
    mask = rng.random(32 * tiles) < 0.7
    for t in masked_tiles:
        mask[32 * t: 32 * (t + 1)] = False
    scores[~mask] = -np.inf
    values[~mask] = np.nan  # stale slots: must never reach acc
    return scores, values, mask


def _numpy(scores, values, mask, lo, hi):
    s = ref.start((1,), D)
    for k0 in range(lo, hi, 32):
        ref.update(s, scores[None, k0:k0 + 32], values[k0:k0 + 32], mask[None, k0:k0 + 32])
    return s


@pytest.mark.parametrize("tiles, split_tile, masked", [(4, 2, [0]), (5, 1, [1, 2]), (3, 2, [0, 1, 2]),
                                                        (2, 1, [1])])
def test_cuda_core_matches_numpy_core(rt, tiles, split_tile, masked):
    rng = np.random.default_rng(tiles * 10 + split_tile)
    scores, values, mask = _case(rng, tiles, masked)
    n, split = 32 * tiles, 32 * split_tile
    out = rt.xp.zeros(D, dtype=np.float32)
    part_m, part_l = rt.xp.zeros(2, dtype=np.float32), rt.xp.zeros(2, dtype=np.float32)
    part_acc = rt.xp.zeros((2, D), dtype=np.float32)
    core = rt.kernel_from_source(SOURCE, "core", {"HEAD_DIM": D}, include_kernels=True)
    core((1,), (32,), (rt.asarray(scores), rt.asarray(values), np.int32(n), np.int32(split), out, part_m, part_l,
                       part_acc))
    reduced = rt.xp.zeros((1, 1, D), dtype=np.float32)
    reduce = rt.kernel_from_source(SOURCE, "attention_reduce_v2", {"HEAD_DIM": D}, include_kernels=True)
    reduce((1, 1), (32,), (part_m, part_l, part_acc, rt.asarray(np.array([n - 1], np.int32)), reduced,
                           np.int32(1), np.int32(split), np.int32(2)))

    want = ref.finish(_numpy(scores, values, mask, 0, n))[0]
    merged = ref.finish(ref.merge(_numpy(scores, values, mask, 0, split), _numpy(scores, values, mask, split, n)))
    got, got_reduced = rt.asnumpy(out), rt.asnumpy(reduced)[0, 0]
    assert np.all(np.isfinite(got)) and np.all(np.isfinite(got_reduced))
    if mask.any():
        assert rel_err(got, want) <= KERNEL_RTOL
        assert rel_err(got_reduced, merged[0]) <= KERNEL_RTOL
    else:  # a row that sees nothing: zeros, never NaN, on both sides
        assert np.array_equal(got, np.zeros(D)) and np.array_equal(want, np.zeros(D))
        assert np.array_equal(got_reduced, np.zeros(D))
    first = rt.asnumpy(part_m)[0]
    assert first == (-np.inf if not mask[:split].any() else np.max(scores[:split]))
