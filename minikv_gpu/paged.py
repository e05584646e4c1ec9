"""Step 3 on the GPU: the paged KV cache (mirrors ``minikv.paged``).

Everything that is bookkeeping stays the NumPy reference's, inherited unchanged:
the block allocator and its prefix cache, block tables, slot mappings, fork and
copy-on-write decisions, swap decisions, step commit and rollback. Only storage
and data movement move to the device (``kernels/paged.cu``):

* the pools ``k_pool, v_pool: [L, num_blocks, block_size, Hkv, D]`` are device
  arrays (float32 or float16); the swap target ``host_k_pool, host_v_pool`` stays
  in host memory, as NumPy arrays;
* ``write``  -> ``reshape_and_cache``: each new K/V row to its slot;
* ``attend`` -> ``paged_decode_attention_v1`` (one block per (token, KV head)
  walks the whole context through the block table), ``..._v2`` (split-K:
  partitions of the context in parallel, merged by the shared ``attention_reduce_v2``)
  or ``..._v3`` / ``..._v4`` (decode steps: K/V straight into registers, ``kernels/decode_v3.cuh``,
  ``decode_v4.cuh``: v4 keeps the next iteration's loads in flight);
* copy-on-write and swap -> ``copy_blocks`` (through the storage hooks
  ``_copy_blocks``, ``_swap_out_blocks``, ``_swap_in_blocks`` of the NumPy class).

Which attention version (``versions.choose_version``, then vLLM's rule ``v1_or_v2``)
------------------------------------------------------------------------------
v2 costs an extra launch and a round trip of partial results through memory; it
pays when v1 would leave the GPU idle. With ``P = PARTITION_SIZE`` keys per
partition (512, vLLM's) and S the longest context of the step:

* S <= P: v1 (there is only one partition);
* S > V1_MAX_CONTEXT (8192): v2 (vLLM's v1 keeps every score of the context in shared
  memory, hence its limit; ours streams tiles and has none, but one block walking more
  keys is a long serial chain while the rest of the GPU may idle);
* otherwise v2 when the launch has fewer than ``BLOCKS_PER_SM`` blocks per
  multiprocessor (N tokens * Hkv heads), else v1.

Before that rule: v4 (or v3, if asked) for a decode step they can serve (one new token per
sequence, at most 8 query heads per KV head, head_dim a power of two;
``versions.decode_refusal``). They split by ``versions.split_plan`` (``versions.decode_splits``: even,
tile-aligned key ranges of at least ``partition_size`` keys, the count that wastes the least of
the last wave). An explicit ``version=3`` or ``4`` (``paged_attention(version=4)``,
``attend(version=4)``) that they cannot serve raises (``InvalidInputError`` for a prefill
step, ``ConfigError`` otherwise); the cache's ``version=3``/``4`` falls back to the rule above.

vLLM uses v1 when ``S <= 8192 and (partitions == 1 or num_seqs * num_heads > 512)``;
ours counts thread blocks (one per KV head, not per query head) against the
device's size. ``version=1`` .. ``4`` forces one (the cache's ``version`` argument,
or ``attend(..., version=)``).

Attention computes in float32 whatever the pool stores, as the NumPy cache casts
what it reads to the query's dtype. GPU-wing limits: head_dim a multiple of 8 up
to 128, at most 32 query heads per KV head.
"""

from __future__ import annotations

import numpy as np

from minikv import paged as _cpu
from minikv.errors import ConfigError, DTypeError, InvalidInputError, ShapeError
from minikv.kv_cache import Step
from minikv.paged.allocator import Block, BlockAllocator, HashFn, chain_hash, num_blocks_for  # host-side, as is
from minikv.paged.attention import check_paged_attention_args, default_blocks_per_tile, query_positions, slot_mapping
from minikv_gpu import versions
from minikv_gpu.runtime import (
    BLOCKS_PER_SM,
    STATIC_SMEM_LIMIT,
    cache_defines,
    check_device_query,
    check_device_rows,
    device_f32,
    get_runtime,
    head_dim_defines,
    host_array,
    multiprocessors,
    score_options,
)

