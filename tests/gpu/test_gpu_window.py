"""Step 6 kernels (kernels/window.cu) and ``minikv_gpu.window`` against ``minikv.window``, on every backend.

``window_decode`` (one decode query per sequence over its slots) equals ``minikv.window.ring.attend_slots``
with ``WindowPolicy``'s visibility (or the plain causal one, window=0) and, with in-cache positions,
``minikv.window.ring.attend_in_cache`` (both rope layouts), within 1e-4 relative in float32. The rings are
built as the cache leaves them at a decode step: positions 0 .. q-1 written to their ring slots (so
a wrapped ring is not time order and the slot of q holds the key that has just left the window),
the query's own key in one more slot, empty slots (-1) holding NaN, and invisible slots NaN too in
the key-free checks (never read). The mass output equals ``attend_slots``' mass. A wrong ``sinks``
or ``window`` must change the answer (the comparison can fail). The GPU ``EvictingKVCache`` matches
the NumPy one over a short generation (window + in-cache, and H2O, whose eviction reads the mass).
Shapes are tiny: the simulator runs one fiber per CUDA thread.
"""

import numpy as np
import pytest

from minikv import window as ref
from minikv.bench.equivalence import assert_close, rel_err
from minikv.errors import ConfigError, DTypeError, ShapeError
from minikv.layers import apply_rope, rope_tables
from minikv.window import H2OPolicy
from minikv_gpu import window as gw

RTOL = 1e-4
D, HKV, G = 16, 2, 2


def ring(rng, w: int, s: int, q_pos, extra: int = 2, dtype=np.float32, d: int = D, hkv: int = HKV):
    """Slots [B, Hkv, W + 1 + extra] of a window cache at decode positions q_pos: 0..q-1 in their ring
    slots, q in slot W, ``extra`` empty slots; k/v of empty slots are NaN (never read)."""
    pol = ref.WindowPolicy(w, s)
    b, c = len(q_pos), w + 1 + extra
    pos = np.full((b, hkv, c), -1, np.int64)
    for i, q in enumerate(q_pos):
        for p in range(q):
            pos[i, :, pol.ring_slot(p)] = p
        pos[i, :, w] = q
    k, v = (rng.standard_normal((b, hkv, c, d)).astype(dtype) for _ in range(2))
    k[pos < 0], v[pos < 0] = np.nan, np.nan
    return k, v, pos


def reference(q, k, v, pos, q_pos, policy, mass=False):
    """attend_slots per sequence: out [B, Hq, D] (, mass [B, Hkv, C])."""
    outs, masses = [], []
    for i in range(len(q_pos)):
        qp = np.asarray(q_pos[i:i + 1])
        res = ref.attend_slots(q[i:i + 1], [(k[i], v[i], pos[i])], lambda kp, qp=qp: policy.visible(qp, kp),
                               np.ones(1, bool) if mass else None)
        outs.append((res[0] if mass else res)[0])
        if mass:
            masses.append(res[1][0])
    return (np.stack(outs), np.stack(masses)) if mass else np.stack(outs)


def in_cache_reference(q, k, v, pos, q_pos, policy, rope, mass=False):
    """attend_in_cache per sequence; with ``mass``, the same rotation by rank_positions, then attend_slots."""
    if not mass:
        return np.stack([ref.attend_in_cache(q[i:i + 1], k[i], v[i], pos[i], np.asarray(q_pos[i:i + 1]),
                                             policy.visible, rope)[0] for i in range(len(q_pos))])
    cos, sin, layout = rope
    qr, kr = np.empty_like(q), np.empty_like(k)
    for i, qp in enumerate(q_pos):
        vis = policy.visible(np.array([qp]), pos[i])[:, 0]
        ranks = ref.rank_positions(pos[i], vis)
        for h in range(HKV):
            kr[i, h] = apply_rope(k[i, h][:, None], cos[ranks[h]], sin[ranks[h]], layout)[:, 0]
            r = vis[h].sum() - 1
            qr[i, h * G:(h + 1) * G] = apply_rope(q[i:i + 1, h * G:(h + 1) * G], cos[r:r + 1], sin[r:r + 1], layout)[0]
    return reference(qr, kr, v, pos, q_pos, policy, mass=True)


