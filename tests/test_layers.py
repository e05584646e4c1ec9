"""The thin products of a few-token pass equal the plain ones: minikv.layers.linear (shapes, tails, dtypes) and
the attention scores of minikv.online_softmax.tile_scores (both orientations, masked at the diagonal), and
paged attention over blocks that the queries of one sequence load once."""

import math

import numpy as np
import pytest

from minikv import online_softmax as osm
from minikv.attention import softmax
from minikv.layers import ROW_BLOCK, THIN_TOKENS, gated_activation, gelu_tanh, linear, silu


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("tokens", [0, 1, 2, 5, THIN_TOKENS, THIN_TOKENS + 1])
@pytest.mark.parametrize("out", [ROW_BLOCK - 1, ROW_BLOCK, 3 * ROW_BLOCK + 7])
def test_linear_equals_the_plain_product(dtype, tokens, out):
    rng = np.random.default_rng(tokens * 1000 + out)
    x = rng.standard_normal((tokens, 37)).astype(dtype)
    w_t = rng.standard_normal((out, 37)).astype(dtype)
    got = linear(x, w_t)
    assert got.shape == (tokens, out) and got.dtype == dtype
    np.testing.assert_allclose(got, x.astype(np.float64) @ w_t.T.astype(np.float64),
                               rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-5 if dtype == np.float32 else 0)


def test_linear_of_a_strided_weight_is_still_right():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 16)).astype(np.float32)
    w = rng.standard_normal((16, 2 * ROW_BLOCK)).astype(np.float32)  # w.T is a strided [out, in] view
    np.testing.assert_allclose(linear(x, w.T), x @ w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_activations_in_place_equal_their_formulas_bit_for_bit(dtype):
    # the engine evaluates them in one scratch array; the plain formulas (tanh GELU: transformers' GELUTanh)
    # must come out the same to the last bit, on a strided gate (the first half of gate_up) left untouched
    rng = np.random.default_rng(0)
    gate_up = (rng.standard_normal((64, 2 * 300)) * 8).astype(dtype)
    gate_up[0, :8] = [0.0, -0.0, 1e4, -1e4, 88.0, -88.0, 1e-30, -1e-30]
    x, before = gate_up[:, :300], gate_up.copy()
    t = dtype
    half = t(0.5)
    silu_ref = x * (half + half * np.tanh(half * x))
    gelu_ref = t(0.5) * x * (t(1) + np.tanh(t(math.sqrt(2 / math.pi)) * (x + t(0.044715) * (x * x * x))))
    np.testing.assert_array_equal(silu(x), silu_ref)
    np.testing.assert_array_equal(gelu_tanh(x), gelu_ref)
    np.testing.assert_array_equal(gated_activation(gate_up, "silu"), silu_ref * gate_up[:, 300:])
    np.testing.assert_array_equal(gate_up, before)


# --- the attention's score product: K @ Q^T for a few query rows (minikv.online_softmax.tile_scores) ---

@pytest.mark.parametrize("rows", [1, 2, 3, osm.THIN_ROWS, osm.THIN_ROWS + 1])
@pytest.mark.parametrize("small_gemm", [0, osm.SMALL_GEMM])  # 0: every thin tile takes the K @ Q^T form
def test_tile_scores_equal_q_times_k_transposed(monkeypatch, rows, small_gemm):
    monkeypatch.setattr(osm, "SMALL_GEMM", small_gemm)
    rng = np.random.default_rng(rows)
    q, k = rng.standard_normal((2, rows, 8)), rng.standard_normal((2, 19, 8))
    got = osm.tile_scores(q, k)
    assert got.flags.c_contiguous  # update(overwrite=True) writes into it
    np.testing.assert_allclose(got, q @ np.swapaxes(k, -1, -2), rtol=1e-12)


@pytest.mark.parametrize("t", [1, 2, 5])
def test_thin_causal_attention_over_a_long_history_equals_the_plain_form(t):
    # 3 query heads per KV head, head_dim 64 and 400 keys: past SMALL_GEMM, the K @ Q^T path, masked at the diagonal
    rng = np.random.default_rng(t)
    q = rng.standard_normal((6, t, 64))
    k, v = rng.standard_normal((2, 2, 400, 64))
    assert 3 * t * 400 * 64 > osm.SMALL_GEMM
    scores = np.repeat(k, 3, axis=0)
    scores = q @ np.swapaxes(scores, -1, -2) / 8.0
    scores[..., np.arange(400)[None, :] > np.arange(400 - t, 400)[:, None]] = -np.inf
    np.testing.assert_allclose(osm.attend_contiguous(q, k, v), softmax(scores) @ np.repeat(v, 3, axis=0),
                               rtol=1e-10, atol=1e-12)  # float64: the exactness tolerance


# --- paged attention: the queries of one sequence load its blocks once (minikv.paged.attention) ---

@pytest.mark.parametrize("t", [2, 5])
@pytest.mark.parametrize("options", [{}, {"sinks": np.linspace(-1, 2, 6), "softcap": 3.0}])
def test_paged_queries_of_one_sequence_equal_each_query_alone(t, options):
    from minikv.paged.attention import paged_attention

    rng = np.random.default_rng(t)
    pool_k, pool_v = rng.standard_normal((2, 9, 4, 2, 8))   # 9 blocks of 4 slots, 2 KV heads, D 8
    pool_k[3, 2:], pool_v[3, 2:] = np.nan, np.nan           # stale slots past the context: never read
    table, ctx = np.array([[5, 0, 7, 3]]), 14               # 14 tokens: block 3 holds two of them
    q = rng.standard_normal((t, 6, 8))

    def load(pool):  # a loader whose blocks depend on ``full`` (as the quantized cache's do)
        return lambda blk, full: pool[blk] * np.where(full, 1.0, 0.5)[..., None, None, None]

    got = paged_attention(q, pool_k, pool_v, table, [ctx], [t], blocks_per_tile=2,
                          load_k=load(pool_k), load_v=load(pool_v), **options)
    for i in range(t):  # query i alone, at its position ctx - t + i
        alone = paged_attention(q[i:i + 1], pool_k, pool_v, table, [ctx - t + i + 1], [1], blocks_per_tile=2,
                                load_k=load(pool_k), load_v=load(pool_v), **options)
        np.testing.assert_allclose(got[i], alone[0], rtol=1e-12)
