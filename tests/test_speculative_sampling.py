"""Speculative sampling keeps the target's distribution (minikv.speculative.accept_sampled).

A toy language model over a 4-token vocabulary: the target is a Markov chain P[prev] -> next, the
drafter another one, Q. Each verify step drafts k tokens from Q, asks P for its k + 1 rows and lets
``accept_sampled`` keep or resample. The first three emitted tokens after a fixed t0 must follow
P[t0, x1] P[x1, x2] P[x2, x3]: a chi-square test over the 64 cells with a fixed seed and 40,000
sequences. The same statistic rejects two wrong rules by a wide margin (keeping every draft, and
resampling from the target instead of the residual), so the test can fail.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from minikv.errors import InvalidInputError
from minikv.speculative import accept_sampled

V, T0, LENGTH, SAMPLES = 4, 2, 2, 20_000
RNG = np.random.default_rng(20261201)
P = RNG.dirichlet(np.ones(V), size=V)                # the target: next-token probabilities after each token
Q = RNG.dirichlet(np.ones(V) * 0.7, size=V)          # a drafter that disagrees with it
ONE_HOT = np.eye(V)[[1, 3, 0, 2]]                    # a deterministic drafter (prompt lookup): q = one-hot
CDF = {id(m): np.cumsum(m, axis=1) for m in (Q, ONE_HOT)}


def keep_all(target, draft, drafts, rng):
    """Wrong: accept every draft (the output follows the drafter)."""
    return list(drafts) + [int(rng.choice(V, p=target[len(drafts)]))]


def resample_target(target, draft, drafts, rng):
    """Wrong: the acceptance test right, but a rejection draws from p instead of max(0, p - q)."""
    for i, d in enumerate(drafts):
        if rng.random() >= target[i, d] / draft[i, d]:
            return list(drafts[:i]) + [int(rng.choice(V, p=target[i]))]
    return list(drafts) + [int(rng.choice(V, p=target[len(drafts)]))]


def generate(rule, drafter: np.ndarray, k: int, seed: int) -> np.ndarray:
    """SAMPLES sequences of LENGTH tokens after T0, produced by verify steps of k drafts each: [SAMPLES, LENGTH]."""
    rng = np.random.default_rng(seed)
    out = np.empty((SAMPLES, LENGTH), dtype=np.int64)
    for n in range(SAMPLES):
        seq = [T0]
        while len(seq) <= LENGTH:
            drafts, prev = [], seq[-1]
            for _ in range(k):  # inverse CDF: rng.choice costs ten times more per draw
                prev = min(int(np.searchsorted(CDF[id(drafter)][prev], rng.random(), side="right")), V - 1)
                drafts.append(prev)
            target = P[[seq[-1], *drafts]]                  # row i: after the i-th fed token
            seq += rule(target, drafter[[seq[-1], *drafts[:-1]]], drafts, rng)
        out[n] = seq[1:LENGTH + 1]
    return out


def chi_square(tokens: np.ndarray) -> float:
    cells = np.ravel_multi_index(tokens.T, (V,) * LENGTH)
    observed = np.bincount(cells, minlength=V**LENGTH)
    expected = (P[T0][:, None] * P).ravel() * len(tokens)          # P[t0, x1] P[x1, x2]
    return float(((observed - expected) ** 2 / expected).sum())


def critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at the normal z (3.09: p = 0.001), by Wilson and Hilferty's approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.slow
@pytest.mark.parametrize("drafter, k", [(Q, 1), (Q, 3), (ONE_HOT, 2)], ids=["q-k1", "q-k3", "one-hot-k2"])
def test_sampled_speculative_output_has_the_target_distribution(drafter, k):
    assert (Q[:, None, :] / P[None, :, :]).max() > 1 > (Q / P).min()   # drafts both under- and over-proposed
    stat, limit = chi_square(generate(accept_sampled, drafter, k, seed=k)), critical(V**LENGTH - 1)
    assert stat < limit, f"chi-square {stat:.1f} over {V**LENGTH - 1} degrees of freedom (limit {limit:.1f})"


@pytest.mark.slow
@pytest.mark.parametrize("wrong", [keep_all, resample_target])
def test_the_statistic_rejects_a_wrong_rule(wrong):
    stat, limit = chi_square(generate(wrong, Q, 3, seed=3)), critical(V**LENGTH - 1)
    assert stat > 10 * limit, f"{wrong.__name__}: chi-square {stat:.1f} should be far above {limit:.1f}"


def test_the_rule_by_hand():
    """q = p: every draft kept; q = one-hot on a token p never picks: always rejected, resampled from p."""
    rng = np.random.default_rng(0)
    p = np.array([[0.5, 0.5, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4]])
    assert accept_sampled(p, p[:1], [1], rng)[:1] == [1]
    never = np.array([[0.0, 0.0, 1.0, 0.0]])
    got = {accept_sampled(p, never, [2], rng)[0] for _ in range(200)}
    assert got == {0, 1}                                            # p's support, without the rejected 2


@pytest.mark.parametrize("target, draft, drafts", [
    (np.full((2, 4), 0.25), np.full((1, 3), 1 / 3), [0]),           # vocabularies differ
    (np.full((2, 4), 0.25), np.full((2, 4), 0.25), [0]),            # k rows where k drafts
    (np.full((2, 4), 0.25), np.array([[0.0, 0.5, 0.5, 0.0]]), [0]),  # a draft its drafter could not draw
    (np.full((2, 4), 0.25), np.full((1, 4), 0.25), [4]),            # outside the vocabulary
])
def test_bad_input_is_refused(target, draft, drafts):
    with pytest.raises(InvalidInputError):
        accept_sampled(target, draft, drafts, np.random.default_rng(0))
