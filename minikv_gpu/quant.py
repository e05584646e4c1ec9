"""Step 5 on the GPU: the quantized paged KV cache (mirrors ``minikv.quant``).

The bookkeeping is the NumPy reference's, inherited unchanged (``minikv.quant.cache.QuantizedPagedKVCache``
over the GPU ``PagedKVCache`` of ``minikv_gpu.paged``): which blocks a step fills, when a block is
published as quantized (commit), the ``quantized`` flags. What moves to the device
(``kernels/quant.cu``):

* ``k_codes, v_codes: [L, num_blocks, block_bytes] uint8`` are device arrays holding exactly the
  bytes of ``minikv.quant.codecs`` (bit for bit); the residual pools are the GPU ``PagedKVCache``'s;
* ``write`` -> ``reshape_and_cache`` into the residual, then ``quantize_blocks_v1`` encodes the blocks
  the step fills (the NumPy cache's rule: encoded at write, published at commit);
* ``attend`` -> ``quant_decode_attention_v3`` (decode_v3.cuh's register-resident design, dequantizing
  8 values per lane in registers; a key of block j comes from the codes iff the block is full at
  the row's position, else from the residual), split-K merged by ``attention_reduce_v2``.

kv_dtypes on the GPU so far (``GPU_KV_DTYPES``): ``int8`` (q8_0), ``fp8`` (e4m3fn), ``kivi2`` (asym2 keys
per channel, values per token; the block is KIVI's residual) and ``int4`` (q4_0); ``group`` a multiple of
8 dividing head_dim (and block_size for kivi2). Others raise ConfigError naming these (the NumPy cache
has them all).

``version``: None or 3 (the one attention kernel, ``quant_decode_attention_v3``; it serves prefill
rows too, each at its own position); 1 and 2 raise ConfigError. head_dim a power of two, at most 8
query heads per KV head (v3's limits).
"""

from __future__ import annotations

import numpy as np

from minikv import quant as _cpu
from minikv.errors import ConfigError
from minikv.kv_cache import Step
from minikv.paged.attention import check_paged_attention_args, query_positions
from minikv.quant.cache import QuantizedStore
from minikv.quant.formats import KV_DTYPES, kv_format
from minikv_gpu import paged as _gpu_paged
from minikv_gpu import runtime as gpu_runtime
from minikv_gpu import versions
from minikv_gpu.runtime import check_device_query, check_device_rows, device_f32, get_runtime

__all__ = ["GPU_KV_DTYPES", "QUANT_VERSIONS", "QuantizedPagedKVCache", "quant_defines", "quantize_blocks", "KV_DTYPES",
           "QuantizedStore", "kv_format", "quantized_paged_attention"]

GPU_KV_DTYPES = {"int8": 0, "fp8": 1, "kivi2": 2, "int4": 3}  # kv_dtype -> QCODEC of kernels/quant.cu
QUANT_THREADS = 128


def quant_defines(kv_dtype: str, group: int, head_dim: int, dtype) -> dict:
    """Compile-time defines of kernels/quant.cu for a format (ConfigError for what it does not serve)."""
    if kv_dtype not in GPU_KV_DTYPES:
        raise ConfigError(f"kv_dtype={kv_dtype!r} has no GPU kernels yet; the GPU quantized cache serves "
                          f"{', '.join(GPU_KV_DTYPES)} (the NumPy minikv.quant has every kv_dtype)")
    group = 32 if kv_dtype in ("int8", "int4") else int(group)
    if group % 8 or head_dim % group:
        raise ConfigError(f"group={group}: the GPU kernels need a multiple of 8 that divides head_dim={head_dim}")
    return {**gpu_runtime.head_dim_defines(head_dim), "CACHE_HALF": int(np.dtype(dtype) == np.float16),
            "QCODEC": GPU_KV_DTYPES[kv_dtype], "GROUP": group}


