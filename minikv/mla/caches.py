"""Step 4, the caches: one latent per token and layer, stored contiguous or paged, attended in latent space.

The cache layout
----------------
Per token and layer the cache stores ``[c_kv ; k_pe]``: r + dr values (the normalised c_kv and
the *rotated* k_pe), one pool, no separate K and V:

* contiguous ``latent: [L, max_seqs, 1, max_len, r + dr]`` (the 1: the single latent "head");
* paged ``pool: [L, num_blocks, block_size, r + dr]``: a block is ``[block_size, r + dr]``, so the block
  manager, prefix sharing, fork/copy-on-write and the scheduler work unchanged.

``bytes_per_token = (r + dr) x L x itemsize``: DeepSeek-V3 caches 576 values, not 128 x (192 + 128).

The three caches reuse step 2's and step 3's bookkeeping (slots, lengths, block tables, prefix
sharing, copy-on-write, swapping); what changes is the storage hook (one store, not K and V),
``write`` (one latent row per token) and ``attend`` (``minikv.mla.latent.latent_attention``).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from minikv.errors import ConfigError, InvalidInputError, ShapeError, check_choice, check_int
from minikv.kv_cache import ContiguousKVCache, NoCache, Step
from minikv.mla.latent import (
    FORMS,
    LatentUp,
    MLAConfig,
    Reader,
    latent_attention,
    latent_bytes_per_token,
    reference_attention,
)
from minikv.paged.attention import slot_mapping
from minikv.paged.cache import PagedKVCache


def _latent_width(mla) -> int:
    if not isinstance(mla, MLAConfig):
        raise ConfigError(f"mla={mla!r}; a latent cache needs the model's MLAConfig (model.new_cache_args())")
    return mla.latent_dim


class _LatentAttention:
    """What the three latent caches share: the geometry, ``write``'s check, ``attend`` over a reader.

    The model writes ``cache.write(layer, latent, None)`` with latent: [N, 1, Dl] (the latent is
    key and value at once) and calls ``cache.attend(layer, q)`` with q: [N, Hq, Dn + dr] -> [N, Hq, Dv].
    """

    def _init_latent(self, num_heads: int, mla: MLAConfig, up: Sequence[LatentUp], form: str) -> None:
        self.num_heads, self.mla, self.form = check_int("num_heads", num_heads), mla, check_choice("form", form, FORMS)
        self.up = list(up)
        want = ((num_heads, mla.kv_lora_rank, mla.qk_nope_head_dim), (num_heads, mla.kv_lora_rank, mla.v_head_dim))
        if len(self.up) != self.num_layers or any((u.w_uk.shape, u.w_uv.shape) != want for u in self.up):
            raise ShapeError(f"up: {len(self.up)} LatentUp for {self.num_layers} layers; each needs "
                             f"w_uk {want[0]} and w_uv {want[1]}")

    def _check_latent(self, latent: np.ndarray, v) -> None:
        self._check_rows("latent", latent, 1)
        if v is not None:
            raise InvalidInputError("a latent cache stores one latent per token (key and value at once); "
                                    "call write(layer, latent, None)")

    def _check_query(self, layer: int, q: np.ndarray) -> Step:
        self._check_layer(layer)
        step = self._require_step()
        want = (step.num_tokens, self.num_heads, self.mla.qk_head_dim)
        if not isinstance(q, np.ndarray) or q.shape != want:
            raise ShapeError(f"q.shape={getattr(q, 'shape', None)}, expected [N, Hq, Dn + dr] = {want}")
        return step

    def _attend_with(self, layer: int, q: np.ndarray, reader: Callable[[int], Reader]) -> np.ndarray:
        """``latent_attention`` for every sequence of the step; ``reader(i)`` reads sequence i's latents."""
        step = self._check_query(layer, q)
        out = np.empty(q.shape[:2] + (self.mla.v_head_dim,), dtype=q.dtype)
        for i in range(len(step.seq_ids)):
            r = step.rows(i)
            out[r] = latent_attention(q[r], reader(i), int(step.past[i]), self.up[layer], self.mla, self.form)
        return out

    def bytes_per_token(self) -> int:
        return latent_bytes_per_token(self.mla, self.num_layers, self.dtype)


class LatentNoCache(_LatentAttention, NoCache):
    """Step 1's baseline for MLA: keeps nothing; each pass recomputes every latent and attends in the
    textbook expanded form (``reference_attention``). The reference the latent caches must equal."""

    def __init__(self, num_layers: int, num_heads: int, mla: MLAConfig, up: Sequence[LatentUp], dtype=np.float32):
        super().__init__(num_layers, 1, _latent_width(mla), dtype)
        self._init_latent(num_heads, mla, up, "expanded")

    def write(self, layer: int, latent: np.ndarray, v=None) -> None:
        self._check_layer(layer)
        self._check_latent(latent, v)
        self._k[layer] = latent[:, 0]

    def attend(self, layer: int, q: np.ndarray) -> np.ndarray:
        step = self._check_query(layer, q)
        if self._k[layer] is None:
            raise InvalidInputError(f"attend(layer={layer}) before write(layer={layer}) in this step")
        out = np.empty(q.shape[:2] + (self.mla.v_head_dim,), dtype=q.dtype)
        for i in range(len(step.seq_ids)):
            r = step.rows(i)
            out[r] = reference_attention(q[r], self._k[layer][r], self.up[layer], self.mla)
        return out


