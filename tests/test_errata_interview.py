"""Errata of issue 13 in the interview guide, the README, formulas.md and minikv.paged.attention: every number
the fixed text quotes is recomputed here from ml_dtypes or minikv's own functions."""

from __future__ import annotations

import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import minikv.paged.attention
from minikv import online_softmax
from minikv.attention import causal_attention
from minikv.costs import (
    decode_flops,
    dtype_bytes,
    format_bytes,
    forward_flops,
    generation_flops,
    get_preset,
    kv_bytes_per_token,
    kv_cache_bytes,
    recompute_flops,
)

ROOT = Path(__file__).resolve().parents[1]
INTERVIEW = (ROOT / "docs" / "interview.md").read_text(encoding="utf-8")


def question(n: int) -> str:
    """The text of question ``n`` of the interview guide, its heading included."""
    m = re.search(rf"^### Q{n}\. .*?(?=^#{{2,3}} |\Z)", INTERVIEW, re.S | re.M)
    assert m, f"docs/interview.md has no Q{n}"
    return m.group(0)


def flat(text: str) -> str:
    return " ".join(text.split())


def test_q13_fp8_limits_come_from_ml_dtypes():
    q13 = flat(question(13))
    assert "FP8" in question(13).split("\n")[0] or "quantiz" in question(13).split("\n")[0]
    e4m3, e5m2, fnuz = (ml_dtypes.finfo(t) for t in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2,
                                                      ml_dtypes.float8_e4m3fnuz))
    assert (e4m3.nexp, e4m3.nmant, fnuz.nexp, fnuz.nmant, e5m2.nexp, e5m2.nmant) == (4, 3, 4, 3, 5, 2)
    for f in (e4m3, e5m2, fnuz):
        assert f"±{float(f.max):,.0f}" in q13                       # ±448, ±57,344, ±240
    assert (float(e4m3.max), float(e5m2.max), float(fnuz.max)) == (448, 57344, 240)
    # the biases the page quotes: 7 for e4m3fn, 8 for e4m3fnuz (smallest normal 2^(1 - bias))
    assert (1 - e4m3.minexp, 1 - fnuz.minexp) == (7, 8)
    assert "bias 8 instead of 7" in q13
    # e4m3fnuz: one NaN, at 0x80 (where -0 would be), and no negative zero
    every = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fnuz).astype(np.float32)
    assert np.flatnonzero(np.isnan(every)).tolist() == [0x80]
    assert not np.any(np.signbit(every[every == 0]))
    assert "no negative zero" in q13 and "single NaN at 0x80" in q13
    # E4M3 (fn) has no infinity, E5M2 has one
    assert not np.isinf(np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)).any()
    assert np.isinf(np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e5m2).astype(np.float32)).any()
    assert "AMD's encoding of E4M3" in q13 and "not a third format" in q13


def test_q3_attention_without_a_cache_is_cubic_in_total():
    q3 = flat(question(3))
    assert "O(G^3)" in q3 and "stays O(G^2)" not in q3 and "O(n^3)" not in q3
    smol = get_preset("smollm2-135m")
    one = recompute_flops(smol, 1)
    token, key = one["projections"] + one["mlp"], one["scores"] + one["weighted_v"]   # per token, per key

    def attention(step, n):
        return sum(step(smol, c)["scores"] + step(smol, c)["weighted_v"] for c in range(1, n + 1))

    for n in (1, 2, 7, 100):
        assert attention(recompute_flops, n) == key * n * (n + 1) * (n + 2) // 6      # cubic
        assert attention(decode_flops, n) == key * n * (n + 1) // 2                 # quadratic
    assert generation_flops(smol, 1, 50, cache=False) == sum(recompute_flops(smol, c)["total"]
                                                             for c in range(1, 51))
    # the cubic attention passes the rerun matmuls (token n (n+1) / 2) from n + 2 >= 3 token / key on
    crossover = next(n for n in range(1, 100_000) if key * (n + 2) >= 3 * token)
    assert crossover == 9214 and "about 9,200" in q3
    matmuls = sum(recompute_flops(smol, c)["projections"] + recompute_flops(smol, c)["mlp"] for c in range(1, 1001))
    assert round(100 * matmuls / generation_flops(smol, 1, 1000, cache=False)) == 90 and "90%" in q3


def test_q7_reduction_order_changes_the_last_bits():
    q7 = flat(question(7))
    for phrase in ("bf16", "batch-invariant", "property of the math, not of every kernel", "greedy decoding"):
        assert phrase in q7
    x = np.random.default_rng(0).standard_normal(4096).astype(np.float32)
    one_pass, in_tiles = x.sum(), x.reshape(64, 64).sum(axis=0).sum()
    assert one_pass != in_tiles and abs(one_pass - in_tiles) < 1e-4 * abs(one_pass)
    assert ml_dtypes.finfo(ml_dtypes.bfloat16).nmant + 1 == 8 and "8 significant bits" in q7


