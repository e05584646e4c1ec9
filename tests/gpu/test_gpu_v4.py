"""v4, the register-resident decode loop with its loads in flight (kernels/decode_v4.cuh), against NumPy for
every cache kind that has it: contiguous, paged, quantized and window decode, on every backend.

The axes of tests/gpu/test_gpu_v3.py (GQA groups 1, 3, 4, 8; head_dim 64 and 128, plus 8 and 16; fp16 and
fp32; block sizes 1, 5, 16; contexts 1 .. 211 including block_size +- 1; NaN-poisoned pools; split and
unsplit) are covered by a covering subset rather than the full product, to keep the simulator's time in CI
small: every value of every axis appears, each (block size, dtype) pair of the paged cache, each group with
both dtypes and both head_dims it is used with. v4's own paths get their own cases: 16 dims per lane
(head_dim 128, G <= 4), 8 (G = 8 or head_dim 64), one lane per key (head_dim 8), block sizes that are not
powers of two (the runtime division), several iterations per warp (contexts past 4 x 32 keys), and
lookups that span two blocks in one warp's keys. The last test runs this file under AddressSanitizer.
"""

from pathlib import Path

import numpy as np
import pytest
from sim_sources import run_under_asan
from test_gpu_kv_cache import RTOL
from test_gpu_paged import PagedBatch
from test_gpu_quant import CacheTwin
from test_gpu_v3 import check_contiguous
from test_gpu_window import in_cache_reference, reference, ring

from minikv import window as ref_window
from minikv.bench.equivalence import rel_err
from minikv.layers import rope_tables
from minikv_gpu import window as gw

ROOT = Path(__file__).resolve().parents[2]

# (block_size, (Hq, Hkv, D), dtype): a covering subset of 3 block sizes x 5 head shapes x 2 dtypes
PAGED = [(1, (2, 2, 64), "fp16"), (16, (2, 2, 64), "fp32"),
         (5, (9, 3, 64), "fp32"), (16, (9, 3, 64), "fp16"),
         (1, (8, 2, 128), "fp32"), (5, (8, 2, 128), "fp16"),
         (16, (8, 1, 128), "fp32"), (1, (8, 1, 128), "fp16"),
         (5, (3, 1, 128), "fp16"), (16, (3, 1, 128), "fp32")]
DTYPES = {"fp16": np.float16, "fp32": np.float32}
HEADS = [(2, 2, 64), (9, 3, 64), (8, 2, 128), (8, 1, 128), (3, 1, 128), (4, 4, 8)]


def _contexts(bs: int) -> list[int]:
    return [1, bs - 1 if bs > 2 else 2, bs + 1, 2 * bs, 3 * bs + 2, 97, 211]


@pytest.mark.parametrize("block_size,heads,dtype", PAGED, ids=lambda x: str(x).replace(" ", ""))
def test_paged_v4_equals_numpy(rt, block_size, heads, dtype):
    hq, hkv, d = heads
    rng = np.random.default_rng(block_size * 1000 + hq * 10 + hkv)
    ctx = _contexts(block_size)
    batch = PagedBatch(rng, ctx, [1] * len(ctx), block_size, hq, hkv, d, dtype=DTYPES[dtype])
    got = batch.run(rt, version=4)
    assert np.all(np.isfinite(got)) and rel_err(got, batch.reference()) <= RTOL
    one = PagedBatch(rng, [211], [1], block_size, hq, hkv, d, dtype=DTYPES[dtype])  # split in 32-key ranges
    got = one.run(rt, version=4, partition_size=32)
    assert np.all(np.isfinite(got)) and rel_err(got, one.reference()) <= RTOL


def test_paged_v4_equals_v3_and_v1_split_and_unsplit(rt):
    batch = PagedBatch(np.random.default_rng(7), [300, 65, 1], [1, 1, 1], 16, 8, 2, 128, dtype=np.float16)
    v1 = batch.run(rt, version=1)
    for ps in (32, 96, 512):
        assert rel_err(batch.run(rt, version=4, partition_size=ps), v1) <= RTOL
        assert rel_err(batch.run(rt, version=4, partition_size=ps), batch.run(rt, version=3, partition_size=ps)) \
            <= RTOL


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "hq{}_hkv{}_d{}".format(*h))
def test_contiguous_v4_equals_numpy(rt, heads, dtype):
    """Histories of 0, 1, 31, 33 and 200 keys (plus the new one), unsplit and split; unwritten slots NaN."""
    check_contiguous(rt, heads, DTYPES[dtype], 4)


