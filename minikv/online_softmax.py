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

Two options some model families need (data in ``minikv.model.ModelConfig``, passed down by the caches):

* **learned sinks** (gpt-oss): one logit ``sink_h`` per query head that joins the softmax
  denominator and carries no value, ``out = sum_j e^{s_j} V_j / (e^{sink} + sum_j e^{s_j})``.
  It is a state that has already seen one key of score ``sink`` and value 0:
  ``start(..., sinks=sink)`` gives ``m = sink, l = 1, acc = 0``, and everything else is unchanged
  (a split-K merge counts it once if exactly one partial starts from it). Unlike StreamingLLM's sink
  *tokens*, nothing is cached for it.
* **tanh soft-capping** (Gemma 2): ``s = cap * tanh(s / cap)`` on each raw score, before the max.
  It must happen per tile, inside the loop: capping changes which score is the max and every
  exponent, so it cannot be applied to a finished output. ``update(..., softcap=cap)``; masked
  keys stay -inf (capping them would give them ``-cap``: a visible key).
"""

from __future__ import annotations

import math
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


def start(shape: tuple, head_dim: int, dtype=np.float32, sinks: np.ndarray | None = None) -> State:
    """The empty state: m = -inf, l = 0, acc = 0, for query rows of ``shape``.

    sinks: learned sink logits broadcastable to ``shape`` (the caller lays one per query head out
           in its own row order): then m = sink, l = 1, acc = 0, as if one key of score ``sink``
           and value 0 had been seen.
    """
    shape = tuple(shape)
    acc = np.zeros(shape + (int(head_dim),), dtype=dtype)
    if sinks is None:
        return State(np.full(shape, -np.inf, dtype=dtype), np.zeros(shape, dtype=dtype), acc)
    m = np.array(np.broadcast_to(np.asarray(sinks, dtype=dtype), shape))  # a writable copy
    return State(m, np.ones(shape, dtype=dtype), acc)


def soft_cap(scores: np.ndarray, cap: float | None, out: np.ndarray | None = None) -> np.ndarray:
    """cap * tanh(scores / cap) (Gemma 2), or ``scores`` unchanged for cap None. -inf stays -inf."""
    if cap is None:
        return scores
    c = scores.dtype.type(cap)  # a scalar of the scores' dtype: float32 math stays float32
    masked = np.isneginf(scores)
    out = np.multiply(np.tanh(np.divide(scores, c, out=out), out=out), c, out=out)
    np.copyto(out, -np.inf, where=masked)
    return out


def _shift(m: np.ndarray) -> np.ndarray:
    """The shift to subtract for a running max: m itself, clamped to the lowest finite float.

    A row that has seen nothing (m = -inf) is shifted by a finite number, so its
    exp(-inf - shift) is 0 rather than exp(-inf - -inf) = NaN; a finite m is unchanged.
    """
    return np.maximum(m, np.finfo(m.dtype).min)


def update(state: State, scores: np.ndarray, values: np.ndarray, mask: np.ndarray | None = None,
           overwrite: bool = False, softcap: float | None = None) -> State:
    """Fold one tile of keys into ``state`` (in place) and return it.

    scores:    [..., Q, K]  already scaled (q . k / sqrt(D)); state.m is [..., Q]
    values:    [..., K, D]  (broadcast against scores' leading dims, as in ``p @ values``)
    mask:      bool, broadcastable to scores; False = the query may not see that key.
               A key that no query of the tile may see has its value row selected to 0,
               so stale NaN slots never reach ``acc``.
    overwrite: ``scores`` is the caller's scratch: mask, shift and exponentiate it in place (its contents
               are garbage afterwards). It saves two [Q, K] copies per tile: about 12% of a 512-token
               contiguous prefill's attention (benchmarks/results/fast_paths.json; decode: no change)
    softcap:   cap the raw scores, ``cap * tanh(s / cap)``, before the max (module docstring)
    """
    if scores.shape[-1] != values.shape[-2]:
        raise ShapeError(f"scores.shape={scores.shape} and values.shape={values.shape}: "
                         "the key axes (scores[-1], values[-2]) must match")
    if softcap is not None:
        scores, overwrite = soft_cap(scores, softcap, out=scores if overwrite else None), True
    if mask is not None:
        if overwrite:
            np.copyto(scores, -np.inf, where=~mask)
        else:
            scores, overwrite = np.where(mask, scores, -np.inf), True  # a new array: ours now
        live = np.swapaxes(np.any(mask, axis=-2, keepdims=True), -1, -2)   # [..., K, 1]
        if not live.all():  # (a causal tile's keys are all seen by its last query: no copy needed)
            values = np.where(live, values, 0)
    m_new = np.maximum(state.m, scores.max(axis=-1, initial=-np.inf))
    shift = _shift(m_new)
    p = np.subtract(scores, shift[..., None], out=scores if overwrite else None)
    np.exp(p, out=p)
    alpha = np.exp(state.m - shift)  # rescales what came before; 0 where m was -inf (the first tile)
    state.l = alpha * state.l + p.sum(axis=-1)
    state.acc = alpha[..., None] * state.acc + p @ values.astype(p.dtype, copy=False)
    state.m = m_new
    return state


def merge(a: State, b: State) -> State:
    """Combine two states over disjoint key ranges (split-K): each side scaled by exp(m_i - m)."""
    m = np.maximum(a.m, b.m)
    shift = _shift(m)
    sa, sb = np.exp(a.m - shift), np.exp(b.m - shift)
    return State(m, sa * a.l + sb * b.l, sa[..., None] * a.acc + sb[..., None] * b.acc)


def finish(state: State) -> np.ndarray:
    """acc / l: [..., D]. A row that saw no key at all (l = 0, acc = 0) returns zeros, never NaN."""
    return state.acc / np.maximum(state.l, np.finfo(state.l.dtype).tiny)[..., None]


def sink_rows(sinks: np.ndarray | None, hkv: int, g: int, t: int) -> np.ndarray | None:
    """[Hq] sink logits laid out as the grouped rows of a KV head: [Hkv, G*T], row g*T + i is
    query head h*G + g (the layout of ``attend_contiguous`` and ``minikv.window.ring.attend_slots``)."""
    if sinks is None:
        return None
    return np.repeat(np.asarray(sinks).reshape(hkv, g), t, axis=1)


# --- one driver: causal attention over a contiguous history, tile by tile --------------------

QUERY_TILE = 64        # query rows per tile of a long causal input (a prefill)
SCORE_BUDGET = 1 << 20  # score elements held at once (4 MiB in float32): sets the key tile

# OpenBLAS (0.3.31 here) computes Q @ K^T for a few query rows over many keys (its "NT" case: K read
# across its rows) 2-5x slower than K @ Q^T ("NN") once rows x keys x D passes its small-matrix kernel:
# 73,728 multiply-adds were the most still fast (3 rows x 384 keys x 64, 9 x 128 x 64), 81,920 the fewest
# already slow (4 x 320 x 64). That is a decode step's 3 rows over 512 keys, a verify pass's 12 over 128.
# Up to THIN_ROWS rows past SMALL_GEMM the scores are computed as K @ Q^T and transposed back; past
# THIN_ROWS the NT product wins. ``benchmarks/decode_profile.py --scores`` sweeps the two forms.
THIN_ROWS = 32
SMALL_GEMM = 72 * 1024


def tile_scores(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """q [..., R, D] . k [..., K, D] -> scores [..., R, K] (C-contiguous: the caller may overwrite them)."""
    rows, keys, d = q.shape[-2], k.shape[-2], q.shape[-1]
    if 2 <= rows <= THIN_ROWS and rows * keys * d > SMALL_GEMM:
        return np.ascontiguousarray(np.swapaxes(k @ np.ascontiguousarray(np.swapaxes(q, -1, -2)), -1, -2))
    return q @ np.swapaxes(k, -1, -2)


def attend_contiguous(q: np.ndarray, k: np.ndarray, v: np.ndarray, key_tile: int | None = None,
                      sinks: np.ndarray | None = None, softcap: float | None = None) -> np.ndarray:
    """Causal GQA attention of the T newest queries over a contiguous K/V history, a key tile at a time.

    q: [..., Hq, T, D], k/v: [..., Hkv, S, D] with S >= T; query t sits at position S - T + t
    and sees keys 0 .. S - T + t. Returns [..., Hq, T, D], equal to
    ``minikv.attention.causal_attention`` up to float rounding.

    Queries go in tiles of ``QUERY_TILE``; a tile reads only the keys it can see (a causal
    prefill skips about half of the T x S square), ``key_tile`` keys at a time (default: as many
    as keep ``SCORE_BUDGET`` scores in hand, so a decode step is one tile up to long contexts).
    Only the keys past the tile's first query are masked: a Tq x Tq triangle at the diagonal, not a
    mask over the whole tile (a verify pass of 8 tokens over 1,024 keys masks 8 x 7 / 2 scores per head).
    The tile's last query sees every key the tile reads, so no value row needs masking either.
    ``sinks`` ([Hq] learned sink logits) and ``softcap`` are the options of the module docstring.
    """
    *batch, hq, t, d = q.shape
    hkv, s = k.shape[-3], k.shape[-2]
    g = hq // hkv
    scale = q.dtype.type(1.0 / np.sqrt(d))  # a float32 scalar keeps float32 math float32
    qg = (q * scale).reshape(*batch, hkv, g, t, d)  # query head h = kv_head * G + g
    out = np.empty(qg.shape, dtype=q.dtype)
    heads = math.prod(batch) * hq
    for t0 in range(0, t, QUERY_TILE):
        t1 = min(t0 + QUERY_TILE, t)
        rows = g * (t1 - t0)  # a KV head's query rows in this tile: row g*Tq + i is head g, query t0 + i
        qt = qg[..., t0:t1, :].reshape(*batch, hkv, rows, d)  # one GEMM per KV head serves its whole group
        tile = key_tile or max(QUERY_TILE, SCORE_BUDGET // (heads * (t1 - t0)))
        state = start(qt.shape[:-1], d, q.dtype, sink_rows(sinks, hkv, g, t1 - t0))
        first_hidden = s - t + t0 + 1  # the first key the tile's first query may not see
        end = s - t + t1  # keys 0 .. end - 1 are all this tile may see
        for k0 in range(0, end, tile):
            k1 = min(k0 + tile, end)
            scores = tile_scores(qt, k[..., k0:k1, :])                      # [..., Hkv, rows, K]
            c0 = max(first_hidden, k0)
            if c0 < k1:  # key j is hidden from query t0 + i while j > S - T + t0 + i
                hidden = np.arange(c0, k1)[None, :] > np.arange(first_hidden - 1, first_hidden - 1 + t1 - t0)[:, None]
                np.copyto(scores[..., c0 - k0:], -np.inf, where=np.tile(hidden, (g, 1)))
            update(state, scores, v[..., k0:k1, :], overwrite=True, softcap=softcap)
        out[..., t0:t1, :] = finish(state).reshape(*batch, hkv, g, t1 - t0, d)
    return out.reshape(q.shape)
