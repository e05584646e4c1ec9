"""The one sampler: pick the next token from one sequence's logits.

``generate`` (one sequence) and ``Scheduler`` (many) both call
``sample(logits, params, rng)``, with one ``rng`` per sequence made by
``params.new_rng()``, so a seeded request gives the same tokens alone or in a batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minikv.errors import InvalidInputError, ShapeError, check_float, check_int


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token from the logits.

    greedy:      always the argmax (temperature/top_k/top_p ignored)
    temperature: divide logits by it before the softmax (> 0)
    top_k:       keep the k most likely tokens (0 = all)
    top_p:       keep the smallest set whose probability mass reaches top_p (1.0 = all)
    seed:        seeds the sampler's random generator, for reproducible runs (None: fresh entropy)
    """

    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        check_float("temperature", self.temperature, error=InvalidInputError, hint="use greedy=True for argmax")
        check_int("top_k", self.top_k, minimum=0, error=InvalidInputError, hint="use 0 (off) or a positive integer")
        top_p = check_float("top_p", self.top_p, error=InvalidInputError, hint="it must lie in (0, 1]")
        if top_p > 1:
            raise InvalidInputError(f"top_p={self.top_p}; it must lie in (0, 1]")
        if self.seed is not None:
            check_int("seed", self.seed, minimum=0, error=InvalidInputError, hint="or None for a fresh seed")

    def new_rng(self) -> np.random.Generator:
        """The generator for one sequence: make it once, pass it to every ``sample`` call of that sequence."""
        return np.random.default_rng(self.seed)


GREEDY = SamplingParams(greedy=True)


def sample(logits: np.ndarray, params: SamplingParams = GREEDY, rng: np.random.Generator | None = None) -> int:
    """Pick one token id from logits: [V] (one sequence's last row).

    Greedy needs no ``rng`` (``sample(row)`` is the argmax). Sampling draws from
    ``rng``, which the caller keeps per sequence (``params.new_rng()``) so that a
    seeded run is reproducible whatever else runs beside it.
    """
    logits = np.asarray(logits)
    if logits.ndim != 1 or logits.size == 0:
        raise ShapeError(f"logits.shape={logits.shape}; sample one sequence's row of logits [V] at a time")
    if logits.dtype.kind != "f" or not np.isfinite(logits).all():
        bad = "not floats" if logits.dtype.kind != "f" else f"{int(np.sum(~np.isfinite(logits)))} NaN or inf"
        raise InvalidInputError(f"the logits hold {bad} values: the model's weights or activations overflowed "
                                "(check the weights for NaN or huge values), so no token can be picked")
    if params.greedy:
        return int(np.argmax(logits))
    if rng is None:
        raise InvalidInputError("sampling needs rng=params.new_rng(), made once per sequence (greedy needs none)")
    # float64 (the cumulative sum below must not drift); the max is taken out before dividing, so a tiny
    # temperature sends every other logit to -inf and the top one to 0 (never inf - inf = NaN)
    with np.errstate(over="ignore"):
        z = (logits.astype(np.float64) - float(logits.max())) / params.temperature
    if params.top_k and params.top_k < z.size:
        kth = np.partition(z, -params.top_k)[-params.top_k]
        z = np.where(z >= kth, z, -np.inf)
    p = np.exp(z)
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
