"""Step 3b: continuous batching gives every request the tokens it would get alone, under any memory pressure."""

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from minikv.bench.workloads import ReserveMaxLen, Workload, batching_benchmark, format_benchmark
from minikv.errors import CacheFullError, ConfigError, InvalidInputError
from minikv.kv_cache import ContiguousKVCache
from minikv.paged import PagedKVCache
from minikv.scheduler import Request, Scheduler
from minikv.weights.random_models import random_model

# float64: a different batch composition changes float32 rounding and could flip a near tie;
# in float64 the greedy tokens must match exactly (DESIGN.md section 3)
MODEL = random_model(num_layers=2, hidden_size=24, num_heads=4, num_kv_heads=2, head_dim=6, intermediate_size=40,
                     vocab_size=53, max_position=256, seed=12, dtype=np.float64)
BS = 4


def make_requests(n, seed=0, prompt=(1, 14), new=(1, 12), shared=0):
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 53, shared).tolist()
    return [Request(f"r{i}", system + rng.integers(0, 53, int(rng.integers(*prompt))).tolist(),
                    int(rng.integers(*new))) for i in range(n)]


def scheduler(num_blocks, preemption="recompute", host=0, prefix=True, **kw):
    cache = PagedKVCache(**MODEL.new_cache_args(), num_blocks=num_blocks, block_size=BS, dtype=np.float64,
                         num_host_blocks=host, enable_prefix_caching=prefix)
    cache.k_pool[:] = np.nan  # stale slots must never leak into any request
    cache.v_pool[:] = np.nan
    return Scheduler(MODEL, cache, preemption=preemption, **kw)


def greedy_alone(request):
    """The request run alone on a contiguous cache: the reference every batched run must reproduce."""
    cache = ContiguousKVCache(**MODEL.new_cache_args(), max_seqs=1, max_len=256, dtype=np.float64)
    cache.add_sequence(0)
    logits = MODEL.forward([request.prompt_ids], cache)[0]
    out = []
    while True:
        out.append(int(np.argmax(logits)))
        if len(out) == request.max_new_tokens or out[-1] == request.eos_token_id:
            return out
        logits = MODEL.forward([[out[-1]]], cache)[0]


REQUESTS = make_requests(12, seed=1)
UNLIMITED = scheduler(num_blocks=200).run(REQUESTS)


def test_unlimited_run_equals_each_request_alone():
    assert set(UNLIMITED) == {r.id for r in REQUESTS}
    for r in REQUESTS:
        assert UNLIMITED[r.id] == greedy_alone(r)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("num_blocks", [7, 12])
def test_preemption_under_pressure_changes_no_output(preemption, num_blocks):
    s = scheduler(num_blocks, preemption, host=40)
    got = s.run(REQUESTS)
    assert got == UNLIMITED  # same tokens, and no request lost
    assert s.stats.preemptions > 0  # the pool really was too small
    if preemption == "swap":
        assert s.stats.preemptions_swap > 0 and s.stats.swap_ins == s.stats.preemptions_swap
    else:
        assert s.stats.preemptions_swap == 0
    assert s.cache.blocks.num_free == num_blocks  # every block came back
    assert s.stats.finished == len(REQUESTS) and not s.has_work()


def test_swap_falls_back_to_recompute_when_the_host_pool_is_full():
    s = scheduler(7, "swap", host=2)
    assert s.run(REQUESTS) == UNLIMITED
    assert s.stats.preemptions_recompute > 0
    assert s.cache.blocks.host_allocator.num_free == 2