__all__ = ["Block", "BlockAllocator", "chain_hash", "num_blocks_for", "slot_mapping", "default_blocks_per_tile",
           "query_positions", "check_paged_attention_args", "reshape_and_cache", "paged_attention", "copy_blocks",
           "v1_or_v2", "PagedKVCache", "KEY_TILE", "PARTITION_SIZE", "V1_MAX_CONTEXT"]

KEY_TILE = 32          # keys per tile in paged.cu; partitions are whole tiles
PARTITION_SIZE = 512   # keys per v2 partition (vLLM's PARTITION_SIZE)
V1_MAX_CONTEXT = 8192  # above this many keys v2 is always chosen (vLLM's threshold)
WRITE_THREADS = 256
COPY_THREADS = 128
POOL_DTYPES = (np.float32, np.float16)


# --- checks shared by the functions and the cache ---------------------------------------------

def _pool_defines(rt, name: str, pool, head_dim: int) -> dict:
    """Compile-time defines for a device pool; raises if it is not a C-contiguous float32/float16 device array."""
    if not isinstance(pool, rt.xp.ndarray):
        raise DTypeError(f"{name} must be a {rt.xp.__name__} array on the device, got {type(pool).__name__}; "
                         f"upload it with runtime.asarray")
    if pool.dtype not in [np.dtype(d) for d in POOL_DTYPES]:
        raise DTypeError(f"{name}.dtype={pool.dtype}; the GPU pools store float32 or float16")
    if not pool.flags.c_contiguous:
        raise ShapeError(f"{name} is not C-contiguous; the kernels index it as a dense "
                         f"[blocks, block_size, Hkv, D] array (pass xp.ascontiguousarray({name}))")
    return cache_defines(head_dim, pool.dtype)


def _check_group(hq: int, hkv: int, d: int) -> int:
    """GQA group size G = Hq / Hkv, if one thread block (32*G threads, its shared memory) can serve it."""
    group = hq // hkv
    smem = 4 * KEY_TILE * (2 * d + 1) + 8 * KEY_TILE + 4 * group * d
    if group > 32 or smem > STATIC_SMEM_LIMIT:
        raise ConfigError(f"a GQA group of {group} query heads (head_dim {d}) needs {32 * group} threads and "
                          f"{smem} bytes of shared memory per block; at most 32 heads per KV head and "
                          f"{STATIC_SMEM_LIMIT} bytes are supported")
    return group


def _check_partition_size(partition_size) -> int:
    if isinstance(partition_size, bool) or not isinstance(partition_size, (int, np.integer)) \
            or partition_size < KEY_TILE or partition_size % KEY_TILE:
        raise ConfigError(f"partition_size={partition_size!r}; use a positive multiple of {KEY_TILE} keys "
                          f"(default {PARTITION_SIZE})")
    return int(partition_size)


def v1_or_v2(max_context: int, n_tokens: int, n_kv_heads: int, partition_size: int = PARTITION_SIZE,
             runtime=None) -> int:
    """vLLM's rule between v1 and v2 for a launch that v3/v4 do not serve (see the module docstring)."""
    if max_context <= partition_size:
        return 1
    if max_context > V1_MAX_CONTEXT:
        return 2
    blocks = n_tokens * n_kv_heads
    return 2 if blocks < BLOCKS_PER_SM * multiprocessors(get_runtime(runtime)) else 1


# --- the kernels as functions ----------------------------------------------------------------

