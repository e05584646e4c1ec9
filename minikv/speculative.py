"""Speculative decoding by prompt lookup: draft k tokens, verify them in one step, roll the cache back.

The idea
--------
A decode step runs one token through the model and reads every weight to do it. At batch 1 that
pass is bound by reading weights, not by arithmetic, so a pass over T = k + 1 tokens costs little
more than a pass over one. If the next k tokens can be *guessed* cheaply, one pass checks all of
them, and every correct guess is a token that cost no pass of its own.

Drafts by prompt lookup (no second model)
-----------------------------------------
Text that copies its context (rewriting a code snippet, quoting, repeating names) repeats n-grams
of the prompt or of what it has already generated. ``ngram_draft`` takes the last n tokens (n
from ``max_ngram`` down to 1), finds their latest earlier occurrence in prompt + generated text,
and proposes the (up to) k tokens that followed it there. No match: no draft, a plain decode step.
It needs no second model, so it works for SmolLM2 as it is.

When to draft (the engine's rule): only when a suffix of at least ``MIN_NGRAM`` = 2 tokens matches,
and after a draft was wholly rejected, only on a match of ``MISS_NGRAM`` = 3 tokens until a draft is
accepted again (a miss raises the bar). A verify pass of k + 1 tokens costs more than a one-token pass
(``benchmarks/decode_profile.py``), so a draft must be right often enough to pay for it. A match on the
last token alone (a space, a comma, "the") predicts what comes next far less often than a match on two;
and where a 2-token match was just wrong, the text is not copying its context there, and the next
2-token match is no better a bet. ``benchmarks/speculative.py`` measures both parts of the rule against
drafting on any 1-token match (its ``K=4 min1`` variant) and against the 2-token rule without the raise
(``K=4 no raise``). ``ngram_draft``'s own default stays 1: the plain lookup of the lesson
(``minikv.textbook.s7_rollback``).

Verification and the acceptance rule (greedy)
---------------------------------------------
The newest token t0 has no K/V yet. One step feeds ``[t0, d1, ..., dk]`` through
``Model.forward(all_logits=True)``: row i of the logits [k + 1, V] is the model's next-token
distribution after ``d_i`` (row 0: after t0), each computed from the true prefix plus the drafts
before it. Greedy decoding's next token is ``g1 = argmax(row 0)``; ``d1`` is accepted iff
``d1 == g1``, then ``d2`` iff ``d2 == argmax(row 1)``, and so on. The longest accepted prefix
``d1..dn`` is kept, and ``g_{n+1} = argmax(row n)`` comes free as the *bonus* token: a step yields
n + 1 >= 1 tokens, each one exactly the token plain greedy decoding would have produced.
(Exactly in float64; in float32 a [k + 1]-row pass sums in another order than k + 1 one-row
passes, so logits differ in their last bits and a near-tie could flip; the tests check SmolLM2's
tokens are identical.)

The acceptance rule for sampling
--------------------------------
Greedy acceptance keeps the output token for token; sampling needs a rule that keeps its
*distribution*. Speculative sampling (Leviathan et al., arXiv 2211.17192; Chen et al., arXiv
2302.01318): draft token d_i was drawn from the drafter's q_i; the target gives p_i. Accept d_i with
probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection, draw the replacement from the
residual max(0, p_i - q_i), renormalised, and stop; if every draft is accepted, draw the bonus from
p_{k+1}. Every emitted token is then distributed exactly as the target's own sampling would draw it
(``accept_sampled``; ``tests/test_speculative_sampling.py`` checks it by a chi-square test). A
deterministic drafter such as prompt lookup has q_i = one-hot(d_i): d_i is kept with probability
p_i(d_i), and a rejection draws from p_i with d_i taken out. ``generate`` runs the greedy rule only.

Rollback
--------
The step wrote K/V for t0 and all k drafts; the k - n rejected ones were computed from wrong tokens
and must go: ``cache.truncate(seq_id, length - (k - n))``. Each lossless cache implements it:
a contiguous cache moves the length back; a paged cache gives back blocks past the new length,
takes blocks holding dropped tokens out of the prefix cache, and copies a shared partly kept last
block (copy-on-write); a quantized paged cache also re-opens a block the step quantized, from
full-precision rows it kept (``minikv.quant``); the MLA latent caches are these with one latent
"head". Window and eviction caches raise ``RollbackError``: what their policy evicted is gone.

Counters (``SpecStats``): verify steps (and how many carried drafts), drafted tokens, accepted tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from minikv.errors import InvalidInputError, check_int

SPECULATIVE_KINDS = ("ngram",)  # the --speculative choices
MAX_NGRAM = 3  # longest suffix the drafter looks up
MIN_NGRAM = 2  # shortest suffix whose match the decode loop drafts from (see "When to draft")
MISS_NGRAM = 3  # ... and after a wholly rejected draft, until a draft is accepted again


@dataclass
class SpecStats:
    """What speculation did: ``steps`` verify passes (``drafted_steps`` of them with at least one draft;
    the others are plain one-token steps), ``drafted`` tokens proposed, ``accepted`` kept."""

    draft_len: int
    steps: int = 0
    drafted_steps: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (nan when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else float("nan")

    @property
    def tokens_per_step(self) -> float:
        """New tokens per verify pass: (accepted + one bonus per step) / steps; 1.0 is plain decoding."""
        return (self.accepted + self.steps) / self.steps if self.steps else float("nan")


def ngram_draft(ids: Sequence[int], k: int, max_ngram: int = MAX_NGRAM, min_ngram: int = 1) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix of ``ids``.

    ids: [P + G] the prompt and the tokens generated so far (the last one not yet run)
    The suffix length n goes from ``max_ngram`` down to ``min_ngram``; the first n with a match wins,
    and the latest match (the closest context) among its occurrences. Returns [] without a match.
    """
    k = check_int("k", k, minimum=0, error=InvalidInputError, hint="the number of draft tokens")
    max_ngram = check_int("max_ngram", max_ngram, error=InvalidInputError)
    min_ngram = check_int("min_ngram", min_ngram, error=InvalidInputError)
    a = np.asarray(ids, dtype=np.int64)
    if k == 0:
        return []
    for n in range(min(max_ngram, a.size - 1), min_ngram - 1, -1):
        # windows a[i:i+n] for i < size - n: each has at least one token after it
        win = np.lib.stride_tricks.sliding_window_view(a[:-1], n)
        hits = np.flatnonzero(np.all(win == a[-n:], axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return a[start:start + k].tolist()
    return []


def verify(model, cache, seq_id, last: int, drafts: Sequence[int], stats: SpecStats | None = None) -> list[int]:
    """Run ``[last, *drafts]`` as one step of ``seq_id``; keep the accepted drafts, roll back the rest.

    ``last`` is the newest token (no K/V yet). Returns the accepted drafts plus the bonus token
    (1 .. len(drafts) + 1 tokens); afterwards the cache holds ``last`` and the accepted drafts,
    and the bonus is the new ``last``. An empty ``drafts`` is a plain decode step.
    """
    drafts = [int(d) for d in drafts]
    logits = model.forward([[int(last), *drafts]], cache, seq_ids=[seq_id], all_logits=True)  # [k + 1, V]
    greedy = np.argmax(logits, axis=-1)  # what plain greedy decoding picks after each fed token
    n = 0
    while n < len(drafts) and drafts[n] == int(greedy[n]):
        n += 1
    if n < len(drafts):
        cache.truncate(seq_id, cache.length(seq_id) - (len(drafts) - n))
    if stats is not None:
        stats.steps, stats.drafted_steps = stats.steps + 1, stats.drafted_steps + bool(drafts)
        stats.drafted, stats.accepted = stats.drafted + len(drafts), stats.accepted + n
    return drafts[:n] + [int(greedy[n])]


def accept_sampled(target: np.ndarray, draft: np.ndarray, drafts: Sequence[int], rng: np.random.Generator
                   ) -> list[int]:
    """Speculative sampling's acceptance rule: the accepted drafts, then one token drawn by the rule.

    target: [k + 1, V] the target's next-token probabilities after each fed token (row 0: after the
    newest token t0, row i: after d_i); draft: [k, V] the distributions d_1..d_k were drawn from;
    drafts: the k draft tokens. Returns 1 .. k + 1 tokens, distributed as sampling the target alone.
    """
    target, draft = np.asarray(target, dtype=np.float64), np.asarray(draft, dtype=np.float64)
    k = len(drafts)
    if target.ndim != 2 or draft.shape != (k, target.shape[1]) or target.shape[0] != k + 1:
        raise InvalidInputError(f"target {target.shape} and draft {draft.shape} must be [k + 1, V] and [k, V] "
                                f"for k = {k} drafts")
    vocab = target.shape[1]
    for i, d in enumerate(int(x) for x in drafts):
        if not 0 <= d < vocab or draft[i, d] <= 0:
            raise InvalidInputError(f"draft token {d} at {i} is outside [0, {vocab}) or has draft probability 0; "
                                    "a draft token must be drawn from its draft distribution")
        if rng.random() < target[i, d] / draft[i, d]:  # accept with probability min(1, p / q)
            continue
        residual = np.maximum(target[i] - draft[i], 0.0)  # what q under-proposes: nonzero, since p(d) < q(d)
        return [int(x) for x in drafts[:i]] + [int(rng.choice(vocab, p=residual / residual.sum()))]
    return [int(x) for x in drafts] + [int(rng.choice(vocab, p=target[k] / target[k].sum()))]


def speculative_decode(model, cache, ids: list[int], first: int, max_new_tokens: int, eos: int | None,
                       result, draft_len: int, max_ngram: int = MAX_NGRAM, seq_id=0,
                       min_ngram: int = MIN_NGRAM, miss_ngram: int = MISS_NGRAM) -> Iterator[int]:
    """The speculative decode loop after prefill: yield tokens from ``first`` on, until EOS or
    ``max_new_tokens``. ``ids`` (prompt, extended in place) is what the drafter searches.

    ``result`` (a ``minikv.generate.GenerationResult``) gets the tokens, ``decode_s`` (drafting and
    verifying, not the consumer's time), ``finish_reason`` and ``speculative``: a ``SpecStats``.
    It drafts only from a match of at least ``min_ngram`` tokens, or ``miss_ngram`` after a draft that was
    wholly rejected until one is accepted again (``MIN_NGRAM``, ``MISS_NGRAM``: "When to draft").
    Drafts are capped so that no step runs past ``prompt + max_new_tokens - 1`` positions: a cache
    sized for plain decoding suffices.
    """
    stats = result.speculative = SpecStats(check_int("draft_len", draft_len, error=InvalidInputError))
    max_ngram = check_int("max_ngram", max_ngram, error=InvalidInputError)
    min_ngram = check_int("min_ngram", min_ngram, maximum=max_ngram, error=InvalidInputError,
                          hint="the shortest suffix to draft from, at most max_ngram")
    miss_ngram = check_int("miss_ngram", miss_ngram, minimum=min_ngram, maximum=max_ngram, error=InvalidInputError,
                           hint="the suffix a draft needs after a miss: from min_ngram to max_ngram")
    queue, need = [int(first)], min_ngram
    while True:
        for tok in queue:
            ids.append(tok)
            result.token_ids.append(tok)
            yield tok
            if eos is not None and tok == eos:
                result.finish_reason = "eos"
                return
            if len(result.token_ids) >= max_new_tokens:
                return
        t0 = time.perf_counter()
        k = min(draft_len, max_new_tokens - len(result.token_ids) - 1)
        drafts = ngram_draft(ids, k, max_ngram, need)
        queue = verify(model, cache, seq_id, queue[-1], drafts, stats)
        if drafts:  # a wholly rejected draft raises the bar; an accepted token lowers it again
            need = miss_ngram if len(queue) == 1 else min_ngram
        result.decode_s += time.perf_counter() - t0
