"""Learned sinks and tanh soft-capping in every decode kernel equal NumPy with the same options
(online_softmax.cuh's Options): the contiguous cache's v1-v4 and fused rope_write_attend v1/v2, the paged
cache's v1-v4 and paged_attention, the window kernels v1 (with the mass)/v3/v4, the GPU hybrid cache, and the
GPU model that passes them down. v1/v2 apply them through attend_tiles and start(sink), v3/v4 through
decode_core.cuh's softmax_update and finish. The quantized GPU cache refuses them, as the NumPy one does.

Two sequences with 5 and 40 tokens of history, then a decode step: 6 and 41 keys, so the last tile is partial
and a split into 32-key ranges leaves the longer history a second range of 9 keys while the shorter has one.
Exactly one range may carry the sink (its merge then counts it once): a kernel that starts every range from it
fails the split cases. Queries are scaled up so that a cap of 1.5 and sinks of +-2 each change every output
(checked against NumPy without one or the other), so neither option can be silently ignored.

Shapes: 6 query heads over 2 KV heads (G = 3), head_dim 64, float32, block size 5: the kernel builds the v3/v4
matrices of test_gpu_v3.py and test_gpu_v4.py and the fused tests of test_gpu_kv_cache.py already make. The
window kernels (v1 with its mass, v3, v4) and the GPU hybrid cache run at test_gpu_window.py's and
test_gpu_hybrid.py's shapes (4 query heads over 2 KV heads, head_dim 16).
"""

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from minikv import kv_cache as ref
from minikv import window as ref_window
from minikv.bench.equivalence import KERNEL_RTOL, assert_close, rel_err
from minikv.errors import ConfigError, ShapeError
from minikv.hybrid import hybrid_cache as ref_hybrid_cache
from minikv.model import Model, rope_tables
from minikv.model import apply_rope as ref_rope
from minikv.weights.random_models import random_model
from minikv_gpu import attention as gattention
from minikv_gpu import hybrid as ghybrid
from minikv_gpu import kv_cache as gpu
from minikv_gpu import model as gmodel
from minikv_gpu import paged as gpaged
from minikv_gpu import quant as gquant
from minikv_gpu import window as gwindow

HQ, HKV, D = 6, 2, 64
HISTORY = [5, 40]
SINKS = np.array([2.0, -2.0, 0.5, 1.0, -0.5, 3.0], np.float32)
CAP = 1.5
# (version, num_splits) of the contiguous cache: each loop unsplit and split into two ranges
CONTIGUOUS = [(1, 1), (2, 2), (3, 1), (3, 2), (4, 1), (4, 2)]


@pytest.fixture(scope="module")
def data():
    """The history, the decode step's raw and rotated q/k, and NumPy's answers with both options, sinks
    only, the cap only and neither (want, sinks_only, cap_only, plain: [2, HQ, D])."""
    rng = np.random.default_rng(23)
    n = sum(HISTORY)
    hist_k, hist_v = (rng.standard_normal((n, HKV, D)).astype(np.float32) for _ in range(2))
    q_raw = (rng.standard_normal((2, HQ, D)) * 4).astype(np.float32)
    k_raw, v = (rng.standard_normal((2, HKV, D)).astype(np.float32) for _ in range(2))
    cos_t, sin_t = rope_tables(D, 64, 10000.0)
    pos = np.array(HISTORY)
    cos, sin = cos_t[pos], sin_t[pos]
    q, k = ref_rope(q_raw, cos, sin, "half"), ref_rope(k_raw, cos, sin, "half")
    outs = {}
    for name, opts in (("want", {"sinks": SINKS, "softcap": CAP}), ("sinks_only", {"sinks": SINKS}),
                       ("cap_only", {"softcap": CAP}), ("plain", {})):
        c = ref.ContiguousKVCache(1, HKV, D, 2, 48)
        for sid in "ab":
            c.add_sequence(sid)
        with c.step(list("ab"), HISTORY):
            c.write(0, hist_k, hist_v)
        with c.step(list("ab"), [1, 1]):
            c.write(0, k, v)
            outs[name] = c.attend(0, q, **opts)
    return SimpleNamespace(hist_k=hist_k, hist_v=hist_v, q_raw=q_raw, k_raw=k_raw, v=v, q=q, k=k, cos=cos, sin=sin,
                           **outs)


def test_each_option_changes_the_answer(data):
    for other in (data.sinks_only, data.cap_only, data.plain):
        assert rel_err(other, data.want) > 1e-2


def _contiguous(rt, data):
    cache = gpu.ContiguousKVCache(1, HKV, D, 2, 48, runtime=rt)
    for sid in "ab":
        cache.add_sequence(sid)
    with cache.step(list("ab"), HISTORY):
        cache.write(0, rt.asarray(data.hist_k), rt.asarray(data.hist_v))
    return cache


