"""The host offload tier (minikv.tiers): exactness on every lossless paged kind, bit-identical round trips,
the link cost model by hand, and random operation sequences that never lose, duplicate or demote a held block."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minikv.bench.offload import ChatTrace, run_trace
from minikv.errors import ConfigError, InvalidInputError, OutOfBlocksError
from minikv.generate import paged_cache
from minikv.paged import PagedKVCache
from minikv.scheduler import Scheduler
from minikv.tiers import LINKS, Link, OffloadPolicy, OffloadTier
from minikv.weights.random_models import random_mla_model, random_model

BS = 8
GROUP = {"kivi2": 4, "kivi4": 4, "fp8": 16, "fp8_e5m2": 16}  # as tests/test_quant_cache.py; others: 32
QUANT = ["fp16", "bf16", "int8", "int4", "q4_1", "kivi2", "kivi4", "fp8", "fp8_e5m2", "k16v8"]
SHAPE = dict(num_layers=2, hidden_size=48, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=64,
             vocab_size=61, max_position=256)
M64 = random_model(**SHAPE, seed=5, dtype=np.float64)
MLA64 = random_mla_model(vocab_size=61, max_position=256, seed=3, dtype=np.float64)
TRACE = ChatTrace(conversations=6, turns=3, system_prompts=2, system_len=16, user_len=(3, 7), reply_len=4,
                  think_steps=2, arrival_every=1, vocab_size=61, seed=1)


def build(model, kv_dtype, num_blocks, host_blocks=0, **options):
    quant = {} if kv_dtype is None else dict(kv_dtype=kv_dtype, group=GROUP.get(kv_dtype, 32))
    return paged_cache(model.new_cache_args(), num_blocks, BS, np.float64, num_host_blocks=host_blocks,
                       **quant, **options)


def chat(model, kv_dtype, policy=None, num_blocks=400, host_blocks=24, **options):
    """The trace's tokens, on an unlimited pool (policy None) or a 9-block pool plus a host tier."""
    if policy is None:
        cache, pol, tier = build(model, kv_dtype, num_blocks, **options), None, None
    else:
        cache = build(model, kv_dtype, 9, host_blocks, **options)
        tier = OffloadTier(cache, policy)
        pol = OffloadPolicy(tier, compute_s=lambda tokens, kv: 1e-3)
    sched = Scheduler(model, cache, max_step_tokens=24, policy=pol)
    out = run_trace(TRACE, sched)
    if tier is not None:
        tier.check()
        cache.blocks.allocator.check()
    return out, tier


REFERENCE = {}


def reference(model, kv_dtype):
    key = (id(model), kv_dtype)
    if key not in REFERENCE:
        REFERENCE[key] = chat(model, kv_dtype)[0]
    return REFERENCE[key]


# -- exact: a tiny device pool plus the host tier gives the unlimited pool's tokens -------------------

@pytest.mark.parametrize("policy", ["lru", "arc", "seen_twice", "seen_twice_arc"])
def test_paged_float_with_a_host_tier_gives_the_tokens_of_an_unlimited_pool(policy):
    got, tier = chat(M64, None, policy)
    assert got == reference(M64, None)
    assert tier.stats.host_hits > 0 and tier.stats.demoted > 0  # prefix hits did come from the host


def test_prefetch_runs_ahead_and_its_blocks_are_used():
    got, tier = chat(M64, None, "lru")
    assert got == reference(M64, None)
    assert tier.stats.prefetched > 0 and tier.stats.prefetch_used > 0 and tier.stats.hidden_s > 0


@pytest.mark.parametrize("kv_dtype", QUANT)
def test_quantized_paged_kinds_with_a_host_tier_give_their_own_unlimited_tokens(kv_dtype):
    got, tier = chat(M64, kv_dtype, "arc")
    assert got == reference(M64, kv_dtype)
    assert tier.stats.host_hits > 0


def test_mla_latent_paged_with_a_host_tier_gives_the_tokens_of_an_unlimited_pool():
    got, tier = chat(MLA64, None, "lru")
    assert got == reference(MLA64, None)
    assert tier.stats.host_hits > 0


