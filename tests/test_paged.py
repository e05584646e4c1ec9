"""Step 3: the paged cache is exact (paged == contiguous == uncached), shares safely, and never leaks a block."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minikv.attention import causal_attention
from minikv.bench.equivalence import EXACT_RTOL, rel_err
from minikv.errors import (
    ConfigError,
    InvalidInputError,
    OutOfBlocksError,
    ShapeError,
    UnknownSequenceError,
)
from minikv.kv_cache import ContiguousKVCache
from minikv.paged import PagedKVCache, chain_hash, paged_attention, slot_mapping
from minikv.weights.random_models import random_model

SHAPES = {
    "mha": dict(num_heads=4, num_kv_heads=4, head_dim=8, hidden_size=32, intermediate_size=64),
    "gqa": dict(num_heads=6, num_kv_heads=2, head_dim=10, hidden_size=42, intermediate_size=70),
    "mqa": dict(num_heads=5, num_kv_heads=1, head_dim=6, hidden_size=35, intermediate_size=33),
}



def paged_for(model, num_blocks=64, block_size=4, nan=True, **kw):
    cache = PagedKVCache(**model.new_cache_args(), num_blocks=num_blocks, block_size=block_size,
                         dtype=model.dtype, **kw)
    if nan:  # every slot that was never written holds NaN: a stale slot that leaks shows up at once
        cache.k_pool[:] = np.nan
        cache.v_pool[:] = np.nan
    return cache


def snapshot(cache):
    """Everything a failed or aborted operation must leave untouched."""
    a = cache.blocks.allocator
    seqs = {s: (cache.length(s), cache.blocks.table(s).tolist(),
                None if cache.blocks.host_table(s) is None else cache.blocks.host_table(s).tolist())
            for s in cache.seq_ids()}
    return (seqs, a.free_block_ids(), a.cached_block_ids(), [a.ref_count(b) for b in range(a.num_blocks)],
            None if cache.blocks.host_allocator is None else cache.blocks.host_allocator.free_block_ids())


# --- exactness ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape,layout", [("mha", "half"), ("mha", "interleaved"), ("gqa", "half"),
                                          ("gqa", "interleaved"), ("mqa", "half"), ("mqa", "interleaved")])
@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("offset", [-1, 0, 1])
def test_paged_equals_contiguous_and_uncached(shape, layout, dtype, block_size, offset):
    """Prefill of 2 blocks (exactly, -1, +1 tokens), then decode across block boundaries: all three agree."""
    model = random_model(rope_layout=layout, dtype=dtype, seed=3, **SHAPES[shape])
    prompt_len = 2 * block_size + offset
    total = prompt_len + block_size + 2  # decode crosses at least one block boundary
    ids = np.random.default_rng(block_size + offset).integers(0, model.config.vocab_size, total)
    reference = model.logits(ids)  # [T, V]: every position recomputed, no cache
    paged = paged_for(model, num_blocks=8, block_size=block_size, blocks_per_tile=1)  # one block per step
    contiguous = ContiguousKVCache(**model.new_cache_args(), max_seqs=1, max_len=total, dtype=dtype)
    runs = {}
    for name, cache in (("paged", paged), ("contiguous", contiguous)):
        cache.add_sequence("s")
        out = [model.forward([ids[:prompt_len]], cache, ["s"], all_logits=True)]
        out += [model.forward([ids[t:t + 1]], cache, ["s"]) for t in range(prompt_len, total)]
        runs[name] = np.concatenate(out)
        assert runs[name].dtype == dtype
    assert rel_err(runs["paged"], reference) <= EXACT_RTOL[dtype]
    assert rel_err(runs["paged"], runs["contiguous"]) <= EXACT_RTOL[dtype]
    assert np.array_equal(runs["paged"].argmax(-1), reference.argmax(-1))
    assert paged.length("s") == total
    assert len(paged.blocks.table("s")) == -(-total // block_size)


@pytest.mark.parametrize("blocks_per_tile", [1, 2, 3, None])
def test_tiles_of_blocks_give_the_same_attention(blocks_per_tile):
    """Walking 1, 2, 3 or ~128/bs blocks per online-softmax iteration changes nothing but rounding."""
    model = random_model(dtype=np.float64, seed=4, **SHAPES["gqa"])
    ids = np.random.default_rng(0).integers(0, 101, 23)
    cache = paged_for(model, num_blocks=16, block_size=3, blocks_per_tile=blocks_per_tile)
    cache.add_sequence(0)
    got = np.concatenate([model.forward([ids[:10]], cache, all_logits=True)]
                         + [model.forward([ids[t:t + 1]], cache) for t in range(10, 23)])
    assert rel_err(got, model.logits(ids)) <= 1e-10


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_mixed_prefill_and_decode_in_one_step(dtype):
    """Sequences prefilling and decoding in the same forward pass each equal their uncached logits."""
    model = random_model(dtype=dtype, seed=7, **SHAPES["gqa"])
    rng = np.random.default_rng(11)
    full = [rng.integers(0, 101, n) for n in (14, 9, 21, 6)]
    cache = paged_for(model, num_blocks=40, block_size=4)
    for i in range(4):
        cache.add_sequence(i)
    model.forward([full[0][:10], full[1][:3]], cache, [0, 1])  # 0 and 1 start first
    # 0 and 1 decode while 2 and 3 prefill, all in one pass; then everyone decodes
    logits = model.forward([full[0][10:11], full[1][3:4], full[2][:17], full[3][:5]], cache, [0, 1, 2, 3],
                           all_logits=True)
    refs = [model.logits(f) for f in full]
    rows = np.cumsum([0, 1, 1, 17, 5])
    for i, (lo, hi, t) in enumerate([(rows[0], rows[1], 10), (rows[1], rows[2], 3), (rows[2], rows[3], 0),
                                     (rows[3], rows[4], 0)]):
        assert rel_err(logits[lo:hi], refs[i][t:t + hi - lo]) <= EXACT_RTOL[dtype]
    pos = [11, 4, 17, 5]
    out = model.forward([full[i][pos[i]:pos[i] + 1] for i in range(4)], cache, [0, 1, 2, 3])
    for i in range(4):
        assert rel_err(out[i], refs[i][pos[i]]) <= EXACT_RTOL[dtype]


def test_paged_attention_reads_every_block_and_ignores_stale_nan():
    """The kernel-level function against plain causal attention on the gathered history."""
    rng = np.random.default_rng(0)
    bs, hkv, hq, d, nblocks = 4, 2, 6, 5, 12
    k_pool = np.full((nblocks, bs, hkv, d), np.nan)
    v_pool = np.full((nblocks, bs, hkv, d), np.nan)
    context = [9, 4, 1]  # partly filled last block, exactly one block, a single token
    qlens = [3, 1, 1]
    tables = np.full((3, 3), -1, dtype=np.int32)  # -1 padding must never be read
    tables[0, :3], tables[1, :1], tables[2, :1] = [7, 2, 10], [5], [0]
    hist = []
    for b, s in enumerate(context):
        k = rng.standard_normal((s, hkv, d))
        v = rng.standard_normal((s, hkv, d))
        slots = slot_mapping(tables[b], np.arange(s), bs)
        k_pool.reshape(-1, hkv, d)[slots] = k
        v_pool.reshape(-1, hkv, d)[slots] = v
        hist.append((k, v))
    q = rng.standard_normal((sum(qlens), hq, d))
    out = paged_attention(q, k_pool, v_pool, tables, context, qlens, blocks_per_tile=1)
    assert np.all(np.isfinite(out))
    start = 0
    for (k, v), t in zip(hist, qlens, strict=True):
        ref = causal_attention(q[start:start + t].transpose(1, 0, 2), k.transpose(1, 0, 2), v.transpose(1, 0, 2))
        assert rel_err(out[start:start + t], ref.transpose(1, 0, 2)) <= 1e-12
        start += t


def test_paged_attention_rejects_bad_input():
    q = np.zeros((2, 4, 8))
    pool = np.zeros((3, 4, 2, 8))
    good = dict(block_tables=np.zeros((2, 2), np.int32), context_lens=[5, 1])
    paged_attention(q, pool, pool, **good)
    with pytest.raises(ShapeError):
        paged_attention(q[:, :, :6], pool, pool, **good)
    with pytest.raises(ShapeError):  # 9 tokens need 3 blocks of 4, the table has 2 columns
        paged_attention(q, pool, pool, np.zeros((2, 2), np.int32), [9, 1])
    with pytest.raises(InvalidInputError):  # block id past the pool
        paged_attention(q, pool, pool, np.full((2, 2), 3, np.int32), [5, 1])
    with pytest.raises(InvalidInputError):  # query_lens do not sum to N
        paged_attention(q, pool, pool, **good, query_lens=[2, 1])
    with pytest.raises(ConfigError):
        paged_attention(q, pool, pool, **good, blocks_per_tile=0)


# --- copy-on-write, fork ------------------------------------------------------------------------------

def test_fork_then_write_copies_exactly_one_block():
    model = random_model(dtype=np.float64, seed=2, **SHAPES["mqa"])
    ids = np.random.default_rng(1).integers(0, 101, 10)  # 2.5 blocks of 4
    cache = paged_for(model, num_blocks=12, block_size=4)
    cache.add_sequence("a")
    model.forward([ids], cache, ["a"])
    cache.fork("a", "b")
    table_a = cache.blocks.table("a").tolist()
    assert cache.blocks.table("b").tolist() == table_a
    assert all(cache.blocks.allocator.ref_count(b) == 2 for b in table_a)
    free = cache.blocks.num_free
    tok_b, tok_a = 17, 42  # the two branches diverge
    lb = model.forward([[tok_b]], cache, ["b"])
    assert cache.blocks.cow_copies == 1
    assert cache.blocks.num_free == free - 1  # exactly one block copied, no other allocation
    table_b = cache.blocks.table("b").tolist()
    assert table_b[:2] == table_a[:2] and table_b[2] != table_a[2]
    assert cache.blocks.table("a").tolist() == table_a
    la = model.forward([[tok_a]], cache, ["a"])  # a's last block is no longer shared: written in place
    assert cache.blocks.cow_copies == 1 and cache.blocks.num_free == free - 1
    assert rel_err(lb[0], model.logits(np.append(ids, tok_b))[-1]) <= 1e-10
    assert rel_err(la[0], model.logits(np.append(ids, tok_a))[-1]) <= 1e-10


def test_fork_at_a_block_boundary_copies_nothing():
    model = random_model(dtype=np.float64, seed=2, **SHAPES["mqa"])
    cache = paged_for(model, num_blocks=12, block_size=4)
    cache.add_sequence("a")
    model.forward([np.arange(8)], cache, ["a"])
    cache.fork("a", "b")
    model.forward([[1], [2]], cache, ["a", "b"])
    assert cache.blocks.cow_copies == 0
    assert cache.blocks.table("a")[:2].tolist() == cache.blocks.table("b")[:2].tolist()


def test_two_forks_writing_in_the_same_step():
    """Three owners of one partial block write together: two copies, the last writer keeps the original."""
    model = random_model(dtype=np.float64, seed=2, **SHAPES["gqa"])
    ids = np.arange(6) + 3
    cache = paged_for(model, num_blocks=6, block_size=4)
    cache.add_sequence(0)
    model.forward([ids], cache, [0])
    cache.fork(0, 1)
    cache.fork(0, 2)
    assert cache.blocks.blocks_needed([0, 1, 2], [1, 1, 1]) == 2
    out = model.forward([[5], [6], [7]], cache, [0, 1, 2])
    assert cache.blocks.cow_copies == 2
    assert len({cache.blocks.table(s)[1] for s in range(3)}) == 3
    for i, t in enumerate((5, 6, 7)):
        assert rel_err(out[i], model.logits(np.append(ids, t))[-1]) <= 1e-10


# --- prefix sharing ------------------------------------------------------------------------------------

def run_prompt(model, cache, sid, prompt, decode=()):
    """Add ``prompt`` with prefix sharing, run what is not cached, then decode; returns (cached, logits rows)."""
    cached = cache.add_sequence(sid, prompt_ids=prompt)
    out = [model.forward([prompt[cached:]], cache, [sid], all_logits=True)]
    for t in decode:
        cache.blocks.extend_token_ids(sid, [t])
        out.append(model.forward([[t]], cache, [sid]))
    return cached, np.concatenate(out)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_prefix_hit_gives_the_same_logits_as_no_sharing(dtype):
    model = random_model(dtype=dtype, seed=5, **SHAPES["gqa"])
    rng = np.random.default_rng(3)
    system = rng.integers(0, 101, 13).tolist()  # 3 full blocks of 4 and one token
    a = system + rng.integers(0, 101, 6).tolist()
    b = system + rng.integers(0, 101, 5).tolist()
    cache = paged_for(model, num_blocks=30, block_size=4)
    run_prompt(model, cache, "a", a)
    decode = [3, 1, 4, 1, 5]
    cached, got = run_prompt(model, cache, "b", b, decode)
    assert cached == 12  # the three full blocks of the shared system prompt
    shared = set(cache.blocks.table("a")[:3].tolist())
    assert set(cache.blocks.table("b")[:3].tolist()) == shared
    ref = model.logits(b + decode)[cached:]
    assert rel_err(got, ref) <= EXACT_RTOL[dtype]
    assert np.array_equal(got.argmax(-1), ref.argmax(-1))
    assert cache.blocks.prefix_hit_tokens == 12 and cache.blocks.prefix_query_tokens == len(a) + len(b)


@pytest.mark.parametrize("free_first", [False, True])
def test_fully_cached_prompt_that_fills_whole_blocks(free_first):
    """Prompt all cached and a multiple of block_size: the last block is recomputed, so logits still exist."""
    model = random_model(dtype=np.float64, seed=5, **SHAPES["mha"])
    prompt = np.random.default_rng(8).integers(0, 101, 12).tolist()  # exactly 3 blocks of 4
    cache = paged_for(model, num_blocks=10, block_size=4)
    run_prompt(model, cache, "a", prompt, decode=[7])
    if free_first:  # the blocks then live only in the LRU list and must be revived
        cache.free_sequence("a")
        assert len(cache.blocks.allocator.cached_block_ids()) == 3
    cost = 3 if free_first else 1  # revived blocks count, blocks in use by "a" do not
    assert cache.blocks.can_admit(prompt, cost) and not cache.blocks.can_admit(prompt, cost - 1)
    free = cache.blocks.num_free
    cached, got = run_prompt(model, cache, "b", prompt)
    assert cached == 8  # not 12: at least one token must run to produce the next token's logits
    assert cache.blocks.num_free == free - cost
    assert rel_err(got, model.logits(prompt)[8:]) <= 1e-10


def test_prefix_ignoring_hash_cannot_reuse_a_block_at_another_position():
    """hash_fn ignoring the prefix makes block [T] at position 1 collide with [T] at position 0.

    Comparing token ids alone would accept the hit and reuse K/V computed after another prefix
    (wrong RoPE position, wrong context); comparing the chain's previous block rejects it.
    """
    model = random_model(dtype=np.float64, seed=6, **SHAPES["gqa"])
    blind = lambda prefix_hash, toks: chain_hash(None, toks)  # noqa: E731
    cache = paged_for(model, num_blocks=30, block_size=4, hash_fn=blind)
    x, t = [1, 2, 3, 4], [9, 8, 7, 6]
    run_prompt(model, cache, "p", x + t + [5])
    cached, got = run_prompt(model, cache, "q", t + [5, 5])
    assert cached == 0
    assert rel_err(got, model.logits(t + [5, 5])) <= 1e-10
    cached, got = run_prompt(model, cache, "r", x + t + [0])  # the genuine prefix still hits
    assert cached == 8
    assert rel_err(got, model.logits(x + t + [0])[8:]) <= 1e-10


def test_constant_hash_collisions_only_cost_misses():
    model = random_model(dtype=np.float64, seed=6, **SHAPES["mqa"])
    cache = paged_for(model, num_blocks=40, block_size=2, hash_fn=lambda prefix_hash, toks: 0)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 4, 9).tolist() for _ in range(6)]  # tiny vocab: many equal blocks
    for i, p in enumerate(prompts):
        cached, got = run_prompt(model, cache, i, p, decode=[1, 2])
        assert rel_err(got, model.logits(p + [1, 2])[cached:]) <= 1e-10


def test_freed_blocks_stay_cached_and_are_evicted_lru_tail_first():
    model = random_model(dtype=np.float64, seed=1, **SHAPES["mqa"])
    cache = paged_for(model, num_blocks=6, block_size=2)
    a = [1, 2, 3, 4, 5, 6]  # 3 full blocks
    run_prompt(model, cache, "a", a + [7])
    table = cache.blocks.table("a").tolist()
    cache.free_sequence("a")
    # freed last block first: the unregistered partial block is plain free, the chain is cached tail first
    assert cache.blocks.allocator.cached_block_ids() == [table[2], table[1], table[0]]
    assert cache.blocks.num_free == 6
    cache.add_sequence("x")  # a stranger needs 4 blocks: 3 plain free, then evicts the chain's tail
    model.forward([np.arange(8) + 50], cache, ["x"])
    assert cache.blocks.allocator.cached_block_ids() == [table[1], table[0]]
    cache.free_sequence("x")  # no token ids: its blocks go back plain, not cached
    cached, got = run_prompt(model, cache, "b", a[:4] + [9])  # the chain's head is still there
    assert cached == 4 and cache.blocks.table("b")[:2].tolist() == table[:2]
    assert rel_err(got, model.logits(a[:4] + [9])[4:]) <= 1e-10


def test_freed_blocks_are_reused():
    model = random_model(dtype=np.float64, seed=1, **SHAPES["mqa"])
    cache = paged_for(model, num_blocks=4, block_size=3)
    cache.add_sequence(0)
    model.forward([np.arange(12)], cache, [0])  # the whole pool
    assert cache.blocks.num_free == 0
    with pytest.raises(OutOfBlocksError):
        cache.add_sequence(1)
        model.forward([[1]], cache, [1])
    used = set(cache.blocks.table(0).tolist())
    cache.free_sequence(0)
    model.forward([np.arange(12)], cache, [1])
    assert set(cache.blocks.table(1).tolist()) == used
    assert cache.memory_stats()["utilization"] == 1.0


# --- failure leaves no trace -----------------------------------------------------------------------------

def test_failed_append_leaves_everything_unchanged():
    model = random_model(dtype=np.float64, seed=1, **SHAPES["gqa"])
    cache = paged_for(model, num_blocks=6, block_size=4)
    cache.add_sequence("a")
    model.forward([np.arange(6)], cache, ["a"])
    cache.fork("a", "b")
    cache.add_sequence("c")
    model.forward([np.arange(8)], cache, ["c"])
    before = snapshot(cache)
    k_before = cache.k_pool.copy()
    # a needs a copy-on-write block and 2 new blocks, c needs 1: 4 > 2 free
    with pytest.raises(OutOfBlocksError, match="needs 4 new blocks but only 2"):
        model.forward([np.arange(7), [1]], cache, ["a", "c"])
    assert snapshot(cache) == before
    assert np.array_equal(cache.k_pool, k_before, equal_nan=True)
    assert cache.blocks.cow_copies == 0


def test_error_inside_a_step_rolls_back_reservation_and_copy():
    model = random_model(dtype=np.float64, seed=1, **SHAPES["gqa"])
    cache = paged_for(model, num_blocks=8, block_size=4)
    cache.add_sequence("a")
    model.forward([np.arange(6)], cache, ["a"])
    cache.fork("a", "b")
    before = snapshot(cache)
    with pytest.raises(RuntimeError, match="boom"):
        with cache.step(["a", "b"], [5, 1]):  # copy-on-write for a, then new blocks
            assert cache.blocks.cow_copies == 1
            raise RuntimeError("boom")
    assert snapshot(cache) == before  # tables, ref counts, free-list order
    assert cache.blocks.cow_copies == 0
    out = model.forward([[9]], cache, ["b"])  # and the cache still works
    assert rel_err(out[0], model.logits(np.append(np.arange(6), 9))[-1]) <= 1e-10


# --- swap ---------------------------------------------------------------------------------------------------

def test_swap_out_and_in_preserves_contents_and_logits():
    model = random_model(dtype=np.float64, seed=9, **SHAPES["gqa"])
    ids = np.random.default_rng(4).integers(0, 101, 15)
    cache = paged_for(model, num_blocks=6, block_size=4, num_host_blocks=4)
    cache.add_sequence("s")
    model.forward([ids[:11]], cache, ["s"])
    kv = [cache.read_kv("s", layer) for layer in range(cache.num_layers)]
    cache.swap_out("s")
    assert cache.blocks.is_swapped("s") and cache.blocks.num_free == 6 and cache.blocks.host_allocator.num_free == 1
    with pytest.raises(InvalidInputError, match="swap_in"):
        model.forward([ids[11:12]], cache, ["s"])
    cache.add_sequence("other")  # scribble over the device pool meanwhile
    model.forward([np.arange(24) % 101], cache, ["other"])
    cache.free_sequence("other")
    cache.swap_in("s")
    assert not cache.blocks.is_swapped("s") and cache.blocks.host_allocator.num_free == 4
    for layer, (k, v) in enumerate(kv):
        k2, v2 = cache.read_kv("s", layer)
        assert np.array_equal(k, k2) and np.array_equal(v, v2)
    out = np.concatenate([model.forward([ids[t:t + 1]], cache, ["s"]) for t in range(11, 15)])
    assert rel_err(out, model.logits(ids)[11:]) <= 1e-10


def test_swap_without_room_changes_nothing():
    model = random_model(dtype=np.float64, seed=9, **SHAPES["mqa"])
    no_host = paged_for(model, num_blocks=6, block_size=4)
    no_host.add_sequence(0)
    model.forward([np.arange(5)], no_host, [0])
    with pytest.raises(OutOfBlocksError, match="num_host_blocks"):
        no_host.swap_out(0)
    cache = paged_for(model, num_blocks=4, block_size=4, num_host_blocks=2)
    cache.add_sequence(0)
    model.forward([np.arange(9)], cache, [0])  # 3 blocks > 2 host blocks
    before = snapshot(cache)
    with pytest.raises(OutOfBlocksError):
        cache.swap_out(0)
    assert snapshot(cache) == before
    cache.add_sequence(1)
    model.forward([np.arange(3)], cache, [1])
    cache.swap_out(1)
    model.forward([np.arange(5)], cache, [0])  # 0 grows to 4 blocks: the pool is full
    before = snapshot(cache)
    with pytest.raises(OutOfBlocksError):
        cache.swap_in(1)
    assert snapshot(cache) == before


# --- bad input ------------------------------------------------------------------------------------------------

def test_bad_input_raises_typed_errors():
    args = dict(num_layers=1, num_kv_heads=1, head_dim=2)
    for bad in (dict(num_blocks=4, block_size=0), dict(num_blocks=0, block_size=4),
                dict(num_blocks=4, block_size=2, num_host_blocks=-1),
                dict(num_blocks=4, block_size=2, blocks_per_tile=0),
                dict(num_blocks=4, block_size=2, hash_fn="md5"), dict(num_blocks=2.5, block_size=2)):
        with pytest.raises(ConfigError):
            PagedKVCache(**args, **bad)
    cache = PagedKVCache(**args, num_blocks=4, block_size=2, num_host_blocks=2)
    cache.add_sequence("a")
    with pytest.raises(InvalidInputError):
        cache.add_sequence("a")
    for call in (lambda: cache.length("zz"), lambda: cache.free_sequence("zz"), lambda: cache.fork("zz", "y"),
                 lambda: cache.swap_out("zz"), lambda: cache.blocks.table("zz"), lambda: cache.step(["zz"], [1])
                 .__enter__()):
        with pytest.raises(UnknownSequenceError, match="zz"):
            call()
    with pytest.raises(InvalidInputError):
        cache.fork("a", "a")
    with pytest.raises(InvalidInputError):
        cache.swap_in("a")  # not swapped out
    for bad in ([], [1.5, 2.0], [[1, 2]]):
        with pytest.raises(InvalidInputError):
            cache.add_sequence("b", prompt_ids=bad)
    with pytest.raises(InvalidInputError):
        cache.add_sequence([1, 2])  # unhashable id
    with cache.step(["a"], [1]):
        with pytest.raises(InvalidInputError, match="step is open"):
            cache.free_sequence("a")
        with pytest.raises(ShapeError):
            cache.write(0, np.zeros((2, 1, 2)), np.zeros((2, 1, 2)))
        cache.write(0, np.zeros((1, 1, 2)), np.zeros((1, 1, 2)))


# --- property test: 10,000 random operations per run ----------------------------------------------------------

class Boom(Exception):
    pass


VOCAB = 3  # few distinct tokens: prompts share prefixes all the time


def kv_values(tokens, layers, heads, dim):
    """Deterministic K/V for a token sequence; position p depends on tokens[:p+1] only, as in a real model."""
    h, base = 0, []
    for t in tokens:
        h = (h * 31 + int(t) + 1) % 1_000_003
        base.append(h)
    base = np.asarray(base, np.float64)[:, None, None]
    grid = np.arange(heads)[:, None] * 0.25 + np.arange(dim)[None, :] * 0.0625
    k = [base + grid + layer for layer in range(layers)]
    return k, [-x for x in k]


class Harness:
    """Drives a PagedKVCache with random operations and checks every invariant after each one."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)
        r = self.rng
        self.bs = int(r.choice([1, 2, 3, 4]))
        self.layers, self.heads, self.dim = 2, 2, 2
        hash_fn = [None, None, lambda p, t: 0][int(r.integers(3))]  # sometimes everything collides
        self.cache = PagedKVCache(self.layers, self.heads, self.dim, num_blocks=int(r.integers(4, 20)),
                                  block_size=self.bs, dtype=np.float64, hash_fn=hash_fn,
                                  num_host_blocks=int(r.choice([0, 6, 12])))
        self.cache.k_pool[:] = np.nan
        self.cache.v_pool[:] = np.nan
        self.tokens = {}  # seq id -> every token the sequence will have (prefix computed = cache.length)
        self.next_id = 0
        self.ops = 0
        self.failures = 0

    def new_id(self):
        self.next_id += 1
        return self.next_id

    def resident(self):
        return [s for s in self.tokens if not self.cache.blocks.is_swapped(s)]

    # the operations ---------------------------------------------------------------------------------------
    def op_add(self):
        sid = self.new_id()
        prompt = self.rng.integers(0, VOCAB, int(self.rng.integers(1, 4 * self.bs + 2))).tolist()
        if self.rng.random() < 0.2:
            self.cache.add_sequence(sid)  # no ids: no sharing
        else:
            cached = self.cache.add_sequence(sid, prompt_ids=prompt)
            assert cached % self.bs == 0 and cached < len(prompt)
        self.tokens[sid] = prompt

    def op_append(self):
        res = self.resident()
        if not res:
            return
        chosen = [res[i] for i in self.rng.permutation(len(res))[: int(self.rng.integers(1, 4))]]
        nums = []
        for s in chosen:
            todo = len(self.tokens[s]) - self.cache.length(s)
            if todo == 0:  # decode: a new token joins the sequence
                tok = int(self.rng.integers(VOCAB))
                self.tokens[s].append(tok)
                self.cache.blocks.extend_token_ids(s, [tok])
                todo = 1
            nums.append(int(self.rng.integers(1, todo + 1)))
        before = snapshot(self.cache)
        fail_inside = self.rng.random() < 0.05
        try:
            with self.cache.step(chosen, nums):
                for layer in range(self.layers):
                    ks, vs = [], []
                    for s, n in zip(chosen, nums, strict=True):
                        p = self.cache.length(s)
                        k, v = kv_values(self.tokens[s][:p + n], self.layers, self.heads, self.dim)
                        ks.append(k[layer][p:])
                        vs.append(v[layer][p:])
                    self.cache.write(layer, np.concatenate(ks), np.concatenate(vs))
                    if fail_inside and layer == 0:
                        raise Boom  # any exception mid-step
        except OutOfBlocksError:  # refused before anything happened
            assert snapshot(self.cache) == before
            self.failures += 1
        except Boom:  # aborted after blocks were handed out (and maybe written)
            after = snapshot(self.cache)
            assert after[0] == before[0] and after[3] == before[3]  # tables, lengths, ref counts
            assert set(after[1]) | set(after[2]) == set(before[1]) | set(before[2])
            # blocks the step evicted from the prefix cache may hold its writes now: they stay evicted
            assert after[2] == [b for b in before[2] if b in after[2]]
            self.failures += 1

    def op_fork(self):
        res = self.resident()
        if res:
            parent = res[int(self.rng.integers(len(res)))]
            child = self.new_id()
            self.cache.fork(parent, child)
            self.tokens[child] = list(self.tokens[parent])

    def op_free(self):
        if self.tokens:
            s = list(self.tokens)[int(self.rng.integers(len(self.tokens)))]
            self.cache.free_sequence(s)
            del self.tokens[s]

    def op_preempt_recompute(self):
        """Free a sequence and re-add its computed tokens as a new prompt (the prefix cache may serve them)."""
        res = [s for s in self.resident() if self.cache.length(s) > 0]
        if res:
            s = res[int(self.rng.integers(len(res)))]
            toks = self.tokens.pop(s)[: self.cache.length(s)]
            self.cache.free_sequence(s)
            sid = self.new_id()
            self.cache.add_sequence(sid, prompt_ids=toks)
            self.tokens[sid] = toks

    def op_swap_out(self):
        res = self.resident()
        if res and self.cache.blocks.host_allocator is not None:
            before = snapshot(self.cache)
            try:
                self.cache.swap_out(res[int(self.rng.integers(len(res)))])
            except OutOfBlocksError:
                assert snapshot(self.cache) == before
                self.failures += 1

    def op_swap_in(self):
        out = [s for s in self.tokens if self.cache.blocks.is_swapped(s)]
        if out:
            before = snapshot(self.cache)
            try:
                self.cache.swap_in(out[int(self.rng.integers(len(out)))])
            except OutOfBlocksError:
                assert snapshot(self.cache) == before
                self.failures += 1

    OPS = ("op_add", "op_append", "op_append", "op_append", "op_fork", "op_free", "op_preempt_recompute",
           "op_swap_out", "op_swap_in")

    def step(self):
        if len(self.tokens) > 8:
            self.op_free()
        else:
            getattr(self, self.OPS[int(self.rng.integers(len(self.OPS)))])()
        self.ops += 1
        self.check()

    # the invariants -----------------------------------------------------------------------------------------
    def check(self):
        c, a = self.cache, self.cache.blocks.allocator
        a.check()
        owners = np.zeros(a.num_blocks, int)
        host_owners = np.zeros(max(c.num_host_blocks, 1), int)
        for s, toks in self.tokens.items():
            n = c.length(s)
            assert n <= len(toks)
            if c.blocks.is_swapped(s):
                host = c.blocks.host_table(s)
                assert len(host) == -(-n // self.bs) and len(c.blocks.table(s)) == 0
                np.add.at(host_owners, host, 1)
            else:
                table = c.blocks.table(s)
                assert len(table) == -(-n // self.bs)
                np.add.at(owners, table, 1)
            k_exp, v_exp = kv_values(toks[:n], self.layers, self.heads, self.dim)
            for layer in range(self.layers):
                k, v = c.read_kv(s, layer)  # contents survive sharing, copy-on-write and swapping
                assert np.array_equal(k, k_exp[layer].reshape(n, self.heads, self.dim))
                assert np.array_equal(v, v_exp[layer].reshape(n, self.heads, self.dim))
        assert [a.ref_count(b) for b in range(a.num_blocks)] == owners.tolist()  # ref counts == owners
        assert a.num_free == int(np.sum(owners == 0))
        if c.blocks.host_allocator is not None:
            h = c.blocks.host_allocator
            h.check()
            assert [h.ref_count(b) for b in range(h.num_blocks)] == host_owners.tolist()

    def finish(self):
        for s in list(self.tokens):
            self.cache.free_sequence(s)
        self.tokens.clear()
        self.check()
        a = self.cache.blocks.allocator
        assert a.num_free == a.num_blocks  # nothing leaked
        assert all(a.ref_count(b) == 0 for b in range(a.num_blocks))
        if self.cache.blocks.host_allocator is not None:
            assert self.cache.blocks.host_allocator.num_free == self.cache.num_host_blocks


OPS_PER_EXAMPLE, EXAMPLES = 500, 20


def test_random_operations_keep_every_invariant():
    """alloc/append/fork/write/free/preempt/swap in random order: 20 hypothesis seeds x 500 operations."""
    done = {"ops": 0, "failures": 0}

    @settings(max_examples=EXAMPLES, deadline=None, database=None)
    @given(seed=st.integers(0, 2**32 - 1))
    def run(seed):
        h = Harness(seed)
        for _ in range(OPS_PER_EXAMPLE):
            h.step()
        h.finish()
        done["ops"] += h.ops
        done["failures"] += h.failures

    run()
    assert done["ops"] >= 10_000
    assert done["failures"] > 0  # the failure paths (out of blocks, aborted steps) were exercised too


# --- the real model ----------------------------------------------------------------------------------------------

@pytest.mark.model
def test_smollm2_paged_equals_contiguous_and_uncached(smollm2):
    """SmolLM2-135M: a ~20-token prompt + 5 decode steps, block size 16, with a prefix-shared second copy."""
    model, tok = smollm2
    ids = tok.encode("The capital of France is Paris, and the capital of Italy is")
    assert 12 <= len(ids) <= 24
    contiguous = ContiguousKVCache(**model.new_cache_args(), max_seqs=1, max_len=64, dtype=np.float32)
    paged = paged_for(model, num_blocks=8, block_size=16)
    contiguous.add_sequence(0)
    paged.add_sequence(0, prompt_ids=ids)
    seq = list(ids)
    c_rows = [model.forward([ids], contiguous)[0]]
    p_rows = [model.forward([ids], paged)[0]]
    for _ in range(5):  # greedy, fed from the paged run
        nxt = int(np.argmax(p_rows[-1]))
        seq.append(nxt)
        paged.blocks.extend_token_ids(0, [nxt])
        c_rows.append(model.forward([[nxt]], contiguous)[0])
        p_rows.append(model.forward([[nxt]], paged)[0])
    reference = model.logits(seq)[len(ids) - 1:]
    got = np.stack(p_rows)
    assert rel_err(got, reference) <= 1e-4
    assert rel_err(got, np.stack(c_rows)) <= 1e-4
    assert np.array_equal(got.argmax(-1), reference.argmax(-1))
    # a second request with the same prompt reuses the first full block and still agrees
    cached = paged.add_sequence(1, prompt_ids=ids)
    assert cached == 16 * ((len(ids) - 1) // 16)
    again = model.forward([ids[cached:]], paged, [1])[0]
    assert rel_err(again, reference[0]) <= 1e-4
