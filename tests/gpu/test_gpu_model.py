"""The model's kernels (kernels/model.cu) and the whole GPU model against ``minikv.model``.

Building blocks at odd sizes (0, 1, 7 tokens; widths 33 and 577) to 1e-5; the
GPU model against the NumPy model on tiny random models (both RoPE layouts,
MHA/GQA/MQA, float32 and float16 caches) through prefill and cached decode,
logits to 1e-4 relative (DESIGN.md section 3) with identical greedy tokens;
the fused decode kernel against the unfused path.
"""

import numpy as np
import pytest

from minikv import kv_cache as ref_cache
from minikv import model as ref
from minikv.bench.equivalence import EXACT_RTOL, KERNEL_RTOL, rel_err
from minikv.errors import ConfigError, DTypeError, InvalidInputError, ShapeError
from minikv.weights.random_models import random_model
from minikv_gpu import kv_cache as gpu_cache
from minikv_gpu import model as gpu

RTOL = KERNEL_RTOL
LOGIT_RTOL = EXACT_RTOL[np.float32]



@pytest.mark.parametrize("n,h", [(0, 33), (1, 577), (7, 33), (3, 1024)])
def test_rms_norm(rt, n, h):
    rng = np.random.default_rng(n + h)
    x = (rng.standard_normal((n, h)) * 3).astype(np.float32)
    w = rng.standard_normal(h).astype(np.float32)
    got = rt.asnumpy(gpu.rms_norm(rt.asarray(x), rt.asarray(w), 1e-5, runtime=rt))
    assert got.dtype == np.float32
    assert rel_err(got, ref.rms_norm(x, w, 1e-5)) <= RTOL


@pytest.mark.parametrize("n,i", [(0, 5), (1, 33), (7, 1536)])
def test_silu_and_swiglu(rt, n, i):
    rng = np.random.default_rng(n + i)
    gate_up = (rng.standard_normal((n, 2 * i)) * 8).astype(np.float32)  # large |x|: tanh form never overflows
    want = ref.silu(gate_up[:, :i]) * gate_up[:, i:]
    assert rel_err(rt.asnumpy(gpu.swiglu(rt.asarray(gate_up), runtime=rt)), want) <= RTOL
    assert rel_err(rt.asnumpy(gpu.silu(rt.asarray(gate_up), runtime=rt)), ref.silu(gate_up)) <= RTOL


@pytest.mark.parametrize("n,i", [(0, 5), (3, 33)])
def test_geglu_is_gemmas_gate(rt, n, i):
    from minikv.layers import gelu_tanh

    gate_up = (np.random.default_rng(i).standard_normal((n, 2 * i)) * 4).astype(np.float32)
    got = rt.asnumpy(gpu.geglu(rt.asarray(gate_up), runtime=rt))
    assert got.shape == (n, i) and rel_err(got, gelu_tanh(gate_up[:, :i]) * gate_up[:, i:]) <= RTOL
    if n:  # not SwiGLU's gate
        assert rel_err(got, ref.silu(gate_up[:, :i]) * gate_up[:, i:]) > 1e-2


@pytest.mark.parametrize("layout", ["interleaved", "half"])
@pytest.mark.parametrize("n,heads,d", [(0, 2, 8), (1, 3, 64), (7, 5, 128)])
def test_apply_rope_both_layouts(rt, layout, n, heads, d):
    rng = np.random.default_rng(n * heads + d)
    x = rng.standard_normal((n, heads, d)).astype(np.float32)
    cos, sin = ref.rope_tables(d, 64, 10000.0)
    pos = rng.integers(0, 64, n)
    want = ref.apply_rope(x, cos[pos], sin[pos], layout)
    got = rt.asnumpy(gpu.apply_rope(rt.asarray(x), rt.asarray(cos[pos]), rt.asarray(sin[pos]), layout, runtime=rt))
    assert rel_err(got, want) <= RTOL


def test_block_errors(rt):
    x = rt.asarray(np.ones((2, 8), np.float32))
    with pytest.raises(ShapeError, match="weight"):
        gpu.rms_norm(x, rt.asarray(np.ones(7, np.float32)), 1e-5, runtime=rt)
    with pytest.raises(DTypeError, match="float32"):
        gpu.rms_norm(rt.asarray(np.ones((2, 8))), rt.asarray(np.ones(8, np.float32)), 1e-5, runtime=rt)
    with pytest.raises(ShapeError, match="2I"):
        gpu.swiglu(rt.asarray(np.ones((2, 7), np.float32)), runtime=rt)
    with pytest.raises(ConfigError, match="layout"):
        gpu.apply_rope(rt.asarray(np.ones((2, 1, 8), np.float32)), x[:, :4], x[:, :4], "sideways", runtime=rt)
    with pytest.raises(ShapeError, match="cos"):
        gpu.apply_rope(rt.asarray(np.ones((2, 1, 8), np.float32)), x, x, "half", runtime=rt)


# tiny models: (Hq, Hkv, D) covering MHA, GQA 3 and 8 (MQA-like); head_dim a multiple of 8
TINY = {
    "mha": dict(num_heads=2, num_kv_heads=2, head_dim=8, hidden_size=24, intermediate_size=40),
    "gqa3": dict(num_heads=6, num_kv_heads=2, head_dim=16, hidden_size=42, intermediate_size=70),
    "gqa8": dict(num_heads=8, num_kv_heads=1, head_dim=8, hidden_size=35, intermediate_size=33),
}


