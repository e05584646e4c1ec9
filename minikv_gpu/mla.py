"""Step 4 on the GPU: multi-head latent attention and the latent caches (mirrors ``minikv.mla``).

The bookkeeping is the NumPy classes', inherited unchanged (slots, lengths, block tables, prefix
sharing, fork/copy-on-write, swapping, step commit and rollback); storage and data movement move
to the device through their storage hooks, as ``minikv_gpu.paged`` does for ``PagedKVCache``:

* ``LatentContiguousKVCache``: ``latent: [L, max_seqs, 1, max_len, Dl]`` on the device;
* ``LatentPagedKVCache``: ``pool: [L, num_blocks, block_size, Dl]`` on the device (the swap
  target ``host_pool`` stays a NumPy array); copy-on-write and swaps are array copies;
* ``LatentNoCache``: step 1's baseline, the step's own latents only.

``write`` -> ``latent_write_v1`` (one 64-bit row per token). ``attend`` runs the **absorbed** form
for every query row, prefill included: ``q_abs = [q_nope W_UK^T ; q_pe]`` (a batched matmul through
``runtime.xp``), then ``mla_decode_attention_v3`` (``kernels/mla.cu``: MQA over the Dl-wide latent
rows, values = their first r entries; split-K partials merged by ``attention_reduce_v2``), then
``out[h] = o[h] W_UV[h]`` (another batched matmul). A prefill row is a decode row with a shorter
history (token n sees keys 0..pos[n]), so one kernel serves both; the NumPy ``form="auto"``
expands the prefill's own tokens instead (cheaper flops there), which only changes rounding.
A contiguous cache is addressed as a paged one with one block of ``max_len`` rows per sequence.

Limits (``mla_defines``): kv_lora_rank and qk_rope_head_dim multiples of 8 (the kernel's 16-byte
loads and the value/RoPE boundary); other sizes raise ConfigError (use ``minikv.mla``). Compute is
float32; the caches store float32 or float16.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from minikv import mla as _cpu
from minikv.errors import ConfigError, DTypeError, InvalidInputError, ShapeError, check_choice
from minikv.kv_cache import Step
from minikv.mla.latent import FORMS, LatentUp, MLAConfig, latent_bytes_per_token
from minikv.paged.attention import query_positions, slot_mapping
from minikv_gpu.runtime import check_device_rows, device_f32, get_runtime, multiprocessors
from minikv_gpu.versions import split_plan

__all__ = ["FORMS", "LatentUp", "MLAConfig", "latent_bytes_per_token", "latent_attention", "reference_attention",
           "mla_defines", "latent_write",
           "absorbed_query", "absorbed_attention", "choose_splits", "LatentNoCache", "LatentContiguousKVCache",
           "LatentPagedKVCache", "HEADS_PER_WARP", "WARPS", "BLOCKS_PER_SM", "MIN_KEYS_PER_SPLIT"]

HEADS_PER_WARP = 2       # MLA_HEADS_PER_WARP: query heads per warp (registers: 0 spills at r=512, dr=64)
WARPS = 8                # warps per block of mla_decode_attention_v3 (mla::WARPS)
BLOCKS_PER_SM = 2        # its __launch_bounds__(256, 2)
MIN_KEYS_PER_SPLIT = 256  # a split's fixed cost (queries, partial write) wants at least this many keys
WRITE_THREADS = 256
DTYPES = (np.float32, np.float16)


def mla_defines(mla: MLAConfig, dtype) -> dict:
    """The compile-time defines of ``kernels/mla.cu`` for this geometry and cache dtype.

    HEAD_DIM is the reduce's chunk: the largest of 128, 64, 32, 16, 8 dividing r (``attention_reduce_v2``
    merges the r values as r / HEAD_DIM chunks). Raises ConfigError for sizes the kernel cannot load.
    """
    r, p = mla.kv_lora_rank, mla.qk_rope_head_dim
    if r % 8 or p % 8:
        raise ConfigError(f"kv_lora_rank={r}, qk_rope_head_dim={p}: the GPU MLA kernel needs both multiples of 8 "
                          "(16-byte loads of whole 8-element vectors); use the NumPy reference minikv.mla")
    if np.dtype(dtype) not in [np.dtype(d) for d in DTYPES]:
        raise DTypeError(f"dtype={np.dtype(dtype)}; the GPU latent caches store float32 or float16")
    chunk = next(d for d in (128, 64, 32, 16, 8) if r % d == 0)
    return {"MLA_R": r, "MLA_P": p, "HEAD_DIM": chunk, "CACHE_HALF": int(np.dtype(dtype) == np.float16),
            "MLA_HEADS_PER_WARP": HEADS_PER_WARP}


def latent_write(defines: dict, latent, cache_rows, rows, *, runtime=None) -> None:
    """``cache_rows[rows[n]] = latent[n]`` (rows[n] = -1: skipped). latent: [N, Dl] float32 device array;
    cache_rows: one layer's [rows, Dl] device view; rows: [N] int64 device array."""
    rt = get_runtime(runtime)
    n, w = latent.shape
    if n == 0:
        return
    vectors = n * (w // 8)
    rt.kernel("mla", "latent_write_v1", defines=defines)(
        ((vectors + WRITE_THREADS - 1) // WRITE_THREADS,), (WRITE_THREADS,), (latent, cache_rows, rows, np.int32(n)))


def absorbed_query(q, w_uk_t, dn: int, *, runtime=None):
    """q: [N, Hq, Dn + dr] -> q_abs = [q_nope W_UK^T ; q_pe]: [N, Hq, r + dr] (w_uk_t: [Hq, Dn, r])."""
    xp = get_runtime(runtime).xp
    q_lat = xp.matmul(xp.ascontiguousarray(q[:, :, :dn].transpose(1, 0, 2)), w_uk_t)  # [Hq, N, r]
    return xp.ascontiguousarray(xp.concatenate([q_lat.transpose(1, 0, 2), q[:, :, dn:]], axis=2))


def choose_splits(max_keys: int, blocks: int, runtime=None, num_splits: int | None = None) -> tuple[int, int]:
    """(n_splits, keys_per_split): ``num_splits`` if given, else ``versions.split_plan``'s count for
    ``BLOCKS_PER_SM`` blocks per multiprocessor (even ranges of at least ``MIN_KEYS_PER_SPLIT`` keys; the
    MLA kernel needs no tile alignment)."""
    sms = multiprocessors(get_runtime(runtime))
    return split_plan(max_keys, blocks, BLOCKS_PER_SM, sms, tile=1, min_keys=MIN_KEYS_PER_SPLIT, requested=num_splits)


def absorbed_attention(defines: dict, q_abs, cache_rows, tables, token_seq, token_pos, max_keys: int,
                       scale: float, num_splits: int | None = None, *, runtime=None):
    """``mla_decode_attention_v3`` (+ ``attention_reduce_v2`` when split): [N, Hq, r] float32.

    q_abs: [N, Hq, Dl] float32 (unscaled); cache_rows: one layer's [rows, Dl] device array;
    tables: (block_size, [B, max_blocks] int32 device table): key j of sequence b is row
    ``table[b, j // block_size] * block_size + j % block_size`` (contiguous: block_size = max_len,
    table [B, 1] of slots); token_seq, token_pos: [N] int32 device arrays (token n sees keys 0..pos[n]).
    """
    rt = get_runtime(runtime)
    xp = rt.xp
    n, hq, _ = q_abs.shape
    r, chunk = defines["MLA_R"], defines["HEAD_DIM"]
    block_size, tab = tables
    out = xp.empty((n, hq, r), dtype=np.float32)
    if n == 0:
        return out
    head_blocks = -(-hq // (WARPS * HEADS_PER_WARP))
    z, per = choose_splits(max_keys, n * head_blocks, rt, num_splits)
    c = r // chunk
    shape = (n, hq * c, z) if z > 1 else (1, 1, 1)
    parts = (xp.empty(shape, dtype=np.float32), xp.empty(shape, dtype=np.float32),
             xp.empty(shape + (chunk,) if z > 1 else (1, 1, 1, chunk), dtype=np.float32))
    kern = rt.kernel("mla", "mla_decode_attention_v3", defines=defines)
    kern((n, head_blocks, z), (32 * WARPS,),
         (q_abs, cache_rows, tab, token_seq, token_pos, out) + parts
         + (np.int32(hq), np.int32(block_size), np.int32(tab.shape[1]), np.int32(per), np.int32(z),
            np.float32(scale)))
    if z > 1:
        rt.kernel("mla", "attention_reduce_v2", defines=defines)(
            (n, hq * c), (32,), parts + (token_pos, out, np.int32(hq * c), np.int32(per), np.int32(z)))
    return out


def latent_attention(q, read, past: int, up: LatentUp, mla: MLAConfig, form: str = "auto",
                     key_tile: int | None = None, *, runtime=None):
    """``minikv.mla.latent.latent_attention`` on the GPU: one sequence's T queries [T, Hq, Dn + dr] (q_pe rotated) at
    positions past .. past+T-1 over its latents ``read(0, past + T)`` [S, Dl] -> [T, Hq, Dv] float32 (device).

    Always the absorbed form (``mla_decode_attention_v3``, then W_UV); ``form`` is checked and otherwise
    changes only rounding in the reference (it expands a prefill's own tokens), ``key_tile`` is unused (the
    kernel walks keys). The latents keep the dtype ``read`` gives them (float32 or float16)."""
    check_choice("form", form, FORMS)
    rt = get_runtime(runtime)
    t = int(q.shape[0])
    lat = read(0, past + t)
    lat = lat if isinstance(lat, rt.xp.ndarray) else rt.asarray(np.ascontiguousarray(lat))
    defines = mla_defines(mla, lat.dtype)
    dev = lambda a: rt.asarray(np.ascontiguousarray(a, dtype=np.float32))  # noqa: E731
    q_abs = absorbed_query(device_f32(rt, q, "q"), dev(up.w_uk.transpose(0, 2, 1)), mla.qk_nope_head_dim, runtime=rt)
    i32 = lambda a: rt.asarray(np.asarray(a, dtype=np.int32))  # noqa: E731
    o = absorbed_attention(defines, q_abs, rt.xp.ascontiguousarray(lat), (past + t, i32([[0]])), i32(np.zeros(t)),
                           i32(past + np.arange(t)), past + t, mla.softmax_scale, runtime=rt)  # [T, Hq, r]
    out = rt.xp.matmul(rt.xp.ascontiguousarray(o.transpose(1, 0, 2)), dev(up.w_uv))        # [Hq, T, Dv]
    return rt.xp.ascontiguousarray(out.transpose(1, 0, 2))


def reference_attention(q, lat, up: LatentUp, mla: MLAConfig, *, runtime=None):
    """``minikv.mla.latent.reference_attention`` on the GPU: q [T, Hq, Dn + dr] over the same T tokens' latents lat
    [T, Dl], causally -> [T, Hq, Dv] (the absorbed kernel; the reference decompresses every key instead)."""
    return latent_attention(q, lambda k0, k1: lat[k0:k1], 0, up, mla, runtime=runtime)


class _LatentKernels:
    """What the three GPU latent caches share: W_UK/W_UV on the device, the device checks, ``_attend_rows``."""

    def _init_gpu(self) -> None:
        self.defines = mla_defines(self.mla, self.dtype)
        up = lambda a: self.rt.asarray(np.ascontiguousarray(a, dtype=np.float32))  # noqa: E731
        self._w_uk_t = [up(u.w_uk.transpose(0, 2, 1)) for u in self.up]  # [Hq, Dn, r]
        self._w_uv = [up(u.w_uv) for u in self.up]                       # [Hq, r, Dv]

    @classmethod
    def supported_dtypes(cls) -> tuple:
        return DTYPES

    def _check_latent(self, latent, v) -> None:
        check_device_rows(self, self.rt, "latent", latent, 1)
        if v is not None:
            raise InvalidInputError("a latent cache stores one latent per token (key and value at once); "
                                    "call write(layer, latent, None)")

    def _check_query(self, layer: int, q) -> Step:
        self._check_layer(layer)
        step = self._require_step()
        want = (step.num_tokens, self.num_heads, self.mla.qk_head_dim)
        if not isinstance(q, (self.rt.xp.ndarray, np.ndarray)) or q.shape != want:
            raise ShapeError(f"q.shape={getattr(q, 'shape', None)}, expected [N, Hq, Dn + dr] = {want}")
        return step

    def _attend_rows(self, layer: int, q, cache_rows, tables, seq, pos, max_keys: int, num_splits=None):
        """Absorbed attention of q: [N, Hq, Dn + dr] over ``cache_rows`` -> [N, Hq, Dv] float32 (device)."""
        xp, dn = self.rt.xp, self.mla.qk_nope_head_dim
        q_abs = absorbed_query(device_f32(self.rt, q, "q"), self._w_uk_t[layer], dn, runtime=self.rt)
        o = absorbed_attention(self.defines, q_abs, cache_rows, tables, seq, pos, max_keys,
                               self.mla.softmax_scale, num_splits, runtime=self.rt)       # [N, Hq, r]
        out = xp.matmul(xp.ascontiguousarray(o.transpose(1, 0, 2)), self._w_uv[layer])  # [Hq, N, Dv]
        return xp.ascontiguousarray(out.transpose(1, 0, 2))

    def bytes_per_token(self) -> int:
        return latent_bytes_per_token(self.mla, self.num_layers, self.dtype)


class LatentNoCache(_LatentKernels, _cpu.LatentNoCache):
    """``minikv.mla.caches.LatentNoCache`` on the GPU: keeps nothing; ``attend`` runs the absorbed kernel over
    the step's own latents (every sequence's rows of the step, addressed through a block table of
    block size 1), instead of the NumPy baseline's textbook expanded form."""

    def __init__(self, num_layers: int, num_heads: int, mla: MLAConfig, up: Sequence[LatentUp], dtype=np.float32,
                 *, runtime=None):
        if np.dtype(dtype) != np.float32:
            raise DTypeError(f"dtype={np.dtype(dtype)}; the GPU LatentNoCache holds float32 activations only")
        self.rt = get_runtime(runtime)
        super().__init__(num_layers, num_heads, mla, up, dtype)
        mla_defines(mla, dtype)
        self._init_gpu()

    def write(self, layer: int, latent, v=None) -> None:
        self._check_layer(layer)
        self._check_latent(latent, v)
        self._k[layer] = device_f32(self.rt, latent, "latent").reshape(latent.shape[0], -1)

    def attend(self, layer: int, q, *, num_splits: int | None = None):
        step = self._check_query(layer, q)
        if self._k[layer] is None:
            raise InvalidInputError(f"attend(layer={layer}) before write(layer={layer}) in this step")
        seq, pos = query_positions(step.num_new, step.num_new)
        starts = np.concatenate([[0], np.cumsum(step.num_new)[:-1]])
        table = (starts[:, None] + np.arange(int(step.num_new.max()))[None, :]).astype(np.int32)
        rt = self.rt
        return self._attend_rows(layer, q, self._k[layer], (1, rt.asarray(table)), rt.asarray(seq.astype(np.int32)),
                                 rt.asarray(pos.astype(np.int32)), int(step.num_new.max()), num_splits)


class LatentContiguousKVCache(_LatentKernels, _cpu.LatentContiguousKVCache):
    """``minikv.mla.caches.LatentContiguousKVCache`` with ``latent: [L, max_seqs, 1, max_len, Dl]`` on the device.

    runtime: the kernel runtime; num_splits: split-K ranges per history (None: nearest one wave).
    ``write`` takes float32 latents [N, 1, Dl], ``attend`` float32 q [N, Hq, Dn + dr]; results on the device.
    """

    def __init__(self, num_layers: int, num_heads: int, mla: MLAConfig, up: Sequence[LatentUp], max_seqs: int,
                 max_len: int, dtype=np.float32, form: str = "auto", *, runtime=None,
                 num_splits: int | None = None):
        mla_defines(mla, dtype)  # fail before allocating anything
        self.rt = get_runtime(runtime)  # _new_store, called by the NumPy constructor, needs it
        self.num_splits, self._dev = num_splits, None
        super().__init__(num_layers, num_heads, mla, up, max_seqs, max_len, dtype, form)
        self._init_gpu()

    def _new_store(self, shape: tuple) -> tuple:
        self.latent = self.rt.xp.zeros(shape, dtype=self.dtype)
        return self.latent, self.latent

    def _reserve(self, step: Step) -> None:
        super()._reserve(step)  # CacheFullError before anything changes
        slots = np.array([self._slot[s] for s in step.seq_ids], dtype=np.int64)
        rows = np.repeat(slots, step.num_new) * self.max_len + step.positions
        seq, _ = query_positions(step.past + step.num_new, step.num_new)
        rt = self.rt
        self._dev = {"rows": rt.asarray(rows.astype(np.int64)), "table": rt.asarray(slots.astype(np.int32)[:, None]),
                     "seq": rt.asarray(seq.astype(np.int32)), "pos": rt.asarray(step.positions.astype(np.int32)),
                     "max_keys": int(step.positions.max()) + 1}

    def _commit(self, step: Step) -> None:
        super()._commit(step)
        self._dev = None

    def _rollback(self, step: Step) -> None:
        super()._rollback(step)
        self._dev = None

    def _layer_rows(self, layer: int):
        return self.latent[layer].reshape(-1, self.head_dim)  # [max_seqs * max_len, Dl], a view

    def write(self, layer: int, latent, v=None) -> None:
        """Store the step's latents (latent: [N, 1, Dl] float32, v None) at each sequence's next positions."""
        self._check_layer(layer)
        self._check_latent(latent, v)
        latent = device_f32(self.rt, latent, "latent").reshape(latent.shape[0], -1)
        latent_write(self.defines, latent, self._layer_rows(layer), self._dev["rows"], runtime=self.rt)

    def attend(self, layer: int, q, *, num_splits: int | None = None):
        """Absorbed MLA attention (q: [N, Hq, Dn + dr] -> [N, Hq, Dv] float32 on the device)."""
        self._check_query(layer, q)
        d = self._dev
        return self._attend_rows(layer, q, self._layer_rows(layer), (self.max_len, d["table"]), d["seq"], d["pos"],
                                 d["max_keys"], num_splits or self.num_splits)


class LatentPagedKVCache(_LatentKernels, _cpu.LatentPagedKVCache):
    """``minikv.mla.caches.LatentPagedKVCache`` with ``pool: [L, num_blocks, block_size, Dl]`` on the device.

    Arguments as the NumPy class, plus runtime and num_splits (as ``LatentContiguousKVCache``).
    """

    def __init__(self, num_layers: int, num_heads: int, mla: MLAConfig, up: Sequence[LatentUp], num_blocks: int,
                 block_size: int = 16, dtype=np.float32, num_host_blocks: int = 0,
                 enable_prefix_caching: bool = True, hash_fn=None, form: str = "auto", *, runtime=None,
                 num_splits: int | None = None):
        mla_defines(mla, dtype)
        self.rt = get_runtime(runtime)
        self.num_splits, self._dev = num_splits, None
        super().__init__(num_layers, num_heads, mla, up, num_blocks, block_size, dtype, num_host_blocks,
                         enable_prefix_caching, hash_fn, form)
        self._init_gpu()

    # -- storage hooks: the device pool, the host pool as NumPy ---------------------------------
    def _new_store(self, num_blocks: int, host: bool) -> tuple:
        shape = (self.num_layers, num_blocks, self.block_size, self.head_dim)
        pool = np.zeros(shape, dtype=self.dtype) if host else self.rt.xp.zeros(shape, self.dtype)
        setattr(self, "host_pool" if host else "pool", pool)
        return pool, pool

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        src, dst = (self.rt.asarray(np.asarray(ids, dtype=np.int64)) for ids in zip(*pairs))
        self.pool[:, dst] = self.pool[:, src]  # gathered first: a destination is never also a source

    def _swap_out_blocks(self, dev: list[int], host: list[int]) -> None:
        if dev:
            self.host_pool[:, host] = self.rt.asnumpy(self.pool[:, self.rt.asarray(np.asarray(dev))])

    def _swap_in_blocks(self, host: list[int], dev: list[int]) -> None:
        if dev:
            self.pool[:, self.rt.asarray(np.asarray(dev))] = self.rt.asarray(self.host_pool[:, host])

    def _reserve(self, step: Step) -> None:
        super()._reserve(step)  # OutOfBlocksError leaves everything unchanged, as in the NumPy class
        seq, pos = query_positions(step.past + step.num_new, step.num_new)
        rt = self.rt
        self._dev = {"rows": rt.asarray(self._slots.astype(np.int64)),
                     "table": rt.asarray(np.where(self._step_tables >= 0, self._step_tables, 0).astype(np.int32)),
                     "seq": rt.asarray(seq.astype(np.int32)), "pos": rt.asarray(pos.astype(np.int32)),
                     "max_keys": int(pos.max()) + 1}

    def _end(self) -> None:
        super()._end()
        self._dev = None

    def write(self, layer: int, latent, v=None) -> None:
        """Store the step's latents (latent: [N, 1, Dl] float32, v None) into their slots."""
        self._check_layer(layer)
        self._check_latent(latent, v)
        latent = device_f32(self.rt, latent, "latent").reshape(latent.shape[0], -1)
        latent_write(self.defines, latent, self.pool[layer].reshape(-1, self.head_dim), self._dev["rows"],
                     runtime=self.rt)

    def attend(self, layer: int, q, *, num_splits: int | None = None):
        """Absorbed MLA attention (q: [N, Hq, Dn + dr] -> [N, Hq, Dv] float32) over each sequence's blocks."""
        self._check_query(layer, q)
        d = self._dev
        return self._attend_rows(layer, q, self.pool[layer].reshape(-1, self.head_dim), (self.block_size, d["table"]),
                                 d["seq"], d["pos"], d["max_keys"], num_splits or self.num_splits)

    def read_latent(self, seq_id, layer: int) -> np.ndarray:
        """The sequence's stored latents [length, Dl] as a host array (tests and debugging only)."""
        s = self.blocks.state(seq_id)
        if s.host_table is not None:
            return super().read_latent(seq_id, layer)
        slots = slot_mapping(s.block_table, np.arange(s.length), self.block_size)
        return self.rt.asnumpy(self.pool[layer].reshape(-1, self.head_dim)[self.rt.asarray(slots)])
