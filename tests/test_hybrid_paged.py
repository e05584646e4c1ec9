"""Step 9, paged, with prefix hits and rollbacks, on tiny random Gemma-3 models (float64, against the masked recompute).

The reference is ``Model.logits``: one uncached pass with each sliding layer masked to its window
(``SlidingNoCache``). Every cache here must equal it within 1e-10 (``assert_close``, float64): the paged hybrid
(block sizes 1, 5, 16 and windows 1, T - 1, T, T + 1), after a prefix hit that reuses only a window's blocks,
after truncates of up to K tokens once the rings wrapped, and under the scheduler with preemptions.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from minikv.bench.equivalence import assert_close, rel_err
from minikv.errors import ConfigError, InvalidInputError, RollbackError
from minikv.generate import generate, make_cache
from minikv.hybrid import HybridPagedKVCache, group_layers, hybrid_cache
from minikv.model import Model
from minikv.scheduler import Request, Scheduler
from minikv.weights.random_models import random_gemma_model

T = 13


def gemma(window: int, seed: int = 0, **kw):
    """7 layers, full at 2 and 5 (groups of 2: one full, three sliding, the last one layer short), GQA 3:1."""
    return random_gemma_model(**{**dict(num_layers=7, sliding_window=window, dtype=np.float64, seed=seed), **kw})


def paged(model, block_size: int = 3, num_blocks: int = 300, rollback: int = 0, **options) -> HybridPagedKVCache:
    c = model.config
    cache = hybrid_cache("paged", c.layer_windows, c.num_kv_heads, c.head_dim, dtype=model.dtype,
                         block_size=block_size, num_blocks=num_blocks, rollback=rollback, **options)
    cache.k_pool[...], cache.v_pool[...] = np.nan, np.nan  # stale rows must never be read
    return cache


def ids(n: int, seed: int = 1, vocab: int = 97) -> list:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def feed(model, cache, seq_id, tokens, cuts) -> np.ndarray:
    """Feed ``tokens`` to ``seq_id`` in steps ending at ``cuts``: logits of every token [T, V]."""
    bounds = [0, *cuts, len(tokens)]
    return np.concatenate([model.forward([tokens[a:b]], cache, [seq_id], all_logits=True)
                           for a, b in zip(bounds, bounds[1:]) if b > a])


# --- the paged hybrid equals the reference ----------------------------------------------------------------------

def test_groups_are_vllms_uniform_groups():
    # Gemma-3-270m: 15 sliding layers, 3 full -> groups of 3; the full group first (it anchors the prefix cache)
    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(18)]
    groups = group_layers(windows)
    assert groups[0] == (None, (5, 11, 17)) and len(groups) == 6
    assert sorted(layer for _, g in groups for layer in g) == list(range(18)) and {len(g) for _, g in groups} == {3}
    # 5 sliding, 2 full: groups of 2, the last sliding group one layer short (vLLM pads it)
    assert group_layers([4, 4, None, 4, 4, None, 4]) == [(None, (2, 5)), (4, (0, 4)), (4, (1, 6)), (4, (3,))]


def with_options(model, softcap: float | None, sinks: bool):
    """``model`` with Gemma 2's per-tile soft-cap and/or gpt-oss's learned sinks (one logit per query head, O(1))."""
    c, w = model.config, model.weights
    layers = [replace(lw, sinks=np.random.default_rng(i).normal(0, 1, c.num_heads) if sinks else None)
              for i, lw in enumerate(w.layers)]
    return Model(replace(c, attn_softcap=softcap, sinks=sinks), replace(w, layers=layers), dtype=model.dtype)


@pytest.mark.parametrize("softcap, sinks", [(2.0, False), (None, True), (1.5, True)])
@pytest.mark.parametrize("window, block_size", [(T - 1, 5), (T + 1, 3), (4, 3)])
def test_paged_hybrid_applies_sinks_and_softcap(window, block_size, softcap, sinks):
    """gpt-oss's sinks and Gemma 2's soft-cap reach the sliding and the full groups of the paged hybrid (block
    sizes that do not divide the window): it equals the masked reference and the contiguous hybrid cache."""
    model = with_options(gemma(window, seed=window), softcap, sinks)
    a = ids(T, seed=4)
    want = model.logits(a)
    assert rel_err(want, with_options(model, None, False).logits(a)) > 1e-3  # the options show in the logits
    cache = paged(model, block_size)
    cache.add_sequence(0)
    assert_close(feed(model, cache, 0, a, [5, 6, 11]), want, np.float64, what="paged hybrid")
    contiguous = make_cache("contiguous", model, T)
    contiguous.add_sequence(0)
    assert_close(feed(model, contiguous, 0, a, [5, 6, 11]), want, np.float64, what="contiguous hybrid")


@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("window", [1, 4, T - 1, T, T + 1])
def test_paged_hybrid_equals_the_sliding_reference(window, block_size):
    model = gemma(window, seed=window)
    cache = paged(model, block_size)
    a, b = ids(T, seed=2), ids(9, seed=3)
    cache.add_sequence("a")
    cache.add_sequence("b")
    got_a, got_b = [], []
    for (ta, tb) in [((0, 6), (0, 2)), ((6, 7), (2, 3)), ((7, 11), (3, 9)), ((11, 12), None), ((12, 13), None)]:
        seqs = ["a"] + ([] if tb is None else ["b"])
        toks = [a[slice(*ta)]] + ([] if tb is None else [b[slice(*tb)]])
        out = model.forward(toks, cache, seqs, all_logits=True)
        got_a.append(out[:len(toks[0])])
        if tb is not None:
            got_b.append(out[len(toks[0]):])
    assert_close(np.concatenate(got_a), model.logits(a), np.float64, what=f"a, window {window}, bs {block_size}")
    assert_close(np.concatenate(got_b), model.logits(b), np.float64, what=f"b, window {window}, bs {block_size}")
    cache.blocks.check()


@pytest.mark.parametrize("window, block_size", [(3, 2), (4, 1), (2, 5)])
def test_blocks_that_left_every_window_go_back_to_the_pool(window, block_size):
    model = gemma(window)
    cache = paged(model, block_size, num_blocks=300)  # room for every released block to stay cached
    tokens = ids(40)
    cache.add_sequence(0, tokens)
    feed(model, cache, 0, tokens, [17, *range(18, 40)])
    stats = cache.memory_stats()
    full, *sliding = stats["groups"]
    assert full["blocks"] == -(-40 // block_size)  # a full group keeps every token
    floor = 40 - (window - 1)                       # a sliding group keeps the W - 1 newest positions
    for g in sliding:
        assert g["blocks"] == -(-40 // block_size) - floor // block_size
        assert g["slots_used"] == window - 1
    assert stats["blocks_in_use"] == sum(g["blocks"] for g in stats["groups"])
    assert stats["cached_free_blocks"] == sum(floor // block_size for _ in sliding)  # registered: still hit-able
    cache.free_sequence(0)
    assert cache.blocks.num_free == 300
    cache.blocks.check()


def test_a_step_that_does_not_fit_changes_no_group():
    model = gemma(3)
    cache = paged(model, block_size=2, num_blocks=9)
    cache.add_sequence(0)
    feed(model, cache, 0, ids(4), [])
    free = cache.blocks.num_free
    with pytest.raises(Exception, match="blocks"):
        model.forward([ids(12, seed=5)], cache, [0])
    assert cache.blocks.num_free == free and all(c.length(0) == 4 for _, c in cache.groups)
    cache.blocks.check()


# --- prefix caching: a sliding group needs only the blocks of its window ----------------------------------------

def shared_then_hit(sliding_rule: bool, filler: int):
    """Run prompt A (32 tokens, window 4, block size 2) and free it; a filler of ``filler`` tokens evicts the
    least recently freed blocks (the sliding groups' oldest); then B shares A's first 26 tokens. Returns
    (model, cache, B, tokens B found cached)."""
    model = gemma(4, seed=7)
    cache = paged(model, block_size=2, num_blocks=16 + 3 * 2 + 3 * 16, sliding_rule=sliding_rule)
    a = ids(32, seed=8)
    cache.add_sequence("a", a)
    feed(model, cache, "a", a, [])
    cache.free_sequence("a")
    if filler:
        cache.add_sequence("filler")
        model.forward([ids(filler, seed=9)], cache, ["filler"])
    b = a[:26] + ids(5, seed=10)
    return model, cache, b, cache.add_sequence("b", b)


def test_a_hit_reuses_only_the_window_blocks_and_equals_a_run_without_it():
    """Today's rule (step 6: blocks filled after the first eviction are never shared; a hit needs every block
    from 0) finds nothing; the sliding-group rule hits 26 tokens although the sliding groups' first blocks are gone."""
    model, cache, b, hit = shared_then_hit(sliding_rule=True, filler=4)
    assert hit == 26
    described = cache.blocks.prefix_hit(b[:26] + [0]).describe(2)
    assert described[0].startswith("blocks 0..12 reused")
    assert described[1].startswith("blocks 11..12 reused, blocks 0..10 not needed")
    got = model.forward([b[hit:]], cache, ["b"], all_logits=True)
    fresh = paged(model, block_size=2, enable_prefix_caching=False)
    fresh.add_sequence("b")
    want = feed(model, fresh, "b", b, [])
    assert_close(got, want[hit:], np.float64, what="after the hit vs without it")
    assert_close(got, model.logits(b)[hit:], np.float64)
    cache.blocks.check()
    _, _, _, old_rule = shared_then_hit(sliding_rule=False, filler=4)
    assert old_rule == 0


