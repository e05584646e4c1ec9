"""Gemma-3-270M, a real hybrid model, through minikv's per-layer caches, against transformers 5.24 on the same GGUF.

One teacher-forced pass feeds the reference text to five caches at once (``Fanout``: the weights are read once
per step for all of them), in steps of 1, 2 and 30 tokens: the contiguous hybrid cache, the paged one with block
sizes 16 and 5, paged 16 under step 6's sharing rule, and an all-full cache (the window ignored). The pass keeps
final hidden states; the 262,144-wide LM head runs only for the rows a test reads. The same pass leaves the
caches for the prefix-hit test. Loading both models costs about 35 s (minikv) and 90 s (transformers) once per
session on a quiet 2-core machine. Fed one token per step through the LM head, the fixture took 498 s on the
2-core machine with one other job running. As it is now, its parts measured at load average 2-3: minikv's pass
24 s, the two NLL heads 8 s, transformers' pass and head 7 s.
"""

from __future__ import annotations

import copy
from contextlib import ExitStack, contextmanager

import numpy as np
import pytest

from minikv.bench.corpus import reference_tokens
from minikv.bench.equivalence import assert_close
from minikv.generate import generate
from minikv.hybrid import HybridPagedKVCache, hybrid_cache
from minikv.kv_cache import ContiguousKVCache
from minikv.layers import linear

pytestmark = [pytest.mark.gemma, pytest.mark.reference, pytest.mark.slow]

N_TEXT = 1040  # tokens of the reference text: past 2 W, so every ring wraps twice
HIT = 1024  # the longest prefix hit on N_TEXT tokens in blocks of 16 (one token must be fed)
CHUNK = 64
FEED_CYCLE = (1, 2, 30)  # minikv's step sizes in the teacher-forced pass


def hybrid(model, max_len: int, add: bool = True):
    c = model.config
    cache = hybrid_cache("contiguous", c.layer_windows, c.num_kv_heads, c.head_dim, max_len)
    if add:
        cache.add_sequence(0)
    return cache


def nll(logits: np.ndarray, targets) -> np.ndarray:
    """Per-row negative log-likelihood of ``targets`` under ``logits`` [T, V], in float64: [T]."""
    z = logits.astype(np.float64)
    top = z.max(-1)
    return top + np.log(np.exp(z - top[:, None]).sum(-1)) - z[np.arange(len(targets)), targets]


def test_the_file_is_read_as_gemma3(gemma3):
    c = gemma3[0].config
    assert [i for i, t in enumerate(c.layer_types) if t == "full_attention"] == [5, 11, 17]
    assert (c.sliding_window, c.rope_theta, c.sliding_rope_theta, c.query_pre_attn_scalar) == (512, 1e6, 1e4, 256)
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size) == (18, 4, 1, 256, 640)
    assert (c.rope_layout, c.hidden_act, c.qk_norm, c.sandwich_norms) == ("half", "gelu_pytorch_tanh", True, True)


def test_logits_match_transformers(gemma3, gemma3_hf, require):
    torch = require("torch")
    model, tok = gemma3
    for text in ["The capital of France is", "机器学习是人工智能的一个分支，", "for i in range(10):\n    print("]:
        ids = tok.encode(text)
        with torch.no_grad():
            want = gemma3_hf(torch.tensor([ids])).logits[0].numpy()
        assert_close(model.logits(ids), want, np.float32, what=repr(text))


class Fanout:
    """One cache per sequence behind the seam: sequence i of a step goes to ``members[i]`` (its id 0 there).

    The teacher-forced runs share one forward per token: the weights (and the 262,144-wide LM head) are read
    once for every cache under test, and each cache still stores and attends over its own history."""

    def __init__(self, model, members: list):
        c = model.config
        self.members, self.layer_windows = members, c.layer_windows
        self.num_layers, self.num_kv_heads, self.head_dim = c.num_layers, c.num_kv_heads, c.head_dim

    @contextmanager
    def step(self, seq_ids, num_new):
        self.bounds = np.concatenate([[0], np.cumsum(num_new)])
        with ExitStack() as stack:
            yield np.concatenate([stack.enter_context(self.members[s].step([0], [n]))
                                  for s, n in zip(seq_ids, num_new)])

    def _rows(self):
        return zip(self.members, self.bounds, self.bounds[1:])

    def write(self, layer, k, v):
        for m, a, b in self._rows():
            m.write(layer, k[a:b], v[a:b])

    def attend(self, layer, q):
        return np.concatenate([m.attend(layer, q[a:b]) for m, a, b in self._rows()])


