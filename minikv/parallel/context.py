"""Context parallelism for MLA: the latent cache striped over cp ranks, partial attentions merged.

Why
---
An MLA model caches one latent row [c_kv ; k_pe] (Dl = r + dr values) per token and layer, shared
by every head. Head sharding (``minikv.parallel``, tp) splits the query heads, but every rank
still needs every token's latent: tensor parallelism *duplicates* the whole latent cache tp
times. Decode context parallelism (vLLM's DCP, SGLang) splits the tokens instead.

The layout
----------
Rank r of a cp group stores the tokens at positions p with ``p mod cp = r``, in order: its local
slot j holds position ``r + j cp``. Striping (rather than contiguous chunks) keeps the ranks
within one token of each other as a sequence grows, and a decode step writes on one rank only.
Each rank's store is an ordinary latent cache (``LatentContiguousKVCache`` or ``LatentPagedKVCache``)
sized for ``ceil(max_len / cp)`` tokens: 1/cp of the latent bytes.

Attention
---------
Every rank has every query (the cp ranks of a group hold the same heads). Rank r attends over its
own keys only, in the absorbed form (``minikv.mla``: scores against the Dl-wide latent, values the
first r entries, mapped through W_UV), keeping the online-softmax state (m, l, acc) instead of the
finished output. A causal mask compares global positions: query p sees local key j iff
``r + j cp <= p``. The states of the cp ranks (one Allgather of [N, Hq, Dv + 2] per layer) merge
with ``online_softmax.merge`` — the split-K merge by log-sum-exp, here split across processes —
and ``finish`` divides. The result equals one process attending over every key, up to rounding.
"""

from __future__ import annotations

from functools import reduce

import numpy as np

from minikv import online_softmax
from minikv.errors import ConfigError, ShapeError
from minikv.kv_cache import KVCacheBase, Step, lookup_sequence
from minikv.mla.latent import LatentUp, MLAConfig
from minikv.paged.allocator import ceil_div
from minikv.parallel.collectives import Collectives

STRIPED_KINDS = ("contiguous", "paged")


def striped_positions(rank: int, cp: int, count: int) -> np.ndarray:
    """Global positions of a rank's first ``count`` local slots: rank, rank + cp, rank + 2 cp, ..."""
    return rank + cp * np.arange(count, dtype=np.int64)


def striped_state(q: np.ndarray, keys: np.ndarray, key_pos: np.ndarray, query_pos: np.ndarray, up: LatentUp,
                  mla: MLAConfig, key_tile: int = 256) -> online_softmax.State:
    """Absorbed MLA attention of T queries over some keys, as an online-softmax state in value space.

    q: [T, Hq, Dn + dr] (q_pe rotated), keys: [K, Dl] latent rows at global positions key_pos [K],
    queries at query_pos [T]; query t sees key j iff key_pos[j] <= query_pos[t].
    Returns the state with m, l: [T, Hq] and acc: [T, Hq, Dv] (acc mapped through W_UV).
    """
    t, hq, _ = q.shape
    dn, r = mla.qk_nope_head_dim, mla.kv_lora_rank
    qs = (q * q.dtype.type(mla.softmax_scale)).transpose(1, 0, 2)                       # [Hq, T, Dn + dr]
    q_lat = np.concatenate([qs[..., :dn] @ up.w_uk.transpose(0, 2, 1), qs[..., dn:]], axis=-1)  # [Hq, T, Dl]
    state = online_softmax.start((hq, t), r, q.dtype)
    for k0 in range(0, keys.shape[0], key_tile):
        lat = keys[k0: k0 + key_tile].astype(q.dtype, copy=False)                       # [K, Dl]
        mask = key_pos[None, k0: k0 + key_tile] <= query_pos[:, None]                   # [T, K]
        online_softmax.update(state, q_lat @ lat.T, lat[:, :r], mask, overwrite=True)
    acc = state.acc @ up.w_uv                                                           # [Hq, T, Dv]
    return online_softmax.State(state.m.T, state.l.T, acc.transpose(1, 0, 2))


