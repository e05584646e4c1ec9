"""Step 9 on tiny models: per-layer caches (a ring of W slots for sliding layers, a slab for full ones)
equal the uncached forward with each sliding layer masked to its window, and equal transformers' Gemma-3.

Random Gemma-3-style models are built in memory (``random_gemma_model``: odd sizes, query_pre_attn_scalar
!= head_dim, GQA) and by transformers (``Gemma3ForCausalLM`` saved with ``save_pretrained``, read by
``load_checkpoint``). Windows sit around the text length (T - 1, T, T + 1) and far below it (the ring
wraps many times), in steps of one token and in chunks.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from minikv.bench.equivalence import assert_close, rel_err
from minikv.errors import CacheFullError, ConfigError, InvalidInputError, ModelFormatError, RollbackError
from minikv.hybrid import HybridKVCache, SlidingNoCache, hybrid_cache, layer_groups
from minikv.kv_cache import ContiguousKVCache, NoCache
from minikv.model import Model, ModelConfig
from minikv.weights.checkpoints import load_checkpoint
from minikv.weights.random_models import random_gemma_model

T = 13  # the text length of most tests


def hybrid(model: Model, max_len: int = 64, max_seqs: int = 1) -> HybridKVCache:
    c = model.config
    return hybrid_cache("contiguous", c.layer_windows, c.num_kv_heads, c.head_dim, max_len, max_seqs, model.dtype)


def run_steps(model: Model, cache, ids, cuts) -> np.ndarray:
    """Feed ``ids`` through ``cache`` in steps ending at ``cuts`` (then the rest): logits of every token [T, V]."""
    cache.add_sequence(0)
    bounds = [0, *cuts, len(ids)]
    return np.concatenate([model.forward([ids[a:b]], cache, all_logits=True) for a, b in zip(bounds, bounds[1:])
                           if b > a])


def text(n: int = T, vocab: int = 97, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, n)


# --- the cache equals the masked reference, float64 -------------------------------------------------

@pytest.mark.parametrize("window", [1, 4, T - 1, T, T + 1])
@pytest.mark.parametrize("cuts", [list(range(1, T)), [5, 6, 11], []], ids=["token-by-token", "chunks", "one-step"])
def test_hybrid_cache_equals_the_sliding_reference_in_float64(window, cuts):
    model = random_gemma_model(sliding_window=window, dtype=np.float64, seed=window)
    ids = text()
    want = model.logits(ids)  # SlidingNoCache: one pass over the whole text
    assert_close(run_steps(model, hybrid(model), ids, cuts), want, np.float64, what=f"window {window}")


def test_the_sliding_reference_is_the_window_mask():
    """SlidingNoCache written out by hand: query t of a window-W layer sees keys max(0, t-W+1) .. t."""
    rng = np.random.default_rng(0)
    n, hq, hkv, d, w = 11, 4, 2, 6, 3
    q, k, v = rng.standard_normal((n, hq, d)), rng.standard_normal((n, hkv, d)), rng.standard_normal((n, hkv, d))
    cache = SlidingNoCache([None, w], hkv, d, dtype=np.float64)
    with cache.step([0], [n]):
        for layer in (0, 1):
            cache.write(layer, k, v)
        full, sliding = cache.attend(0, q), cache.attend(1, q)
    for out, win in ((full, n), (sliding, w)):
        want = np.empty_like(q)
        for t in range(n):
            seen = slice(max(0, t - win + 1), t + 1)
            for h in range(hq):
                s = k[seen, h // (hq // hkv)] @ q[t, h] / np.sqrt(d)
                p = np.exp(s - s.max())
                want[t, h] = p @ v[seen, h // (hq // hkv)] / p.sum()
        assert_close(out, want, np.float64)


def test_the_window_changes_the_result_only_past_it():
    """The same weights with the window ignored (as long as the text): equal while T <= W, different after."""
    model = random_gemma_model(sliding_window=5, dtype=np.float64)
    ignored = Model(replace(model.config, sliding_window=T), model.weights, dtype=np.float64)
    ids = text()
    got, want = run_steps(ignored, hybrid(ignored), ids, []), model.logits(ids)
    assert_close(got[:5], want[:5], np.float64)
    assert rel_err(got[5:], want[5:]) > 1e-3


def test_a_cache_that_ignores_the_windows_is_refused():
    model = random_gemma_model(sliding_window=5)
    c = model.config
    for cache in (ContiguousKVCache(c.num_layers, c.num_kv_heads, c.head_dim, 1, 64), NoCache(**model.new_cache_args()),
                  hybrid(Model(replace(c, sliding_window=6), model.weights))):
        cache.add_sequence(0)
        with pytest.raises(ConfigError, match="windows"):
            model.forward([text(3)], cache)


def test_sequences_of_different_lengths_share_one_step():
    model = random_gemma_model(sliding_window=3, dtype=np.float64)
    a, b = text(9, seed=2), text(4, seed=3)
    cache = hybrid(model, max_seqs=2)
    cache.add_sequence("a")
    cache.add_sequence("b")
    got = model.forward([a[:6], b[:2]], cache, ["a", "b"], all_logits=True)
    got = np.concatenate([got, model.forward([a[6:], b[2:]], cache, ["a", "b"], all_logits=True)])
    want = np.concatenate([model.logits(a)[:6], model.logits(b)[:2], model.logits(a)[6:], model.logits(b)[2:]])
    assert_close(got, want, np.float64)


# --- the cache's bookkeeping ---------------------------------------------------------------------------

def test_groups_follow_the_layer_pattern():
    model = random_gemma_model(num_layers=7, pattern=3, sliding_window=4)
    assert layer_groups(model.config.layer_windows) == {4: [0, 1, 3, 4, 6], None: [2, 5]}
    cache = hybrid(model)
    assert [(layers, type(c).__name__) for layers, c in cache.groups] == [
        ((0, 1, 3, 4, 6), "SlidingRingKVCache"), ((2, 5), "ContiguousKVCache")]
    assert isinstance(hybrid_cache("contiguous", [None] * 3, 1, 4, 8), ContiguousKVCache)  # nothing slides
    assert type(hybrid_cache("none", [None] * 3, 1, 4)) is NoCache
    with pytest.raises(ConfigError, match="window"):
        hybrid_cache("window", model.config.layer_windows, 1, 10)


def test_a_sliding_group_stops_growing_at_its_window():
    model = random_gemma_model(num_layers=3, pattern=3, sliding_window=4, dtype=np.float64)
    cache = hybrid(model)
    per_token_layer = 2 * model.config.num_kv_heads * model.config.head_dim * 8  # K and V, float64
    run_steps(model, cache, text(10), list(range(1, 10)))
    # one full layer holds all 10 tokens; between steps each of the two sliding layers holds the W - 1 = 3
    # keys the next query sees beside its own
    assert cache.bytes_used() == per_token_layer * (10 * 1 + 3 * 2)


def test_a_refused_step_changes_no_group():
    model = random_gemma_model(sliding_window=3, dtype=np.float64)
    cache = hybrid(model, max_len=6)
    ids = text(8)
    run_steps(model, cache, ids[:5], [])
    with pytest.raises(CacheFullError):
        model.forward([ids[5:8]], cache)  # 5 + 3 > max_len of the full group
    assert all(c.length(0) == 5 for _, c in cache.groups)
    last = model.forward([ids[5:6]], cache)  # the step after the refusal is the one it would have been
    assert_close(last[0], model.logits(ids[:6])[-1], np.float64)


def test_a_step_that_skips_a_layer_commits_nothing():
    model = random_gemma_model(sliding_window=3, dtype=np.float64)
    c = model.config
    cache = hybrid(model)
    cache.add_sequence(0)
    k = np.zeros((2, c.num_kv_heads, c.head_dim))
    with pytest.raises(InvalidInputError, match=r"layers \[4\]"):
        with cache.step([0], [2]):
            for layer in range(c.num_layers - 1):
                cache.write(layer, k, k)
    assert all(g.length(0) == 0 for _, g in cache.groups)


def test_rollback_is_refused_by_the_ring_and_changes_nothing():
    model = random_gemma_model(sliding_window=3, dtype=np.float64)
    cache = hybrid(model)
    run_steps(model, cache, text(6), [])
    with pytest.raises(RollbackError):
        cache.truncate(0, 4)
    assert all(g.length(0) == 6 for _, g in cache.groups)


def test_sequences_are_added_and_freed_in_every_group():
    cache = hybrid(random_gemma_model(sliding_window=3), max_seqs=1)
    cache.add_sequence("x")
    with pytest.raises(CacheFullError):
        cache.add_sequence("y")
    assert "y" not in cache and all("y" not in g for _, g in cache.groups)
    cache.free_sequence("x")
    cache.add_sequence("y")


# --- bad configurations ------------------------------------------------------------------------------------

def base_config(**kw) -> ModelConfig:
    return ModelConfig(**{**dict(vocab_size=11, hidden_size=8, intermediate_size=12, num_layers=3, num_heads=2,
                                 num_kv_heads=1, head_dim=4), **kw})


@pytest.mark.parametrize("kw, field", [
    (dict(layer_types=("full_attention",) * 2), "layer_types"),
    (dict(layer_types="full_attention"), "layer_types"),
    (dict(layer_types=3), "layer_types"),
    (dict(layer_types=("full_attention", "local", "full_attention")), r"layer_types\[1\]"),
    (dict(layer_types=("sliding_attention",) * 3), "sliding_window"),
    (dict(layer_types=("sliding_attention",) * 3, sliding_window=0), "sliding_window"),
    (dict(layer_types=("sliding_attention",) * 3, sliding_window=2.5), "sliding_window"),
    (dict(rope_theta=float("nan")), "rope_theta"),
    (dict(rope_theta=-1.0), "rope_theta"),
    (dict(rms_eps=0.0), "rms_eps"),
    (dict(embed_scale=float("inf")), "embed_scale"),
    (dict(sliding_rope_theta="1e4"), "sliding_rope_theta"),
    (dict(query_pre_attn_scalar=True), "query_pre_attn_scalar"),
    (dict(hidden_act="gelu"), "hidden_act"),
])
def test_bad_configs_name_the_field(kw, field):
    with pytest.raises(ConfigError, match=field):
        base_config(**kw)


def test_weights_must_match_the_norm_options():
    model = random_gemma_model()
    with pytest.raises(Exception, match="q_norm"):
        Model(replace(model.config, qk_norm=True), replace(model.weights, layers=[
            replace(lw, q_norm=None) for lw in model.weights.layers]))


# --- transformers' Gemma-3, saved and read back ------------------------------------------------------------

def hf_gemma(tmp_path, require, window: int, **overrides):
    """A random ``Gemma3ForCausalLM`` (odd sizes, norms drawn away from 0) saved to ``tmp_path``: (hf model, dir)."""
    torch, transformers = require("torch"), require("transformers")
    types = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
    cfg = transformers.Gemma3TextConfig(**{**dict(
        vocab_size=97, hidden_size=45, intermediate_size=58, num_hidden_layers=5, num_attention_heads=3,
        num_key_value_heads=1, head_dim=10, sliding_window=window, layer_types=types, query_pre_attn_scalar=13,
        max_position_embeddings=512, attn_implementation="eager"), **overrides})
    torch.manual_seed(window)
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # zero-initialized (a multiplier of 1): draw them, so a missing 1 + w shows
                p.normal_(0, 0.3)
    model.save_pretrained(tmp_path)
    return model, tmp_path


@pytest.mark.reference
@pytest.mark.parametrize("window", [4, T - 1, T, T + 1])
def test_saved_gemma3_matches_transformers(tmp_path, require, window):
    torch = require("torch")
    hf, path = hf_gemma(tmp_path, require, window)
    ids = text()
    with torch.no_grad():
        want = hf(torch.tensor(ids[None])).logits[0].numpy()
    m32, m64 = load_checkpoint(path), load_checkpoint(path, dtype=np.float64)
    assert m32.config.layer_windows == (window, window, None, window, window)
    assert_close(m32.logits(ids), want, np.float32, what="uncached logits vs transformers")
    assert_close(run_steps(m32, hybrid(m32), ids, list(range(1, T))), want, np.float32, what="hybrid cache")
    assert_close(run_steps(m64, hybrid(m64), ids, [3, 4, 9]), m64.logits(ids), np.float64)


@pytest.mark.reference
@pytest.mark.parametrize("overrides, match", [
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(hidden_activation="relu"), "hidden_activation"),
])
def test_unsupported_gemma3_options_are_refused(tmp_path, require, overrides, match):
    _, path = hf_gemma(tmp_path, require, 4, **overrides)
    with pytest.raises(ModelFormatError, match=match):
        load_checkpoint(path)


@pytest.mark.reference
@pytest.mark.parametrize("edit, match", [
    (lambda c: c.update(layer_types=c["layer_types"][:4]), "layer_types"),
    (lambda c: c.update(sliding_window=0), "sliding_window"),
    (lambda c: c.update(layer_types=["full_attention"] * 4 + ["global"]), r"layer_types\[4\]"),
])
def test_a_layer_pattern_or_window_that_does_not_fit_is_refused(tmp_path, require, edit, match):
    import json

    _, path = hf_gemma(tmp_path, require, 4)
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFormatError, match=match):
        load_checkpoint(path)