def _q(rng, b, d: int = D):
    return rng.standard_normal((b, HKV * G, d)).astype(np.float32) * 2


@pytest.mark.parametrize("version", [1, 3, 4])
@pytest.mark.parametrize("w,s", [(7, 0), (7, 2), (37, 3)], ids=["W7S0", "W7S2", "W37S3"])
def test_window_decode_matches_attend_slots(rt, w, s, version):
    """Original positions: unfilled, just wrapped and long-wrapped rings, with and without sinks."""
    rng = np.random.default_rng(w + s)
    q_pos = [2, w + 1, 3 * w + 5]
    k, v, pos = ring(rng, w, s, q_pos)
    q = _q(rng, len(q_pos))
    got = rt.asnumpy(gw.window_decode(q, k, v, pos, np.array(q_pos), w, s, runtime=rt, version=version))
    assert_close(got, reference(q, k, v, pos, q_pos, ref.WindowPolicy(w, s)), rtol=RTOL)
    if s:  # the check can fail: the same slots with other sinks give another answer
        assert rel_err(got, reference(q, k, v, pos, q_pos, ref.WindowPolicy(w, s - 1))) > 10 * RTOL


def test_window_zero_is_causal_over_stored_positions_and_mass_matches(rt):
    """window=0 (H2O/SnapKV): every stored position <= q, any slot order; the mass equals attend_slots'."""
    rng = np.random.default_rng(5)
    b, c = 2, 19
    pos = np.stack([rng.permutation(c)[None].repeat(HKV, 0) for _ in range(b)]).astype(np.int64) * 2
    pos[0, 1, [3, 8]] = -1  # empty slots
    q_pos = np.array([20, 40])  # sequence 0 sees only part of its slots (positions > 20 are invisible)
    k, v = (rng.standard_normal((b, HKV, c, D)).astype(np.float32) for _ in range(2))
    k[pos < 0] = np.nan
    q = _q(rng, b)
    out, mass = (rt.asnumpy(a) for a in gw.window_decode(q, k, v, pos, q_pos, want_mass=True, runtime=rt))
    want_out, want_mass = reference(q, k, v, pos, q_pos, ref.Policy(), mass=True)
    assert_close(out, want_out, rtol=RTOL)
    assert_close(mass, want_mass, rtol=RTOL, what="mass")
    assert np.all(mass[pos > q_pos[:, None, None]] == 0) and np.all(mass[pos < 0] == 0)
    np.testing.assert_allclose(mass.sum(-1), G, rtol=1e-5)  # each query head's probabilities sum to 1


@pytest.mark.parametrize("version", [1, 3, 4])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_in_cache_rotation_matches_attend_in_cache(rt, layout, version):
    """Pre-RoPE keys rotated by rank in the kernel = attend_in_cache (rank_positions), both layouts;
    with the window's mass too. Original positions (rotated at the absolute positions) differ."""
    rng = np.random.default_rng(11)
    w, s = 9, 2
    q_pos = [4, w + 3, 4 * w + 1]
    k, v, pos = ring(rng, w, s, q_pos, extra=1)
    q = _q(rng, len(q_pos))
    rope = (*rope_tables(D, 64, 10000.0), layout)
    pol = ref.WindowPolicy(w, s, positions="in-cache")
    out = rt.asnumpy(gw.window_decode(q, k, v, pos, np.array(q_pos), w, s, rope=rope, runtime=rt, version=version))
    assert_close(out, in_cache_reference(q, k, v, pos, q_pos, pol, rope), rtol=RTOL)
    out2, mass = (rt.asnumpy(a) for a in gw.window_decode(q, k, v, pos, np.array(q_pos), w, s, rope=rope,
                                                            want_mass=True, runtime=rt))  # v1: the mass kernel
    want_out, want_mass = in_cache_reference(q, k, v, pos, q_pos, pol, rope, mass=True)
    assert_close(out2, want_out, rtol=RTOL)
    assert_close(mass, want_mass, rtol=RTOL, what="mass")
    absolute = np.stack([apply_rope(k[i].reshape(-1, 1, D), *(t[pos[i].clip(0).ravel()] for t in rope[:2]),
                                    layout).reshape(k[i].shape) for i in range(3)])
    q_abs = np.stack([apply_rope(q[i:i + 1], rope[0][p:p + 1], rope[1][p:p + 1], layout)[0]
                      for i, p in enumerate(q_pos)])
    assert rel_err(out, reference(q_abs, absolute, v, pos, q_pos, pol)) > 10 * RTOL  # the sinks' distances differ