class Spy:
    """The model, recording how many tokens each sequence brings to every forward pass."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return getattr(MODEL, name)

    def forward(self, tokens, cache, seq_ids=None, all_logits=False, then=None):
        self.calls.append([len(t) for t in tokens])
        return MODEL.forward(tokens, cache, seq_ids, all_logits, then)


def test_prefill_and_decode_share_a_forward_pass():
    s = scheduler(200)
    s.model = spy = Spy()
    reqs = make_requests(6, seed=2, prompt=(3, 9), new=(4, 8))
    for r in reqs[:3]:
        s.add_request(r)
    s.step()  # three prefills
    for r in reqs[3:]:
        s.add_request(r)
    while s.has_work():
        s.step()
    assert any(max(c) > 1 and min(c) == 1 for c in spy.calls)  # a step mixing prefill and decode
    assert {rid: s.output(rid) for rid in s.finished} == {r.id: greedy_alone(r) for r in reqs}


def test_chunked_prefill_respects_the_token_budget():
    s = scheduler(200, max_step_tokens=5)
    s.model = spy = Spy()
    reqs = make_requests(5, seed=3, prompt=(6, 14), new=(2, 6))
    assert s.run(reqs) == {r.id: greedy_alone(r) for r in reqs}
    assert max(sum(c) for c in spy.calls) <= 5
    assert any(sum(c) == 5 for c in spy.calls)  # prompts were split to fill the budget


def test_prefix_sharing_in_the_scheduler():
    reqs = make_requests(8, seed=4, shared=9, prompt=(1, 6), new=(2, 6))  # 9-token system prompt: 2 blocks
    plain = scheduler(200, prefix=False)
    shared = scheduler(200, max_num_seqs=1)  # one at a time: later requests find the system prompt cached
    assert shared.run(reqs) == plain.run(reqs)
    assert plain.stats.prefix_hit_tokens == 0
    assert shared.stats.prefix_hit_tokens == 8 * (len(reqs) - 1)
    assert shared.stats.forward_tokens < plain.stats.forward_tokens


def test_eos_stops_a_request():
    r = REQUESTS[0]
    full = UNLIMITED[r.id]
    assert len(full) >= 3
    eos = full[1]
    stop = full.index(eos) + 1
    got = scheduler(200).run([Request("e", r.prompt_ids, r.max_new_tokens, eos_token_id=eos)])
    assert got["e"] == full[:stop]


def test_sample_fn_hook():
    picks = []

    def always_seven(logits, request):
        picks.append(request.id)
        assert logits.shape == (MODEL.config.vocab_size,)
        return 7

    got = scheduler(200, sample_fn=always_seven).run(REQUESTS[:3])
    assert all(out == [7] * r.max_new_tokens for r, out in zip(REQUESTS[:3], got.values(), strict=True))
    assert len(picks) == sum(r.max_new_tokens for r in REQUESTS[:3])


def test_contiguous_policy_reserves_max_len():
    s = scheduler(24, policy=ReserveMaxLen(32))  # 24 blocks of 4 / 8 blocks per sequence = 3 at once
    assert s.policy.slots == 3
    assert s.run(REQUESTS) == UNLIMITED
    assert s.stats.max_concurrency == 3 and s.stats.preemptions == 0
    assert 0 < s.stats.utilization < 0.5  # short requests in 32-token slabs
    paged = scheduler(24)
    paged.run(REQUESTS)
    assert paged.stats.max_concurrency > 3 and paged.stats.utilization > s.stats.utilization


@settings(max_examples=40, deadline=None, database=None)
@example(seed=193099081, num_blocks=7, preemption="swap", max_step_tokens=8, max_num_seqs=4)  # swap-in mid-chunk
@given(seed=st.integers(0, 2**31), num_blocks=st.integers(6, 16), preemption=st.sampled_from(["recompute", "swap"]),
       max_step_tokens=st.sampled_from([None, 3, 8]), max_num_seqs=st.integers(1, 6))
def test_any_pressure_any_policy_same_tokens(seed, num_blocks, preemption, max_step_tokens, max_num_seqs):
    reqs = make_requests(5, seed=seed, prompt=(1, 12), new=(1, 9), shared=int(seed % 3) * 3)
    s = scheduler(num_blocks, preemption, host=int(seed % 2) * 10 + 1, max_step_tokens=max_step_tokens,
                  max_num_seqs=max_num_seqs)
    got = s.run(reqs)
    assert got == {r.id: greedy_alone(r) for r in reqs}
    assert s.cache.blocks.num_free == num_blocks and s.cache.seq_ids() == []
    s.cache.blocks.allocator.check()


def test_bad_requests_and_settings_raise_typed_errors():
    s = scheduler(6)
    s.add_request(Request("a", [1, 2], 3))
    with pytest.raises(InvalidInputError, match="already queued"):
        s.add_request(Request("a", [1], 1))
    for bad in (Request("b", [], 3), Request("b", [1, 99], 3), Request("b", [1], 0), Request([1], [1], 1)):
        with pytest.raises(InvalidInputError):
            s.add_request(bad)
    with pytest.raises(CacheFullError, match="blocks"):
        s.add_request(Request("big", [1] * 20, 10))  # 29 tokens > 6 blocks of 4
    with pytest.raises(InvalidInputError, match="max_position"):
        scheduler(200).add_request(Request("long", [1] * 250, 10))
    with pytest.raises(CacheFullError, match="reserve_len"):
        scheduler(200, policy=ReserveMaxLen(8)).add_request(Request("c", [1] * 6, 4))
    with pytest.raises(ConfigError):
        scheduler(6, preemption="drop")
    with pytest.raises(ConfigError, match="host pool"):
        scheduler(6, preemption="swap", host=0)
    with pytest.raises(ConfigError):
        scheduler(6, max_num_seqs=0)
    with pytest.raises(ConfigError):
        scheduler(6, policy=ReserveMaxLen(100))  # one slab is larger than the pool
    with pytest.raises(ConfigError):
        Scheduler(MODEL, ContiguousKVCache(**MODEL.new_cache_args(), max_seqs=1, max_len=8))
    with pytest.raises(InvalidInputError):
        s.output("nope")


def test_batching_benchmark_small():
    wl = Workload(num_requests=12, prompt_median=20, prompt_range=(2, 40), output_median=8, output_range=(1, 16),
                  shared_prefix_len=16, vocab_size=53, seed=1)
    model = random_model(num_layers=1, hidden_size=16, num_heads=2, num_kv_heads=1, head_dim=8,
                         intermediate_size=16, vocab_size=53, max_position=128)
    bytes_per_token = 2 * 1 * 1 * 8 * 4  # K and V, 1 layer, 1 KV head, D 8, float32
    res = batching_benchmark(wl, kv_budget_bytes=256 * bytes_per_token, block_size=4, model=model)
    assert res["budget_tokens"] == 256 and res["contiguous"]["reserve_len"] == 72
    assert res["requests_lost"] == 0
    assert res["paged"]["generated_tokens"] == res["contiguous"]["generated_tokens"]
    for side in ("paged", "contiguous"):
        assert 0 < res[side]["utilization"] <= 1
    assert res["paged"]["utilization"] > res["contiguous"]["utilization"]
    assert res["concurrency_ratio"] == res["paged"]["max_concurrency"] / res["contiguous"]["max_concurrency"]
    assert res["concurrency_ratio"] > 1
    assert res["contiguous"]["preemptions"] == 0 and res["contiguous"]["prefix_hit_rate"] == 0
    assert "concurrency ratio" in format_benchmark(res)


def test_cli_bench_batching_prints_one_json_line_last(capsys):
    import json

    from minikv.cli import main

    assert main(["bench", "batching", "--requests", "3", "--kv-budget-mib", "1", "--json"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    res = json.loads(last)
    assert {"paged", "contiguous", "concurrency_ratio"} <= set(res)
    assert {"utilization", "max_concurrency", "preemptions", "prefix_hit_rate",
            "throughput_tokens_per_s"} <= set(res["paged"])
    assert res["requests_lost"] == 0


@pytest.mark.parametrize("num_blocks", [9, 200])
def test_seeded_sampling_in_a_batch_gives_the_tokens_generate_gives_alone(num_blocks):
    """One sampler (minikv.sampling) for both loops: each request keeps its own rng, so batching,
    preemption and the order of service cannot change what a seeded request draws."""
    from minikv.generate import generate
    from minikv.sampling import SamplingParams

    reqs = [Request(f"s{i}", r.prompt_ids, r.max_new_tokens,
                    sampling=SamplingParams(temperature=1.5, top_k=20, top_p=0.95, seed=i))
            for i, r in enumerate(REQUESTS[:6])]
    ticks = []
    s = scheduler(num_blocks, progress=ticks.append)
    got = s.run(reqs)
    for r in reqs:
        assert got[r.id] == generate(MODEL, r.prompt_ids, r.max_new_tokens, sampling=r.sampling).token_ids
    assert sum(ticks) == sum(r.max_new_tokens for r in reqs) == s.stats.generated_tokens
    assert len(ticks) == s.stats.steps
    assert any(got[r.id] != UNLIMITED[REQUESTS[i].id] for i, r in enumerate(reqs))  # it did sample
    if num_blocks == 9:
        assert s.stats.preemptions > 0
    with pytest.raises(InvalidInputError, match="SamplingParams"):
        s.add_request(Request("x", [1], 1, sampling="greedy"))


class Boom(RuntimeError):
    pass


def run_through_failures(s, requests, fail_at: set) -> tuple[dict, int]:
    """Step until done; the scheduler's sampler raises on its calls numbered in ``fail_at`` (each once)."""
    for r in requests:
        s.add_request(r)
    failures = 0
    while s.has_work():
        try:
            s.step()
        except Boom:
            failures += 1
    return {rid: list(q.output) for rid, q in s.finished.items()}, failures


