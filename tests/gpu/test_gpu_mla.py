"""Step 4 on the GPU (minikv_gpu/mla.py, kernels/mla.cu) against the NumPy reference (minikv/mla/).

* ``latent_write_v1``: bit-exact against the NumPy caches' stored latents, contiguous and paged,
  float32 and float16 (rounded the same way), into NaN-poisoned storage: every row not written stays NaN.
* ``mla_decode_attention_v3`` through the GPU latent caches equals the NumPy caches' absorbed form
  (``form="absorbed"``, the same rounded latents) within ``KERNEL_RTOL``: several Hq (1 .. 17: one and
  two head blocks, a partly filled warp), R and P, contexts 1 .. ~200, block sizes 1, 5, 16, split and
  unsplit, unwritten storage NaN. float16 against the exact float32 computation within
  test_gpu_kv_cache's ``fp16_bound`` (in latent space, before W_UV).
* The paged cache's fork (copy-on-write) and swap round trip keep equality.
* A tiny MLA model (plain and low-rank q) through the GPU caches equals the NumPy model (float32
  logits within ``EXACT_RTOL[float32]``, as test_gpu_model).
* Sizes the kernel cannot load are refused with a ConfigError naming them.
``MINIKV_SIM_ASAN=1`` runs this file under AddressSanitizer; the last test does so for a subset.
"""

from pathlib import Path

import numpy as np
import pytest
from sim_sources import run_under_asan
from test_gpu_kv_cache import fp16_bound

from minikv import mla as ref
from minikv.bench.equivalence import EXACT_RTOL, KERNEL_RTOL, rel_err
from minikv.errors import ConfigError
from minikv.weights.random_models import default_mla, random_mla_model
from minikv_gpu import mla as gpu
from minikv_gpu.model import from_cpu

ROOT = Path(__file__).resolve().parents[2]
LOGIT_RTOL = EXACT_RTOL[np.float32]

# (Hq, R, P, Dn, Dv): one head, a partly filled head block, two head blocks (16 heads per block)
GEOMETRIES = [(1, 8, 8, 4, 8), (3, 16, 8, 5, 7), (5, 24, 16, 8, 6), (17, 32, 8, 3, 5)]


def _mla(r, p, dn, dv):
    return ref.MLAConfig(kv_lora_rank=r, qk_nope_head_dim=dn, qk_rope_head_dim=p, v_head_dim=dv)


def _ups(rng, layers, hq, m):
    return [ref.LatentUp((rng.standard_normal((hq, m.kv_lora_rank, m.qk_nope_head_dim)) * 0.3).astype(np.float32),
                         rng.standard_normal((hq, m.kv_lora_rank, m.v_head_dim)).astype(np.float32))
            for _ in range(layers)]


class LatentTwin:
    """A NumPy latent cache (absorbed form) and its GPU twin, storage poisoned with NaN, driven alike."""

    def __init__(self, rt, kind, geometry, dtype=np.float32, layers=2, num_splits=None, **kw):
        hq, r, p, dn, dv = geometry
        self.rt, self.hq, self.m = rt, hq, _mla(r, p, dn, dv)
        self.rng = np.random.default_rng(hq * 100 + r + p)
        up = _ups(self.rng, layers, hq, self.m)
        cpu_cls, gpu_cls = {"contiguous": (ref.LatentContiguousKVCache, gpu.LatentContiguousKVCache),
                            "paged": (ref.LatentPagedKVCache, gpu.LatentPagedKVCache)}[kind]
        self.cpu = cpu_cls(layers, hq, self.m, up, dtype=dtype, form="absorbed", **kw)
        self.gpu = gpu_cls(layers, hq, self.m, up, dtype=dtype, runtime=rt, num_splits=num_splits, **kw)
        store = self.gpu.latent if kind == "contiguous" else self.gpu.pool
        store[...] = np.nan  # a kernel that reads (or leaves) a row it should not shows up as NaN

    def add(self, *sids):
        for sid in sids:
            self.cpu.add_sequence(sid)
            self.gpu.add_sequence(sid)

    def step(self, sids, lens, layers=(0, 1)):
        """One step: random latents and queries for each layer; returns [(cpu_out, gpu_out), ...]."""
        n, w = sum(lens), self.m.latent_dim
        outs = []
        with self.cpu.step(sids, lens), self.gpu.step(sids, lens):
            for li in layers:
                lat = self.rng.standard_normal((n, 1, w)).astype(np.float32)
                q = self.rng.standard_normal((n, self.hq, self.m.qk_head_dim)).astype(np.float32)
                self.cpu.write(li, lat, None)
                self.gpu.write(li, self.rt.asarray(lat), None)
                outs.append((self.cpu.attend(li, q), self.rt.asnumpy(self.gpu.attend(li, self.rt.asarray(q)))))
        return outs


