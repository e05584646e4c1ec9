"""Step 1: attention from scratch, the way a model computes it without any cache.

Everything here is plain math on NumPy arrays; nothing remembers anything
between calls. ``causal_attention`` is also the reference every cached variant
is checked against.

Shapes (leading batch dimensions ``...`` are allowed everywhere):

    q: [..., Hq,  T, D]   queries of the T newest positions
    k: [..., Hkv, S, D]   keys of all S positions (S >= T)
    v: [..., Hkv, S, D]
    out: [..., Hq, T, D]

Grouped-query attention (GQA): Hq query heads share Hkv key/value heads,
``group = Hq // Hkv`` query heads per KV head. Hkv == Hq is classic multi-head
attention (MHA); Hkv == 1 is multi-query attention (MQA).
"""

from __future__ import annotations

import numpy as np

from minikv import online_softmax
from minikv.errors import ConfigError, DTypeError, ShapeError

FLOAT_DTYPES = (np.float32, np.float64)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Numerically stable softmax: ``exp(x - max) / sum(exp(x - max))``.

    Subtracting the row maximum changes nothing mathematically (it cancels in
    the ratio) but keeps ``exp`` from overflowing. A row that is entirely
    ``-inf`` (fully masked) returns zeros instead of 0/0 = NaN: its max is
    clamped to the lowest finite float, so ``exp`` gives 0, and its sum is
    clamped away from 0. Neither clamp can touch a normal row, whose max is
    finite and whose sum is at least exp(0) = 1.
    """
    m = np.maximum(np.max(x, axis=axis, keepdims=True, initial=-np.inf), np.finfo(x.dtype).min)  # initial: S=0 ok
    e = x - m
    np.exp(e, out=e)
    e /= np.maximum(np.sum(e, axis=axis, keepdims=True), np.finfo(x.dtype).tiny)
    return e


def kv_head_for_query_head(num_heads: int, num_kv_heads: int) -> np.ndarray:
    """GQA head mapping: query head h reads KV head ``h // (Hq // Hkv)``. Returns ``[Hq]`` ints."""
    if num_kv_heads <= 0 or num_heads % num_kv_heads != 0:
        raise ConfigError(
            f"num_heads={num_heads} must be a positive multiple of num_kv_heads={num_kv_heads}; "
            "choose num_kv_heads among the divisors of num_heads"
        )
    return np.arange(num_heads) // (num_heads // num_kv_heads)