@pytest.mark.parametrize("version", [3, 4])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("d", [8, 16])
def test_in_cache_rotation_at_small_head_dims(rt, d, layout, version):
    """head_dim 8 puts a whole key on one lane (D/8 lanes), 16 on two: the "half" layout's pair (p, p + D/2)
    then lies within a lane or across two. v3 once paired each dimension with itself at D = 8."""
    rng = np.random.default_rng(d)
    w, s = 6, 1
    q_pos = [3, 4 * w + 2]
    k, v, pos = ring(rng, w, s, q_pos, extra=1, d=d)
    q = _q(rng, len(q_pos), d)
    rope = (*rope_tables(d, 32, 10000.0), layout)
    pol = ref.WindowPolicy(w, s, positions="in-cache")
    out = rt.asnumpy(gw.window_decode(q, k, v, pos, np.array(q_pos), w, s, rope=rope, runtime=rt,
                                      version=version))
    assert_close(out, in_cache_reference(q, k, v, pos, q_pos, pol, rope), rtol=RTOL)


def test_closed_form_rank_equals_rank_positions():
    """The kernel's rank(k) = k (k < S) else S + k - max(S, q - (W - S) + 1), on every ring state."""
    for w, s in [(5, 0), (6, 1), (9, 3)]:
        rng = np.random.default_rng(w)
        for q in range(0, 4 * w):
            _, _, pos = ring(rng, w, s, [q], extra=1)
            p = pos[0]
            vis = ref.WindowPolicy(w, s).visible(np.array([q]), p)[:, 0]
            want = ref.rank_positions(p, vis)
            got = np.where(p < s, p, s + p - max(s, q - (w - s) + 1))
            assert np.array_equal(got[vis], want[vis]), (w, s, q)
            assert got[vis].max() == vis[0].sum() - 1  # the query's own key has the largest rank


@pytest.mark.parametrize("version", [1, 3, 4])
def test_float16_slots(rt, version):
    rng = np.random.default_rng(3)
    k, v, pos = ring(rng, 7, 1, [3, 12], dtype=np.float16)
    q = _q(rng, 2)
    got = rt.asnumpy(gw.window_decode(q, k, v, pos, np.array([3, 12]), 7, 1, runtime=rt, version=version))
    assert_close(got, reference(q, k.astype(np.float32), v.astype(np.float32), pos, [3, 12],
                                ref.WindowPolicy(7, 1)), rtol=RTOL)


def test_typed_errors(rt):
    rng = np.random.default_rng(0)
    k, v, pos = ring(rng, 7, 1, [3])
    q, qp = _q(rng, 1), np.array([3])
    with pytest.raises(ShapeError):
        gw.window_decode(q[:, :3], k, v, pos, qp, 7, 1, runtime=rt)
    with pytest.raises(DTypeError):
        gw.window_decode(q.astype(np.float64), k, v, pos, qp, 7, 1, runtime=rt)
    with pytest.raises(ConfigError):
        gw.window_decode(q, k, v, pos, qp, 7, 7, runtime=rt)  # sinks must be < window
    with pytest.raises(ConfigError):
        gw.window_decode(q, k, v, pos, qp, 0, 0, rope=(*rope_tables(D, 16, 1e4), "half"), runtime=rt)
    with pytest.raises(ConfigError):
        gw.window_decode(q, k, v, pos, qp, 7, 1, want_mass=True, runtime=rt, version=3)  # v3 has no mass