def test_a_prefix_blind_hash_never_gives_a_wrong_host_hit():
    blind = lambda prefix, toks: hash(tuple(toks))  # noqa: E731  equal blocks collide after any prefix
    cache = build(M64, None, 6, host_blocks=12, hash_fn=blind)
    tier = OffloadTier(cache, "lru")
    rng = np.random.default_rng(2)
    z = rng.integers(0, 60, BS).tolist()
    a, b = rng.integers(0, 60, BS).tolist() + z + [1], rng.integers(0, 60, BS).tolist() + z + [2]

    def run(sid, toks):
        n = cache.add_sequence(sid, toks)
        logits = M64.forward([toks[n:]], cache, [sid])
        cache.free_sequence(sid)
        return n, logits

    for sid, toks in (("a", a), ("f1", rng.integers(0, 60, 6 * BS).tolist()), ("b", b),
                      ("f2", rng.integers(0, 60, 6 * BS).tolist())):
        run(sid, toks)
    # a's blocks and b's first block are on the host; b's second block shares a's key and tokens,
    # but follows another first block: only b's first block may come back
    hits = tier.stats.host_hits
    n, logits = run("b again", b)
    assert n == BS and tier.stats.host_hits == hits + 1
    fresh = build(M64, None, 6)
    fresh.add_sequence(0, b)
    want = M64.forward([b], fresh, [0])
    assert np.max(np.abs(logits - want)) <= 1e-10 * np.max(np.abs(want))


def test_a_colliding_hash_never_gives_a_wrong_host_hit():
    collide = lambda prefix, toks: 7  # noqa: E731  every block has the same hash
    got, tier = chat(M64, None, "lru", hash_fn=collide)
    assert got == reference(M64, None)


# -- offload then reload is bit-identical (K/V, codes, scales, flags) -------------------------------

def block_bytes(cache, bid: int, host: bool = False) -> bytes:
    """Every stored byte of one block: pools, codes (with their scales) and the quantized flag."""
    pre, out = "host_" if host else "", b""
    for name in ("k_pool", "v_pool", "k_codes", "v_codes", "pool"):
        arr = getattr(cache, pre + name, None)
        if isinstance(arr, np.ndarray) and (name != "v_pool" or arr is not getattr(cache, pre + "k_pool")):
            out += np.ascontiguousarray(arr[:, bid]).tobytes()
    flags = getattr(cache, pre + "quantized", None)
    return out + (b"" if flags is None else bytes([bool(flags[bid])]))


@pytest.mark.parametrize("model, kv_dtype", [(M64, None), (MLA64, None)] + [(M64, k) for k in QUANT],
                         ids=["paged", "mla"] + QUANT)
def test_offload_then_reload_is_bit_identical(model, kv_dtype):
    cache = build(model, kv_dtype, 6, host_blocks=12)
    tier = OffloadTier(cache, "lru")
    rng = np.random.default_rng(0)
    p = rng.integers(0, 60, 33).tolist()  # 4 full blocks + 1 token
    cache.add_sequence("a", p)
    model.forward([p], cache, ["a"])
    table = cache.blocks.table("a").tolist()
    before = [block_bytes(cache, b) for b in table[:4]]
    cache.free_sequence("a")
    other = rng.integers(0, 60, 48).tolist()  # 6 blocks: evicts all four
    cache.add_sequence("b", other)
    model.forward([other], cache, ["b"])
    assert tier.stats.demoted == 4
    on_host = {e.token_ids: e.host_id for e in tier.entries.values()}
    for j in range(4):
        assert block_bytes(cache, on_host[tuple(p[j * BS:(j + 1) * BS])], host=True) == before[j]
    cache.free_sequence("b")
    assert cache.add_sequence("c", p) == 32  # every full block found on the host
    assert tier.stats.promoted == 4
    assert [block_bytes(cache, b) for b in cache.blocks.table("c").tolist()] == before


# -- the cost model, priced by hand ------------------------------------------------------------------

