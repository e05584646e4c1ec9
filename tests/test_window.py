"""Step 6: window and eviction caches are exact where they can be exact.

* every policy with original positions equals the masked recompute built from its own eviction
  log, at every step (float64 1e-10, float32 1e-4), prefill 1 and a multi-token prefill;
* in-cache positions equal the recompute in which kept keys carry their rank;
* the ring writes O(1) elements per token, whatever W;
* bad options raise typed errors.
"""

import numpy as np
import pytest

from minikv.bench.equivalence import assert_close, rel_err
from minikv.errors import ConfigError, InvalidInputError, ShapeError
from minikv.generate import generate, make_cache
from minikv.weights.random_models import random_mla_model, random_model
from minikv.window import (
    NEVER,
    EvictingKVCache,
    H2OPolicy,
    MaskedRecompute,
    SnapKVPolicy,
    WindowPolicy,
    make_policy,
    rank_positions,
)

POLICIES = {
    "window": lambda: WindowPolicy(7),
    "sinks": lambda: WindowPolicy(7, 2),
    "sinks-in-cache": lambda: WindowPolicy(7, 2, "in-cache"),
    "h2o-raw": lambda: H2OPolicy(9, 3),
    "h2o-normalized": lambda: H2OPolicy(9, 2, "normalized"),
    "snapkv": lambda: SnapKVPolicy(10, 4, kernel=3),
}


def rope_of(model):
    return model.cos, model.sin, model.config.rope_layout


def run_cached(model, ids, policy, prefill: int, chunk: int = 1):
    """Teacher-forced logits [n, V] of every fed position, and the cache."""
    cache = EvictingKVCache(**model.new_cache_args(), policy=policy, dtype=model.dtype, rope=rope_of(model))
    cache.add_sequence(0)
    out = [model.forward([ids[:prefill]], cache, all_logits=True)]
    for t in range(prefill, len(ids), chunk):
        out.append(model.forward([ids[t:t + chunk]], cache, all_logits=True))
    return np.concatenate(out), cache


def masked_recompute(model, ids, cache):
    ref = MaskedRecompute(**model.new_cache_args(), evicted_at=cache.evicted_at(0),
                          positions=cache.policy.positions, rope=rope_of(model), dtype=model.dtype)
    return model.forward([ids], ref, all_logits=True)


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("prefill", [1, 14])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_every_policy_equals_its_masked_recompute(name, dtype, prefill, layout):
    model = random_model(dtype=dtype, seed=2, rope_layout=layout)
    ids = np.random.default_rng(1).integers(0, model.config.vocab_size, 30)
    got, cache = run_cached(model, ids, POLICIES[name](), prefill)
    assert got.dtype == dtype
    assert_close(got, masked_recompute(model, ids, cache), dtype, what=f"{name} prefill {prefill}")
    if name == "snapkv" and prefill == 1:  # SnapKV compresses a prompt; a 1-token prompt keeps everything
        assert (cache.evicted_at(0) == NEVER).all()
        assert_close(got, model.logits(ids), dtype)
        return
    assert (cache.evicted_at(0) < NEVER).any(), "the test must evict something"
    # ...and the eviction matters: the full cache gives other logits
    assert rel_err(got, model.logits(ids)) > 1e-3


def test_each_step_sees_exactly_the_logged_keys():
    """The log is the cache's own: at step t the kept positions are those with evicted_at > t."""
    model = random_model(dtype=np.float64, seed=4)
    ids = np.random.default_rng(2).integers(0, model.config.vocab_size, 25)
    cache = EvictingKVCache(**model.new_cache_args(), policy=H2OPolicy(6, 2), dtype=np.float64)
    cache.add_sequence(0)
    for t in range(ids.size):
        model.forward([ids[t:t + 1]], cache)
        log = cache.evicted_at(0)
        for layer in range(model.config.num_layers):
            for h, kept in enumerate(cache.kept_positions(0, layer)):
                want = np.flatnonzero(log[layer, h, : t + 1] > t + 1)  # still visible to the next query
                np.testing.assert_array_equal(kept, want)
                assert kept.size == min(t + 1, 6)


def test_in_cache_positions_without_sinks_equal_original_positions():
    """Ranks preserve every query-key distance when S = 0, so RoPE gives the same scores."""
    model = random_model(dtype=np.float64, seed=5)
    ids = np.random.default_rng(3).integers(0, model.config.vocab_size, 24)
    a, _ = run_cached(model, ids, WindowPolicy(6, 0, "original"), 1)
    b, _ = run_cached(model, ids, WindowPolicy(6, 0, "in-cache"), 1)
    assert_close(b, a, np.float64)
    # with sinks the contracts differ (the sinks move close to the query)
    c, _ = run_cached(model, ids, WindowPolicy(6, 2, "original"), 1)
    d, _ = run_cached(model, ids, WindowPolicy(6, 2, "in-cache"), 1)
    assert rel_err(d, c) > 1e-6


