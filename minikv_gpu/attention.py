"""Step 1 on the GPU: attention without a cache (mirrors ``minikv.attention``).

Same functions, same shapes, same masks as the NumPy reference; arrays live on
the device (CuPy) or, on the CPU simulator, are NumPy arrays that the kernels
of ``kernels/attention.cu`` read through pointers. Everything is float32.

    q: [..., Hq,  T, D]   k, v: [..., Hkv, S, D]   out: [..., Hq, T, D]

Two versions of ``causal_attention``; ``version=N`` runs the kernels named ``_vN``, and N
means what it means in every kernel file (``minikv_gpu.versions``):

* ``version=0``: ``q k^T`` with ``xp.matmul``, the ``causal_softmax_v0`` kernel,
  then ``probs v``: the textbook, which writes the [Hq, T, S] scores to memory;
* ``version=1`` (default): one kernel, ``causal_attention_v1``, one block per 4 query
  rows over their whole key range, with an online softmax over tiles of 32 keys
  (``kernels/online_softmax.cuh``); the scores never leave the chip.

GPU-wing restriction: ``head_dim`` is a multiple of 8 and at most 128 (16-byte
vector loads; the key/value tiles fit the 48 KB of static shared memory).
"""

from __future__ import annotations

import numpy as np

from minikv.attention import check_qkv as ref_check_qkv
from minikv.attention import kv_head_for_query_head
from minikv.errors import ConfigError, DTypeError, ShapeError
from minikv_gpu.runtime import device_f32, get_runtime, head_dim_defines, score_options

__all__ = ["softmax", "kv_head_for_query_head", "check_qkv", "attention_weights", "causal_attention", "THREADS"]

THREADS = 128  # threads per block of the row-wise kernels
ROWS_PER_BLOCK = 4  # query rows per block of causal_attention_v1 (one warp each)


def _grid(n: int, per_block: int) -> int:
    return (n + per_block - 1) // per_block


def _rows(a):
    """View ``a`` [..., S] as [R, S] rows (also when R or S is 0, where reshape(-1, S) is ambiguous)."""
    return a.reshape(int(np.prod(a.shape[:-1], dtype=np.int64)), a.shape[-1])


def _masked_softmax(rt, scores, t: int, causal: bool):
    """Row softmax of ``scores`` [R, S] (row r is query ``r % t``) with the bottom-right mask."""
    r, s = scores.shape
    out = rt.xp.empty_like(scores)
    if r and s:
        k = rt.kernel("attention", "causal_softmax_v0")
        k((r,), (THREADS,), (scores, out, np.int32(r), np.int32(max(t, 1)), np.int32(s), np.int32(causal)))
    return out


def softmax(x, axis: int = -1, *, runtime=None):
    """Numerically stable softmax along ``axis`` (kernel ``causal_softmax_v0`` without a mask).

    As in ``minikv.attention.softmax``, a row whose maximum is not finite is
    shifted by 0 instead, and a row whose exponentials sum to 0 returns zeros.
    """
    rt = get_runtime(runtime)
    x = device_f32(rt, x, "x")
    if x.ndim == 0:
        raise ShapeError("x is a scalar; softmax needs at least one axis")
    if not -x.ndim <= axis < x.ndim:
        raise ShapeError(f"axis={axis} is out of range for x.shape={x.shape}")
    moved = rt.xp.ascontiguousarray(rt.xp.moveaxis(x, axis, -1))
    out = _masked_softmax(rt, _rows(moved), 1, causal=False).reshape(moved.shape)
    return rt.xp.moveaxis(out, -1, axis)


def check_qkv(q, k, v, *, runtime=None) -> None:
    """Validate an attention call on device arrays; raise ShapeError/DTypeError/ConfigError.

    The shape rules are the NumPy reference's own ``check_qkv``, applied to
    zero-byte host stand-ins of the same shapes (so both wings accept exactly
    the same calls); on top, the GPU wing computes in float32 only and needs a
    supported head_dim.
    """
    rt = get_runtime(runtime)
    for name, a in (("q", q), ("k", k), ("v", v)):
        if not isinstance(a, (rt.xp.ndarray, np.ndarray)):
            raise DTypeError(f"{name} must be a {rt.xp.__name__} or numpy array, got {type(a).__name__}")
        if a.dtype != np.float32:
            raise DTypeError(f"{name}.dtype={a.dtype}; the GPU kernels compute in float32, "
                             f"cast with {name}.astype(np.float32)")
    ref_check_qkv(*(_stand_in(a) for a in (q, k, v)))
    head_dim_defines(q.shape[-1])


