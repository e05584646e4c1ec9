"""Step 5 kernels (kernels/quant.cu) and ``minikv_gpu.quant`` against ``minikv.quant``, on every backend.

Stored bytes: ``quantize_blocks_v1`` writes exactly ``minikv.quant``'s encode (int8 = q8_0, fp8
e4m3fn with groups 8 and 32, int4 = q4_0, kivi2 = asym2 keys per channel and values per token),
for fp32 and fp16 residual pools, on values spanning 2^-20 .. 2^20 (fp16 and kivi2: 2^+-10), exact
ties of the rounding, zero and constant groups, fp8 saturation and subnormals; blocks not listed
(NaN-poisoned) are neither read nor written.

Attention: the GPU quantized cache equals ``minikv.quant.cache.quantized_paged_attention`` (the NumPy
cache's ``attend``) within ``KERNEL_RTOL``, over prefill + decode steps, split and unsplit, with
its codes bit-exact against the NumPy cache's after every step; a tiny model on it gives the
NumPy quantized cache's logits within the GPU model tolerance (``EXACT_RTOL[float32]``).
"""

import numpy as np
import pytest

from minikv import quant as ref
from minikv.bench.equivalence import EXACT_RTOL, KERNEL_RTOL, rel_err
from minikv.errors import ConfigError
from minikv.quant import codec
from minikv.weights.random_models import random_model
from minikv_gpu import model as gpu_model
from minikv_gpu import quant as gq

RTOL = KERNEL_RTOL
LOGIT_RTOL = EXACT_RTOL[np.float32]
CODECS = [("int8", 32), ("fp8", 32), ("fp8", 8), ("int4", 32), ("kivi2", 32), ("kivi2", 8)]
CODEC_IDS = ["int8", "fp8_g32", "fp8_g8", "int4", "kivi2_g32", "kivi2_g8"]


def _odd_pool(rng, shape, dtype, top=20):
    """Values over 2 * top binary orders of magnitude, with groups that hit the codecs' edge cases."""
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-top, top + 1, shape[:-1] + (1,)))
    x[0, 0, 0, :32] = 0.0                                   # an all-zero group
    x[0, 1, 0, :32] = -3.25                                 # a constant group
    x[0, 2, 0, :32] = np.arange(-16, 16) + 0.5              # q8_0: d = 15.5/127, many near-ties
    x[0, 3, 0, :32] = np.concatenate([[127.0], np.arange(31) - 15.5])  # d = 1: exact ties +-k.5
    x[1, 0, 0, :32] = np.concatenate([[448.0], rng.uniform(-1e-3, 1e-3, 31)])  # fp8: subnormal codes
    x[1, 1, 0, :8] = [1e-7, -1e-7, 0, 0, 0, 0, 0, 0]        # fp8 g8: the scale rounds to an fp16 subnormal
    return x.astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("kv_dtype,group", CODECS, ids=CODEC_IDS)
def test_quantize_blocks_is_bit_exact(rt, kv_dtype, group, dtype):
    """K and V of the listed blocks equal the NumPy format's encode (kivi2: keys per channel)."""
    rng = np.random.default_rng(group + 3 * (dtype == np.float16))
    nb, bs, hkv, d = 6, max(4, group if kv_dtype == "kivi2" else 4), 2, 64
    top = 20 if dtype == np.float32 and kv_dtype != "kivi2" else 10  # fp16 pools, kivi2's fp16 zero: finite
    k, v = (_odd_pool(rng, (nb, bs, hkv, d), dtype, top) for _ in range(2))
    k[4, :, 1, 3] = 0.75  # kivi2: a constant channel; int4: ties of |x| (the first one wins)
    k[4, 0, 1, 32:] = np.tile([-2.0, 2.0], 16)
    blocks = np.array([0, 1, 4], np.int32)
    for pool in (k, v):
        pool[[2, 3, 5]] = np.nan  # not listed: must not be read
    fmt = ref.kv_format(kv_dtype, group, bs, hkv, d)
    kc, vc = (np.full((nb, width), 0xA5, np.uint8) for width in fmt.block_bytes())
    dev = [rt.asarray(a) for a in (k, v, kc, vc)]
    gq.quantize_blocks(gq.quant_defines(kv_dtype, group, d, dtype), *dev, rt.asarray(blocks), runtime=rt)
    for got, pool, before, side in ((dev[2], k, kc, fmt.k), (dev[3], v, vc, fmt.v)):
        got = rt.asnumpy(got)
        want = side.encode(pool[blocks].astype(np.float32))
        assert np.array_equal(got[blocks], want)
        others = np.setdiff1d(np.arange(nb), blocks)
        assert np.array_equal(got[others], before[others])  # untouched


