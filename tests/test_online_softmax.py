"""The online-softmax core: tile size never matters, merge(halves) == one pass, masks never leak NaN."""

import numpy as np
import pytest

from minikv import online_softmax as osm
from minikv.attention import causal_attention, softmax
from minikv.bench.equivalence import rel_err


def reference(scores, values, mask=None):
    """softmax(scores) @ values in one piece: scores [..., Q, K], values [..., K, D]."""
    if mask is not None:
        scores = np.where(mask, scores, -np.inf)
        values = np.where(np.swapaxes(mask.any(axis=-2, keepdims=True), -1, -2), values, 0)
    return softmax(scores) @ values


def run_tiles(scores, values, tile, mask=None, overwrite=False):
    state = osm.start(scores.shape[:-1], values.shape[-1], scores.dtype)
    for k0 in range(0, scores.shape[-1], tile):
        sl = slice(k0, k0 + tile)
        osm.update(state, scores[..., sl].copy() if overwrite else scores[..., sl], values[..., sl, :],
                   None if mask is None else mask[..., sl], overwrite=overwrite)
    return osm.finish(state)


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("tile", [1, 2, 3, 7, 16, 37, 100])
def test_any_tile_size_gives_the_one_pass_result(tile, overwrite):
    rng = np.random.default_rng(tile)
    scores = rng.standard_normal((3, 5, 37)) * 4
    values = rng.standard_normal((3, 37, 8))
    mask = rng.random((3, 5, 37)) < 0.8
    before = scores.copy()
    assert rel_err(run_tiles(scores, values, tile, overwrite=overwrite), reference(scores, values)) < 1e-13
    got = run_tiles(scores, values, tile, mask, overwrite=overwrite)
    assert rel_err(got, reference(scores, values, mask)) < 1e-13
    np.testing.assert_array_equal(scores, before)  # without overwrite, the caller's scores are untouched


def test_merge_of_two_halves_equals_one_pass():
    rng = np.random.default_rng(1)
    scores, values = rng.standard_normal((4, 2, 50)) * 3, rng.standard_normal((4, 50, 16))
    whole = osm.update(osm.start((4, 2), 16, np.float64), scores, values)
    for cut in (1, 17, 25, 49):
        a = osm.update(osm.start((4, 2), 16, np.float64), scores[..., :cut], values[:, :cut])
        b = osm.update(osm.start((4, 2), 16, np.float64), scores[..., cut:], values[:, cut:])
        m = osm.merge(a, b)
        assert rel_err(osm.finish(m), osm.finish(whole)) < 1e-13
        np.testing.assert_allclose(m.l, whole.l, rtol=1e-13)  # same running max: the sums agree too
        assert rel_err(osm.finish(osm.merge(b, a)), osm.finish(whole)) < 1e-13  # merge is symmetric


def test_fully_masked_tile_and_stale_nan_values_never_leak():
    rng = np.random.default_rng(2)
    scores = rng.standard_normal((2, 3, 12)).astype(np.float32)
    values = rng.standard_normal((2, 12, 4)).astype(np.float32)
    mask = np.ones((2, 3, 12), dtype=bool)
    mask[..., 8:] = False                 # keys 8.. are stale slots nobody may see
    values[:, 8:] = np.nan                # ... and hold NaN, as a recycled paged block can
    mask[1, 1, :] = False                 # one query sees nothing in the whole input
    state = osm.start((2, 3), 4, np.float32)
    osm.update(state, scores[..., 8:], values[:, 8:], mask[..., 8:])   # a tile that is masked for everyone
    assert np.all(np.isneginf(state.m)) and not np.isnan(state.acc).any()
    osm.update(state, scores[..., :8], values[:, :8], mask[..., :8])
    out = osm.finish(state)
    assert out.dtype == np.float32 and not np.isnan(out).any()
    np.testing.assert_array_equal(out[1, 1], 0)  # a row that saw no key: zeros, not 0/0
    want = reference(scores[..., :8].astype(np.float64), values[:, :8].astype(np.float64))
    keep = mask[..., 0]
    assert rel_err(out[keep], want[keep]) < 1e-6


def test_merge_with_an_empty_side_is_the_other_side():
    rng = np.random.default_rng(3)
    a = osm.update(osm.start((5,), 3, np.float64), rng.standard_normal((5, 9)), rng.standard_normal((9, 3)))
    empty = osm.start((5,), 3, np.float64)
    for m in (osm.merge(a, empty), osm.merge(empty, a)):
        np.testing.assert_array_equal(osm.finish(m), osm.finish(a))
    assert not np.isnan(osm.finish(osm.merge(empty, empty))).any()


@pytest.mark.parametrize("key_tile", [1, 5, 64, None])
@pytest.mark.parametrize("t,s", [(1, 1), (1, 40), (7, 7), (70, 90), (130, 130)])
def test_attend_contiguous_equals_textbook_causal_attention(key_tile, t, s):
    rng = np.random.default_rng(t * 1000 + s)
    q = rng.standard_normal((2, 6, t, 8))
    k, v = rng.standard_normal((2, 2, 2, s, 8))
    got = osm.attend_contiguous(q, k, v, key_tile=key_tile)
    want = (softmax(_causal_scores(q, k)) @ np.repeat(v, 3, axis=-3))
    assert got.shape == q.shape and rel_err(got, want) < 1e-12
    assert rel_err(causal_attention(q, k, v), want) < 1e-12


def _causal_scores(q, k):
    t, s = q.shape[-2], k.shape[-2]
    scores = q @ np.swapaxes(np.repeat(k, q.shape[-3] // k.shape[-3], axis=-3), -1, -2) / np.sqrt(q.shape[-1])
    return np.where(np.arange(s)[None, :] <= np.arange(s - t, s)[:, None], scores, -np.inf)


def test_shapes_that_do_not_line_up_are_refused():
    from minikv.errors import ShapeError

    with pytest.raises(ShapeError, match="key axes"):
        osm.update(osm.start((2,), 4), np.zeros((2, 5), np.float32), np.zeros((6, 4), np.float32))


def test_assert_close_picks_the_bar_by_dtype_and_says_where_it_differs():
    from minikv.bench.equivalence import assert_close

    want = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    assert assert_close(want + np.float32(1e-6), want) <= 1e-4  # float32 bar 1e-4
    with pytest.raises(AssertionError, match=r"worst at index \(2, 1\).*1 of 12 elements off"):
        bad = want.copy()
        bad[2, 1] += 0.01
        assert_close(bad, want)
    with pytest.raises(AssertionError, match="1e-10"):
        assert_close(want.astype(np.float64) + 1e-6, want.astype(np.float64))  # float64 bar 1e-10
    with pytest.raises(AssertionError, match="relative error nan"):
        assert_close(np.full_like(want, np.nan), want)
    with pytest.raises(AssertionError, match="shape"):
        assert_close(want[:2], want)