def _launch_write(rt, defines: dict, k, v, k_pool, v_pool, slots) -> None:
    n, hkv, d = k.shape
    if n == 0:
        return
    vectors = n * hkv * (d // 8)
    kern = rt.kernel("paged", "reshape_and_cache", defines=defines)
    kern(((vectors + WRITE_THREADS - 1) // WRITE_THREADS,), (WRITE_THREADS,),
         (k, v, k_pool, v_pool, slots, np.int32(n), np.int32(hkv)))


def reshape_and_cache(k, v, k_pool, v_pool, slot_mapping, *, runtime=None) -> None:
    """Store new rows into one layer's pools: ``pool[slot_mapping[n]] = new[n]``; a slot of -1 is skipped.

    k, v:          [N, Hkv, D] float32 (keys already rotated)
    k_pool, v_pool: [num_blocks, block_size, Hkv, D] device arrays, float32 or float16 (rounded
                   to nearest even on the way in); written in place
    slot_mapping:  [N] ints ``block_id * block_size + offset``, or -1 (padding: nothing stored)
    """
    rt = get_runtime(runtime)
    if getattr(k_pool, "ndim", None) != 4 or getattr(v_pool, "shape", None) != k_pool.shape:
        raise ShapeError(f"k_pool/v_pool shapes {getattr(k_pool, 'shape', None)}, {getattr(v_pool, 'shape', None)}; "
                         "expected two equal [num_blocks, block_size, Hkv, D] pools")
    num_blocks, bs, hkv, d = k_pool.shape
    defines = _pool_defines(rt, "k_pool", k_pool, d)
    if _pool_defines(rt, "v_pool", v_pool, d) != defines:
        raise DTypeError(f"k_pool.dtype={k_pool.dtype} but v_pool.dtype={v_pool.dtype}; store both alike")
    k, v = device_f32(rt, k, "k"), device_f32(rt, v, "v")
    if k.ndim != 3 or k.shape[1:] != (hkv, d) or v.shape != k.shape:
        raise ShapeError(f"k.shape={k.shape}, v.shape={v.shape}; expected [N, Hkv={hkv}, D={d}] for these pools")
    slots = host_array(rt, slot_mapping)
    if slots.shape != (k.shape[0],) or slots.dtype.kind not in "iu":
        raise ShapeError(f"slot_mapping: {slots.dtype} {slots.shape}; expected [N={k.shape[0]}] integers")
    live = slots[slots != -1]
    if live.size and (live.min() < 0 or live.max() >= num_blocks * bs):
        bad = int(live.min() if live.min() < 0 else live.max())
        raise InvalidInputError(f"slot {bad} is outside the pool's [0, {num_blocks * bs}) slots (use -1 to skip)")
    if np.unique(live).size != live.size:
        raise InvalidInputError("slot_mapping repeats a slot; two tokens cannot share one cache row")
    _launch_write(rt, defines, k, v, k_pool, v_pool, rt.asarray(slots.astype(np.int64)))


def _plan_attention(rt, defines: dict, q, k_pool, v_pool, tables, token_seq, token_pos, max_context: int,
                    version: int | None, partition_size: int, options: tuple):
    """Allocate the buffers of one attention launch and return ``launch()`` -> out [N, Hq, D] float32.

    Arguments are already checked; ``tables``, ``token_seq``, ``token_pos`` are int32 device arrays;
    ``options`` is ``runtime.score_options``' (sinks, use_sinks, softcap), which every kernel takes last;
    ``version`` is resolved (``versions.choose_version``: None means v1 or v2 by ``v1_or_v2``).
    ``launch.version`` and ``launch.partitions`` say what was chosen (for benchmarks).
    """
    xp = rt.xp
    n, hq, d = q.shape
    _, bs, hkv, _ = k_pool.shape
    group = hq // hkv
    if version is None:
        version = v1_or_v2(max_context, n, hkv, partition_size, rt)
    out = xp.empty((n, hq, d), dtype=np.float32)
    common = (np.int32(hq), np.int32(hkv), np.int32(bs), np.int32(tables.shape[1]))
    scale = (np.float32(1.0 / np.sqrt(d)),) + options
    block, smem, reduce = (32 * group,), 4 * group * d, None
    head = (q, k_pool, v_pool, tables, token_seq, token_pos)
    if version == 1:
        parts, per = 1, partition_size
        kern = rt.kernel("paged", "paged_decode_attention_v1", defines=defines)
        args = head + (out,) + common + scale
    else:
        if version >= 3:
            parts, per = versions.decode_splits(max_context, n * hkv, version, group, d, partition_size, rt)
            block, smem = (versions.DECODE_THREADS,), 0  # decode_core.cuh: 4 warps, static shared memory only
        else:
            parts, per = -(-max_context // partition_size), partition_size
        shape = (n, hq, parts) if parts > 1 or version == 2 else (1, 1, 1)  # v3/v4 unsplit: unused
        partials = (xp.empty(shape, dtype=np.float32), xp.empty(shape, dtype=np.float32),
                    xp.empty(shape + (d,), dtype=np.float32))  # m, l, acc: kernels/split_k.cuh
        kdefs = {**versions.decode_defines(defines, group), **versions.block_defines(bs)} if version >= 3 else defines
        kern = rt.kernel("paged", f"paged_decode_attention_v{version}", defines=kdefs)
        args = head + ((out,) if version >= 3 else ()) + partials + common + (np.int32(per), np.int32(parts)) + scale
        if parts > 1 or version == 2:
            reduce = rt.kernel("paged", "attention_reduce_v2", defines=defines)
            reduce_args = partials + (token_pos, out, np.int32(hq), np.int32(per), np.int32(parts))

    def launch():
        if n:
            kern((n, hkv, parts), block, args, shared_mem=smem)
            if reduce is not None:
                reduce((n, hq), (32,), reduce_args)
        return out
    launch.version, launch.partitions = version, parts
    return launch


def paged_attention(q, k_pool, v_pool, block_tables, context_lens, query_lens=None,
                    blocks_per_tile: int | None = None, load_tile=None, *, sinks=None, softcap: float | None = None,
                    version: int | None = None, partition_size: int = PARTITION_SIZE, runtime=None):
    """``minikv.paged.attention.paged_attention`` on the GPU: packed queries over each sequence's blocks.

    q:            [N, Hq, D] float32 (host or device)
    k_pool:       [num_blocks, block_size, Hkv, D] device array, float32 or float16 (v_pool the same)
    block_tables: [B, max_blocks]; context_lens, query_lens: [B] (host or device; small)
    blocks_per_tile: checked as in the reference and otherwise unused: the kernels walk tiles of
                  ``KEY_TILE`` keys whatever the block size
    load_tile:    the reference's hook for how a tile of blocks is read; the kernels read the pools
                  themselves, so only None (quantized pools: ``minikv_gpu.quant.quantized_paged_attention``)
    sinks, softcap: learned sink logits [Hq] (float32) and tanh soft-capping (``minikv.online_softmax``), in
                  every version
    version:      1, 2, 3, 4 or None (``versions.choose_version``; 3 and 4 only for decode rows: query_lens
                  all 1); partition_size: keys per v2 partition (v3/v4: the least keys per split)
    returns:      [N, Hq, D] float32 on the device

    The same calls are accepted as by the reference (its own argument check runs here). The
    t-th query of sequence b sits at position ``context_lens[b] - query_lens[b] + t`` and sees
    keys 0 .. that position; stale slots past a context are never read.
    """
    rt = get_runtime(runtime)
    versions.check_version(version)  # before any other check: a bad version is a bad call whatever the data
    if load_tile is not None:
        raise ConfigError("load_tile is the NumPy walk's hook; the GPU kernels read the pools themselves (for "
                          "quantized pools use minikv_gpu.quant.quantized_paged_attention)")
    partition_size = _check_partition_size(partition_size)
    tables, ctx, qlens, _ = check_paged_attention_args(
        q, k_pool, v_pool, host_array(rt, block_tables), host_array(rt, context_lens),
        None if query_lens is None else host_array(rt, query_lens), blocks_per_tile)
    n, hq, d = q.shape
    defines = _pool_defines(rt, "k_pool", k_pool, d)
    if _pool_defines(rt, "v_pool", v_pool, d) != defines:
        raise DTypeError(f"k_pool.dtype={k_pool.dtype} but v_pool.dtype={v_pool.dtype}; store both alike")
    _check_group(hq, k_pool.shape[2], d)
    q = device_f32(rt, q, "q")
    options = score_options(rt, hq, sinks, softcap)
    seq, pos = query_positions(ctx, qlens)
    # Entries past a sequence's last block are never read (keys < context only), so any padding
    # value may stay; the int32 cast is safe: in-use entries were checked against the pool size.
    dev_tables = rt.asarray(np.where(tables >= 0, tables, 0).astype(np.int32))
    max_context = int(ctx.max()) if ctx.size else 0
    refusal = versions.decode_refusal(hq // k_pool.shape[2], d, bool(np.all(qlens == 1)))
    version = versions.choose_version(version, None, refusal)
    return _plan_attention(rt, defines, q, k_pool, v_pool, dev_tables, rt.asarray(seq.astype(np.int32)),
                           rt.asarray(pos.astype(np.int32)), max_context, version, partition_size, options)()


def _launch_copy(rt, defines: dict, src_k, src_v, dst_k, dst_v, pairs: np.ndarray) -> None:
    if not len(pairs):
        return
    layers, src_blocks, bs, hkv, _ = src_k.shape
    kern = rt.kernel("paged", "copy_blocks", defines=defines)
    kern((len(pairs), layers), (COPY_THREADS,),
         (src_k, src_v, dst_k, dst_v, rt.asarray(np.ascontiguousarray(pairs, dtype=np.int32)),
          np.int32(src_blocks), np.int32(dst_k.shape[1]), np.int32(bs), np.int32(hkv)))


def copy_blocks(src_k, src_v, dst_k, dst_v, pairs, *, runtime=None) -> None:
    """Copy whole blocks, every layer, K and V: ``dst[:, d] = src[:, s]`` for each (s, d) in ``pairs``.

    src_k, src_v: [L, src_blocks, block_size, Hkv, D]; dst_k, dst_v: [L, dst_blocks, ...] device
                  arrays of one dtype (float32 or float16); src and dst may be the same pools
                  (copy-on-write), as long as no destination block is also a source
    pairs:        [P, 2] ints (source block, destination block); destinations distinct
    """
    rt = get_runtime(runtime)
    arrays = {"src_k": src_k, "src_v": src_v, "dst_k": dst_k, "dst_v": dst_v}
    shapes = {name: getattr(a, "shape", None) for name, a in arrays.items()}
    if any(s is None or len(s) != 5 for s in shapes.values()) or src_k.shape != src_v.shape \
            or dst_k.shape != dst_v.shape or src_k.shape[0] != dst_k.shape[0] or src_k.shape[2:] != dst_k.shape[2:]:
        raise ShapeError(f"pool shapes {shapes}; expected [L, blocks, block_size, Hkv, D] with only the "
                         "block counts of source and destination differing")
    defines = _pool_defines(rt, "src_k", src_k, src_k.shape[-1])
    for name, a in arrays.items():
        if _pool_defines(rt, name, a, a.shape[-1]) != defines:
            raise DTypeError(f"{name}.dtype={a.dtype} but src_k.dtype={src_k.dtype}; copy between pools of one dtype")
    pairs = host_array(rt, pairs)
    if pairs.size == 0:
        pairs = np.zeros((0, 2), dtype=np.int64)
    if pairs.ndim != 2 or pairs.shape[1] != 2 or pairs.dtype.kind not in "iu":
        raise ShapeError(f"pairs: {pairs.dtype} {pairs.shape}; expected [P, 2] integer (source, destination) ids")
    for col, name, count in ((0, "source", src_k.shape[1]), (1, "destination", dst_k.shape[1])):
        ids = pairs[:, col]
        if ids.size and (ids.min() < 0 or ids.max() >= count):
            raise InvalidInputError(f"{name} block {int(ids.min() if ids.min() < 0 else ids.max())} is outside "
                                    f"[0, {count})")
    if np.unique(pairs[:, 1]).size != len(pairs):
        raise InvalidInputError("pairs repeat a destination block; each block can receive one copy")
    same = dst_k is src_k or dst_v is src_v
    if same and np.intersect1d(pairs[:, 0], pairs[:, 1]).size:
        raise InvalidInputError("a block is both a source and a destination of one copy; blocks of one launch "
                                "are not ordered, so split the copy in two")
    _launch_copy(rt, defines, src_k, src_v, dst_k, dst_v, pairs)


# --- the cache -----------------------------------------------------------------------------------

def no_pending_copies() -> None:
    """The default ``PagedKVCache.wait_for_copies``: without an asynchronous host tier no copy is in flight."""


class PagedKVCache(_cpu.PagedKVCache):
    """``minikv.paged.cache.PagedKVCache`` with its pools on the device (see the module docstring).

    Arguments as the NumPy class (``blocks_per_tile`` is checked and unused: the kernels walk
    tiles of ``KEY_TILE`` keys whatever the block size), plus:
    runtime:        the kernel runtime (default: CuPy on a GPU, else the simulator)
    version:        attention version, 1, 2, 3 or 4 (3 and 4: decode steps; others fall back), or None
                    to choose per step (``versions.choose_version``)
    partition_size: keys per v2 partition (a multiple of ``KEY_TILE``)

    Storage dtype float32 or float16; ``write`` takes float32 K/V ``[N, Hkv, D]`` and
    ``attend`` float32 q ``[N, Hq, D]``, on the device or the host; results stay on the device.
    ``read_kv`` returns host NumPy arrays (it is for tests and debugging).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int = 16, dtype=np.float32, num_host_blocks: int = 0,
                 enable_prefix_caching: bool = True, hash_fn: HashFn | None = None,
                 blocks_per_tile: int | None = None, *, runtime=None, version: int | None = None,
                 partition_size: int = PARTITION_SIZE):
        head_dim_defines(head_dim)  # fail before allocating anything
        self.rt = get_runtime(runtime)  # _new_store, called by the NumPy constructor, needs it
        self.version = versions.check_version(version)
        self.partition_size = _check_partition_size(partition_size)
        self._dev: dict | None = None
        self.wait_for_copies = no_pending_copies  # an asynchronous host tier installs its fence here (minikv_gpu.tiers)
        super().__init__(num_layers, num_kv_heads, head_dim, num_blocks, block_size, dtype, num_host_blocks,
                         enable_prefix_caching, hash_fn, blocks_per_tile)
        self.defines = cache_defines(self.head_dim, self.dtype)

    @classmethod
    def supported_dtypes(cls) -> tuple:
        return POOL_DTYPES

    # -- storage hooks of the NumPy class ----------------------------------------------------
    def _new_store(self, num_blocks: int, host: bool) -> tuple:
        shape = (self.num_layers, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        zeros = np.zeros if host else self.rt.xp.zeros
        return zeros(shape, dtype=self.dtype), zeros(shape, dtype=self.dtype)

    def _tier_wait(self) -> None:
        """Order the next use of the pools after a host tier's pending copies (``minikv_gpu.tiers``, rule 2)."""
        self.wait_for_copies()

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self._tier_wait()
        _launch_copy(self.rt, self.defines, self.k_pool, self.v_pool, self.k_pool, self.v_pool, np.asarray(pairs))

    def _swap_out_blocks(self, dev: list[int], host: list[int]) -> None:
        """Gather the blocks into a staging buffer on the device, then one device-to-host transfer."""
        if not dev:
            return
        self._tier_wait()
        shape = (self.num_layers, len(dev)) + self.k_pool.shape[2:]
        stage_k, stage_v = self.rt.xp.empty(shape, self.dtype), self.rt.xp.empty(shape, self.dtype)
        _launch_copy(self.rt, self.defines, self.k_pool, self.v_pool, stage_k, stage_v,
                     np.stack([dev, np.arange(len(dev))], axis=1))
        self.host_k_pool[:, host] = self.rt.asnumpy(stage_k)
        self.host_v_pool[:, host] = self.rt.asnumpy(stage_v)

    def _swap_in_blocks(self, host: list[int], dev: list[int]) -> None:
        """One host-to-device transfer of the gathered blocks, then a scatter into the pool by the kernel."""
        if not dev:
            return
        self._tier_wait()
        stage_k = self.rt.asarray(self.host_k_pool[:, host])
        stage_v = self.rt.asarray(self.host_v_pool[:, host])
        _launch_copy(self.rt, self.defines, stage_k, stage_v, self.k_pool, self.v_pool,
                     np.stack([np.arange(len(dev)), dev], axis=1))

    # -- steps: the inherited reservation, plus this step's index arrays on the device --------
    def _reserve(self, step: Step) -> None:
        super()._reserve(step)  # OutOfBlocksError leaves everything unchanged, as in the NumPy class
        seq, pos = query_positions(step.past + step.num_new, step.num_new)
        rt = self.rt
        self._dev = {"slots": rt.asarray(self._slots.astype(np.int64)),
                     "tables": rt.asarray(self._step_tables.astype(np.int32)),
                     "seq": rt.asarray(seq.astype(np.int32)), "pos": rt.asarray(pos.astype(np.int32)),
                     "max_context": int(pos.max()) + 1, "decode": bool(np.all(step.num_new == 1))}
        self._tier_wait()  # after this step's allocations demoted what they evict, before write/attend

    def _end(self) -> None:
        super()._end()
        self._dev = None

    # -- the data paths --------------------------------------------------------------------
    def write(self, layer: int, k, v) -> None:
        """Store the step's new K/V (k, v: [N, Hkv, D] float32) into their slots of layer ``layer``'s pool."""
        self._check_layer(layer)
        check_device_rows(self, self.rt, "k", k, self.num_kv_heads)
        check_device_rows(self, self.rt, "v", v, self.num_kv_heads)
        _launch_write(self.rt, self.defines, device_f32(self.rt, k, "k"), device_f32(self.rt, v, "v"),
                      self.k_pool[layer], self.v_pool[layer], self._dev["slots"])

    def attend(self, layer: int, q, *, version: int | None = None, sinks=None, softcap: float | None = None):
        """Paged attention of the step's queries (q: [N, Hq, D] float32) over each sequence's blocks
        -> [N, Hq, D] float32 on the device. ``version`` overrides the cache's choice for this call;
        ``sinks`` ([Hq] learned sink logits) and ``softcap``: ``minikv.online_softmax``'s options."""
        return self.prepare_attend(layer, q, version=version, sinks=sinks, softcap=softcap)()

    def prepare_attend(self, layer: int, q, *, version: int | None = None, sinks=None, softcap: float | None = None):
        """Check ``attend``'s arguments and allocate its buffers; return ``launch()``, which runs the
        kernel(s) and returns the output (the same array every call). Benchmarks time ``launch`` alone."""
        self._check_layer(layer)
        check_device_query(self, self.rt, q)
        group = _check_group(q.shape[1], self.num_kv_heads, self.head_dim)
        d = self._dev
        options = score_options(self.rt, q.shape[1], sinks, softcap)
        refusal = versions.decode_refusal(group, self.head_dim, d["decode"])
        version = versions.choose_version(version, self.version, refusal)
        return _plan_attention(self.rt, self.defines, device_f32(self.rt, q, "q"), self.k_pool[layer],
                               self.v_pool[layer], d["tables"], d["seq"], d["pos"], d["max_context"], version,
                               self.partition_size, options)

    # -- inspection -------------------------------------------------------------------------------
    def read_kv(self, seq_id, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """The sequence's stored history as host arrays k, v: [length, Hkv, D] (tests and debugging only)."""
        if self.blocks.is_swapped(seq_id):
            return super().read_kv(seq_id, layer)  # the host pools are NumPy arrays already
        self._check_layer(layer)
        self._tier_wait()
        slots = self.rt.asarray(slot_mapping(self.blocks.table(seq_id), np.arange(self.length(seq_id)),
                                             self.block_size))
        flat = (-1, self.num_kv_heads, self.head_dim)
        return (self.rt.asnumpy(self.k_pool[layer].reshape(flat)[slots]),
                self.rt.asnumpy(self.v_pool[layer].reshape(flat)[slots]))