def test_decode_kernels_apply_sinks_and_softcap(rt, data):
    cache = _contiguous(rt, data)
    sinks = rt.asarray(SINKS)
    with cache.step(list("ab"), [1, 1]):
        cache.write(0, rt.asarray(data.k), rt.asarray(data.v))
        q = rt.asarray(data.q)
        for version, splits in CONTIGUOUS:
            launch = cache.prepare_attend(0, q, version=version, num_splits=splits, sinks=sinks, softcap=CAP)
            assert (launch.version, launch.splits) == (version, splits)
            got = rt.asnumpy(launch())
            assert rel_err(got, data.want) <= KERNEL_RTOL, (version, splits)


@pytest.mark.parametrize("version,splits", [(1, 1), (2, 2)], ids=["v1", "v2-split2"])
def test_fused_kernels_apply_sinks_and_softcap(rt, data, version, splits):
    cache = _contiguous(rt, data)
    args = [rt.asarray(a) for a in (data.q_raw, data.k_raw, data.v, data.cos, data.sin)]
    with cache.step(list("ab"), [1, 1]):
        launch = cache.prepare_rope_write_attend(0, *args, "half", version=version, num_splits=splits,
                                                 sinks=rt.asarray(SINKS), softcap=CAP)
        assert (launch.version, launch.splits) == (version, splits)
        got = rt.asnumpy(launch())
        cache._written.add(0)  # the fused launch wrote the layer (as rope_write_attend records it)
    assert rel_err(got, data.want) <= KERNEL_RTOL


def test_paged_decode_kernels_apply_sinks_and_softcap(rt, data):
    """Sequence b alone (41 keys; its row of the two-sequence answer): 32-key partitions split it in v2, and
    v3/v4's split_plan cuts it in two as well (2 blocks, a wave of 4 on the simulator's one multiprocessor)."""
    cache = gpaged.PagedKVCache(1, HKV, D, 20, block_size=5, runtime=rt, partition_size=32)
    for sid in "ab":
        cache.add_sequence(sid)
    with cache.step(list("ab"), HISTORY):
        cache.write(0, rt.asarray(data.hist_k), rt.asarray(data.hist_v))
    with cache.step(["b"], [1]):
        cache.write(0, rt.asarray(data.k[1:]), rt.asarray(data.v[1:]))
        q = rt.asarray(data.q[1:])
        for version in (1, 2, 3, 4):
            launch = cache.prepare_attend(0, q, version=version, sinks=rt.asarray(SINKS), softcap=CAP)
            assert launch.version == version and launch.partitions == (1 if version == 1 else 2)
            got = rt.asnumpy(launch())
            assert rel_err(got, data.want[1:]) <= KERNEL_RTOL, version
    table = cache.blocks.table("b")[None]
    got = gpaged.paged_attention(rt.asarray(data.q[1:]), cache.k_pool[0], cache.v_pool[0], table, [41], sinks=SINKS,
                                 softcap=CAP, runtime=rt)
    assert rel_err(rt.asnumpy(got), data.want[1:]) <= KERNEL_RTOL


def test_window_kernels_apply_sinks_and_softcap(rt):
    """window_decode v1 (with H2O's mass: each key's probability, the sink in its denominator), v3 and v4 over a
    wrapped ring of a window of 7 with 2 sink tokens, through attend_slots, minikv's name and arguments."""
    from test_gpu_window import ring

    rng = np.random.default_rng(31)
    w, s, q_pos = 7, 2, np.array([3 * 7 + 1])
    k, v, pos = (a[0] for a in ring(rng, w, s, q_pos, extra=0))
    q = (rng.standard_normal((1, 4, 16)) * 4).astype(np.float32)
    tiles = [(k[:, :4], v[:, :4], pos[:, :4]), (k[:, 4:], v[:, 4:], pos[:, 4:])]
    vis = gwindow.Visible(ref_window.WindowPolicy(w, s), q_pos)
    sinks, rows = SINKS[:4], np.array([True])
    want = ref_window.attend_slots(q, tiles, vis, rows, sinks=sinks, softcap=CAP)
    for opts in ({"sinks": sinks}, {"softcap": CAP}, {}):  # each option matters here too
        assert rel_err(ref_window.attend_slots(q, tiles, vis, **opts), want[0]) > 1e-2
    got = gwindow.attend_slots(q, tiles, vis, rows, sinks=sinks, softcap=CAP, version=1, runtime=rt)
    assert rel_err(rt.asnumpy(got[0]), want[0]) <= KERNEL_RTOL
    for a, b in zip(got[1], want[1]):
        assert rel_err(np.asarray(a), b) <= KERNEL_RTOL
    for version in (3, 4):
        got = gwindow.attend_slots(q, tiles, vis, sinks=sinks, softcap=CAP, version=version, runtime=rt)
        assert rel_err(rt.asnumpy(got), want[0]) <= KERNEL_RTOL, version


