"""Step 2: the KV cache. Keep every token's key and value; attend over them a tile at a time.

In a causal decoder a token's key and value depend only on that token and the ones before it,
so once computed they never change: keep them. Generation then has two phases:

* **prefill**: the P prompt tokens go through the model in one pass; every layer writes their
  K and V, and the last position's logits give the first new token;
* **decode**: each later pass feeds only the newest token (T = 1); every layer appends its K
  and V and attends with its query over all S = P + G cached keys.

Queries are never cached: a query is used once, by its own token. Keys are rotated (RoPE)
before they are cached, at their own position, so a cached key never changes again.

The seam (the same for every later step)
----------------------------------------
``with cache.step(seq_ids, num_new) as positions:`` opens one pass. Sequences of different
lengths share it, *packed* along one axis of N rows without padding: sequence i owns rows
``starts[i]:starts[i+1]``, and its new tokens sit at positions ``past_i, past_i + 1, ...``.
Then every layer calls ``cache.write(layer, k, v)`` and ``cache.attend(layer, q)``. When the
step closes, each sequence's length grows by its new tokens.

The online softmax
------------------
A cache never builds one [T, S] score matrix over the whole history. It walks its keys in
tiles and keeps three running numbers per query row: the max ``m`` of the scores seen so far,
the sum ``l`` of exp(score - m) and the unnormalised output ``acc``. Each tile rescales what
came before by exp(m - m'); after the last tile ``out = acc / l``. The result does not
depend on where the tiles split the keys (only rounding does), which is what lets step 3
read a history scattered over blocks, step 5 dequantize a tile at a time and step 6 read a
ring in storage order.

Run it: ``python -m minikv.textbook.s2_kv_cache`` (against ``minikv.kv_cache.ContiguousKVCache``).
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np

# --- NEW in step 2 ---


def online_softmax_start(shape: tuple, dim: int, dtype) -> tuple:
    """The state before any key: m = -inf, l = 0 ([*shape] each) and acc = 0 ([*shape, dim])."""
    return np.full(shape, -np.inf, dtype), np.zeros(shape, dtype), np.zeros((*shape, dim), dtype)


def online_softmax_update(m: np.ndarray, l: np.ndarray, acc: np.ndarray, scores: np.ndarray,
                          values: np.ndarray, mask: np.ndarray) -> tuple:
    """Fold one tile of K keys into the running state; returns the new (m, l, acc).

    m, l:   [..., Q] running max and running sum of exp(score - m), one per query row
    acc:    [..., Q, D] running sum of exp(score - m) * value
    scores: [..., Q, K] this tile's scaled scores;  values: [..., K, D] its value rows
    mask:   bool, broadcastable to scores ([Q, K] here); False: that query may not see that key

        m'   = max(m, max_k s_k)
        l'   = exp(m - m') l   + sum_k exp(s_k - m')
        acc' = exp(m - m') acc + sum_k exp(s_k - m') v_k
    """
    scores = np.where(mask, scores, -np.inf)
    m_new = np.maximum(m, scores.max(axis=-1, initial=-np.inf))
    # A row that has seen no visible key yet still has m' = -inf, and exp(-inf - -inf) is NaN:
    # shift such a row by the lowest finite float instead, so its exponentials come out 0.
    shift = np.maximum(m_new, np.finfo(m.dtype).min)
    p = np.exp(scores - shift[..., None])
    alpha = np.exp(m - shift)
    # A key no query of the tile sees may be a stale slot holding anything, NaN included, and
    # 0 * NaN = NaN: select its value row away instead of trusting its zero probability.
    values = np.where(np.any(mask, axis=-2)[..., None], values, 0)
    return m_new, alpha * l + p.sum(axis=-1), alpha[..., None] * acc + p @ values


def online_softmax_finish(m: np.ndarray, l: np.ndarray, acc: np.ndarray) -> np.ndarray:
    """acc / l: [..., Q, D]. A row that saw no key at all (l = 0, acc = 0) gives zeros, not NaN."""
    return acc / np.maximum(l, np.finfo(l.dtype).tiny)[..., None]


def attend_tiles(q: np.ndarray, tiles, num_kv_heads: int, scale: float) -> np.ndarray:
    """Attention of one sequence's T queries over keys that arrive a tile at a time.

    q:     [T, Hq, D]
    tiles: iterable of (k [K, Hkv, D], v [K, Hkv, D], mask [T, K]); the tiles may come in any order
    returns [T, Hq, D]. Query head h reads KV head h // g (g = Hq / Hkv): a group's g heads form
    one block of g*T rows, so each tile of K and V is read once per group.
    """
    t, hq, d = q.shape
    qg = (q * q.dtype.type(scale)).reshape(t, num_kv_heads, hq // num_kv_heads, d).transpose(1, 2, 0, 3)
    m, l, acc = online_softmax_start(qg.shape[:-1], d, q.dtype)                    # [Hkv, g, T]
    for k, v, mask in tiles:
        scores = qg @ k.transpose(1, 2, 0)[:, None]                                # [Hkv, g, T, K]
        m, l, acc = online_softmax_update(m, l, acc, scores, v.transpose(1, 0, 2)[:, None], mask)
    return online_softmax_finish(m, l, acc).transpose(2, 0, 1, 3).reshape(t, hq, d)


class Cache:
    """The seam. A subclass stores K/V (``write``) and yields a sequence's keys in tiles (``tiles``)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int):
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.lens: dict = {}  # seq_id -> tokens cached

    def add_sequence(self, seq_id) -> None:
        self.lens[seq_id] = 0

    def length(self, seq_id) -> int:
        return self.lens[seq_id]

    @contextmanager
    def step(self, seq_ids, num_new):
        """Open one forward pass of ``num_new[i]`` new tokens for each ``seq_ids[i]``; yields positions [N]."""
        starts = np.cumsum([0, *num_new])
        # per sequence: its id, the positions of its new tokens [T], its packed rows
        self.seqs = [(sid, np.arange(self.lens[sid], self.lens[sid] + n), slice(a, b))
                     for sid, n, a, b in zip(seq_ids, num_new, starts, starts[1:])]
        yield np.concatenate([pos for _, pos, _ in self.seqs])
        for sid, n in zip(seq_ids, num_new):
            self.lens[sid] += int(n)  # the step is done: its tokens are part of the history now

    def attend(self, layer: int, q: np.ndarray) -> np.ndarray:
        """q: [N, Hq, D] -> [N, Hq, D]: each sequence's queries over its own history."""
        return np.concatenate([self.attend_one(layer, q[rows], self.tiles(layer, sid, pos))
                               for sid, pos, rows in self.seqs])

    def attend_one(self, layer: int, q: np.ndarray, tiles) -> np.ndarray:
        """One sequence: q [T, Hq, D] over its tiles (step 4 attends in latent space instead)."""
        return attend_tiles(q, tiles, self.num_kv_heads, 1 / np.sqrt(self.head_dim))


class ContiguousCache(Cache):
    """Each sequence owns one slab of ``max_len`` positions, reserved up front.

    k, v: [L, max_seqs, max_len, Hkv, D]. Simple and fast to read; the price is memory: every
    slab reserves max_len positions whether the sequence ever uses them or not (step 3 pages it).
    ``tile``: keys per tile of the online softmax.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_seqs: int, max_len: int,
                 dtype=np.float32, tile: int = 64):
        super().__init__(num_layers, num_kv_heads, head_dim)
        self.k = np.zeros((num_layers, max_seqs, max_len, num_kv_heads, head_dim), dtype)
        self.v = np.zeros_like(self.k)
        self.slab: dict = {}  # seq_id -> its slab
        self.tile = tile

    def add_sequence(self, seq_id) -> None:
        super().add_sequence(seq_id)
        self.slab[seq_id] = len(self.slab)

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """k, v: [N, Hkv, D]: each sequence's rows go to their positions in its slab."""
        for sid, pos, rows in self.seqs:
            self.k[layer, self.slab[sid], pos] = k[rows]
            self.v[layer, self.slab[sid], pos] = v[rows]

    def tiles(self, layer: int, seq_id, q_pos: np.ndarray):
        """Positions 0 .. S-1 of the slab (this step's included), ``tile`` keys at a time, causally masked."""
        s, slab = q_pos[-1] + 1, self.slab[seq_id]
        for k0 in range(0, s, self.tile):
            k_pos = np.arange(k0, min(k0 + self.tile, s))
            yield (self.k[layer, slab, k0:k0 + k_pos.size], self.v[layer, slab, k0:k0 + k_pos.size],
                   k_pos[None, :] <= q_pos[:, None])

# --- end NEW ---


def main(max_new_tokens: int = 16):
    from minikv.textbook.demo import demo, engine, greedy_with
    from minikv.textbook.s1_attention import greedy

    return demo("step 2, contiguous cache", greedy_with(greedy, lambda model, n: ContiguousCache(
        **model.new_cache_args(), max_seqs=1, max_len=n, dtype=model.dtype)), engine(cache="contiguous"),
        max_new_tokens)


if __name__ == "__main__":
    main()
