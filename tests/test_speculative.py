"""Speculative decoding (minikv.speculative) and the cache rollback it needs (``cache.truncate``).

* the drafter: longest suffix first, latest occurrence, nothing without a match;
* speculative greedy == plain greedy, token for token, on every lossless cache (contiguous, paged with
  block sizes 1, 5, 16, quantized, MLA latent) and on SmolLM2;
* truncate then re-write == never having written the dropped tokens: bit-identical K/V and attention
  (contiguous, paged), identical stored bytes (quantized, including a block quantized by the step that
  is rolled back), identical logits through the model;
* sharing: a rollback never changes what another owner of a block reads, and the prefix cache never
  keeps a hash for a block whose tokens were dropped;
* typed errors for bad input, for caches that cannot roll back, and in generate / the CLI.
"""

import json

import numpy as np
import pytest

from minikv.bench.equivalence import assert_close
from minikv.cli import main
from minikv.errors import ConfigError, InvalidInputError, OutOfBlocksError, RollbackError, UnknownSequenceError
from minikv.generate import GREEDY, GenerationResult, SamplingParams, generate, make_cache
from minikv.kv_cache import ContiguousKVCache
from minikv.paged import PagedKVCache
from minikv.quant import QuantizedPagedKVCache
from minikv.speculative import MIN_NGRAM, MISS_NGRAM, SpecStats, ngram_draft, speculative_decode, verify
from minikv.weights.random_models import random_mla_model, random_model

PROMPT = [5, 7, 9, 11, 5, 7, 9, 11, 3, 4, 5, 7]  # repeats itself: the drafter finds matches at once
MIXED = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]  # on the GQA model every cache kind both accepts and rejects drafts


@pytest.fixture(scope="module")
def gqa():
    return random_model(dtype=np.float64, seed=1, head_dim=32)  # head_dim 32: room for q8_0's group


@pytest.fixture(scope="module")
def mla():
    return random_mla_model(dtype=np.float64, seed=2)


# --- the drafter ---------------------------------------------------------------------------------

def test_the_drafter_takes_the_longest_suffix_and_its_latest_occurrence():
    ids = [1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]
    assert ngram_draft(ids, 3) == [7, 5, 1]          # [1, 2, 3] last seen before 7, not before 9
    assert ngram_draft(ids, 9) == [7, 5, 1, 2, 3]    # runs up to the end of the text
    assert ngram_draft(ids, 3, max_ngram=1) == [7, 5, 1]  # [3]: its latest earlier occurrence too
    assert ngram_draft([4, 5, 6, 7, 5], 2) == [6, 7]  # n = 3, 2 miss; n = 1 ([5]) hits
    assert ngram_draft([4, 5, 6, 7, 5], 2, min_ngram=2) == []  # the engine's rule: a 1-token match drafts nothing
    assert ngram_draft(ids, 3, min_ngram=2) == [7, 5, 1]  # a 3-token match still drafts
    assert ngram_draft([1, 2, 3], 4) == [] and ngram_draft([8], 4) == [] and ngram_draft(ids, 0) == []
    for bad in (-1, 1.5, True):
        with pytest.raises(InvalidInputError, match="k="):
            ngram_draft(ids, bad)


# --- the decode loop's drafting rule ("When to draft") ---------------------------------------------------

class Scripted:
    """A model, and its cache, whose greedy next token after position j is ``text[j + 1]``: the loop's drafts
    are recorded, and accepted exactly where they copy the text."""

    def __init__(self, text: list[int], cached: int):
        self.text, self.n, self.drafts = text, cached, []

    def forward(self, seqs, cache, seq_ids, all_logits):
        fed = seqs[0]
        self.drafts.append(list(fed[1:]))
        logits = np.zeros((len(fed), max(self.text) + 1))
        logits[np.arange(len(fed)), self.text[self.n + 1:self.n + 1 + len(fed)]] = 1.0
        self.n += len(fed)
        return logits

    def length(self, seq_id):
        return self.n

    def truncate(self, seq_id, length):
        self.n = length