@pytest.mark.parametrize("kind", ghybrid.HYBRID_KINDS)
def test_hybrid_cache_passes_the_options_to_every_group(rt, kind):
    """A sliding layer (window 4, the window kernel on a decode step) and a full one (the contiguous or paged
    kernels) against minikv's hybrid cache with the same options, prefill (NumPy and v1/v2) and decode."""
    rng = np.random.default_rng(37)
    caches = [ref_hybrid_cache("contiguous", [4, None], 2, 16, 12),
              ghybrid.hybrid_cache(kind, [4, None], 2, 16, 12, block_size=3, runtime=rt)]
    for c in caches:
        c.add_sequence(0)
    sinks = SINKS[:4]
    for num_new in (7, 1):
        q = (rng.standard_normal((num_new, 4, 16)) * 4).astype(np.float32)
        k, v = (rng.standard_normal((num_new, 2, 16)).astype(np.float32) for _ in range(2))
        outs = []
        for i, c in enumerate(caches):
            dev = rt.asarray if i else (lambda a: a)
            with c.step([0], [num_new]):
                outs.append([])
                for layer in (0, 1):
                    c.write(layer, dev(k), dev(v))
                    outs[-1].append(c.attend(layer, dev(q), sinks=dev(sinks), softcap=CAP))
        for layer in (0, 1):
            assert rel_err(rt.asnumpy(outs[1][layer]), outs[0][layer]) <= KERNEL_RTOL, (num_new, layer)
    sliding = [g for _, g in caches[1].groups if isinstance(g, ghybrid.SlidingRingKVCache)]
    assert sliding[0].gpu_steps == 1  # the decode step ran the window kernel


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_gpu_model_runs_a_model_with_sinks_and_softcap(rt, fused):
    """test_gpu_model.py's "gqa3" model given learned sinks and a cap: prefill, then decode steps (the fused
    kernel on them when fused), and its uncached logits (the GPU NoCache), equal to the NumPy model's. Options
    it cannot run are refused."""
    cpu = random_model(rope_layout="half", seed=5, num_heads=6, num_kv_heads=2, head_dim=16, hidden_size=42,
                       intermediate_size=70)
    rng = np.random.default_rng(41)
    layers = [replace(lw, sinks=(rng.standard_normal(6) * 2).astype(np.float32)) for lw in cpu.weights.layers]
    model = Model(replace(cpu.config, attn_softcap=0.5, sinks=True), replace(cpu.weights, layers=layers),
                  dtype=np.float32)
    ids = [3, 1, 4, 1, 5, 9, 2]
    want = model.logits(ids)[4:]
    assert rel_err(cpu.logits(ids)[4:], want) > 1e-2
    gpu = gmodel.from_cpu(model, runtime=rt, fused=fused)
    cache = gpu.new_cache(1, 8)
    cache.add_sequence(0)
    got = [rt.asnumpy(gpu.forward([ids[:5]], cache))] + [rt.asnumpy(gpu.forward([[t]], cache)) for t in ids[5:]]
    assert_close(np.concatenate(got), want, np.float32)
    if not fused:  # the uncached logits: the GPU NoCache, causal_attention_v1 with the options
        assert_close(rt.asnumpy(gpu.logits(ids))[4:], want, np.float32)
    with pytest.raises(ConfigError, match="config.final_softcap=30.0"):
        gmodel.from_cpu(Model(replace(cpu.config, final_softcap=30.0), cpu.weights, dtype=np.float32), runtime=rt)


def test_bad_options_and_caches_without_them_refuse(rt):
    cache = gpu.ContiguousKVCache(1, HKV, D, 1, 8, runtime=rt)
    cache.add_sequence(0)
    z = rt.asarray(np.zeros((1, HKV, D), np.float32))
    with cache.step([0], [1]):
        cache.write(0, z, z)
        q = rt.asarray(np.zeros((1, HQ, D), np.float32))
        with pytest.raises(ShapeError, match="one logit per query head"):
            cache.attend(0, q, sinks=rt.asarray(np.zeros(3, np.float32)))
        with pytest.raises(ConfigError, match="softcap=-1.0"):
            cache.attend(0, q, softcap=-1.0)
    with pytest.raises(ConfigError, match="version=1"):
        gattention.causal_attention(q.transpose(1, 0, 2), z.transpose(1, 0, 2), z.transpose(1, 0, 2), softcap=CAP,
                                    version=0, runtime=rt)
    qc = gquant.QuantizedPagedKVCache(1, HKV, D, 4, block_size=4, kv_dtype="int8", runtime=rt)
    qc.add_sequence(0)
    qc.begin_step([0], [1])
    try:  # the NumPy quantized cache does not take the options either: the seam refuses them by name
        with pytest.raises(ConfigError, match="learned sinks or logit soft-capping"):
            qc.attend(0, q, sinks=rt.asarray(SINKS))
    finally:
        qc.abort_step()
