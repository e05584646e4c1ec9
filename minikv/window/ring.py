"""Step 6: window and eviction — a ring buffer, attention sinks, and the policies' shared machinery.

A cache that keeps at most W keys per (layer, KV head) forgets the rest. What it keeps is a
**policy**; where it keeps them is **storage**. Both are small and separate:

* ``WindowPolicy`` (here): a sliding window of the W - S most recent tokens, plus the first S
  tokens for good (StreamingLLM's *attention sinks*; S = 0 is a plain window);
* ``H2OPolicy`` and ``SnapKVPolicy`` (``minikv.window.scores``): keep the keys that attention used.

The ring buffer
---------------
With S sinks, token p >= S lives in slot ``S + (p - S) mod (W - S)`` (S = 0: ``p mod W``). A new
token overwrites the token that has just left the window: O(1) work per token, where a static
window that shifts (``roll``s) its buffer moves W rows every step. Attention reads the ring in
storage order, because the online softmax does not care about the order of its keys; what it
needs is each key's **position, stored per slot** (a wrapped ring's slot order is not time order).

Two position contracts (named in every output)
----------------------------------------------
* ``original`` (the default): keys are rotated (RoPE) at their absolute positions when written,
  as every other cache stores them. Query q sees key k at distance q - k, as the model was
  trained. The position itself keeps growing, so this is valid only inside the trained context.
* ``in-cache`` (StreamingLLM): the cache keeps *pre-RoPE* keys; at attention each kept key is
  rotated by its rank among the keys the query sees (0, 1, ...) and the query by its own rank
  (``S + (W - S) - 1`` once the ring is full: the newest key is the query's own). Distances then
  never exceed W, so generation can run past the trained context. Keys are re-rotated from the
  stored pre-RoPE key every time, never by compounding small rotations (which drifts).
  The trade-off: within the window the two agree (same distances); the sinks move from distance
  q - s to W - 1 - s, which the model never saw in training for its first tokens, and the cache
  rotates W keys per query instead of none.

What is exact, and what is not
------------------------------
An evicting cache is **not** equal to recomputing the model over the kept tokens: the K/V of a
later token were computed while the evicted tokens were still visible to it. It *is* equal to one
forward over the whole text with the mask the policy implies: token t sees exactly the keys that
were in the cache at step t. Each cache logs, per (layer, KV head, key position), the first query
position that no longer saw the key (``evicted_at``); ``MaskedRecompute`` runs that mask over the
whole text in one pass. With ``in-cache`` positions the reference also rotates by rank.

Storage (``EvictingKVCache``, contiguous; ``minikv.window.paged`` holds the paged form)
--------------------------------------------------------------------------------------
Per sequence: ``k, v: [L, Hkv, C, D]``, ``pos: [L, Hkv, C]`` (-1 = empty) and the policy's
``score, seen: [L, Hkv, C]``. ``write`` only stashes the step's new K/V; ``attend`` reads the
stored slots and the stash as two tiles; ``end_step`` lets the policy drop keys and places the
survivors (the ring's slot, or a freed slot). A failed step therefore changes nothing.
"""

from __future__ import annotations

import numpy as np

from minikv import online_softmax
from minikv.errors import CacheFullError, ConfigError, InvalidInputError, RollbackError, check_choice, check_int
from minikv.kv_cache import KVCacheBase, lookup_sequence
from minikv.layers import apply_rope

POSITIONS = ("original", "in-cache")
NEVER = np.iinfo(np.int64).max  # evicted_at of a key that is still kept


# --- policies: which keys stay ---------------------------------------------------------------


