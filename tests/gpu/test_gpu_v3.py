"""v3, the register-resident decode kernels (kernels/decode_v3.cuh): ``paged_decode_attention_v3`` and
``decode_attention_v3`` against NumPy, on every backend.

Paged: ``minikv.paged.attention.paged_attention`` over NaN-poisoned pools (every slot that holds no token of a
context is NaN), GQA groups 1, 3, 4, 8, head_dim 64 and 128 (and 16, the tiny model's), float32
and float16 pools, block sizes 1, 5, 16, contexts 1 .. a few hundred including block_size +- 1,
split (partitions of 32 keys) and unsplit. Contiguous: the NumPy ``ContiguousKVCache`` with
histories of 0, 1, 31, 33 and 200 keys, every unwritten position of the device cache NaN.
Tolerance ``KERNEL_RTOL`` against NumPy on the same (rounded) cache; float16 against the exact
float32 computation within test_gpu_kv_cache's documented ``fp16_bound``. The choice rules
(decode only, G <= 8, powers of two) are checked too.
``MINIKV_SIM_ASAN=1`` (see the simulator's README) runs this file under AddressSanitizer; the
last test does so in a subprocess (every simulator test of the file).
"""

from pathlib import Path

import numpy as np
import pytest
from sim_sources import run_under_asan
from test_gpu_kv_cache import RTOL, Twin, fp16_bound, probe_step
from test_gpu_paged import PagedBatch

from minikv.bench.equivalence import KERNEL_RTOL, rel_err
from minikv.errors import ConfigError, InvalidInputError
from minikv_gpu import kv_cache as gpu_kv
from minikv_gpu.runtime import multiprocessors
from minikv_gpu.versions import decode_refusal, split_plan

assert RTOL == KERNEL_RTOL
ROOT = Path(__file__).resolve().parents[2]

# (Hq, Hkv, D): GQA groups 1, 3, 4, 8; head_dim 64 and 128
HEADS = [(2, 2, 64), (9, 3, 64), (8, 2, 128), (8, 1, 128), (3, 1, 128)]


def _contexts(bs: int) -> list[int]:
    return [1, bs - 1 if bs > 2 else 2, bs + 1, 2 * bs, 3 * bs + 2, 97, 211]


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "hq{}_hkv{}_d{}".format(*h))
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_paged_v3_equals_numpy(rt, block_size, heads, dtype):
    hq, hkv, d = heads
    rng = np.random.default_rng(block_size * 1000 + hq * 10 + hkv)
    ctx = _contexts(block_size)
    batch = PagedBatch(rng, ctx, [1] * len(ctx), block_size, hq, hkv, d, dtype=dtype)
    got = batch.run(rt, version=3)  # 7 * Hkv blocks: at least one wave on the simulator, unsplit
    assert np.all(np.isfinite(got))
    assert rel_err(got, batch.reference()) <= RTOL
    if dtype == np.float32:
        assert rel_err(got, batch.contiguous()) <= RTOL
    one = PagedBatch(rng, [211], [1], block_size, hq, hkv, d, dtype=dtype)  # Hkv < 4 blocks: split in 32s
    got = one.run(rt, version=3, partition_size=32)
    assert np.all(np.isfinite(got)) and rel_err(got, one.reference()) <= RTOL


