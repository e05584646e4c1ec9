"""Step 6, the reference: one forward over the whole text with the mask an evicting cache logged.

The exact reference
-------------------
``MaskedRecompute`` is one forward over the whole text in which token t sees key k of layer l and
KV head h iff ``k <= t < evicted_at[l, h, k]``: the mask an evicting cache logged. For original
positions every policy's cached run equals it (tests: float64 1e-10, float32 1e-4); with in-cache
positions the reference also rotates each visible key by its rank, as the cache does.
"""

from __future__ import annotations

import numpy as np

from minikv.errors import ConfigError, InvalidInputError, ShapeError, check_choice
from minikv.kv_cache import NoCache
from minikv.layers import apply_rope
from minikv.window.ring import POSITIONS


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
