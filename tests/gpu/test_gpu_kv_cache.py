"""Step 2 kernels (kernels/kv_cache.cu): the device cache against the NumPy cache, on every backend.

The NumPy ``ContiguousKVCache`` and the device one receive the same steps and the
same K/V/q; their attention outputs must agree to 1e-5 (relative to the largest
value) and their stored rows exactly. Sizes: histories of 0, 1 and
non-multiples of 32 keys, head_dim 64 and 128, GQA ratios 1, 3 and 8, float32
and float16 storage.

The float16 bound. Against the *float16* NumPy cache the tolerance stays 1e-5:
both round K and V to nearest-even once and then compute in float32. Against the
exact *float32* computation the error is bounded (``fp16_bound``): with unit
roundoff u = 2^-11, each score moves by at most eps_j = u * scale * sum_i |q_i k_ji|,
so each probability by a factor within exp(+-2 eps), and

    |out_fp16 - out_fp32| <= (exp(2 eps) - 1) * max|v| * (1 + u) + u * max|v|

(eps the largest eps_j), plus float32 rounding (1e-5 * max|out|).
"""

from collections import namedtuple
from contextlib import contextmanager

import numpy as np
import pytest

from minikv import kv_cache as ref
from minikv.bench.equivalence import KERNEL_RTOL, rel_err
from minikv.errors import CacheFullError, ConfigError, DTypeError, InvalidInputError, ShapeError
from minikv.model import apply_rope as ref_rope
from minikv.model import rope_tables
from minikv_gpu import kv_cache as gpu
from minikv_gpu.model import apply_rope as gpu_rope

RTOL = KERNEL_RTOL
U16 = 2.0 ** -11  # float16 unit roundoff

StepOut = namedtuple("StepOut", "got want exact q")



def fp16_bound(q: np.ndarray, ks: list, vs: list) -> float:
    """The documented bound on |attention(fp16 K/V) - attention(fp32 K/V)| (module docstring).

    q: [..., D] queries; ks, vs: lists of [S_i, D] float32 histories they may attend to.
    """
    d = q.shape[-1]
    q2 = np.abs(q.reshape(-1, d)).astype(np.float64)
    eps = max(float(np.max(q2 @ np.abs(k).T)) for k in ks if k.size) * U16 / np.sqrt(d)
    vmax = max(float(np.max(np.abs(v))) for v in vs if v.size)
    return float((np.expm1(2 * eps) * (1 + U16) + U16) * vmax)


@contextmanager
def probe_step(cache, seq_ids, num_new):
    """A step that only asks which kernel would run, writing nothing, and is rolled back (a step that
    wrote no K/V may not commit: ``KVCacheBase``)."""
    cache.begin_step(seq_ids, num_new)
    try:
        yield
    finally:
        cache.abort_step()


def write_other_layers(cache, layer: int, k, v) -> None:
    """Every layer must write before a step commits (``KVCacheBase``): fill the ones a test does not look at."""
    for li in range(cache.num_layers):
        if li != layer:
            cache.write(li, k, v)


