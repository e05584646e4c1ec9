"""Step 1: softmax, causal attention and the GQA head mapping, checked against brute force."""

import numpy as np
import pytest

from minikv.attention import attention_weights, causal_attention, kv_head_for_query_head, softmax
from minikv.errors import ConfigError, DTypeError, ShapeError


def brute_force_attention(q, k, v):
    """One query, one head at a time, straight from the formula (float64)."""
    hq, t, d = q.shape
    hkv, s, _ = k.shape
    out = np.zeros((hq, t, d))
    for h in range(hq):
        kv = h * hkv // hq  # query head h reads KV head h // (Hq / Hkv)
        for i in range(t):
            pos = s - t + i  # the T queries are the last T positions
            scores = np.array([q[h, i] @ k[kv, j] / np.sqrt(d) for j in range(pos + 1)])
            w = np.exp(scores - scores.max())
            out[h, i] = (w / w.sum()) @ v[kv, : pos + 1]
    return out


def test_softmax_is_stable_and_normalized():
    x = np.array([[1000.0, 1001.0, 1002.0], [-1e4, 0.0, 1e4]], dtype=np.float32)
    p = softmax(x)
    assert np.all(np.isfinite(p))
    np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(p[0], softmax(np.array([0.0, 1.0, 2.0])), rtol=1e-6)
    assert p.dtype == np.float32


def test_softmax_of_no_keys_is_empty():
    assert softmax(np.zeros((3, 0), dtype=np.float32)).shape == (3, 0)
    q = np.zeros((2, 0, 4), np.float32)  # zero queries over zero keys: an empty result, not an error
    assert causal_attention(q, q[:1], q[:1]).shape == (2, 0, 4)


def test_softmax_fully_masked_row_gives_zeros_not_nan():
    p = softmax(np.array([[-np.inf, -np.inf], [0.0, -np.inf]]))
    np.testing.assert_array_equal(p, [[0.0, 0.0], [1.0, 0.0]])


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (5, 1), (8, 1), (9, 3)])
@pytest.mark.parametrize("t,s", [(1, 1), (1, 9), (7, 7), (3, 11)])
def test_causal_attention_matches_brute_force(hq, hkv, t, s):
    rng = np.random.default_rng(hq * 100 + t * 10 + s)
    d = 6
    q = rng.standard_normal((hq, t, d))
    k = rng.standard_normal((hkv, s, d))
    v = rng.standard_normal((hkv, s, d))
    np.testing.assert_allclose(causal_attention(q, k, v), brute_force_attention(q, k, v), rtol=1e-12, atol=1e-12)


def test_gqa_equals_mha_with_repeated_kv_heads():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 6, 5, 8)).astype(np.float32)
    k = rng.standard_normal((2, 2, 5, 8)).astype(np.float32)
    v = rng.standard_normal((2, 2, 5, 8)).astype(np.float32)
    mha = causal_attention(q, np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1))
    out = causal_attention(q, k, v)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, mha, rtol=1e-5, atol=1e-6)


def test_head_mapping():
    np.testing.assert_array_equal(kv_head_for_query_head(9, 3), [0, 0, 0, 1, 1, 1, 2, 2, 2])
    np.testing.assert_array_equal(kv_head_for_query_head(4, 1), [0, 0, 0, 0])
    np.testing.assert_array_equal(kv_head_for_query_head(4, 4), [0, 1, 2, 3])
    with pytest.raises(ConfigError, match="num_kv_heads=4"):
        kv_head_for_query_head(6, 4)


def test_weights_rows_sum_to_one_and_respect_causality():
    rng = np.random.default_rng(1)
    w = attention_weights(rng.standard_normal((2, 4, 3)), rng.standard_normal((1, 4, 3)))
    np.testing.assert_allclose(w.sum(-1), 1.0)
    assert np.all(np.triu(w[0], k=1) == 0)  # no query sees a later key


def test_bad_inputs_raise_typed_errors():
    good = np.zeros((2, 3, 4), dtype=np.float32)
    with pytest.raises(DTypeError, match="int64"):
        causal_attention(good.astype(np.int64), good, good)
    with pytest.raises(DTypeError, match="mixed"):
        causal_attention(good, good.astype(np.float64), good.astype(np.float64))
    with pytest.raises(ShapeError, match="k.shape"):
        causal_attention(good, good, good[:, :2])
    with pytest.raises(ShapeError, match="head_dim"):
        causal_attention(good, good[..., :2], good[..., :2])
    with pytest.raises(ShapeError, match="queries"):
        causal_attention(np.zeros((2, 5, 4), np.float32), good, good)
    with pytest.raises(ConfigError):
        causal_attention(np.zeros((3, 3, 4), np.float32), good, good)
    with pytest.raises(ShapeError):
        causal_attention(good[0], good, good)


@pytest.mark.parametrize("t,s", [(11, 11), (11, 15), (8, 8), (9, 30)])
def test_tiled_causal_attention_matches_brute_force(monkeypatch, t, s):
    """Long inputs go through the online softmax in query and key tiles; shrink both to test it."""
    import minikv.online_softmax as online_softmax

    monkeypatch.setattr(online_softmax, "QUERY_TILE", 4)  # tiles of 4 queries: 11 = 4 + 4 + 3
    monkeypatch.setattr(online_softmax, "SCORE_BUDGET", 1)  # and of 4 keys (the smallest key tile)
    rng = np.random.default_rng(t * 100 + s)
    q, k, v = rng.standard_normal((6, t, 5)), rng.standard_normal((2, s, 5)), rng.standard_normal((2, s, 5))
    np.testing.assert_allclose(causal_attention(q, k, v), brute_force_attention(q, k, v), rtol=1e-12, atol=1e-12)


def test_tiled_equals_untiled_at_real_sizes(monkeypatch):
    import minikv.online_softmax as online_softmax

    rng = np.random.default_rng(9)
    q = rng.standard_normal((9, 200, 64)).astype(np.float32)  # 200 = 3 full tiles of 64 + 8
    k, v = rng.standard_normal((2, 3, 230, 64)).astype(np.float32)
    tiled = causal_attention(q, k, v)
    monkeypatch.setattr(online_softmax, "QUERY_TILE", 10**9)
    untiled = causal_attention(q, k, v)
    assert tiled.dtype == np.float32
    np.testing.assert_allclose(tiled, untiled, rtol=1e-5, atol=1e-6)
