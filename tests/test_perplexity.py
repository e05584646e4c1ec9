"""minikv.perplexity: teacher-forced NLL through every lossless cache equals one uncached pass."""

import math

import numpy as np
import pytest

from minikv.errors import InvalidInputError
from minikv.generate import CACHE_KINDS, make_cache
from minikv.perplexity import NextTokenNLL, log_softmax, perplexity
from minikv.weights.random_models import random_model


def uncached_nll(model, ids) -> float:
    """The reference: mean NLL from one uncached forward over the whole text."""
    logp = log_softmax(model.logits(ids))[:-1]  # the last position predicts nothing in the text
    return float(-logp[np.arange(len(ids) - 1), np.asarray(ids[1:])].mean())


@pytest.fixture(scope="module")
def tiny():
    model = random_model(num_layers=2, hidden_size=36, num_heads=6, num_kv_heads=2, head_dim=6,
                         intermediate_size=50, vocab_size=97, dtype=np.float64, seed=3)
    ids = [int(i) for i in np.random.default_rng(1).integers(0, 97, size=23)]
    return model, ids


@pytest.mark.parametrize("cache", [k for k, v in CACHE_KINDS.items() if not v.evicts])  # step 6: test_window
@pytest.mark.parametrize("prefill", [1, 5, 22])
def test_every_cache_kind_and_prefill_equals_the_uncached_nll(tiny, cache, prefill):
    model, ids = tiny
    want = uncached_nll(model, ids)
    got = perplexity(model, ids, cache=cache, prefill=prefill, block_size=4)
    assert got["tokens"] == 23 and got["scored_tokens"] == 22 and got["cache"] == cache
    assert abs(got["mean_nll"] - want) <= 1e-10 * abs(want), (got["mean_nll"], want)
    assert got["ppl"] == pytest.approx(math.exp(want), rel=1e-10)
    assert got["cache_bytes_per_token"] == 2 * 2 * 2 * 6 * 8  # K and V, 2 layers, 2 KV heads, 6 dims, float64


def test_block_sizes_around_the_text_length(tiny):
    model, ids = tiny
    want = uncached_nll(model, ids)
    for block_size in (1, 21, 22, 23):
        got = perplexity(model, ids, cache="paged", block_size=block_size)["mean_nll"]
        assert abs(got - want) <= 1e-10 * abs(want), block_size


def test_the_loss_is_measured_through_the_cache(tiny):
    """A cache that corrupts what it stores must change the NLL: the loop reads the cached history."""
    from minikv.kv_cache import ContiguousKVCache

    class Forgetful(ContiguousKVCache):  # zeroes the values it is handed
        def write(self, layer, k, v):
            super().write(layer, k, np.zeros_like(v))

    model, ids = tiny
    factory = lambda m, n: Forgetful(**m.new_cache_args(), max_seqs=1, max_len=n, dtype=m.dtype)  # noqa: E731
    broken = perplexity(model, ids, cache="forgetful", cache_factory=factory)
    assert broken["cache"] == "forgetful"
    assert abs(broken["mean_nll"] - uncached_nll(model, ids)) > 1e-3


def test_extra_metrics_and_progress_see_every_scored_position(tiny):
    model, ids = tiny
    seen, ticks = NextTokenNLL(), []

    class Counter:
        def update(self, logprobs, targets):
            assert logprobs.dtype == np.float64 and logprobs.shape == (targets.size, 97)
            seen.update(logprobs, targets)

        def result(self):
            return {"counted": seen.count}

    got = perplexity(model, ids, prefill=5, metrics=[Counter()], progress=ticks.append)
    assert got["counted"] == 22 and ticks == [5] + [1] * 17 and sum(ticks) == got["scored_tokens"]
    assert seen.result()["mean_nll"] == got["mean_nll"]


def test_float32_model_agrees_with_its_uncached_pass():
    model = random_model(seed=5)
    ids = [int(i) for i in np.random.default_rng(0).integers(0, 101, size=30)]
    got = perplexity(model, ids, cache="paged", block_size=7)["mean_nll"]
    assert got == pytest.approx(uncached_nll(model, ids), rel=1e-4)


@pytest.mark.parametrize("ids, prefill, match", [
    ([], 1, "0 token"), ([3], 1, "1 token"), ([1, 2, 3], 3, r"prefill=3 is outside \[1, 2\]"),
    ([1, 2, 3], 0, "prefill=0"), ([1, -2, 3], 1, "token id -2"), ([1, 97, 3], 1, "token id 97"),
])
def test_bad_input_is_refused_naming_the_value(tiny, ids, prefill, match):
    with pytest.raises(InvalidInputError, match=match):
        perplexity(tiny[0], ids, prefill=prefill)


def test_a_text_past_the_context_is_refused_before_a_cache_is_built():
    model = random_model(max_position=8)
    with pytest.raises(InvalidInputError, match="max_position=8; use at most 9"):
        perplexity(model, list(range(10)))
    assert perplexity(model, list(range(9)))["scored_tokens"] == 8
    make_cache("contiguous", model, max_len=8)  # the same cache perplexity built


@pytest.mark.model
def test_smollm2_contiguous_and_paged_agree_and_the_perplexity_is_plausible(smollm2):
    from minikv.bench.corpus import reference_tokens

    model, tok = smollm2
    ids = reference_tokens(tok, 64)
    runs = {cache: perplexity(model, ids, cache=cache, prefill=8) for cache in ("contiguous", "paged")}
    c, p = runs["contiguous"]["mean_nll"], runs["paged"]["mean_nll"]
    print(f"SmolLM2 on 64 reference tokens: mean NLL {c:.4f} (ppl {math.exp(c):.2f}) contiguous, {p:.4f} paged")
    assert abs(c - p) <= 1e-4 * abs(c)
    assert 1.0 < runs["contiguous"]["ppl"] < 100
    assert runs["contiguous"]["cache_bytes_per_token"] == 2 * 30 * 3 * 64 * 4  # float32 K and V


