"""Teacher-forced next-token loss through a KV cache: the measuring stick for lossy caches.

The text is fed to the model the way generation feeds it, except that the next
token is the text's, not a sampled one ("teacher forcing")::

    prefill: ids[0 : prefill]           one forward pass, logits for every position
    decode:  ids[t] for t = prefill .. T-2, one token per pass against the cached history

Position t's logits predict ids[t + 1], so a text of T tokens scores T - 1
predictions and the last token is never fed. Because every decoded token
attends over what the cache *stored* (quantized, evicted, paged...), the loss
measures what the cache does to the model; a lossless cache gives the loss of
one uncached ``model.logits(ids)`` pass (tests/test_perplexity.py proves it).

    NLL_t = -log softmax(logits_t)[ids[t + 1]]       mean_nll = mean over t     ppl = exp(mean_nll)

Log-probabilities are taken in float64 from the model's logits (float32 or
float64): the measurement is exact to the logits, the model's pipeline is untouched.

Hooks for the lossy steps (5: quantization, 6: eviction):

* ``cache_factory(model, max_len) -> KVCacheBase`` builds a cache the registry
  does not know, or a registered one with options (a codec, a window); ``cache``
  is then only its label.
* ``metrics``: objects with ``update(logprobs, targets)`` and ``result() -> dict``,
  fed every scored chunk after the built-in NLL. ``teacher_forced_logits`` is the
  loop as a generator, so a metric can run the *exact* reference in lockstep
  (``zip`` two generators over the same ids): that is where step 5's KL
  divergence against the exact run, top-1 agreement and the perplexity delta plug in
  (see ``NextTokenNLL`` for the shape of a metric).
* ``perplexity_vs_exact(model, ids, cache_factory)`` is that zip: the lossy cache and the exact
  one in lockstep, scored by ``VersusExact`` (mean KL(exact || lossy) in nats, top-1
  agreement, ppl_lossy / ppl_exact - 1), one chunk of each run held at a time.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Iterator, Sequence

import numpy as np

from minikv.errors import InvalidInputError, check_int
from minikv.generate import cache_kind, make_cache
from minikv.kv_cache import KVCacheBase
from minikv.model import Model

# rows of logits turned into float64 log-probabilities at once (256 x a 49,152-token vocabulary: 100 MB)
SCORE_ROWS = 256


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-probabilities of ``logits`` [n, V], in float64."""
    x = np.asarray(logits, dtype=np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


class NextTokenNLL:
    """The built-in metric: the summed negative log-likelihood of the text's next tokens.

    A metric sees each scored chunk once: ``logprobs`` [n, V] (float64) of n
    consecutive positions and ``targets`` [n], the ids those positions predict.
    """

    def __init__(self) -> None:
        self.total, self.count = 0.0, 0

    def update(self, logprobs: np.ndarray, targets: np.ndarray) -> None:
        self.total += float(-logprobs[np.arange(targets.size), targets].sum())
        self.count += int(targets.size)

    def result(self) -> dict:
        mean = self.total / self.count
        return {"scored_tokens": self.count, "mean_nll": mean, "ppl": math.exp(mean)}


def check_eval_ids(model: Model, ids: Sequence[int], prefill: int, name: str = "ids",
                   prefill_name: str = "prefill") -> np.ndarray:
    """``ids`` as int64 after checking them against ``model`` and ``prefill`` (InvalidInputError otherwise).

    Needs T >= 2 tokens (one predicts the next), 1 <= prefill <= T - 1, and
    T - 1 positions within the model's context (the last token is never fed).
    ``name``/``prefill_name`` are what the messages call them (the CLI passes its flags).
    """
    arr = np.asarray(ids)
    if arr.ndim != 1 or arr.size < 2:
        raise InvalidInputError(f"{name} has {arr.size} token(s); a perplexity needs at least 2 "
                                "(each token is scored by the one before it)")
    try:
        (arr,) = model.check_tokens([arr])
    except InvalidInputError as e:
        raise InvalidInputError(f"{name}: {e}") from e
    check_int(prefill_name, prefill, minimum=1, maximum=arr.size - 1, error=InvalidInputError,
              hint=f"the {arr.size} tokens are scored by the {arr.size - 1} before the last: feed 1 to "
                   f"{arr.size - 1} of them in the first pass")
    if arr.size - 1 > model.config.max_position:
        raise InvalidInputError(f"{name} has {arr.size} tokens but the model's context is max_position="
                                f"{model.config.max_position}; use at most {model.config.max_position + 1}")
    return arr


def teacher_forced_logits(model: Model, ids: np.ndarray, kv: KVCacheBase, prefill: int = 1,
                          recompute: bool = False) -> Iterator[tuple[int, np.ndarray]]:
    """Yield ``(start, logits)``: logits [n, V] of positions start .. start + n - 1, in order.

    The first chunk is the prefill (``prefill`` rows), then one row per decoded
    token. ``kv`` must be empty with sequence 0 added; ``recompute`` (a cache that
    forgets, like ``"none"``) feeds the whole text so far at every step instead.
    ``ids`` must already be checked (``check_eval_ids``).
    """
    yield 0, model.forward([ids[:prefill]], kv, all_logits=True)
    for t in range(prefill, ids.size - 1):
        new = ids[: t + 1] if recompute else ids[t: t + 1]
        yield t, model.forward([new], kv)  # [1, V]: the last position only


def perplexity(model: Model, ids: Sequence[int], cache: str = "contiguous", prefill: int = 1,
               block_size: int = 16, cache_factory: Callable[[Model, int], KVCacheBase] | None = None,
               metrics: Sequence = (), progress: Callable[[int], None] | None = None) -> dict:
    """Teacher-forced next-token NLL of ``ids`` through a ``cache`` (see the module docstring).

    model:         any ``Model``
    ids:           T >= 2 token ids
    cache:         a key of ``minikv.generate.CACHE_KINDS`` (or the label of ``cache_factory``'s cache)
    prefill:       tokens fed in the first pass (1 .. T-1); the rest are decoded one by one
    block_size:    tokens per block for ``cache="paged"``
    cache_factory: ``factory(model, max_len)`` builds the cache instead of the registry
    metrics:       extra metrics (``update(logprobs, targets)``, ``result()``), e.g. a KL against the exact run
    progress:      called with the number of positions each pass scored (a progress bar's ``update``)
    returns:       {"tokens", "scored_tokens", "mean_nll", "ppl", "cache", "prefill",
                    "cache_bytes_per_token", "elapsed_s", "tokens_per_s"} plus each metric's result
    """
    arr = check_eval_ids(model, ids, prefill)
    recompute = cache_kind(cache).recompute if cache_factory is None else False
    max_len = arr.size - 1  # tokens fed; the last one is only a target
    if cache_factory is None:
        kv = make_cache(cache, model, max_len=max_len, block_size=block_size)
    else:
        kv = cache_factory(model, max_len)
    kv.add_sequence(0)
    nll = NextTokenNLL()
    every = [nll, *metrics]
    t0 = time.perf_counter()
    for start, logits in teacher_forced_logits(model, arr, kv, prefill, recompute):
        for row in range(0, logits.shape[0], SCORE_ROWS):  # a long prefill is scored a slice at a time
            rows = logits[row: row + SCORE_ROWS]
            targets = arr[start + row + 1: start + row + 1 + rows.shape[0]]
            logprobs = log_softmax(rows)
            for metric in every:
                metric.update(logprobs, targets)
        if progress is not None:
            progress(int(logits.shape[0]))
    elapsed = time.perf_counter() - t0
    out = {"tokens": int(arr.size), **nll.result(), "cache": cache, "prefill": int(prefill),
           "cache_bytes_per_token": int(kv.bytes_per_token()), "elapsed_s": elapsed,
           "tokens_per_s": nll.count / elapsed if elapsed > 0 else float("nan")}
    for metric in metrics:
        out.update(metric.result())
    return out


# --- a lossy cache against the exact run (step 5) ------------------------------------------------


class VersusExact:
    """KL(exact || lossy), top-1 agreement and both NLLs over paired chunks of log-probabilities.

    ``update(exact, lossy, targets)`` takes the float64 log-probabilities [n, V] of the same n
    positions from the two runs. Per position ``KL = sum_v p_v (log p_v - log q_v)`` with p the exact
    distribution (natural log); a row's sum is clamped at 0, the bound it can only miss by rounding.
    """

    def __init__(self, curve: bool = False) -> None:
        self.exact, self.lossy = NextTokenNLL(), NextTokenNLL()
        self.kl_sum, self.kl_max, self.agree = 0.0, 0.0, 0
        self.curve = {"exact": [], "lossy": []} if curve else None  # per-position NLL, when asked

    def update(self, exact: np.ndarray, lossy: np.ndarray, targets: np.ndarray) -> None:
        kl = np.maximum((np.exp(exact) * (exact - lossy)).sum(axis=-1), 0.0)
        self.kl_sum += float(kl.sum())
        self.kl_max = max(self.kl_max, float(kl.max()))
        self.agree += int((exact.argmax(axis=-1) == lossy.argmax(axis=-1)).sum())
        if self.curve is not None:
            rows = np.arange(targets.size)
            self.curve["exact"].extend((-exact[rows, targets]).tolist())
            self.curve["lossy"].extend((-lossy[rows, targets]).tolist())
        self.exact.update(exact, targets)
        self.lossy.update(lossy, targets)

    def result(self) -> dict:
        n, ex = self.lossy.count, self.exact.result()
        return {**self.lossy.result(), "ppl_exact": ex["ppl"], "mean_nll_exact": ex["mean_nll"],
                "kld_vs_exact": self.kl_sum / n, "kld_max_vs_exact": self.kl_max,
                "top1_vs_exact": self.agree / n, "delta_ppl": math.exp(self.lossy.total / n - ex["mean_nll"]) - 1.0,
                **({"nll_curve": self.curve} if self.curve is not None else {})}


def perplexity_vs_exact(model: Model, ids: Sequence[int], cache_factory: Callable[[Model, int], KVCacheBase],
                        prefill: int = 1, exact_cache: str = "contiguous", block_size: int = 16,
                        label: str = "lossy", progress: Callable[[int], None] | None = None,
                        curve: bool = False) -> dict:
    """Teacher-forced run through ``cache_factory``'s cache and the exact ``exact_cache``, in lockstep.

    Both runs see the same ids and the same prefill; the two ``teacher_forced_logits``
    generators are zipped, so one chunk of each is held at a time (never T x V).
    returns: ``perplexity``'s keys for the lossy run ("cache" is ``label``) plus "ppl_exact",
             "mean_nll_exact", "kld_vs_exact" (mean KL(exact || lossy) of the next-token
             distributions, nats), "kld_max_vs_exact", "top1_vs_exact" (fraction of positions whose
             argmax agrees) and "delta_ppl" (ppl_lossy / ppl_exact - 1); with ``curve`` also
             "nll_curve": {"exact": [T - 1], "lossy": [T - 1]} per-position NLLs (position t predicts ids[t + 1])
    """
    arr = check_eval_ids(model, ids, prefill)
    max_len = arr.size - 1
    exact = make_cache(exact_cache, model, max_len=max_len, block_size=block_size)
    lossy = cache_factory(model, max_len)
    recompute = cache_kind(exact_cache).recompute
    for kv in (exact, lossy):
        kv.add_sequence(0)
    versus = VersusExact(curve)
    t0 = time.perf_counter()
    pairs = zip(teacher_forced_logits(model, arr, exact, prefill, recompute),
                teacher_forced_logits(model, arr, lossy, prefill))
    for (start, ex), (_, lo) in pairs:
        for row in range(0, ex.shape[0], SCORE_ROWS):
            targets = arr[start + row + 1: start + row + 1 + ex[row: row + SCORE_ROWS].shape[0]]
            versus.update(log_softmax(ex[row: row + SCORE_ROWS]), log_softmax(lo[row: row + SCORE_ROWS]), targets)
        if progress is not None:
            progress(int(ex.shape[0]))
    elapsed = time.perf_counter() - t0
    res = versus.result()
    return {"tokens": int(arr.size), **res, "cache": label, "prefill": int(prefill),
            "cache_bytes_per_token": float(lossy.bytes_per_token()), "elapsed_s": elapsed,
            "tokens_per_s": res["scored_tokens"] / elapsed if elapsed > 0 else float("nan")}