# (kv_dtype, group, block_size, (Hq, Hkv, D), dtype, partition_size): every codec, block sizes 1, 5, 8, 16,
# 16 dims per lane (int8/fp8 g32/int4 at D = 128, G <= 4) and 8 (kivi2, fp8 g8, G = 8, D = 64), split once
QUANT = [("int8", 32, 16, (8, 2, 128), "fp16", 512), ("fp8", 32, 5, (9, 3, 64), "fp32", 512),
         ("int4", 32, 1, (8, 1, 128), "fp16", 512), ("kivi2", 8, 8, (2, 2, 64), "fp32", 512),
         ("fp8", 8, 16, (3, 1, 128), "fp32", 512), ("int8", 32, 16, (4, 1, 128), "fp32", 32)]


@pytest.mark.parametrize("kv_dtype,group,block_size,heads,dtype,partition_size", QUANT,
                         ids=lambda x: str(x).replace(" ", ""))
def test_quant_v4_equals_numpy(rt, kv_dtype, group, block_size, heads, dtype, partition_size):
    """Prefill rows (each at its own position) and decode rows over codes and residual, NaN-poisoned residual."""
    hq, hkv, d = heads
    tw = CacheTwin(rt, kv_dtype, group, block_size=block_size, hq=hq, hkv=hkv, d=d, dtype=DTYPES[dtype],
                   num_blocks=-(-230 // block_size) * 2 + 8, version=4, partition_size=partition_size)
    tw.step(["a", "b"], [2 * block_size + 1, 150])
    for _ in range(2):
        tw.step(["a", "b"], [1, 1])
    tw.step(["b", "c"], [1, block_size + 2])


# (W, S, (Hq, Hkv, D), dtype, rope layout or None): groups 1, 3, 4, 8, head_dim 8 .. 128, rings past 4 x 32
WINDOW = [(37, 3, (2, 2, 64), "fp16", None), (61, 2, (9, 3, 64), "fp32", "half"),
          (130, 4, (8, 2, 128), "fp16", "interleaved"), (211, 0, (8, 1, 128), "fp32", None),
          (24, 1, (3, 1, 128), "fp32", "half"), (9, 1, (4, 4, 8), "fp16", "half")]


@pytest.mark.parametrize("w,s,heads,dtype,layout", WINDOW, ids=lambda x: str(x).replace(" ", ""))
def test_window_v4_equals_numpy(rt, w, s, heads, dtype, layout):
    """Unfilled, just wrapped and long-wrapped rings; empty slots NaN; in-cache rotation in both layouts."""
    hq, hkv, d = heads
    rng = np.random.default_rng(w + hq)
    q_pos = [2, w + 1, 3 * w + 5]
    k, v, pos = ring(rng, w, s, q_pos, dtype=DTYPES[dtype], d=d, hkv=hkv)
    q = rng.standard_normal((len(q_pos), hq, d)).astype(np.float32)
    policy = ref_window.WindowPolicy(w, s, positions="in-cache" if layout else "original")
    k32, v32 = k.astype(np.float32), v.astype(np.float32)
    if layout:
        rope = (*rope_tables(d, 4 * w + 8, 10000.0), layout)
        want = in_cache_reference(q, k32, v32, pos, q_pos, policy, rope)
    else:
        rope, want = None, reference(q, k32, v32, pos, q_pos, policy)
    got = rt.asnumpy(gw.window_decode(q, k, v, pos, np.array(q_pos), w, s, rope=rope, version=4, runtime=rt))
    assert np.all(np.isfinite(got)) and rel_err(got, want) <= RTOL


def test_v4_under_asan():
    """This file's kernels compiled with -fsanitize=address (a subset, in a subprocess): no report. Each shape
    is its own build, so each kernel runs once or twice at shapes with partial tiles: paged blocks of 5, every
    codec of the quantized cache, the window kernel under each RoPE layout."""
    select = ("sim and not asan and ((paged_v4_equals_numpy and -5-) or equals_v3_and_v1 or "
              "(contiguous_v4_equals_numpy and hq9) or (quant_v4 and not -8-16-) or "
              "(window_v4 and (-37- or -61- or -130-)))")
    run_under_asan(__file__, select, at_least=14)