def test_fp8_codes_cover_every_finite_value(rt):
    """Every finite e4m3fn value and every midpoint between neighbours (ties to even) round-trips as
    ml_dtypes casts it: the group's amax is 448, so the scale is exactly 1."""
    import ml_dtypes
    vals = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    vals = np.sort(vals[np.isfinite(vals) & (vals >= 0)])
    mids = (vals[:-1] + vals[1:]) / 2
    x = np.concatenate([vals, mids, -vals, -mids, [448.0, 500.0, -1e9]])
    x = np.concatenate([x, np.zeros(-x.size % 32)]).astype(np.float32)
    x[::32] = 448.0  # every group's amax: scale 1
    pool = x.reshape(1, -1, 1, 32)
    c = codec("fp8_e4m3fn", 32)
    codes = rt.asarray(np.zeros((1, pool.shape[1] * 34), np.uint8))
    gq.quantize_blocks(gq.quant_defines("fp8", 32, 32, np.float32), rt.asarray(pool), rt.asarray(pool),
                       codes, rt.asarray(np.zeros_like(rt.asnumpy(codes))), rt.asarray(np.array([0], np.int32)),
                       runtime=rt)
    assert np.array_equal(rt.asnumpy(codes)[0], c.encode(pool[0]).reshape(-1))


class CacheTwin:
    """The NumPy quantized cache and the GPU one, fed the same K/V; attention and codes compared."""

    def __init__(self, rt, kv_dtype="int8", group=32, block_size=4, hq=8, hkv=2, d=64, dtype=np.float32,
                 num_blocks=24, num_host_blocks=0, **gpu_kw):
        self.rt, self.hq, self.hkv, self.d = rt, hq, hkv, d
        args = dict(num_layers=2, num_kv_heads=hkv, head_dim=d, num_blocks=num_blocks, block_size=block_size,
                    dtype=dtype, kv_dtype=kv_dtype, group=group, num_host_blocks=num_host_blocks)
        self.cpu = ref.QuantizedPagedKVCache(**args)
        self.gpu = gq.QuantizedPagedKVCache(**args, runtime=rt, **gpu_kw)
        self.cpu.k_pool[:] = np.nan
        self.cpu.v_pool[:] = np.nan
        self.gpu.k_pool[...] = np.nan
        self.gpu.v_pool[...] = np.nan
        self.rng = np.random.default_rng(block_size * 7 + hq)

    def step(self, seq_ids, num_new):
        n = int(sum(num_new))
        for c in (self.cpu, self.gpu):
            for s in seq_ids:
                if s not in c.seq_ids():
                    c.add_sequence(s)
        kv = [(self.rng.standard_normal((n, self.hkv, self.d)).astype(np.float32) * 3,
               self.rng.standard_normal((n, self.hkv, self.d)).astype(np.float32),
               self.rng.standard_normal((n, self.hq, self.d)).astype(np.float32)) for _ in range(2)]
        with self.cpu.step(seq_ids, num_new), self.gpu.step(seq_ids, num_new):
            for layer, (k, v, q) in enumerate(kv):
                self.cpu.write(layer, k, v)
                self.gpu.write(layer, k, v)
                want = self.cpu.attend(layer, q)
                got = self.rt.asnumpy(self.gpu.attend(layer, q))
                assert np.all(np.isfinite(got)) and rel_err(got, want) <= RTOL, (layer, rel_err(got, want))
        assert np.array_equal(self.cpu.quantized, self.gpu.quantized)
        for name in ("k_codes", "v_codes"):
            got, want = self.rt.asnumpy(getattr(self.gpu, name)), getattr(self.cpu, name)
            assert np.array_equal(got[:, self.cpu.quantized], want[:, self.cpu.quantized]), name


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("kv_dtype,group", [("int8", 32), ("fp8", 32), ("fp8", 16), ("int4", 32), ("kivi2", 8)],
                         ids=["int8", "fp8", "fp8_g16", "int4", "kivi2_g8"])