def test_in_cache_positions_run_past_the_trained_context():
    model = random_model(seed=6, max_position=24)
    res = generate(model, [1, 2, 3], 40, cache="window", eviction={"window": 8, "sinks": 2, "positions": "in-cache"})
    assert len(res.token_ids) == 40
    with pytest.raises(InvalidInputError, match="max_position"):
        generate(model, [1, 2, 3], 40, cache="window", eviction={"window": 8, "sinks": 2})


@pytest.mark.parametrize("policy", [WindowPolicy(6, 2), WindowPolicy(6, 2, "in-cache"), SnapKVPolicy(8, 3)])
def test_chunked_feeding_equals_token_by_token(policy):
    """A window evicts by position and SnapKV only at the prompt, so a chunk equals its tokens one by one
    (benchmarks/eviction_quality.py relies on this; H2O evicts at every step and is always fed token by token)."""
    model = random_model(dtype=np.float64, seed=7)
    ids = np.random.default_rng(4).integers(0, model.config.vocab_size, 30)
    one, _ = run_cached(model, ids, policy, 12, chunk=1)
    many, _ = run_cached(model, ids, policy, 12, chunk=7)
    assert_close(many, one, np.float64)


def test_ring_slots_and_stored_positions():
    policy = WindowPolicy(6, 2)
    assert [policy.ring_slot(p) for p in range(10)] == [0, 1, 2, 3, 4, 5, 2, 3, 4, 5]
    assert [WindowPolicy(4).ring_slot(p) for p in range(6)] == [0, 1, 2, 3, 0, 1]
    model = random_model(dtype=np.float64, seed=8)
    _, cache = run_cached(model, np.arange(1, 14), policy, 1)
    pos = cache._seqs[0].pos[0, 0]
    assert pos.tolist() == [0, 1, 10, 11, 12, -1]  # slot 5 is free: it takes position 13 next
    assert [p.tolist() for p in cache.kept_positions(0, 1)] == [[0, 1, 10, 11, 12]] * model.config.num_kv_heads


@pytest.mark.parametrize("window", [4, 16, 64])
def test_ring_writes_a_constant_number_of_elements_per_token(window):
    model = random_model(seed=9)
    cache = make_cache("window", model, max_len=1, eviction={"window": window, "sinks": 1})
    cache.add_sequence(0)
    c = model.config
    per_token = c.num_layers * c.num_kv_heads * 2 * c.head_dim
    for t in range(80):
        before = cache.elements_written
        model.forward([[t % 50]], cache)
        assert cache.elements_written - before == per_token
    assert cache.bytes_used() == c.num_layers * c.num_kv_heads * (window - 1) * 2 * c.head_dim * 4


def test_rank_positions_orders_by_time_not_by_slot():
    k_pos = np.array([[10, 11, 2, 3, 0]])
    vis = np.array([[True, True, False, True, True]])
    r = rank_positions(k_pos, vis)
    assert r[0, [4, 3, 0, 1]].tolist() == [0, 1, 2, 3]


def test_bad_options_raise_typed_errors():
    model = random_model(seed=10)
    with pytest.raises(ConfigError, match="sinks"):
        WindowPolicy(4, 4)
    with pytest.raises(ConfigError, match="positions"):
        WindowPolicy(4, 1, "relative")
    with pytest.raises(ConfigError, match="recent"):
        H2OPolicy(4, 5)
    with pytest.raises(ConfigError, match="obs_window"):
        SnapKVPolicy(4, 8)
    with pytest.raises(ConfigError, match="odd"):
        SnapKVPolicy(8, 2, kernel=4)
    with pytest.raises(ConfigError, match="rope"):
        EvictingKVCache(**model.new_cache_args(), policy=WindowPolicy(4, 1, "in-cache"))
    with pytest.raises(ConfigError, match="do not apply"):
        make_policy("h2o", budget=8, window=3)
    with pytest.raises(ConfigError, match="needs window"):
        make_policy("window", sinks=2)
    with pytest.raises(ConfigError, match="eviction"):
        make_cache("contiguous", model, 8, eviction={"window": 4})
    with pytest.raises(ConfigError, match="kv_dtype"):
        make_cache("window", model, 8, kv_dtype="int8", eviction={"window": 4})
    with pytest.raises(ConfigError, match="MLA"):
        make_cache("h2o", random_mla_model(), 8, eviction={"budget": 4})
    with pytest.raises(ShapeError, match="evicted_at"):
        MaskedRecompute(**model.new_cache_args(), evicted_at=np.zeros((1, 2, 3)))
    cache = make_cache("window", model, 8, eviction={"window": 4})
    cache.add_sequence(0)
    with pytest.raises(InvalidInputError, match="already"):
        cache.add_sequence(0)


