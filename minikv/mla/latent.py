"""Step 4, the math: multi-head latent attention (MLA, DeepSeek-V2/V3) over a cached latent.

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
from typing import Callable

import numpy as np

from minikv import online_softmax
from minikv.attention import softmax
from minikv.errors import ConfigError, check_choice, check_int
from minikv.layers import YarnConfig

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
