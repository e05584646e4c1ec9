"""Step 5, the quantized paged cache: append-only, step-3 invariants, sharing, preemption, per-tile dequantization."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tests.test_paged as tp
from minikv.attention import causal_attention
from minikv.bench.equivalence import KERNEL_RTOL, assert_close, rel_err
from minikv.errors import ConfigError
from minikv.generate import make_cache, paged_cache
from minikv.paged import PagedKVCache
from minikv.quant import KV_DTYPES, QuantizedPagedKVCache, dequantized_pools, kv_bytes_per_token
from minikv.scheduler import Request, Scheduler
from minikv.weights.random_models import random_model

BS = 8
GROUP = {"kivi2": 4, "kivi4": 4, "fp8": 16, "fp8_e5m2": 16}  # others: llama.cpp's 32 (casts: none)
LOSSY = [k for k in KV_DTYPES if k != "fp32"]
SHAPE = dict(num_layers=2, hidden_size=48, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=64,
             vocab_size=61, max_position=512)
M64 = random_model(**SHAPE, seed=5, dtype=np.float64)
M32 = random_model(**SHAPE, seed=5, dtype=np.float32)
IDS = np.random.default_rng(7).integers(0, 61, 60).tolist()


def qcache(model, kv, num_blocks=64, bs=BS, nan=True, **kw):
    cache = QuantizedPagedKVCache(**model.new_cache_args(), num_blocks=num_blocks, block_size=bs, dtype=model.dtype,
                                  kv_dtype=kv, group=GROUP.get(kv, 32), **kw)
    if nan:  # a slot never written, or a quantized block's dead residual rows: NaN shows any leak
        cache.k_pool[:] = np.nan
        cache.v_pool[:] = np.nan
    return cache


def token_by_token(model, cache, ids, sid=0):
    cache.add_sequence(sid)
    return np.stack([model.forward([[t]], cache, [sid])[0] for t in ids])


# --- registration ------------------------------------------------------------------------------------

def test_fp32_and_none_keep_todays_cache_exactly():
    for kv in (None, "fp32"):
        c = make_cache("paged", M32, 64, kv_dtype=kv)
        assert type(c) is PagedKVCache and c.block_size == 16
    plain = PagedKVCache(**M32.new_cache_args(), num_blocks=16, block_size=BS)
    quant = qcache(M32, "fp32", num_blocks=16)  # the quantized machinery with a lossless codec
    for c in (plain, quant):
        c.add_sequence(0)
    a = [M32.forward([IDS[:21]], plain, all_logits=True)] + [M32.forward([[t]], plain) for t in IDS[21:40]]
    b = [M32.forward([IDS[:21]], quant, all_logits=True)] + [M32.forward([[t]], quant) for t in IDS[21:40]]
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype == np.float32 and np.array_equal(x, y)


def test_make_cache_builds_every_kv_dtype_on_the_paged_layout():
    for kv in LOSSY:
        c = make_cache("paged", M32, 40, max_seqs=2, kv_dtype=kv, group=GROUP.get(kv, 32), residual=24)
        assert isinstance(c, QuantizedPagedKVCache) and c.kv_dtype == kv
        assert c.block_size == (24 if kv.startswith("kivi") else 16)  # kivi: residual -> block size
    assert make_cache("paged", M32, 300, kv_dtype="kivi2", group=32).block_size == 128  # KIVI's R = 128
    with pytest.raises(ConfigError, match="paged"):
        make_cache("contiguous", M32, 40, kv_dtype="int8")
    with pytest.raises(ConfigError, match="int3"):
        make_cache("paged", M32, 40, kv_dtype="int3")
    with pytest.raises(ConfigError, match="residual=8 must equal block_size=16"):
        paged_cache(M32.new_cache_args(), 8, 16, np.float32, kv_dtype="kivi2", group=4, residual=8)
    with pytest.raises(ConfigError, match="group of 32"):
        make_cache("paged", random_model(**{**SHAPE, "head_dim": 24}, seed=1), 40, kv_dtype="int8")


# --- append-only ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kv", LOSSY)
def test_stored_bytes_never_change_and_each_block_is_quantized_once(kv):
    cache = qcache(M64, kv)
    cache.add_sequence(0)
    M64.forward([IDS[:13]], cache)
    seen = {}  # (layer, block) -> bytes when it became full
    for t in IDS[13:]:
        n_before = cache.length(0)
        open_rows = [(cache.k_pool[:, b].copy(), b) for b in cache.blocks.table(0)[n_before // BS:]]
        M64.forward([[t]], cache)
        n, table = cache.length(0), cache.blocks.table(0)
        for j, b in enumerate(table):
            full = (j + 1) * BS <= n
            assert bool(cache.quantized[b]) == full and cache.quantize_count[b] == int(full)
            for layer in range(cache.num_layers):
                if full:
                    now = cache.stored_block(layer, b)
                    assert seen.setdefault((layer, b), now) == now  # identical, bit for bit
        for rows, b in open_rows:  # residual rows of old tokens are untouched until their block fills
            if not cache.quantized[b]:
                k = n_before % BS
                assert np.array_equal(cache.k_pool[:, b, :k], rows[:, :k])
    assert len(seen) == cache.num_layers * (len(IDS) // BS)


@pytest.mark.parametrize("kv", ["int8", "kivi2", "fp8"])
def test_bytes_used_is_the_formula(kv):
    cache = qcache(M64, kv)
    for sid, n in ((0, 21), (1, 8), (2, 3)):
        cache.add_sequence(sid)
        M64.forward([IDS[:n]], cache, [sid])
    full, residual = 2 + 1 + 0, 5 + 0 + 3
    kb, vb = cache.format.block_bytes()
    assert cache.bytes_per_block() == 2 * (kb + vb)
    assert cache.bytes_used() == full * cache.bytes_per_block() + residual * cache.residual_bytes_per_token()
    assert cache.residual_bytes_per_token() == 2 * 2 * 2 * 32 * 8
    assert cache.bytes_per_token() == cache.bytes_per_block() / BS
    per_value = {"int8": 34 / 32, "kivi2": (4 + 4 * 2 / 8) / 4, "fp8": 18 / 16}[kv]
    assert cache.bytes_per_token() == 2 * 2 * 2 * 32 * per_value
    assert kv_bytes_per_token(kv, 2, 2, 32, BS, GROUP.get(kv, 32)) == cache.bytes_per_token()


# --- the step-3 invariants: the paged property-test harness on the quantized cache ------------------------

class QuantHarness(tp.Harness):
    """``tests.test_paged.Harness`` on a QuantizedPagedKVCache: what it reads back is each full block
    quantized once (encode -> decode of the exact K/V), the open block exact."""

    def __init__(self, seed, kv):
        super().__init__(seed)
        self.bs, self.dim = int(self.rng.choice([4, 8])), 32
        self.cache = QuantizedPagedKVCache(self.layers, self.heads, self.dim, num_blocks=int(self.rng.integers(4, 20)),
                                           block_size=self.bs, dtype=np.float64, kv_dtype=kv, group=GROUP.get(kv, 32),
                                           hash_fn=[None, lambda p, t: 0][int(self.rng.integers(2))],
                                           num_host_blocks=int(self.rng.choice([0, 6, 12])))
        self.cache.k_pool[:] = np.nan
        self.cache.v_pool[:] = np.nan

    def stored(self, kvs):
        """The exact per-layer K (or V) [n, H, D] as the cache must hold it."""
        out = []
        for x in kvs:
            x = np.asarray(x, np.float64).reshape(-1, self.heads, self.dim)
            f = x.shape[0] // self.bs * self.bs
            side = self.cache.format.k if kvs is self._k else self.cache.format.v
            blocks = x[:f].reshape(-1, self.bs, self.heads, self.dim)
            out.append(np.concatenate([side.decode(side.encode(blocks), self.bs, self.heads, self.dim)
                                       .reshape(-1, self.heads, self.dim), x[f:]]))
        return out

    def check(self):
        def expected(tokens, layers, heads, dim):
            k, v = small_kv(tokens, layers, heads, dim)
            self._k = k
            return self.stored(k), self.stored(v)

        tp.kv_values = expected
        try:
            super().check()
        finally:
            tp.kv_values = small_kv


REAL_KV = tp.kv_values


def small_kv(tokens, layers, heads, dim):
    """The harness' K/V scaled into fp16's range (its raw values reach 1e6)."""
    k, v = REAL_KV(tokens, layers, heads, dim)
    return [x / 1e5 for x in k], [x / 1e5 for x in v]


@pytest.mark.parametrize("kv", ["int8", "kivi2", "fp8", "k16v8"])
def test_random_operations_keep_every_invariant_on_quantized_blocks(kv):
    done = {"ops": 0, "failures": 0}

    @settings(max_examples=4, deadline=None, database=None)
    @given(seed=st.integers(0, 2**32 - 1))
    def run(seed):
        h = QuantHarness(seed, kv)
        for _ in range(250):
            h.step()
        h.finish()
        done["ops"] += h.ops
        done["failures"] += h.failures

    tp.kv_values = small_kv
    try:
        run()
    finally:
        tp.kv_values = REAL_KV
    assert done["ops"] >= 1000 and done["failures"] > 0


# --- sharing, fork, preemption: the quantized cache equals its own token-by-token run -----------------------

@pytest.mark.parametrize("kv", LOSSY)
def test_prefix_hit_on_quantized_blocks_gives_the_same_logits_as_no_sharing(kv):
    a, b = IDS[:27], IDS[:19] + IDS[40:50]
    shared = qcache(M64, kv)
    shared.add_sequence("a", a)
    M64.forward([a], shared, ["a"])
    shared.free_sequence("a")
    cached = shared.add_sequence("b", b)
    assert cached == 16 and all(shared.quantized[shared.blocks.table("b")[:2]])
    got = M64.forward([b[cached:]], shared, ["b"], all_logits=True)
    alone = qcache(M64, kv, enable_prefix_caching=False)
    alone.add_sequence("b")
    want = M64.forward([b], alone, ["b"], all_logits=True)[cached:]
    assert rel_err(got, want) <= 1e-10
    assert rel_err(want, token_by_token(M64, qcache(M64, kv), b)[cached:]) <= 1e-10  # batching changes nothing


@pytest.mark.parametrize("kv", ["int8", "kivi2", "fp8_e5m2"])
def test_fork_copies_the_residual_block_once_and_both_branches_stay_exact(kv):
    cache = qcache(M64, kv)
    cache.add_sequence("a")
    M64.forward([IDS[:13]], cache, ["a"])  # a full quantized block + 5 residual tokens
    cache.fork("a", "b")
    before = [cache.stored_block(layer, cache.blocks.table("a")[0]) for layer in range(2)]
    out_b = M64.forward([[IDS[30]]], cache, ["b"])[0]
    assert cache.blocks.cow_copies == 1 and cache.blocks.table("a")[0] == cache.blocks.table("b")[0]
    out_a = M64.forward([[IDS[13]]], cache, ["a"])[0]
    assert [cache.stored_block(layer, cache.blocks.table("a")[0]) for layer in range(2)] == before
    ref_b = token_by_token(M64, qcache(M64, kv), IDS[:13] + [IDS[30]])[-1]
    ref_a = token_by_token(M64, qcache(M64, kv), IDS[:14])[-1]
    assert rel_err(out_b, ref_b) <= 1e-10 and rel_err(out_a, ref_a) <= 1e-10


REQUESTS = [Request(f"r{i}", np.random.default_rng(i).integers(0, 61, int(3 + 4 * i)).tolist(), 10 + i)
            for i in range(5)]


@pytest.mark.parametrize("kv", ["int8", "kivi2"])
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_preempted_requests_get_the_tokens_of_an_unpreempted_run(kv, preemption):
    roomy = Scheduler(M64, qcache(M64, kv, num_blocks=64, bs=4)).run(REQUESTS)
    tight = Scheduler(M64, qcache(M64, kv, num_blocks=9, bs=4, num_host_blocks=40), preemption=preemption)
    got = tight.run(REQUESTS)
    assert tight.stats.preemptions > 0
    assert got == roomy
    alone = token_by_token(M64, qcache(M64, kv, bs=4), REQUESTS[1].prompt_ids + roomy["r1"][:-1])
    assert np.argmax(alone[len(REQUESTS[1].prompt_ids) - 1:], axis=-1).tolist() == roomy["r1"]


# --- accuracy: per-tile dequantization is exact; the loss is the codec's ---------------------------------

@pytest.mark.parametrize("kv", LOSSY)
def test_attention_equals_dequantize_everything_then_exact_attention(kv):
    """Decode steps on a one-layer cache: attend() == causal attention over read_kv's stored history."""
    rng = np.random.default_rng(1)
    cache = QuantizedPagedKVCache(1, 2, 32, num_blocks=16, block_size=BS, kv_dtype=kv, group=GROUP.get(kv, 32),
                                  blocks_per_tile=1)
    cache.add_sequence(0)
    k, v = (rng.standard_normal((40, 2, 32)).astype(np.float32) for _ in range(2))
    with cache.step([0], [20]):
        cache.write(0, k[:20], v[:20])
    for t in range(20, 40):
        q = rng.standard_normal((1, 6, 32)).astype(np.float32)
        with cache.step([0], [1]):
            cache.write(0, k[t:t + 1], v[t:t + 1])
            got = cache.attend(0, q)
        ks, vs = cache.read_kv(0, 0)  # after commit: exactly the history that query saw
        want = causal_attention(q.transpose(1, 0, 2), ks.transpose(1, 0, 2), vs.transpose(1, 0, 2))
        assert got.dtype == np.float32
        assert_close(got, want.transpose(1, 0, 2), rtol=KERNEL_RTOL, what=f"{kv} step {t}")
    dk, _ = dequantized_pools(cache, 0)
    assert np.array_equal(dk[cache.blocks.table(0)[:5]].reshape(-1, 2, 32), cache.read_kv(0, 0)[0])