@pytest.mark.parametrize("miss_ngram", [MISS_NGRAM, MIN_NGRAM])  # MIN_NGRAM: the rule without the raise
def test_a_wholly_rejected_draft_raises_the_bar_until_one_is_accepted(miss_ngram):
    prompt = [1, 2, 9, 3, 4, 5, 10, 11, 8]
    answer = [1, 2, 7, 3, 4, 5, 10, 11, 1, 2, 9, 0]
    script = Scripted(prompt + answer, len(prompt))
    result = GenerationResult(prompt_ids=prompt)
    got = list(speculative_decode(script, script, list(prompt), answer[0], len(answer), None, result, draft_len=2,
                                  miss_ngram=miss_ngram))
    assert got == answer  # a rule changes which passes run, never a token
    drafted = [d for d in script.drafts if d]
    if miss_ngram == MISS_NGRAM:
        # [1, 2] drafts [9, 3]: wrong, so the 2-token match [3, 4] drafts nothing; the 3-token match [3, 4, 5]
        # drafts [10, 11]: right, and the bar is down again, so the 2-token match [1, 2] drafts [7] (one token
        # before max_new_tokens)
        assert drafted == [[9, 3], [10, 11], [7]]
    else:
        assert drafted == [[9, 3], [5, 10], [8, 1], [7]]  # every 2-token match drafts
    assert result.speculative.drafted_steps == len(drafted)


@pytest.mark.parametrize("bad, name", [
    (dict(miss_ngram=0), "miss_ngram"), (dict(miss_ngram=4), "miss_ngram"), (dict(miss_ngram="3"), "miss_ngram"),
    (dict(min_ngram=0), "min_ngram"), (dict(min_ngram=3, miss_ngram=2), "miss_ngram"),
    (dict(max_ngram=0), "max_ngram")])
def test_the_drafting_rule_refuses_bad_lengths_before_any_token(bad, name):
    steps = speculative_decode(None, None, [1, 2], 3, 5, None, GenerationResult(prompt_ids=[1, 2]), draft_len=2, **bad)
    with pytest.raises(InvalidInputError, match=f"{name}="):
        next(steps)  # the generator checks before it yields its first token


# --- speculative greedy == plain greedy ------------------------------------------------------------

LOSSLESS = {
    "contiguous": dict(cache="contiguous"),
    "paged-b1": dict(cache="paged", block_size=1),
    "paged-b5": dict(cache="paged", block_size=5),
    "paged-b16": dict(cache="paged", block_size=16),
}
QUANTIZED = {
    "int8-b5": dict(cache="paged", block_size=5, kv_dtype="int8"),
    "kivi2-r8": dict(cache="paged", kv_dtype="kivi2", group=8, residual=8),
    "fp8-b3": dict(cache="paged", block_size=3, kv_dtype="fp8", group=8),
}


def _both(model, kw: dict, n: int = 60, k: int = 4, prompt=PROMPT):
    plain = generate(model, prompt, n, sampling=GREEDY, **kw)
    spec = generate(model, prompt, n, sampling=GREEDY, speculative="ngram", draft_len=k, **kw)
    return plain, spec


@pytest.mark.parametrize("kind", [*LOSSLESS, *QUANTIZED])
@pytest.mark.parametrize("k", [2, 7])
def test_speculative_greedy_equals_plain_greedy(gqa, kind, k):
    plain, spec = _both(gqa, {**LOSSLESS, **QUANTIZED}[kind], k=k, prompt=MIXED)
    st = spec.speculative
    assert spec.token_ids == plain.token_ids and len(plain.token_ids) == 60
    assert 0 < st.accepted < st.drafted  # some drafts kept, some rolled back: both paths ran
    assert st.steps + st.accepted == 60 - 1  # every token after the first came from one verify pass
    assert 0 < st.drafted_steps <= st.steps and st.drafted_steps <= st.drafted <= k * st.drafted_steps


@pytest.mark.parametrize("kind", ["contiguous", "paged-b1", "paged-b5"])
def test_speculative_greedy_equals_plain_greedy_on_an_mla_latent_cache(mla, kind):
    plain, spec = _both(mla, LOSSLESS[kind], k=5)
    assert spec.token_ids == plain.token_ids and 0 < spec.speculative.accepted < spec.speculative.drafted


@pytest.mark.parametrize("n", [1, 2, 3])
def test_the_shortest_runs_and_eos(gqa, n):
    plain, spec = _both(gqa, LOSSLESS["paged-b5"], n=n, k=8)
    assert spec.token_ids == plain.token_ids and len(spec.token_ids) == n
    eos = generate(gqa, PROMPT, 30, sampling=GREEDY).token_ids[17]  # drafts may run past it, the output must not
    plain = generate(gqa, PROMPT, 30, sampling=GREEDY, eos_token_id=eos)
    spec = generate(gqa, PROMPT, 30, sampling=GREEDY, eos_token_id=eos, speculative="ngram", draft_len=6)
    assert spec.token_ids == plain.token_ids and spec.finish_reason == plain.finish_reason == "eos"


