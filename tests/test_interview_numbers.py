"""The numbers that docs/interview.md (Q34-Q44) and docs/cheatsheet.md state equal what minikv computes.

Each test computes a number with ``minikv.costs`` (or reads the benchmark JSON a page cites),
formats it the way the page writes it, and checks that the page's question says exactly that, so
a change to a formula, a preset or a result fails here until the prose follows.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from test_errata_interview import flat
from test_errata_interview import question as interview_question

from minikv import online_softmax as osm
from minikv.attention import causal_attention
from minikv.costs import (
    decode_flops,
    expanded_kv_values_per_token,
    get_preset,
    kv_bytes_per_token,
    kv_cache_bytes,
    kv_dtype_bytes_per_token,
    kv_values_per_token,
    param_count,
    weights_bytes,
)
from minikv.paged import BlockAllocator, PagedKVCache, num_blocks_for
from minikv.scheduler import Request, Scheduler
from minikv.weights.random_models import random_model

ROOT = Path(__file__).resolve().parents[1]
CHEATSHEET = (ROOT / "docs" / "cheatsheet.md").read_text(encoding="utf-8")
RESULTS = ROOT / "benchmarks" / "results"

HBM = 3.35e12         # bytes/s: H100 SXM, the pages' stated assumption
BF16_PEAK = 989e12    # FLOP/s: H100 SXM dense bf16, the pages' stated assumption
K128 = 131072


def question(n: int) -> str:
    """The text of ``## Qn.`` up to the next question, with line breaks folded to spaces."""
    return flat(interview_question(n))


def says(text: str, *numbers: str) -> None:
    for s in numbers:
        assert s in text, f"the page should state {s!r}"


def gib(n: float) -> str:
    return f"{n / 2**30:g} GiB"


def attention_intensity(shape, context: int, batch: int = 1) -> float:
    """Decode attention's FLOPs (scores and weighted V; MLA: absorbed) per byte of bf16 cache read."""
    f = decode_flops(shape, context)
    return batch * (f["scores"] + f["weighted_v"]) / kv_cache_bytes(shape, batch, context, 0, "bf16")


