"""The textbook (minikv/textbook/) bound to the engine, lesson by lesson.

* Logits: each lesson's cache and its engine chapter's cache run the same steps of a tiny random
  model in float64 (odd sizes, GQA and MQA, both RoPE layouts; several sequences of different
  lengths in one step, prefill, chunks, decodes) and must agree within 1e-12 relative
  (``rel_err``: max |a - b| / max |b|). Every pool of the lesson starts full of NaN.
* SmolLM2: each lesson's ``main`` generates through the lesson and through the engine; the
  greedy tokens must be identical (``model`` marker; step 9 on Gemma-3-270M, ``gemma`` marker).
* Form: every lesson runs as a module, stays within 200 lines of code and fences its new lines.
* Mutations: a lesson with a wrong slot mapping, a missing mask, a ring without sinks, a prefix hit that
  copies no window or a ring without rollback slots must diverge.

The exercises (exercises/README.md) run selections of these tests with the learner's function
swapped into the lesson module, so the tests call lesson functions through their module
(``s1.softmax``), never through a name imported here. Nothing here imports torch or mpi4py at
import time (``make exercise`` installs neither).
"""

from __future__ import annotations

import functools
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from minikv.bench.equivalence import rel_err
from minikv.textbook import LESSONS
from minikv.textbook import s1_attention as s1
from minikv.textbook import s2_kv_cache as s2
from minikv.textbook import s3_paged as s3
from minikv.textbook import s3b_sharing_batching as s3b
from minikv.textbook import s4_mla as s4
from minikv.textbook import s5_quant as s5
from minikv.textbook import s6_window as s6
from minikv.textbook import s7_rollback as s7
from minikv.textbook import s8_heads as s8
from minikv.textbook import s9_hybrid as s9
from minikv.weights.random_models import default_mla, random_gemma_model, random_mla_model, random_model
from tests.test_layout import code_lines  # the one counter of code lines (DESIGN.md sizes)

ROOT = Path(__file__).resolve().parents[1]
RTOL = 1e-12
ERRORS: dict = {}  # lesson -> the largest relative error measured (printed at the end with -s)

MODELS = {
    "gqa": dict(num_heads=9, num_kv_heads=3, hidden_size=36, head_dim=6, intermediate_size=50, vocab_size=97),
    "mqa-interleaved": dict(num_heads=5, num_kv_heads=1, hidden_size=30, head_dim=10, intermediate_size=38,
                            vocab_size=89, rope_layout="interleaved"),
    "mha": dict(num_heads=3, num_kv_heads=3, hidden_size=21, head_dim=4, intermediate_size=26, vocab_size=61),
    "q8": dict(num_heads=6, num_kv_heads=2, hidden_size=48, head_dim=32, intermediate_size=40, vocab_size=83,
               rope_layout="interleaved"),  # q8_0 groups 32 values along D
}


@functools.cache
def tiny(kind: str):
    return random_model(dtype=np.float64, seed=len(kind), **MODELS[kind])


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    print("\nlargest relative error per lesson:", {k: f"{v:.2g}" for k, v in sorted(ERRORS.items())})


def check(lesson: str, got: np.ndarray, want: np.ndarray) -> None:
    err = rel_err(got, want)
    assert np.all(np.isfinite(got)) and err <= RTOL, f"{lesson}: relative error {err:.3g} > {RTOL}"
    ERRORS[lesson] = max(ERRORS.get(lesson, 0.0), err)


def poison(*arrays: np.ndarray) -> None:
    for a in arrays:
        a[...] = np.nan


def steps_for(vocab: int, seed: int = 0) -> list[dict]:
    """Three sequences: a packed prefill of 7, 4 and 11 tokens, decodes, chunks, and a lone sequence."""
    rng = np.random.default_rng(seed)
    ids = lambda n: rng.integers(0, vocab, n).tolist()  # noqa: E731
    return [{0: ids(7), 1: ids(4), 2: ids(11)}, {0: ids(1), 1: ids(1), 2: ids(1)}, {0: ids(1), 2: ids(3)},
            {1: ids(5)}, {0: ids(1), 1: ids(1), 2: ids(1)}, {2: ids(1)}, {0: ids(2), 1: ids(1), 2: ids(1)}]


def run_both(lesson: str, model, mine, engine, steps: list[dict], after=None) -> None:
    """Feed the same steps to the lesson's cache and the engine's; every logit row must agree."""
    for seq_id in sorted({s for step in steps for s in step}):
        mine.add_sequence(seq_id)
        engine.add_sequence(seq_id)
    for step in steps:
        seq_ids = list(step)
        toks = [step[s] for s in seq_ids]
        check(lesson, model.forward(toks, mine, seq_ids, all_logits=True),
              model.forward(toks, engine, seq_ids, all_logits=True))
        if after is not None:
            after()


# --- step 1 ----------------------------------------------------------------------------------------

