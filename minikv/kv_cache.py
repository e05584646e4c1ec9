"""Step 2: the KV cache interface, the no-cache baseline, and a contiguous cache.

The seam between model math and storage
---------------------------------------
A model never knows which cache it runs on. For every forward pass it opens a
*step* that says which sequences take part and how many new tokens each
brings, then for every layer hands over the new (already RoPE-rotated) keys and
values and asks the cache to attend:

    with cache.step(seq_ids, num_new) as positions:   # positions: [N]
        for layer in range(L):
            ...
            cache.write(layer, k, v)                   # k, v: [N, Hkv, D]
            out = cache.attend(layer, q)               # q: [N, Hq, D] -> [N, Hq, D]

Tokens of all sequences are *packed* along N (no padding): sequence i owns rows
``offsets[i]:offsets[i+1]``. A step either commits entirely (every sequence's
length grows by its ``num_new``) or, if anything raises, changes nothing that
later steps can see. ``truncate(seq_id, new_len)`` takes committed tokens back
(speculative decoding's rollback, ``minikv.speculative``); a cache that cannot
says why with a ``RollbackError``.

Two implementations live here:

* ``NoCache`` is step 1's baseline: it remembers nothing, so the caller must
  feed the whole sequence every time and K/V are recomputed for all of it.
* ``ContiguousKVCache`` preallocates ``[layers, max_seqs, Hkv, max_len, D]``
  for keys and the same for values: prefill writes the prompt once, each
  decode step appends one row and attends over the stored history.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from minikv import online_softmax
from minikv.attention import causal_attention
from minikv.errors import (
    CacheFullError,
    DTypeError,
    InvalidInputError,
    RollbackError,
    ShapeError,
    UnknownSequenceError,
    check_int,
    check_memory,
)
from minikv.seam import after_write, outside_step, records_write

CACHE_DTYPES = (np.float64, np.float32, np.float16)


@dataclass(frozen=True)
class Step:
    """Who takes part in one forward pass, and where their packed rows are.

    seq_ids:   the B sequences, in packing order
    num_new:   [B] new tokens per sequence in this step
    past:      [B] tokens each sequence had cached before this step
    offsets:   [B+1] sequence i owns packed rows ``offsets[i]:offsets[i+1]``
    positions: [N] absolute position of every packed token (past + 0, 1, ...), built on first use (after
               the cache has checked that the step fits, so a huge ``num_new`` is refused before it is built)
    """

    seq_ids: tuple
    num_new: np.ndarray
    past: np.ndarray
    offsets: np.ndarray

    @functools.cached_property
    def positions(self) -> np.ndarray:
        total = int(self.num_new.sum())
        check_memory("num_new", total, 32, what="the step's positions and slot maps", error=InvalidInputError)
        return np.concatenate([np.arange(p, p + n) for p, n in zip(self.past, self.num_new)])

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def rows(self, i: int) -> slice:
        return slice(int(self.offsets[i]), int(self.offsets[i + 1]))


def make_step(seq_ids: Sequence, num_new: Sequence[int], past: Sequence[int]) -> Step:
    """Build a ``Step``, validating ``num_new`` (every sequence brings 1 .. 2^31 - 1 tokens, as integers)."""
    seq_ids = tuple(seq_ids)
    if len(seq_ids) == 0:
        raise InvalidInputError("a step needs at least one sequence; got seq_ids=()")
    if len(set(seq_ids)) != len(seq_ids):
        raise InvalidInputError(f"seq_ids={seq_ids} repeats a sequence; pass each sequence once per step")
    counts = np.ravel(np.asarray(num_new, dtype=object))
    if counts.shape != (len(seq_ids),):
        raise ShapeError(f"num_new has {counts.size} entries for {len(seq_ids)} sequences; give one count each")
    num_new = np.array([check_int("num_new", n, maximum=2**31 - 1, error=InvalidInputError, hint="every sequence "
                                  "in a step brings at least one token") for n in counts], dtype=np.int64)
    return Step(seq_ids, num_new, np.asarray(past, dtype=np.int64), np.concatenate([[0], np.cumsum(num_new)]))


def lookup_sequence(table: dict, seq_id):
    """``table[seq_id]``, or an ``UnknownSequenceError`` that lists the ids the cache knows."""
    try:
        return table[seq_id]
    except (KeyError, TypeError):  # TypeError: an unhashable id
        raise UnknownSequenceError(f"sequence {seq_id!r} is not in the cache (known: "
                                   f"{sorted(table, key=str)}); call add_sequence first") from None


class KVCacheBase:
    """The interface every cache implements (see the module docstring).

    Subclasses implement ``length``, ``_reserve``, ``_commit``, ``_rollback``,
    ``write`` and ``attend``; the step bookkeeping lives here once, and so do the seam's two rules,
    which every subclass's ``write`` and ``attend`` keep (``__init_subclass__`` wraps them): a layer
    attends only after it wrote in this step, and a step commits only once every layer wrote. A
    half-run forward pass therefore never commits rows that hold zeros or another sequence's K/V.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: np.dtype

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype=np.float32):
        for name, val in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            check_int(name, val)
        dtype = np.dtype(dtype)
        if dtype not in [np.dtype(d) for d in self.supported_dtypes()]:
            raise DTypeError(f"cache dtype {dtype} is not supported by {type(self).__name__}; "
                             f"use one of {[np.dtype(d).name for d in self.supported_dtypes()]}")
        self.num_layers, self.num_kv_heads, self.head_dim = int(num_layers), int(num_kv_heads), int(head_dim)
        self.dtype = dtype
        self._step: Step | None = None
        self._written: set = set()  # layers that wrote K/V in the open step

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for name, wrap in (("write", records_write), ("attend", after_write), ("free_sequence", outside_step)):
            fn = cls.__dict__.get(name)
            if fn is not None and not getattr(fn, "_seam_rule", False):
                setattr(cls, name, wrap(fn))

    @classmethod
    def supported_dtypes(cls) -> tuple:
        return CACHE_DTYPES

    # -- sequences ----------------------------------------------------------------
    def add_sequence(self, seq_id) -> None:
        raise NotImplementedError

    def free_sequence(self, seq_id) -> None:
        raise NotImplementedError

    def length(self, seq_id) -> int:
        """Tokens cached for ``seq_id``."""
        raise NotImplementedError

    # -- steps ----------------------------------------------------------------------
    @contextmanager
    def step(self, seq_ids: Sequence, num_new: Sequence[int]) -> Iterator[np.ndarray]:
        """Open a forward pass; yields ``positions`` [N]. Commits on success, rolls back on error."""
        positions = self.begin_step(seq_ids, num_new)
        try:
            yield positions
        except BaseException:
            self.abort_step()
            raise
        self.end_step()

    def begin_step(self, seq_ids: Sequence, num_new: Sequence[int]) -> np.ndarray:
        if self._step is not None:
            raise InvalidInputError("a step is already open on this cache; finish it with end_step() first")
        seq_ids = tuple(seq_ids)
        past = [self.length(s) for s in seq_ids]  # raises UnknownSequenceError
        step = make_step(seq_ids, num_new, past)
        self._reserve(step)  # may raise CacheFullError; must leave the cache unchanged if it does
        self._step, self._written = step, set()
        return step.positions

    def end_step(self) -> None:
        step = self._require_step()
        try:
            missing = sorted(set(range(self.num_layers)) - self._written)
            if missing:  # checked before anything changes: a half-run step must not half-commit
                raise InvalidInputError(f"the step wrote no K/V for layers {missing}; every layer must write "
                                        "(and attend) before the step ends")
            self._commit(step)
        except BaseException:  # a commit that refuses (it checks before changing anything) closes the step
            self._rollback(step)
            raise
        finally:
            self._step = None

    def abort_step(self) -> None:
        if self._step is not None:
            self._rollback(self._step)
            self._step = None

    def truncate(self, seq_id, new_len: int) -> None:
        """Keep only the first ``new_len`` tokens of ``seq_id`` (0 <= new_len <= length; no step open).

        Afterwards the cache is what it would be had the dropped tokens never been written: the next
        step writes at position ``new_len``. A cache that cannot roll back raises ``RollbackError``
        saying why, changing nothing; ``new_len == length`` still asks it (a cheap probe).
        """
        if self._step is not None:
            raise InvalidInputError(f"cannot truncate sequence {seq_id!r} while a step is open; "
                                    "finish the step (end_step or abort_step) first")
        length = self.length(seq_id)  # UnknownSequenceError for an unknown id
        new_len = check_int("new_len", new_len, minimum=0, maximum=length, error=InvalidInputError,
                            hint=f"sequence {seq_id!r} holds {length} tokens; truncate keeps a prefix of them")
        self._truncate(seq_id, new_len)

    def _truncate(self, seq_id, new_len: int) -> None:
        raise RollbackError(f"{type(self).__name__} does not implement truncate, so sequence {seq_id!r} cannot "
                            "be rolled back; use a contiguous, paged or quantized paged cache")

    def _require_step(self) -> Step:
        if self._step is None:
            raise InvalidInputError("no step is open; wrap write/attend in `with cache.step(seq_ids, num_new):`")
        return self._step

    def _check_rows(self, name: str, a: np.ndarray, heads: int) -> None:
        step = self._require_step()
        want = (step.num_tokens, heads, self.head_dim)
        if not isinstance(a, np.ndarray) or a.shape != want:
            got = getattr(a, "shape", type(a).__name__)
            raise ShapeError(f"{name}.shape={got}, expected [N, heads, D] = {want} for this step")
        if a.dtype.kind != "f":
            raise DTypeError(f"{name}.dtype={a.dtype}; pass floating-point activations")

    def _check_query(self, layer: int, q) -> Step:
        """Validate ``attend(layer, q)``: a layer in range, an open step, q: [N, Hq, D]. Returns the step."""
        self._check_layer(layer)
        step = self._require_step()
        if getattr(q, "ndim", None) != 3 or q.shape[0] != step.num_tokens or q.shape[2] != self.head_dim:
            raise ShapeError(f"q.shape={getattr(q, 'shape', type(q).__name__)}, expected [N={step.num_tokens}, Hq, "
                             f"D={self.head_dim}]")
        return step

    def _check_layer(self, layer: int) -> None:
        check_int("layer", layer, minimum=0, maximum=self.num_layers - 1, error=InvalidInputError,
                  hint="a layer index of this cache")

    def _reserve(self, step: Step) -> None:
        pass

    def _commit(self, step: Step) -> None:
        pass

    def _rollback(self, step: Step) -> None:
        pass

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store the step's new keys/values. k, v: [N, Hkv, D] (keys already rotated)."""
        raise NotImplementedError

    def attend(self, layer: int, q: np.ndarray) -> np.ndarray:
        """Attention of the step's queries over each sequence's cached history. q: [N, Hq, D] -> [N, Hq, D]."""
        raise NotImplementedError

    # -- memory -----------------------------------------------------------------------
    def bytes_allocated(self) -> int:
        return 0

    def bytes_used(self) -> int:
        """Bytes holding real tokens: 2 (K and V) x layers x Hkv x D x itemsize x tokens."""
        return 0

    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize


class NoCache(KVCacheBase):
    """Step 1's baseline: keeps nothing between forward passes.

    Every pass must carry each sequence's *whole* token history, whose K/V are
    recomputed and attended causally. ``length`` is therefore always 0 and any
    sequence id is accepted. Generating n tokens after a prompt of p costs
    about n full forward passes over p..p+n tokens: the quadratic baseline.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype=np.float32):
        super().__init__(num_layers, num_kv_heads, head_dim, dtype)
        self._k: list = [None] * self.num_layers
        self._v: list = [None] * self.num_layers

    def add_sequence(self, seq_id) -> None:
        pass

    def free_sequence(self, seq_id) -> None:
        pass

    def length(self, seq_id) -> int:
        return 0

    def _commit(self, step: Step) -> None:
        self._k = [None] * self.num_layers  # forget everything: that is the point
        self._v = [None] * self.num_layers

    _rollback = _commit

    def _truncate(self, seq_id, new_len: int) -> None:
        pass  # nothing is kept, so nothing to take back (length is always 0)

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        self._check_layer(layer)
        self._check_rows("k", k, self.num_kv_heads)
        self._check_rows("v", v, self.num_kv_heads)
        self._k[layer], self._v[layer] = k, v

    def attend(self, layer: int, q: np.ndarray, sinks: np.ndarray | None = None,
               softcap: float | None = None) -> np.ndarray:
        step = self._check_query(layer, q)
        if self._k[layer] is None:
            raise InvalidInputError(f"attend(layer={layer}) before write(layer={layer}) in this step")
        out = np.empty_like(q)
        for i in range(len(step.seq_ids)):
            r = step.rows(i)
            k, v = self._k[layer][r].transpose(1, 0, 2), self._v[layer][r].transpose(1, 0, 2)  # [Hkv, T, D]
            out[r] = self._attend_sequence(layer, q[r], k, v, sinks, softcap)
        return out

    def _attend_sequence(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, sinks, softcap):
        """One whole sequence, causally: q [T, Hq, D], k/v [Hkv, T, D] -> [T, Hq, D]. A later step's
        reference (step 9's windows) overrides this, not ``attend``."""
        k, v = k.astype(q.dtype, copy=False), v.astype(q.dtype, copy=False)
        return causal_attention(q.transpose(1, 0, 2), k, v, check=False, sinks=sinks,
                                softcap=softcap).transpose(1, 0, 2)


class ContiguousKVCache(KVCacheBase):
    """A preallocated cache: each sequence owns one slot of ``max_len`` positions.

    Storage per layer: ``k[layer]: [max_seqs, Hkv, max_len, D]`` (same for v),
    so one sequence's history for one head is a contiguous ``[len, D]`` block.

    Prefill writes T prompt rows at positions ``0..T-1``; each decode step
    writes one row at position ``len`` and attends over ``0..len``. A write
    that would pass ``max_len`` raises ``CacheFullError`` before anything is
    stored. The price of contiguity: every slot reserves ``max_len`` positions
    up front, whether the sequence ever uses them or not (see ``bytes_used``).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_seqs: int, max_len: int,
                 dtype=np.float32):
        super().__init__(num_layers, num_kv_heads, head_dim, dtype)
        for name, val in (("max_seqs", max_seqs), ("max_len", max_len)):
            check_int(name, val)
        self.max_seqs, self.max_len = int(max_seqs), int(max_len)
        shape = (self.num_layers, self.max_seqs, self.num_kv_heads, self.max_len, self.head_dim)
        self.k, self.v = self._new_store(shape)
        self._slot: dict = {}  # seq_id -> slot index
        self._len = np.zeros(self.max_seqs, dtype=np.int64)

    # -- storage hook: a device cache (minikv_gpu.kv_cache) overrides this, write and attend; a latent
    #    cache (minikv.mla) stores one array for both ----
    def _new_store(self, shape: tuple) -> tuple:
        """The zeroed K and V stores, each of ``shape`` = [L, max_seqs, Hkv, max_len, D], in the cache dtype."""
        return np.zeros(shape, dtype=self.dtype), np.zeros(shape, dtype=self.dtype)

    # -- sequences ----------------------------------------------------------------
    def add_sequence(self, seq_id) -> None:
        if seq_id in self._slot:
            raise InvalidInputError(f"sequence {seq_id!r} is already in the cache; free it or pick a new id")
        free = sorted(set(range(self.max_seqs)) - set(self._slot.values()))
        if not free:
            raise CacheFullError(f"all {self.max_seqs} slots are taken, so sequence {seq_id!r} cannot be added; "
                                 "free a finished sequence or build the cache with a larger max_seqs")
        self._slot[seq_id] = free[0]
        self._len[free[0]] = 0

    def free_sequence(self, seq_id) -> None:
        self._slot_of(seq_id)  # raises UnknownSequenceError for an unknown id
        del self._slot[seq_id]

    def _slot_of(self, seq_id) -> int:
        return lookup_sequence(self._slot, seq_id)

    def length(self, seq_id) -> int:
        return int(self._len[self._slot_of(seq_id)])

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._slot

    # -- steps ----------------------------------------------------------------------
    def _reserve(self, step: Step) -> None:
        for sid, past, n in zip(step.seq_ids, step.past, step.num_new):
            if past + n > self.max_len:
                raise CacheFullError(
                    f"sequence {sid!r} holds {past} tokens and this step adds {n}, but max_len={self.max_len}; "
                    f"build the cache with max_len >= {past + n} or stop generating earlier")

    def _commit(self, step: Step) -> None:
        for sid, n in zip(step.seq_ids, step.num_new):
            self._len[self._slot[sid]] += n

    def _truncate(self, seq_id, new_len: int) -> None:
        self._len[self._slot[seq_id]] = new_len  # rows past it are stale: overwritten before they are read

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        self._check_layer(layer)
        self._check_rows("k", k, self.num_kv_heads)
        self._check_rows("v", v, self.num_kv_heads)
        step = self._step
        for i, sid in enumerate(step.seq_ids):
            slot, p, r = self._slot[sid], int(step.past[i]), step.rows(i)
            t = r.stop - r.start
            self.k[layer, slot, :, p:p + t] = k[r].transpose(1, 0, 2)  # [T, Hkv, D] -> [Hkv, T, D]
            self.v[layer, slot, :, p:p + t] = v[r].transpose(1, 0, 2)

    def attend(self, layer: int, q: np.ndarray, sinks: np.ndarray | None = None,
               softcap: float | None = None) -> np.ndarray:
        """q: [N, Hq, D] -> [N, Hq, D]; sinks [Hq] and softcap: ``minikv.online_softmax``'s options."""
        step = self._check_query(layer, q)
        out = np.empty_like(q)
        for i, sid in enumerate(step.seq_ids):
            slot, r = self._slot[sid], step.rows(i)
            s = int(step.past[i] + step.num_new[i])  # history including this step's tokens
            k = self.k[layer, slot, :, :s].astype(q.dtype, copy=False)  # [Hkv, S, D]
            v = self.v[layer, slot, :, :s].astype(q.dtype, copy=False)
            out[r] = online_softmax.attend_contiguous(q[r].transpose(1, 0, 2), k, v, sinks=sinks,
                                                     softcap=softcap).transpose(1, 0, 2)
        return out

    # -- memory -----------------------------------------------------------------------
    def bytes_allocated(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def bytes_used(self) -> int:
        return int(sum(self._len[s] for s in self._slot.values())) * self.bytes_per_token()