# Worst relative error per value, as a fraction of its group's largest |x| (the codec's step / 2; q4_0:
# its clipped side costs a whole step, 1/8; fp8: half a mantissa step of the largest value)
CODEC_EPS = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8, "int8": 1 / 254, "int4": 1 / 8, "q4_1": 1 / 30,
             "kivi2": 1 / 6, "kivi4": 1 / 30, "fp8": 2.0 ** -4, "fp8_e5m2": 2.0 ** -3, "k16v8": 1 / 254}


@pytest.mark.parametrize("kv", LOSSY)
def test_lossy_logits_stay_close_to_exact(kv):
    """A perturbation of K/V by eps (relative) moves this tiny 2-layer model's logits by ~eps x its
    amplification; 8 bounds it (measured 0.7-3.6 x eps across the codecs). A sanity bound, not a quality claim."""
    got = token_by_token(M64, qcache(M64, kv), IDS[:40])
    want = M64.logits(IDS[:40])
    err = rel_err(got, want)
    assert 0 < err <= 8 * CODEC_EPS[kv], err


@pytest.mark.parametrize("kv", LOSSY)
def test_attention_error_within_the_perturbation_bound(kv):
    """Derived: with stored K' = K + dK, V' = V + dV, every score moves by at most
    delta = max_j |q . dK_j| / sqrt(D), so each softmax weight by a factor in [e^-2delta, e^2delta], and
    |out' - out| <= max|dV| + (e^(2 delta) - 1) max|V| per head (plus float32 rounding)."""
    rng = np.random.default_rng(2)
    cache = QuantizedPagedKVCache(1, 2, 32, num_blocks=16, block_size=BS, kv_dtype=kv, group=GROUP.get(kv, 32))
    cache.add_sequence(0)
    k, v = (rng.standard_normal((41, 2, 32)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((1, 6, 32)).astype(np.float32)
    with cache.step([0], [40]):
        cache.write(0, k[:40], v[:40])
    with cache.step([0], [1]):
        cache.write(0, k[40:], v[40:])
        got = cache.attend(0, q)[0].astype(np.float64)                                      # [Hq, D]
    ks, vs = cache.read_kv(0, 0)
    k64, v64, q64 = (x.astype(np.float64) for x in (k, v, q))
    exact = causal_attention(q64.transpose(1, 0, 2), k64.transpose(1, 0, 2), v64.transpose(1, 0, 2))[:, 0]
    kv_head = np.arange(6) // 3
    dk, dv = (ks - k64)[:, kv_head], (vs - v64)[:, kv_head]                                  # [S, Hq, D]
    delta = np.abs(np.einsum("hd,shd->sh", q64[0], dk)).max(axis=0) / np.sqrt(32)             # [Hq]
    bound = np.abs(dv).max(axis=(0, 2)) + np.expm1(2 * delta) * np.abs(v64[:, kv_head]).max(axis=(0, 2))
    err = np.abs(got - exact).max(axis=1)
    assert np.all(err <= bound + 1e-5), (err, bound)
    assert np.all(err > 0)  # it really is lossy


class Boom(Exception):
    pass


@pytest.mark.parametrize("kv", ["int8", "kivi4"])
def test_a_rolled_back_step_that_would_fill_blocks_leaves_no_trace(kv):
    cache = qcache(M64, kv)
    cache.add_sequence(0)
    M64.forward([IDS[:13]], cache)
    table = cache.blocks.table(0).tolist()
    before = ([cache.stored_block(layer, table[0]) for layer in range(2)], cache.quantized.copy(),
              cache.quantize_count.copy(), cache.k_pool[:, table[1], :5].copy(), cache.v_pool[:, table[1], :5].copy())
    with pytest.raises(Boom), cache.step([0], [12]):  # would fill block 1 and block 2
        for layer in range(2):
            cache.write(layer, np.ones((12, 2, 32)), np.ones((12, 2, 32)))
        raise Boom
    assert cache.length(0) == 13 and cache.blocks.table(0).tolist() == table
    assert [cache.stored_block(layer, table[0]) for layer in range(2)] == before[0]  # the quantized block
    assert np.array_equal(cache.quantized, before[1]) and np.array_equal(cache.quantize_count, before[2])
    # the residual rows of the 5 tokens held (the step's writes past them are stale slots, as in step 3)
    assert np.array_equal(cache.k_pool[:, table[1], :5], before[3])
    assert np.array_equal(cache.v_pool[:, table[1], :5], before[4])
    got = np.stack([M64.forward([[t]], cache)[0] for t in IDS[13:20]])
    assert rel_err(got, token_by_token(M64, qcache(M64, kv), IDS[:20])[13:]) <= 1e-10


@pytest.mark.parametrize("kv", ["int8", "kivi2"])
def test_chunked_prefill_gives_the_tokens_of_whole_prompts(kv):
    whole = Scheduler(M64, qcache(M64, kv, bs=4)).run(REQUESTS)
    chunked = Scheduler(M64, qcache(M64, kv, bs=4), max_step_tokens=5).run(REQUESTS)
    assert chunked == whole


@pytest.mark.parametrize("kv", ["int8", "kivi2", "fp8"])
def test_a_failed_step_keeps_the_rows_truncate_needs(kv):
    """Issue 25: a step that fails used to clear the full-precision rows the step before it kept, so a
    truncate into that step's tokens was refused (RollbackError) although nothing had changed."""
    from minikv.errors import InvalidInputError

    def new():
        c = QuantizedPagedKVCache(2, 2, 32, num_blocks=16, block_size=4, dtype=np.float64, kv_dtype=kv, group=4)
        c.add_sequence(0)
        return c

    rng = np.random.default_rng(5)
    rows = [rng.standard_normal((n, 2, 32)) for n in (3, 6, 2)]
    got, ref = new(), new()
    for c in (got, ref):
        for k in rows[:2]:  # the second step fills (and quantizes) block 1
            with c.step([0], [len(k)]):
                for layer in range(2):
                    c.write(layer, k, k)
    with pytest.raises(InvalidInputError, match="wrote no K/V"):  # a step that fails: only layer 0 wrote
        with got.step([0], [2]):
            got.write(0, rows[2], rows[2])
    for c in (got, ref):
        c.truncate(0, 5)  # back into block 1, which the last committed step quantized
    assert got.length(0) == ref.length(0) == 5
    for layer in range(2):
        for pool in ("k_pool", "v_pool"):
            t_got, t_ref = got.blocks.table(0)[-1], ref.blocks.table(0)[-1]
            assert np.array_equal(getattr(got, pool)[layer, t_got, :1], getattr(ref, pool)[layer, t_ref, :1])
