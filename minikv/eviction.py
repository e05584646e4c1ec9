"""Step 6, continued: keep the keys attention used (H2O, SnapKV), and the exact reference for all policies.

Both policies plug into ``minikv.window.EvictingKVCache`` (and the paged form) like the window:

* **H2O** (heavy hitters, during decode). A budget of B keys per (layer, KV head): the R most
  recent are always kept, the other B - R are the keys with the highest score. A key's score
  accumulates the softmax probability it receives from every query, summed over the query heads
  of its KV group. The attention returns that mass at O(S) extra cost: with the online softmax's
  *final* max m and sum l, key j's probability is exp(s_j - m) / l (``window.attend_slots``).
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

The exact reference
-------------------
``MaskedRecompute`` is one forward over the whole text in which token t sees key k of layer l and
KV head h iff ``k <= t < evicted_at[l, h, k]``: the mask an evicting cache logged. For original
positions every policy's cached run equals it (tests: float64 1e-10, float32 1e-4); with in-cache
positions the reference also rotates each visible key by its rank, as the cache does.
"""

from __future__ import annotations

import numpy as np

from minikv.errors import ConfigError, InvalidInputError, ShapeError, check_choice, check_int
from minikv.kv_cache import NoCache
from minikv.layers import apply_rope
from minikv.window import POSITIONS, Policy, WindowPolicy

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


# --- the exact reference --------------------------------------------------------------------------


class MaskedRecompute(NoCache):
    """One forward over a whole text with the mask an evicting cache logged (one sequence, one step).

    evicted_at: [L, Hkv, n] from ``EvictingKVCache.evicted_at`` (``window.NEVER`` = kept);
    positions:  the cache's contract; ``in-cache`` needs ``rope`` = (cos, sin, layout) and makes the
                model hand over pre-RoPE q and k, as with the cache.
    Like ``NoCache`` (whose storage it inherits) it remembers nothing: feed it the n tokens the cache
    was fed, in one pass.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, evicted_at: np.ndarray,
                 positions: str = "original", rope: tuple | None = None, dtype=np.float32):
        super().__init__(num_layers, num_kv_heads, head_dim, dtype)
        evicted_at = np.asarray(evicted_at)
        if evicted_at.ndim != 3 or evicted_at.shape[:2] != (self.num_layers, self.num_kv_heads):
            raise ShapeError(f"evicted_at.shape={evicted_at.shape}; expected [L={num_layers}, Hkv={num_kv_heads}, n]")
        self.evicted_at = evicted_at
        self.positions = check_choice("positions", positions, POSITIONS)
        if self.positions == "in-cache" and rope is None:
            raise ConfigError("positions='in-cache' needs rope=(cos, sin, layout) to rotate keys by rank")
        self.rope, self.rotates_in_cache = rope, self.positions == "in-cache"

    def mask(self, layer: int, n: int) -> np.ndarray:
        """[Hkv, n, n] bool: query t sees key k iff k <= t < evicted_at[layer, h, k]."""
        if n > self.evicted_at.shape[-1]:
            raise InvalidInputError(f"{n} tokens but the eviction log covers {self.evicted_at.shape[-1]}; feed "
                                    "the reference exactly the tokens the cache was fed")
        t, k = np.arange(n)[:, None], np.arange(n)[None, :]
        return (k <= t)[None] & (t[None] < self.evicted_at[layer][:, None, :n])

    def attend(self, layer: int, q: np.ndarray) -> np.ndarray:
        step = self._check_query(layer, q)
        if len(step.seq_ids) != 1:
            raise InvalidInputError("MaskedRecompute runs one sequence's whole text in one step")
        k, v = self._k[layer], self._v[layer]
        if k is None:
            raise InvalidInputError(f"attend(layer={layer}) before write(layer={layer}) in this step")
        n, hq, d = q.shape
        hkv = self.num_kv_heads
        mask = self.mask(layer, n)                                            # [Hkv, n, n]
        kt, vt = k.transpose(1, 0, 2).astype(q.dtype), v.transpose(1, 0, 2).astype(q.dtype)
        if self.rotates_in_cache:
            return self._ranked(q, kt, vt, mask)
        qg = q.reshape(n, hkv, hq // hkv, d).transpose(1, 2, 0, 3)            # [Hkv, G, n, D]
        scores = qg @ kt[:, None].swapaxes(-1, -2) / np.sqrt(d).astype(q.dtype)
        scores = np.where(mask[:, None], scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        out = (p / p.sum(-1, keepdims=True)) @ vt[:, None]                    # [Hkv, G, n, D]
        return out.transpose(2, 0, 1, 3).reshape(n, hq, d).astype(q.dtype)

    def _ranked(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """In-cache positions, written independently of the cache's code: for each query and KV head, take
        the visible keys in time order, rotate the i-th by angle row i and the query by the last row, then a
        plain softmax. q: [n, Hq, D] and k: [Hkv, n, D] pre-RoPE; v: [Hkv, n, D]; mask: [Hkv, n, n]."""
        cos, sin, layout = self.rope
        n, hq, d = q.shape
        g = hq // self.num_kv_heads
        out = np.empty_like(q)
        for t in range(n):
            for h in range(self.num_kv_heads):
                seen = np.flatnonzero(mask[h, t])                              # time order
                m = seen.size
                kr = apply_rope(k[h, seen][:, None], cos[:m], sin[:m], layout)[:, 0]          # [m, D]
                qr = apply_rope(q[t:t + 1, h * g:(h + 1) * g], cos[m - 1:m], sin[m - 1:m], layout)[0]  # [G, D]
                s = qr @ kr.T / np.sqrt(d).astype(q.dtype)
                p = np.exp(s - s.max(-1, keepdims=True))
                out[t, h * g:(h + 1) * g] = (p / p.sum(-1, keepdims=True)) @ v[h, seen]
        return out