def test_link_presets_and_the_step_accounting_by_hand():
    assert LINKS["pcie4"].bytes_per_s == 31.5e9 and LINKS["pcie5"].bytes_per_s == 63e9
    assert LINKS["nvlink-c2c"].bytes_per_s == 450e9
    cache = PagedKVCache(1, 1, 2, num_blocks=6, block_size=BS, dtype=np.float64, num_host_blocks=12)
    tier = OffloadTier(cache, "lru", link=Link("test", 1e9), bytes_per_block=10**6)  # 1 ms per block
    p, q, r = list(range(17)), list(range(20, 37)), list(range(40, 88))  # 2, 2 and 6 full blocks
    for sid, toks in (("p", p), ("q", q), ("r", r)):
        assert cache.add_sequence(sid, toks) == 0
        with cache.step([sid], [len(toks)]):
            cache.write(0, np.ones((len(toks), 1, 2)), np.ones((len(toks), 1, 2)))
        cache.free_sequence(sid)
    # r's six blocks evicted p's and q's four: 4 demotions stall (4 ms); r's blocks are cached-free now
    tier.end_step(1.0)
    assert tier.stats.demoted == 4 and tier.stats.stall_s == pytest.approx(4e-3)
    # prefetch p: 2 promotions + the 2 demotions of r's blocks they evict = 4 ms under a 3 ms step
    assert tier.prefetch([p], 10) == 2
    tier.end_step(3e-3)
    assert tier.stats.hidden_s == pytest.approx(3e-3) and tier.stats.stall_s == pytest.approx(4e-3)
    assert cache.add_sequence("p", p) == 16 and tier.stats.prefetch_used == 2  # on the device already
    tier.end_step(1.0)  # the 1 ms the last step could not hide
    assert tier.stats.stall_s == pytest.approx(5e-3)
    assert cache.add_sequence("q", q) == 16  # not prefetched: 2 promotions + 2 demotions stall
    tier.end_step(1.0)
    assert tier.stats.stall_s == pytest.approx(9e-3) and tier.stats.promoted == 2
    assert tier.stats.bytes_moved == (4 + 4 + 4) * 10**6


# -- the filter and the refusals -----------------------------------------------------------------------

def test_seen_twice_stores_nothing_from_one_shot_prompts():
    cache = build(M64, None, 6, host_blocks=12)
    tier = OffloadTier(cache, "seen_twice")
    rng = np.random.default_rng(1)
    for i in range(8):
        toks = rng.integers(0, 60, 24).tolist()
        cache.add_sequence(i, toks)
        M64.forward([toks], cache, [i])
        cache.free_sequence(i)
    assert cache.blocks.allocator.evictions > 0 and tier.stats.demoted == 0 and not tier.entries


def test_a_tier_refuses_what_it_cannot_serve():
    with pytest.raises(ConfigError, match="num_host_blocks"):
        OffloadTier(build(M64, None, 8), "lru")
    with pytest.raises(ConfigError, match="policy"):
        OffloadTier(build(M64, None, 8, 4), "mru")
    with pytest.raises(ConfigError, match="capacity"):
        OffloadTier(build(M64, None, 8, 4), "lru", capacity=5)
    with pytest.raises(ConfigError, match="link"):
        OffloadTier(build(M64, None, 8, 4), "lru", link="pcie9")
    cache = build(M64, None, 8, 4)
    tier = OffloadTier(cache, "lru")
    with pytest.raises(ConfigError, match="fresh cache"):
        OffloadTier(cache, "arc")
    with pytest.raises(InvalidInputError, match="max_blocks"):
        tier.prefetch([[1, 2, 3]], -1)
    with pytest.raises(InvalidInputError, match="compute_s"):
        tier.end_step(float("nan"))


# -- random operation sequences --------------------------------------------------------------------------

def kv_of(tokens: list) -> np.ndarray:
    """The K (and V) a position holds: a function of the whole prefix, [len, 1, 2]."""
    return np.array([[[hash(tuple(tokens[:p + 1])) % 9973, p]] for p in range(len(tokens))], dtype=np.float64)


PROMPTS = [[1] * 8 + [2] * 8 + [3] * 3, [1] * 8 + [2] * 8 + [4] * 9, [1] * 8 + [5] * 10, [6] * 17, [7] * 26]
# weighted: adds and frees churn the small pool, so blocks are demoted and come back often
OPS = st.lists(st.tuples(st.sampled_from(["add"] * 3 + ["free"] * 2 + ["decode", "fork", "swap", "recompute",
                                                                      "prefetch", "prefetch"]),
                         st.integers(0, 10**6)), min_size=5, max_size=40)