class Twin:
    """A NumPy cache (same dtype), an exact float32 NumPy cache and a device cache, driven identically."""

    def __init__(self, rt, hq, hkv, d, max_seqs, max_len, dtype=np.float32, layers=2, num_splits=None):
        self.rt, self.hq, self.hkv, self.d = rt, hq, hkv, d
        self.cpu = ref.ContiguousKVCache(layers, hkv, d, max_seqs, max_len, dtype=dtype)
        self.exact = ref.ContiguousKVCache(layers, hkv, d, max_seqs, max_len, dtype=np.float32)
        self.gpu = gpu.ContiguousKVCache(layers, hkv, d, max_seqs, max_len, dtype=dtype, runtime=rt,
                                         num_splits=num_splits)
        self.rng = np.random.default_rng(hq * 1000 + hkv * 100 + d)

    def add(self, sid):
        for c in (self.cpu, self.exact, self.gpu):
            c.add_sequence(sid)

    def step(self, seq_ids, num_new, layer=1, num_splits=None) -> StepOut:
        n = int(sum(num_new))
        q = self.rng.standard_normal((n, self.hq, self.d)).astype(np.float32)
        k = self.rng.standard_normal((n, self.hkv, self.d)).astype(np.float32)
        v = self.rng.standard_normal((n, self.hkv, self.d)).astype(np.float32)
        outs = []
        for c in (self.cpu, self.exact):
            with c.step(seq_ids, num_new):
                c.write(layer, k, v)
                outs.append(c.attend(layer, q))
                write_other_layers(c, layer, k, v)
        with self.gpu.step(seq_ids, num_new):
            kd, vd = self.rt.asarray(k), self.rt.asarray(v)
            self.gpu.write(layer, kd, vd)
            got = self.rt.asnumpy(self.gpu.attend(layer, self.rt.asarray(q), num_splits=num_splits))
            write_other_layers(self.gpu, layer, kd, vd)
        assert got.dtype == np.float32 and got.shape == q.shape
        return StepOut(got, outs[0], outs[1], q)

    def fill(self, seq_ids, num_new, layer=1):
        """Write random history without attending (full-size tests: a 4096-token NumPy prefill is slow)."""
        k = self.rng.standard_normal((int(sum(num_new)), self.hkv, self.d)).astype(np.float32)
        v = self.rng.standard_normal(k.shape).astype(np.float32)
        for c in (self.cpu, self.exact, self.gpu):
            kv = (k, v) if c is not self.gpu else (self.rt.asarray(k), self.rt.asarray(v))
            with c.step(seq_ids, num_new):
                c.write(layer, *kv)
                write_other_layers(c, layer, *kv)

    def histories(self, layer=1):
        """Every (sequence, KV head) history of the exact cache: lists of [S, D] keys and values."""
        ks, vs = [], []
        for sid, slot in self.exact._slot.items():
            n = self.exact.length(sid)
            for h in range(self.hkv):
                ks.append(self.exact.k[layer, slot, h, :n])
                vs.append(self.exact.v[layer, slot, h, :n])
        return ks, vs

    def assert_storage_equal(self, layer=1):
        for name in ("k", "v"):
            a, b = getattr(self.cpu, name)[layer], self.rt.asnumpy(getattr(self.gpu, name)[layer])
            for sid, slot in self.cpu._slot.items():
                n = self.cpu.length(sid)
                assert np.array_equal(a[slot, :, :n], b[slot, :, :n]), (name, sid)