@pytest.mark.parametrize("heads", [(8, 2, 64), (4, 4, 32), (16, 2, 128)], ids=["g4_d64", "g1_d32", "g8_d128"])
def test_cache_attention_equals_numpy(rt, kv_dtype, group, heads, dtype):
    hq, hkv, d = heads
    bs = 8 if kv_dtype == "kivi2" else 4  # kivi2: the block is KIVI's residual, a multiple of the group
    tw = CacheTwin(rt, kv_dtype, group, block_size=bs, hq=hq, hkv=hkv, d=d, dtype=dtype)
    tw.step(["a", "b"], [2 * bs + 1, bs - 1])  # prefill: rows see their own blocks full or residual
    for _ in range(2):
        tw.step(["a", "b"], [1, 1])            # decode: "b" fills its first block
    tw.step(["b", "c"], [1, bs + 2])           # a decode row and a prefill in one step


def test_split_cache_attention_equals_numpy(rt):
    """One sequence below a wave: split in partitions of 32 keys, merged by attention_reduce_v2."""
    tw = CacheTwin(rt, "int8", block_size=16, hq=4, hkv=1, d=64, num_blocks=16, partition_size=32)
    tw.step(["a"], [150])
    tw.step(["a"], [1])
    assert gq._plan is not None


def test_fork_and_copy_on_write_copy_codes(rt):
    tw = CacheTwin(rt, "fp8", block_size=4)
    tw.step(["a"], [6])
    for c in (tw.cpu, tw.gpu):
        c.fork("a", "c")
    tw.step(["a", "c"], [1, 1])
    tw.step(["a", "c"], [1, 3])
    assert tw.cpu.blocks.cow_copies == tw.gpu.blocks.cow_copies == 1


@pytest.mark.parametrize("kv_dtype,group", [("int8", 32), ("kivi2", 8)])
def test_swap_out_and_in_keep_codes_and_flags(rt, kv_dtype, group):
    tw = CacheTwin(rt, kv_dtype, group, block_size=8, num_host_blocks=8)
    tw.step(["a", "b"], [19, 3])
    for c in (tw.cpu, tw.gpu):
        c.swap_out("a")
    assert np.array_equal(tw.cpu.host_k_codes, tw.gpu.host_k_codes)
    assert np.array_equal(tw.cpu.host_quantized, tw.gpu.host_quantized) and tw.gpu.host_quantized.sum() == 2
    tw.step(["b"], [9])  # "b" reuses device blocks "a" left
    for c in (tw.cpu, tw.gpu):
        c.swap_in("a")
    tw.step(["a", "b"], [1, 1])
    for layer in range(2):
        for x, y in zip(tw.cpu.read_kv("a", layer), tw.gpu.read_kv("a", layer)):
            assert np.array_equal(x, y)


def test_refusals(rt):
    args = dict(num_layers=1, num_kv_heads=1, head_dim=64, num_blocks=4, block_size=32, runtime=rt)
    with pytest.raises(ConfigError, match="no GPU kernels yet"):
        gq.QuantizedPagedKVCache(**args, kv_dtype="kivi4")
    with pytest.raises(ConfigError, match="versions 3 .* 4"):
        gq.QuantizedPagedKVCache(**args, kv_dtype="int8", version=1)
    with pytest.raises(ConfigError, match="multiple of 8"):
        gq.QuantizedPagedKVCache(**args, kv_dtype="fp8", group=4)


