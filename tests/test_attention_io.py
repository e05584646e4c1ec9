"""minikv.costs.attention_hbm_bytes counts what FlashAttention's loops move, element by element.

Each order is run here as a loop over NumPy arrays that stand for HBM: every load and store goes through
a counter, the loop computes real attention (checked against the one-pass softmax), and the count must
equal the formula, for ragged tiles too. Then the I/O argument itself: standard attention moves Theta(N^2),
the tiled orders Theta(N^2 d / block), and a decode step reads K and V once.
"""

from __future__ import annotations

import numpy as np
import pytest

from minikv.costs import attention_hbm_bytes
from minikv.errors import InvalidInputError


class HBM:
    """Arrays in 'HBM': ``load``/``store`` copy a row range in or out and count its elements."""

    def __init__(self, **arrays):
        self.a, self.moved = dict(arrays), 0

    def load(self, name, r0, r1):
        self.moved += self.a[name][r0:r1].size
        return self.a[name][r0:r1].copy()

    def store(self, name, r0, r1, value):
        self.moved += np.asarray(value).size
        self.a[name][r0:r1] = value


def reference(q, k, v):
    s = q @ k.T / np.sqrt(q.shape[1])
    p = np.exp(s - s.max(1, keepdims=True))
    return p / p.sum(1, keepdims=True) @ v


def standard(q, k, v):
    n, d = k.shape
    hbm = HBM(Q=q, K=k, V=v, S=np.zeros((len(q), n)), P=np.zeros((len(q), n)), O=np.zeros((len(q), d)))
    t = len(q)
    hbm.store("S", 0, t, hbm.load("Q", 0, t) @ hbm.load("K", 0, n).T / np.sqrt(d))
    s = hbm.load("S", 0, t)
    e = np.exp(s - s.max(1, keepdims=True))
    hbm.store("P", 0, t, e / e.sum(1, keepdims=True))
    hbm.store("O", 0, t, hbm.load("P", 0, t) @ hbm.load("V", 0, n))
    return hbm.a["O"], hbm.moved


def flash1(q, k, v, bq, bk):
    """FlashAttention's Algorithm 1: K/V blocks outside, query blocks inside; O, l, m live in HBM."""
    (t, d), n = q.shape, len(k)
    hbm = HBM(Q=q, K=k, V=v, O=np.zeros((t, d)), l=np.zeros(t), m=np.zeros(t))
    hbm.store("O", 0, t, np.zeros((t, d)))
    hbm.store("l", 0, t, np.zeros(t))
    hbm.store("m", 0, t, np.full(t, -np.inf))
    for j in range(0, n, bk):
        kj, vj = hbm.load("K", j, j + bk), hbm.load("V", j, j + bk)
        for i in range(0, t, bq):
            qi, oi, li, mi = (hbm.load(x, i, i + bq) for x in ("Q", "O", "l", "m"))
            s = qi @ kj.T / np.sqrt(d)
            m_new = np.maximum(mi, s.max(1))
            p = np.exp(s - m_new[:, None])
            l_new = np.exp(mi - m_new) * li + p.sum(1)
            o_new = ((li * np.exp(mi - m_new))[:, None] * oi + p @ vj) / l_new[:, None]
            hbm.store("O", i, i + bq, o_new)
            hbm.store("l", i, i + bq, l_new)
            hbm.store("m", i, i + bq, m_new)
    return hbm.a["O"], hbm.moved


def flash2(q, k, v, bq, bk):
    """FlashAttention-2's order: one query tile resident, every K/V block streamed past it."""
    (t, d), n = q.shape, len(k)
    hbm = HBM(Q=q, K=k, V=v, O=np.zeros((t, d)), L=np.zeros(t))
    for i in range(0, t, bq):
        qi = hbm.load("Q", i, i + bq)
        m, l, acc = np.full(len(qi), -np.inf), np.zeros(len(qi)), np.zeros((len(qi), d))
        for j in range(0, n, bk):
            s = qi @ hbm.load("K", j, j + bk).T / np.sqrt(d)
            m_new = np.maximum(m, s.max(1))
            p, a = np.exp(s - m_new[:, None]), np.exp(m - m_new)
            l, acc, m = a * l + p.sum(1), a[:, None] * acc + p @ hbm.load("V", j, j + bk), m_new
        hbm.store("O", i, i + bq, acc / l[:, None])
        hbm.store("L", i, i + bq, m + np.log(l))
    return hbm.a["O"], hbm.moved