@pytest.mark.model
@pytest.mark.parametrize("cache,block_size", [("contiguous", 16), ("paged", 5)])
def test_speculative_equals_plain_on_smollm2(smollm2, cache, block_size):
    model, tok = smollm2
    code = "def area(width, height):\n    result = width * height\n    return result\n"
    text = f"Rewrite this function with `result` renamed to `total`. Reply with the code only.\n```python\n{code}```"
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))
    plain, spec = _both(model, dict(cache=cache, block_size=block_size), n=40, k=4, prompt=ids)
    assert spec.token_ids == plain.token_ids and spec.finish_reason == plain.finish_reason
    assert 5 <= spec.speculative.accepted < spec.speculative.drafted  # the answer copies the prompt's code


# --- verify with chosen drafts: accepted prefix, bonus, rollback across blocks ---------------------------

CACHES = {
    "contiguous": lambda m: ContiguousKVCache(**m.new_cache_args(), max_seqs=2, max_len=64, dtype=m.dtype),
    "paged-b1": lambda m: PagedKVCache(**m.new_cache_args(), num_blocks=128, block_size=1, dtype=m.dtype),
    "paged-b5": lambda m: PagedKVCache(**m.new_cache_args(), num_blocks=32, block_size=5, dtype=m.dtype),
    "paged-b16": lambda m: PagedKVCache(**m.new_cache_args(), num_blocks=8, block_size=16, dtype=m.dtype),
    "int8-b4": lambda m: QuantizedPagedKVCache(**m.new_cache_args(), num_blocks=32, block_size=4, dtype=m.dtype,
                                               kv_dtype="int8"),
    "kivi4-b8": lambda m: QuantizedPagedKVCache(**m.new_cache_args(), num_blocks=16, block_size=8, dtype=m.dtype,
                                                kv_dtype="kivi4", group=8),
}


def _kv(cache, layer=0):
    return cache.read_kv(0, layer) if hasattr(cache, "read_kv") else (
        cache.k[layer, 0, :, :cache.length(0)], cache.v[layer, 0, :, :cache.length(0)])


def _plain_greedy(model, cache, n: int) -> list[int]:
    """Greedy tokens after PROMPT, one decode step at a time, on ``cache`` (sequence 0)."""
    cache.add_sequence(0)
    out = [int(np.argmax(model.forward([PROMPT], cache)[0]))]
    while len(out) < n:
        out.append(int(np.argmax(model.forward([out[-1:]], cache)[0])))
    return out


@pytest.mark.parametrize("kind", CACHES)
@pytest.mark.parametrize("accept", [0, 2, 5])
def test_verify_keeps_the_accepted_prefix_and_rolls_back_the_rest(gqa, kind, accept):
    """Through the model the reference step is shorter (it lacks the dropped tokens), so its matrix products
    have another shape and may round differently: float64's bar here; the cache tests below are bit-exact."""
    want = _plain_greedy(gqa, CACHES[kind](gqa), 14)
    drafts = want[1:1 + accept] + [(want[1 + accept] + 1) % 101] + want[2 + accept:8]  # wrong at `accept`
    spec, ref = CACHES[kind](gqa), CACHES[kind](gqa)
    for c in (spec, ref):
        c.add_sequence(0)
        gqa.forward([PROMPT], c)  # 12 tokens: the 8-token step below crosses block boundaries of 1, 4, 5, 8
    stats = SpecStats(draft_len=len(drafts))
    got = verify(gqa, spec, 0, want[0], drafts, stats)
    assert got == want[1:2 + accept]
    assert (stats.accepted, stats.drafted, stats.steps, stats.drafted_steps) == (accept, len(drafts), 1, 1)
    gqa.forward([want[:1 + accept]], ref)  # the same step without the dropped tokens
    assert spec.length(0) == ref.length(0) == len(PROMPT) + 1 + accept
    for layer in range(gqa.config.num_layers):
        for a, b in zip(_kv(spec, layer), _kv(ref, layer)):
            assert_close(a, b, np.float64, what=f"{kind} K/V of layer {layer}")
    nxt = want[1 + accept:6 + accept]  # the next step reads and writes the same
    assert_close(gqa.forward([nxt], spec, all_logits=True), gqa.forward([nxt], ref, all_logits=True), np.float64)
    if isinstance(spec, QuantizedPagedKVCache):
        assert np.array_equal(spec.quantized[spec.blocks.table(0)], ref.quantized[ref.blocks.table(0)])


