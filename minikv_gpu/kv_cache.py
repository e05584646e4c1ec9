"""Step 2 on the GPU: the contiguous KV cache (mirrors ``minikv.kv_cache``).

The seam is the NumPy reference's, unchanged: a model opens a step, hands each
layer's new (rotated) K/V to ``write`` and asks ``attend``. The bookkeeping
(steps, sequences, lengths, rollback) is inherited from ``minikv.kv_cache``;
only the storage and the two data paths move to the device:

* ``write``  -> ``cache_write_v1``: new rows to ``[layer, slot, head, pos]``;
* ``attend`` -> ``decode_attention_v1``: each packed token's query heads over
  positions ``0 .. pos`` of its sequence, one block per (token, KV head) so the
  whole GQA group shares every K/V tile it loads; long histories are split into
  ranges that run in parallel and are merged by ``decode_attention_combine_v1``;
* ``rope_write_attend`` -> ``decode_attention_v2``: the fused kernel (RoPE on q
  and k, cache write and attention in one launch) for decode steps.

The cache stores float32 or float16 (``dtype``); attention always computes in
float32, exactly as the NumPy cache casts what it reads to the query's dtype.
"""

from __future__ import annotations

import numpy as np

from minikv import kv_cache as _cpu
from minikv.errors import ConfigError, DTypeError, InvalidInputError, ShapeError
from minikv.kv_cache import KVCacheBase, Step
from minikv_gpu.attention import causal_attention, device_f32, get_runtime, head_dim_defines

__all__ = ["NoCache", "ContiguousKVCache", "KEY_TILE", "MIN_KEYS_PER_SPLIT", "BLOCKS_PER_SM"]

KEY_TILE = 32             # keys per tile in kv_cache.cu; split boundaries are multiples of it
MIN_KEYS_PER_SPLIT = 256  # below this a split's fixed cost (q load, partial write) outweighs its parallelism
BLOCKS_PER_SM = 4         # automatic splits aim for this many blocks per multiprocessor (a block is only
#                           G warps, so one per SM leaves too few loads in flight to stream from HBM);
#                           a first guess: benchmarks/gpu_check.py sweeps the split count to tune it
STATIC_SMEM_LIMIT = 48 * 1024


def _check_device_rows(cache: KVCacheBase, rt, name: str, a, heads: int) -> None:
    """``KVCacheBase._check_rows`` for device arrays: a [N, heads, D] float array of this step."""
    step = cache._require_step()
    want = (step.num_tokens, heads, cache.head_dim)
    if not isinstance(a, (rt.xp.ndarray, np.ndarray)) or a.shape != want:
        got = getattr(a, "shape", type(a).__name__)
        raise ShapeError(f"{name}.shape={got}, expected [N, heads, D] = {want} for this step")
    if a.dtype != np.float32:
        raise DTypeError(f"{name}.dtype={a.dtype}; the GPU cache takes float32 activations, "
                         f"cast with {name}.astype(np.float32)")