def test_a_hit_shrinks_to_the_longest_window_still_cached():
    model, cache, b, _ = shared_then_hit(sliding_rule=True, filler=0)
    cache.free_sequence("b")
    hit = cache.blocks.prefix_hit(b)
    assert hit.tokens == 26
    # evict the blocks of B's window in one sliding group: the hit moves back to where a window is whole
    group = cache.groups[1][1].blocks
    lost = hit.tables[1][12]
    group.allocator.drop(lost)
    shorter = cache.blocks.prefix_hit(b)
    assert shorter.tokens < 26 and all(lost not in t for t in shorter.tables)
    cache.add_sequence("c", b)
    got = model.forward([b[shorter.tokens:]], cache, ["c"], all_logits=True)
    assert_close(got, model.logits(b)[shorter.tokens:], np.float64)


def test_a_shared_prefix_under_the_scheduler_equals_greedy_alone():
    model = gemma(4, seed=11)
    system = ids(20, seed=12)
    requests = [Request(i, system + ids(3 + i, seed=20 + i), 16) for i in range(8)]
    cache = paged(model, block_size=2, num_blocks=96)  # the longest request may hold 4 groups x 22 blocks
    sched = Scheduler(model, cache, max_num_seqs=6)
    out = sched.run(requests)
    for r in requests:
        alone = generate(model, r.prompt_ids, 16, cache="contiguous").token_ids
        assert out[r.id] == alone, r.id
    assert sched.stats.prefix_hit_tokens > 0 and sched.stats.preemptions > 0
    assert cache.blocks.num_free == 96
    cache.blocks.check()