# --- the caches: truncate then re-write == never written ---------------------------------------------------

def _rows(rng, n, hkv=2, d=32):
    return rng.standard_normal((n, hkv, d)), rng.standard_normal((n, hkv, d))


def _write(cache, seq, k, v, q=None):
    with cache.step([seq], [len(k)]):
        for layer in range(cache.num_layers):
            cache.write(layer, k, v)
        return None if q is None else cache.attend(0, q)


@pytest.mark.parametrize("kind", ["contiguous", "paged-b1", "paged-b5", "paged-b16"])
def test_truncate_then_rewrite_is_bit_identical_to_never_writing(kind):
    m = random_model(dtype=np.float64, head_dim=32)
    rng = np.random.default_rng(0)
    (pk, pv), (ak, av), (dk, dv), (bk, bv) = _rows(rng, 7), _rows(rng, 3), _rows(rng, 9), _rows(rng, 6)
    q = rng.standard_normal((6, 6, 32))
    got, ref = CACHES[kind](m), CACHES[kind](m)
    for c in (got, ref):
        c.add_sequence(0)
        _write(c, 0, pk, pv)
    _write(got, 0, np.concatenate([ak, dk]), np.concatenate([av, dv]))  # 3 kept + 9 dropped, across blocks
    got.truncate(0, 10)
    _write(ref, 0, ak, av)
    out_got, out_ref = _write(got, 0, bk, bv, q), _write(ref, 0, bk, bv, q)
    assert np.array_equal(out_got, out_ref)
    for a, b in zip(_kv(got), _kv(ref)):
        assert np.array_equal(a, b)
    if isinstance(got, PagedKVCache):
        assert got.blocks.num_free == ref.blocks.num_free  # the dropped blocks went back
        got.blocks.allocator.check()