def test_a_failed_step_changes_nothing():
    model = random_model(dtype=np.float64, seed=11)
    cache = make_cache("h2o", model, 8, eviction={"budget": 5, "recent": 2, "log": True})
    cache.add_sequence(0)
    model.forward([[1, 2, 3, 4, 5, 6, 7]], cache)
    before = [p.copy() for p in cache.kept_positions(0, 0)], cache.evicted_at(0)
    with pytest.raises(InvalidInputError):
        model.forward([[1, 2, 999]], cache)  # a bad id inside the step's checks
    with pytest.raises(RuntimeError):
        with cache.step([0], [1]):
            cache.write(0, np.zeros((1, 2, 8)), np.zeros((1, 2, 8)))
            raise RuntimeError("the model failed mid-step")
    assert cache.length(0) == 7
    np.testing.assert_array_equal(cache.evicted_at(0), before[1])
    for a, b in zip(cache.kept_positions(0, 0), before[0], strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.model
def test_smollm2_policies_equal_their_masked_recompute(smollm2):
    model, tok = smollm2
    ids = np.asarray(tok.encode("The quick brown fox jumps over the lazy dog. " * 3)[:36])
    for policy in (WindowPolicy(12, 4), H2OPolicy(12, 4), SnapKVPolicy(12, 4)):
        got, cache = run_cached(model, ids, policy, 20)
        assert_close(got, masked_recompute(model, ids, cache), np.float32, what=policy.name)


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_in_cache_positions_handle_long_prompts_and_windows_up_to_the_rope_table(layout):
    """Ranks of unseen keys never index the RoPE table; W may equal max_position, not exceed it."""
    model = random_model(seed=6, max_position=24)
    for prompt, window in ((30, 8), (5, 24)):
        ev = {"window": window, "sinks": 2, "positions": "in-cache", "layout": layout}
        res = generate(model, list(range(1, prompt + 1)), 20, cache="window", eviction=ev, block_size=4)
        assert len(res.token_ids) == 20
    with pytest.raises(ConfigError, match="max_position"):
        make_cache("window", model, 8, eviction={"window": 25, "positions": "in-cache", "layout": layout})


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("positions", ["original", "in-cache"])
def test_a_window_longer_than_the_text_equals_the_full_cache(layout, positions):
    model = random_model(dtype=np.float64, seed=12)
    ids = np.random.default_rng(5).integers(0, model.config.vocab_size, 20)
    cache = make_cache("window", model, 24, block_size=3,
                       eviction={"window": 32, "sinks": 4, "positions": positions, "layout": layout})
    cache.add_sequence(0)
    got = np.concatenate([model.forward([ids[:7]], cache, all_logits=True)] +
                         [model.forward([ids[t:t + 1]], cache) for t in range(7, ids.size)])
    assert_close(got, model.logits(ids), np.float64)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_batched_step_equals_each_sequence_alone(name):
    """Two sequences of different lengths share the contiguous cache's steps, prefill and decode."""
    model = random_model(dtype=np.float64, seed=13)
    rng = np.random.default_rng(6)
    texts = [rng.integers(0, model.config.vocab_size, n) for n in (19, 12)]
    cache = EvictingKVCache(**model.new_cache_args(), policy=POLICIES[name](), max_seqs=2, dtype=np.float64,
                            rope=rope_of(model))
    for sid in ("a", "b"):
        cache.add_sequence(sid)
    prefill = model.forward([texts[0][:11], texts[1][:6]], cache, ["a", "b"], all_logits=True)  # [17, V]
    decode = [model.forward([texts[0][11 + t:12 + t], texts[1][6 + t:7 + t]], cache, ["a", "b"]) for t in range(6)]
    alone = {sid: run_cached(model, text[:n + 6], POLICIES[name](), n)[0]
             for sid, text, n in (("a", texts[0], 11), ("b", texts[1], 6))}
    assert_close(prefill[:11], alone["a"][:11], np.float64)
    assert_close(prefill[11:], alone["b"][:6], np.float64)
    for t, step in enumerate(decode):
        assert_close(step[0], alone["a"][11 + t], np.float64)
        assert_close(step[1], alone["b"][6 + t], np.float64)


def test_a_commit_without_every_layer_refuses_and_changes_nothing():
    model = random_model(dtype=np.float64, seed=14)
    for layout in ("contiguous", "paged"):
        cache = make_cache("window", model, 16, block_size=4,
                           eviction={"window": 6, "sinks": 1, "layout": layout, "log": True})
        cache.add_sequence(0)
        model.forward([[1, 2, 3, 4, 5, 6, 7]], cache)
        before = cache.evicted_at(0), [p.copy() for p in cache.kept_positions(0, 0)]
        with pytest.raises(InvalidInputError, match="layers"):
            with cache.step([0], [1]):
                k = np.zeros((1, model.config.num_kv_heads, model.config.head_dim))
                cache.write(0, k, k)
                cache.attend(0, np.zeros((1, model.config.num_heads, model.config.head_dim)))
        assert cache.length(0) == 7
        np.testing.assert_array_equal(cache.evicted_at(0), before[0])
        model.forward([[8]], cache)  # the cache still works: the refused step was closed
        assert cache.length(0) == 8
