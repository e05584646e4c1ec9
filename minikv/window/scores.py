"""Step 6, the scores: keep the keys attention used (H2O during decode, SnapKV at prefill).

Both policies plug into ``minikv.window.ring.EvictingKVCache`` (and the paged form) like the window:

* **H2O** (heavy hitters, during decode). A budget of B keys per (layer, KV head): the R most
  recent are always kept, the other B - R are the keys with the highest score. A key's score
  accumulates the softmax probability it receives from every query, summed over the query heads
  of its KV group. The attention returns that mass at O(S) extra cost: with the online softmax's
  *final* max m and sum l, key j's probability is exp(s_j - m) / l (``minikv.window.ring.attend_slots``).
  Two scores, both kept per slot:
    - ``raw`` (H2O's, the default here because it *is* H2O): the sum. A key seen by more queries
      has had more chances to collect mass, so old tokens are favoured (sinks emerge by themselves).
    - ``normalized`` (kvpress's ObservedAttention): the sum / the number of queries that saw the key.
  After each step the lowest-scoring non-recent keys go until B remain (ties: the oldest first).
* **SnapKV** (at prefill). The last w prompt queries (the observation window) already say what
  the prompt will be asked for: each prefix key is scored by the attention those w queries give
  it (summed over them and over the group's query heads), pooled along positions (average over
  a ``kernel`` window, zero-padded, so neighbours of a hit survive with it), and the top B - w
  prefix keys per KV head are kept with the whole window. Only the first step (the prompt) is
  compressed; decoding then appends without evicting.

The seeds' selective-caching example keeps a token when its *mean* attention exceeds a threshold.
The mean of a softmax row is always 1/S, so that rule keeps everything or nothing: importance
must be read per key (a column of the attention matrix), which is what H2O and SnapKV do.

"""

from __future__ import annotations

import numpy as np

from minikv.errors import ConfigError, InvalidInputError, check_choice, check_int
from minikv.window.ring import Policy, WindowPolicy

H2O_SCORES = ("raw", "normalized")
POOLINGS = ("avg", "max")


class H2OPolicy(Policy):
    """Heavy hitters + a recent window; see the module docstring. recent default: B // 2."""

    name = "h2o"

    def __init__(self, budget: int, recent: int | None = None, score: str = "raw"):
        self.budget = check_int("budget", budget, hint="keys kept per layer and head, e.g. --budget 128")
        recent = self.budget // 2 if recent is None else recent
        self.recent = check_int("recent", recent, minimum=0, maximum=self.budget, error=ConfigError,
                                hint=f"the recent window is part of the budget: 0 <= R <= B={self.budget}")
        self.score = check_choice("h2o score", score, H2O_SCORES)
        self.capacity = self.budget

    def mass_queries(self, past, num_new):
        return np.ones(num_new, dtype=bool)

    def keep(self, pos, score, seen, last, first_step):
        alive = pos >= 0
        keep = alive.copy()
        value = score if self.score == "raw" else score / np.maximum(seen, 1)
        for h in range(pos.shape[0]):
            extra = int(alive[h].sum()) - self.budget
            if extra <= 0:
                continue
            cand = np.flatnonzero(alive[h] & (pos[h] <= last - self.recent))  # not among the R newest
            order = np.lexsort((pos[h, cand], value[h, cand]))               # lowest score, then oldest
            keep[h, cand[order[:extra]]] = False
        return keep

    def describe(self):
        return {**super().describe(), "budget": self.budget, "recent": self.recent, "score": self.score}


def pool1d(x: np.ndarray, kernel: int, how: str) -> np.ndarray:
    """Pool ``x`` [..., K] along its last axis with a centred odd ``kernel``, zero (avg) or -inf (max) padded."""
    if kernel == 1:
        return x
    pad = kernel // 2
    fill = 0.0 if how == "avg" else -np.inf
    xp = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(pad, pad)], constant_values=fill)
    win = np.lib.stride_tricks.sliding_window_view(xp, kernel, axis=-1)     # [..., K, kernel]
    return win.mean(-1) if how == "avg" else win.max(-1)


