"""Step 4: multi-head latent attention (MLA, DeepSeek-V2/V3) and its latent cache.

The idea
--------
A GQA cache stores 2 x Hkv x D numbers per token and layer. MLA stores one
*latent* instead: the token's hidden state is compressed to ``c_kv``
(``kv_lora_rank`` = r numbers, 512 in DeepSeek-V3, RMS-normalised by
``kv_a_layernorm``) plus one small RoPE key ``k_pe`` (``qk_rope_head_dim`` = dr,
64) shared by every head. Per-head keys and values are linear functions of the
latent (``kv_b_proj`` = [W_UK | W_UV] per head h)::

    k_h = [c_kv @ W_UK[h] ; k_pe]    (qk_nope_head_dim + dr)      v_h = c_kv @ W_UV[h]   (v_head_dim)

Two ways to attend over the same cache, equal up to rounding:

* **expanded**: decompress k_h and v_h for the keys, then ordinary attention;
* **absorbed**: fold W_UK into the query, ``q_lat[h] = q_nope[h] @ W_UK[h]^T`` (r numbers), so
  ``q_h . k_h = [q_lat[h] ; q_pe[h]] . [c_kv ; k_pe]``: every head scores against the *same*
  576-wide latent (MQA with one key head), the values are the latent's first r entries, and
  W_UV is applied once to the attention output: ``out[h] = (sum_j p_j c_kv[j]) @ W_UV[h]``.

Decoupled RoPE: why k_pe exists
-------------------------------
RoPE multiplies a key by a rotation R(pos) that depends on the token's position. If the
whole key were rotated, ``q . R(p_k) (c_kv W_UK)`` would put R(p_k) between the query and
W_UK, so W_UK could not be folded into the query once for all keys: each key would need its
own product. MLA therefore rotates only a separate part: the last dr dims of each query and
``k_pe`` (one per token, shared by all heads); the ``qk_nope_head_dim`` dims are position-free
and absorb. The rotation itself uses either layout of ``minikv.layers.apply_rope``: DeepSeek's
``rope_interleave=True`` rotates adjacent pairs (transformers then de-interleaves both q and k
the same way before concatenating; a permutation applied to both sides of a dot product
changes nothing), ``rope_interleave=False`` the half-split pairs of ``rotate_half``.

The cache layout
----------------
Per token and layer the cache stores ``[c_kv ; k_pe]``: r + dr values (the normalised c_kv and
the *rotated* k_pe), one pool, no separate K and V:

* contiguous ``latent: [L, max_seqs, 1, max_len, r + dr]`` (the 1: the single latent "head");
* paged ``pool: [L, num_blocks, block_size, r + dr]``: a block is ``[block_size, r + dr]``, so the block
  manager, prefix sharing, fork/copy-on-write and the scheduler work unchanged.

``bytes_per_token = (r + dr) x L x itemsize``: DeepSeek-V3 caches 576 values, not 128 x (192 + 128).

Which form runs when (``form="auto"``, the default)
----------------------------------------------------
* decode (one new token): absorbed over the whole history, its own token included: the
  cache is read once as Dl-wide rows and no per-head K/V is built (decode is memory-bound);
* prefill (T > 1): expanded over the step's own T tokens (decompressed once; a score costs
  Dn + dr = 192 multiply-adds instead of 576: prefill is compute-bound) plus absorbed over the
  history cached before the step. The two online-softmax states merge exactly once the
  absorbed one's latent accumulator is mapped through W_UV (``acc`` is linear in the values).
  ``form="absorbed"`` or ``"expanded"`` forces one form for every key (the tests use both).

Shapes: N packed tokens, Hq heads, Dn = qk_nope_head_dim, dr = qk_rope_head_dim,
Dv = v_head_dim, r = kv_lora_rank, Dl = r + dr.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from minikv import online_softmax
from minikv.attention import softmax
from minikv.errors import ConfigError, InvalidInputError, ShapeError, check_choice, check_int
from minikv.kv_cache import ContiguousKVCache, NoCache, Step
from minikv.layers import YarnConfig
from minikv.paged import PagedKVCache, slot_mapping

FORMS = ("auto", "absorbed", "expanded")


# --- configuration: the MLA geometry --------------------------------------------------------------

@dataclass(frozen=True)
class MLAConfig:
    """The MLA geometry of every layer (``ModelConfig.mla``; None there means a GQA model).

    kv_lora_rank (r), qk_nope_head_dim (Dn), qk_rope_head_dim (dr, even), v_head_dim (Dv);
    q_lora_rank: None for a plain ``q_proj``, else the rank of ``q_a_proj``/``q_b_proj``;
    rope_interleave: adjacent-pair RoPE (DeepSeek's checkpoints) or the half-split layout;
    yarn: YaRN scaling of the RoPE part and the softmax (None: plain RoPE);
    latent_eps: epsilon of ``q_a_layernorm`` and ``kv_a_layernorm`` (transformers builds them
    with its RMSNorm default 1e-6, not the config's ``rms_norm_eps``).
    """

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope_interleave: bool = True
    yarn: YarnConfig | None = None
    latent_eps: float = 1e-6

    def __post_init__(self):
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            check_int(name, getattr(self, name))
        if self.q_lora_rank is not None:
            check_int("q_lora_rank", self.q_lora_rank, hint="or None for a plain q_proj")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even: RoPE rotates pairs")

    qk_head_dim = property(lambda self: self.qk_nope_head_dim + self.qk_rope_head_dim)   # Dn + dr
    latent_dim = property(lambda self: self.kv_lora_rank + self.qk_rope_head_dim)        # Dl = r + dr, cached
    rope_layout = property(lambda self: "interleaved" if self.rope_interleave else "half")

    @property
    def softmax_scale(self) -> float:
        """``1/sqrt(Dn + dr)``, times YaRN's ``mscale^2`` when ``mscale_all_dim`` is set."""
        return self.qk_head_dim ** -0.5 * (self.yarn.softmax_factor if self.yarn else 1.0)


def latent_bytes_per_token(mla: MLAConfig, num_layers: int, dtype) -> int:
    """Bytes a latent cache stores per token: (r + dr) x layers x itemsize."""
    return mla.latent_dim * int(num_layers) * np.dtype(dtype).itemsize


@dataclass(frozen=True)
class LatentUp:
    """One layer's decompression of the latent, from ``kv_b_proj`` ([r, Hq*(Dn+Dv)] as x @ W).

    w_uk: [Hq, r, Dn]   k_nope[h] = c_kv @ w_uk[h]
    w_uv: [Hq, r, Dv]   v[h] = c_kv @ w_uv[h]
    """

    w_uk: np.ndarray
    w_uv: np.ndarray

    @classmethod
    def from_kv_b(cls, wkv_b: np.ndarray, num_heads: int, mla: MLAConfig) -> "LatentUp":
        r, dn = mla.kv_lora_rank, mla.qk_nope_head_dim
        per_head = wkv_b.reshape(r, num_heads, dn + mla.v_head_dim).transpose(1, 0, 2)  # [Hq, r, Dn+Dv]
        return cls(np.ascontiguousarray(per_head[..., :dn]), np.ascontiguousarray(per_head[..., dn:]))


# --- pure functions: the two forms over one sequence's latent history -----------------------------

Reader = Callable[[int, int], np.ndarray]  # read(k0, k1) -> latent rows [k1 - k0, Dl] of positions k0..k1-1


def _causal_mask(k0: int, k1: int, past: int, t: int) -> np.ndarray | None:
    """[T, K] visibility of keys k0..k1-1 for queries at past..past+T-1 (None: all visible)."""
    if k1 - 1 <= past:
        return None
    return np.arange(k0, k1)[None, :] <= (past + np.arange(t))[:, None]


def _key_tile(heads: int, t: int, key_tile: int | None) -> int:
    return key_tile or max(64, online_softmax.SCORE_BUDGET // (heads * t))


def absorbed_state(q_nope: np.ndarray, q_pe: np.ndarray, read: Reader, lo: int, hi: int, past: int,
                   up: LatentUp, key_tile: int | None = None) -> online_softmax.State:
    """Absorbed attention over keys lo..hi-1, as an online-softmax state in latent space.

    q_nope: [Hq, T, Dn], q_pe: [Hq, T, dr] (already scaled), queries at past..past+T-1.
    Scores ``[q_nope W_UK^T ; q_pe] . [c_kv ; k_pe]``: MQA, one Dl-wide key row per token for all
    heads (one GEMM per tile); values are the rows' first r entries. State acc: [Hq, T, r].
    """
    hq, t, _ = q_nope.shape
    r = up.w_uk.shape[1]
    q_lat = np.concatenate([q_nope @ up.w_uk.transpose(0, 2, 1), q_pe], axis=-1)  # [Hq, T, Dl]
    rows = q_lat.reshape(hq * t, -1)
    state = online_softmax.start((hq, t), r, q_nope.dtype)
    tile = _key_tile(hq, t, key_tile)
    for k0 in range(lo, hi, tile):
        k1 = min(k0 + tile, hi)
        lat = read(k0, k1).astype(q_nope.dtype, copy=False)                 # [K, Dl]
        scores = (rows @ lat.T).reshape(hq, t, k1 - k0)                      # [Hq, T, K]
        online_softmax.update(state, scores, lat[:, :r], _causal_mask(k0, k1, past, t), overwrite=True)
    return state


def expand(lat: np.ndarray, up: LatentUp) -> tuple[np.ndarray, np.ndarray]:
    """Per-head keys and values of latent rows lat: [K, Dl] -> k: [Hq, K, Dn + dr], v: [Hq, K, Dv]."""
    r = up.w_uk.shape[1]
    c_kv, k_pe = lat[:, :r], lat[:, r:]
    k_nope = c_kv[None] @ up.w_uk                                            # [Hq, K, Dn]
    k_pe = np.broadcast_to(k_pe, (k_nope.shape[0],) + k_pe.shape)            # shared by every head
    return np.concatenate([k_nope, k_pe], axis=-1), c_kv[None] @ up.w_uv


def expanded_state(q: np.ndarray, read: Reader, lo: int, hi: int, past: int, up: LatentUp,
                   key_tile: int | None = None) -> online_softmax.State:
    """Expanded attention over keys lo..hi-1: decompress each tile's k_h, v_h, then ordinary attention.

    q: [Hq, T, Dn + dr] (already scaled), queries at past..past+T-1. State acc: [Hq, T, Dv].
    """
    hq, t, _ = q.shape
    state = online_softmax.start((hq, t), up.w_uv.shape[2], q.dtype)
    tile = _key_tile(hq, t, key_tile)
    for k0 in range(lo, hi, tile):
        k1 = min(k0 + tile, hi)
        k, v = expand(read(k0, k1).astype(q.dtype, copy=False), up)
        scores = q @ k.transpose(0, 2, 1)                                    # [Hq, T, K]
        online_softmax.update(state, scores, v, _causal_mask(k0, k1, past, t), overwrite=True)
    return state


def latent_attention(q: np.ndarray, read: Reader, past: int, up: LatentUp, mla: MLAConfig,
                     form: str = "auto", key_tile: int | None = None) -> np.ndarray:
    """Causal MLA attention of one sequence's T new queries over its cached latents.

    q:     [T, Hq, Dn + dr] queries (q_pe rotated) at positions past..past+T-1
    read:  read(k0, k1) -> [k1 - k0, Dl] latent rows; positions 0..past+T-1 are stored
    form:  "absorbed", "expanded", or "auto" (decode absorbed; prefill expanded over its own
           tokens + absorbed over the history; see the module docstring)
    returns [T, Hq, Dv] in q's dtype
    """
    check_choice("form", form, FORMS)
    t, dn = q.shape[0], mla.qk_nope_head_dim
    s = past + t
    qs = (q * q.dtype.type(mla.softmax_scale)).transpose(1, 0, 2)          # [Hq, T, Dn + dr]
    split = {"absorbed": s, "expanded": 0}.get(form, s if t == 1 else past)  # keys < split: absorbed
    state = None
    if split > 0:
        state = absorbed_state(qs[..., :dn], qs[..., dn:], read, 0, split, past, up, key_tile)
        state.acc = state.acc @ up.w_uv  # latent -> value space: acc is linear in the values
    if split < s:
        rest = expanded_state(qs, read, split, s, past, up, key_tile)
        state = rest if state is None else online_softmax.merge(state, rest)
    out = online_softmax.finish(state).transpose(1, 0, 2)
    assert out.dtype == q.dtype, out.dtype
    return np.ascontiguousarray(out)


def reference_attention(q: np.ndarray, lat: np.ndarray, up: LatentUp, mla: MLAConfig) -> np.ndarray:
    """The textbook form, for the uncached baseline: decompress every key, one causal softmax.

    q: [T, Hq, Dn + dr], lat: [T, Dl] (the same T tokens, positions 0..T-1) -> [T, Hq, Dv].
    """
    k, v = expand(lat.astype(q.dtype, copy=False), up)
    scores = (q.transpose(1, 0, 2) * q.dtype.type(mla.softmax_scale)) @ k.transpose(0, 2, 1)  # [Hq, T, T]
    t = q.shape[0]
    scores = np.where(np.tril(np.ones((t, t), dtype=bool)), scores, -np.inf)
    return np.ascontiguousarray((softmax(scores) @ v).transpose(1, 0, 2))


# --- the caches -------------------------------------------------------------------------------------

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
        self.latent = None
        super().__init__(num_layers, 1, _latent_width(mla), max_seqs, max_len, dtype)
        self._init_latent(num_heads, mla, up, form)

    def _new_buffer(self, shape: tuple):
        """The one latent store [L, max_seqs, 1, max_len, Dl]: asked for K and then V, both get it."""
        if self.latent is None:
            self.latent = np.zeros(shape, dtype=self.dtype)
        return self.latent

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
        """The sequence's stored latents [length, Dl] (committed tokens; ``minikv.parallel_mla`` reads them)."""
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
        self.pool = self.host_pool = None
        super().__init__(num_layers, 1, _latent_width(mla), num_blocks, block_size, dtype,
                         num_host_blocks, enable_prefix_caching, hash_fn)
        self._init_latent(num_heads, mla, up, form)

    # -- storage hooks: one pool (and one host pool), each copy done once -------------------------
    def _new_pool(self, num_blocks: int, host: bool):
        """The one pool [L, num_blocks, block_size, Dl]: asked for K and then V, both get it."""
        name = "host_pool" if host else "pool"
        if getattr(self, name) is None:
            setattr(self, name, np.zeros((self.num_layers, num_blocks, self.block_size, self.head_dim),
                                         dtype=self.dtype))
        return getattr(self, name)

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