class Policy:
    """What every policy answers. Positions are absolute token positions; -1 marks an empty slot.

    visible(q_pos [T], k_pos [Hkv, K]) -> [Hkv, T, K]: may query q see key k *during* a step?
    mass_queries(past, num_new) -> [T] bool: which of the step's queries feed ``score`` (None: none)
    keep(pos, score, seen, last, first_step) -> [Hkv, K] bool: the keys that survive the step
    dropped_at(k_pos, last): first query position that no longer sees a dropped key
    ring_slot(p): the ring's slot of position p, or None (survivors take any freed slot)
    """

    name = "full"
    positions = "original"
    capacity: int  # slots per (layer, head) that the storage starts with

    def visible(self, q_pos: np.ndarray, k_pos: np.ndarray) -> np.ndarray:
        return (k_pos[:, None, :] >= 0) & (k_pos[:, None, :] <= q_pos[None, :, None])

    def mass_queries(self, past: int, num_new: int) -> np.ndarray | None:
        return None

    def keep(self, pos, score, seen, last: int, first_step: bool) -> np.ndarray:
        return pos >= 0

    def dropped_at(self, k_pos: np.ndarray, last: int) -> np.ndarray:
        return np.full_like(k_pos, last + 1)

    def ring_slot(self, p: int) -> int | None:
        return None

    def describe(self) -> dict:
        return {"policy": self.name, "positions": self.positions}


class WindowPolicy(Policy):
    """The W - S most recent tokens plus the first S (sinks). Query q sees key k iff
    ``k < S`` or ``q - k < W - S`` (and k <= q): the window counts the query's own token."""

    name = "window"

    def __init__(self, window: int, sinks: int = 0, positions: str = "original"):
        self.window = check_int("window", window, hint="the tokens a sequence keeps per layer, e.g. --window 128")
        self.sinks = check_int("sinks", sinks, minimum=0, maximum=self.window - 1, error=ConfigError,
                               hint=f"sinks must leave room for the recent tokens: 0 <= S < W={self.window}")
        self.positions = check_choice("positions", positions, POSITIONS)
        self.capacity = self.window

    def visible(self, q_pos, k_pos):
        k, q = k_pos[:, None, :], q_pos[None, :, None]
        return (k >= 0) & (k <= q) & ((k < self.sinks) | (q - k < self.window - self.sinks))

    def keep(self, pos, score, seen, last, first_step):
        return (pos >= 0) & ((pos < self.sinks) | (last + 1 - pos < self.window - self.sinks))

    def dropped_at(self, k_pos, last):
        return k_pos + (self.window - self.sinks)

    def ring_slot(self, p: int) -> int:
        s = self.sinks
        return p if p < s else s + (p - s) % (self.window - s)

    def describe(self):
        return {**super().describe(), "window": self.window, "sinks": self.sinks}


# --- attention over slots in any order ---------------------------------------------------------


def attend_slots(q: np.ndarray, tiles: list, visible, mass_rows: np.ndarray | None = None,
                 sinks: np.ndarray | None = None, softcap: float | None = None):
    """GQA attention of T queries over keys stored in any order, a tile at a time.

    q:         [T, Hq, D] rotated queries (query head h reads KV head h // G)
    tiles:     list of (k [Hkv, K, D], v [Hkv, K, D], k_pos [Hkv, K]); k_pos -1 = empty slot
    visible:   visible(k_pos) -> [Hkv, T, K] bool (the policy's rule at these queries)
    mass_rows: [T] bool or None. If given, also return each key's softmax mass, summed over
               the selected queries and the G query heads of its group, and how many selected
               queries saw it: two lists of [Hkv, K] (one per tile).
    sinks, softcap: learned sink logits [Hq] and tanh soft-capping (``minikv.online_softmax``)
    returns:   out [T, Hq, D] (, mass, seen)

    The mass of key j for a query is exp(s_j - m) / l with the *final* running max m and sum l,
    so it costs one more exp per score: the scores of a tile are kept until the end.
    """
    t, hq, d = q.shape
    hkv = tiles[0][0].shape[0]
    g = hq // hkv
    scale = q.dtype.type(1.0 / np.sqrt(d))
    qg = (q * scale).reshape(t, hkv, g, d).transpose(1, 2, 0, 3).reshape(hkv, g * t, d)  # row = g*T + t
    state = online_softmax.start((hkv, g * t), d, q.dtype, online_softmax.sink_rows(sinks, hkv, g, t))
    kept = []
    for k, v, k_pos in tiles:
        vis = visible(k_pos)                                           # [Hkv, T, K]
        mask = np.tile(vis, (1, g, 1))                                 # [Hkv, G*T, K]
        scores = online_softmax.soft_cap(qg @ np.swapaxes(k.astype(q.dtype, copy=False), -1, -2), softcap)
        online_softmax.update(state, scores.copy() if mass_rows is not None else scores,
                              v.astype(q.dtype, copy=False), mask, overwrite=True)
        kept.append((scores, mask, vis))
    out = online_softmax.finish(state).reshape(hkv, g, t, d).transpose(2, 0, 1, 3).reshape(t, hq, d)
    if mass_rows is None:
        return out
    rows = np.tile(np.asarray(mass_rows, dtype=bool), g)               # [G*T]
    shift = np.maximum(state.m, np.finfo(q.dtype).min)[..., None]
    l = np.maximum(state.l, np.finfo(q.dtype).tiny)[..., None]
    mass, seen = [], []
    for scores, mask, vis in kept:
        p = np.where(mask, np.exp(scores - shift), 0) / l               # [Hkv, G*T, K]
        mass.append(p[:, rows].sum(axis=1, dtype=np.float64))
        seen.append(vis[:, np.asarray(mass_rows, dtype=bool)].sum(axis=1))
    return out, mass, seen