def test_the_scheduler_refuses_swap_and_requests_that_never_fit():
    model = gemma(4)
    with pytest.raises(ConfigError, match="host pool"):
        Scheduler(model, paged(model), preemption="swap")
    cache = paged(model, block_size=2, num_blocks=10)
    with pytest.raises(Exception, match="blocks"):
        Scheduler(model, cache).add_request(Request(0, ids(30), 4))
    with pytest.raises(ConfigError, match="host pool"):
        cache.swap_out(0)


# --- rollback: W + K slots ------------------------------------------------------------------------------------

def rollback_script(model, cache, k: int, seed: int = 0) -> list:
    """Verify-like steps after the rings wrapped: 1 + j tokens, then j or fewer taken back (j <= K).
    Returns the token list the cache holds at the end; checks every step's logits against the reference."""
    rng = np.random.default_rng(seed)
    kept = ids(15, seed=seed)
    cache.add_sequence(0)
    feed(model, cache, 0, kept, [6, 9])
    for _ in range(8):
        j = int(rng.integers(0, k + 1))
        step = rng.integers(0, 97, 1 + j).tolist()
        got = model.forward([step], cache, [0], all_logits=True)
        assert_close(got, model.logits(kept + step)[-len(step):], np.float64)
        back = int(rng.integers(0, j + 1))
        cache.truncate(0, cache.length(0) - back)
        kept += step[:len(step) - back]
    return kept