def _stand_in(a) -> np.ndarray:
    """A host array with ``a``'s shape and dtype that owns no memory (all strides 0)."""
    return np.lib.stride_tricks.as_strided(np.zeros(1, a.dtype), shape=a.shape, strides=(0,) * a.ndim)


def attention_weights(q, k, causal: bool = True, *, runtime=None):
    """The attention probabilities ``softmax(q k^T / sqrt(D) + mask)``: [..., Hq, T, S].

    Query t of T sits at position ``S - T + t`` and sees keys ``0 .. S - T + t``.
    Scores come from ``xp.matmul``; the mask and softmax from ``causal_softmax_v0``.
    """
    rt = get_runtime(runtime)
    check_qkv(q, k, k, runtime=rt)
    q, k = device_f32(rt, q, "q"), device_f32(rt, k, "k")
    *batch, hq, t, d = q.shape
    hkv, s = k.shape[-3], k.shape[-2]
    qg = q.reshape(*batch, hkv, hq // hkv, t, d)  # each KV head serves a group of query heads
    scale = np.float32(1.0 / np.sqrt(d))
    scores = rt.xp.matmul(qg, rt.xp.swapaxes(k, -1, -2)[..., None, :, :]) * scale  # [..., Hkv, G, T, S]
    scores = rt.xp.ascontiguousarray(scores, dtype=np.float32)
    probs = _masked_softmax(rt, _rows(scores), t, causal and t > 1)
    return probs.reshape(*batch, hq, t, s)


def causal_attention(q, k, v, causal: bool = True, check: bool = True, *, sinks=None, softcap: float | None = None,
                     version: int = 1, runtime=None):
    """Scaled dot-product attention with a bottom-right causal mask and GQA.

    q: [..., Hq, T, D], k/v: [..., Hkv, S, D] -> out: [..., Hq, T, D] (float32)
    check: validate the call (``minikv.attention.causal_attention``'s argument; the dtype and head_dim
    checks of the GPU wing run always, since a kernel cannot take what they refuse)
    version 0: matmul + ``causal_softmax_v0`` + matmul; version 1: the fused kernel ``causal_attention_v1``.
    sinks ([Hq] learned sink logits, float32), softcap: ``minikv.online_softmax``'s options (version 1).
    """
    rt = get_runtime(runtime)
    if check:
        check_qkv(q, k, v, runtime=rt)
    else:
        head_dim_defines(q.shape[-1])
    if isinstance(version, bool) or version not in (0, 1):
        raise ConfigError(f"version={version!r}; causal_attention has versions 0 (the textbook: matmul + "
                          "softmax kernel + matmul) and 1 (the fused kernel)")
    q, k, v = (device_f32(rt, a, n) for a, n in ((q, "q"), (k, "k"), (v, "v")))
    *batch, hq, t, d = q.shape
    options = score_options(rt, hq, sinks, softcap)
    if version == 0 and (sinks is not None or softcap is not None):
        raise ConfigError("learned sinks and soft-capping run in causal_attention's fused kernel (version=1); "
                          "version 0's softmax kernel does not take them")
    hkv, s = k.shape[-3], k.shape[-2]
    if version == 0:
        probs = attention_weights(q, k, causal, runtime=rt).reshape(*batch, hkv, hq // hkv, t, s)
        out = rt.xp.matmul(probs, v[..., None, :, :])  # [..., Hkv, G, T, D]
        return rt.xp.ascontiguousarray(out.reshape(*batch, hq, t, d))
    b = int(np.prod(batch, dtype=np.int64))
    out = rt.xp.empty(q.shape, dtype=np.float32)
    if out.size == 0:
        return out
    if b > 65535:
        raise ShapeError(f"{b} batch entries exceed the grid's z limit of 65535; split the batch")
    kern = rt.kernel("attention", "causal_attention_v1", defines=head_dim_defines(d))
    kern((_grid(t, ROWS_PER_BLOCK), hq, b), (32 * ROWS_PER_BLOCK,),
         (q, k, v, out, np.int32(hq), np.int32(hkv), np.int32(t), np.int32(s), np.int32(causal),
          np.float32(1.0 / np.sqrt(d))) + options)
    return out