def test_a_long_prefill_is_scored_in_slices_with_the_same_result(tiny, monkeypatch):
    import minikv.perplexity as ppl

    model, ids = tiny
    whole = perplexity(model, ids, prefill=22)["mean_nll"]
    monkeypatch.setattr(ppl, "SCORE_ROWS", 4)  # 22 prefill rows: slices of 4, 4, 4, 4, 4, 2
    ticks = []
    sliced = perplexity(model, ids, prefill=22, progress=ticks.append)
    assert sliced["scored_tokens"] == 22 and ticks == [22]
    assert abs(sliced["mean_nll"] - whole) <= 1e-12 * abs(whole)


# --- a lossy cache against the exact run ---------------------------------------------------------


@pytest.fixture(scope="module")
def quantizable():
    """A tiny float64 model whose head_dim (32) every codec's group divides."""
    model = random_model(num_layers=2, hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32,
                         intermediate_size=48, vocab_size=61, dtype=np.float64, seed=7)
    ids = [int(i) for i in np.random.default_rng(4).integers(0, 61, size=40)]
    return model, ids


def quantized(kv_dtype, residual=16, group=8):
    return lambda m, n: make_cache("paged", m, max_len=n, block_size=8, kv_dtype=kv_dtype, residual=residual,
                                    group=group)


def test_the_exact_cache_against_itself_has_zero_kld(quantizable):
    from minikv.perplexity import perplexity_vs_exact

    model, ids = quantizable
    same = perplexity_vs_exact(model, ids, lambda m, n: make_cache("contiguous", m, max_len=n), prefill=3)
    assert same["kld_vs_exact"] == 0.0 and same["kld_max_vs_exact"] == 0.0 and same["delta_ppl"] == 0.0
    assert same["top1_vs_exact"] == 1.0 and same["mean_nll"] == same["mean_nll_exact"]
    # the paged layout sums in another order: float64 rounding only
    paged = perplexity_vs_exact(model, ids, lambda m, n: make_cache("paged", m, max_len=n), prefill=3)
    assert 0.0 <= paged["kld_vs_exact"] <= 1e-14 and abs(paged["delta_ppl"]) <= 1e-12
    assert paged["top1_vs_exact"] == 1.0
    assert paged["mean_nll"] == pytest.approx(uncached_nll(model, ids), rel=1e-10)


def test_fp16_storage_is_tiny_and_a_destructive_cache_is_large(quantizable):
    from minikv.kv_cache import ContiguousKVCache
    from minikv.perplexity import perplexity_vs_exact

    class Forgetful(ContiguousKVCache):  # zeroes the values it is handed
        def write(self, layer, k, v):
            super().write(layer, k, np.zeros_like(v))

    model, ids = quantizable
    fp16 = perplexity_vs_exact(model, ids, quantized("fp16"))
    broken = perplexity_vs_exact(model, ids, lambda m, n: Forgetful(**m.new_cache_args(), max_seqs=1, max_len=n,
                                                                    dtype=m.dtype))
    assert 0.0 < fp16["kld_vs_exact"] < 1e-5, fp16["kld_vs_exact"]
    assert broken["kld_vs_exact"] > 1e3 * fp16["kld_vs_exact"] and broken["kld_vs_exact"] > 1e-2
    assert fp16["cache_bytes_per_token"] == 2 * 2 * 1 * 32 * 2  # K and V, 2 layers, 1 KV head, 32 dims, fp16


@pytest.mark.parametrize("kv_dtype", ["int8", "int4", "kivi2", "kivi4", "fp8", "k16v8", "bf16"])
def test_the_metrics_equal_a_direct_computation_from_two_logit_arrays(quantizable, kv_dtype):
    """Lockstep zip == the full [T-1, V] logits of both runs scored at once (the definition)."""
    from minikv.perplexity import perplexity_vs_exact, teacher_forced_logits

    model, ids = quantizable
    arr = np.asarray(ids)
    runs = []
    for factory in (lambda m, n: make_cache("contiguous", m, max_len=n), quantized(kv_dtype)):
        kv = factory(model, arr.size - 1)
        kv.add_sequence(0)
        runs.append(log_softmax(np.concatenate([lg for _, lg in teacher_forced_logits(model, arr, kv, 2)])))
    p, q = runs
    targets = arr[1:]
    kl = (np.exp(p) * (p - q)).sum(axis=-1)
    nll_p, nll_q = -p[np.arange(targets.size), targets].mean(), -q[np.arange(targets.size), targets].mean()
    got = perplexity_vs_exact(model, ids, quantized(kv_dtype), prefill=2)
    assert np.all(kl >= -1e-15) and got["kld_vs_exact"] >= 0.0
    assert got["kld_vs_exact"] == pytest.approx(np.maximum(kl, 0).mean(), rel=1e-9, abs=1e-18)
    assert got["top1_vs_exact"] == np.mean(p.argmax(-1) == q.argmax(-1))
    assert got["delta_ppl"] == pytest.approx(math.exp(nll_q) / math.exp(nll_p) - 1, rel=1e-9, abs=1e-15)
    assert got["ppl"] == pytest.approx(math.exp(nll_q), rel=1e-12)
    assert got["ppl_exact"] == pytest.approx(math.exp(nll_p), rel=1e-12)


def test_versus_exact_refuses_bad_ids_like_perplexity(quantizable):
    from minikv.perplexity import perplexity_vs_exact

    with pytest.raises(InvalidInputError, match="prefill=40"):
        perplexity_vs_exact(quantizable[0], quantizable[1], quantized("int8"), prefill=40)