class StripedLatentCache(KVCacheBase):
    """One cp rank's latent cache: the tokens with ``position mod cp == rank``, in an ordinary latent cache.

    inner: a ``LatentContiguousKVCache`` or ``LatentPagedKVCache`` of ``ceil(max_len / cp)`` tokens per
           sequence (``striped_cache`` builds it); group: the cp ranks (``Collectives``).
    The model sees a latent cache of the whole sequence: ``write(layer, latent [N, 1, Dl], None)`` keeps
    this rank's rows, ``attend(layer, q [N, Hq, Dn + dr])`` returns [N, Hq, Dv] merged over the group.
    """

    def __init__(self, inner: KVCacheBase, group: Collectives):
        super().__init__(inner.num_layers, 1, inner.head_dim, inner.dtype)
        self.inner, self.group, self.rank, self.cp = inner, group, group.rank, group.size
        self.mla, self.num_heads, self.up = inner.mla, inner.num_heads, inner.up
        self._len: dict = {}
        self._mask = self._local_offsets = self._new = None
        self._inner_open = False

    def add_sequence(self, seq_id) -> None:
        self.inner.add_sequence(seq_id)
        self._len[seq_id] = 0

    def free_sequence(self, seq_id) -> None:
        self.inner.free_sequence(seq_id)
        del self._len[seq_id]

    def length(self, seq_id) -> int:
        """Tokens of the whole sequence (every rank's share)."""
        return lookup_sequence(self._len, seq_id)

    def _reserve(self, step: Step) -> None:
        """Open the inner step for this rank's new tokens (sequences with none stay out of it)."""
        self._mask = step.positions % self.cp == self.rank                            # [N] this rank's rows
        counts = [int(self._mask[step.rows(i)].sum()) for i in range(len(step.seq_ids))]
        mine = [(sid, n) for sid, n in zip(step.seq_ids, counts) if n]
        if mine:  # may raise CacheFullError: nothing changed
            self.inner.begin_step([sid for sid, _ in mine], [n for _, n in mine])
        self._inner_open, self._local_offsets, self._new = bool(mine), np.cumsum([0] + counts), {}

    def _commit(self, step: Step) -> None:
        if self._inner_open:
            self.inner.end_step()
        for sid, n in zip(step.seq_ids, step.num_new):
            self._len[sid] += int(n)
        self._inner_open = False

    def _rollback(self, step: Step) -> None:
        self.inner.abort_step()
        self._inner_open = False

    def write(self, layer: int, latent: np.ndarray, v=None) -> None:
        """Keep this rank's rows of the step's latents (latent: [N, 1, Dl], v None)."""
        self._check_layer(layer)
        self._check_rows("latent", latent, 1)
        if v is not None:
            raise ShapeError("a latent cache stores one latent per token; call write(layer, latent, None)")
        rows = np.ascontiguousarray(latent[self._mask])
        if self._inner_open:
            self.inner.write(layer, rows, None)
        self._new[layer] = rows[:, 0]  # [n_mine, Dl]: read back by this layer's attend

    def attend(self, layer: int, q: np.ndarray) -> np.ndarray:
        """Attention of every query over every rank's keys: local states, one Allgather, ``merge``, ``finish``."""
        self._check_layer(layer)
        step = self._require_step()
        want = (step.num_tokens, self.num_heads, self.mla.qk_head_dim)
        if getattr(q, "shape", None) != want:
            raise ShapeError(f"q.shape={getattr(q, 'shape', None)}, expected [N, Hq, Dn + dr] = {want}")
        n, hq, dv = q.shape[0], self.num_heads, self.mla.v_head_dim
        state = online_softmax.start((n, hq), dv, q.dtype)
        for i, sid in enumerate(step.seq_ids):
            new = self._new[layer][self._local_offsets[i]: self._local_offsets[i + 1]]
            keys = np.concatenate([self.inner.read_latent(sid, layer), new]) if len(new) else \
                self.inner.read_latent(sid, layer)
            rows = step.rows(i)
            state[rows] = striped_state(q[rows], keys, striped_positions(self.rank, self.cp, keys.shape[0]),
                                        step.positions[rows], self.up[layer], self.mla)
        packed = np.concatenate([state.m[..., None], state.l[..., None], state.acc], axis=-1)  # [N, Hq, Dv + 2]
        parts = self.group.allgather(packed)                                                  # [cp, N, Hq, Dv + 2]
        merged = reduce(online_softmax.merge, [online_softmax.State(p[..., 0], p[..., 1], p[..., 2:])
                                               for p in parts])
        return online_softmax.finish(merged)

    def bytes_allocated(self) -> int:
        return self.inner.bytes_allocated()

    def bytes_per_token(self) -> float:
        """This rank's bytes per token of the sequence: 1/cp of a latent row per layer."""
        return self.inner.bytes_per_token() / self.cp


def striped_cache(kind: str, local_model, ranks: Collectives, max_len: int, max_seqs: int = 1,
                  block_size: int = 16, **options) -> StripedLatentCache:
    """A ``StripedLatentCache`` over a ``kind`` latent cache of ``ceil(max_len / cp)`` tokens per sequence."""
    from minikv.generate import make_cache

    if kind not in STRIPED_KINDS:
        raise ConfigError(f"cache {kind!r} with cp={ranks.size}: context parallelism stripes a cache that keeps "
                          f"every token; use one of {STRIPED_KINDS}")
    inner = make_cache(kind, local_model, ceil_div(int(max_len), ranks.size), max_seqs, block_size, **options)
    return StripedLatentCache(inner, ranks)