def test_split_plan_minimises_waves_and_cuts_evenly():
    """versions.split_plan with the device's size given: the same answers on the simulator and a GPU."""
    # SmolLM2 on an H200 (64 x 3 blocks, 4 per SM x 132 SMs = 528 slots): 8 splits, 1536 blocks in 3 waves,
    # 97% of the slots busy (2 splits: one wave, 73%). The nearest-wave rule took 3: 576 blocks, a second
    # wave of 48 (55%).
    assert split_plan(4097, 192, 4, 132, min_keys=512) == (8, 544)
    # the quant stage's case (16 x 8 blocks): 4 even tile-aligned cuts, 2080 x 3 + 1953, not 2560 x 3 + 513
    assert split_plan(8193, 128, 4, 132, min_keys=512) == (4, 2080)
    # one multiprocessor of 4 slots (the simulator's size): 1, 2, 3, 4 blocks of 1000 keys
    assert [split_plan(1000, b, 4, 1)[0] for b in (1, 2, 3, 4)] == [4, 2, 4, 1]  # 3 blocks: 12 in 3 full waves
    assert split_plan(1000, 1, 2, 1) == (2, 512)  # 2 slots per SM (G > 4)
    assert split_plan(20, 1, 4, 1) == (1, 32) and split_plan(0, 3, 4, 1) == (1, 32)
    assert split_plan(200, 1, 4, 1, requested=50) == (7, 32)  # a request: clamped to one tile per split
    rng = np.random.default_rng(0)
    for _ in range(300):
        keys, blocks, per_sm, sms = (int(x) for x in (rng.integers(1, 40000), rng.integers(1, 3000),
                                                      rng.choice([2, 4]), rng.choice([1, 108, 132])))
        z, per = split_plan(keys, blocks, per_sm, sms)
        wave = per_sm * sms
        assert per % 32 == 0 and (z - 1) * per < keys <= z * per  # whole tiles, no empty split
        assert z == 1 or blocks * z <= wave or blocks * z >= 2 * wave  # never 1.x waves


def test_paged_v3_split_equals_unsplit_and_v1(rt):
    batch = PagedBatch(np.random.default_rng(7), [300, 65, 1], [1, 1, 1], 16, 8, 2, 128, dtype=np.float16)
    v1 = batch.run(rt, version=1)
    for ps in (32, 64, 96, 512):
        assert rel_err(batch.run(rt, version=3, partition_size=ps), v1) <= RTOL


def test_paged_v3_refusals_and_choice(rt):
    batch = PagedBatch(np.random.default_rng(8), [9, 12], [1, 3], 4, 4, 2, 64)
    with pytest.raises(InvalidInputError, match="decode kernel"):
        batch.run(rt, version=3)
    assert rel_err(batch.run(rt), batch.reference()) <= RTOL  # None falls back for the prefill rows
    wide = PagedBatch(np.random.default_rng(9), [9], [1], 4, 16, 1, 64)
    with pytest.raises(ConfigError, match="at most 8"):
        wide.run(rt, version=3)
    assert rel_err(wide.run(rt), wide.reference()) <= RTOL
    odd = PagedBatch(np.random.default_rng(10), [9], [1], 4, 2, 1, 96)
    with pytest.raises(ConfigError, match="power of two"):
        odd.run(rt, version=3)
    with pytest.raises(ConfigError, match="version=5"):
        batch.run(rt, version=5)


def test_paged_cache_version_3_decodes_with_v3_and_prefills_with_v1_v2(rt):
    from test_gpu_paged import ModelTwin

    tw = ModelTwin(rt, block_size=5, num_blocks=40, gpu_kw=dict(version=3, partition_size=32))
    rng = np.random.default_rng(0)
    tw.both("add_sequence", 0)
    tw.both("add_sequence", 1)
    tw.forward([rng.integers(0, 101, 40), rng.integers(0, 101, 3)], [0, 1])  # prefill: the cache falls back
    for t in range(3):
        tw.forward([[4 + t], [9 + t]], [0, 1])
    c = tw.c_gpu
    with probe_step(c, [0, 1], [1, 1]):
        q = rt.asarray(np.ones((2, 6, 16), np.float32))
        assert c.prepare_attend(0, q).version == 3
        assert c.prepare_attend(0, q, version=1).version == 1
    with probe_step(c, [0, 1], [2, 1]):
        assert c.prepare_attend(0, rt.asarray(np.ones((3, 6, 16), np.float32))).version in (1, 2)
        with pytest.raises(InvalidInputError, match="decode kernel"):
            c.prepare_attend(0, rt.asarray(np.ones((3, 6, 16), np.float32)), version=3)


# --- the contiguous cache -------------------------------------------------------------------------