@pytest.mark.parametrize("num_blocks", [9, 200])
def test_a_sampler_that_raises_mid_step_loses_no_request_and_changes_no_token(num_blocks):
    """The step samples every sequence before the cache commits: a failure part-way rolls the step back, so
    the next step runs the same tokens again (today's bug: the request was lost and later ones fed twice)."""
    calls = []

    def flaky(logits, request):
        calls.append(request.id)
        if len(calls) in (5, 9, 23):  # inside batched steps: some sequences of the step already sampled
            raise Boom(f"sampler failure at call {len(calls)}")
        return int(np.argmax(logits))

    s = scheduler(num_blocks, sample_fn=flaky)
    got, failures = run_through_failures(s, REQUESTS, {5, 9, 23})
    assert failures == 3
    assert got == UNLIMITED
    assert s.cache.blocks.num_free == num_blocks and not s.running and not s.waiting


def test_a_failed_step_restores_each_seeded_rng(monkeypatch):
    """Seeded sampling through a step that fails part-way: each request's rng is put back, so the tokens are
    still the ones ``generate`` gives it alone."""
    import minikv.scheduler as sched_mod
    from minikv.generate import generate
    from minikv.sampling import SamplingParams

    reqs = [Request(f"s{i}", r.prompt_ids, r.max_new_tokens, MODEL.config.eos_token_id,  # as generate stops
                    sampling=SamplingParams(temperature=1.2, seed=i)) for i, r in enumerate(REQUESTS[:5])]
    real, calls = sched_mod.sample, []

    def flaky(logits, params, rng=None):
        tok = real(logits, params, rng)  # the draw happens (the rng moves), then the failure
        calls.append(tok)
        if len(calls) in (4, 11):
            raise Boom("after drawing")
        return tok

    monkeypatch.setattr(sched_mod, "sample", flaky)
    got, failures = run_through_failures(scheduler(200), reqs, {4, 11})
    assert failures == 2
    for r in reqs:
        assert got[r.id] == generate(MODEL, r.prompt_ids, r.max_new_tokens, sampling=r.sampling).token_ids


def test_a_sample_fn_returning_no_token_id_is_refused_before_the_step_commits():
    s = scheduler(200, sample_fn=lambda logits, request: MODEL.config.vocab_size)
    s.add_request(REQUESTS[0])
    with pytest.raises(InvalidInputError, match="sample_fn returned"):
        s.step()
    assert s.cache.length(REQUESTS[0].id) == 0  # the prefill was rolled back