def _json(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


# --- the presets these pages need ---------------------------------------------------------------

@pytest.mark.parametrize("name, shape", [
    ("llama3-70b", (80, 8192, 64, 8, 128, 28672, 128256, 131072)),
    ("llama3-405b", (126, 16384, 128, 8, 128, 53248, 128256, 131072)),
])
def test_llama3_presets_have_the_published_shapes(name, shape):
    s = get_preset(name)
    assert (s.num_layers, s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim, s.intermediate_size,
            s.vocab_size, s.max_context) == shape
    assert s.hidden_size == s.num_heads * s.head_dim and not s.tie_embeddings
    assert "config.json" in s.source
    total = param_count(s)["total"]
    assert abs(total / s.published_params - 1) < 0.01          # 70.55B and 405.85B


# --- interview.md ------------------------------------------------------------------------------

def test_q34_llama3_70b_at_128k():
    l70 = get_preset("llama3-70b")
    per_tok = kv_bytes_per_token(l70, "bf16")
    seq = kv_cache_bytes(l70, 1, K128, 0, "bf16")
    assert per_tok == 327_680 == 320 * 1024 and seq == 40 * 2**30
    mha = dataclasses.replace(l70, num_kv_heads=l70.num_heads)
    says(question(34), f"{per_tok // 1024} KiB per token", f"{gib(seq)} ({seq / 1e9:.2f} GB)", f"{per_tok:,} bytes",
         f"{weights_bytes(l70, 'bf16') / 1e9:.0f} GB of bf16 weights",
         f"{kv_bytes_per_token(mha, 'bf16') / 2**20:g} MiB per token")


def test_q35_llama3_8b_sequences_on_80_gb():
    l8 = get_preset("llama3-8b")
    w = weights_bytes(l8, "bf16")
    seq = kv_cache_bytes(l8, 1, 8192, 0, "bf16")
    plain, reserve, gib80 = (int((mem - w) // seq) for mem in (80e9, 0.9 * 80e9, 80 * 2**30))
    assert (plain, reserve, gib80) == (59, 52, 65)
    assert num_blocks_for(8192, 16) * 16 == 8192
    says(question(35), f"**{plain}**", f"gives **{reserve}**", f"gives **{gib80}**", f"{w / 1e9:.2f} GB",
         f"{param_count(l8)['total'] / 1e9:.2f} B parameters", f"{seq / 1e9:.2f} GB per 8,192-token sequence")


def test_q36_decode_floor():
    l8 = get_preset("llama3-8b")
    text = question(36)
    for batch in (1, 32):
        step = weights_bytes(l8, "bf16") + kv_cache_bytes(l8, batch, 8192, 0, "bf16")
        says(text, f"{step / 1e9:.2f} GB", f"{step / HBM * 1e3:.2f} ms")
    one = weights_bytes(l8, "bf16") + kv_cache_bytes(l8, 1, 8192, 0, "bf16")
    thirty_two = weights_bytes(l8, "bf16") + kv_cache_bytes(l8, 32, 8192, 0, "bf16")
    says(text, f"at most {HBM / one:.0f} tokens/s", f"about {32 * HBM / thirty_two:,.0f} tokens/s", "3.35 TB/s")


def test_q37_decode_attention_intensity():
    text = question(37)
    for name in ("llama3-8b", "llama3-70b", "llama3-405b"):
        s = get_preset(name)
        ratio = s.num_heads // s.num_kv_heads
        assert attention_intensity(s, 8192) == attention_intensity(s, 8192, batch=64) == ratio
        says(text, f"**{ratio}** for {name.replace('llama3-', 'Llama-3-').upper().replace('LLAMA-3-', 'Llama-3-')}")
    v3 = get_preset("deepseek-v3")
    f = decode_flops(v3, 8192)
    per_key = (f["scores"] + f["weighted_v"]) // 8192 // v3.num_layers
    says(text, f"= {per_key:,} FLOPs", f"**{attention_intensity(v3, 8192):.0f} FLOPs per byte**",
         f"it is **{2 * attention_intensity(v3, 8192):.0f}**", f"about **{BF16_PEAK / HBM:.0f}**",
         f"{kv_bytes_per_token(v3, 'bf16') // v3.num_layers:,} bytes")
    assert attention_intensity(v3, 8192) < BF16_PEAK / HBM < 2 * attention_intensity(v3, 8192)


def test_q38_flash_tiles_and_split_k_merge():
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((2, 3, 8)), rng.standard_normal((1, 300, 8)), rng.standard_normal((1, 300, 8))
    ref = causal_attention(q, k, v)
    for tile in (7, 64, 300):
        np.testing.assert_allclose(osm.attend_contiguous(q, k, v, key_tile=tile), ref, rtol=1e-12)
    last = q[:, -1:] / np.sqrt(8)                                  # the newest query, one split-K merge
    parts = [osm.update(osm.start((2, 1), 8, q.dtype), last @ k[0, a:b].T, v[0, a:b])
             for a, b in ((0, 123), (123, 300))]
    np.testing.assert_allclose(osm.finish(osm.merge(*parts)), ref[:, -1:], rtol=1e-12)
    says(question(38), f"{8192 * 8192 * 4 // 2**20} MiB per head", f"`QUERY_TILE` = {osm.QUERY_TILE}",
         f"{get_preset('llama3-8b').num_heads} heads")


def _chunked_run(budget):
    model = random_model(dtype=np.float64, seed=3)
    sched = Scheduler(model, PagedKVCache(**model.new_cache_args(), num_blocks=64, block_size=16, dtype=np.float64),
                      max_step_tokens=budget)
    sched.add_request(Request("chat", [1, 2, 3], max_new_tokens=12))
    sched.step()
    sched.add_request(Request("doc", list(range(4, 68)), max_new_tokens=2))
    sizes, first = [], None
    while sched.has_work():
        before = sched.stats.forward_tokens
        sched.step()
        sizes.append(sched.stats.forward_tokens - before)
        if first is None and sched.output("doc"):
            first = len(sizes)
    return max(sizes), first, {r: sched.output(r) for r in ("chat", "doc")}


def test_q39_chunked_prefill_trade():
    big, ttft_big, out_big = _chunked_run(None)
    small, ttft_small, out_small = _chunked_run(16)
    assert out_big == out_small and ttft_big == 1
    assert ttft_small == -(-64 // (16 - 1))                        # ceil(P / (budget - decodes))
    says(question(39), f"**{big} tokens**", f"more than **{small}**", f"after **{ttft_small} steps**",
         "a 64-token prompt", "`max_step_tokens`")


def test_q40_block_size_trade():
    alloc = BlockAllocator(num_blocks=8, block_size=16)
    a, prev = list(range(100, 148)), None
    for i in range(3):
        bid = alloc.allocate()
        alloc.register(bid, prev, a[16 * i:16 * i + 16])
        prev = bid
    reused = len(alloc.match(a[:40] + [7] * 8)) * 16
    assert reused == 32
    per_tok = kv_bytes_per_token(get_preset("llama3-8b"), "bf16")
    seq = 8192 * per_tok
    w16, w256 = 7.5 * per_tok, 127.5 * per_tok
    says(question(40), f"reuses {reused} and recomputes {40 - reused}", f"**{w16 / 2**20:.2f} MiB**",
         f"{w16 / seq:.2%} of an 8k sequence", f"**{num_blocks_for(8192, 16)}**",
         f"{num_blocks_for(8192, 1):,} entries", f"({w256 / 2**20:.1f} MiB, {w256 / seq:.1%})",
         f"`16 x 128 x 2` = {16 * 128 * 2 // 1024} KiB")


def test_q41_eviction_table_matches_the_json():
    d = _json("eviction_quality.json")
    text = question(41)
    says(text, f"perplexity **{d['full']['ppl']:.2f}**", "`benchmarks/results/eviction_quality.json`")
    rows = {"sliding window": "window", "window + 4 sinks (StreamingLLM)": "sinks",
            "H2O (64 heavy hitters + 64 recent)": "h2o", "H2O, scores normalized by queries seen": "h2o normalized",
            "SnapKV (512-token prompt compressed once)": "snapkv"}
    for label, run in rows.items():
        r = d["runs"][f"{run} B=128"]
        assert r["budget"] == 128
        says(text, f"| {label} | {r['ppl']:.2f} | {100 * r['top1_vs_exact']:.1f}% |")
    assert d["runs"]["h2o B=128"]["policy"]["recent"] == 64 and d["runs"]["snapkv B=128"]["prompt"] == 512
    assert d["runs"]["snapkv B=128"]["policy"]["obs_window"] == 32 and d["sinks"] == 4


def test_q42_fp8_numbers_match_the_json():
    smol = get_preset("smollm2-135m")
    res = _json("kv_quant_quality.json")["minikv"]
    fp8, e5m2, int8 = res["fp8"], res["fp8_e5m2"], res["int8"]
    assert fp8["cache_bytes_per_token"] == e5m2["cache_bytes_per_token"] == kv_dtype_bytes_per_token(smol, "fp8")
    assert fp8["group"] == 32
    says(question(42), f"**{kv_dtype_bytes_per_token(smol, 'fp8'):,} bytes per token instead of "
         f"{kv_bytes_per_token(smol, 'fp16'):,}**",
         f"({kv_dtype_bytes_per_token(smol, 'fp8') / kv_bytes_per_token(smol, 'fp16'):.2f}x)",
         f"Llama-3-70B {kv_dtype_bytes_per_token(get_preset('llama3-70b'), 'fp8') // 1024} KiB instead of "
         f"{kv_bytes_per_token(get_preset('llama3-70b'), 'bf16') // 1024} KiB",
         # the perplexity change is absolute beside the absolute pair, relative beside a percentage (issue 21)
         f"**{fp8['ppl'] - fp8['ppl_exact']:+.3f}** ({fp8['ppl']:.3f} against {fp8['ppl_exact']:.3f}, "
         f"{fp8['delta_ppl']:+.2%})",
         f"**{fp8['kld_vs_exact']:.4f}**", f"{100 * fp8['top1_vs_exact']:.1f}% of the time",
         f"{e5m2['ppl'] - e5m2['ppl_exact']:+.3f} perplexity ({e5m2['ppl']:.3f} against {e5m2['ppl_exact']:.3f}, "
         f"{e5m2['delta_ppl']:+.2%}), KL {e5m2['kld_vs_exact']:.4f}, top-1 {100 * e5m2['top1_vs_exact']:.1f}%",
         f"KL of {int8['kld_vs_exact']:.4f}", "1.0625 bytes per value")
    for relative in (fp8["delta_ppl"], e5m2["delta_ppl"]):  # never a relative change printed as an absolute one
        assert f"{relative:+.3f} perplexity" not in question(42) and f"**{relative:.3f}**" not in question(42)


def test_q43_tensor_parallel_kv_per_rank():
    l70 = get_preset("llama3-70b")
    per_rank = {tp: dataclasses.replace(l70, num_kv_heads=max(1, l70.num_kv_heads // tp)) for tp in (8, 16)}
    b8, b16 = (kv_bytes_per_token(per_rank[tp], "bf16") for tp in (8, 16))
    assert b8 == b16 == kv_bytes_per_token(l70, "bf16") // 8
    says(question(43), f"**{b8 // 1024} KiB per token, {gib(kv_cache_bytes(per_rank[8], 1, K128, 0, 'bf16'))} per "
         "128k-token sequence**", f"still {b16 // 1024} KiB per token per rank", f"`2 x {l70.hidden_size}`",
         f"replicated** on {16 // l70.num_kv_heads} ranks", "**two all-reduces**")


def test_q44_tiling_changes_only_rounding():
    rng = np.random.default_rng(0)
    q, (k, v) = rng.standard_normal((1, 4, 1, 64)), rng.standard_normal((2, 1, 2, 4096, 64))
    diff = {}
    for dtype in (np.float64, np.float32):
        a = osm.attend_contiguous(q.astype(dtype), k.astype(dtype), v.astype(dtype), key_tile=64)
        b = osm.attend_contiguous(q.astype(dtype), k.astype(dtype), v.astype(dtype), key_tile=1024)
        diff[dtype] = np.abs(a - b).max()
    assert diff[np.float64] < 1e-15 and 1e-9 < diff[np.float32] < 1e-6   # float64 "to 1e-16", float32 "about 1e-7"
    says(question(44), "float64 agrees to 1e-16, float32 only to about 1e-7")
    bf16 = ml_dtypes.finfo(ml_dtypes.bfloat16)
    assert float(bf16.eps) == 2.0**-7 and bf16.nmant + 1 == 8          # spacing next to 1.0; 8 significant bits
    one = np.float32(1 + 2.0**-8 * 0.999)                              # just under half a step above 1.0
    assert float(one.astype(ml_dtypes.bfloat16)) == 1.0                # rounds back: the error reaches 2^-8
    says(question(44), f"spacing is 2^-7 ({float(bf16.eps):.2%})", f"2^-8 ({float(bf16.eps) / 2:.2%}) relative")


# --- cheatsheet.md -----------------------------------------------------------------------------

CHEAT_PRESETS = ("smollm2-135m", "llama2-7b", "llama3-8b", "llama3-70b", "llama3-405b", "gpt3-175b", "deepseek-v3")


def _kib(b: int) -> str:
    k = b / 1024
    return f"{k:,.0f} KiB" if k == int(k) else f"{k:.1f} KiB"


def test_cheatsheet_numbers_match_minikv():
    text = " ".join(CHEATSHEET.split())
    for name in CHEAT_PRESETS:
        s = get_preset(name)
        b = kv_bytes_per_token(s, "bf16")
        says(text, f"| `{name}` |", f"| {b:,} ({_kib(b)}) | {b * 8192 / 2**30:.2f} GiB | {b * K128 / 2**30:.2f} GiB |")
    v3 = get_preset("deepseek-v3")
    expanded = expanded_kv_values_per_token(v3)
    says(text, f"**{expanded * 2:,} bytes per token, {expanded / kv_values_per_token(v3):.1f}x**",
         f"latent's {kv_bytes_per_token(v3, 'bf16'):,}")
    l8 = get_preset("llama3-8b")
    says(text, f"weights {weights_bytes(l8, 'bf16') / 1e9:.2f} GB",
         f"ridge is **{BF16_PEAK / HBM:.0f} FLOPs per byte**")
    for batch in (1, 32):
        step = weights_bytes(l8, "bf16") + kv_cache_bytes(l8, batch, 8192, 0, "bf16")
        says(text, f"batch {batch} reads {step / 1e9:.2f} GB", f"**{step / HBM * 1e3:.2f} ms**",
             f"{batch * HBM / step:,.0f} tokens/s")
    for name in ("llama3-8b", "llama3-70b", "llama3-405b"):
        s = get_preset(name)
        says(text, f"{attention_intensity(s, 8192):.0f} (Llama-3-{name.split('-')[1].upper()})")
    says(text, f"**{attention_intensity(v3, 8192):.0f} FLOPs per byte**",
         f"**{2 * attention_intensity(v3, 8192):.0f}** with two query tokens")
    seq = kv_cache_bytes(l8, 1, 8192, 0, "bf16")
    w = weights_bytes(l8, "bf16")
    says(text, f"no reserve: **{int((80e9 - w) // seq)}**", f"({int((0.9 * 80e9 - w) // seq)} with a 10% reserve, "
         f"{int((80 * 2**30 - w) // seq)} if the GPU has 80 GiB)")
    l70 = get_preset("llama3-70b")
    says(text, f"**{kv_bytes_per_token(l70, 'bf16') // 8 // 1024} KiB per token per rank at tp = 8**")
    smol = get_preset("smollm2-135m")
    says(text, f"**{kv_dtype_bytes_per_token(smol, 'fp8') / kv_bytes_per_token(smol, 'bf16'):.2f}x** bf16",
         f"**{num_blocks_for(8192, 16)}** block-table entries")
