"""The generation loop: caches change speed, never tokens; sampling is controlled and reproducible."""

import numpy as np
import pytest

from minikv.errors import InvalidInputError
from minikv.generate import GREEDY, SamplingParams, generate, sample, stream
from minikv.weights.random_models import random_model


@pytest.fixture(scope="module")
def model():
    return random_model(num_layers=3, num_heads=6, num_kv_heads=2, head_dim=8, hidden_size=40, seed=1)


def test_greedy_tokens_identical_with_and_without_cache(model):
    prompt = [3, 14, 15, 92, 65]
    runs = {c: generate(model, prompt, 20, cache=c, eos_token_id=-1) for c in ("none", "contiguous")}
    assert runs["none"].token_ids == runs["contiguous"].token_ids
    assert len(runs["none"].token_ids) == 20
    assert runs["contiguous"].prefill_s > 0 and runs["contiguous"].decode_s > 0


def test_stream_yields_what_generate_returns(model):
    sp = SamplingParams(temperature=0.8, top_k=10, seed=42)
    streamed = list(stream(model, [1, 2, 3], 12, sampling=sp, eos_token_id=-1))
    assert streamed == generate(model, [1, 2, 3], 12, sampling=sp, eos_token_id=-1).token_ids


def test_stops_at_eos(model):
    first = generate(model, [5, 6, 7], 10, eos_token_id=-1).token_ids
    res = generate(model, [5, 6, 7], 10, eos_token_id=first[3])
    stop = first.index(first[3])  # the first time that token appears
    assert res.token_ids == first[: stop + 1]
    assert res.finish_reason == "eos"


def test_zero_new_tokens(model):
    assert generate(model, [1, 2], 0).token_ids == []


def test_sampling_is_seeded_and_varies(model):
    sp = SamplingParams(temperature=1.5, seed=7)
    a = generate(model, [1, 2, 3], 15, sampling=sp, eos_token_id=-1).token_ids
    b = generate(model, [1, 2, 3], 15, sampling=sp, eos_token_id=-1).token_ids
    c = generate(model, [1, 2, 3], 15, sampling=SamplingParams(temperature=1.5, seed=8), eos_token_id=-1).token_ids
    assert a == b and a != c


def test_top_k_and_top_p_restrict_the_choice():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    rng = np.random.default_rng(0)
    draws = lambda sp: {sample(logits, sp, rng) for _ in range(400)}  # noqa: E731
    assert draws(SamplingParams(top_k=1)) == {0}
    assert draws(SamplingParams(top_k=2)) == {0, 1}
    assert draws(SamplingParams(top_p=0.5)) == {0}  # 0.5 alone reaches the mass
    assert draws(SamplingParams(top_p=0.79)) == {0, 1}  # 0.5 + 0.3 = 0.8 >= 0.79
    assert draws(SamplingParams()) == {0, 1, 2, 3}
    assert sample(logits, GREEDY, rng) == 0


