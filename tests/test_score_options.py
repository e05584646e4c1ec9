"""Learned sinks (gpt-oss) and tanh soft-capping (Gemma 2) in the shared online-softmax core.

Reference: the dense formula written out, per query head h and query t over its visible keys j,
    s_j = cap * tanh((q . k_j / sqrt(D)) / cap)          (no cap: the plain score)
    out = sum_j e^{s_j} v_j / (e^{sink_h} + sum_j e^{s_j})  (no sink: the plain denominator)
in float64. Every driver (the contiguous tiles, paged blocks, ring slots, the uncached baseline)
and every cache that takes the options must agree with it, in float32 to 1e-5 and float64 to 1e-12;
a tile of one key checks that the cap is applied per tile, before the max.
"""

from __future__ import annotations

import numpy as np
import pytest

from minikv import online_softmax as osm
from minikv.attention import causal_attention
from minikv.errors import ConfigError
from minikv.hybrid import hybrid_cache
from minikv.paged import PagedKVCache
from minikv.quant import QuantizedPagedKVCache

HQ, HKV, D = 6, 2, 8


def dense(q, k, v, sinks=None, cap=None, window=None):
    """q: [Hq, T, D], k/v: [Hkv, S, D] (query t at position S - T + t) -> [Hq, T, D], float64."""
    q, k, v = (a.astype(np.float64) for a in (q, k, v))
    hq, t, d = q.shape
    g, s = hq // k.shape[0], k.shape[1]
    kk, vv = np.repeat(k, g, 0), np.repeat(v, g, 0)
    sc = q @ kk.transpose(0, 2, 1) / np.sqrt(d)
    if cap is not None:
        sc = cap * np.tanh(sc / cap)
    qp, kp = np.arange(s - t, s)[:, None], np.arange(s)[None, :]
    vis = (kp <= qp) & (True if window is None else qp - kp < window)
    sc = np.where(vis, sc, -np.inf)
    extra = np.full((hq, t, 1), -np.inf) if sinks is None else np.broadcast_to(
        np.asarray(sinks, np.float64)[:, None, None], (hq, t, 1))
    m = np.maximum(sc.max(-1, keepdims=True), extra)
    p = np.exp(sc - m)
    return (p @ vv) / (p.sum(-1, keepdims=True) + np.exp(extra - m))


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(23)
    t = 11
    q = rng.standard_normal((HQ, t, D)) * 3  # large scores: the cap and the sink both matter
    k, v = rng.standard_normal((HKV, t, D)), rng.standard_normal((HKV, t, D))
    return q, k, v, rng.standard_normal(HQ) * 2