class SnapKVPolicy(Policy):
    """Compress the prompt to B keys per (layer, KV head) by the observation window's attention.
    obs_window default: SnapKV's 32, or B // 2 for a budget under 64 (the window must leave room)."""

    name = "snapkv"

    def __init__(self, budget: int, obs_window: int | None = None, kernel: int = 5, pooling: str = "avg"):
        self.budget = check_int("budget", budget, hint="keys kept per layer and head, e.g. --budget 128")
        obs_window = min(32, max(1, self.budget // 2)) if obs_window is None else obs_window  # SnapKV's 32
        self.obs_window = check_int("obs_window", obs_window, maximum=self.budget, error=ConfigError,
                                    hint=f"the observation window is kept whole, so it must fit the budget "
                                         f"B={self.budget}")
        self.kernel = check_int("kernel", kernel, hint="an odd pooling width such as 5")
        if self.kernel % 2 == 0:
            raise ConfigError(f"kernel={kernel}: use an odd pooling width (centred), such as 5")
        self.pooling = check_choice("pooling", pooling, POOLINGS)
        self.capacity = self.budget

    def mass_queries(self, past, num_new):
        if past > 0 or num_new <= self.budget:
            return None  # not the prompt, or nothing to compress
        rows = np.zeros(num_new, dtype=bool)
        rows[-self.obs_window:] = True
        return rows

    def keep(self, pos, score, seen, last, first_step):
        alive = pos >= 0
        if not first_step or alive.sum(-1).max() <= self.budget:
            return alive
        keep = alive.copy()
        for h in range(pos.shape[0]):
            prefix = np.flatnonzero(alive[h] & (pos[h] <= last - self.obs_window))
            prefix = prefix[np.argsort(pos[h, prefix], kind="stable")]        # time order, for pooling
            pooled = pool1d(score[h, prefix], self.kernel, self.pooling)
            top = np.lexsort((pos[h, prefix], -pooled))[: self.budget - self.obs_window]
            keep[h, prefix] = False
            keep[h, prefix[top]] = True
        return keep

    def describe(self):
        return {**super().describe(), "budget": self.budget, "obs_window": self.obs_window,
                "kernel": self.kernel, "pooling": self.pooling}


class PrefillOnly(Policy):
    """Apply ``inner``'s choice once, after the prompt, then keep everything (kvpress's protocol).

    The prompt itself attends causally over all of its keys (kvpress cuts each layer's cache after
    that layer's attention); decoding then appends without evicting. ``WindowPolicy(W + 1, S)``
    inside keeps S sinks and the W - S latest prompt tokens (the window counts the next token).
    """

    def __init__(self, inner: Policy):
        self.inner, self.name, self.capacity = inner, f"{inner.name}@prefill", inner.capacity

    def mass_queries(self, past, num_new):
        return self.inner.mass_queries(past, num_new) if past == 0 else None

    def keep(self, pos, score, seen, last, first_step):
        return self.inner.keep(pos, score, seen, last, first_step) if first_step else pos >= 0

    def describe(self):
        return {**self.inner.describe(), "policy": self.name}


POLICIES = {"window": WindowPolicy, "h2o": H2OPolicy, "snapkv": SnapKVPolicy}
# each policy's options; a flag given to the wrong kind is refused rather than ignored
POLICY_OPTIONS = {"window": ("window", "sinks", "positions"), "h2o": ("budget", "recent", "score"),
                  "snapkv": ("budget", "obs_window", "kernel", "pooling")}
REQUIRED = {"window": "window", "h2o": "budget", "snapkv": "budget"}


def make_policy(kind: str, **options) -> Policy:
    """The policy of cache kind ``kind`` ("window", "h2o", "snapkv") from its options (None = default)."""
    check_choice("eviction kind", kind, tuple(POLICIES), error=InvalidInputError)
    options = {k: v for k, v in options.items() if v is not None}
    wrong = sorted(set(options) - set(POLICY_OPTIONS[kind]))
    if wrong:
        raise ConfigError(f"option(s) {wrong} do not apply to cache {kind!r}; it takes {list(POLICY_OPTIONS[kind])}")
    if REQUIRED[kind] not in options:
        raise ConfigError(f"cache {kind!r} needs {REQUIRED[kind]}=N (the keys it keeps per layer and KV head), "
                          f"e.g. --{REQUIRED[kind]} 128")
    return POLICIES[kind](**options)