def check_contiguous(rt, heads, dtype, version: int) -> None:
    """Histories of 0, 1, 31, 33 and 200 keys (plus the new one), unsplit and split (1, 3 or automatic
    ranges), every unwritten position NaN: ``version`` equals NumPy, and fp16 stays within fp16_bound."""
    hq, hkv, d = heads
    tw = Twin(rt, hq, hkv, d, max_seqs=5, max_len=204, dtype=dtype)
    tw.gpu.version = version
    tw.gpu.k[...] = np.nan  # every position past a history is stale: a kernel that reads one returns NaN
    tw.gpu.v[...] = np.nan
    for sid in "abcde":
        tw.add(sid)
    tw.fill("bcde", [1, 31, 33, 200])
    steps = [tw.step("abcde", [1] * 5, num_splits=splits) for splits in (1, 3, None)]
    ks, vs = tw.histories()
    for s in steps:
        assert np.all(np.isfinite(s.got))
        assert rel_err(s.got, s.want) <= RTOL
        if dtype == np.float16:
            err = float(np.max(np.abs(s.got - s.exact)))
            assert err <= fp16_bound(s.q, ks, vs) + RTOL * float(np.max(np.abs(s.exact)))


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "hq{}_hkv{}_d{}".format(*h))
def test_contiguous_v3_equals_numpy(rt, heads, dtype):
    check_contiguous(rt, heads, dtype, 3)


def test_contiguous_v3_is_chosen_for_decode_and_refused_for_prefill(rt):
    """The choice rules, and the split counts of split_plan on this device (whatever its size)."""
    tw = Twin(rt, 8, 2, 64, max_seqs=2, max_len=80)
    for sid in "ab":
        tw.add(sid)
    tw.fill("ab", [40, 3])
    q = rt.asarray(np.ones((2, 8, 64), np.float32))
    with probe_step(tw.gpu, "ab", [1, 1]):
        assert tw.gpu.prepare_attend(1, q).version == 4  # None prefers the newest decode version
        launch = tw.gpu.prepare_attend(1, q, version=3, num_splits=2)
        assert (launch.version, launch.splits) == (3, 2)
        auto = tw.gpu.prepare_attend(1, q, version=3)
        assert (auto.splits, auto.keys_per_split) == split_plan(41, 2 * 2, 4, multiprocessors(rt), min_keys=256)
        with pytest.raises(ConfigError, match="fused"):
            tw.gpu.prepare_rope_write_attend(1, q, q[:, :2], q[:, :2], q[:, 0, :32], q[:, 0, :32], "half",
                                             version=3)
    tw.gpu.version = 3
    with probe_step(tw.gpu, "ab", [2, 1]):
        q3 = rt.asarray(np.ones((3, 8, 64), np.float32))
        assert tw.gpu.prepare_attend(1, q3).version in (1, 2)  # the cache's 3 falls back on a prefill step
        with pytest.raises(InvalidInputError, match="decode kernel"):
            tw.gpu.prepare_attend(1, q3, version=3)
    assert decode_refusal(4, 64, True) is None and decode_refusal(9, 64, True)[0] is ConfigError


def test_the_split_choice_follows_the_device_size(monkeypatch):
    """The simulator standing in for a 132-multiprocessor GPU: the cache asks split_plan with 132, so a
    test written for one multiprocessor (or for 132) holds on both."""
    from minikv_gpu import runtime

    sim = runtime.get_runtime("sim")
    for sms in (1, 132):
        monkeypatch.setattr(gpu_kv, "multiprocessors", lambda rt, sms=sms: sms)
        tw = Twin(sim, 8, 2, 64, max_seqs=2, max_len=1100)
        for sid in "ab":
            tw.add(sid)
        tw.fill("ab", [999, 5])
        tw.gpu.begin_step("ab", [1, 1])  # the plan only: nothing is launched
        launch = tw.gpu.prepare_attend(1, sim.asarray(np.ones((2, 8, 64), np.float32)), version=3)
        assert (launch.splits, launch.keys_per_split) == split_plan(1000, 4, 4, sms, min_keys=256)
        tw.gpu.abort_step()


# --- AddressSanitizer ------------------------------------------------------------------------------

def test_v3_under_asan():
    """This file's v3 kernels compiled with -fsanitize=address (a subset, in a subprocess): no report. Each
    shape is its own build (the defines), so the subset takes each kernel once at shapes that leave partial
    tiles: paged blocks of 5 tokens over every head grouping, two contiguous groupings, the split paths."""
    select = ("sim and not asan and ((paged_v3_equals_numpy and -5- and fp16) or split_equals or refusals or "
              "(contiguous_v3_equals_numpy and fp32 and (hq9 or hq3)) or cache_version_3 or is_chosen)")
    run_under_asan(__file__, select, at_least=11)
