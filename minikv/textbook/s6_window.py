"""Step 6: a sliding window with attention sinks, kept in a ring buffer of W slots.

Steps 2 to 5 keep every token, so the cache grows with the text. A window keeps the W newest
tokens of each sequence and forgets the rest: memory stops growing. StreamingLLM found that a
windowed model falls apart once the first tokens leave, because attention parks surplus weight
on them (*attention sinks*); keeping the first n_sink tokens for good fixes it. So query q sees
key k iff k <= q and either k is a sink (k < n_sink) or k is among the W - n_sink newest:
``q - k < W - n_sink`` (the window counts the query's own token).

The ring buffer
---------------
Each sequence owns W slots per layer: the sinks keep slots 0 .. n_sink - 1 forever, and every
later token cycles through the W - n_sink slots after them, overwriting the token that has just
left the window::

    slot(p) = p                                       if p < n_sink
            = n_sink + (p - n_sink) mod (W - n_sink)  otherwise    (W = 6, n_sink = 2: 0 1 2 3 4 5 2 3 4 5 2 ...)

That is O(1) work per token, where a window that shifts its buffer moves W rows every step.
Attention reads the ring **in storage order**: step 2's online softmax does not care in which
order keys arrive. What it needs is each key's **position, stored per slot**, because once the
ring wraps, slot order is not time order; the mask reads those positions (-1: an empty slot).

A step's own tokens are attended from where ``write`` left them (a prefill longer than the
window would overwrite, in the ring, keys its own earlier queries still need); when the step
ends, the sinks and the W - n_sink newest of them enter the ring.

What it equals: keys are rotated at their absolute positions when written (the *original*
contract), so this is not the model run over the kept tokens; it is one forward over the whole
text in which token t sees exactly the keys the window kept at t (``minikv.window`` builds that
masked recompute; step 6 of the engine also has H2O, SnapKV and re-rotated *in-cache* positions).

Run it: ``python -m minikv.textbook.s6_window`` (W = 32, n_sink = 4, so the ring wraps inside the
prompt; against ``minikv.window.ring.EvictingKVCache(WindowPolicy(32, 4))``).
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from minikv.textbook.s2_kv_cache import Cache

# --- NEW in step 6 ---


def ring_slot(p: np.ndarray, window: int, sinks: int) -> np.ndarray:
    """The ring slot of each position p ([T] ints): W = ``window`` slots, the first n_sink = ``sinks`` for sinks."""
    return np.where(p < sinks, p, sinks + (p - sinks) % (window - sinks))


def visible(q_pos: np.ndarray, k_pos: np.ndarray, window: int, sinks: int) -> np.ndarray:
    """May query q see key k? q_pos [T], k_pos [K] (-1: an empty slot) -> bool [T, K]."""
    q, k = q_pos[:, None], k_pos[None, :]
    return (k >= 0) & (k <= q) & ((k < sinks) | (q - k < window - sinks))


class RingCache(Cache):
    """k, v: [L, max_seqs, W, Hkv, D], one ring per sequence; pos: [max_seqs, W] each slot's position."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, window: int, sinks: int, max_seqs: int,
                 dtype=np.float32):
        super().__init__(num_layers, num_kv_heads, head_dim)
        self.k = np.zeros((num_layers, max_seqs, window, num_kv_heads, head_dim), dtype)
        self.v = np.zeros_like(self.k)
        self.pos = np.full((max_seqs, window), -1)  # the same for every layer and head: a window drops by position
        self.window, self.sinks = window, sinks
        self.ring: dict = {}  # seq_id -> its ring
        self.new: dict = {}   # layer -> {seq_id: this step's (k, v) [T, Hkv, D]}

    def add_sequence(self, seq_id) -> None:
        super().add_sequence(seq_id)
        self.ring[seq_id] = len(self.ring)

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        self.new[layer] = {sid: (k[rows], v[rows]) for sid, _, rows in self.seqs}

    def tiles(self, layer: int, seq_id, q_pos: np.ndarray):
        """Two tiles: the ring in storage order, then the step's own tokens; the window rule masks both."""
        i, (k_new, v_new) = self.ring[seq_id], self.new[layer][seq_id]
        yield self.k[layer, i], self.v[layer, i], visible(q_pos, self.pos[i], self.window, self.sinks)
        yield k_new, v_new, visible(q_pos, q_pos, self.window, self.sinks)

    @contextmanager
    def step(self, seq_ids, num_new):
        with super().step(seq_ids, num_new) as positions:
            yield positions
        for sid, pos, _ in self.seqs:  # the sinks and the W - n_sink newest tokens enter the ring: one slot each
            keep = (pos < self.sinks) | (pos > pos[-1] - (self.window - self.sinks))
            slots, i = ring_slot(pos[keep], self.window, self.sinks), self.ring[sid]
            for layer, new in self.new.items():
                self.k[layer, i, slots], self.v[layer, i, slots] = new[sid][0][keep], new[sid][1][keep]
            self.pos[i, slots] = pos[keep]

# --- end NEW ---


def main(max_new_tokens: int = 16):
    from minikv.textbook.demo import demo, engine, greedy_with
    from minikv.textbook.s1_attention import greedy

    return demo("step 6, window 32 with 4 sinks", greedy_with(greedy, lambda model, n: RingCache(
        **model.new_cache_args(), window=32, sinks=4, max_seqs=1, dtype=model.dtype)),
        engine(cache="window", eviction=dict(window=32, sinks=4)), max_new_tokens)


if __name__ == "__main__":
    main()
