"""Learned sinks and tanh soft-capping in the decode kernels (kernels/kv_cache.cu's decode_attention_v1
and _v2, through online_softmax.cuh's start(sink) and soft_cap) equal the NumPy cache with the same options.

One prefill of 5 and 40 tokens, then a decode step: v1 attends each history in one range, v2 in two
splits (only split 0 starts from the sink, and the shared reduce must count it once). Scores are
scaled up so that a cap of 1.5 and sinks of +-2 change every output (checked), so neither option can
be silently ignored. Versions 3 and 4 do not take the options: asking for them is a ConfigError.
"""

import numpy as np
import pytest

from minikv import kv_cache as ref
from minikv.bench.equivalence import KERNEL_RTOL, rel_err
from minikv.errors import ConfigError, ShapeError
from minikv_gpu import kv_cache as gpu

HQ, HKV, D = 4, 2, 64


def _run(rt, version, splits, sinks, cap):
    """(kernel output, NumPy output, NumPy output without the options) of the decode step."""
    rng = np.random.default_rng(23)
    caches = [ref.ContiguousKVCache(1, HKV, D, 2, 48), ref.ContiguousKVCache(1, HKV, D, 2, 48),
              gpu.ContiguousKVCache(1, HKV, D, 2, 48, runtime=rt)]
    for c in caches:
        for sid in "ab":
            c.add_sequence(sid)
    outs = []
    for num_new in ([5, 40], [1, 1]):
        n = sum(num_new)
        q = (rng.standard_normal((n, HQ, D)) * 4).astype(np.float32)
        k, v = (rng.standard_normal((n, HKV, D)).astype(np.float32) for _ in range(2))
        outs = []
        for i, c in enumerate(caches):
            dev = (lambda a: rt.asarray(a)) if i == 2 else (lambda a: a)
            opts = {} if i == 1 else {"sinks": dev(sinks), "softcap": cap}
            if i == 2:
                opts.update(version=version, num_splits=splits)
            with c.step(list("ab"), num_new):
                c.write(0, dev(k), dev(v))
                outs.append(c.attend(0, dev(q), **opts))
    return rt.asnumpy(outs[2]), outs[0], outs[1]


@pytest.mark.parametrize("version,splits", [(1, 1), (2, 2)], ids=["v1", "v2-split2"])
def test_decode_kernels_apply_sinks_and_softcap(rt, version, splits):
    sinks = np.array([2.0, -2.0, 0.5, 1.0], np.float32)
    got, want, plain = _run(rt, version, splits, sinks, 1.5)
    assert rel_err(got, want) <= KERNEL_RTOL
    assert rel_err(plain, want) > 1e-2  # the options matter at these sizes


def test_versions_without_the_options_refuse_them(rt):
    cache = gpu.ContiguousKVCache(1, HKV, D, 1, 8, runtime=rt)
    cache.add_sequence(0)
    z = rt.asarray(np.zeros((1, HKV, D), np.float32))
    with cache.step([0], [1]):
        cache.write(0, z, z)
        q = rt.asarray(np.zeros((1, HQ, D), np.float32))
        with pytest.raises(ConfigError, match="versions 1 and 2"):
            cache.attend(0, q, version=3, softcap=2.0)
        with pytest.raises(ShapeError, match="one logit per query head"):
            cache.attend(0, q, sinks=rt.asarray(np.zeros(3, np.float32)))
        cache.attend(0, q)
