"""``truncate`` (speculative decoding's rollback) on the GPU caches, on every backend.

The GPU caches keep the NumPy classes' bookkeeping and override only their storage hooks, so
``truncate`` is inherited; the quantized cache's commit keeps the rows of the blocks it publishes
(``_keep_rows``) as the NumPy one does. Checked: truncate then re-write gives the same stored K/V
and the same attention, bit for bit, as a twin of the same class that never saw the dropped tokens.
"""

import numpy as np
import pytest

from minikv_gpu import kv_cache as gkv
from minikv_gpu import paged as gpaged
from minikv_gpu import quant as gquant

D, HKV, HQ = 32, 2, 4

CACHES = {
    "contiguous": lambda rt: gkv.ContiguousKVCache(1, HKV, D, max_seqs=1, max_len=24, runtime=rt),
    "paged-b5": lambda rt: gpaged.PagedKVCache(1, HKV, D, num_blocks=6, block_size=5, runtime=rt),
    "int8-b4": lambda rt: gquant.QuantizedPagedKVCache(1, HKV, D, num_blocks=6, block_size=4, kv_dtype="int8",
                                                       runtime=rt),
}


def _step(rt, cache, k, v, q):
    with cache.step([0], [len(k)]):
        cache.write(0, k, v)
        return rt.asnumpy(cache.attend(0, q))


def _stored(rt, cache):
    if isinstance(cache, gpaged.PagedKVCache):
        return [rt.asnumpy(a) for a in cache.read_kv(0, 0)]
    return [rt.asnumpy(a[0, 0, :, :cache.length(0)]) for a in (cache.k, cache.v)]


@pytest.mark.parametrize("kind", CACHES)
def test_truncate_then_rewrite_equals_never_writing_on_the_gpu_caches(rt, kind):
    rng = np.random.default_rng(0)
    rows = [rng.standard_normal((n, HKV, D)).astype(np.float32) for n in (6, 6, 7, 7, 3, 3)]
    (pk, pv, dk, dv, bk, bv) = rows
    qp, qd, qb = (rng.standard_normal((n, HQ, D)).astype(np.float32) for n in (6, 7, 3))
    got, ref = CACHES[kind](rt), CACHES[kind](rt)
    for c in (got, ref):
        c.add_sequence(0)
        _step(rt, c, pk, pv, qp)
    _step(rt, got, dk, dv, qd)  # positions 6..12: fills (and, int8, quantizes) blocks, then 4 of them go
    got.truncate(0, 9)
    _step(rt, ref, dk[:3], dv[:3], qd[:3])
    assert np.array_equal(_step(rt, got, bk, bv, qb), _step(rt, ref, bk, bv, qb))
    for a, b in zip(_stored(rt, got), _stored(rt, ref)):
        assert np.array_equal(a, b)