@pytest.mark.parametrize("t, n, d, bq, bk", [(37, 37, 8, 5, 7), (16, 16, 4, 16, 16), (1, 29, 6, 1, 4),
                                             (12, 40, 3, 5, 40), (9, 9, 5, 1, 1)])
def test_the_formula_counts_what_the_loops_move(t, n, d, bq, bk):
    rng = np.random.default_rng(t * 100 + n)
    q, k, v = rng.standard_normal((t, d)), rng.standard_normal((n, d)), rng.standard_normal((n, d))
    want = reference(q, k, v)
    for order, run in (("standard", lambda: standard(q, k, v)), ("flash1", lambda: flash1(q, k, v, bq, bk)),
                       ("flash2", lambda: flash2(q, k, v, bq, bk))):
        out, moved = run()
        np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-14)
        for itemsize in (1, 2):
            assert attention_hbm_bytes(n, d, bq, bk, order, itemsize=itemsize, seq_q=t) == moved * itemsize, order


def test_tiles_turn_the_quadratic_term_into_n_squared_d_over_the_tile():
    n, d = 4096, 128
    standard_bytes = attention_hbm_bytes(n, d, 1, 1, "standard")
    assert standard_bytes == 2 * (4 * n * d + 4 * n * n)
    assert attention_hbm_bytes(n, d, 16, 16, "standard") == standard_bytes  # tiles do not matter to it
    for order, per_pass in (("flash1", n * (3 * d + 4)), ("flash2", 2 * n * d)):  # elements of one pass
        one_pass = attention_hbm_bytes(n, d, n, n, order)                  # a single tile: one pass
        for b in (16, 32, 64, 128, 256):                                   # then N / b passes of N d-ish each
            assert attention_hbm_bytes(n, d, b, b, order) == one_pass + (n // b - 1) * per_pass * 2
        assert attention_hbm_bytes(n, d, 32, 32, order) > attention_hbm_bytes(n, d, 64, 64, order)
    # FlashAttention-2's order moves less than Algorithm 1's at the same tile: K/V re-read, no O round trips
    assert attention_hbm_bytes(n, d, 128, 128, "flash2") < attention_hbm_bytes(n, d, 128, 128, "flash1")
    # at d = 128 and 128-row tiles that is half of standard attention's bytes: the d / block factor is 1
    assert standard_bytes / attention_hbm_bytes(n, d, 128, 128, "flash2") == pytest.approx(2.0, rel=0.01)


def test_sram_bound_tile_gives_theorem_2_scaling():
    """Algorithm 1's block_k = ceil(M / 4d): the traffic falls as 1 / M (Theta(N^2 d^2 / M))."""
    n, d = 8192, 64
    fixed = attention_hbm_bytes(n, d, 1, n, "flash1") - 2 * n * (3 * d + 4)   # everything but the passes
    for m in (16384, 32768, 65536):
        block_k = -(-m // (4 * d))
        passes = (attention_hbm_bytes(n, d, 1, block_k, "flash1") - fixed) // (2 * n * (3 * d + 4))
        assert passes == n // block_k == n * 4 * d // m                      # N / B_c = 4 N d / M passes of ~3 N d
    assert attention_hbm_bytes(n, d, 1, 256 // 4, "flash1") > 3 * attention_hbm_bytes(n, d, 1, 1024 // 4, "flash1")


def test_decode_reads_k_and_v_once_whatever_the_tile():
    s, d = 8192, 128
    for bk in (16, 128, 8192):
        assert attention_hbm_bytes(s, d, 1, bk, "flash2", seq_q=1) == 2 * (2 * s * d + 2 * d + 1)


@pytest.mark.parametrize("kwargs", [dict(order="flash3"), dict(block_k=0), dict(seq_q=0), dict(itemsize=True)])
def test_bad_input_is_refused_naming_it(kwargs):
    args = dict(seq_len=64, head_dim=8, block_q=8, block_k=8) | kwargs
    with pytest.raises(InvalidInputError, match=next(iter(kwargs))):
        attention_hbm_bytes(**args)