# (Hq, Hkv, D): GQA ratios 1, 3, 8; head_dim 64 and 128
HEADS = [(2, 2, 64), (9, 3, 64), (8, 1, 128), (3, 1, 128)]


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "hq{}_hkv{}_d{}".format(*h))
def test_prefill_then_decode_matches_numpy(rt, heads, dtype):
    """Three sequences (prompts of 1, 33 and 6 tokens) prefilled together, then decoded together,
    joined by a sequence with an empty history (seq_len 0) that decodes its first token."""
    hq, hkv, d = heads
    tw = Twin(rt, hq, hkv, d, max_seqs=4, max_len=40, dtype=dtype)
    for sid in "abc":
        tw.add(sid)
    steps = [tw.step("abc", [1, 33, 6])]
    tw.add("d")
    steps += [tw.step("abcd", [1, 1, 1, 1]) for _ in range(3)]
    for s in steps:
        assert np.all(np.isfinite(s.got))
        assert rel_err(s.got, s.want) <= RTOL
    tw.assert_storage_equal()
    assert [tw.gpu.length(s) for s in "abcd"] == [4, 36, 9, 3]
    if dtype == np.float16:  # the rounding's effect against exact float32 stays within the documented bound
        ks, vs = tw.histories()
        for s in steps:
            err = float(np.max(np.abs(s.got - s.exact)))
            assert err <= fp16_bound(s.q, ks, vs) + RTOL * float(np.max(np.abs(s.exact)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("heads", [(9, 3, 64), (32, 8, 128), (8, 1, 128)], ids=lambda h: "hq{}_hkv{}_d{}".format(*h))
def test_full_size_decode(cupy_rt, heads, dtype):
    """GPU only: 8 sequences of 1..4097 cached tokens, automatic splits, three decode steps."""
    hq, hkv, d = heads
    tw = Twin(cupy_rt, hq, hkv, d, max_seqs=8, max_len=4100, dtype=dtype)
    lens = [4097, 1, 31, 33, 1000, 2048, 4000, 257]
    for sid in range(8):
        tw.add(sid)
    tw.fill(range(8), lens)
    for _ in range(3):
        s = tw.step(range(8), [1] * 8)
        assert rel_err(s.got, s.want) <= RTOL
    tw.assert_storage_equal()


@pytest.mark.parametrize("splits", [1, 2, 3])
def test_split_key_ranges_merge_exactly(rt, splits):
    """Histories of 150, 40 and 1 keys split into up to 3 ranges of whole tiles: attention_reduce_v2's
    exp(m_i - m) rescaling gives the unsplit answer; ranges past a short sequence's end are skipped."""
    tw = Twin(rt, 6, 2, 64, max_seqs=3, max_len=152, num_splits=None)
    for sid in "xyz":
        tw.add(sid)
    tw.step("xy", [149, 39])
    s = tw.step("xyz", [1, 1, 1], num_splits=splits)
    assert rel_err(s.got, s.want) <= RTOL


@pytest.mark.parametrize("version", [1, 2, 3, 4, None])
def test_version_knob_means_what_it_means_for_paged(rt, version):
    """version=1: decode_attention_v1 (one range); 2: decode_attention_v2 + attention_reduce_v2, even
    with one split; 3, 4 and None on a decode step: decode_attention_v3 or _v4 (+ the reduce when split). All
    equal the NumPy cache (tests/gpu/test_gpu_v3.py has v3's own matrix and its prefill fallback)."""
    tw = Twin(rt, 6, 2, 64, max_seqs=2, max_len=100)
    tw.gpu.version = version
    for sid in "ab":
        tw.add(sid)
    tw.step("ab", [70, 20])
    tw.gpu.begin_step("ab", [1, 1])  # prepared, never launched: the step is aborted below
    q = rt.asarray(np.ones((2, 6, 64), np.float32))
    for splits in (None, 1, 3):
        if version == 1 and splits == 3:
            with pytest.raises(ConfigError, match="version=2"):
                tw.gpu.prepare_attend(1, q, num_splits=splits)
            continue
        launch = tw.gpu.prepare_attend(1, q, num_splits=splits)
        want = version or 4
        assert launch.version == want and (launch.splits == 1 or want in (2, 3, 4))
    tw.gpu.abort_step()
    s = tw.step("ab", [1, 1], num_splits=None if version == 1 else 3)
    assert rel_err(s.got, s.want) <= RTOL
    with pytest.raises(ConfigError, match="version"):
        gpu.ContiguousKVCache(1, 1, 64, 1, 4, runtime=rt, version=5)
    with pytest.raises(ConfigError, match="num_splits"):
        gpu.ContiguousKVCache(1, 1, 64, 1, 4, runtime=rt, version=1, num_splits=2)


def test_automatic_split_choice(rt):
    """On the simulator (one 'multiprocessor') nothing is split; a request is clamped to whole tiles."""
    c = gpu.ContiguousKVCache(1, 1, 64, 1, 300, runtime=rt)
    c.add_sequence(0)
    with probe_step(c, [0], [100]):
        assert c._splits(50, 1) == (4, 32)  # at most one split per 32-key tile
        assert c._splits(2, 1) == (2, 64)
        if rt.name == "sim":
            assert c._splits(None, 1) == (1, 128)


def test_stale_nan_slots_are_never_read(rt):
    """Positions past a sequence's length may hold NaN (never written, or freed and reused):
    tiles are zero-filled there instead of read, so 0 * NaN never reaches the sum."""
    tw = Twin(rt, 6, 2, 64, max_seqs=2, max_len=70)
    tw.gpu.k[...] = np.nan
    tw.gpu.v[...] = np.nan
    tw.add("a")
    tw.add("b")
    for s in (tw.step("ab", [3, 37]), tw.step("ab", [1, 1])):
        assert np.all(np.isfinite(s.got))
        assert rel_err(s.got, s.want) <= RTOL


@pytest.mark.parametrize("layout", ["interleaved", "half"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
def test_fused_kernel_equals_unfused_path(rt, layout, dtype):
    """rope_write_attend_v1 (RoPE + write + attend in one launch) == rope_v1 x2 + cache_write_v1 +
    decode_attention_v1, in outputs and in what ends up in the cache; and both match NumPy."""
    hq, hkv, d = 9, 3, 64
    rng = np.random.default_rng(7)
    cos_t, sin_t = rope_tables(d, 64, 10000.0)
    caches = [gpu.ContiguousKVCache(2, hkv, d, 3, 48, dtype=dtype, runtime=rt) for _ in range(2)]
    cpu = ref.ContiguousKVCache(2, hkv, d, 3, 48, dtype=dtype)
    for c in caches + [cpu]:
        for sid in range(3):
            c.add_sequence(sid)
    for num_new in ([5, 1, 32], [1, 1, 1], [1, 1, 1]):
        n = sum(num_new)
        q, k, v = (rng.standard_normal((n, h, d)).astype(np.float32) for h in (hq, hkv, hkv))
        with cpu.step(range(3), num_new) as pos:
            cos, sin = cos_t[pos], sin_t[pos]
            cpu.write(1, ref_rope(k, cos, sin, layout), v)
            want = cpu.attend(1, ref_rope(q, cos, sin, layout))
            write_other_layers(cpu, 1, k, v)
        outs = []
        for i, c in enumerate(caches):
            with c.step(range(3), num_new):
                args = [rt.asarray(a) for a in (q, k, v, cos, sin)]
                if i == 1 and n == 3:  # a decode step: the fused kernel
                    outs.append(rt.asnumpy(c.rope_write_attend(1, *args, layout)))
                else:
                    qd, kd, vd, cd, sd = args
                    c.write(1, gpu_rope(kd, cd, sd, layout, runtime=rt), vd)
                    outs.append(rt.asnumpy(c.attend(1, gpu_rope(qd, cd, sd, layout, runtime=rt))))
                write_other_layers(c, 1, args[1], args[2])
        assert rel_err(outs[1], outs[0]) <= RTOL
        assert rel_err(outs[0], want) <= RTOL
    stored_tol = 0 if dtype == np.float32 else 2.0 ** -10  # fp16: an FMA-contracted rotation may round 1 ulp apart
    for name in ("k", "v"):
        a, b = (rt.asnumpy(getattr(c, name)[1]).astype(np.float32) for c in caches)
        assert np.allclose(a, b, rtol=stored_tol, atol=1e-6 if dtype == np.float32 else 2.0 ** -24)


def test_fused_kernel_with_split_ranges(rt):
    """The block that holds the new position writes it; the other ranges never need it."""
    hq, hkv, d = 4, 1, 64
    rng = np.random.default_rng(8)
    cos_t, sin_t = rope_tables(d, 128, 10000.0)
    a, b = (gpu.ContiguousKVCache(1, hkv, d, 1, 100, runtime=rt) for _ in range(2))
    k = rng.standard_normal((90, hkv, d)).astype(np.float32)
    for c in (a, b):
        c.add_sequence(0)
        with c.step([0], [90]):
            c.write(0, rt.asarray(k), rt.asarray(k))
    q, k1, v1 = (rng.standard_normal((1, h, d)).astype(np.float32) for h in (hq, hkv, hkv))
    cos, sin = rt.asarray(cos_t[[90]]), rt.asarray(sin_t[[90]])
    with a.step([0], [1]):
        one = rt.asnumpy(a.rope_write_attend(0, rt.asarray(q), rt.asarray(k1), rt.asarray(v1), cos, sin, "half",
                                             num_splits=1))
        assert a.prepare_rope_write_attend(0, rt.asarray(q), rt.asarray(k1), rt.asarray(v1), cos, sin, "half",
                                           num_splits=1).version == 1
    with b.step([0], [1]):
        three = rt.asnumpy(b.rope_write_attend(0, rt.asarray(q), rt.asarray(k1), rt.asarray(v1), cos, sin, "half",
                                               num_splits=3))
    assert rel_err(three, one) <= RTOL
    assert np.array_equal(rt.asnumpy(a.k), rt.asnumpy(b.k))


def test_full_cache_raises_and_changes_nothing(rt):
    c = gpu.ContiguousKVCache(1, 1, 64, 1, 4, runtime=rt)
    c.add_sequence("s")
    kv = rt.asarray(np.ones((3, 1, 64), np.float32))
    with c.step(["s"], [3]):
        c.write(0, kv, kv)
    before = rt.asnumpy(c.k).copy()
    with pytest.raises(CacheFullError, match="max_len=4"):
        with c.step(["s"], [2]):
            pass
    assert c.length("s") == 3
    assert np.array_equal(rt.asnumpy(c.k), before)


def test_errors_name_the_problem(rt):
    c = gpu.ContiguousKVCache(1, 2, 64, 2, 8, runtime=rt)
    c.add_sequence(0)
    ones = lambda *s: rt.asarray(np.ones(s, np.float32))  # noqa: E731
    with pytest.raises(RuntimeError, match="abort"), c.step([0], [2]):
        with pytest.raises(ShapeError, match="expected"):
            c.write(0, ones(2, 3, 64), ones(2, 3, 64))
        with pytest.raises(DTypeError, match="float32"):
            c.write(0, rt.asarray(np.ones((2, 2, 64))), ones(2, 2, 64))
        with pytest.raises(InvalidInputError, match="layer=1"):
            c.write(1, ones(2, 2, 64), ones(2, 2, 64))
        with pytest.raises(InvalidInputError, match="before write"):
            c.attend(0, ones(2, 2, 64))
        c.write(0, ones(2, 2, 64), ones(2, 2, 64))
        with pytest.raises(ShapeError, match="Hq a multiple of the 2 KV heads"):
            c.attend(0, ones(2, 3, 64))
        with pytest.raises(InvalidInputError, match="one new token"):
            c.rope_write_attend(0, ones(2, 4, 64), ones(2, 2, 64), ones(2, 2, 64), ones(2, 32), ones(2, 32), "half")
        with pytest.raises(ConfigError, match="threads"):
            c.attend(0, ones(2, 2 * 33, 64))
        c.write(0, ones(2, 2, 64), ones(2, 2, 64))
        raise RuntimeError("abort")  # an exception inside the step rolls it back
    assert c.length(0) == 0
    with pytest.raises(DTypeError, match="float64"):
        gpu.ContiguousKVCache(1, 1, 64, 1, 4, dtype=np.float64, runtime=rt)
    with pytest.raises(ConfigError, match="head_dim=60"):
        gpu.ContiguousKVCache(1, 1, 60, 1, 4, runtime=rt)
    with pytest.raises(ConfigError, match="num_splits"):
        gpu.ContiguousKVCache(1, 1, 64, 1, 4, runtime=rt, num_splits=0)


def test_gpu_no_cache_recomputes_like_numpy(rt):
    """The GPU NoCache attends each sequence's step rows causally (the step-1 baseline)."""
    hq, hkv, d = 6, 2, 64
    rng = np.random.default_rng(9)
    q, k, v = (rng.standard_normal((12, h, d)).astype(np.float32) for h in (hq, hkv, hkv))
    cpu, dev = ref.NoCache(1, hkv, d), gpu.NoCache(1, hkv, d, runtime=rt)
    with cpu.step(["a", "b"], [5, 7]):
        cpu.write(0, k, v)
        want = cpu.attend(0, q)
    with dev.step(["a", "b"], [5, 7]):
        dev.write(0, rt.asarray(k), rt.asarray(v))
        got = rt.asnumpy(dev.attend(0, rt.asarray(q)))
    assert rel_err(got, want) <= RTOL