class NoCache(_cpu.NoCache):
    """Step 1's baseline on the GPU: remembers nothing; ``attend`` runs ``causal_attention``
    (the fused ``causal_attention_v2`` kernel) over the step's own K/V, one sequence at a time."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype=np.float32, *, runtime=None):
        if np.dtype(dtype) != np.float32:
            raise DTypeError(f"dtype={np.dtype(dtype)}; the GPU NoCache holds float32 activations only")
        super().__init__(num_layers, num_kv_heads, head_dim, dtype)
        self.rt = get_runtime(runtime)

    def write(self, layer: int, k, v) -> None:
        self._check_layer(layer)
        _check_device_rows(self, self.rt, "k", k, self.num_kv_heads)
        _check_device_rows(self, self.rt, "v", v, self.num_kv_heads)
        self._k[layer], self._v[layer] = k, v

    def attend(self, layer: int, q):
        self._check_layer(layer)
        step = self._require_step()
        if self._k[layer] is None:
            raise InvalidInputError(f"attend(layer={layer}) before write(layer={layer}) in this step")
        xp = self.rt.xp
        out = xp.empty(q.shape, dtype=np.float32)
        for i in range(len(step.seq_ids)):
            r = step.rows(i)
            qi, ki, vi = (xp.ascontiguousarray(a[r].transpose(1, 0, 2)) for a in (q, self._k[layer], self._v[layer]))
            out[r] = causal_attention(qi, ki, vi, runtime=self.rt).transpose(1, 0, 2)
        return out


class ContiguousKVCache(_cpu.ContiguousKVCache):
    """A preallocated cache on the device: ``k, v: [layers, max_seqs, Hkv, max_len, D]``.

    Sequence slots, lengths, capacity checks and step commit/rollback are the
    NumPy class's (inherited); this class owns the device storage, ``write``,
    ``attend`` and the fused ``rope_write_attend``.

    ``num_splits`` (``None`` = automatic) sets how many ranges a sequence's
    history is split into for attention. Automatic aims for ``BLOCKS_PER_SM``
    blocks per multiprocessor and at least ``MIN_KEYS_PER_SPLIT`` keys per
    range; the simulator counts as one multiprocessor, so there only launches
    of fewer than ``BLOCKS_PER_SM`` blocks over long histories split.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_seqs: int, max_len: int,
                 dtype=np.float32, *, runtime=None, num_splits: int | None = None):
        # Not super().__init__: that would allocate the NumPy storage. Set up the same bookkeeping instead.
        KVCacheBase.__init__(self, num_layers, num_kv_heads, head_dim, dtype)
        for name, val in (("max_seqs", max_seqs), ("max_len", max_len)):
            if not isinstance(val, (int, np.integer)) or val < 1:
                raise ConfigError(f"{name}={val!r} must be a positive integer")
        if num_splits is not None and not (isinstance(num_splits, (int, np.integer)) and num_splits >= 1):
            raise ConfigError(f"num_splits={num_splits!r}; use None (automatic) or a positive integer")
        self.defines = {**head_dim_defines(head_dim), "CACHE_HALF": int(self.dtype == np.float16)}
        self.rt = get_runtime(runtime)
        self.max_seqs, self.max_len = int(max_seqs), int(max_len)
        self.num_splits = num_splits
        shape = (self.num_layers, self.max_seqs, self.num_kv_heads, self.max_len, self.head_dim)
        self.k = self.rt.xp.zeros(shape, dtype=self.dtype)
        self.v = self.rt.xp.zeros(shape, dtype=self.dtype)
        self._slot: dict = {}
        self._len = np.zeros(self.max_seqs, dtype=np.int64)
        self._dev: dict | None = None  # this step's per-token slot/pos on the device

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
        _check_device_rows(self, self.rt, "k", k, self.num_kv_heads)
        _check_device_rows(self, self.rt, "v", v, self.num_kv_heads)
        k, v = device_f32(self.rt, k, "k"), device_f32(self.rt, v, "v")
        n = self._step.num_tokens
        vectors = n * self.num_kv_heads * (self.head_dim // 8)
        kern = self.rt.kernel("kv_cache", "cache_write_v1", defines=self.defines)
        kern(((vectors + 255) // 256,), (256,),
             (k, v, self.k, self.v, self._dev["slot"], self._dev["pos"], np.int32(layer), np.int32(n),
              np.int32(self.num_kv_heads), np.int32(self.max_seqs), np.int32(self.max_len)))

    def attend(self, layer: int, q, *, num_splits: int | None = None):
        """Attention of the step's queries over each sequence's cached history (this step's rows
        included, causally). q: [N, Hq, D] float32 -> [N, Hq, D] float32."""
        return self.prepare_attend(layer, q, num_splits=num_splits)()

    def rope_write_attend(self, layer: int, q, k, v, cos, sin, layout: str, *, num_splits: int | None = None):
        """The fused kernel: ``write(layer, rope(k), v)`` then ``attend(layer, rope(q))`` in one launch.

        q: [N, Hq, D], k/v: [N, Hkv, D] float32, *before* RoPE; cos/sin: [N, D/2] at the
        tokens' positions; layout "interleaved" or "half" (see ``minikv.model.apply_rope``).
        Decode steps only (every sequence brings one token): a sequence's new tokens
        would otherwise need keys written by other blocks of the same launch.
        """
        return self.prepare_rope_write_attend(layer, q, k, v, cos, sin, layout, num_splits=num_splits)()

    # -- launches prepared once, for timing ------------------------------------------------
    def prepare_attend(self, layer: int, q, *, num_splits: int | None = None):
        """Validate ``attend``'s arguments and allocate its buffers; return ``launch()``, which runs
        the kernel(s) and returns the output array (the same array every call). Benchmarks time
        ``launch`` alone, without Python-side checks and allocations."""
        self._check_layer(layer)
        q = self._check_query(q)
        return self._plan_attention("decode_attention_v1", layer, q, (), num_splits)

    def prepare_rope_write_attend(self, layer: int, q, k, v, cos, sin, layout: str, *,
                                  num_splits: int | None = None):
        """``prepare_attend`` for the fused kernel (see ``rope_write_attend``)."""
        self._check_layer(layer)
        step = self._require_step()
        if not self._dev["decode"]:
            raise InvalidInputError(f"rope_write_attend needs one new token per sequence, got num_new="
                                    f"{step.num_new.tolist()}; use apply_rope + write + attend for prefill")
        if layout not in ("interleaved", "half"):
            raise ConfigError(f"rope layout {layout!r}; use 'interleaved' or 'half'")
        q = self._check_query(q)
        _check_device_rows(self, self.rt, "k", k, self.num_kv_heads)
        _check_device_rows(self, self.rt, "v", v, self.num_kv_heads)
        half = (step.num_tokens, self.head_dim // 2)
        for name, t in (("cos", cos), ("sin", sin)):
            if getattr(t, "shape", None) != half:
                raise ShapeError(f"{name}.shape={getattr(t, 'shape', None)}, expected [N, D/2] = {half}")
        rt = self.rt
        extra = (device_f32(rt, k, "k"), device_f32(rt, v, "v"), device_f32(rt, cos, "cos"),
                 device_f32(rt, sin, "sin"), np.int32(layout == "half"))
        return self._plan_attention("decode_attention_v2", layer, q, extra, num_splits)

    # -- helpers ---------------------------------------------------------------------------
    def _check_query(self, q):
        step = self._require_step()
        if not isinstance(q, (self.rt.xp.ndarray, np.ndarray)) or q.ndim != 3 or q.shape[0] != step.num_tokens \
                or q.shape[2] != self.head_dim or q.shape[1] % self.num_kv_heads:
            raise ShapeError(f"q.shape={getattr(q, 'shape', type(q).__name__)}, expected [N={step.num_tokens}, "
                             f"Hq, D={self.head_dim}] with Hq a multiple of Hkv={self.num_kv_heads}")
        group = q.shape[1] // self.num_kv_heads
        smem = 4 * KEY_TILE * (2 * self.head_dim + 1) + 4 * group * self.head_dim
        if group > 32 or smem > STATIC_SMEM_LIMIT:
            raise ConfigError(f"a GQA group of {group} query heads (head_dim {self.head_dim}) needs {32 * group} "
                              f"threads and {smem} bytes of shared memory per block; at most 32 heads per KV "
                              f"head and {STATIC_SMEM_LIMIT} bytes are supported")
        return device_f32(self.rt, q, "q")

    def _splits(self, requested: int | None, n_blocks: int) -> tuple[int, int]:
        """(n_splits, keys_per_split) for a launch of ``n_blocks`` (token, KV head) pairs."""
        max_keys = self._dev["max_keys"]
        want = requested if requested is not None else self.num_splits
        if want is None:
            target = BLOCKS_PER_SM * _multiprocessors(self.rt)
            want = min(-(-target // n_blocks), -(-max_keys // MIN_KEYS_PER_SPLIT))
        want = max(1, min(int(want), -(-max_keys // KEY_TILE)))  # never an empty split on the longest sequence
        per = -(-max_keys // want)
        per = -(-per // KEY_TILE) * KEY_TILE  # split boundaries on tile boundaries
        return -(-max_keys // per), per

    def _plan_attention(self, name: str, layer: int, q, extra: tuple, num_splits: int | None):
        rt, xp = self.rt, self.rt.xp
        n, hq, d = q.shape
        group = hq // self.num_kv_heads
        splits, per = self._splits(num_splits, n * self.num_kv_heads)
        out = xp.empty((n, hq, d), dtype=np.float32)
        part_acc = xp.empty((n, hq, splits, d) if splits > 1 else (1,), dtype=np.float32)
        part_ml = xp.empty((n, hq, splits, 2) if splits > 1 else (1,), dtype=np.float32)
        args = (q,) + extra + (self.k, self.v, self._dev["slot"], self._dev["pos"], out, part_acc, part_ml,
                               np.int32(layer), np.int32(hq), np.int32(self.num_kv_heads), np.int32(self.max_seqs),
                               np.int32(self.max_len), np.int32(per), np.int32(splits), np.float32(1.0 / np.sqrt(d)))
        kern = rt.kernel("kv_cache", name, defines=self.defines)
        comb = rt.kernel("kv_cache", "decode_attention_combine_v1", defines=self.defines) if splits > 1 else None
        comb_args = (part_acc, part_ml, self._dev["pos"], out, np.int32(hq), np.int32(per), np.int32(splits))

        def launch():
            kern((n, self.num_kv_heads, splits), (32 * group,), args, shared_mem=4 * group * d)
            if comb is not None:
                comb((n, hq), (d,), comb_args)
            return out

        launch.splits, launch.keys_per_split = splits, per
        return launch


def _multiprocessors(rt) -> int:
    """Streaming multiprocessors of the current device (1 on the simulator)."""
    if rt.name != "cupy":
        return 1
    dev = rt.xp.cuda.Device()
    return int(dev.attributes["MultiProcessorCount"])