def _generate(cache, steps: int, rng, prompt: int = 3):
    """Prefill ``prompt`` tokens of two sequences, then decode steps; the attend outputs per step."""
    for sid in (0, 1):
        cache.add_sequence(sid)
    outs = []
    hq = HKV * G
    for t in range(steps):
        num = [prompt, prompt + 1] if t == 0 else [1, 1]
        with cache.step([0, 1], num):
            n = sum(num)
            for layer in range(cache.num_layers):
                k, v = (rng.standard_normal((n, HKV, D)).astype(np.float32) for _ in range(2))
                cache.write(layer, k, v)
                outs.append(cache.attend(layer, rng.standard_normal((n, hq, D)).astype(np.float32)))
    return outs


@pytest.mark.parametrize("kind", ["window-in-cache", "h2o"])
def test_gpu_evicting_cache_matches_numpy(rt, kind):
    """Decode steps on the kernel, prefill on NumPy: the same outputs and kept positions as the NumPy cache."""
    rope = (*rope_tables(D, 64, 10000.0), "half")
    make = {"window-in-cache": lambda: ref.WindowPolicy(5, 1, positions="in-cache"),
            "h2o": lambda: H2OPolicy(4, recent=1)}[kind]
    caches = [cls(1, HKV, D, make(), max_seqs=2, rope=rope, **extra)
              for cls, extra in ((ref.EvictingKVCache, {}), (gw.EvictingKVCache, {"runtime": rt}))]
    want, got = (_generate(c, 8, np.random.default_rng(1)) for c in caches)
    assert caches[1].gpu_steps == 7
    for a, b in zip(got, want):
        assert_close(a, b, rtol=RTOL)
    for sid in (0, 1):
        for a, b in zip(caches[1].kept_positions(sid, 0), caches[0].kept_positions(sid, 0)):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("version", [1, 4])
def test_attend_slots_and_attend_in_cache_mirror_numpy(rt, version):
    """minikv_gpu.window.attend_slots / attend_in_cache: minikv's names and arguments (tiles of slots, the
    visibility as gw.Visible(policy, q_pos) or a window policy's visible), the GPU kernel's answer."""
    rng = np.random.default_rng(21)
    w, s = 7, 2
    k, v, pos = ring(rng, w, s, [3 * w + 1], extra=0)
    k, v, pos = k[0], v[0], pos[0]  # one cache's slots [Hkv, C, D]
    q_pos = np.array([3 * w + 1, 3 * w + 1])
    q = _q(rng, 2)
    policy = ref.WindowPolicy(w, s)
    tiles = [(k[:, :4], v[:, :4], pos[:, :4]), (k[:, 4:], v[:, 4:], pos[:, 4:])]
    vis = gw.Visible(policy, q_pos)
    want = ref.attend_slots(q, tiles, vis, np.array([True, False]))
    got = gw.attend_slots(q, tiles, vis, np.array([True, False]), runtime=rt)
    assert_close(rt.asnumpy(got[0]), want[0], rtol=RTOL)
    for a, b in zip(got[1] + got[2], want[1] + want[2]):
        assert_close(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=RTOL, what="mass/seen")
    if version == 4:
        assert_close(rt.asnumpy(gw.attend_slots(q, tiles, vis, version=4, runtime=rt)), want[0], rtol=RTOL)
    rope = (*rope_tables(D, 64, 10000.0), "half")
    pol = ref.WindowPolicy(w, s, positions="in-cache")
    want = ref.attend_in_cache(q, k, v, pos, q_pos, pol.visible, rope)
    got = gw.attend_in_cache(q, k, v, pos, q_pos, pol.visible, rope, version=4 if version == 4 else 3, runtime=rt)
    assert_close(rt.asnumpy(got), want, rtol=RTOL)
    with pytest.raises(ConfigError, match="Visible"):
        gw.attend_slots(q, tiles, lambda kp: policy.visible(q_pos, kp), runtime=rt)