def test_s1_softmax_is_stable_normalized_and_keeps_its_dtype():
    x = np.array([[1000.0, 1001.0, 1002.0], [0.0, 1.0, 2.0]], dtype=np.float32)
    p = s1.softmax(x)
    assert p.dtype == np.float32 and np.all(np.isfinite(p))
    np.testing.assert_allclose(p[0], p[1], rtol=1e-6)
    np.testing.assert_allclose(p.sum(axis=-1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(s1.softmax(x, axis=0)[:, 0], [1.0, 0.0], atol=1e-6)


def test_s1_softmax_of_a_fully_masked_row_is_zeros_and_of_no_keys_is_empty():
    p = s1.softmax(np.array([[-np.inf, -np.inf], [0.0, -np.inf]]))
    np.testing.assert_array_equal(p, [[0.0, 0.0], [1.0, 0.0]])
    assert s1.softmax(np.zeros((3, 0), dtype=np.float32)).shape == (3, 0)


@pytest.mark.parametrize("hq, hkv, t, s", [(6, 2, 5, 5), (4, 1, 1, 9), (3, 3, 4, 7)])
def test_s1_causal_attention_equals_the_engine(hq, hkv, t, s):
    from minikv.attention import causal_attention

    rng = np.random.default_rng(hq * t)
    q, k, v = rng.standard_normal((hq, t, 8)), rng.standard_normal((hkv, s, 8)), rng.standard_normal((hkv, s, 8))
    check("s1", s1.causal_attention(q, k, v), causal_attention(q, k, v))


@pytest.mark.parametrize("kind", ["gqa", "mqa-interleaved"])
def test_s1_no_cache_equals_the_engine_no_cache(kind):
    from minikv.kv_cache import NoCache

    model = tiny(kind)
    seqs = {0: [], 1: [], 2: []}
    for step in steps_for(model.config.vocab_size):  # no cache: every pass feeds each sequence's whole history
        for s, new in step.items():
            seqs[s] += new
        toks = [seqs[s] for s in step]
        check("s1", model.forward(toks, s1.NoCache(**model.new_cache_args()), list(step), all_logits=True),
              model.forward(toks, NoCache(**model.new_cache_args(), dtype=np.float64), list(step), all_logits=True))


# --- step 2 ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("tile", [1, 3, 7, 40])
def test_s2_online_softmax_over_any_tiles_equals_one_softmax_and_never_leaks_nan(tile):
    rng = np.random.default_rng(tile)
    scores, values = rng.standard_normal((2, 5, 37)) * 4, rng.standard_normal((2, 37, 6))
    mask = rng.random((5, 37)) < 0.7
    mask[3] = False                  # a query that sees nothing
    mask[:, 30:] = False             # keys nobody sees: stale slots
    values[:, 30:] = np.nan
    m, l, acc = s2.online_softmax_start((2, 5), 6, np.float64)
    for k0 in range(0, 37, tile):
        sl = slice(k0, k0 + tile)
        m, l, acc = s2.online_softmax_update(m, l, acc, scores[..., sl], values[:, sl], mask[:, sl])
    want = s1.softmax(np.where(mask, scores, -np.inf)) @ np.where(mask.any(0)[:, None], values, 0)
    check("s2", s2.online_softmax_finish(m, l, acc), want)
    assert np.all(s2.online_softmax_finish(m, l, acc)[:, 3] == 0)


@pytest.mark.parametrize("tile", [1, 5, 64])
@pytest.mark.parametrize("kind", ["gqa", "mqa-interleaved", "mha"])
def test_s2_contiguous_cache_equals_the_engine(kind, tile):
    from minikv.kv_cache import ContiguousKVCache

    model = tiny(kind)
    mine = s2.ContiguousCache(**model.new_cache_args(), max_seqs=3, max_len=24, dtype=np.float64, tile=tile)
    poison(mine.k, mine.v)
    engine = ContiguousKVCache(**model.new_cache_args(), max_seqs=3, max_len=24, dtype=np.float64)
    run_both("s2", model, mine, engine, steps_for(model.config.vocab_size))


# --- step 3 ----------------------------------------------------------------------------------------

def test_s3_slot_mapping_reads_the_block_table():
    np.testing.assert_array_equal(s3.slot_mapping([7, 2], np.arange(6), 4), [28, 29, 30, 31, 8, 9])
    np.testing.assert_array_equal(s3.slot_mapping([3, 0, 5], np.array([8, 2, 5]), 3), [17, 11, 2])


def paged_pair(model, block_size: int, cls=s3.PagedCache, num_blocks: int = 64, **engine_options):
    from minikv.paged import PagedKVCache

    mine = cls(**model.new_cache_args(), num_blocks=num_blocks, block_size=block_size, dtype=np.float64,
               tile_blocks=2)
    poison(mine.k_pool, mine.v_pool)
    engine = PagedKVCache(**model.new_cache_args(), num_blocks=num_blocks, block_size=block_size, dtype=np.float64,
                          **{"enable_prefix_caching": False, **engine_options})
    return mine, engine


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
@pytest.mark.parametrize("kind", ["gqa", "mqa-interleaved"])
def test_s3_paged_cache_equals_the_engine(kind, block_size):
    model = tiny(kind)
    mine, engine = paged_pair(model, block_size)
    run_both("s3", model, mine, engine, steps_for(model.config.vocab_size))
    assert len(mine.allocator.free_ids) == engine.blocks.num_free  # blocks taken only as sequences grow


def diverges(model, mine, engine, steps) -> float:
    """The largest relative error of the lesson's logits (NaN counts as infinite) over the steps."""
    worst = 0.0
    for seq_id in sorted({s for step in steps for s in step}):
        mine.add_sequence(seq_id)
        engine.add_sequence(seq_id)
    for step in steps:
        a = model.forward([step[s] for s in step], mine, list(step), all_logits=True)
        b = model.forward([step[s] for s in step], engine, list(step), all_logits=True)
        worst = max(worst, rel_err(a, b) if np.all(np.isfinite(a)) else np.inf)
    return worst


def test_s3_mutation_a_wrong_slot_mapping_diverges(monkeypatch):
    model = tiny("gqa")
    monkeypatch.setattr(s3, "slot_mapping", lambda table, pos, bs: np.asarray(table)[pos // bs] + pos % bs)
    assert diverges(model, *paged_pair(model, 4), steps_for(model.config.vocab_size)) > 1e-3


def test_s3_mutation_a_missing_mask_reads_the_stale_nan_slots():
    class Unmasked(s3.PagedCache):
        def tiles(self, layer, seq_id, q_pos):
            for k, v, mask in super().tiles(layer, seq_id, q_pos):
                yield k, v, np.ones_like(mask)

    model = tiny("gqa")
    assert diverges(model, *paged_pair(model, 3, Unmasked), steps_for(model.config.vocab_size)) == np.inf


# --- step 3b ---------------------------------------------------------------------------------------

def test_s3b_allocator_counts_owners_and_keeps_freed_prefixes_findable():
    a = s3b.SharingAllocator(3)
    b = a.allocate()
    a.register(b, 1234)
    a.hold(b)
    a.free(b)
    assert a.refs[b] == 1 and b not in a.free_ids  # one owner left
    a.free(b)
    assert b in a.free_ids and a.cached[1234] == b  # free, and its prefix still findable
    a.hold(b)
    assert b not in a.free_ids and a.refs[b] == 1   # a hit revives it
    a.free(b)
    assert [a.allocate() for _ in range(3)][-1] == b and 1234 not in a.cached  # recycled last: the hash goes


def test_s3b_prefix_hits_equal_the_engine_and_so_do_the_logits():
    model = tiny("gqa")
    mine, engine = paged_pair(model, 4, s3b.SharingCache, num_blocks=24, enable_prefix_caching=True)
    rng = np.random.default_rng(5)
    base = rng.integers(0, 97, 9).tolist()
    prompts = {0: base + [1, 2, 3], 1: base + [4, 5], 2: base + [1, 2, 3], 3: base[:8]}

    def run(seq_id, toks):
        check("s3b", model.forward([toks], mine, [seq_id], all_logits=True),
              model.forward([toks], engine, [seq_id], all_logits=True))

    for seq_id, prompt in prompts.items():
        hit = mine.add_sequence(seq_id, prompt)
        assert hit == engine.add_sequence(seq_id, prompt), seq_id
        run(seq_id, prompt[hit:])
        for tok in rng.integers(0, 97, 3).tolist():  # decode: the caller declares each token it feeds
            mine.tokens[seq_id].append(tok)
            engine.blocks.extend_token_ids(seq_id, [tok])
            run(seq_id, [tok])
        if seq_id == 0:
            mine.free_sequence(0)  # its full blocks stay findable: sequence 2 revives them
            engine.free_sequence(0)
    assert [mine.length(s) for s in (1, 2, 3)] == [engine.length(s) for s in (1, 2, 3)]
    assert engine.blocks.prefix_hit_tokens == 8 + 8 + 4


def test_s3b_fork_copies_exactly_one_block_on_write_and_equals_the_engine():
    model = tiny("mqa-interleaved")
    mine, engine = paged_pair(model, 4, s3b.SharingCache, num_blocks=12, enable_prefix_caching=True)
    prompt = [5, 6, 7, 8, 9, 10]  # two blocks, the second half full: the one a write must copy
    for cache in (mine, engine):
        cache.add_sequence(0, prompt)
    check("s3b", model.forward([prompt], mine, all_logits=True), model.forward([prompt], engine, all_logits=True))
    mine.fork(0, 1)
    engine.fork(0, 1)
    free = len(mine.allocator.free_ids)
    for toks in ([[11], [12]], [[13], [14]], [[15, 16], [17]]):
        for s, t in enumerate(toks):
            mine.tokens[s] += t
            engine.blocks.extend_token_ids(s, t)
        check("s3b", model.forward(toks, mine, [0, 1], all_logits=True),
              model.forward(toks, engine, [0, 1], all_logits=True))
        if toks[0] == [11]:
            assert free - len(mine.allocator.free_ids) == 1 == engine.blocks.cow_copies  # one copy, for one writer
    mine.free_sequence(0)
    mine.free_sequence(1)
    assert sorted(mine.allocator.free_ids) == list(range(12))


def test_s3b_continuous_batching_gives_the_schedulers_answers():
    model = tiny("gqa")
    rng = np.random.default_rng(9)
    base = rng.integers(0, 97, 8).tolist()
    prompts = [base + rng.integers(0, 97, n).tolist() for n in (3, 1, 6, 2, 5)]
    mine = s3b.SharingCache(**model.new_cache_args(), num_blocks=9, block_size=4, dtype=np.float64)
    poison(mine.k_pool, mine.v_pool)
    hits = []
    mine.add_sequence = lambda seq_id, ids, add=mine.add_sequence: hits.append(add(seq_id, ids)) or hits[-1]
    assert s3b.serve(model, mine, prompts, 6) == s3b.scheduled(model, prompts, 6, num_blocks=9, block_size=4)
    assert sum(hits) > 0 and len(mine.allocator.free_ids) == 9  # prompts shared blocks; all returned at the end


# --- step 4 ----------------------------------------------------------------------------------------

MLAS = {"default": None, "half-rope-qlora": dict(rope_interleave=False, q_lora_rank=7),
        "wide": dict(kv_lora_rank=16, qk_nope_head_dim=6, qk_rope_head_dim=2, v_head_dim=5)}


@pytest.mark.parametrize("engine_kind", ["contiguous-absorbed", "contiguous-auto", "paged-absorbed"])
@pytest.mark.parametrize("mla", list(MLAS))
def test_s4_latent_cache_equals_the_engine(mla, engine_kind):
    from minikv.mla import LatentContiguousKVCache, LatentPagedKVCache

    model = random_mla_model(None if MLAS[mla] is None else default_mla(**MLAS[mla]), dtype=np.float64)
    mine = s4.LatentCache(**model.new_cache_args(), max_seqs=3, max_len=24, dtype=np.float64, tile=4)
    poison(mine.k)
    kind, form = engine_kind.split("-")
    engine = (LatentContiguousKVCache(**model.new_cache_args(), max_seqs=3, max_len=24, dtype=np.float64, form=form)
              if kind == "contiguous" else
              LatentPagedKVCache(**model.new_cache_args(), num_blocks=30, block_size=3, dtype=np.float64, form=form))
    run_both("s4", model, mine, engine, steps_for(model.config.vocab_size))


# --- step 5 ----------------------------------------------------------------------------------------

def test_s5_q8_0_bytes_equal_llama_cpp_and_the_engine():
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from minikv.quant.codecs import decode_q8_0, encode_q8_0

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((5, 3, 64)) * 3).astype(np.float32)
    x[0, 0, :32] = 0                                      # an all-zero group: d = 0, codes 0
    x[1, 1, :32] = np.arange(32) - 12.5                   # ties: x/d lands on .5
    b = s5.encode_q8_0(x)
    assert b.dtype == np.uint8 and b.shape == (5, 3, 68)
    np.testing.assert_array_equal(b, quantize(x, GGMLQuantizationType.Q8_0))
    np.testing.assert_array_equal(b, encode_q8_0(x))
    np.testing.assert_array_equal(s5.decode_q8_0(b), decode_q8_0(b))
    assert s5.decode_q8_0(b).dtype == np.float32 and s5.decode_q8_0(b[:0]).shape == (0, 3, 64)


@pytest.mark.parametrize("block_size", [1, 3, 4])
def test_s5_quantized_cache_equals_the_engine(block_size):
    from minikv.quant import QuantizedPagedKVCache

    model = tiny("q8")
    mine = s5.QuantCache(**model.new_cache_args(), num_blocks=64, block_size=block_size, dtype=np.float64,
                         tile_blocks=2)
    poison(mine.k_pool, mine.v_pool)
    mine.k_codes[:], mine.v_codes[:] = 0xFF, 0xFF  # as codes, 0xFFFF is an fp16 NaN scale
    engine = QuantizedPagedKVCache(**model.new_cache_args(), num_blocks=64, block_size=block_size,
                                   dtype=np.float64, kv_dtype="int8", enable_prefix_caching=False)

    def full_rows_dead():  # a full block lives in its codes only: its rows may hold anything from now on
        for sid, table in mine.tables.items():
            full = table[:mine.lens[sid] // block_size]
            mine.k_pool[:, full], mine.v_pool[:, full] = np.nan, np.nan

    run_both("s5", model, mine, engine, steps_for(model.config.vocab_size), after=full_rows_dead)


# --- step 6 ----------------------------------------------------------------------------------------

def test_s6_ring_slot_and_the_window_rule():
    np.testing.assert_array_equal(s6.ring_slot(np.arange(10), 6, 2), [0, 1, 2, 3, 4, 5, 2, 3, 4, 5])
    np.testing.assert_array_equal(s6.ring_slot(np.arange(6), 4, 0), [0, 1, 2, 3, 0, 1])
    seen = s6.visible(np.array([9]), np.array([-1, 0, 1, 5, 6, 9]), 6, 2)
    np.testing.assert_array_equal(seen, [[False, True, True, False, True, True]])


def window_pair(model, window: int, sinks: int, cls=s6.RingCache):
    from minikv.window import EvictingKVCache, WindowPolicy

    mine = cls(**model.new_cache_args(), window=window, sinks=sinks, max_seqs=3, dtype=np.float64)
    poison(mine.k, mine.v)
    return mine, EvictingKVCache(**model.new_cache_args(), policy=WindowPolicy(window, sinks), max_seqs=3,
                                 dtype=np.float64)


@pytest.mark.parametrize("window, sinks", [(5, 1), (4, 0), (6, 2), (3, 2), (40, 4)])
@pytest.mark.parametrize("kind", ["gqa", "mqa-interleaved"])
def test_s6_ring_equals_the_engine_window(kind, window, sinks):
    model = tiny(kind)
    mine, engine = window_pair(model, window, sinks)
    run_both("s6", model, mine, engine, steps_for(model.config.vocab_size))
    if window < 11:  # the 11-token prompt wrapped its ring: every slot holds a token
        assert (mine.pos[mine.ring[2]] >= 0).all()


def test_s6_mutation_a_ring_without_sinks_diverges(monkeypatch):
    model = tiny("gqa")
    monkeypatch.setattr(s6, "ring_slot", lambda p, window, sinks: p % window)
    assert diverges(model, *window_pair(model, 5, 2), steps_for(model.config.vocab_size)) > 1e-3


def test_s6_mutation_a_missing_window_mask_diverges(monkeypatch):
    model = tiny("gqa")
    monkeypatch.setattr(s6, "visible", lambda q, k, window, sinks: (k[None, :] >= 0) & (k[None, :] <= q[:, None]))
    assert diverges(model, *window_pair(model, 5, 1), steps_for(model.config.vocab_size)) > 1e-3


# --- step 7 ----------------------------------------------------------------------------------------

def test_s7_ngram_drafts_equal_the_engines():
    from minikv.speculative import ngram_draft

    rng = np.random.default_rng(7)
    for _ in range(500):
        ids, k = rng.integers(0, 4, rng.integers(0, 14)).tolist(), int(rng.integers(0, 5))
        assert s7.ngram_draft(ids, k) == ngram_draft(ids, k), (ids, k)


@pytest.mark.parametrize("block_size", [2, 4])
def test_s7_truncate_equals_the_engine_and_leaks_no_stale_row(block_size):
    model = tiny("gqa")
    mine, engine = paged_pair(model, block_size, s7.RollbackCache)
    rng = np.random.default_rng(block_size)
    steps = [{0: rng.integers(0, 97, 7).tolist(), 1: rng.integers(0, 97, 5).tolist()}]
    for cut in ((5, 4), (5, 1), (0, 1)):  # inside a block, on a block boundary, everything
        for s, new_len in enumerate(cut):
            steps.append(("truncate", s, new_len))
        steps += [{0: rng.integers(0, 97, 3).tolist(), 1: [3]}, {0: [4], 1: rng.integers(0, 97, 2).tolist()}]
    run_both("s7", model, mine, engine, [steps[0]])
    for step in steps[1:]:
        if step[0] == "truncate":
            _, s, new_len = step
            mine.truncate(s, new_len)
            engine.truncate(s, new_len)
            stale = s3.slot_mapping(mine.tables[s], np.arange(new_len, len(mine.tables[s]) * block_size), block_size)
            for pool in (mine.k_pool, mine.v_pool):
                pool.reshape(model.config.num_layers, -1, *pool.shape[3:])[:, stale] = np.nan
            continue
        check("s7", model.forward(list(step.values()), mine, list(step), all_logits=True),
              model.forward(list(step.values()), engine, list(step), all_logits=True))
        assert len(mine.allocator.free_ids) == engine.blocks.num_free


class CountingModel:
    """A model that counts its forward passes."""

    def __init__(self, model):
        self.model, self.config, self.passes = model, model.config, 0

    def forward(self, *args, **kwargs):
        self.passes += 1
        return self.model.forward(*args, **kwargs)


@pytest.fixture
def engine_drafts_on_any_match(monkeypatch):
    """The lesson drafts from any n-gram match (down to one token); the engine's decode loop only from a match of
    ``MIN_NGRAM`` = 2, and of ``MISS_NGRAM`` = 3 after a wholly rejected draft (a performance rule,
    ``minikv/speculative.py`` "When to draft"). Pass for pass, the lesson is compared with the engine under the
    lesson's rule."""
    import functools

    import minikv.generate
    from minikv.speculative import speculative_decode

    monkeypatch.setattr(minikv.generate, "speculative_decode", functools.partial(speculative_decode, min_ngram=1,
                                                                                  miss_ngram=1))


@pytest.mark.parametrize("prompt", [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7, 8, 5, 6], [9]])
def test_s7_speculative_equals_greedy_and_the_engine_pass_for_pass(prompt, engine_drafts_on_any_match):
    from minikv.generate import generate

    model = tiny("gqa")
    counting = CountingModel(model)
    mine = s7.RollbackCache(**model.new_cache_args(), num_blocks=20, block_size=3, dtype=np.float64)
    poison(mine.k_pool, mine.v_pool)
    got = s7.speculative_greedy(counting, mine, prompt, 20)
    ref = generate(model, prompt, 20, cache="paged", block_size=3, speculative="ngram")
    plain = s1.greedy(model, s3.PagedCache(**model.new_cache_args(), num_blocks=20, block_size=3,
                                           dtype=np.float64), prompt, 20)
    assert got == ref.token_ids == plain
    assert counting.passes == 1 + ref.speculative.steps  # the prefill, then one pass per verify step


# --- step 8 ----------------------------------------------------------------------------------------

def test_s8_heads_split_as_the_engine_plans():
    from minikv.parallel import head_plan

    for hq, hkv in ((9, 3), (6, 1), (6, 2), (8, 8)):
        for ranks in range(1, hq + 1):
            assert s8.split_heads(hq, hkv, ranks) == [(h.q, h.kv) for h in head_plan(hq, hkv, ranks)]


class _Group:
    def __init__(self, size: int):
        self.size, self.slots, self.barrier = size, [None] * size, threading.Barrier(size)
        self.lock, self.children = threading.Lock(), {}


class _Done:
    """A completed MPI request."""

    @staticmethod
    def Test():
        return True


_DONE = _Done()


class ThreadComm:
    """Just enough of an mpi4py communicator to run ``minikv.parallel.tensor.ParallelModel``'s ranks as threads."""

    def __init__(self, group: _Group, rank: int):
        self.group, self.rank, self.splits = group, rank, 0

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.group.size

    def allgather(self, obj):
        g = self.group
        g.slots[self.rank] = obj
        g.barrier.wait()
        out = list(g.slots)
        g.barrier.wait()
        return out

    def Allreduce(self, a, out, op):
        from mpi4py import MPI

        parts = self.allgather(np.array(a))
        out[...] = functools.reduce(np.add if op is MPI.SUM else np.maximum, parts)  # in rank order

    def Allgatherv(self, a, spec):
        spec[0][...] = np.concatenate([p.ravel() for p in self.allgather(np.array(a))])

    # The engine's collectives start nonblocking and wait under a watchdog (minikv.parallel.watchdog); the
    # threads' versions complete at once and hand back a request that says so.
    def Iallreduce(self, a, out, op):
        self.Allreduce(a, out, op)
        return _DONE

    def Iallgather(self, a, out):
        out[...] = np.stack(self.allgather(np.array(a))).reshape(out.shape)
        return _DONE

    def Iallgatherv(self, a, spec):
        self.Allgatherv(a, spec)
        return _DONE

    def Split(self, color, key):
        members = sorted((k, r) for c, k, r in self.allgather((color, key, self.rank)) if c == color)
        self.splits += 1
        with self.group.lock:
            sub = self.group.children.setdefault((self.splits, color), _Group(len(members)))
        return ThreadComm(sub, [r for _, r in members].index(self.rank))


def run_ranks(size: int, fn) -> list:
    """``fn(comm)`` on ``size`` threads, one communicator rank each; their results in rank order."""
    group, results, errors = _Group(size), [None] * size, []

    def rank(r):
        try:
            results[r] = fn(ThreadComm(group, r))
        except BaseException as e:  # noqa: BLE001  (re-raised below, after every thread stopped)
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("kind, ranks", [("gqa", 2), ("gqa", 3), ("gqa", 4), ("mqa-interleaved", 3), ("mha", 2)])
def test_s8_ranks_equal_the_engines_parallel_model(kind, ranks):
    pytest.importorskip("mpi4py", reason="the engine's ranks need mpi4py's MPI.SUM (the parallel extra)")
    from minikv.parallel import ParallelModel

    model = tiny(kind)
    steps = [[3, 4, 5, 6, 7], [8], [9], [1, 2], [10]]
    tp = s8.TensorParallel(model, ranks, 20)
    tp.add_sequence(0)
    for rank in tp.ranks:
        poison(rank.cache.k, rank.cache.v)
    mine = [tp.forward([ids])[0] for ids in steps]

    def engine_rank(comm):
        pm = ParallelModel(model, tp=ranks, comm=comm)
        cache = pm.make_cache("contiguous", 20)
        cache.add_sequence(0)
        return [pm.forward([ids], cache)[0] for ids in steps]

    for got, want in zip(mine, run_ranks(ranks, engine_rank)[0]):
        check("s8", got, want)
    hkv = model.config.num_kv_heads
    assert sum(r.cache.num_kv_heads for r in tp.ranks) == max(ranks, hkv)  # replicas past Hkv


def test_s8_ranks_give_the_plain_models_greedy_tokens():
    model = tiny("gqa")
    plain = s1.greedy(model, s2.ContiguousCache(**model.new_cache_args(), max_seqs=1, max_len=12, dtype=np.float64),
                      [3, 1, 4], 8)
    for ranks in (1, 2, 9):
        tp = s8.TensorParallel(model, ranks, 12)
        assert s1.greedy(tp, tp, [3, 1, 4], 8) == plain


# --- step 9 ----------------------------------------------------------------------------------------

GEMMAS = {"mqa": dict(), "gqa": dict(num_heads=6, num_kv_heads=2, head_dim=6, hidden_size=30, num_layers=7)}


@functools.cache
def tiny_gemma(kind: str, window: int):
    """A tiny Gemma-3-style hybrid (every 3rd layer full), float64."""
    return random_gemma_model(sliding_window=window, dtype=np.float64, seed=window, **GEMMAS[kind])


def hybrid_pair(model, rollback: int = 0, engine_kind: str = "contiguous", max_seqs: int = 3, **options):
    from minikv.hybrid import hybrid_cache

    c = model.config
    mine = s9.HybridCache(c.layer_windows, c.num_kv_heads, c.head_dim, max_seqs, 40, rollback, np.float64)
    for cache in mine.groups.values():
        poison(cache.k, cache.v)
    engine = hybrid_cache(engine_kind, c.layer_windows, c.num_kv_heads, c.head_dim, 40, max_seqs, np.float64,
                          block_size=2, num_blocks=200, rollback=rollback, **options)
    return mine, engine


def test_s9_the_layer_pattern_and_what_each_layer_keeps():
    from minikv.weights.gemma import gemma3_layer_types

    windows = s9.layer_windows(18, 512)
    assert [w is None for w in windows] == [t == "full_attention" for t in gemma3_layer_types(18)]
    n = 32_768  # Gemma-3-270M at 32k: the hybrid cache against every layer sized full
    assert sum(s9.kv_tokens(windows, n)) == 3 * n + 15 * 511
    assert round(1 - sum(s9.kv_tokens(windows, n)) / sum(s9.kv_tokens([None] * 18, n)), 2) == 0.82
    assert s9.kv_tokens(windows, 300) == [300] * 18  # below the window nothing is saved
    model = tiny_gemma("gqa", 4)
    c = model.config
    for k in (0, 2):
        mine, engine = hybrid_pair(model, rollback=k, max_seqs=1)
        engine.add_sequence(0)
        for n, step in enumerate(np.random.default_rng(k).integers(0, 97, (12, 1)), start=1):
            model.forward([step], engine)
            assert engine.bytes_used() == 2 * c.num_kv_heads * c.head_dim * 8 * sum(
                s9.kv_tokens(c.layer_windows, n, k)), (k, n)


@pytest.mark.parametrize("engine_kind", ["contiguous", "paged"])
@pytest.mark.parametrize("window", [1, 3, 4, 12])
@pytest.mark.parametrize("kind", list(GEMMAS))
def test_s9_hybrid_cache_equals_the_engine(kind, window, engine_kind):
    model = tiny_gemma(kind, window)
    mine, engine = hybrid_pair(model, engine_kind=engine_kind)
    run_both("s9", model, mine, engine, steps_for(model.config.vocab_size))
    ring = mine.groups[window]
    assert ring.k.shape[2] == window and (window > 11 or (ring.pos[ring.ring[2]] >= 0).all())  # wrapped


def prefix_hit(model, mine, engine, h: int, tail: int):
    """Sequence "a" runs h tokens; "b" = a's h tokens + ``tail`` more starts on a's prefix in both caches."""
    rng = np.random.default_rng(h)
    a, more = rng.integers(0, 97, h).tolist(), rng.integers(0, 97, tail).tolist()
    mine.add_sequence("a")
    engine.add_sequence("a", a)
    check("s9", model.forward([a], mine, ["a"], all_logits=True), model.forward([a], engine, ["a"], all_logits=True))
    assert mine.share_prefix("a", "b", h) and engine.add_sequence("b", a + more) == h
    return a + more


def test_s9_a_prefix_hit_needs_only_the_window_and_equals_the_engine():
    from minikv.bench.equivalence import assert_close

    model = tiny_gemma("gqa", 4)
    mine, engine = hybrid_pair(model, engine_kind="paged", enable_prefix_caching=True)
    b = prefix_hit(model, mine, engine, 12, 5)
    ring = mine.groups[4]
    assert not ring.holds("a", range(0, 12)) and ring.holds("a", s9.needed_for_hit(12, 4))  # the whole prefix: gone
    got = model.forward([b[12:]], mine, ["b"], all_logits=True)
    check("s9", got, model.forward([b[12:]], engine, ["b"], all_logits=True))
    assert_close(got, model.logits(b)[12:], np.float64, what="after the hit vs one uncached pass")
    assert not mine.share_prefix("a", "c", 6) and "c" not in mine.lens  # the ring no longer holds keys 3..5


def test_s9_mutation_a_hit_that_copies_no_window_diverges(monkeypatch):
    model = tiny_gemma("gqa", 4)
    mine, engine = hybrid_pair(model, engine_kind="paged", enable_prefix_caching=True)
    monkeypatch.setattr(s9, "needed_for_hit", lambda h, window: range(0 if window is None else h, h))
    b = prefix_hit(model, mine, engine, 12, 3)
    got = model.forward([b[12:]], mine, ["b"], all_logits=True)
    assert rel_err(got, model.forward([b[12:]], engine, ["b"], all_logits=True)) > 1e-3


def rollback_steps(model, mine, engine, k: int, seed: int) -> None:
    """After the rings wrapped: verify-like steps of 1 + j tokens (j <= k), then j or fewer taken back."""
    rng = np.random.default_rng(seed)
    run_both("s9", model, mine, engine, [{0: rng.integers(0, 97, 9).tolist()}, {0: rng.integers(0, 97, 3).tolist()}])
    for _ in range(6):
        j = int(rng.integers(0, k + 1))
        step = rng.integers(0, 97, 1 + j).tolist()
        check("s9", model.forward([step], mine, [0], all_logits=True),
              model.forward([step], engine, [0], all_logits=True))
        back = int(rng.integers(0, j + 1)) if j < k else j  # take back the most at least once in a while
        mine.truncate(0, mine.length(0) - back)
        engine.truncate(0, engine.length(0) - back)


@pytest.mark.parametrize("engine_kind", ["contiguous", "paged"])
@pytest.mark.parametrize("window, k", [(2, 3), (4, 2), (5, 4)])
def test_s9_rollback_of_up_to_k_after_the_ring_wrapped_equals_the_engine(window, k, engine_kind):
    model = tiny_gemma("mqa", window)
    mine, engine = hybrid_pair(model, rollback=k, engine_kind=engine_kind, max_seqs=1)
    rollback_steps(model, mine, engine, k, seed=window + k)
    assert mine.groups[window].k.shape[2] == window + k


def test_s9_mutation_a_ring_without_rollback_slots_diverges():
    model = tiny_gemma("mqa", 4)
    mine, _ = hybrid_pair(model, rollback=0, max_seqs=1)  # W slots: taking back 2 loses a key the next query needs
    _, engine = hybrid_pair(model, rollback=2, max_seqs=1)
    for cache in (mine, engine):
        cache.add_sequence(0)
        model.forward([list(range(9, 21))], cache)
        model.forward([[5, 6, 7]], cache)
        cache.truncate(0, 13)
    assert rel_err(model.forward([[8]], mine), model.forward([[8]], engine)) > 1e-3


@pytest.mark.parametrize("prompt", [[1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7, 8, 5, 6], [9]])
def test_s9_speculative_decoding_through_the_lesson_equals_greedy_and_the_engine(prompt, engine_drafts_on_any_match):
    from minikv.generate import generate

    model = tiny_gemma("gqa", 3)
    c = model.config
    counting = CountingModel(model)
    mine = s9.HybridCache(c.layer_windows, c.num_kv_heads, c.head_dim, 1, len(prompt) + 20, 4, np.float64)
    got = s7.speculative_greedy(counting, mine, prompt, 20, draft_len=4)
    ref = generate(model, prompt, 20, cache="contiguous", speculative="ngram", draft_len=4)
    assert got == ref.token_ids == generate(model, prompt, 20, cache="none").token_ids
    assert counting.passes == 1 + ref.speculative.steps


# --- every lesson: SmolLM2, runs as a module, size and fences ---------------------------------------

# s4 has no real MLA model here (its module run below uses a random one); s3 runs as a module below and s8
# against the engine's own two ranks: the other lessons through their main(), 8 new tokens each.
@pytest.mark.model
@pytest.mark.parametrize("lesson", [name for name in LESSONS
                                    if name not in ("s3_paged", "s4_mla", "s8_heads", "s9_hybrid")])
def test_smollm2_greedy_tokens_equal_the_engine(smollm2, lesson):
    import importlib

    mine, ref = importlib.import_module(f"minikv.textbook.{lesson}").main(8)
    assert mine == ref and all(len(ids) == 8 for ids in mine), (mine, ref)


@pytest.mark.model
def test_smollm2_s8_over_two_ranks_equals_the_engines_two_ranks(smollm2):
    pytest.importorskip("mpi4py", reason="the engine's ranks need mpi4py's MPI.SUM (the parallel extra)")
    from minikv.parallel import ParallelModel, generate
    from minikv.textbook.demo import QUESTIONS

    model, tok = smollm2
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}]))
    tp = s8.TensorParallel(model, 2, len(ids) + 8)
    ranks = run_ranks(2, lambda comm: generate(ParallelModel(model, tp=2, comm=comm), ids, 8).token_ids)
    assert s1.greedy(tp, tp, ids, 8) == ranks[0] == ranks[1]


