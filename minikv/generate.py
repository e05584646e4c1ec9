"""The generation loop: prefill once, then decode one token at a time.

    prefill: run the whole prompt, fill the cache, sample the first new token
    decode:  run only the newest token against the cached history, sample the next

With ``cache="none"`` every step re-runs the model over the whole sequence so
far (step 1's baseline); with a real cache each decode step runs one token.
Both must produce the same tokens under greedy decoding (tests prove it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np

from minikv.errors import ConfigError, InvalidInputError
from minikv.kv_cache import ContiguousKVCache, KVCacheBase, NoCache
from minikv.model import Model

CACHE_KINDS = ("none", "contiguous", "paged")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token from the logits.

    greedy:      always the argmax (temperature/top_k/top_p ignored)
    temperature: divide logits by it before the softmax (> 0)
    top_k:       keep the k most likely tokens (0 = all)
    top_p:       keep the smallest set whose probability mass reaches top_p (1.0 = all)
    seed:        seeds the sampler's random generator, for reproducible runs
    """

    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if not self.temperature > 0:
            raise InvalidInputError(f"temperature={self.temperature}; it must be > 0 (use greedy=True for argmax)")
        if not (isinstance(self.top_k, (int, np.integer)) and self.top_k >= 0):
            raise InvalidInputError(f"top_k={self.top_k!r}; use 0 (off) or a positive integer")
        if not 0 < self.top_p <= 1:
            raise InvalidInputError(f"top_p={self.top_p}; it must lie in (0, 1]")


GREEDY = SamplingParams(greedy=True)


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """Pick one token id from logits: [V]."""
    if params.greedy:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / params.temperature  # float64: the cumulative sum below must not drift
    if params.top_k and params.top_k < z.size:
        kth = np.partition(z, -params.top_k)[-params.top_k]
        z = np.where(z >= kth, z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    if params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        # keep every token up to and including the one that pushes the mass past top_p
        keep = order[: int(np.searchsorted(cum, params.top_p)) + 1]
        mask = np.zeros_like(p, dtype=bool)
        mask[keep] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return int(rng.choice(p.size, p=p))


def make_cache(kind: str, model: Model, max_len: int, max_seqs: int = 1, block_size: int = 16,
               dtype=None) -> KVCacheBase:
    """Build a cache of ``kind`` ("none", "contiguous" or "paged") sized for ``max_seqs`` x ``max_len`` tokens."""
    dtype = model.dtype if dtype is None else dtype
    args = model.new_cache_args()
    if kind == "none":
        return NoCache(**args, dtype=dtype)
    if kind == "contiguous":
        return ContiguousKVCache(**args, max_seqs=max_seqs, max_len=max_len, dtype=dtype)
    if kind == "paged":
        from minikv.paged import PagedKVCache

        if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size < 1:
            raise ConfigError(f"block_size={block_size!r}; a paged cache needs a positive number of token "
                              "slots per block (e.g. --block-size 16)")
        num_blocks = max_seqs * -(-max_len // block_size)  # ceil: enough blocks for every sequence's max length
        return PagedKVCache(**args, num_blocks=num_blocks, block_size=block_size, dtype=dtype)
    raise InvalidInputError(f"cache kind {kind!r}; use one of {CACHE_KINDS}")


@dataclass
class GenerationResult:
    """What one ``generate`` call produced, with its timings.

    prefill_s is the time to the first new token (the prompt's forward pass);
    decode_tokens_per_s counts the tokens after the first, each of which needs
    one decode forward pass.
    """

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    cache: str = "contiguous"
    prefill_s: float = 0.0
    decode_s: float = 0.0
    finish_reason: str = "length"  # "length" or "eos"

    @property
    def decode_tokens_per_s(self) -> float:
        n = len(self.token_ids) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else float("nan")


def stream(model: Model, prompt_ids: Sequence[int], max_new_tokens: int, cache: str = "contiguous",
           sampling: SamplingParams = GREEDY, eos_token_id: int | None = None, block_size: int = 16,
           result: GenerationResult | None = None) -> Iterator[int]:
    """Yield new token ids one by one as they are generated; stops at EOS or ``max_new_tokens``.

    ``result`` (optional) is filled in as generation proceeds: timings and
    tokens, for the caller to read when the iterator is exhausted.
    """
    (prompt,) = model.check_tokens([prompt_ids])
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
        raise InvalidInputError(f"max_new_tokens={max_new_tokens!r}; use a non-negative integer")
    eos = model.config.eos_token_id if eos_token_id is None else eos_token_id
    result = GenerationResult(prompt_ids=[]) if result is None else result
    result.prompt_ids, result.cache = prompt.tolist(), cache
    if max_new_tokens == 0:
        return
    rng = np.random.default_rng(sampling.seed)
    kv = make_cache(cache, model, max_len=prompt.size + max_new_tokens, block_size=block_size)
    kv.add_sequence(0)
    ids = prompt.tolist()

    def next_logits(new: Sequence[int]) -> np.ndarray:
        if cache == "none":  # recompute everything: feed the whole sequence to a cache that forgets
            return model.forward([ids], kv)[0]
        return model.forward([new], kv)[0]

    t0 = time.perf_counter()
    logits = next_logits(ids)
    result.prefill_s = time.perf_counter() - t0
    for i in range(max_new_tokens):
        tok = sample(logits, sampling, rng)
        ids.append(tok)
        result.token_ids.append(tok)
        yield tok  # the consumer's time while we are suspended is not counted below
        if eos is not None and tok == eos:
            result.finish_reason = "eos"
            break
        if i + 1 < max_new_tokens:
            t0 = time.perf_counter()
            logits = next_logits([tok])
            result.decode_s += time.perf_counter() - t0


def generate(model: Model, prompt_ids: Sequence[int], max_new_tokens: int, cache: str = "contiguous",
             sampling: SamplingParams = GREEDY, eos_token_id: int | None = None, block_size: int = 16,
             on_token: Callable[[int], None] | None = None) -> GenerationResult:
    """Generate up to ``max_new_tokens`` tokens after ``prompt_ids``; see ``stream``."""
    result = GenerationResult(prompt_ids=[])  # stream() fills it in
    for tok in stream(model, prompt_ids, max_new_tokens, cache, sampling, eos_token_id, block_size, result):
        if on_token is not None:
            on_token(tok)
    return result