def _check(outs):
    for want, got in outs:
        assert got.shape == want.shape and got.dtype == np.float32
        assert np.all(np.isfinite(got))
        assert rel_err(got, want) <= KERNEL_RTOL


# --- the write ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_latent_write_is_bit_exact_and_touches_only_its_rows(rt, kind, dtype):
    kw = dict(max_seqs=3, max_len=20) if kind == "contiguous" else dict(num_blocks=12, block_size=5)
    t = LatentTwin(rt, kind, (3, 16, 8, 5, 7), dtype, **kw)
    t.add(0, 1, 2)
    t.step([0, 1, 2], [7, 1, 11])
    t.step([0, 2], [1, 3])
    store = rt.asnumpy(t.gpu.latent if kind == "contiguous" else t.gpu.pool)
    want = t.cpu.latent if kind == "contiguous" else t.cpu.pool
    written = ~np.isnan(store)
    assert written.sum() == 2 * 23 * 24  # layers x tokens x W: nothing else was touched
    assert np.array_equal(store[written], want[written])  # bit-exact, fp16 rounded alike
    assert store.dtype == np.dtype(dtype)


# --- absorbed attention ---------------------------------------------------------------------------

@pytest.mark.parametrize("num_splits", [None, 3], ids=["unsplit", "split3"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "hq{}_r{}_p{}".format(*g))
def test_contiguous_absorbed_equals_numpy(rt, geometry, num_splits):
    t = LatentTwin(rt, "contiguous", geometry, max_seqs=3, max_len=210, num_splits=num_splits)
    t.add(0, 1, 2)
    _check(t.step([0, 1, 2], [1, 33, 190]))   # prefill rows: histories 1 .. 190
    _check(t.step([0, 1, 2], [1, 1, 1]))      # decode
    _check(t.step([2, 0], [1, 1]))


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("geometry", GEOMETRIES[1:3], ids=lambda g: "hq{}_r{}_p{}".format(*g))
def test_paged_absorbed_equals_numpy(rt, geometry, block_size, dtype):
    t = LatentTwin(rt, "paged", geometry, dtype, num_blocks=-(-420 // block_size) + 4, block_size=block_size,
                   num_splits=None if block_size != 5 else 4)
    t.add(0, 1, 2)
    ctx = [block_size + 1, 2 * block_size, 197]
    _check(t.step([0, 1, 2], [c - 1 for c in ctx]))
    _check(t.step([0, 1, 2], [1, 1, 1]))


def test_fork_and_swap_keep_equality(rt):
    t = LatentTwin(rt, "paged", (3, 16, 8, 5, 7), num_blocks=24, block_size=4, num_host_blocks=8)
    t.add(0)
    _check(t.step([0], [10]))
    for c in (t.cpu, t.gpu):
        c.fork(0, 1)  # shares 0's blocks; the next write to the partly filled last block copies it
    _check(t.step([0, 1], [1, 2]))
    for c in (t.cpu, t.gpu):
        c.swap_out(1)
    _check(t.step([0], [1]))
    for c in (t.cpu, t.gpu):
        c.swap_in(1)
    _check(t.step([0, 1], [1, 1]))
    assert np.array_equal(t.gpu.read_latent(1, 0), t.cpu.read_latent(1, 0))


@pytest.mark.parametrize("num_splits", [1, 4])
def test_fp16_within_the_derived_bound_of_exact_fp32(rt, num_splits):
    """The kernel over a float16 latent vs exact float32 math over the unrounded latent, in latent space."""
    hq, m = 5, _mla(24, 16, 8, 6)
    rng = np.random.default_rng(7)
    s, w, r = 150, m.latent_dim, m.kv_lora_rank
    lat = rng.standard_normal((s, w)).astype(np.float32)
    q = rng.standard_normal((1, hq, w)).astype(np.float32)
    scale = m.softmax_scale
    sc = (q[0] @ lat.T) * scale
    p = np.exp(sc - sc.max(-1, keepdims=True))
    exact = (p / p.sum(-1, keepdims=True)) @ lat[:, :r]
    i32 = lambda a: rt.asarray(np.asarray(a, dtype=np.int32))  # noqa: E731
    got = gpu.absorbed_attention(gpu.mla_defines(m, np.float16), rt.asarray(q), rt.asarray(lat.astype(np.float16)),
                                 (s, i32([[0]])), i32([0]), i32([s - 1]), s, scale, num_splits, runtime=rt)
    bound = fp16_bound(q * np.float32(scale * np.sqrt(w)), [lat], [lat[:, :r]])
    assert np.max(np.abs(rt.asnumpy(got)[0] - exact)) <= bound
    assert np.max(np.abs(rt.asnumpy(got)[0] - exact)) > 0  # it did round


# --- the model ---------------------------------------------------------------------------------

@pytest.mark.parametrize("q_lora_rank", [None, 12])
@pytest.mark.parametrize("cache", ["none", "contiguous", "paged"])
def test_mla_model_on_gpu_caches_equals_numpy(rt, cache, q_lora_rank):
    cpu = random_mla_model(default_mla(kv_lora_rank=16, qk_rope_head_dim=8, q_lora_rank=q_lora_rank), seed=3)
    model = from_cpu(cpu, runtime=rt)
    ids = [5, 17, 2, 88, 40, 3, 9]
    if cache == "none":
        assert rel_err(rt.asnumpy(model.logits(ids)), cpu.logits(ids)) <= LOGIT_RTOL
        return
    args = cpu.new_cache_args()
    if cache == "contiguous":
        c_cpu, c_gpu = ref.LatentContiguousKVCache(**args, max_seqs=2, max_len=16), model.new_cache(2, 16)
    else:
        c_cpu = ref.LatentPagedKVCache(**args, num_blocks=8, block_size=3)
        c_gpu = gpu.LatentPagedKVCache(**args, num_blocks=8, block_size=3, runtime=rt)
    for c in (c_cpu, c_gpu):
        c.add_sequence(0)
        c.add_sequence(1)
    for tokens in ([ids, ids[:3]], [[1], [2]], [[60], [61]]):
        want = cpu.forward(tokens, c_cpu)
        assert rel_err(rt.asnumpy(model.forward(tokens, c_gpu)), want) <= LOGIT_RTOL


def test_sizes_the_kernel_cannot_load_are_refused_by_name(rt):
    with pytest.raises(ConfigError, match="kv_lora_rank=11, qk_rope_head_dim=4"):
        from_cpu(random_mla_model(), runtime=rt)
    with pytest.raises(ConfigError, match="fused"):
        from_cpu(random_mla_model(default_mla(kv_lora_rank=16, qk_rope_head_dim=8)), runtime=rt, fused=True)
    m = _mla(16, 4, 5, 7)
    with pytest.raises(ConfigError, match="qk_rope_head_dim=4"):
        gpu.LatentContiguousKVCache(1, 2, m, _ups(np.random.default_rng(0), 1, 2, m), 1, 8, runtime=rt)


def test_asan_subset(sim_rt):
    """This file's kernels compiled with -fsanitize=address (a subset, in a subprocess): no report."""
    run_under_asan(__file__, "sim and (write or paged_absorbed or fp16_within) and not asan", at_least=10)


def test_latent_and_reference_attention_mirror_numpy(rt):
    """minikv_gpu.mla.latent_attention / reference_attention: minikv's names and arguments (a reader of latent
    rows, the up-projections), the absorbed kernel's answer; a decode row and a prefill over a history."""
    rng = np.random.default_rng(3)
    hq, r, p, dn, dv = 3, 16, 8, 5, 7
    m = _mla(r, p, dn, dv)
    up = _ups(rng, 1, hq, m)[0]
    lat = rng.standard_normal((13, r + p)).astype(np.float32)
    for past, t in ((12, 1), (9, 4)):
        q = rng.standard_normal((t, hq, dn + p)).astype(np.float32)
        read = lambda k0, k1: lat[k0:k1]  # noqa: E731
        want = ref.latent_attention(q, read, past, up, m)
        got = rt.asnumpy(gpu.latent_attention(q, read, past, up, m, runtime=rt))
        assert rel_err(got, want) <= KERNEL_RTOL
    q = rng.standard_normal((6, hq, dn + p)).astype(np.float32)
    want = ref.reference_attention(q, lat[:6], up, m)
    assert rel_err(rt.asnumpy(gpu.reference_attention(q, lat[:6], up, m, runtime=rt)), want) <= KERNEL_RTOL
