"""Step 2 on the GPU: the contiguous KV cache (mirrors ``minikv.kv_cache``).

The seam is the NumPy reference's, unchanged: a model opens a step, hands each
layer's new (rotated) K/V to ``write`` and asks ``attend``. The bookkeeping
(steps, sequences, lengths, rollback) is inherited from ``minikv.kv_cache``, and so
is the constructor: the device storage comes in through its storage hook
``_new_store``. Only the two data paths move to the device (``kernels/kv_cache.cu``):

* ``write``  -> ``cache_write_v1``: new rows to ``[layer, slot, head, pos]``;
* ``attend`` -> ``decode_attention_v1``: each packed token's query heads over
  positions ``0 .. pos`` of its sequence, one block per (token, KV head) so the
  whole GQA group shares every K/V tile it loads; or ``decode_attention_v2``
  (split-K: long histories split into ranges that run in parallel, merged by
  the shared ``attention_reduce_v2``); or ``decode_attention_v3`` / ``_v4`` (decode
  steps: K/V straight into registers, the GQA group's queries in registers,
  ``kernels/decode_v3.cuh`` and ``decode_v4.cuh``, which keeps the next iteration's
  loads in flight);
* ``rope_write_attend`` -> ``rope_write_attend_v1`` / ``_v2``: the fused kernel (RoPE
  on q and k, cache write and attention in one launch) for decode steps.

``version`` (the cache's, or per call) means what it means for ``minikv_gpu.paged`` (the
numbers are ``minikv_gpu.versions``'): 1 = one block per (token, KV head), 2 = split-K +
reduce, 3 and 4 = the register-resident decode kernels, None = choose per step. The choice
(``versions.choose_version``): v4 on a decode step it can serve (``versions.decode_refusal``:
one new token per sequence, at most 8 query heads per KV head, head_dim a power of two),
split by ``versions.split_plan``; otherwise ``num_splits`` ranges (None = automatic:
``BLOCKS_PER_SM`` blocks per multiprocessor, at least ``MIN_KEYS_PER_SPLIT`` keys per range),
v1 when that is one. v3 and v4 are decode-only: a call's explicit ``version=3`` or ``4`` on a
step with more than one new token for some sequence raises ``InvalidInputError`` (and
``ConfigError`` for a group or head_dim they cannot serve, or for the fused op); the cache's
``version=3``/``4`` is a policy, so such steps fall back to the automatic v1/v2.

The cache stores float32 or float16 (``dtype``); attention always computes in
float32, exactly as the NumPy cache casts what it reads to the query's dtype.
"""

from __future__ import annotations

import numpy as np

from minikv import kv_cache as _cpu
from minikv.errors import ConfigError, DTypeError, InvalidInputError, ShapeError
from minikv.kv_cache import Step
from minikv_gpu import versions
from minikv_gpu.attention import causal_attention  # NoCache: step 1's attention is its whole data path
from minikv_gpu.runtime import (
    BLOCKS_PER_SM,
    STATIC_SMEM_LIMIT,
    cache_defines,
    check_device_query,
    check_device_rows,
    device_f32,
    get_runtime,
    head_dim_defines,
    multiprocessors,
    score_options,
)

__all__ = ["NoCache", "ContiguousKVCache", "KEY_TILE", "MIN_KEYS_PER_SPLIT", "BLOCKS_PER_SM"]

KEY_TILE = 32             # keys per tile in kv_cache.cu; split boundaries are multiples of it
MIN_KEYS_PER_SPLIT = 256  # below this a split's fixed cost (q load, partial write) outweighs its parallelism


def _check_num_splits(num_splits):
    if num_splits is not None and not (isinstance(num_splits, (int, np.integer)) and num_splits >= 1):
        raise ConfigError(f"num_splits={num_splits!r}; use None (automatic) or a positive integer")
    return num_splits