@pytest.mark.parametrize("layout", ["contiguous", "paged-1", "paged-3"])
@pytest.mark.parametrize("window, k", [(2, 3), (5, 2), (4, 4)])
def test_truncate_by_up_to_k_is_exact_after_the_ring_wrapped(layout, window, k):
    model = gemma(window, seed=window + k)
    c = model.config
    cache = (hybrid_cache("contiguous", c.layer_windows, c.num_kv_heads, c.head_dim, 64, 1, np.float64, rollback=k)
             if layout == "contiguous" else paged(model, int(layout[-1]), rollback=k))
    kept = rollback_script(model, cache, k, seed=window)
    assert cache.length(0) == len(kept)
    last = model.forward([[5]], cache, [0])
    assert_close(last[0], model.logits(kept + [5])[-1], np.float64)


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_truncate_beyond_k_raises_naming_k_and_changes_nothing(layout):
    model = gemma(4)
    c = model.config
    cache = (hybrid_cache("contiguous", c.layer_windows, c.num_kv_heads, c.head_dim, 64, 1, np.float64, rollback=2)
             if layout == "contiguous" else paged(model, 2, rollback=2))
    tokens = ids(20)
    cache.add_sequence(0)
    feed(model, cache, 0, tokens, [10])
    free = cache.blocks.num_free if layout == "paged" else None
    with pytest.raises(RollbackError, match=r"K=2"):
        cache.truncate(0, 17)
    cache.truncate(0, 19)
    with pytest.raises(RollbackError, match=r"K=2"):  # K is what the ring holds, not what one call takes
        cache.truncate(0, 17)
    assert all(g.length(0) == 19 for _, g in cache.groups)
    if layout == "paged":
        assert cache.blocks.num_free >= free
        cache.blocks.check()
    assert_close(model.forward([[3]], cache, [0])[0], model.logits(tokens[:19] + [3])[-1], np.float64)


@pytest.mark.parametrize("cache_kind", ["contiguous", "paged"])
def test_speculative_decoding_on_a_hybrid_model_equals_greedy(cache_kind):
    model = gemma(3, seed=4)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 9, 5, 6]
    spec = generate(model, prompt, 24, cache=cache_kind, speculative="ngram", draft_len=3, block_size=2)
    plain = generate(model, prompt, 24, cache="none").token_ids
    assert spec.token_ids == plain and spec.speculative.accepted > 0
    kv = make_cache(cache_kind, model, 40, rollback=3)
    assert all(getattr(g, "policy", None) is None or g.policy.rollback == 3 for _, g in kv.groups)


# --- combinations with the other steps ------------------------------------------------------------------------

def test_an_evicting_full_group_equals_its_masked_recompute():
    """A StreamingLLM window on the full layers (step 6) beside the model's own sliding windows: equal to one
    pass that masks the sliding layers by their window and the full layers by what the eviction logged."""
    from minikv.hybrid import HybridKVCache, SlidingNoCache
    from minikv.window.reference import MaskedRecompute

    model = gemma(3, seed=5)
    c = model.config
    cache = make_cache("window", model, 40, eviction=dict(window=6, sinks=2, log=True))
    tokens = ids(24)
    cache.add_sequence(0)
    got = feed(model, cache, 0, tokens, [9, *range(10, 24)])
    (sliding, _), (full, evicting) = cache.groups
    ref = HybridKVCache([(sliding, SlidingNoCache([3] * len(sliding), c.num_kv_heads, c.head_dim, np.float64)),
                         (full, MaskedRecompute(len(full), c.num_kv_heads, c.head_dim, evicting.evicted_at(0),
                                                dtype=np.float64))], c.num_kv_heads, c.head_dim, np.float64)
    assert_close(got, model.forward([tokens], ref, all_logits=True), np.float64)
    with pytest.raises(RollbackError):
        cache.truncate(0, 20)


def test_a_quantized_full_group_keeps_the_sliding_layers_exact():
    model = gemma(3, seed=6, head_dim=32)
    tokens = ids(30)
    runs = {}
    for name, options in (("int8", dict(kv_dtype="int8")), ("plain", {})):
        cache = make_cache("paged", model, 40, **options)
        cache.add_sequence(0)
        runs[name] = feed(model, cache, 0, tokens, [12, *range(13, 30)])
    assert type(make_cache("paged", model, 40, kv_dtype="int8").groups[1][1]).__name__ == "QuantizedPagedKVCache"
    exact = model.logits(tokens)
    assert_close(runs["plain"], exact, np.float64)
    err = np.abs(runs["int8"] - exact).max() / np.abs(exact).max()
    assert 1e-6 < err < 5e-2, err  # lossy, and only a little
    assert (np.argmax(runs["int8"], -1) == np.argmax(exact, -1)).mean() > 0.9


@pytest.mark.parametrize("kind, options, match", [
    ("window", dict(eviction=dict(window=8, positions="in-cache")), "in-cache"),
    ("contiguous", dict(eviction=dict(window=8)), "eviction"),
    ("contiguous", dict(kv_dtype="int8"), "paged"),
])
def test_combinations_that_make_no_sense_are_typed_errors(kind, options, match):
    with pytest.raises((ConfigError, InvalidInputError), match=match):
        make_cache(kind, gemma(3), 40, **options)
    with pytest.raises(ConfigError, match="none"):
        hybrid_cache("none", [3, None], 1, 4, full_group=lambda n: None)
