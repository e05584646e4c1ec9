"""Step 1 kernels (kernels/attention.cu) against the NumPy reference, on every backend.

Small, odd sizes on purpose: seq_len 0 and 1, lengths that are not multiples of
the warp size or of the 4 query rows per block, head_dim 64 and 128, GQA ratios
1, 3 and 8. fp32 tolerance: 1e-5 relative (to the largest reference value).
"""

import numpy as np
import pytest

from minikv import attention as ref
from minikv.bench.equivalence import KERNEL_RTOL, rel_err
from minikv.errors import ConfigError, DTypeError, ShapeError
from minikv_gpu import attention as gpu

RTOL = KERNEL_RTOL

# (Hq, Hkv, D, T, S, causal): GQA ratios 1, 3, 8; seq_len 0, 1, 31, 33, 37 ...
CASES = [
    (2, 2, 64, 0, 0, True),
    (2, 2, 64, 0, 5, True),
    (2, 2, 64, 1, 1, True),
    (3, 1, 64, 1, 33, True),    # decode-like: one query over 33 keys
    (6, 2, 64, 7, 7, True),
    (6, 2, 128, 5, 37, True),   # T < S: the mask is bottom-right
    (8, 1, 64, 33, 33, True),   # MQA-like ratio 8, a partial 9th row block
    (8, 1, 128, 3, 31, False),
    (3, 3, 128, 6, 65, True),
]



def qkv(rng, hq, hkv, d, t, s, batch=()):
    q = rng.standard_normal((*batch, hq, t, d)).astype(np.float32)
    k = rng.standard_normal((*batch, hkv, s, d)).astype(np.float32)
    v = rng.standard_normal((*batch, hkv, s, d)).astype(np.float32)
    return q, k, v


@pytest.mark.parametrize("version", [0, 1])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "hq{}_hkv{}_d{}_t{}_s{}_{}".format(*c))
def test_causal_attention_matches_numpy(rt, case, version):
    hq, hkv, d, t, s, causal = case
    q, k, v = qkv(np.random.default_rng(hash(case) % 2**32), hq, hkv, d, t, s)
    want = ref.causal_attention(q, k, v, causal=causal)
    got = rt.asnumpy(gpu.causal_attention(rt.asarray(q), rt.asarray(k), rt.asarray(v), causal=causal,
                                          version=version, runtime=rt))
    assert got.shape == want.shape and got.dtype == np.float32
    assert np.all(np.isfinite(got))
    assert rel_err(got, want) <= RTOL


def test_causal_attention_batch_dims(rt):
    q, k, v = qkv(np.random.default_rng(1), 6, 2, 64, 5, 9, batch=(2, 1))
    want = ref.causal_attention(q, k, v)
    for version in (0, 1):
        got = rt.asnumpy(gpu.causal_attention(q, k, v, version=version, runtime=rt))
        assert rel_err(got, want) <= RTOL


@pytest.mark.gpu
@pytest.mark.parametrize("version", [0, 1])
@pytest.mark.parametrize("hq,hkv,d,t,s", [(32, 8, 128, 1000, 1000), (9, 3, 64, 333, 4097), (16, 2, 64, 1, 8191)])
def test_causal_attention_full_size(cupy_rt, hq, hkv, d, t, s, version):
    """Full sizes, too slow for the simulator: on a GPU only, against float64 NumPy."""
    q, k, v = qkv(np.random.default_rng(2), hq, hkv, d, t, s)
    want = ref.causal_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64))
    got = cupy_rt.asnumpy(gpu.causal_attention(q, k, v, version=version, runtime=cupy_rt))
    assert rel_err(got, want) <= RTOL


@pytest.mark.parametrize("causal", [True, False])
def test_attention_weights_match_numpy(rt, causal):
    q, k, _ = qkv(np.random.default_rng(3), 6, 2, 64, 4, 35)
    want = ref.attention_weights(q, k, causal=causal)
    got = rt.asnumpy(gpu.attention_weights(q, k, causal=causal, runtime=rt))
    assert got.shape == want.shape
    assert rel_err(got, want) <= RTOL
    assert np.allclose(got.sum(-1), 1.0, atol=1e-6)
    if causal:  # query t (of 4) at position 31 + t sees keys 0 .. 31 + t: everything later is exactly 0
        assert np.all(got[..., 0, 32:] == 0) and np.all(got[..., 2, 34:] == 0)


def test_softmax_matches_numpy_including_masked_rows(rt):
    x = np.random.default_rng(4).standard_normal((3, 5, 37)).astype(np.float32) * 10
    x[0, 1, :] = -np.inf  # a fully masked row returns zeros, not NaN
    x[1, 2, ::2] = -np.inf
    for axis in (-1, 1):
        want = ref.softmax(x.copy(), axis=axis)
        got = rt.asnumpy(gpu.softmax(x, axis=axis, runtime=rt))
        assert np.all(np.isfinite(got))
        assert np.max(np.abs(got - want)) <= RTOL
    assert np.all(rt.asnumpy(gpu.softmax(x, runtime=rt))[0, 1] == 0)


def test_empty_inputs(rt):
    assert gpu.softmax(np.zeros((0, 4), np.float32), runtime=rt).shape == (0, 4)
    q, k, v = qkv(np.random.default_rng(5), 2, 1, 64, 0, 0)
    for version in (0, 1):
        assert gpu.causal_attention(q, k, v, version=version, runtime=rt).shape == (2, 0, 64)


def test_errors_name_the_problem(rt):
    q, k, v = qkv(np.random.default_rng(6), 4, 2, 64, 3, 3)
    with pytest.raises(DTypeError, match="float32"):
        gpu.causal_attention(q.astype(np.float64), k, v, runtime=rt)
    with pytest.raises(ShapeError, match="k.shape"):
        gpu.causal_attention(q, k, v[:, :2], runtime=rt)
    with pytest.raises(ConfigError, match="num_heads=4"):
        gpu.causal_attention(q, np.concatenate([k, k, k[:1]]), np.concatenate([v, v, v[:1]]), runtime=rt)
    with pytest.raises(ConfigError, match="head_dim=12"):
        gpu.causal_attention(q[..., :12].copy(), k[..., :12].copy(), v[..., :12].copy(), runtime=rt)
    with pytest.raises(ShapeError, match="queries"):
        gpu.causal_attention(q, k[:, :2], v[:, :2], runtime=rt)
    with pytest.raises(ConfigError, match="version"):
        gpu.causal_attention(q, k, v, version=2, runtime=rt)
    with pytest.raises(ShapeError, match="axis"):
        gpu.softmax(q, axis=4, runtime=rt)