@pytest.mark.parametrize("kv_dtype,bs,group", [("int8", 4, 32), ("kivi2", 8, 8), ("q4_1", 4, 32)])
@pytest.mark.parametrize("cut", [9, 13, 16])  # 9, 13: re-opens a block the step quantized; 16: a boundary
def test_a_quantized_block_the_rollback_reopens_is_a_residual_again(kv_dtype, bs, group, cut):
    rng = np.random.default_rng(1)
    (pk, pv), (dk, dv), (bk, bv) = _rows(rng, 6), _rows(rng, 14), _rows(rng, 11)
    q = rng.standard_normal((11, 6, 32))

    def new():
        c = QuantizedPagedKVCache(2, 2, 32, num_blocks=16, block_size=bs, dtype=np.float64, kv_dtype=kv_dtype,
                                  group=group)
        c.add_sequence(0)
        _write(c, 0, pk, pv)
        return c

    got, ref = new(), new()
    _write(got, 0, dk, dv)  # positions 6..19: quantizes the blocks it fills
    assert got.quantized[got.blocks.table(0)[(cut - 1) // bs]]
    got.truncate(0, cut)
    _write(ref, 0, dk[:cut - 6], dv[:cut - 6])  # the run that never saw positions cut..19
    table_got, table_ref = got.blocks.table(0), ref.blocks.table(0)
    assert np.array_equal(got.quantized[table_got], ref.quantized[table_ref])
    for layer in range(2):
        for bg, br in zip(table_got, table_ref):
            if ref.quantized[br]:
                assert got.stored_block(layer, bg) == ref.stored_block(layer, br)
        open_rows = cut % bs  # the kept rows of the re-opened block equal the never-rolled-back residual
        if open_rows:
            for pool in ("k_pool", "v_pool"):
                g, r = getattr(got, pool)[layer, table_got[-1]], getattr(ref, pool)[layer, table_ref[-1]]
                assert np.array_equal(g[:open_rows], r[:open_rows])
    assert np.array_equal(_write(got, 0, bk, bv, q), _write(ref, 0, bk, bv, q))  # fills it again, same bytes
    for layer in range(2):
        for bg, br in zip(got.blocks.table(0), ref.blocks.table(0)):
            assert got.stored_block(layer, bg) == ref.stored_block(layer, br) or not ref.quantized[br]
    assert got.quantize_count.max() == 1  # an undone quantization is not counted


def test_a_block_quantized_before_the_last_step_cannot_be_reopened():
    c = QuantizedPagedKVCache(2, 2, 32, num_blocks=8, block_size=4, dtype=np.float64, kv_dtype="int8")
    c.add_sequence(0)
    rng = np.random.default_rng(2)
    _write(c, 0, *_rows(rng, 6))  # block 0 quantized here
    _write(c, 0, *_rows(rng, 1))
    before = (c.length(0), c.blocks.table(0).tolist(), c.quantized.copy(), c.blocks.num_free)
    with pytest.raises(RollbackError, match="quantized .* before the last step"):
        c.truncate(0, 3)
    assert before[:2] == (c.length(0), c.blocks.table(0).tolist()) and np.array_equal(before[2], c.quantized)
    c.truncate(0, 4)  # at its boundary: the block stays quantized, nothing to restore
    assert c.length(0) == 4 and c.quantized[c.blocks.table(0)[0]]


# --- sharing: forks, prefix hits and the prefix cache --------------------------------------------------------

def test_a_rollback_never_changes_what_another_owner_reads():
    c = PagedKVCache(2, 2, 32, num_blocks=12, block_size=4, dtype=np.float64)
    rng = np.random.default_rng(3)
    c.add_sequence("a")
    _write(c, "a", *_rows(rng, 10))          # a: blocks 0, 1 full, block 2 holds 2 tokens
    a_kv = [x.copy() for x in c.read_kv("a", 1)]
    c.fork("a", "b")
    _write(c, "b", *_rows(rng, 7))           # b copies the shared block 2 (CoW) and adds block 3, 4
    c.truncate("b", 11)                      # back into b's own copy of block 2
    c.truncate("b", 6)                       # frees b's copy (its last owner) and cuts into shared block 1
    assert c.blocks.table("b")[1] != c.blocks.table("a")[1]  # copied at truncate: b will write it
    _write(c, "b", *_rows(rng, 5))
    c.truncate("b", 3)                       # cuts into shared block 0: copied again
    _write(c, "b", *_rows(rng, 2))
    for x, y in zip(c.read_kv("a", 1), a_kv):
        assert np.array_equal(x, y)
    assert all(c.blocks.allocator.ref_count(b) == 1 for b in c.blocks.table("a"))
    c.free_sequence("b")
    c.blocks.allocator.check()
    assert c.blocks.num_free == 12 - 3


def test_a_copy_the_rollback_needs_and_cannot_get_changes_nothing():
    c = PagedKVCache(2, 2, 32, num_blocks=2, block_size=4, dtype=np.float64, enable_prefix_caching=False)
    c.add_sequence("a")
    _write(c, "a", *_rows(np.random.default_rng(4), 8))
    c.fork("a", "b")
    with pytest.raises(OutOfBlocksError, match="shared last block"):
        c.truncate("b", 6)
    assert c.length("b") == 8 and c.blocks.table("b").tolist() == c.blocks.table("a").tolist()
    c.blocks.allocator.check()


def test_the_prefix_cache_never_keeps_a_hash_for_a_rolled_back_block():
    m = random_model(dtype=np.float64, head_dim=32)
    c = PagedKVCache(**m.new_cache_args(), num_blocks=16, block_size=4, dtype=m.dtype)
    prompt, drafts = list(range(1, 11)), [20, 21, 22, 23, 24, 25, 26]
    c.add_sequence(0, prompt)
    m.forward([prompt], c)
    c.blocks.extend_token_ids(0, drafts)               # the drafts' ids declared: the step registers blocks 2 and 3
    m.forward([drafts], c)
    registered = {b.block_id for b in c.blocks.allocator.blocks if b.hash is not None}
    assert set(c.blocks.table(0)[:4].tolist()) <= registered
    c.truncate(0, 11)                           # keeps one draft: block 2 is cut, block 3 and 4 dropped
    kept = set(c.blocks.table(0)[:2].tolist())   # the only full blocks left
    assert {b.block_id for b in c.blocks.allocator.blocks if b.hash is not None} == kept
    c.blocks.allocator.check()
    assert c.add_sequence(1, prompt + drafts) == 8  # a prompt with the dropped tokens hits the kept blocks only
    c.free_sequence(1)
    other = [30, 31, 32, 33, 34]                # re-write other tokens; their blocks are shared correctly
    c.blocks.extend_token_ids(0, other)
    logits = m.forward([other], c, all_logits=True)
    text = prompt + drafts[:1] + other
    assert c.add_sequence(2, text + [40]) == 16
    assert np.array_equal(m.forward([[40]], c, seq_ids=[2]), m.forward([[40]], c, seq_ids=[0]))
    assert np.allclose(logits, m.logits(text)[11:], rtol=1e-10, atol=1e-12)
    c.blocks.allocator.check()


# --- bad input, caches that cannot roll back -------------------------------------------------------------

@pytest.mark.parametrize("kind", ["contiguous", "paged-b5", "int8-b4"])
def test_truncate_refuses_bad_input_with_typed_errors(gqa, kind):
    c = CACHES[kind](gqa)
    c.add_sequence(0)
    gqa.forward([PROMPT], c)
    with pytest.raises(UnknownSequenceError, match="not in the cache"):
        c.truncate(7, 1)
    for bad in (13, -1, 2.0, True, None):
        with pytest.raises(InvalidInputError, match="new_len="):
            c.truncate(0, bad)
    c.begin_step([0], [1])
    with pytest.raises(InvalidInputError, match="while a step is open"):
        c.truncate(0, 3)
    c.abort_step()
    assert c.length(0) == len(PROMPT)
    c.truncate(0, len(PROMPT))  # a no-op
    c.truncate(0, 0)
    assert c.length(0) == 0


@pytest.mark.parametrize("kind,options", [("window", dict(window=8)), ("window", dict(window=8, layout="paged")),
                                          ("h2o", dict(budget=8)), ("snapkv", dict(budget=8, obs_window=4))])
def test_evicting_caches_say_why_they_cannot_roll_back(gqa, kind, options):
    c = make_cache(kind, gqa, max_len=32, eviction=options)
    c.add_sequence(0)
    gqa.forward([PROMPT], c)
    with pytest.raises(RollbackError, match="evict.*is gone"):
        c.truncate(0, 10)
    with pytest.raises(RollbackError, match="evict"):
        generate(gqa, PROMPT, 4, sampling=GREEDY, cache=kind, eviction=options, speculative="ngram")


def test_generate_refuses_what_speculation_cannot_do(gqa):
    with pytest.raises(InvalidInputError, match="greedily"):
        generate(gqa, PROMPT, 4, sampling=SamplingParams(seed=0), speculative="ngram")
    with pytest.raises(ConfigError, match="cache='none'"):
        generate(gqa, PROMPT, 4, sampling=GREEDY, cache="none", speculative="ngram")
    with pytest.raises(InvalidInputError, match="speculative='medusa'"):
        generate(gqa, PROMPT, 4, sampling=GREEDY, speculative="medusa")
    for bad in (0, -2, 1.5):
        with pytest.raises(InvalidInputError, match="draft_len="):
            generate(gqa, PROMPT, 4, sampling=GREEDY, speculative="ngram", draft_len=bad)


# --- the CLI ------------------------------------------------------------------------------------------------

@pytest.fixture
def checkpoint_dir(monkeypatch, tmp_path):
    """A --model directory that loads as a tiny random model (``minikv.weights.checkpoints``' loader replaced)."""
    from minikv.cli import common

    monkeypatch.setattr(common, "_load_checkpoint", lambda path: random_model(dtype=np.float64, seed=1))
    return str(tmp_path)


def test_cli_generate_speculative_reports_acceptance_and_speedup(capsys, checkpoint_dir):
    argv = ["generate", "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "40", "--greedy",
            "--json", "--model", checkpoint_dir]
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main([*argv, "--speculative", "ngram", "--draft-len", "3", "--cache", "paged", "--block-size", "5"]) == 0
    out = capsys.readouterr()
    r = json.loads(out.out.strip().splitlines()[-1])
    assert r["token_ids"] == plain["token_ids"] and r["identical_to_plain"] is True
    assert r["draft_tokens"] > 0 and r["acceptance_rate"] == r["accepted_tokens"] / r["draft_tokens"]
    assert r["draft_len"] == 3 and r["speedup"] > 0
    assert "acceptance" in out.err and "speed-up" in out.err
    for extra, fix in ((["--speculative", "ngram", "--draft-len", "0"], "--draft-len=0"),
                       (["--speculative", "ngram", "--cache", "window", "--window", "8"],
                        "use --cache contiguous or paged")):
        assert main([*argv, *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and fix in err[0]
    assert main([a for a in argv if a != "--greedy"] + ["--speculative", "ngram"]) == 2
    assert "add --greedy" in capsys.readouterr().err