def test_bad_arguments(model):
    with pytest.raises(InvalidInputError, match="temperature"):
        SamplingParams(temperature=0)
    with pytest.raises(InvalidInputError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(InvalidInputError, match="top_k"):
        SamplingParams(top_k=-1)
    with pytest.raises(InvalidInputError, match="empty"):
        generate(model, [], 5)
    with pytest.raises(InvalidInputError, match="max_new_tokens"):
        generate(model, [1], -1)
    with pytest.raises(InvalidInputError, match="cache kind"):
        generate(model, [1], 2, cache="bogus")


@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_paged_cache_generates_the_same_tokens(model, block_size):
    prompt = [3, 14, 15, 92, 65]
    want = generate(model, prompt, 12, cache="contiguous", eos_token_id=-1).token_ids
    assert generate(model, prompt, 12, cache="paged", block_size=block_size, eos_token_id=-1).token_ids == want


@pytest.mark.parametrize("block_size", [0, -3, 2.5])
def test_paged_cache_rejects_a_bad_block_size(model, block_size):
    from minikv.errors import ConfigError

    with pytest.raises(ConfigError, match="block_size"):
        generate(model, [1, 2], 2, cache="paged", block_size=block_size)


def test_a_length_past_the_context_is_refused_before_anything_is_allocated(model, monkeypatch):
    import minikv.generate as gen

    def no_allocation(*args, **kwargs):
        raise AssertionError("make_cache ran although the length was refused")

    limit = model.config.max_position  # 512 for random_model
    with monkeypatch.context() as m:
        m.setattr(gen, "make_cache", no_allocation)
        with pytest.raises(InvalidInputError, match="max_new_tokens=100000000.*max_position=512"):
            generate(model, [1, 2, 3, 4, 5], 100_000_000)
        with pytest.raises(InvalidInputError, match=f"max_new_tokens <= {limit - 5 + 1}"):
            generate(model, [1, 2, 3, 4, 5], limit - 5 + 2)
    # the last new token is never fed back: prompt + max_new_tokens - 1 positions fit exactly
    assert len(generate(model, [1, 2, 3, 4, 5], limit - 5 + 1, eos_token_id=-1).token_ids) == limit - 4


def test_make_cache_refuses_a_cache_larger_than_memory(model, monkeypatch):
    import minikv.generate as gen
    from minikv.errors import ConfigError

    per_token = 2 * 3 * 2 * 8 * 4  # K and V x layers x kv heads x head_dim x float32 bytes
    monkeypatch.setattr("minikv.errors.available_memory_bytes", lambda: 100 * per_token)
    assert gen.make_cache("contiguous", model, max_len=100).bytes_allocated() == 100 * per_token
    with pytest.raises(ConfigError, match=f"needs {101 * per_token:,} bytes"):
        gen.make_cache("contiguous", model, max_len=101)
    with pytest.raises(ConfigError, match="paged cache"):
        gen.make_cache("paged", model, max_len=90, block_size=64)  # two blocks of 64 > 100 tokens
    gen.make_cache("none", model, max_len=10**12)  # a cache that stores nothing needs no memory


def test_one_registry_of_cache_kinds(model):
    from minikv.generate import CACHE_KINDS, make_cache
    from minikv.kv_cache import ContiguousKVCache, NoCache
    from minikv.paged import PagedKVCache
    from minikv.window import EvictingKVCache

    assert list(CACHE_KINDS) == ["none", "contiguous", "paged", "window", "h2o", "snapkv"]
    options = {"window": {"window": 4}, "h2o": {"budget": 4}, "snapkv": {"budget": 4}}
    built = {kind: type(make_cache(kind, model, max_len=8, eviction=options.get(kind))) for kind in CACHE_KINDS}
    assert built == {"none": NoCache, "contiguous": ContiguousKVCache, "paged": PagedKVCache,
                     "window": EvictingKVCache, "h2o": EvictingKVCache, "snapkv": EvictingKVCache}
    assert [k for k, spec in CACHE_KINDS.items() if spec.recompute] == ["none"]
    assert [k for k, spec in CACHE_KINDS.items() if spec.evicts] == ["window", "h2o", "snapkv"]


def test_sample_per_sequence_as_a_scheduler_calls_it(model):
    """One rng per sequence, made once: the same draws as stream() whatever runs in between."""
    from minikv.generate import make_cache

    sp = SamplingParams(temperature=0.9, top_p=0.9, seed=3)
    want = generate(model, [4, 5, 6], 6, cache="none", sampling=sp, eos_token_id=-1).token_ids
    rng, ids, got = sp.new_rng(), [4, 5, 6], []
    other = SamplingParams(seed=9)
    for _ in range(6):
        logits = model.forward([ids], make_cache("none", model, max_len=1))[0]  # what stream() computes
        tok = sample(logits, sp, rng)
        sample(logits, other, other.new_rng())  # another sequence's draw does not disturb this one
        ids.append(tok)
        got.append(tok)
    assert got == want
    row = model.logits([1, 2])[-1]
    assert sample(row) == sample(row, GREEDY, None) == int(np.argmax(row))
    with pytest.raises(InvalidInputError, match="rng"):
        sample(row, sp)
    with pytest.raises(InvalidInputError, match="seed=-1"):
        SamplingParams(seed=-1)
