"""The online softmax: attention over keys that arrive a tile at a time.

Every attention in minikv, and every attention kernel in minikv_gpu
(``kernels/online_softmax.cuh`` mirrors this file name for name), walks its keys
in tiles and keeps three running numbers per query instead of a score row:

    m    running max of the scores seen so far                 [...]
    l    running sum of exp(score - m)                          [...]
    acc  running sum of exp(score - m) * value                  [..., D]

A new tile of scores ``s`` (with its values ``V``) updates them as

    m'  = max(m, max_j s_j)
    a   = exp(m - m')                          rescales everything seen so far
    l'  = a * l + sum_j exp(s_j - m')
    acc' = a * acc + sum_j exp(s_j - m') * V_j

and ``finish`` returns ``acc / l``. Two partial states over disjoint key ranges
(split-K: two blocks of a GPU grid, two halves of a sequence) merge the same way:
``m = max(m1, m2)``, each side scaled by ``exp(m_i - m)``, then added. The result
does not depend on the tile size or on where the keys were split; only rounding does.

Masked keys score -inf. Two traps are handled here, once:

* a row whose scores are all -inf so far has ``m = -inf``, and ``-inf - -inf`` is
  NaN; such a row is shifted by 0 instead (its ``l`` and ``acc`` stay 0);
* a masked slot may hold stale memory, even NaN (a paged pool's partly filled last
  block). Its probability is 0, but ``0 * NaN = NaN``, so a value row that no query of
  the tile may see is *selected* away, never multiplied by 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minikv.errors import ShapeError


@dataclass
class State:
    """Running (m, l, acc) for a batch of query rows.

    m, l: [...]        (one entry per query row; ``...`` is the caller's layout)
    acc:  [..., D]
    """

    m: np.ndarray
    l: np.ndarray
    acc: np.ndarray

    def __getitem__(self, rows) -> "State":
        """The state of a subset of rows along the first axis (a copy for fancy indices)."""
        return State(self.m[rows], self.l[rows], self.acc[rows])

    def __setitem__(self, rows, other: "State") -> None:
        self.m[rows], self.l[rows], self.acc[rows] = other.m, other.l, other.acc


def start(shape: tuple, head_dim: int, dtype=np.float32) -> State:
    """The empty state: m = -inf, l = 0, acc = 0, for query rows of ``shape``."""
    shape = tuple(shape)
    return State(np.full(shape, -np.inf, dtype=dtype), np.zeros(shape, dtype=dtype),
                 np.zeros(shape + (int(head_dim),), dtype=dtype))


def _safe(m: np.ndarray) -> np.ndarray:
    """The shift to use for a running max: 0 where nothing has been seen (m = -inf)."""
    return np.where(np.isneginf(m), 0, m).astype(m.dtype, copy=False)


def update(state: State, scores: np.ndarray, values: np.ndarray, mask: np.ndarray | None = None) -> State:
    """Fold one tile of keys into ``state`` (in place) and return it.

    scores: [..., Q, K]  already scaled (q . k / sqrt(D)); state.m is [..., Q]
    values: [..., K, D]  (broadcast against scores' leading dims, as in ``p @ values``)
    mask:   bool, broadcastable to scores; False = the query may not see that key.
            A key that no query of the tile may see has its value row selected to 0,
            so stale NaN slots never reach ``acc``.
    """
    if scores.shape[-1] != values.shape[-2]:
        raise ShapeError(f"scores.shape={scores.shape} and values.shape={values.shape}: "
                         "the key axes (scores[-1], values[-2]) must match")
    if mask is not None:
        scores = np.where(mask, scores, -np.inf)
        live = np.swapaxes(np.any(mask, axis=-2, keepdims=True), -1, -2)   # [..., K, 1]
        values = np.where(live, values, 0)
    m_new = np.maximum(state.m, scores.max(axis=-1, initial=-np.inf))
    shift = _safe(m_new)
    alpha = np.exp(state.m - shift)                                         # 0 where m was -inf
    p = np.exp(scores - shift[..., None])
    state.l = alpha * state.l + p.sum(axis=-1)
    state.acc = alpha[..., None] * state.acc + p @ values.astype(p.dtype, copy=False)
    state.m = m_new
    return state


def merge(a: State, b: State) -> State:
    """Combine two states over disjoint key ranges (split-K): each side scaled by exp(m_i - m)."""
    m = np.maximum(a.m, b.m)
    shift = _safe(m)
    sa, sb = np.exp(a.m - shift), np.exp(b.m - shift)
    return State(m, sa * a.l + sb * b.l, sa[..., None] * a.acc + sb[..., None] * b.acc)


def finish(state: State) -> np.ndarray:
    """acc / l: [..., D]. A row that saw no key at all (l = 0) returns zeros, never NaN."""
    l = state.l[..., None]
    return np.divide(state.acc, l, out=np.zeros_like(state.acc), where=l > 0)