class NoCache(_cpu.NoCache):
    """Step 1's baseline on the GPU: remembers nothing; ``attend`` runs ``causal_attention``
    (the fused ``causal_attention_v1`` kernel) over the step's own K/V, one sequence at a time."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype=np.float32, *, runtime=None):
        if np.dtype(dtype) != np.float32:
            raise DTypeError(f"dtype={np.dtype(dtype)}; the GPU NoCache holds float32 activations only")
        super().__init__(num_layers, num_kv_heads, head_dim, dtype)
        self.rt = get_runtime(runtime)

    def write(self, layer: int, k, v) -> None:
        self._check_layer(layer)
        check_device_rows(self, self.rt, "k", k, self.num_kv_heads)
        check_device_rows(self, self.rt, "v", v, self.num_kv_heads)
        self._k[layer], self._v[layer] = k, v

    def attend(self, layer: int, q, sinks=None, softcap: float | None = None):
        """q: [N, Hq, D] -> [N, Hq, D] float32; sinks ([Hq] learned sink logits), softcap: as ``attend`` of
        ``ContiguousKVCache`` (``minikv.online_softmax``'s options)."""
        self._check_layer(layer)
        step = self._require_step()
        if self._k[layer] is None:
            raise InvalidInputError(f"attend(layer={layer}) before write(layer={layer}) in this step")
        xp = self.rt.xp
        out = xp.empty(q.shape, dtype=np.float32)
        for i in range(len(step.seq_ids)):
            r = step.rows(i)
            qi, ki, vi = (xp.ascontiguousarray(a[r].transpose(1, 0, 2)) for a in (q, self._k[layer], self._v[layer]))
            out[r] = causal_attention(qi, ki, vi, sinks=sinks, softcap=softcap, runtime=self.rt).transpose(1, 0, 2)
        return out


class ContiguousKVCache(_cpu.ContiguousKVCache):
    """A preallocated cache on the device: ``k, v: [layers, max_seqs, Hkv, max_len, D]``.

    Sequence slots, lengths, capacity checks and step commit/rollback are the
    NumPy class's (inherited, constructor included); this class owns the device
    storage (``_new_store``), ``write``, ``attend`` and the fused ``rope_write_attend``.

    ``version`` (None, 1, 2, 3 or 4; see the module docstring) and ``num_splits`` (``None`` =
    automatic) choose the attention kernel and how many ranges a sequence's history
    is split into. Automatic aims for ``BLOCKS_PER_SM`` blocks per multiprocessor and
    at least ``MIN_KEYS_PER_SPLIT`` keys per range; the simulator counts as one
    multiprocessor, so there only launches of fewer than ``BLOCKS_PER_SM`` blocks over
    long histories split.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_seqs: int, max_len: int,
                 dtype=np.float32, *, runtime=None, version: int | None = None, num_splits: int | None = None):
        head_dim_defines(head_dim)  # fail before allocating anything
        self.version = versions.check_version(version)
        self.num_splits = _check_num_splits(num_splits)
        if version == 1 and num_splits not in (None, 1):
            raise ConfigError(f"version=1 attends each history in one range; num_splits={num_splits} needs "
                              "version=2 (or None)")
        self.rt = get_runtime(runtime)  # _new_store, called by the NumPy constructor, needs it
        self._dev: dict | None = None  # this step's per-token slot/pos on the device
        super().__init__(num_layers, num_kv_heads, head_dim, max_seqs, max_len, dtype)
        self.defines = cache_defines(self.head_dim, self.dtype)

    def _new_store(self, shape: tuple) -> tuple:
        """The storage hook: zeroed K and V stores on the device."""
        return self.rt.xp.zeros(shape, dtype=self.dtype), self.rt.xp.zeros(shape, dtype=self.dtype)

    @classmethod
    def supported_dtypes(cls) -> tuple:
        return (np.float32, np.float16)

    # -- steps: the inherited checks, plus the per-token index arrays the kernels read --------
    def _reserve(self, step: Step) -> None:
        super()._reserve(step)  # raises CacheFullError before anything changes
        slots = np.repeat([self._slot[s] for s in step.seq_ids], step.num_new).astype(np.int32)
        pos = step.positions.astype(np.int32)
        self._dev = {"slot": self.rt.asarray(slots), "pos": self.rt.asarray(pos),
                     "max_keys": int(pos.max()) + 1, "decode": bool(np.all(step.num_new == 1))}

    def _commit(self, step: Step) -> None:
        super()._commit(step)
        self._dev = None

    def _rollback(self, step: Step) -> None:
        super()._rollback(step)
        self._dev = None

    # -- the data paths --------------------------------------------------------------------
    def write(self, layer: int, k, v) -> None:
        """Store the step's new keys/values. k, v: [N, Hkv, D] float32 (keys already rotated)."""
        self._check_layer(layer)
        check_device_rows(self, self.rt, "k", k, self.num_kv_heads)
        check_device_rows(self, self.rt, "v", v, self.num_kv_heads)
        k, v = device_f32(self.rt, k, "k"), device_f32(self.rt, v, "v")
        n = self._step.num_tokens
        vectors = n * self.num_kv_heads * (self.head_dim // 8)
        kern = self.rt.kernel("kv_cache", "cache_write_v1", defines=self.defines)
        kern(((vectors + 255) // 256,), (256,),
             (k, v, self.k, self.v, self._dev["slot"], self._dev["pos"], np.int32(layer), np.int32(n),
              np.int32(self.num_kv_heads), np.int32(self.max_seqs), np.int32(self.max_len)))

    def attend(self, layer: int, q, *, version: int | None = None, num_splits: int | None = None,
               sinks=None, softcap: float | None = None):
        """Attention of the step's queries over each sequence's cached history (this step's rows
        included, causally). q: [N, Hq, D] float32 -> [N, Hq, D] float32. ``version`` and
        ``num_splits`` override the cache's for this call. ``sinks`` ([Hq] learned sink logits) and
        ``softcap`` are ``minikv.online_softmax``'s options; every version takes them."""
        return self.prepare_attend(layer, q, version=version, num_splits=num_splits, sinks=sinks, softcap=softcap)()

    def rope_write_attend(self, layer: int, q, k, v, cos, sin, layout: str, *, version: int | None = None,
                          num_splits: int | None = None, sinks=None, softcap: float | None = None):
        """The fused kernel: ``write(layer, rope(k), v)`` then ``attend(layer, rope(q))`` in one launch.

        q: [N, Hq, D], k/v: [N, Hkv, D] float32, *before* RoPE; cos/sin: [N, D/2] at the
        tokens' positions; layout "interleaved" or "half" (see ``minikv.model.apply_rope``).
        Decode steps only (every sequence brings one token): a sequence's new tokens
        would otherwise need keys written by other blocks of the same launch. ``sinks`` and
        ``softcap``: as for ``attend``.
        """
        out = self.prepare_rope_write_attend(layer, q, k, v, cos, sin, layout, version=version,
                                             num_splits=num_splits, sinks=sinks, softcap=softcap)()
        self._written.add(layer)  # the fused launch wrote this layer's K/V (the seam's rule: KVCacheBase)
        return out

    # -- launches prepared once, for timing ------------------------------------------------
    def prepare_attend(self, layer: int, q, *, version: int | None = None, num_splits: int | None = None,
                       sinks=None, softcap: float | None = None):
        """Validate ``attend``'s arguments and allocate its buffers; return ``launch()``, which runs
        the kernel(s) and returns the output array (the same array every call). Benchmarks time
        ``launch`` alone, without Python-side checks and allocations. ``launch.version``,
        ``launch.splits`` and ``launch.keys_per_split`` say what was chosen."""
        self._check_layer(layer)
        q = self._check_query(q)
        options = score_options(self.rt, q.shape[1], sinks, softcap)
        return self._plan_attention("decode_attention", layer, q, (), version, num_splits, options)

    def prepare_rope_write_attend(self, layer: int, q, k, v, cos, sin, layout: str, *,
                                  version: int | None = None, num_splits: int | None = None, sinks=None,
                                  softcap: float | None = None):
        """``prepare_attend`` for the fused kernel (see ``rope_write_attend``)."""
        self._check_layer(layer)
        step = self._require_step()
        if not self._dev["decode"]:
            raise InvalidInputError(f"rope_write_attend needs one new token per sequence, got num_new="
                                    f"{step.num_new.tolist()}; use apply_rope + write + attend for prefill")
        if layout not in ("interleaved", "half"):
            raise ConfigError(f"rope layout {layout!r}; use 'interleaved' or 'half'")
        q = self._check_query(q)
        options = score_options(self.rt, q.shape[1], sinks, softcap)
        check_device_rows(self, self.rt, "k", k, self.num_kv_heads)
        check_device_rows(self, self.rt, "v", v, self.num_kv_heads)
        half = (step.num_tokens, self.head_dim // 2)
        for name, t in (("cos", cos), ("sin", sin)):
            if getattr(t, "shape", None) != half:
                raise ShapeError(f"{name}.shape={getattr(t, 'shape', None)}, expected [N, D/2] = {half}")
        rt = self.rt
        extra = (device_f32(rt, k, "k"), device_f32(rt, v, "v"), device_f32(rt, cos, "cos"),
                 device_f32(rt, sin, "sin"), np.int32(layout == "half"))
        return self._plan_attention("rope_write_attend", layer, q, extra, version, num_splits, options)

    # -- helpers ---------------------------------------------------------------------------
    def _check_query(self, q):
        check_device_query(self, self.rt, q)
        group = q.shape[1] // self.num_kv_heads
        smem = 4 * KEY_TILE * (2 * self.head_dim + 1) + 4 * group * self.head_dim
        if group > 32 or smem > STATIC_SMEM_LIMIT:
            raise ConfigError(f"a GQA group of {group} query heads (head_dim {self.head_dim}) needs {32 * group} "
                              f"threads and {smem} bytes of shared memory per block; at most 32 heads per KV "
                              f"head and {STATIC_SMEM_LIMIT} bytes are supported")
        return device_f32(self.rt, q, "q")

    def _splits(self, requested: int | None, n_blocks: int) -> tuple[int, int]:
        """v2's (n_splits, keys_per_split) for a launch of ``n_blocks`` (token, KV head) pairs; automatic:
        at least ``BLOCKS_PER_SM`` blocks per multiprocessor and ``MIN_KEYS_PER_SPLIT`` keys per range."""
        max_keys = self._dev["max_keys"]
        want = requested if requested is not None else self.num_splits
        if want is None:
            target = BLOCKS_PER_SM * multiprocessors(self.rt)
            want = min(max(1, -(-target // n_blocks)), -(-max_keys // MIN_KEYS_PER_SPLIT))
        want = max(1, min(int(want), -(-max_keys // KEY_TILE)))  # never an empty split on the longest sequence
        per = -(-max_keys // want)
        per = -(-per // KEY_TILE) * KEY_TILE  # split boundaries on tile boundaries
        return -(-max_keys // per), per

    def _choose(self, version, num_splits, n_blocks: int, group: int, fused: bool) -> tuple[int, int, int]:
        """(version, n_splits, keys_per_split): v1 attends one range; v2 splits (``num_splits`` or
        automatic); v3/v4 (decode steps; ``versions.choose_version``) split by ``versions.split_plan``;
        None without them: v2 when the split count comes out above 1."""
        refusal = versions.decode_refusal(group, self.head_dim, self._dev["decode"], fused)
        version = versions.choose_version(version, self.version, refusal)
        if version == 1 and num_splits not in (None, 1):
            raise ConfigError(f"version=1 attends each history in one range; num_splits={num_splits} "
                              "needs version=2 (or None)")
        if version in (3, 4):
            per_sm = versions.blocks_per_sm(version, group, versions.row_dims(version, self.head_dim, group))
            want = num_splits if num_splits is not None else self.num_splits
            splits, per = versions.split_plan(self._dev["max_keys"], n_blocks, per_sm, multiprocessors(self.rt),
                                     tile=KEY_TILE, min_keys=MIN_KEYS_PER_SPLIT, requested=want)
            return version, splits, per
        splits, per = self._splits(1 if version == 1 else num_splits, n_blocks)
        return version or (2 if splits > 1 else 1), splits, per

    def _plan_attention(self, op: str, layer: int, q, extra: tuple, version, num_splits, options: tuple):
        """The launch of ``op``'s kernel (and the reduce) for ``prepare_attend`` and ``prepare_rope_write_attend``;
        options: ``score_options``' (sinks, use_sinks, softcap), which every kernel here takes last."""
        rt, xp = self.rt, self.rt.xp
        n, hq, d = q.shape
        group = hq // self.num_kv_heads
        version, splits, per = self._choose(version, num_splits, n * self.num_kv_heads, group,
                                            op == "rope_write_attend")
        out = xp.empty((n, hq, d), dtype=np.float32)
        head = (q,) + extra + (self.k, self.v, self._dev["slot"], self._dev["pos"])
        sizes = (np.int32(layer), np.int32(hq), np.int32(self.num_kv_heads), np.int32(self.max_seqs),
                 np.int32(self.max_len))
        scale = (np.float32(1.0 / np.sqrt(d)),) + options
        grid, block, smem = (n, self.num_kv_heads, splits), (32 * group,), 4 * group * d
        defines = versions.decode_defines(self.defines, group) if version >= 3 else self.defines
        kern = rt.kernel("kv_cache", f"{op}_v{version}", defines=defines)
        reduce = None
        if version == 1:
            args = head + (out,) + sizes + scale
        else:
            shape = (n, hq, splits) if splits > 1 or version == 2 else (1, 1, 1)  # v3/v4 unsplit: unused
            parts = (xp.empty(shape, dtype=np.float32), xp.empty(shape, dtype=np.float32),
                     xp.empty(shape + (d,), dtype=np.float32))
            args = head + ((out,) if version >= 3 else ()) + parts + sizes + (np.int32(per), np.int32(splits)) + scale
            if version >= 3:
                block, smem = (versions.DECODE_THREADS,), 0  # decode_core.cuh: 4 warps, static shared memory only
            if splits > 1 or version == 2:
                reduce = rt.kernel("kv_cache", "attention_reduce_v2", defines=self.defines)
                reduce_args = parts + (self._dev["pos"], out, np.int32(hq), np.int32(per), np.int32(splits))

        def launch():
            kern(grid, block, args, shared_mem=smem)
            if reduce is not None:
                reduce((n, hq), (32,), reduce_args)
            return out

        launch.version, launch.splits, launch.keys_per_split = version, splits, per
        return launch