class LatentContiguousKVCache(_LatentAttention, ContiguousKVCache):
    """A contiguous cache of latents: ``latent: [L, max_seqs, 1, max_len, Dl]`` (``k`` and ``v`` name it too).

    Slots, lengths, ``max_len`` checks and rollback are ``ContiguousKVCache``'s; only the storage
    hook (one store, not K and V), ``write`` and ``attend`` change.
    """

    def __init__(self, num_layers: int, num_heads: int, mla: MLAConfig, up: Sequence[LatentUp], max_seqs: int,
                 max_len: int, dtype=np.float32, form: str = "auto"):
        super().__init__(num_layers, 1, _latent_width(mla), max_seqs, max_len, dtype)
        self._init_latent(num_heads, mla, up, form)

    def _new_store(self, shape: tuple) -> tuple:
        """The one latent store [L, max_seqs, 1, max_len, Dl], which ``k`` and ``v`` both name."""
        self.latent = np.zeros(shape, dtype=self.dtype)
        return self.latent, self.latent

    def write(self, layer: int, latent: np.ndarray, v=None) -> None:
        """Store the step's latents (latent: [N, 1, Dl], v None) at each sequence's next positions."""
        self._check_layer(layer)
        self._check_latent(latent, v)
        step = self._step
        for i, sid in enumerate(step.seq_ids):
            slot, p, r = self._slot[sid], int(step.past[i]), step.rows(i)
            self.latent[layer, slot, 0, p:p + r.stop - r.start] = latent[r, 0]

    def attend(self, layer: int, q: np.ndarray) -> np.ndarray:
        """MLA attention (q: [N, Hq, Dn + dr] -> [N, Hq, Dv]) over each sequence's latent slab."""
        step = self._require_step()
        slots = [self._slot[sid] for sid in step.seq_ids]
        return self._attend_with(layer, q, lambda i: lambda k0, k1: self.latent[layer, slots[i], 0, k0:k1])

    def read_latent(self, seq_id, layer: int) -> np.ndarray:
        """The sequence's stored latents [length, Dl] (committed tokens; ``minikv.parallel.context`` reads them)."""
        self._check_layer(layer)
        return self.latent[layer, self._slot_of(seq_id), 0, :self.length(seq_id)]

    def bytes_allocated(self) -> int:
        return self.latent.nbytes


class LatentPagedKVCache(_LatentAttention, PagedKVCache):
    """A paged cache of latents: ``pool: [L, num_blocks, block_size, Dl]`` (``k_pool``/``v_pool`` name it too).

    Block tables, prefix sharing, fork with copy-on-write, swapping and admission are
    ``PagedKVCache``'s (its ``BlockManager``): a block is just ``[block_size, Dl]`` here. Reads go
    through the block table, tile by tile, to the slots of positions 0..len-1 only, so a stale
    (even NaN) slot of a partly filled last block is never read.
    """

    def __init__(self, num_layers: int, num_heads: int, mla: MLAConfig, up: Sequence[LatentUp], num_blocks: int,
                 block_size: int = 16, dtype=np.float32, num_host_blocks: int = 0,
                 enable_prefix_caching: bool = True, hash_fn=None, form: str = "auto"):
        super().__init__(num_layers, 1, _latent_width(mla), num_blocks, block_size, dtype,
                         num_host_blocks, enable_prefix_caching, hash_fn)
        self._init_latent(num_heads, mla, up, form)

    # -- storage hooks: one pool (and one host pool), each copy done once -------------------------
    def _new_store(self, num_blocks: int, host: bool) -> tuple:
        """The one pool [L, num_blocks, block_size, Dl] (``pool``, or ``host_pool``), which K and V both name."""
        pool = np.zeros((self.num_layers, num_blocks, self.block_size, self.head_dim), dtype=self.dtype)
        setattr(self, "host_pool" if host else "pool", pool)
        return pool, pool

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        src, dst = (np.asarray(ids, dtype=np.int64) for ids in zip(*pairs))
        self.pool[:, dst] = self.pool[:, src]

    def _swap_out_blocks(self, dev: list[int], host: list[int]) -> None:
        self.host_pool[:, host] = self.pool[:, dev]

    def _swap_in_blocks(self, host: list[int], dev: list[int]) -> None:
        self.pool[:, dev] = self.host_pool[:, host]

    def write(self, layer: int, latent: np.ndarray, v=None) -> None:
        """Store the step's latents (latent: [N, 1, Dl], v None) into their slots of layer ``layer``'s pool."""
        self._check_layer(layer)
        self._check_latent(latent, v)
        self.pool[layer].reshape(-1, self.head_dim)[self._slots] = latent[:, 0]

    def attend(self, layer: int, q: np.ndarray) -> np.ndarray:
        """MLA attention (q: [N, Hq, Dn + dr] -> [N, Hq, Dv]) over each sequence's blocks."""
        self._require_step()
        flat, bs, tables = self.pool[layer].reshape(-1, self.head_dim), self.block_size, self._step_tables

        def reader(i: int) -> Reader:
            return lambda k0, k1: flat[slot_mapping(tables[i], np.arange(k0, k1), bs)]

        return self._attend_with(layer, q, reader)

    def read_latent(self, seq_id, layer: int) -> np.ndarray:
        """The sequence's stored latents [length, Dl] (tests and debugging only)."""
        return self.read_kv(seq_id, layer)[0][:, 0]

    def bytes_allocated(self) -> int:
        return self.pool.nbytes
