"""The paged evicting cache: equal to the contiguous one and to the masked recompute, blocks given back,
prefix sharing that never hands out K/V computed under eviction, fork, swap, typed errors."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minikv.bench.equivalence import assert_close
from minikv.errors import ConfigError, InvalidInputError, OutOfBlocksError
from minikv.paged import PagedKVCache, num_blocks_for
from minikv.scheduler import Request, Scheduler
from minikv.weights.random_models import random_model
from minikv.window import (
    HOLE,
    EvictingKVCache,
    H2OPolicy,
    MaskedRecompute,
    PagedEvictingKVCache,
    SnapKVPolicy,
    WindowPolicy,
)

MODEL = random_model(dtype=np.float64, seed=1)
ROPE = (MODEL.cos, MODEL.sin, MODEL.config.rope_layout)
IDS = np.random.default_rng(0).integers(0, 100, 28)

# (policy, multi-token prefill length): each prefill already evicts
POLICIES = {
    "window": (WindowPolicy(8), 12),
    "sinks-original": (WindowPolicy(8, 2), 12),
    "sinks-in-cache": (WindowPolicy(8, 2, "in-cache"), 12),
    "h2o-raw": (H2OPolicy(10, 3), 15),
    "h2o-normalized": (H2OPolicy(10, 3, "normalized"), 15),
    "snapkv": (SnapKVPolicy(12, 4, kernel=3), 20),
}


def paged(policy, block_size: int, num_blocks: int = 64, **kw) -> PagedEvictingKVCache:
    return PagedEvictingKVCache(**MODEL.new_cache_args(), num_blocks=num_blocks, block_size=block_size,
                                policy=policy, dtype=np.float64, rope=ROPE, **kw)


def feed(cache, ids, prefill: int, check=None) -> np.ndarray:
    """Prefill ``ids[:prefill]``, then decode the rest one token at a time; all logits [n, V]."""
    cache.add_sequence(0)
    outs = [MODEL.forward([ids[:prefill]], cache, all_logits=True)]
    for t in range(prefill, len(ids)):
        outs.append(MODEL.forward([ids[t:t + 1]], cache))
        if check is not None:
            check()
    return np.concatenate(outs)


def recompute(cache, seq_id, ids) -> np.ndarray:
    ref = MaskedRecompute(**MODEL.new_cache_args(), evicted_at=cache.evicted_at(seq_id),
                          positions=cache.policy.positions, rope=ROPE, dtype=np.float64)
    return MODEL.forward([ids], ref, all_logits=True)


@pytest.mark.parametrize("block_size", [1, 3, 4])
@pytest.mark.parametrize("multi", [False, True], ids=["prefill1", "prefill-many"])
@pytest.mark.parametrize("name", list(POLICIES))
def test_equals_contiguous_and_masked_recompute(name, multi, block_size):
    policy, many = POLICIES[name]
    prefill = many if multi else 1
    contiguous = EvictingKVCache(**MODEL.new_cache_args(), policy=policy, dtype=np.float64, rope=ROPE)
    want = feed(contiguous, IDS, prefill)
    cache = paged(policy, block_size)
    got = feed(cache, IDS, prefill)
    assert_close(got, want, np.float64, what=f"{name} paged vs contiguous")
    assert_close(got, recompute(cache, 0, IDS), np.float64, what=f"{name} paged vs masked recompute")
    assert np.array_equal(cache.evicted_at(0), contiguous.evicted_at(0))
    for layer in range(MODEL.config.num_layers):
        for a, b in zip(cache.kept_positions(0, layer), contiguous.kept_positions(0, layer)):
            assert np.array_equal(a, b)
    assert cache.bytes_used() == contiguous.bytes_used()  # one sequence: the same kept (layer, head, token)s
    cache.blocks.allocator.check()


def test_a_batched_step_equals_each_sequence_alone():
    policy = WindowPolicy(6, 1)
    cache = paged(policy, 3)
    for sid in (0, 1):
        cache.add_sequence(sid)
    a, b = IDS[:20], IDS[5:]
    got = [MODEL.forward([a[:7], b[:2]], cache, all_logits=True)]
    for t in range(13):
        got.append(MODEL.forward([a[7 + t:8 + t], b[2 + t:3 + t]], cache))
    got = np.concatenate(got)
    alone_a, alone_b = feed(paged(policy, 3), a, 7), feed(paged(policy, 3), b[:15], 2)
    assert_close(got[np.r_[0:7, 9:got.shape[0]:2]], alone_a, np.float64)
    assert_close(got[np.r_[7:9, 10:got.shape[0]:2]], alone_b, np.float64)


# -- blocks go back to the pool -------------------------------------------------------------------


def test_window_blocks_return_to_the_allocator():
    cache = paged(WindowPolicy(8), 4, num_blocks=16)
    free, in_use = [], []

    def check():
        free.append(cache.blocks.num_free)
        in_use.append(cache.memory_stats()["blocks_in_use"])
        cache.blocks.allocator.check()

    feed(cache, np.tile(IDS, 3), 1, check)
    # 8 keys span at most 3 blocks of 4, and the step's new token may open a fourth
    assert max(in_use) <= 3 and in_use[-1] <= 3
    assert any(f2 > f1 for f1, f2 in zip(free, free[1:])), "no block ever came back"
    table = cache.blocks.table(0)
    assert (table == HOLE).sum() == len(table) - in_use[-1]
    assert cache.memory_stats()["slots_used"] == 8 - 1  # the window minus the next token's own slot
    with pytest.raises(InvalidInputError, match="gave blocks back"):
        cache.read_kv(0, 0)


def test_a_pool_smaller_than_the_text_but_larger_than_the_window_runs_to_the_end():
    text = np.tile(IDS, 3)  # 84 tokens = 21 blocks of 4; the pool has 4
    with pytest.raises(OutOfBlocksError):
        feed(PagedKVCache(**MODEL.new_cache_args(), num_blocks=4, block_size=4, dtype=np.float64), text, 1)
    cache = paged(WindowPolicy(8, 1), 4, num_blocks=4)
    got = feed(cache, text, 1)
    assert got.shape[0] == text.size and cache.length(0) == text.size
    assert_close(got, recompute(cache, 0, text), np.float64)


def test_swap_out_and_in_keeps_the_holes_and_the_logits():
    policy = WindowPolicy(6, 1)
    want = feed(paged(policy, 2), IDS, 3)
    cache = paged(policy, 2, num_host_blocks=16)
    cache.add_sequence(0)
    got = [MODEL.forward([IDS[:3]], cache, all_logits=True)]
    for t in range(3, IDS.size):
        if t in (12, 20):
            holes = cache.blocks.table(0) == HOLE
            assert holes.any()
            cache.swap_out(0)
            assert cache.blocks.num_free == cache.num_blocks
            assert np.array_equal(cache.blocks.host_table(0) == HOLE, holes)
            cache.swap_in(0)
            assert np.array_equal(cache.blocks.table(0) == HOLE, holes)
        got.append(MODEL.forward([IDS[t:t + 1]], cache))
    assert_close(np.concatenate(got), want, np.float64)
    cache.blocks.allocator.check()


def test_fork_shares_blocks_and_eviction_drops_only_its_own_reference():
    cache = paged(WindowPolicy(6), 2)
    cache.add_sequence("p")
    MODEL.forward([IDS[:9]], cache, seq_ids=["p"])
    cache.fork("p", "c")
    shared = [b for b in cache.blocks.table("p") if b != HOLE]
    assert all(cache.blocks.allocator.ref_count(b) == 2 for b in shared)
    for t in range(9, 16):  # the child alone slides on: its old blocks lose one reference each
        MODEL.forward([IDS[t:t + 1]], cache, seq_ids=["c"])
    assert all(cache.blocks.allocator.ref_count(b) == 1 for b in shared if b not in cache.blocks.table("c"))
    parent = MODEL.forward([IDS[9:12]], cache, seq_ids=["p"], all_logits=True)
    alone = paged(WindowPolicy(6), 2)
    want = feed(alone, IDS[:12], 9)
    assert_close(parent, want[9:], np.float64)
    assert np.array_equal(cache.evicted_at("p"), alone.evicted_at(0))


def test_the_scheduler_runs_more_with_a_window_and_each_request_gets_its_own_tokens():
    prompts = [np.random.default_rng(i).integers(0, 100, 10).tolist() for i in range(6)]
    policy = WindowPolicy(8, 1)

    def run(cache, ids):
        sched = Scheduler(MODEL, cache)
        return sched.run([Request(i, prompts[i], 20) for i in ids]), sched.stats

    window, stats = run(paged(policy, 4, num_blocks=12), range(6))
    _, full_stats = run(PagedKVCache(**MODEL.new_cache_args(), num_blocks=12, block_size=4, dtype=np.float64), range(6))
    assert stats.preemptions < full_stats.preemptions and stats.steps < full_stats.steps
    for i in range(6):  # a window's outputs depend on positions only, so batching and recompute change nothing
        assert window[i] == run(paged(policy, 4, num_blocks=12), [i])[0][i]


def test_the_scheduler_admits_a_request_longer_than_the_pool_under_a_window():
    """A window returns blocks as it slides, so admission bounds the blocks held at once, not the length."""
    from minikv.errors import CacheFullError

    prompt = np.random.default_rng(9).integers(0, 100, 6).tolist()
    window = paged(WindowPolicy(8, 1), 4, num_blocks=6)                    # 6 blocks = 24 slots
    assert window.peak_blocks(6, 6 + 40 - 1) == 5 < num_blocks_for(45, 4)  # sinks 1 + span 2 + 1 + the open one
    out = Scheduler(MODEL, window).run([Request("long", prompt, 40)])["long"]
    assert len(out) == 40 and window.blocks.num_free == 6
    alone = paged(WindowPolicy(8, 1), 4, num_blocks=20)
    assert out == Scheduler(MODEL, alone).run([Request("long", prompt, 40)])["long"]
    full = PagedKVCache(**MODEL.new_cache_args(), num_blocks=6, block_size=4, dtype=np.float64)
    with pytest.raises(CacheFullError, match="blocks"):
        Scheduler(MODEL, full).add_request(Request("long", prompt, 40))


# -- prefix sharing ----------------------------------------------------------------------------------


@pytest.mark.parametrize("positions", ["original", "in-cache"])
def test_a_prefix_hit_gives_the_same_logits_and_stops_at_the_first_eviction(positions):
    policy = WindowPolicy(8, 2, positions)
    cache = paged(policy, 2)
    cache.add_sequence("a", IDS[:20])
    MODEL.forward([IDS[:20]], cache, seq_ids=["a"])  # evicts in its prompt step: shares nothing
    assert cache.add_sequence("b", IDS[:20]) == 0
    cache.add_sequence("c", IDS[:5])
    MODEL.forward([IDS[:5]], cache, seq_ids=["c"])  # no eviction: its 2 full blocks are shared
    for t in range(5, 14):
        cache.blocks.extend_token_ids("c", IDS[t:t + 1])
        MODEL.forward([IDS[t:t + 1]], cache, seq_ids=["c"])
    # c first evicted when it fed token 7 (8 = W tokens): blocks full before that step are shared
    assert cache.blocks.state("c").num_registered == 7 // 2
    hit = cache.add_sequence("d", IDS[:24])
    assert hit == 6
    got = MODEL.forward([IDS[hit:24]], cache, seq_ids=["d"], all_logits=True)
    want = feed(paged(policy, 2, enable_prefix_caching=False), IDS[:24], 24)
    assert_close(got, want[hit:], np.float64)
    assert_close(got, recompute(cache, "d", IDS[:24])[hit:], np.float64)


@pytest.mark.parametrize("policy", [H2OPolicy(8), SnapKVPolicy(8, 2)], ids=["h2o", "snapkv"])
def test_score_based_policies_refuse_prefix_caching(policy):
    with pytest.raises(ConfigError, match="scores"):
        paged(policy, 4, enable_prefix_caching=True)
    assert not paged(policy, 4).blocks.allocator.enable_prefix_caching  # off by default for them
    assert paged(WindowPolicy(8), 4).blocks.allocator.enable_prefix_caching


def test_typed_config_errors():
    with pytest.raises(ConfigError, match="policy"):
        PagedEvictingKVCache(**MODEL.new_cache_args(), num_blocks=8)
    with pytest.raises(ConfigError, match="rope"):
        PagedEvictingKVCache(**MODEL.new_cache_args(), num_blocks=8, policy=WindowPolicy(4, 1, "in-cache"))
    with pytest.raises(ConfigError, match="log=False"):
        c = paged(WindowPolicy(4), 2, log=False)
        c.add_sequence(0)
        c.evicted_at(0)


# -- the property test: steps, forks and frees with prefix caching on ---------------------------------

BASES = [IDS[:22], np.concatenate([IDS[:6], IDS[12:28]])]  # two texts sharing their first 6 tokens


def _full_kv(text) -> list:
    """K of every layer of a never-evicting run over ``text``: [L] of [n, Hkv, D]."""
    ref = PagedKVCache(**MODEL.new_cache_args(), num_blocks=32, block_size=1, dtype=np.float64)
    ref.add_sequence(0)
    MODEL.forward([text], ref)
    return [ref.read_kv(0, layer)[0] for layer in range(MODEL.config.num_layers)]


FULL_K = [_full_kv(b) for b in BASES]


def _check_invariants(cache) -> None:
    alloc, bs = cache.blocks.allocator, cache.block_size
    alloc.check()
    held = Counter(b for sid in cache.seq_ids() for b in cache.blocks.table(sid).tolist() if b != HOLE)
    assert all(alloc.ref_count(b) == held.get(b, 0) for b in range(alloc.num_blocks)), "ref counts drifted"
    # What a prefix hit can hand out is exact: every block that matching a base text reaches holds the
    # K of a never-evicting run over that text (so no K/V computed under eviction entered the cache).
    for base, full in zip(BASES, FULL_K):
        for j, bid in enumerate(alloc.match(base)):
            for layer, k in enumerate(full):
                assert np.allclose(cache.k_pool[layer, bid], k[j * bs:(j + 1) * bs], rtol=1e-10, atol=1e-12), \
                    f"prefix block {bid} (chain index {j}) holds K that a full run would not compute"
    # and the bookkeeping form: a sequence registers nothing from the block of its first evicting step on
    for sid in cache.seq_ids():
        limit = cache.blocks.share_limit.get(sid)
        assert limit is None or cache.blocks.state(sid).num_registered <= limit


OPS = st.lists(st.tuples(st.sampled_from(["new", "step", "step", "fork", "free"]), st.integers(0, 99)),
               min_size=3, max_size=20)


@settings(max_examples=50, deadline=None)
@given(ops=OPS, block_size=st.sampled_from([2, 3]))
def test_random_steps_forks_and_frees_keep_the_cache_exact(ops, block_size):
    policy = WindowPolicy(6, 1)
    cache = paged(policy, block_size, num_blocks=48)
    shadow = EvictingKVCache(**MODEL.new_cache_args(), policy=policy, dtype=np.float64, rope=ROPE, max_seqs=64)
    live: dict = {}  # seq id -> [base text, prompt length, tokens fed]
    for n, (op, x) in enumerate(ops):
        if op == "new" and len(live) < 4:
            base = BASES[x % 2]
            prompt = base[:2 + x % 11]
            hit = cache.add_sequence(n, prompt)
            got = MODEL.forward([prompt[hit:]], cache, seq_ids=[n], all_logits=True)
            shadow.add_sequence(n)
            want = MODEL.forward([prompt], shadow, seq_ids=[n], all_logits=True)
            assert_close(got, want[hit:], np.float64, what=f"prompt of {prompt.size} with a hit of {hit}")
            live[n] = [x % 2, prompt.size, prompt.size]
        elif op == "step" and live:
            sids = [s for s in live if live[s][2] < BASES[live[s][0]].size]
            if not sids:
                continue
            toks = [BASES[live[s][0]][live[s][2]:live[s][2] + 1] for s in sids]
            for s, t in zip(sids, toks):
                cache.blocks.extend_token_ids(s, t)
                live[s][2] += 1
            assert_close(MODEL.forward(toks, cache, seq_ids=sids), MODEL.forward(toks, shadow, seq_ids=sids),
                         np.float64, what="a batched decode step")
        elif op == "fork" and live and len(live) < 4:
            parent = sorted(live)[x % len(live)]
            cache.fork(parent, n)
            b, p, fed = live[parent]
            shadow.add_sequence(n)  # the contiguous cache cannot fork: replay the parent's steps
            MODEL.forward([BASES[b][:p]], shadow, seq_ids=[n])
            for t in range(p, fed):
                MODEL.forward([BASES[b][t:t + 1]], shadow, seq_ids=[n])
            live[n] = [b, p, fed]
            assert np.array_equal(cache.evicted_at(n), shadow.evicted_at(n))
        elif op == "free" and live:
            sid = sorted(live)[x % len(live)]
            cache.free_sequence(sid)
            shadow.free_sequence(sid)
            del live[sid]
        _check_invariants(cache)
