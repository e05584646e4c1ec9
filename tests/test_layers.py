"""minikv.layers.linear: the blocked product of a thin pass equals the plain one (shapes, tails, dtypes)."""

import numpy as np
import pytest

from minikv.layers import ROW_BLOCK, THIN_TOKENS, linear


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