def paged(model, block_size: int, num_blocks: int | None = None, **options):
    c = model.config
    return hybrid_cache("paged", c.layer_windows, c.num_kv_heads, c.head_dim, N_TEXT, block_size=block_size,
                        num_blocks=num_blocks, **options)


def tight_paged(model, sliding_rule: bool):
    """Block size 16 in a pool just large enough for the text: blocks that left the window are reused (and
    their prefix-cache entries evicted) while the text is still being fed."""
    size = paged(model, 16).peak_blocks(N_TEXT, N_TEXT)
    return paged(model, 16, size, sliding_rule=sliding_rule)


def feed_schedule(n: int, cycle=FEED_CYCLE) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` covering ``range(n)``: steps of the sizes in ``cycle``, repeated. A 33-token
    cycle moves the single-token steps to a new phase of every block (16, 5) and of the window (512) each round."""
    spans, a, i = [], 0, 0
    while a < n:
        b = min(n, a + cycle[i % len(cycle)])
        spans.append((a, b))
        a, i = b, i + 1
    return spans


@pytest.fixture(scope="module")
def teacher_forced(gemma3, gemma3_hf, require) -> dict:
    """The first N_TEXT tokens of the reference text, teacher-forced. transformers: per-token NLL, one pass.
    minikv: the final normed hidden states [N_TEXT - 1, H] through each cache under test, in one ``Fanout``
    (the contiguous hybrid cache; paged with block sizes 16 and 5; paged 16 with step 6's sharing rule, in a
    tight pool; and an all-full cache, the window ignored as an engine that ignores layer_types would), fed in
    steps of 1, 2 and 30 tokens (``feed_schedule``): single-token decode steps and multi-token chunks, at every
    phase of the rings and blocks. The 262,144-wide LM head then runs only where a test needs logits: the NLL
    of the contiguous and all-full runs, and the paged run's logits past ``HIT`` (for the prefix hit)."""
    torch = require("torch")
    model, tok = gemma3
    ids = reference_tokens(tok, N_TEXT)
    inputs, targets = ids[:-1], np.array(ids[1:])
    with torch.no_grad():
        hidden = gemma3_hf.model(torch.tensor([ids])).last_hidden_state[0, :-1]
        hf = np.concatenate([nll(gemma3_hf.lm_head(hidden[a:a + CHUNK]).numpy(), targets[a:a + CHUNK])
                             for a in range(0, len(targets), CHUNK)])
    c = model.config
    runs = {"hybrid": hybrid(model, N_TEXT, add=False), "paged 16": tight_paged(model, sliding_rule=True),
            "paged 5": paged(model, 5), "step 6 rule": tight_paged(model, sliding_rule=False),
            "window ignored": ContiguousKVCache(c.num_layers, c.num_kv_heads, c.head_dim, 1, N_TEXT)}
    for cache in runs.values():
        cache.add_sequence(0, *([inputs] if isinstance(cache, HybridPagedKVCache) else []))
    # The same model with the identity as its LM head returns the final normed hidden states as its "logits"
    # (exactly: x @ I), so the head's 168M multiply-adds per token run only for the rows a test reads.
    assert c.final_softcap is None
    head, heads_off = model.lm_head, copy.copy(model)
    heads_off.lm_head = np.eye(c.hidden_size, dtype=head.dtype)
    fan, states = Fanout(model, list(runs.values())), {k: [] for k in runs}
    for a, b in feed_schedule(len(inputs)):
        h = heads_off.forward([inputs[a:b]] * len(runs), fan, list(range(len(runs))), all_logits=True)
        for name, rows in zip(runs, np.split(h, len(runs))):  # member i's b - a rows, in order
            states[name].append(rows)
    states = {k: np.concatenate(v) for k, v in states.items()}
    ours = {k: np.concatenate([nll(linear(states[k][a:a + CHUNK], head), targets[a:a + CHUNK])
                               for a in range(0, len(targets), CHUNK)]) for k in ("hybrid", "window ignored")}
    return {"transformers": hf, **ours, "states": states, "ids": ids, "caches": runs,
            "tail": linear(states["paged 16"][HIT:], head)}


def test_nll_through_the_hybrid_cache_matches_transformers(teacher_forced):
    hf, ours = teacher_forced["transformers"].mean(), teacher_forced["hybrid"].mean()
    print(f"mean NLL over {N_TEXT - 1} tokens: transformers {hf:.6f}, minikv {ours:.6f}, "
          f"relative difference {abs(ours - hf) / hf:.2e}")
    assert abs(ours - hf) / hf <= 1e-4


@pytest.mark.parametrize("run", ["paged 16", "paged 5", "step 6 rule"])
def test_the_paged_hybrid_caches_equal_the_contiguous_one(teacher_forced, run):
    """Every final hidden state, token by token, equals the contiguous hybrid cache's (whose NLL matches
    transformers above): a stronger check than the mean NLL, and it needs no LM head."""
    states = teacher_forced["states"]
    assert_close(states[run], states["hybrid"], np.float32, what=f"{run} vs the contiguous hybrid cache")


def test_ignoring_the_window_changes_the_nll(teacher_forced):
    """The check above can fail: keeping every layer whole (as an engine that ignores layer_types would)
    moves the NLL by far more than the bar, and only after the first W tokens."""
    hf, ignored = teacher_forced["transformers"], teacher_forced["window ignored"]
    print(f"window ignored: mean NLL {ignored.mean():.6f}, relative difference "
          f"{abs(ignored.mean() - hf.mean()) / hf.mean():.2e}")
    assert abs(ignored.mean() - hf.mean()) / hf.mean() > 1e-3
    assert np.abs(ignored[:511] - hf[:511]).max() < 1e-3  # tokens 1..511 see the same keys either way


def test_a_prefix_hit_past_the_window_equals_the_run_without_it(teacher_forced, gemma3):
    """The text, fed once and freed, comes back: the sliding groups gave their first blocks back (and the tight
    pool reused them) long ago, yet the hit covers 1,024 tokens, because a sliding group needs only the blocks
    of the 511 tokens before the hit point. Step 6's rule (evicted means unshareable) stops at the sequence's first
    eviction, inside the first window (measured: 496 tokens). The logits after the hit equal the token-by-token
    run's, which had no hit."""
    model, ids, caches = gemma3[0], teacher_forced["ids"], teacher_forced["caches"]
    hits = {}
    for name in ("paged 16", "step 6 rule"):
        caches[name].free_sequence(0)
        hits[name] = caches[name].add_sequence("again", ids)
    assert hits["paged 16"] == HIT and hits["step 6 rule"] < model.config.sliding_window, hits
    got = model.forward([ids[HIT:-1]], caches["paged 16"], ["again"], all_logits=True)
    assert_close(got, teacher_forced["tail"], np.float32, what="after a 1,024-token hit vs the run without it")


PROMPTS = {
    "english": "The history of the printing press begins",
    "chinese": "北京是中国的首都，也是",
    "code": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "past the window": None,  # the reference text's first 600 tokens: the rings have wrapped before decoding
}


@pytest.fixture(scope="module")
def greedy_hf(gemma3, gemma3_hf, require):
    """``greedy_hf(name) -> (prompt ids, transformers' 16 greedy tokens)``, each computed once per module."""
    torch, tok, done = require("torch"), gemma3[1], {}

    def run(name):
        if name not in done:
            ids = reference_tokens(tok, 600) if PROMPTS[name] is None else tok.encode(PROMPTS[name])
            with torch.no_grad():
                out = gemma3_hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
            done[name] = ids, out[0, len(ids):].tolist()
        return done[name]
    return run


@pytest.mark.parametrize("name", list(PROMPTS))
def test_greedy_tokens_match_transformers(gemma3, greedy_hf, name):
    model, tok = gemma3
    ids, want = greedy_hf(name)
    cache, step, got = hybrid(model, len(ids) + len(want)), ids, []
    for _ in range(len(want)):
        got.append(int(np.argmax(model.forward([step], cache)[0])))
        step = got[-1:]
    assert got == want, f"{tok.decode(got)!r} != {tok.decode(want)!r}"


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_speculative_decoding_rolls_back_after_the_rings_wrapped(gemma3, greedy_hf, cache):
    """600 prompt tokens: every sliding group has wrapped before the first draft. A verify step of 1 + 3 tokens
    whose 3 drafts are wrong is taken back from rings of W + K slots (K = 3) and the next token is still
    transformers'; speculative decoding (n-gram drafts) gives transformers' greedy tokens."""
    model, (ids, want) = gemma3[0], greedy_hf("past the window")
    c = model.config
    kv = hybrid_cache(cache, c.layer_windows, c.num_kv_heads, c.head_dim, len(ids) + 8, rollback=3)
    kv.add_sequence(0)
    assert int(np.argmax(model.forward([ids], kv)[0])) == want[0]
    wrong = [(t + 1) % c.vocab_size for t in want[1:4]]
    model.forward([[want[0], *wrong]], kv)
    kv.truncate(0, len(ids) + 1)
    assert int(np.argmax(model.forward([[want[1]]], kv)[0])) == want[2]
    out = generate(model, ids, len(want), cache=cache, speculative="ngram", draft_len=3)
    spec = out.speculative
    print(f"{cache}: {spec.drafted} drafted, {spec.accepted} accepted in {spec.steps} verify steps")
    assert out.token_ids == want