def run_pair(rt, shape, layout, cache_dtype=np.float32, fused=False, prompt_lens=(5, 1), decode=3, seed=0):
    """Prefill + decode the same token streams through the NumPy and the GPU model; return both logits."""
    cpu = random_model(rope_layout=layout, seed=seed, **TINY[shape])
    dev = gpu.from_cpu(cpu, runtime=rt, cache_dtype=cache_dtype, fused=fused)
    rng = np.random.default_rng(seed)
    lens = list(prompt_lens)
    streams = [rng.integers(0, cpu.config.vocab_size, n + decode) for n in lens]
    c_cpu = ref_cache.ContiguousKVCache(**cpu.new_cache_args(), max_seqs=len(lens), max_len=max(lens) + decode,
                                        dtype=cache_dtype)
    c_gpu = dev.new_cache(max_seqs=len(lens), max_len=max(lens) + decode)
    ids = list(range(len(lens)))
    for i in ids:
        c_cpu.add_sequence(i)
        c_gpu.add_sequence(i)
    want = [cpu.forward([s[:n] for s, n in zip(streams, lens)], c_cpu, ids, all_logits=True)]
    got = [rt.asnumpy(dev.forward([s[:n] for s, n in zip(streams, lens)], c_gpu, ids, all_logits=True))]
    for t in range(decode):
        step = [s[n + t: n + t + 1] for s, n in zip(streams, lens)]
        want.append(cpu.forward(step, c_cpu, ids))
        got.append(rt.asnumpy(dev.forward(step, c_gpu, ids)))
    return got, want


@pytest.mark.parametrize("layout", ["interleaved", "half"])
@pytest.mark.parametrize("shape", list(TINY))
def test_gpu_model_equals_numpy_model(rt, shape, layout):
    got, want = run_pair(rt, shape, layout)
    for g, w in zip(got, want):
        assert g.dtype == np.float32 and g.shape == w.shape
        assert rel_err(g, w) <= LOGIT_RTOL
        assert np.array_equal(g.argmax(-1), w.argmax(-1))


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_fused_decode_equals_unfused(rt, layout):
    plain, _ = run_pair(rt, "gqa3", layout, prompt_lens=(4, 9))
    fused, want = run_pair(rt, "gqa3", layout, fused=True, prompt_lens=(4, 9))
    for a, b, w in zip(plain, fused, want):
        assert rel_err(b, a) <= RTOL
        assert rel_err(b, w) <= LOGIT_RTOL


def test_fp16_cache_model_equals_numpy_fp16_cache(rt):
    """Both paths store float16 K/V. Their float32 keys may differ in the last bit (other matmul order),
    and a key on a float16 rounding boundary then rounds one float16 ulp apart; so the paths must agree
    to 1e-4, or at worst much closer than float16 storage itself moves the logits (fp16 vs fp32 NumPy)."""
    got, want = run_pair(rt, "gqa8", "interleaved", cache_dtype=np.float16, fused=True)
    _, exact = run_pair(rt, "gqa8", "interleaved", cache_dtype=np.float32)
    for g, w, e in zip(got, want, exact):
        storage_effect = rel_err(w, e)
        assert storage_effect > 0  # the float16 cache really rounds
        assert rel_err(g, w) <= max(LOGIT_RTOL, 0.1 * storage_effect)
        assert np.array_equal(g.argmax(-1), w.argmax(-1))


def test_uncached_logits_equal_numpy(rt):
    cpu = random_model(rope_layout="half", seed=4, **TINY["gqa3"])
    dev = gpu.from_cpu(cpu, runtime=rt)
    ids = np.random.default_rng(4).integers(0, cpu.config.vocab_size, 11)
    got = rt.asnumpy(dev.logits(ids))
    assert rel_err(got, cpu.logits(ids)) <= LOGIT_RTOL


def test_model_errors(rt):
    cpu = random_model(**TINY["mha"])
    dev = gpu.from_cpu(cpu, runtime=rt)
    cache = dev.new_cache(1, 8)
    cache.add_sequence(0)
    with pytest.raises(ConfigError, match="minikv_gpu"):
        dev.forward([[1, 2]], ref_cache.ContiguousKVCache(**cpu.new_cache_args(), max_seqs=1, max_len=8))
    with pytest.raises(InvalidInputError, match="outside"):
        dev.forward([[1, 10_000]], cache)
    assert cache.length(0) == 0  # the failed step changed nothing
    with pytest.raises(ConfigError, match="head_dim=6"):
        gpu.from_cpu(random_model(head_dim=6, num_heads=2, num_kv_heads=1), runtime=rt)
    with pytest.raises(DTypeError, match="float64"):
        gpu.Model(cpu.config, cpu.weights, dtype=np.float64, runtime=rt)
    with pytest.raises(DTypeError, match="cache_dtype"):
        gpu.Model(cpu.config, cpu.weights, cache_dtype=np.int8, runtime=rt)
    with pytest.raises(ConfigError, match="geometry"):
        dev.forward([[1]], gpu_cache.ContiguousKVCache(3, 2, 8, 1, 4, runtime=rt))
