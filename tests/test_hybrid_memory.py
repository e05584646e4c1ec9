"""Step 9's memory, measured: ``bytes_used`` of the hybrid caches against ``minikv.costs.hybrid`` and against
an all-full cache, at 2k, 8k and 32k tokens, with Gemma-3-270m's layer pattern (18 layers, 15 sliding over 512).

The caches are filled by writing random K/V for every layer, without a model (a hybrid step commits once every
layer wrote); head_dim is 8 so that 32k tokens of an all-full cache fit in a test. The formula is linear in
Hkv x D x itemsize, so the real model's bytes follow from the same counts (``minikv memory`` prints them).
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from minikv.costs.hybrid import GEMMA3_270M, HYBRID_PRESETS, hybrid_kv_bytes
from minikv.hybrid import hybrid_cache
from minikv.kv_cache import ContiguousKVCache

WINDOWS = HYBRID_PRESETS["gemma3-270m"][1]
SHAPE = replace(GEMMA3_270M, head_dim=8)
CHUNK = 4096


def fill(cache, tokens: int) -> None:
    """Write ``tokens`` random K/V rows into every layer of sequence 0, a chunk per step."""
    rng = np.random.default_rng(0)
    cache.add_sequence(0)
    done = 0
    while done < tokens:
        n = min(CHUNK, tokens - done)
        with cache.step([0], [n]):
            for layer in range(cache.num_layers):
                kv = rng.standard_normal((n, 1, 8)).astype(np.float32)
                cache.write(layer, kv, kv)
        done += n


@pytest.mark.parametrize("tokens", [2048, 8192, 32768])
def test_bytes_used_follow_the_formula_and_undercut_all_full(tokens):
    want = hybrid_kv_bytes(SHAPE, WINDOWS, tokens, "fp32", block_size=16)
    contiguous = hybrid_cache("contiguous", WINDOWS, 1, 8, tokens)
    fill(contiguous, tokens)
    # a step writes all of its tokens before the sliding groups give blocks back: room for one chunk in each
    paged = hybrid_cache("paged", WINDOWS, 1, 8, block_size=16, num_blocks=want["paged"]["blocks"] + 5 * CHUNK // 16)
    fill(paged, tokens)
    full = ContiguousKVCache(18, 1, 8, 1, tokens)
    fill(full, tokens)
    assert contiguous.bytes_used() == paged.bytes_used() == want["hybrid_bytes"]
    assert full.bytes_used() == want["all_full_bytes"]
    assert paged.memory_stats()["blocks_in_use"] == want["paged"]["blocks"]
    assert paged.memory_stats()["blocks_in_use"] * paged.block_bytes() == want["paged"]["bytes"]
    rows = {r["type"]: r for r in want["layer_types"]}
    assert rows["sliding_attention"]["tokens_per_layer"] == 511 and rows["full_attention"]["tokens_per_layer"] == tokens
    saved = 1 - contiguous.bytes_used() / full.bytes_used()
    print(f"{tokens} tokens: hybrid {contiguous.bytes_used():,} B, all-full {full.bytes_used():,} B, "
          f"saved {saved:.1%}; paged {want['paged']['blocks']} blocks")
    assert saved == pytest.approx(want["saved_fraction"]) and saved > {2048: 0.6, 8192: 0.78, 32768: 0.81}[tokens]


def test_the_real_models_saving_and_where_it_starts():
    at = {n: hybrid_kv_bytes(GEMMA3_270M, WINDOWS, n, "fp16") for n in (400, 512, 2048, 32768)}
    assert at[400]["saved_fraction"] == 0 and at[512]["saved_fraction"] > 0  # below the window nothing is saved
    assert round(at[32768]["saved_fraction"], 3) == 0.820  # the "about 82% smaller at 32k"
    assert at[32768]["all_full_bytes"] == 2 * 18 * 256 * 2 * 32768
    k = hybrid_kv_bytes(GEMMA3_270M, WINDOWS, 32768, "fp16", rollback=4)
    assert k["hybrid_bytes"] - at[32768]["hybrid_bytes"] == 15 * 4 * 2 * 256 * 2  # K more tokens per sliding layer


def test_minikv_memory_prints_per_layer_type_bytes(capsys):
    from minikv.cli import main

    assert main(["memory", "--preset", "gemma3-270m", "--prompt-len", "8000", "--output-len", "192", "--dtype",
                 "fp32", "--json"]) == 0
    out = capsys.readouterr().out
    rep = json.loads(out.strip().splitlines()[-1])["hybrid"]
    assert rep == json.loads(json.dumps(hybrid_kv_bytes(GEMMA3_270M, WINDOWS, 8192, "fp32", block_size=16)))
    assert "sliding_attention (W=512)" in out and "saved 78.1%" in out  # 1 - (3 x 8192 + 15 x 511) / (18 x 8192)


def test_the_preset_names_the_mlp_its_source_names(capsys):
    """Gemma's MLP is GeGLU (gated, tanh GELU): three matrices like SwiGLU, but the report must not call it
    SwiGLU while the source line beside it says GeGLU."""
    from minikv.cli import main

    assert main(["memory", "--preset", "gemma3-270m"]) == 0
    out = capsys.readouterr().out
    assert "(GeGLU)" in GEMMA3_270M.source and "MLP 2048 (geglu)" in out and "swiglu" not in out


@pytest.mark.gemma
def test_minikv_memory_reads_the_layer_pattern_from_the_gemma_file(gemma3, capsys):  # shares its weights
    """``memory --model gemma3`` (the planner, reading the GGUF's metadata): the layer types and per-token bytes
    that ``hybrid_kv_bytes`` counts for the preset, and its all-full waste at 2,048 tokens."""
    from minikv.cli import main

    assert main(["memory", "--model", "gemma3", "--context", "2048", "--kv", "fp16", "--block-size", "1",
                 "--json"]) == 0
    rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    want = hybrid_kv_bytes(GEMMA3_270M, WINDOWS, 2048, "fp16")
    per_token = {r["window"]: r["bytes"] // (r["layers"] * r["tokens_per_layer"]) for r in want["layer_types"]}
    assert rep["layers"] == {("full" if w is None else f"sliding {w}"): {"count": r["layers"], "bytes_per_token":
                             per_token[w]} for r in want["layer_types"] for w in [r["window"]]}
    assert rep["waste_of_all_full"] == pytest.approx(want["saved_fraction"], abs=0.002)  # W against W - 1 kept


def test_one_pool_holds_more_sequences_hybrid_than_all_full():
    """``bench batching --model``'s engine on a small workload: the same pool, the same outputs; the hybrid side
    gives the sliding groups' old blocks back, so it runs more sequences at once and preempts none."""
    from minikv.bench.hybrid import geometry_model, hybrid_batching_benchmark, longest_request_bytes
    from minikv.bench.workloads import Workload
    from minikv.weights.random_models import random_gemma_model

    config = random_gemma_model(num_layers=7, pattern=3, sliding_window=4, head_dim=8, max_position=128).config
    wl = Workload(num_requests=8, prompt_median=24, prompt_range=(8, 48), output_median=12, output_range=(4, 24),
                  shared_prefix_len=8, vocab_size=64)
    model = geometry_model(config, 64, hidden_size=16)
    res = hybrid_batching_benchmark(model, wl, 2 * longest_request_bytes(model, wl, 4), 4)
    hybrid, full = res["hybrid"], res["all_full"]
    assert res["identical_outputs"] and hybrid["generated_tokens"] == full["generated_tokens"]
    assert hybrid["max_concurrency"] > full["max_concurrency"] and res["mean_concurrency_ratio"] > 1
    assert hybrid["preemptions"] == 0 < full["preemptions"] and hybrid["peak_blocks"] < full["peak_blocks"]