class Run:
    """Drives a cache + tier with random operations and checks every stored token after each."""

    def __init__(self, policy: str):
        self.cache = PagedKVCache(1, 1, 2, num_blocks=6, block_size=BS, dtype=np.float64, num_host_blocks=8)
        self.tier = OffloadTier(self.cache, policy, capacity=4)
        self.tokens, self.next_id = {}, 0
        real = self.tier.storage.demote

        def demote(dev, host):  # no block still held is ever demoted
            assert all(self.cache.blocks.allocator.ref_count(b) == 0 for b in dev)
            real(dev, host)
        self.tier.storage.demote = demote

    def feed(self, sid, new: list, declare: bool) -> None:
        toks = self.tokens[sid] + new
        past = self.cache.length(sid)
        if declare:  # a decoded token: the cache learns its id (a prompt's ids came with add_sequence)
            self.cache.blocks.extend_token_ids(sid, new)
        try:
            with self.cache.step([sid], [len(toks) - past]):
                kv = kv_of(toks)[past:]
                self.cache.write(0, kv, kv + 0.5)
        except OutOfBlocksError:
            self.cache.free_sequence(sid)
            del self.tokens[sid]
            return
        self.tokens[sid] = toks

    def add(self, toks: list) -> None:
        if len(self.tokens) >= 2:  # the oldest request finishes first
            oldest = min(self.tokens)
            self.cache.free_sequence(oldest)
            del self.tokens[oldest]
        sid, self.next_id = self.next_id, self.next_id + 1
        cached = self.cache.add_sequence(sid, toks)
        self.tokens[sid] = toks[:cached]
        self.feed(sid, toks[cached:], declare=False)

    def apply(self, op: str, r: int) -> None:
        live = sorted(self.tokens)
        sid = live[r % len(live)] if live else None
        swapped = sid is not None and self.cache.blocks.is_swapped(sid)
        if op == "add" or sid is None:
            self.add(list(PROMPTS[r % len(PROMPTS)]))
        elif op == "prefetch":
            self.tier.prefetch([PROMPTS[r % len(PROMPTS)]], 1 + r % 4)
        elif op == "free":
            self.cache.free_sequence(sid)
            del self.tokens[sid]
        elif op == "swap" and not swapped and self.cache.blocks.host_allocator.num_free >= self.cache.blocks.held(sid):
            self.cache.swap_out(sid)
        elif swapped:
            if self.cache.blocks.num_free >= self.cache.blocks.held(sid):
                self.cache.swap_in(sid)
        elif op == "fork":
            self.cache.fork(sid, self.next_id)
            self.tokens[self.next_id], self.next_id = list(self.tokens[sid]), self.next_id + 1
        elif op == "recompute":  # preemption by recompute: drop the K/V, admit the tokens again
            toks = self.tokens.pop(sid)
            self.cache.free_sequence(sid)
            self.add(toks)
        elif op == "decode":
            self.feed(sid, [r % 11], declare=True)

    def check(self) -> None:
        self.cache.blocks.allocator.check()
        self.cache.blocks.host_allocator.check()
        self.tier.check()
        for sid, toks in self.tokens.items():
            k, v = self.cache.read_kv(sid, 0)
            assert self.cache.length(sid) == len(toks)
            np.testing.assert_array_equal(k, kv_of(toks))
            np.testing.assert_array_equal(v, kv_of(toks) + 0.5)


@pytest.mark.parametrize("policy", ["lru", "arc", "seen_twice"])
@settings(max_examples=40, deadline=None)
@given(ops=OPS)
def test_random_demote_promote_prefetch_fork_free_preempt_lose_nothing(policy, ops):
    run = Run(policy)
    for op, r in ops:
        run.apply(op, r)
        run.check()


# -- the CLI -----------------------------------------------------------------------------------------------

def test_bench_offload_prints_one_json_line_last(capsys):
    from minikv.cli import main

    flags = ["--conversations", "6", "--device-blocks", "16", "--host-blocks", "32", "--json"]
    assert main(["bench", "offload", *flags]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    res = json.loads(out[-1])
    assert set(res["policies"]) == {"lru", "arc", "seen_twice"} and res["outputs_identical"] is True
    for side in [*res["policies"].values(), res["device_only"]]:
        assert {"hit_rate", "bytes_moved", "stall_s", "max_concurrency"} <= set(side)
    assert res["policies"]["lru"]["hit_rate"] > res["device_only"]["hit_rate"]
    assert main(["bench", "offload", "--device-blocks", "3"]) == 2


@pytest.mark.parametrize("policy", ["lru", "arc", "seen_twice"])
def test_long_seeded_runs_reach_every_path_and_lose_nothing(policy):
    rng = np.random.default_rng(11)
    names = ["add"] * 3 + ["free"] * 2 + ["decode", "fork", "swap", "recompute", "prefetch", "prefetch"]
    run = Run(policy)
    for _ in range(300):
        run.apply(names[rng.integers(len(names))], int(rng.integers(10**6)))
        run.check()
    s = run.tier.stats
    blocks = run.cache.blocks
    assert min(s.demoted, s.promoted, s.prefetched, s.host_evictions, blocks.swap_ins, blocks.cow_copies) > 0