TINY = dict(num_layers=2, num_heads=6, num_kv_heads=2, head_dim=32, hidden_size=48, intermediate_size=70)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8", "int4", "kivi2"])
def test_tiny_model_on_the_gpu_quantized_cache_equals_numpy(rt, kv_dtype):
    cpu = random_model(seed=11, **TINY)
    gpu = gpu_model.from_cpu(cpu, runtime=rt)
    args = dict(**cpu.new_cache_args(), num_blocks=16, block_size=4 if kv_dtype != "kivi2" else 8, group=8,
                kv_dtype=kv_dtype)
    c_cpu, c_gpu = ref.QuantizedPagedKVCache(**args), gq.QuantizedPagedKVCache(**args, runtime=rt)
    rng = np.random.default_rng(5)
    for c in (c_cpu, c_gpu):
        c.add_sequence(0)
        c.add_sequence(1)
    feeds = [[rng.integers(0, 101, 7).tolist(), rng.integers(0, 101, 2).tolist()]] + \
        [[[int(t)], [int(t) + 1]] for t in rng.integers(0, 100, 5)]
    for tokens in feeds:
        want = cpu.forward(tokens, c_cpu, [0, 1], all_logits=True)
        got = rt.asnumpy(gpu.forward(tokens, c_gpu, [0, 1], all_logits=True))
        assert rel_err(got, want) <= LOGIT_RTOL
        assert np.array_equal(got.argmax(-1), want.argmax(-1))
    assert c_gpu.quantized.sum() == c_cpu.quantized.sum() >= (1 if kv_dtype == "kivi2" else 3)
    for layer in range(2):
        assert np.array_equal(rt.asnumpy(c_gpu.k_codes[layer]), c_cpu.k_codes[layer])


def test_gpu_check_quant_sim_smoke(sim_rt, tmp_path):
    """benchmarks/gpu_check_quant.py at toy sizes: every kv_dtype timed against fp16, bytes per token right."""
    import importlib.util
    import json
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[2] / "benchmarks"
    sys.path.insert(0, str(bench))
    spec = importlib.util.spec_from_file_location("gpu_check_quant", bench / "gpu_check_quant.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main([str(tmp_path / "q.json"), "--sim-smoke"]) == 0
    res = json.loads((tmp_path / "q.json").read_text())
    hkv, d = res["case"]["num_kv_heads"], res["case"]["head_dim"]
    for v in (3, 4):
        assert res[f"fp16_v{v}"]["bytes_per_token"] == 4 * hkv * d and res[f"fp16_v{v}"]["median_ms"] > 0
        for kv in ("int8", "fp8"):
            e = res[f"{kv}_v{v}"]
            assert e["bytes_per_token"] == 2 * hkv * d // 32 * 34 and e["finite"]
            assert e["speedup_vs_fp16"] > 0 and 0 < e["rel_err_vs_fp16"] < 0.1


@pytest.mark.parametrize("version", [3, 4])
@pytest.mark.parametrize("kv_dtype,group", [("int8", 32), ("kivi2", 8)])
def test_quantized_paged_attention_mirrors_numpy(rt, kv_dtype, group, version):
    """minikv_gpu.quant.quantized_paged_attention: minikv's name and arguments (host QuantizedStores, block
    tables, context and query lengths), the GPU kernel's answer. Prefill rows see their own blocks full or residual."""
    tw = CacheTwin(rt, kv_dtype, group, block_size=8, hq=4, hkv=2, d=64)
    tw.step(["a", "b"], [21, 9])
    c = tw.cpu
    rng = np.random.default_rng(0)
    with c.step(["a", "b"], [3, 1]):
        k, v = (rng.standard_normal((4, 2, 64)).astype(np.float32) for _ in range(2))
        c.write(0, k, v)
        c.write(1, k, v)  # every layer writes before a step commits
        q = rng.standard_normal((4, 4, 64)).astype(np.float32)
        want = c.attend(0, q)
        step = c._require_step()
        kp, vp = c.stores(0)
        args = (c._step_tables, step.past + step.num_new, step.num_new)
        got = rt.asnumpy(gq.quantized_paged_attention(q, kp, vp, *args, version=version, runtime=rt))
        assert rel_err(got, want) <= RTOL
        assert rel_err(got, ref.quantized_paged_attention(q, kp, vp, *args)) <= RTOL
