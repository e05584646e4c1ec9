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

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_gpu_kv_cache import RTOL, Twin, fp16_bound
from test_gpu_paged import PagedBatch

from minikv.bench.equivalence import KERNEL_RTOL, rel_err
from minikv.errors import ConfigError, InvalidInputError
from minikv_gpu import kv_cache as gpu_kv
from minikv_gpu import paged as gpu

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


def test_paged_v3_launch_splits_only_below_one_wave(sim_rt):
    """The simulator counts as one multiprocessor: 4 blocks (G <= 4) or 2 (G > 4) fill it."""
    assert gpu.v3_partitions(200, 1, 4, 32, sim_rt) == (4, 64)     # 7 partitions of 32, 4 blocks wanted
    assert gpu.v3_partitions(200, 4, 4, 32, sim_rt) == (1, 224)    # one wave already: unsplit
    assert gpu.v3_partitions(200, 1, 8, 32, sim_rt) == (2, 128)    # G > 4: 2 blocks per SM
    assert gpu.v3_partitions(20, 1, 1, 32, sim_rt) == (1, 32)      # one partition
    assert gpu.v3_partitions(0, 3, 1, 32, sim_rt) == (1, 32)
    assert gpu.v3_partitions(200, 3, 4, 32, sim_rt) == (1, 224)    # 3 of 4 slots: nearest is one wave
    assert gpu.v3_partitions(200, 2, 4, 32, sim_rt) == (2, 128)


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
    assert gpu.choose_version(9000, 1, 1, runtime=rt, v3=True) == 3
    with pytest.raises(ConfigError, match="version=4"):
        batch.run(rt, version=4)


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
    with c.step([0, 1], [1, 1]):
        q = rt.asarray(np.ones((2, 6, 16), np.float32))
        assert c.prepare_attend(0, q).version == 3
        assert c.prepare_attend(0, q, version=1).version == 1
    with c.step([0, 1], [2, 1]):
        assert c.prepare_attend(0, rt.asarray(np.ones((3, 6, 16), np.float32))).version in (1, 2)
        with pytest.raises(InvalidInputError, match="decode kernel"):
            c.prepare_attend(0, rt.asarray(np.ones((3, 6, 16), np.float32)), version=3)


# --- the contiguous cache -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "hq{}_hkv{}_d{}".format(*h))
def test_contiguous_v3_equals_numpy(rt, heads, dtype):
    """Histories of 0, 1, 31, 33 and 200 keys (plus the new one), unsplit and split (3 ranges)."""
    hq, hkv, d = heads
    tw = Twin(rt, hq, hkv, d, max_seqs=5, max_len=204, dtype=dtype)
    tw.gpu.version = 3
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


def test_contiguous_v3_is_chosen_for_decode_and_refused_for_prefill(rt):
    tw = Twin(rt, 8, 2, 64, max_seqs=2, max_len=80)
    for sid in "ab":
        tw.add(sid)
    tw.fill("ab", [40, 3])
    q = rt.asarray(np.ones((2, 8, 64), np.float32))
    with tw.gpu.step("ab", [1, 1]):
        assert tw.gpu.prepare_attend(1, q).version == 3  # None prefers v3 for decode
        launch = tw.gpu.prepare_attend(1, q, num_splits=2)
        assert (launch.version, launch.splits) == (3, 2)
        tw.gpu._dev["max_keys"] = 1000  # long enough for 4 ranges of MIN_KEYS_PER_SPLIT: only the waves decide
        # the simulator's wave is 4 blocks: v3 takes the split count nearest it, v2 at least it
        assert [tw.gpu._splits(None, b, 4, nearest=True)[0] for b in (1, 2, 3, 4)] == [4, 2, 1, 1]
        assert [tw.gpu._splits(None, b, 4)[0] for b in (1, 2, 3, 4)] == [4, 2, 2, 1]
        tw.gpu._dev["max_keys"] = 41
        with pytest.raises(ConfigError, match="fused"):
            tw.gpu.prepare_rope_write_attend(1, q, q[:, :2], q[:, :2], q[:, 0, :32], q[:, 0, :32], "half",
                                             version=3)
    tw.gpu.version = 3
    with tw.gpu.step("ab", [2, 1]):
        q3 = rt.asarray(np.ones((3, 8, 64), np.float32))
        assert tw.gpu.prepare_attend(1, q3).version in (1, 2)  # the cache's 3 falls back on a prefill step
        with pytest.raises(InvalidInputError, match="decode kernel"):
            tw.gpu.prepare_attend(1, q3, version=3)
    assert gpu_kv.v3_refusal(4, 64, True) is None and gpu_kv.v3_refusal(9, 64, True)[0] is ConfigError


# --- AddressSanitizer ------------------------------------------------------------------------------

def test_v3_under_asan():
    """This file's v3 kernels compiled with -fsanitize=address (a subset, in a subprocess): no report."""
    if os.environ.get("MINIKV_SIM_ASAN") == "1":
        pytest.skip("already running under ASan")
    lib = subprocess.run([os.environ.get("CXX") or "g++", "-print-file-name=libasan.so"], capture_output=True,
                         text=True).stdout.strip()
    if not os.path.isabs(lib) or not os.path.exists(lib):
        pytest.skip("g++ has no libasan.so")
    env = dict(os.environ, MINIKV_SIM_ASAN="1", LD_PRELOAD=lib, ASAN_OPTIONS="detect_leaks=0",
               MINIKV_GPU_BACKEND="sim", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                           "sim and not asan"], env=env, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "AddressSanitizer" not in proc.stderr
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= 40 and "failed" not in proc.stdout, proc.stdout[-2000:]