def test_q20_swap_is_cheaper_per_token_for_gqa():
    q20 = flat(question(20))
    gpu_flops, pcie = 989e12 / 2, 25e9      # the page's named assumptions
    assert "494.5 TFLOP/s" in q20 and "25 GB/s" in q20 and f"{gpu_flops / pcie:,.0f} FLOPs per byte" in q20
    l3, l2 = get_preset("llama3-8b"), get_preset("llama2-7b")
    assert kv_bytes_per_token(l3, "fp16") == 2 * 32 * 8 * 128 * 2 == 131_072 and "131,072 bytes" in q20
    f = forward_flops(l3, 2048)
    assert f"{(f['projections'] + f['mlp']) / 2048 / 1e9:.2f} GFLOP" in q20                # 13.96
    per_token = {s.name: forward_flops(s, 2048)["total"] / 2048 for s in (l3, l2)}
    assert f"{per_token['llama3-8b'] / 1e9:.2f} GFLOP" in q20                               # 14.50
    for s in (l3, l2):
        assert f"{per_token[s.name] / kv_bytes_per_token(s, 'fp16'):,.0f} FLOPs per" in q20   # 110,598; 25,729
    swap = kv_bytes_per_token(l3, "fp16") / pcie
    recompute = per_token["llama3-8b"] / gpu_flops
    assert f"{swap * 1e6:.1f} us" in q20 and f"{recompute * 1e6:.1f} us" in q20
    assert f"{recompute / swap:.1f}x cheaper" in q20                                     # 5.6x
    mha = (per_token["llama2-7b"] / gpu_flops) / (kv_bytes_per_token(l2, "fp16") / pcie)
    assert f"{mha:.1f}x cheaper" in q20 and mha > 1                                      # 1.3x
    assert (per_token["llama2-7b"] / (2 * gpu_flops)) < kv_bytes_per_token(l2, "fp16") / pcie  # full speed: recompute
    assert kv_bytes_per_token(l2, "fp16") == 4 * kv_bytes_per_token(l3, "fp16") and "4x the bytes" in q20


def _int32_limit_numbers(name: str, dtype: str) -> tuple[int, int, int]:
    """(slots per layer pool below 2^31 elements, bytes of one layer's K pool, bytes of the whole cache)."""
    s = get_preset(name)
    row = s.num_kv_heads * s.head_dim
    slots = 2**31 // row
    return slots, slots * row * dtype_bytes(dtype), kv_cache_bytes(s, 1, slots, 0, dtype)


def test_q17_int32_offsets_limit_one_layer_pool():
    q17, doc = flat(question(17)), flat(minikv.paged.attention.__doc__)
    slots, pool, whole = _int32_limit_numbers("llama3-8b", "fp16")
    assert slots == 2**21 == 2_097_152 and pool == 4 * 2**30
    assert format_bytes(whole).startswith("274.88 GB")
    assert "num_blocks * block_size * Hkv * D" in q17 and "274.88 GB" in q17 and "4 GiB" in q17
    # the module docstring states the rule and points at Q17 for the numbers
    assert "num_blocks * block_size * Hkv * D <= 2**31" in doc and "Q17" in doc
    assert "2,097,152 tokens" in q17 and "2**21 slots" in doc
    _, _, smol_fp8 = _int32_limit_numbers("smollm2-135m", "fp8")
    assert format_bytes(smol_fp8).startswith("128.85 GB")
    assert "128.85 GB" in q17
    # indexed across layers, the limit comes L times sooner
    l3 = get_preset("llama3-8b")
    across = 2**31 // (l3.num_layers * l3.num_kv_heads * l3.head_dim)
    assert across == 65_536 and "65,536 tokens" in q17 and "L times sooner" in doc
    assert format_bytes(kv_cache_bytes(l3, 1, across, 0, "fp16")).startswith("8.59 GB") and "8.59 GB" in q17
    assert "copy_blocks" in (ROOT / "minikv_gpu" / "kernels" / "paged.cu").read_text()


def test_q12_mla_has_one_latent_head():
    q12 = flat(question(12))
    v3 = get_preset("deepseek-v3")
    assert v3.kv_lora_rank + v3.rope_dim == 576 and v3.num_heads == 128
    assert "one 576-wide latent head, shared by all 128 query heads" in q12
    assert "no KV heads" not in INTERVIEW


@pytest.mark.parametrize("past, n", [(0, 200), (0, 64), (37, 130), (5, 1)])
def test_formulas_tiled_causal_score_count(monkeypatch, past, n):
    """formulas.md: causal_attention scores sum over query tiles of Tq (past + t1); dense up to 64 queries."""
    text = flat((ROOT / "docs" / "formulas.md").read_text(encoding="utf-8"))
    assert "as step 1's causal_attention does" not in text and "attend_contiguous" in text
    counted = []
    real = online_softmax.update
    monkeypatch.setattr(online_softmax, "update", lambda state, s, *a, **k: (counted.append(s.shape[-1] * s.shape[-2]),
                                                                           real(state, s, *a, **k))[1])
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, n, 8))
    k, v = rng.standard_normal((2, 1, past + n, 8))
    out = causal_attention(q, k, v)
    tile = online_softmax.QUERY_TILE
    if n > tile:
        expect = sum((min(t0 + tile, n) - t0) * (past + min(t0 + tile, n)) for t0 in range(0, n, tile))
        causal = n * past + n * (n + 1) // 2
        assert sum(counted) == expect == causal + sum(tq * (tq - 1) // 2
                                                      for tq in (min(tile, n - t0) for t0 in range(0, n, tile)))
        assert expect - causal <= n * (tile - 1) / 2
    else:
        assert counted == []          # the dense block, masked afterwards: n (past + n) scores
    s = q[0] @ k[0].T / np.sqrt(8)
    s = np.where(np.arange(past + n)[None, :] <= np.arange(past, past + n)[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    np.testing.assert_allclose(out[0], (p / p.sum(-1, keepdims=True)) @ v[0], rtol=1e-10, atol=1e-14)


def test_readme_and_gpu_page_claim_no_gpu_run():
    readme, gpu = ((ROOT / p).read_text(encoding="utf-8") for p in ("README.md", "docs/gpu.md"))
    for text in (readme, gpu):
        assert "proven" not in text and not re.search(r"\bprove\b", text)
        assert "no GPU has run" in flat(text)
    assert "real GPU through CuPy" not in flat(readme)
    assert "its tests skip without one" in flat(readme)