def rank_positions(k_pos: np.ndarray, vis: np.ndarray) -> np.ndarray:
    """In-cache positions: each visible key's rank among the visible keys, in time order.

    k_pos: [Hkv, K] (any order), vis: [Hkv, K] bool -> [Hkv, K] int64 (0 where not visible).
    """
    order = np.argsort(np.where(vis, k_pos, NEVER), axis=-1, kind="stable")
    ranks = np.empty_like(order)
    np.put_along_axis(ranks, order, np.arange(k_pos.shape[-1])[None, :].repeat(k_pos.shape[0], 0), axis=-1)
    return np.where(vis, ranks, 0)  # an unseen key gets 0: its rotation is never used, nor past the table


def attend_in_cache(q_pre: np.ndarray, k_pre: np.ndarray, v: np.ndarray, k_pos: np.ndarray,
                    q_pos: np.ndarray, visible, rope: tuple) -> np.ndarray:
    """Attention with in-cache positions: every query re-rotates the keys it sees by their rank.

    q_pre: [T, Hq, D] and k_pre: [Hkv, K, D] *pre-RoPE*; v: [Hkv, K, D]; k_pos: [Hkv, K];
    q_pos: [T]; rope = (cos, sin, layout) tables [max_position, D/2]. Query t sits at its own
    key's rank (the largest). One query at a time: each sees its own set, hence its own ranks.
    """
    cos, sin, layout = rope
    t, hq, d = q_pre.shape
    hkv = k_pre.shape[0]
    out = np.empty_like(q_pre)
    for i in range(t):
        vis = visible(q_pos[i:i + 1], k_pos)[:, 0]                     # [Hkv, K]
        ranks = rank_positions(k_pos, vis)
        if np.any(vis.sum(-1) == 0):
            raise InvalidInputError(f"query at position {q_pos[i]} sees no key; the cache lost its own token")
        k_rot = np.stack([apply_rope(k_pre[h][:, None], cos[ranks[h]], sin[ranks[h]], layout)[:, 0]
                          for h in range(hkv)])                         # [Hkv, K, D]
        q_rank = vis.sum(-1) - 1                                       # [Hkv]: the query's own key
        q_rot = np.concatenate([apply_rope(q_pre[i:i + 1, h * (hq // hkv):(h + 1) * (hq // hkv)],
                                           cos[q_rank[h]:q_rank[h] + 1], sin[q_rank[h]:q_rank[h] + 1], layout)
                                for h in range(hkv)], axis=1)          # [1, Hq, D]
        out[i] = attend_slots(q_rot, [(k_rot, v, k_pos)], lambda kp, i=i: visible(q_pos[i:i + 1], kp))[0]
    return out


def check_rope_table(policy: Policy, rope: tuple | None) -> None:
    """In-cache ranks reach W - 1: refuse a window longer than the model's RoPE table (ConfigError)."""
    if policy.positions == "in-cache" and rope is not None and len(rope[0]) < getattr(policy, "window", 0):
        raise ConfigError(f"window={policy.window} with in-cache positions needs RoPE angles for ranks up to "
                          f"{policy.window - 1}, but the model has {len(rope[0])} (max_position); use --window "
                          f"<= {len(rope[0])}")


# --- contiguous storage ---------------------------------------------------------------------------


def truncate_refusal(policy: Policy, seq_id) -> RollbackError:
    """Why an evicting cache cannot ``truncate`` (take tokens back): what the policy dropped is gone."""
    return RollbackError(f"the {policy.name} cache cannot truncate sequence {seq_id!r}: each step lets the "
                         "policy evict keys (and rank by scores) for the new tokens, and what it dropped is gone, "
                         "so the cache before them cannot be rebuilt; speculative decoding needs a contiguous or "
                         "paged cache")


class _Seq:
    """One sequence's slots: k, v [L, Hkv, C, D]; pos, seen [L, Hkv, C] int64; score float64;
    ``log`` [L, Hkv, >= n] (``evicted_at`` of the n tokens seen, capacity doubled as they arrive, so a
    token costs O(1) amortized) and ``length`` (tokens seen)."""

    def __init__(self, shape: tuple, dtype, log: bool):
        L, hkv, c, d = shape
        self.k, self.v = np.zeros(shape, dtype), np.zeros(shape, dtype)
        self.pos = np.full((L, hkv, c), -1, dtype=np.int64)
        self.score, self.seen = np.zeros((L, hkv, c)), np.zeros((L, hkv, c), dtype=np.int64)
        self.log = np.full((L, hkv, 16), NEVER, dtype=np.int64) if log else None
        self.length = 0

    def grow(self, extra: int) -> None:
        """Add ``extra`` empty slots per (layer, head) (a policy whose cache may grow: SnapKV's decode)."""
        pad = [(0, 0), (0, 0), (0, extra)]
        self.k = np.pad(self.k, pad + [(0, 0)])
        self.v = np.pad(self.v, pad + [(0, 0)])
        self.pos = np.pad(self.pos, pad, constant_values=-1)
        self.score, self.seen = np.pad(self.score, pad), np.pad(self.seen, pad)


class EvictingKVCache(KVCacheBase):
    """A cache that keeps what ``policy`` keeps, in slots per sequence (see the module docstring).

    policy:  a ``Policy`` (``WindowPolicy``, ``minikv.window.scores.H2OPolicy``, ``SnapKVPolicy``)
    rope:    (cos, sin, layout) of the model, needed by ``in-cache`` positions only: the model then
             hands over pre-RoPE q and k (``rotates_in_cache``) and this cache rotates by rank
    log:     keep ``evicted_at`` (what ``MaskedRecompute`` needs; one int64 per token, layer and head, so
             ``make_cache`` turns it off: a streaming cache must not grow with the text)
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, policy: Policy, max_seqs: int = 1,
                 dtype=np.float32, rope: tuple | None = None, log: bool = True):
        super().__init__(num_layers, num_kv_heads, head_dim, dtype)
        if policy.positions == "in-cache" and rope is None:
            raise ConfigError("positions='in-cache' re-rotates keys at attention time: pass rope=(cos, sin, layout)"
                              " (make_cache does)")
        check_rope_table(policy, rope)
        self.policy, self.rope, self.log = policy, rope, bool(log)
        self.rotates_in_cache = policy.positions == "in-cache"
        self.max_seqs = check_int("max_seqs", max_seqs)
        self._seqs: dict = {}
        self._stash: dict = {}   # layer -> (k [N, Hkv, D], v, {seq index: (mass, seen) per tile})
        self.elements_written = 0  # K/V elements stored so far: the ring's O(1)-per-token check

    def add_sequence(self, seq_id) -> None:
        if seq_id in self._seqs:
            raise InvalidInputError(f"sequence {seq_id!r} is already in the cache; free it or pick a new id")
        if len(self._seqs) >= self.max_seqs:
            raise CacheFullError(f"all {self.max_seqs} sequences are taken, so {seq_id!r} cannot be added; free "
                                 "one or build the cache with a larger max_seqs")
        shape = (self.num_layers, self.num_kv_heads, self.policy.capacity, self.head_dim)
        self._seqs[seq_id] = _Seq(shape, self.dtype, self.log)

    def free_sequence(self, seq_id) -> None:
        lookup_sequence(self._seqs, seq_id)
        del self._seqs[seq_id]

    def length(self, seq_id) -> int:
        return lookup_sequence(self._seqs, seq_id).length

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._seqs

    def _truncate(self, seq_id, new_len: int) -> None:
        raise truncate_refusal(self.policy, seq_id)

    # -- a step: stash, attend over slots + stash, then let the policy drop and place --------------
    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        self._check_layer(layer)
        self._check_rows("k", k, self.num_kv_heads)
        self._check_rows("v", v, self.num_kv_heads)
        self._stash[layer] = (k.astype(self.dtype), v.astype(self.dtype), {})

    def attend(self, layer: int, q: np.ndarray, sinks: np.ndarray | None = None,
               softcap: float | None = None) -> np.ndarray:
        step = self._check_query(layer, q)
        if layer not in self._stash:
            raise InvalidInputError(f"attend(layer={layer}) before write(layer={layer}) in this step")
        if self.rotates_in_cache and (sinks is not None or softcap is not None):
            raise ConfigError("positions='in-cache' does not apply learned sinks or soft-capping; "
                              "use positions='original' for this model")
        k_new, v_new, masses = self._stash[layer]
        out = np.empty_like(q)
        for i, sid in enumerate(step.seq_ids):
            s, r = self._seqs[sid], step.rows(i)
            q_pos = step.positions[r]
            kn, vn = k_new[r].transpose(1, 0, 2), v_new[r].transpose(1, 0, 2)  # [Hkv, T, D]
            pn = np.broadcast_to(q_pos, kn.shape[:2])                           # [Hkv, T]
            vis = lambda kp, q_pos=q_pos: self.policy.visible(q_pos, kp)  # noqa: E731
            if self.rotates_in_cache:
                out[r] = attend_in_cache(q[r], np.concatenate([s.k[layer], kn], 1), np.concatenate([s.v[layer], vn], 1),
                                         np.concatenate([s.pos[layer], pn], 1), q_pos, self.policy.visible, self.rope)
                continue
            rows = self.policy.mass_queries(int(step.past[i]), r.stop - r.start)
            res = attend_slots(q[r], [(s.k[layer], s.v[layer], s.pos[layer]), (kn, vn, pn)], vis, rows,
                               sinks=sinks, softcap=softcap)
            out[r] = res if rows is None else res[0]
            if rows is not None:
                masses[i] = res[1:]
        return out

    def _commit(self, step) -> None:
        missing = [layer for layer in range(self.num_layers) if layer not in self._stash]
        if missing:  # checked before anything changes: a half-run step must not half-commit
            raise InvalidInputError(f"the step wrote no K/V for layers {missing}; every layer must write and "
                                    "attend before the step ends")
        for i, sid in enumerate(step.seq_ids):
            s, r = self._seqs[sid], step.rows(i)
            new_pos = step.positions[r]
            if s.log is not None and s.log.shape[-1] < s.length + new_pos.size:
                extra = max(s.log.shape[-1], new_pos.size)
                s.log = np.concatenate([s.log, np.full(s.log.shape[:2] + (extra,), NEVER)], -1)
            for layer in range(self.num_layers):
                self._settle(s, layer, i, r, new_pos, first=int(step.past[i]) == 0)
            s.length += new_pos.size
        self._stash.clear()

    def _rollback(self, step) -> None:
        self._stash.clear()

    def _settle(self, s: _Seq, layer: int, i: int, r: slice, new_pos: np.ndarray, first: bool) -> None:
        """Fold the step into one layer's slots: scores, the policy's drops (logged), then placement."""
        k_new, v_new, masses = self._stash[layer]
        hkv, c, t = self.num_kv_heads, s.pos.shape[-1], new_pos.size
        pos = np.concatenate([s.pos[layer], np.broadcast_to(new_pos, (hkv, t))], -1)   # [Hkv, C + T]
        score = np.concatenate([s.score[layer], np.zeros((hkv, t))], -1)
        seen = np.concatenate([s.seen[layer], np.zeros((hkv, t), dtype=np.int64)], -1)
        if i in masses:
            (m_old, m_new), (n_old, n_new) = masses[i]
            score += np.concatenate([m_old, m_new], -1)
            seen += np.concatenate([n_old, n_new], -1)
        keep = self.policy.keep(pos, score, seen, int(new_pos[-1]), first)
        gone = (pos >= 0) & ~keep
        if s.log is not None and gone.any():
            h, j = np.nonzero(gone)
            s.log[layer, h, pos[h, j]] = self.policy.dropped_at(pos[h, j], int(new_pos[-1]))
        s.pos[layer][gone[:, :c]] = -1
        s.score[layer], s.seen[layer] = np.where(keep[:, :c], score[:, :c], 0), np.where(keep[:, :c], seen[:, :c], 0)
        kn, vn = k_new[r], v_new[r]
        for h in range(hkv):
            self._place(s, layer, h, np.flatnonzero(keep[h, c:]), new_pos, kn, vn, score[h, c:], seen[h, c:])

    def _place(self, s: _Seq, layer: int, h: int, js: np.ndarray, new_pos, kn, vn, score, seen) -> None:
        """Store the surviving new tokens ``js`` of head ``h``: in their ring slot, else in freed slots."""
        if js.size == 0:
            return
        ring = [self.policy.ring_slot(int(new_pos[j])) for j in js]
        if ring[0] is None:
            free = np.flatnonzero(s.pos[layer, h] < 0)
            if free.size < js.size:
                s.grow(max(js.size - free.size, s.pos.shape[-1]))
                free = np.flatnonzero(s.pos[layer, h] < 0)
            ring = free[: js.size]
        ring = np.asarray(ring)
        assert np.all(s.pos[layer, h, ring] < 0), "a slot was overwritten before its key was dropped"
        s.k[layer, h, ring], s.v[layer, h, ring] = kn[js, h], vn[js, h]
        s.pos[layer, h, ring], s.score[layer, h, ring], s.seen[layer, h, ring] = new_pos[js], score[js], seen[js]
        self.elements_written += 2 * js.size * self.head_dim

    # -- inspection ---------------------------------------------------------------------------------
    def kept_positions(self, seq_id, layer: int) -> list[np.ndarray]:
        """The positions each KV head keeps at ``layer``, sorted: Hkv arrays."""
        pos = lookup_sequence(self._seqs, seq_id).pos[layer]
        return [np.sort(p[p >= 0]) for p in pos]

    def slots(self, seq_id, layer: int) -> dict:
        """Copies of one layer's slots in storage order: ``pos``, ``score`` (the policy's accumulated mass)
        and ``seen`` (queries that saw each key), each [Hkv, C]; pos -1 = an empty slot."""
        self._check_layer(layer)
        s = lookup_sequence(self._seqs, seq_id)
        return {"pos": s.pos[layer].copy(), "score": s.score[layer].copy(), "seen": s.seen[layer].copy()}

    def evicted_at(self, seq_id) -> np.ndarray:
        """[L, Hkv, n]: the first query position that no longer saw each key (NEVER: still kept)."""
        s = lookup_sequence(self._seqs, seq_id)
        if s.log is None:
            raise ConfigError("this cache was built with log=False, so it kept no eviction log")
        return s.log[..., : s.length].copy()

    def bytes_allocated(self) -> int:
        return sum(s.k.nbytes + s.v.nbytes for s in self._seqs.values())

    def bytes_used(self) -> int:
        """Bytes of the kept keys and values: 2 x D x itemsize per kept (layer, head, token)."""
        per = 2 * self.head_dim * self.dtype.itemsize
        return int(sum((s.pos >= 0).sum() for s in self._seqs.values())) * per