@pytest.mark.gemma
@pytest.mark.slow
def test_gemma3_s9_speculative_tokens_past_the_window_equal_the_engine(gemma3):
    mine, ref = s9.main(8)
    assert mine == ref and all(len(ids) == 8 for ids in mine), (mine, ref)


def test_s4_runs_as_a_module_on_its_random_model():
    proc = subprocess.run([sys.executable, "-m", "minikv.textbook.s4_mla"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "the lesson's tokens equal the engine's" in proc.stdout, proc.stdout


@pytest.mark.model
def test_smollm2_s3_runs_as_a_module(smollm2_path):
    proc = subprocess.run([sys.executable, "-m", "minikv.textbook.s3_paged"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "step 3, paged cache: the lesson's tokens equal the engine's" in proc.stdout, proc.stdout


@pytest.mark.parametrize("lesson", LESSONS)
def test_each_lesson_is_short_and_fences_what_it_adds(lesson):
    text = (ROOT / "minikv" / "textbook" / f"{lesson}.py").read_text()
    assert code_lines(text) <= 200, f"{lesson}: {code_lines(text)} lines of code"
    step = lesson.split("_")[0][1:]
    opens, closes = text.count("# --- NEW in step "), text.count("# --- end NEW ---")
    if lesson == "s1_attention":
        assert opens == closes == 0
        return
    assert opens == closes >= 1 and text.count(f"# --- NEW in step {step} ---") == opens, lesson
    assert text.index(f"# --- NEW in step {step} ---") < text.index("# --- end NEW ---")