def check_qkv(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
    """Validate shapes and dtypes of an attention call; raise ShapeError/DTypeError."""
    for name, a in (("q", q), ("k", k), ("v", v)):
        if not isinstance(a, np.ndarray):
            raise DTypeError(f"{name} must be a numpy array, got {type(a).__name__}")
        if a.dtype not in FLOAT_DTYPES:
            raise DTypeError(f"{name}.dtype={a.dtype}; attention computes in float32 or float64, "
                             f"cast with {name}.astype(np.float32)")
        if a.ndim < 3:
            raise ShapeError(f"{name}.shape={a.shape}; expected [..., heads, seq, head_dim]")
    if k.shape != v.shape:
        raise ShapeError(f"k.shape={k.shape} != v.shape={v.shape}; keys and values must match")
    if q.shape[-1] != k.shape[-1]:
        raise ShapeError(f"head_dim differs: q {q.shape[-1]} vs k {k.shape[-1]}")
    if q.shape[:-3] != k.shape[:-3]:
        raise ShapeError(f"batch dims differ: q {q.shape[:-3]} vs k {k.shape[:-3]}")
    hq, hkv = q.shape[-3], k.shape[-3]
    kv_head_for_query_head(hq, hkv)  # raises ConfigError if not divisible
    if q.shape[-2] > k.shape[-2]:
        raise ShapeError(f"{q.shape[-2]} queries but only {k.shape[-2]} keys; queries are the newest "
                         "positions, so there are at least as many keys")
    if q.dtype != k.dtype or k.dtype != v.dtype:
        raise DTypeError(f"mixed dtypes q={q.dtype} k={k.dtype} v={v.dtype}; use one float dtype")


def _grouped_probs(q: np.ndarray, k: np.ndarray, causal: bool) -> np.ndarray:
    """Unchecked core: attention probabilities with query heads grouped per KV head.

    q: [..., Hq, T, D], k: [..., Hkv, S, D] -> [..., Hkv, G*T, S], where row
    ``g*T + t`` of KV head h belongs to query head ``h*G + g``, token t.
    Grouping makes one matmul per KV head serve all G query heads that share
    it: K is read once per group instead of being repeated G times.
    """
    *batch, hq, t, d = q.shape
    hkv, s = k.shape[-3], k.shape[-2]
    g = hq // hkv
    scale = q.dtype.type(1.0 / np.sqrt(d))  # a float32 scalar keeps float32 math float32
    qg = (q * scale).reshape(*batch, hkv, g * t, d)
    scores = qg @ np.swapaxes(k, -1, -2)  # [..., Hkv, G*T, S]
    if causal and t > 1:
        q_pos = np.arange(s - t, s)[:, None]  # query t sits at position S - T + t
        visible = np.arange(s)[None, :] <= q_pos  # [T, S]
        scores = np.where(np.tile(visible, (g, 1)), scores, -np.inf)
    # Softmax written out: every query sees at least its own key, so no row is fully masked
    # and the guards of ``softmax`` are not needed on this hot path (decode calls it per layer).
    scores -= scores.max(axis=-1, keepdims=True, initial=-np.inf)  # initial: no keys (S=0) gives an empty result
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return scores


def attention_weights(q: np.ndarray, k: np.ndarray, causal: bool = True) -> np.ndarray:
    """The attention probabilities ``softmax(q k^T / sqrt(D) + mask)``: [..., Hq, T, S].

    q: [..., Hq, T, D], k: [..., Hkv, S, D]. The T queries are the *last* T of
    the S positions: query t sits at absolute position ``S - T + t`` and may see
    keys ``0 .. S - T + t``. With T == S this is the usual lower-triangular
    mask; with T == 1 (decode) nothing is masked.
    """
    check_qkv(q, k, k)
    return _grouped_probs(q, k, causal).reshape(*q.shape[:-1], k.shape[-2])


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool = True,
                     check: bool = True, sinks: np.ndarray | None = None, softcap: float | None = None) -> np.ndarray:
    """Scaled dot-product attention with a bottom-right causal mask and GQA.

        out = softmax(q k^T / sqrt(D) + mask) v

    q: [..., Hq, T, D], k/v: [..., Hkv, S, D] -> out: [..., Hq, T, D]
    (see ``attention_weights`` for which keys each query may see).
    ``check=False`` skips input validation, for callers (the caches) that
    already validated their arrays and call this once per layer per token.

    This is the textbook form: the whole [T, S] score matrix at once. Long causal
    inputs (more than ``online_softmax.QUERY_TILE`` queries: a prefill, or the
    no-cache baseline) go through ``online_softmax.attend_contiguous`` instead,
    which walks tiles of queries and keys and skips the keys a tile cannot see
    (about half of a causal T x T square), keeping each tile's scores in the CPU
    cache. The result is the same up to float rounding; only the order of work changes.
    Learned ``sinks`` [Hq] and ``softcap`` (``minikv.online_softmax``'s options) take that path too.
    """
    if check:
        check_qkv(q, k, v)
    if causal and (q.shape[-2] > online_softmax.QUERY_TILE or sinks is not None or softcap is not None):
        return online_softmax.attend_contiguous(q, k, v, sinks=sinks, softcap=softcap)
    return (_grouped_probs(q, k, causal) @ v).reshape(q.shape)  # [..., Hkv, G*T, D] -> [..., Hq, T, D]
