"""Step 5, the cache: a paged KV cache whose full blocks are quantized once and dequantized per tile.

The idea
--------
K and V are most of a long context's memory. Storing them in fewer bits (a scale per small
group keeps the error relative to the group's own range) cuts that memory 2-8x, at the cost
of dequantizing inside attention. The codecs are pure functions (``minikv.quant.codecs``); the
formats pair a codec and a grouping axis for K and for V (``minikv.quant.formats``); this module
arranges them over a paged cache.

When a value is quantized (append-only, each value once)
-------------------------------------------------------
A block is quantized **when it becomes full**: ``write`` encodes the blocks the open step
fills (each layer once), and the step's commit publishes them (``quantized[b] = True``);
from then on a block's bytes never change (prefix sharing, fork, copy-on-write and swapping
only copy whole blocks; only a rollback can re-open it, below). Until then its tokens sit in
full precision (the cache's ``dtype``) in ``k_pool``/``v_pool``: **the partly filled last block
is the residual**, 0..block_size-1 most recent tokens. A rolled-back step never publishes, so it
quantizes nothing. After publishing, a block's full-precision rows are set to NaN: a read of
them would show at once.

What a query sees is a function of positions only: the query at position p reads block j
dequantized iff the block is full at p, ``(j + 1) * block_size <= p + 1``, else in full precision.
So a prefill, a chunked prefill, a batch, a prefix hit and a recompute after preemption all
give what feeding the tokens one at a time gives (the quantized cache's own exactness spine).

Rolling back (``truncate``, speculative decoding)
-----------------------------------------------
A dropped token in the open block is just forgotten (the length moves back). A dropped token in a
block the step *quantized* re-opens that block, and it must be a full-precision residual again with
the very rows a run that never saw the dropped tokens would hold. Codes cannot give them back
(dequantizing is lossy), so each commit keeps the full-precision rows of the blocks it publishes
until the next step begins (``_published``: a copy of the blocks that one step fills, a block or
two for a decode or verify step, the whole prompt after a prefill); a truncate re-opening one of
them puts its rows back and clears its flag. Re-opening a block
quantized by an earlier step raises ``RollbackError``: its rows are gone.

KIVI's residual rule, and why
-----------------------------
KIVI (Algorithm 1) keeps keys in full precision until ``R`` (= ``residual``) of them have
arrived, then quantizes those R tokens per channel in groups of G (= ``group``) tokens and
starts a new full-precision chunk. That is exactly a paged block of R tokens quantized when
full: for ``kivi*``, **the block size is the residual** (``make_cache`` sets
``block_size = residual``, which must be a multiple of ``group``; default R = 128, G = 32), and
the residual is the open block, between 0 and R - 1 tokens. KIVI's values use a sliding
window of exactly R full-precision tokens instead; here values follow the keys' chunk (they
are quantized per token, so the chunk only decides *when*, not *how*). A sliding window of
the last ``ceil(R / block_size)`` blocks was rejected: it re-decides a full block's storage
after the block is full, so a shared prefix block would change under the sequences that
share it.

"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minikv.errors import RollbackError
from minikv.kv_cache import Step
from minikv.paged.allocator import ceil_div
from minikv.paged.attention import paged_attention
from minikv.paged.cache import PagedKVCache
from minikv.quant.formats import Side, kv_format

# --- attention: paged_attention, with each tile of blocks dequantized as it is loaded ----------
#
# What a query sees: the query at position p reads block j of its sequence *dequantized* iff the
# block is full at p, (j + 1) * bs <= p + 1, and in full precision otherwise. That is a function of
# positions only, so a prefill, a chunked prefill, a batch, a prefix hit or a recompute after
# preemption all see exactly what the one-token-at-a-time decode saw (the block that a step fills
# is already encoded when the step attends; it is *published* as quantized at commit).
# ``paged_attention`` hands every tile loader that per-query mask, ``full`` [R, tile].

@dataclass
class QuantizedStore:
    """One layer's K (or V): the open blocks' full-precision rows and the full blocks' codes.

    residual: [num_blocks, bs, Hkv, D] in the cache's dtype
    codes:    [num_blocks, block_bytes] uint8
    Called as ``paged_attention``'s tile loader: blocks ``blk`` [R, tile] -> [R, tile, bs, Hkv, D],
    from the codes where ``full`` [R, tile] (the block is full at that query's position), else
    from the residual rows.
    """

    residual: np.ndarray
    codes: np.ndarray
    side: Side

    def decode(self, ids: np.ndarray) -> np.ndarray:
        """Blocks ``ids`` [M] from their codes: float32 [M, bs, Hkv, D]."""
        return self.side.decode(self.codes[ids], *self.residual.shape[1:])

    def __call__(self, blk: np.ndarray, full: np.ndarray) -> np.ndarray:
        tile = self.residual[blk].astype(np.result_type(self.residual.dtype, np.float32))
        if full.any():  # each distinct block decoded once, however many queries read it
            ids, inv = np.unique(blk[full], return_inverse=True)
            tile[full] = self.decode(ids)[inv]
        return tile


def quantized_paged_attention(q: np.ndarray, k: QuantizedStore, v: QuantizedStore, block_tables: np.ndarray,
                              context_lens: np.ndarray, query_lens: np.ndarray | None = None,
                              blocks_per_tile: int | None = None) -> np.ndarray:
    """``paged_attention`` over quantized storage: q [N, Hq, D] -> [N, Hq, D] in q's dtype.

    The same walk over the block tables, tile by tile through the online softmax; the one new step:
    each tile's blocks are loaded by ``k`` and ``v``, which dequantize those full at the query.
    The history is never dequantized as a whole: one tile of blocks at a time.
    """
    return paged_attention(q, k.residual, v.residual, block_tables, context_lens, query_lens, blocks_per_tile,
                           load_k=k, load_v=v)


# --- the cache ---------------------------------------------------------------------------------

class QuantizedPagedKVCache(PagedKVCache):
    """A ``PagedKVCache`` whose full blocks are stored quantized in ``kv_dtype`` (see the module docstring).

    num_layers, num_kv_heads, head_dim, num_blocks, block_size, ...: as ``PagedKVCache``
    dtype:    the residual's precision (the open blocks) and attention's compute dtype
    kv_dtype: a key of ``KV_DTYPES``;  group: values per scale for kivi*/fp8* (others: fixed)

    Storage: ``k_pool, v_pool: [L, num_blocks, bs, Hkv, D]`` in ``dtype`` hold the open blocks
    (written through the slot mapping, as in step 3); ``k_codes, v_codes: [L, num_blocks,
    block_bytes] uint8`` the quantized full blocks, ``quantized: [num_blocks] bool`` which is
    which; the host pools the same. ``quantize_count[b]``: how often block b was quantized.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int = 16, dtype=np.float32, kv_dtype: str = "int8", group: int = 32, **options):
        super().__init__(num_layers, num_kv_heads, head_dim, num_blocks, block_size, dtype, **options)
        self.format = kv_format(kv_dtype, group, self.block_size, num_kv_heads, head_dim)
        self.kv_dtype = kv_dtype
        kb, vb = self.format.block_bytes()
        self.k_codes, self.v_codes = (np.zeros((num_layers, self.num_blocks, n), np.uint8) for n in (kb, vb))
        self.host_k_codes, self.host_v_codes = (np.zeros((num_layers, self.num_host_blocks, n), np.uint8)
                                                for n in (kb, vb))
        self.quantized = np.zeros(self.num_blocks, bool)
        self.host_quantized = np.zeros(self.num_host_blocks, bool)
        self.quantize_count = np.zeros(self.num_blocks, np.int64)
        self._filling = np.zeros(0, np.int64)  # the blocks the open step fills
        self._published: dict = {}  # (block id, generation) -> (k, v) [L, bs, Hkv, D] rows the last step quantized
        self._published_before: dict = {}  # what _published held before the open step (a failed step restores it)

    # -- storage hooks: a block is its residual rows, its codes and its flag ----------------------
    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        super()._copy_blocks(pairs)
        src, dst = (np.asarray(ids, dtype=np.int64) for ids in zip(*pairs))
        for codes in (self.k_codes, self.v_codes):
            codes[:, dst] = codes[:, src]
        self.quantized[dst] = self.quantized[src]

    def _swap_out_blocks(self, dev: list[int], host: list[int]) -> None:
        super()._swap_out_blocks(dev, host)
        self.host_k_codes[:, host], self.host_v_codes[:, host] = self.k_codes[:, dev], self.v_codes[:, dev]
        self.host_quantized[host] = self.quantized[dev]

    def _swap_in_blocks(self, host: list[int], dev: list[int]) -> None:
        super()._swap_in_blocks(host, dev)
        self.k_codes[:, dev], self.v_codes[:, dev] = self.host_k_codes[:, host], self.host_v_codes[:, host]
        self.quantized[dev] = self.host_quantized[host]

    # -- the step: blocks it fills are encoded at write, published as quantized at commit ----------
    def _blocks_of_step(self, step: Step, full_only: bool) -> np.ndarray:
        """Physical ids of the blocks this step writes (or, ``full_only``, fills), int64 [M]."""
        bs, ids = self.block_size, []
        for i, (p, n) in enumerate(zip(step.past.tolist(), step.num_new.tolist(), strict=True)):
            stop = (p + n) // bs if full_only else ceil_div(p + n, bs)
            ids.extend(self._step_tables[i, p // bs:stop].tolist())
        return np.asarray(ids, dtype=np.int64)

    def _reserve(self, step: Step) -> None:
        super()._reserve(step)
        # step 7: the last step's quantized blocks can no longer be re-opened (unless this step fails)
        self._published_before, self._published = self._published, {}
        self.quantized[self._blocks_of_step(step, full_only=False)] = False  # written blocks: not full yet
        self._filling = self._blocks_of_step(step, full_only=True)

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store the step's K/V (k, v: [N, Hkv, D]) in the residual; encode the blocks the step fills.

        The codes of a block being filled are written here, once per layer, but the block counts as
        quantized only from commit on (a rolled-back step leaves codes of an unquantized block,
        which nothing reads).
        """
        super().write(layer, k, v)
        if self._filling.size:
            for pool, codes, side in ((self.k_pool, self.k_codes, self.format.k),
                                      (self.v_pool, self.v_codes, self.format.v)):
                codes[layer, self._filling] = side.encode(pool[layer, self._filling])

    def _commit(self, step: Step) -> None:
        full = self._filling
        super()._commit(step)
        if full.size:  # publish: the codes hold the block now; its residual rows are dead (NaN)
            self._keep_rows(full)  # step 7: for a truncate that re-opens one of them (the last section)
            self.quantized[full] = True
            self.quantize_count[full] += 1
            self.k_pool[:, full] = np.nan
            self.v_pool[:, full] = np.nan

    def _end(self) -> None:
        super()._end()
        self._filling = np.zeros(0, np.int64)

    def attend(self, layer: int, q: np.ndarray) -> np.ndarray:
        """Paged attention with per-tile dequantization (q: [N, Hq, D] -> [N, Hq, D])."""
        step = self._check_query(layer, q)
        return quantized_paged_attention(q, *self.stores(layer), self._step_tables, step.past + step.num_new,
                                         step.num_new, self.blocks_per_tile)

    # -- inspection ---------------------------------------------------------------------------------
    def stores(self, layer: int, host: bool = False) -> tuple[QuantizedStore, QuantizedStore]:
        """Layer ``layer``'s K and V storage (device or host pools) as ``QuantizedStore`` s."""
        pre = "host_" if host else ""
        return tuple(QuantizedStore(getattr(self, f"{pre}{s}_pool")[layer], getattr(self, f"{pre}{s}_codes")[layer],
                                    side) for s, side in (("k", self.format.k), ("v", self.format.v)))

    def read_kv(self, seq_id, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """The history as attention sees it (quantized blocks decoded): k, v [length, Hkv, D] (tests only)."""
        self._check_layer(layer)
        s = self.blocks.state(seq_id)
        host = s.host_table is not None
        table = np.asarray(s.host_table if host else s.block_table, dtype=np.int64)
        flags = (self.host_quantized if host else self.quantized)[table]  # quantized blocks: decoded
        flat = (-1, self.num_kv_heads, self.head_dim)
        return tuple(store(table, flags).reshape(flat)[:s.length] for store in self.stores(layer, host))

    def stored_block(self, layer: int, block_id: int) -> tuple[bytes, bytes]:
        """The bytes that hold device block ``block_id`` of ``layer`` now (K, V): its codes once quantized,
        else its residual rows."""
        if self.quantized[block_id]:
            return self.k_codes[layer, block_id].tobytes(), self.v_codes[layer, block_id].tobytes()
        return self.k_pool[layer, block_id].tobytes(), self.v_pool[layer, block_id].tobytes()

    def bytes_per_block(self) -> int:
        """Bytes of one full quantized block, all layers, K and V (data, scales and zero points)."""
        return self.num_layers * sum(self.format.block_bytes())

    def bytes_per_token(self) -> float:
        """``bytes_per_block() / block_size``: a token's bytes averaged over a full quantized block."""
        return self.bytes_per_block() / self.block_size

    def residual_bytes_per_token(self) -> int:
        """A residual (not yet quantized) token: 2 L Hkv D itemsize(dtype)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def bytes_used(self) -> int:
        """Quantized blocks in use x ``bytes_per_block`` + residual tokens x ``residual_bytes_per_token``."""
        filled = self.blocks.slots_filled()
        quantized = sum(1 for b in filled if self.quantized[b])
        residual = sum(n for b, n in filled.items() if not self.quantized[b])
        return quantized * self.bytes_per_block() + residual * self.residual_bytes_per_token()

    def bytes_allocated(self) -> int:
        """Every array of the device pool: residual pools, codes and flags."""
        return self.k_pool.nbytes + self.v_pool.nbytes + self.k_codes.nbytes + self.v_codes.nbytes + \
            self.quantized.nbytes

    # --- NEW in step 7: rolling back (speculative decoding's truncate) -----------------------------
    # A block the last step quantized can become a residual again: its rows are kept until the next
    # step (``_reserve`` forgets them, ``_commit`` keeps them). The rest of this class never reads them.
    def _keep_rows(self, full: np.ndarray) -> None:
        """Keep the full-precision rows of the blocks being published until the next step (see the module
        docstring); keyed by generation, so a block id handed out again never matches."""
        gen = self.blocks.allocator.blocks
        self._published = {(int(b), gen[int(b)].generation): (self.k_pool[:, int(b)].copy(),
                                                             self.v_pool[:, int(b)].copy()) for b in full}

    def _rollback(self, step: Step) -> None:
        """A failed step quantized nothing: the rows of the step before it stay what a truncate needs."""
        super()._rollback(step)
        self._published = self._published_before

    def _truncate(self, seq_id, new_len: int) -> None:
        """The paged truncate; a quantized block the cut re-opens gets its saved rows back (or RollbackError)."""
        table, bs = self.blocks.resident(seq_id).block_table, self.block_size
        old = table[new_len // bs] if new_len % bs and self.quantized[table[new_len // bs]] else None
        key = None if old is None else (old, self.blocks.allocator.blocks[old].generation)
        if key is not None and key not in self._published:
            raise RollbackError(f"truncating {seq_id!r} to {new_len} tokens re-opens block {old}, quantized "
                                f"({self.kv_dtype}) before the last step: its full-precision rows are gone and "
                                "decoding its codes would not be exact; truncate only tokens of the last step")
        super()._truncate(seq_id, new_len)
        if key is not None:
            new = self.blocks.state(seq_id).block_table[new_len // bs]  # a fresh copy if the block was shared
            self.k_pool[:, new], self.v_pool[:, new] = self._published[key]
            self.quantized[new] = False
            if new == old:  # that quantization is undone (a fresh copy was never counted)
                self.quantize_count[new] -= 1
    # --- end NEW in step 7 ---


def dequantized_pools(cache: QuantizedPagedKVCache, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """Every device block of ``layer`` decoded at once: k, v [num_blocks, bs, Hkv, D] (tests' reference only)."""
    return tuple(store(np.arange(cache.num_blocks), cache.quantized) for store in cache.stores(layer))