def quantize_blocks(defines: dict, k_pool, v_pool, k_codes, v_codes, blocks, *, runtime=None) -> None:
    """Encode blocks ``blocks`` (int32 device array [M]) of one layer's residual pools into its codes."""
    rt = get_runtime(runtime)
    m = int(blocks.shape[0])
    if m == 0:
        return
    _, bs, hkv, d = k_pool.shape
    records = bs * hkv * d // defines["GROUP"]
    kern = rt.kernel("quant", "quantize_blocks_v1", defines=defines)
    kern((m, -(-records // QUANT_THREADS)), (QUANT_THREADS,),
         (k_pool, v_pool, k_codes, v_codes, blocks, np.int32(bs), np.int32(hkv)))


QUANT_VERSIONS = (3, 4)  # quant_decode_attention_v3 / _v4: the register-resident decode loops


def quant_dims(version: int, defines: dict, group: int) -> int:
    """Dims per lane of quant_decode_attention_v<version> (quant.cu's V4_DIMS; v3 always 8)."""
    row = 16 if version == 4 and defines["HEAD_DIM"] == 128 and group <= 4 else 8
    return 16 if row == 16 and defines["GROUP"] % 16 == 0 else 8


def _plan(rt, defines: dict, q, k_res, v_res, k_codes, v_codes, tables, seq, pos, max_context: int,
          partition_size: int, version: int):
    """Buffers of one ``quant_decode_attention_v<version>`` launch; returns ``launch()`` -> out [N, Hq, D] float32."""
    xp = rt.xp
    n, hq, d = q.shape
    _, bs, hkv, _ = k_res.shape
    group = hq // hkv
    parts, per = versions.decode_splits(max_context, n * hkv, version, group, d, partition_size, rt,
                                          dims=quant_dims(version, defines, group))
    out = xp.empty((n, hq, d), dtype=np.float32)
    shape = (n, hq, parts) if parts > 1 else (1, 1, 1)
    partials = (xp.empty(shape, dtype=np.float32), xp.empty(shape, dtype=np.float32),
                xp.empty(shape + (d,), dtype=np.float32))
    kdefs = {**versions.decode_defines(defines, group), **versions.block_defines(bs)}
    kern = rt.kernel("quant", f"quant_decode_attention_v{version}", defines=kdefs)
    args = (q, k_res, v_res, k_codes, v_codes, tables, seq, pos, out) + partials + (
        np.int32(hq), np.int32(hkv), np.int32(bs), np.int32(tables.shape[1]), np.int32(per), np.int32(parts),
        np.float32(1.0 / np.sqrt(d)))
    reduce = None
    if parts > 1:
        base = {k: defines[k] for k in ("HEAD_DIM", "CACHE_HALF")}
        reduce = rt.kernel("paged", "attention_reduce_v2", defines=base)
        reduce_args = partials + (pos, out, np.int32(hq), np.int32(per), np.int32(parts))

    def launch():
        if n:
            kern((n, hkv, parts), (versions.DECODE_THREADS,), args)
            if reduce is not None:
                reduce((n, hq), (32,), reduce_args)
        return out
    launch.version, launch.partitions = version, parts
    return launch


def _kv_dtype_of(k_pool: QuantizedStore, v_pool: QuantizedStore) -> tuple[str, int]:
    """(kv_dtype, group) of two host QuantizedStore sides, among GPU_KV_DTYPES (ConfigError otherwise)."""
    sides = (k_pool.side.codec.name, k_pool.side.axis, v_pool.side.codec.name, v_pool.side.axis)
    kv = next((name for name, spec in KV_DTYPES.items() if tuple(spec) == sides and name in GPU_KV_DTYPES), None)
    if kv is None:
        raise ConfigError(f"pools of {sides} have no GPU kernels; the GPU quantized attention serves "
                          f"{', '.join(GPU_KV_DTYPES)} (minikv.quant.quantized_paged_attention serves every format)")
    return kv, k_pool.side.codec.group


def quantized_paged_attention(q, k_pool: QuantizedStore, v_pool: QuantizedStore, block_tables, context_lens,
                              query_lens=None, blocks_per_tile: int | None = None, *, version: int | None = None,
                              partition_size: int = _gpu_paged.PARTITION_SIZE, runtime=None):
    """``minikv.quant.cache.quantized_paged_attention`` on the GPU: q [N, Hq, D] -> [N, Hq, D] float32 on the device.

    k_pool, v_pool: host ``QuantizedStore`` sides (residual [num_blocks, bs, Hkv, D], codes [num_blocks, bytes]),
    copied to the device; block_tables [B, width], context_lens [B], query_lens [B] (default all 1) as
    ``paged_attention``'s; blocks_per_tile: checked as in the reference, unused (the kernel walks keys);
    version: 3, 4 or None (4). The kernel reads a block from its codes iff it is full at the row's position,
    the reference's rule.
    """
    rt = get_runtime(runtime)
    kv_dtype, group = _kv_dtype_of(k_pool, v_pool)
    num_blocks, bs, hkv, d = k_pool.residual.shape
    defines = quant_defines(kv_dtype, group, d, k_pool.residual.dtype)
    host = gpu_runtime.host_array
    tables, ctx, qlens, _ = check_paged_attention_args(
        q, k_pool.residual, v_pool.residual, host(rt, block_tables), host(rt, context_lens),
        None if query_lens is None else host(rt, query_lens), blocks_per_tile)
    refusal = versions.decode_refusal(q.shape[1] // hkv, d, True)
    if refusal is not None:
        raise ConfigError(f"GPU quantized attention: {refusal[1]}")
    version = versions.choose_version(version, None, None, versions=QUANT_VERSIONS)
    seq_of, pos = query_positions(ctx, qlens)  # each row's sequence and position
    up = rt.asarray
    return _plan(rt, defines, device_f32(rt, q, "q"), up(k_pool.residual), up(v_pool.residual), up(k_pool.codes),
                 up(v_pool.codes), up(np.maximum(tables, 0).astype(np.int32)), up(seq_of.astype(np.int32)),
                 up(pos.astype(np.int32)), int(ctx.max(initial=0)), partition_size, version)()


class QuantizedPagedKVCache(_cpu.QuantizedPagedKVCache, _gpu_paged.PagedKVCache):
    """``minikv.quant.cache.QuantizedPagedKVCache`` with its residual pools and codes on the device.

    Arguments as the NumPy class (``kv_dtype`` one of ``GPU_KV_DTYPES``), plus the GPU
    ``PagedKVCache``'s ``runtime``, ``version`` (None or 3) and ``partition_size``.
    ``quantized``/``quantize_count`` (bookkeeping) and the host pools stay NumPy arrays.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int = 16, dtype=np.float32, kv_dtype: str = "int8", group: int = 32, **options):
        self.qdefines = quant_defines(kv_dtype, group, head_dim, dtype)
        versions.check_version(options.get("version"), QUANT_VERSIONS, "the quantized GPU cache's attention")
        super().__init__(num_layers, num_kv_heads, head_dim, num_blocks, block_size, dtype, kv_dtype, group,
                         **options)
        xp = self.rt.xp
        self.k_codes, self.v_codes = (xp.zeros(c.shape, np.uint8) for c in (self.k_codes, self.v_codes))
        self._dev_filling = None

    # -- storage hooks: residual rows (the GPU pools' kernels), codes, flags ------------------------
    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        _gpu_paged.PagedKVCache._copy_blocks(self, pairs)
        if not len(pairs):
            return
        src, dst = (self.rt.asarray(np.asarray(ids, dtype=np.int64)) for ids in zip(*pairs))
        for codes in (self.k_codes, self.v_codes):
            codes[:, dst] = codes[:, src]
        self.quantized[np.asarray([p[1] for p in pairs])] = self.quantized[np.asarray([p[0] for p in pairs])]

    def _swap_out_blocks(self, dev: list[int], host: list[int]) -> None:
        _gpu_paged.PagedKVCache._swap_out_blocks(self, dev, host)
        if not dev:
            return
        ids = self.rt.asarray(np.asarray(dev, dtype=np.int64))
        self.host_k_codes[:, host] = self.rt.asnumpy(self.k_codes[:, ids])
        self.host_v_codes[:, host] = self.rt.asnumpy(self.v_codes[:, ids])
        self.host_quantized[host] = self.quantized[dev]

    def _swap_in_blocks(self, host: list[int], dev: list[int]) -> None:
        _gpu_paged.PagedKVCache._swap_in_blocks(self, host, dev)
        if not dev:
            return
        ids = self.rt.asarray(np.asarray(dev, dtype=np.int64))
        self.k_codes[:, ids] = self.rt.asarray(self.host_k_codes[:, host])
        self.v_codes[:, ids] = self.rt.asarray(self.host_v_codes[:, host])
        self.quantized[dev] = self.host_quantized[host]

    # -- the step ----------------------------------------------------------------------------------
    def _reserve(self, step: Step) -> None:
        super()._reserve(step)
        self._dev_filling = self.rt.asarray(self._filling.astype(np.int32))

    def write(self, layer: int, k, v) -> None:
        """Store the step's K/V (k, v: [N, Hkv, D] float32) in the residual; encode the blocks it fills."""
        self._check_layer(layer)
        check_device_rows(self, self.rt, "k", k, self.num_kv_heads)
        check_device_rows(self, self.rt, "v", v, self.num_kv_heads)
        _gpu_paged._launch_write(self.rt, self.defines, device_f32(self.rt, k, "k"), device_f32(self.rt, v, "v"),
                                 self.k_pool[layer], self.v_pool[layer], self._dev["slots"])
        quantize_blocks(self.qdefines, self.k_pool[layer], self.v_pool[layer], self.k_codes[layer],
                        self.v_codes[layer], self._dev_filling, runtime=self.rt)

    def _commit(self, step: Step) -> None:
        full = self._filling
        _gpu_paged.PagedKVCache._commit(self, step)  # the paged bookkeeping (the NumPy class's commit)
        if full.size:  # publish; the residual rows of a published block are dead (NaN)
            self._keep_rows(full)  # until the next step, for a truncate that re-opens one (the NumPy class's)
            self.quantized[full] = True
            self.quantize_count[full] += 1
            ids = self.rt.asarray(full)
            self.k_pool[:, ids] = np.nan
            self.v_pool[:, ids] = np.nan

    def _end(self) -> None:
        super()._end()
        self._dev_filling = None

    def attend(self, layer: int, q, *, version: int | None = None):
        """Attention of the step's queries (q: [N, Hq, D] float32) -> [N, Hq, D] float32 on the device."""
        return self.prepare_attend(layer, q, version=version)()

    def prepare_attend(self, layer: int, q, *, version: int | None = None):
        """Check ``attend``'s arguments and allocate its buffers; return ``launch()`` (benchmarks time it)."""
        self._check_layer(layer)
        check_device_query(self, self.rt, q)
        refusal = versions.decode_refusal(q.shape[1] // self.num_kv_heads, self.head_dim, True)
        if refusal is not None:
            raise ConfigError(f"the quantized GPU cache: {refusal[1]}")
        version = versions.choose_version(version, self.version, None, versions=QUANT_VERSIONS)
        d = self._dev
        return _plan(self.rt, self.qdefines, device_f32(self.rt, q, "q"), self.k_pool[layer], self.v_pool[layer],
                     self.k_codes[layer], self.v_codes[layer], d["tables"], d["seq"], d["pos"], d["max_context"],
                     self.partition_size, version)

    # -- inspection (host copies; tests and debugging) ---------------------------------------------
    def stores(self, layer: int, host: bool = False) -> tuple[QuantizedStore, QuantizedStore]:
        """Layer ``layer``'s K and V storage as host ``QuantizedStore`` copies (device pools are copied)."""
        if host:
            return super().stores(layer, host=True)
        self._tier_wait()
        get = self.rt.asnumpy
        return tuple(QuantizedStore(get(getattr(self, f"{s}_pool")[layer]), get(getattr(self, f"{s}_codes")[layer]),
                                    side) for s, side in (("k", self.format.k), ("v", self.format.v)))

    def stored_block(self, layer: int, block_id: int) -> tuple[bytes, bytes]:
        """The bytes that hold device block ``block_id`` of ``layer`` now (K, V), as the NumPy class."""
        pre = "codes" if self.quantized[block_id] else "pool"
        self._tier_wait()
        return tuple(self.rt.asnumpy(getattr(self, f"{s}_{pre}")[layer, block_id]).tobytes() for s in "kv")

    def read_kv(self, seq_id, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """The history as attention sees it (quantized blocks decoded), host arrays [length, Hkv, D]."""
        return _cpu.QuantizedPagedKVCache.read_kv(self, seq_id, layer)