OPTIONS = [(None, None), ("sinks", None), (None, 2.0), ("sinks", 2.0)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("opt", OPTIONS, ids=lambda o: f"{o[0]}-{o[1]}")
@pytest.mark.parametrize("key_tile", [1, 4, None])
def test_contiguous_tiles_equal_dense(data, opt, dtype, key_tile):
    q, k, v, sinks = data
    sinks = sinks if opt[0] else None
    got = osm.attend_contiguous(q.astype(dtype), k.astype(dtype), v.astype(dtype), key_tile=key_tile,
                                sinks=None if sinks is None else sinks.astype(dtype), softcap=opt[1])
    assert got.dtype == dtype
    want = dense(q, k, v, sinks, opt[1])
    np.testing.assert_allclose(got, want, rtol=0, atol=(1e-5 if dtype == np.float32 else 1e-12) * np.abs(want).max())


def test_each_option_changes_the_output(data):
    """The reference itself can fail: a sink or a cap of this size moves every output."""
    q, k, v, sinks = data
    plain = dense(q, k, v)
    assert np.abs(dense(q, k, v, sinks) - plain).max() > 1e-2
    assert np.abs(dense(q, k, v, cap=2.0) - plain).max() > 1e-2


def test_sink_state_is_one_seen_key_of_value_zero():
    s = osm.start((2, 3), 4, np.float32, sinks=np.array([[1.0], [-2.0]]))
    assert s.m.tolist() == [[1.0] * 3, [-2.0] * 3] and (s.l == 1).all() and (s.acc == 0).all()
    assert (osm.finish(s) == 0).all()  # no key yet: the output is 0, not NaN


def test_capping_keeps_masked_keys_masked():
    s = np.array([[-np.inf, 0.5, 100.0]], dtype=np.float32)
    got = osm.soft_cap(s, 30.0)
    assert got[0, 0] == -np.inf and got.dtype == np.float32
    np.testing.assert_allclose(got[0, 1:], 30 * np.tanh(np.array([0.5, 100.0]) / 30), rtol=1e-6)


def test_merge_counts_the_sink_once(data):
    """Split-K: one partial starts from the sink, the other empty; the merge equals the whole."""
    q, k, v, sinks = data
    rows = q[:, -1:, :] / np.sqrt(D)                                       # [Hq, 1, D] decode rows
    kk, vv = np.repeat(k, HQ // HKV, 0), np.repeat(v, HQ // HKV, 0)
    parts = []
    for lo, hi, sk in ((0, 5, sinks[:, None]), (5, 11, None)):
        st = osm.start((HQ, 1), D, np.float64, sk)
        parts.append(osm.update(st, rows @ kk[:, lo:hi].transpose(0, 2, 1), vv[:, lo:hi], softcap=2.0))
    got = osm.finish(osm.merge(*parts))
    np.testing.assert_allclose(got, dense(q[:, -1:], k, v, sinks, 2.0), rtol=0, atol=1e-12)


def _run_cache(cache, q, k, v, sinks, cap, chunks=(7, 1, 1, 2)):
    """Feed the tokens through ``cache`` in steps of ``chunks``, one layer; return [Hq, T, D]."""
    cache.add_sequence(0)
    out, p = [], 0
    for n in chunks:
        with cache.step([0], [n]):
            cache.write(0, k[:, p:p + n].transpose(1, 0, 2), v[:, p:p + n].transpose(1, 0, 2))
            out.append(cache.attend(0, q[:, p:p + n].transpose(1, 0, 2), sinks=sinks, softcap=cap))
        p += n
    return np.concatenate(out).transpose(1, 0, 2)


@pytest.mark.parametrize("kind", ["none", "contiguous", "paged", "hybrid-none", "hybrid-contiguous"])
def test_caches_take_the_options(data, kind):
    q, k, v, sinks = data
    window = 4 if kind.startswith("hybrid") else None
    if kind == "paged":
        cache = PagedKVCache(1, HKV, D, num_blocks=8, block_size=3, dtype=np.float64)
    else:
        cache = hybrid_cache(kind.split("-")[-1], [window], HKV, D, max_len=16, dtype=np.float64)
    chunks = (11,) if kind.endswith("none") else (7, 1, 1, 2)  # an uncached reference sees one whole step
    got = _run_cache(cache, q, k, v, sinks, 2.0, chunks)
    np.testing.assert_allclose(got, dense(q, k, v, sinks, 2.0, window), rtol=0, atol=1e-12)


def test_the_uncached_baseline_takes_the_options(data):
    q, k, v, sinks = data
    got = causal_attention(q, k, v, sinks=sinks, softcap=2.0)
    np.testing.assert_allclose(got, dense(q, k, v, sinks, 2.0), rtol=0, atol=1e-12)


def test_a_cache_without_the_options_refuses_them(data):
    sinks = data[3]
    q, k, v = (np.ones((h, 4, 32), np.float32) for h in (HQ, HKV, HKV))
    cache = QuantizedPagedKVCache(1, HKV, 32, num_blocks=8, block_size=4, dtype=np.float32)
    with pytest.raises(ConfigError, match="QuantizedPagedKVCache does not apply learned sinks"):
        _run_cache(cache, q, k, v, sinks, None, (4,))
