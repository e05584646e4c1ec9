"""Step 9: hybrid models. Each layer gets the cache its own attention needs.

Most models released since 2024 do not give every layer the same attention. Gemma 3 slides five
layers of every six over a window of W keys and gives the sixth full attention: a sliding layer's
query t sees keys t - W + 1 .. t, a full layer's query sees keys 0 .. t. The pattern is data, one
name per layer (``config.layer_types``, as transformers spells it), here one window per layer
(None: full)::

    Gemma-3-270M, 18 layers, W = 512:   S S S S S F S S S S S F S S S S S F      (full: 5, 11, 17)

So the cache belongs to the layer, not to the model. The layers of one kind form a **group**, and
each group gets the cache of an earlier step behind the same seam: the sliding layers step 6's
ring (no sinks), the full layers step 2's slab. One ``step`` opens every group; ``write(layer, ..)``
and ``attend(layer, ..)`` go to the layer's group. Step 6's window was a policy laid over the whole
model, which changes what the model computes; here the window *is* the model, so the hybrid cache
is exact: it equals one uncached forward with each sliding layer masked to its window.

Memory
------
Between steps a full layer holds all n keys, a sliding one at most W - 1 (the next query brings its
own key; ``kv_tokens``, W - 1 + K with the rollback slots below). A key and a value per token and
layer, Hkv x D numbers of b bytes each::

    bytes(n) = 2 * Hkv * D * b * (L_full * n + L_sliding * min(n, W - 1))

Gemma-3-270M (Hkv = 1, D = 256, 3 full and 15 sliding layers) at n = 32,768: 3 n + 15 x 511 = 105,969
key rows against 18 n = 589,824 when every layer is sized full: 82% smaller. Up to n = W - 1 the two
are equal; past it the sliding layers stop growing and the saving grows with the context.

Prefix hits
-----------
A prefix hit starts a new sequence on the K/V another sequence already computed for the same first h
tokens (step 3b). Step 3b's rule reuses every key of the prefix, and an evicting cache (step 6)
shares nothing it has dropped a key of: under that rule a sliding layer, which drops keys as soon as
the text passes W, never hits, and several engines report no prefix hits on hybrid models. But the
next query, at position h, sees only keys h - W + 1 .. h, and brings key h itself: a sliding layer
needs only the **W - 1 keys before the hit point**, a full layer all h (``needed_for_hit``).
``share_prefix`` copies exactly those. The second turn of a chat starts where the first ended, so it
always finds them in the first turn's ring.

Rollback
--------
Speculative decoding (step 7) writes 1 + k tokens in one step and may take k of them back
(``truncate``). After taking back j tokens the next query, at new_len, needs keys new_len - W + 1 ..
new_len - 1; in a ring of W slots the tokens just taken back have overwritten the oldest of them.
A ring of **W + K slots** (K: the largest draft length) holds the W - 1 + K keys a query may need after
taking back up to K tokens, and the slot its own key goes to.

Run it: ``python -m minikv.textbook.s9_hybrid`` (Gemma-3-270M continues 555 tokens of text, so
every ring has wrapped, by step 7's speculative decoding through the lesson's hybrid cache; against
``minikv.generate.generate(..., speculative="ngram")`` on the engine's ``minikv.hybrid`` caches).
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager

import numpy as np

from minikv.textbook.s2_kv_cache import Cache, ContiguousCache
from minikv.textbook.s6_window import RingCache, visible

# --- NEW in step 9 ---


def layer_windows(num_layers: int, window: int, pattern: int = 6) -> list:
    """Gemma 3's pattern: layer i is full (None) iff (i + 1) % pattern == 0, else it slides over W = ``window``."""
    return [None if (i + 1) % pattern == 0 else window for i in range(num_layers)]


def kv_tokens(windows: list, n: int, rollback: int = 0) -> list:
    """[L] the keys each layer must keep after n tokens: all n for a full layer, at most W - 1 + K for a sliding one."""
    return [n if w is None else min(n, w - 1 + rollback) for w in windows]


def needed_for_hit(h: int, window: int | None) -> range:
    """The positions a layer must still hold for a new sequence to start at position h on a cached prefix."""
    return range(0 if window is None else max(0, h - window + 1), h)


class Slab(ContiguousCache):
    """The full layers: step 2's slab, k, v [L, max_seqs, max_len, Hkv, D]."""

    def holds(self, seq_id, need: range) -> bool:
        return need.stop <= self.lens[seq_id]

    def truncate(self, seq_id, new_len: int) -> None:
        """Rows past new_len stay, hidden by the causal mask until the next step overwrites them (step 7)."""
        self.lens[seq_id] = new_len

    def copy_prefix(self, src, dst, need: range) -> None:
        a, b = self.slab[src], self.slab[dst]
        self.k[:, b, need.start:need.stop], self.v[:, b, need.start:need.stop] = (
            self.k[:, a, need.start:need.stop], self.v[:, a, need.start:need.stop])


class SlidingRing(RingCache):
    """The sliding layers: step 6's ring without sinks, W + K slots: k, v [L, max_seqs, W + K, Hkv, D].

    The ring turns over W + K slots (position p in slot p mod (W + K)); the mask still slides over W.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, window: int, rollback: int,
                 max_seqs: int, dtype=np.float32):
        super().__init__(num_layers, num_kv_heads, head_dim, window + rollback, 0, max_seqs, dtype)
        self.w = window

    def tiles(self, layer: int, seq_id, q_pos: np.ndarray):
        """As step 6: the ring in storage order, then the step's own tokens; the mask keeps q - k < W."""
        i, (k_new, v_new) = self.ring[seq_id], self.new[layer][seq_id]
        yield self.k[layer, i], self.v[layer, i], visible(q_pos, self.pos[i], self.w, 0)
        yield k_new, v_new, visible(q_pos, q_pos, self.w, 0)

    def truncate(self, seq_id, new_len: int) -> None:
        """Forget positions >= new_len: their slots are free for the next step's tokens."""
        pos = self.pos[self.ring[seq_id]]
        pos[pos >= new_len] = -1
        self.lens[seq_id] = new_len

    def holds(self, seq_id, need: range) -> bool:
        return bool(np.isin(np.arange(need.start, need.stop), self.pos[self.ring[seq_id]]).all())

    def copy_prefix(self, src, dst, need: range) -> None:
        a, b = self.ring[src], self.ring[dst]
        keep = (self.pos[a] >= need.start) & (self.pos[a] < need.stop)  # the same slots: slot = p mod (W + K)
        self.k[:, b, keep], self.v[:, b, keep] = self.k[:, a, keep], self.v[:, a, keep]
        self.pos[b] = np.where(keep, self.pos[a], -1)


class HybridCache(Cache):
    """One group per window (None: the full layers), each its own cache; layer ``layers[j]`` is its group's layer j.

    windows: [L] each layer's window W, None for full attention (``model.config.layer_windows``)
    """

    def __init__(self, windows: list, num_kv_heads: int, head_dim: int, max_seqs: int, max_len: int,
                 rollback: int = 0, dtype=np.float32):
        super().__init__(len(windows), num_kv_heads, head_dim)
        self.layer_windows = tuple(windows)  # the model checks them against its config
        self.groups, self.where = {}, {}     # window -> its cache; model layer -> (its group's cache, index there)
        for w in dict.fromkeys(windows):
            layers = [layer for layer, x in enumerate(windows) if x == w]
            self.groups[w] = (Slab(len(layers), num_kv_heads, head_dim, max_seqs, max_len, dtype) if w is None else
                              SlidingRing(len(layers), num_kv_heads, head_dim, w, rollback, max_seqs, dtype))
            self.where.update({layer: (self.groups[w], j) for j, layer in enumerate(layers)})

    def add_sequence(self, seq_id) -> None:
        super().add_sequence(seq_id)
        for cache in self.groups.values():
            cache.add_sequence(seq_id)

    @contextmanager
    def step(self, seq_ids, num_new):
        """One step opens every group's step; they see the same tokens, so they agree on the positions."""
        with ExitStack() as groups:
            for cache in self.groups.values():
                groups.enter_context(cache.step(seq_ids, num_new))
            with super().step(seq_ids, num_new) as positions:
                yield positions

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        cache, j = self.where[layer]
        cache.write(j, k, v)

    def attend(self, layer: int, q: np.ndarray) -> np.ndarray:
        cache, j = self.where[layer]
        return cache.attend(j, q)

    def truncate(self, seq_id, new_len: int) -> None:
        """Take tokens back in every group (a slab just forgets; a ring of W + K slots stays exact for up to K)."""
        for cache in self.groups.values():
            cache.truncate(seq_id, new_len)
        self.lens[seq_id] = new_len

    def share_prefix(self, src, dst, h: int) -> bool:
        """A prefix hit: start the new sequence ``dst`` on the first h tokens of ``src``. Each group copies the
        keys ``needed_for_hit(h, W)``; False, adding nothing, when a group no longer holds them (recompute)."""
        needs = {w: needed_for_hit(h, w) for w in self.groups}
        if not all(cache.holds(src, needs[w]) for w, cache in self.groups.items()):
            return False
        self.add_sequence(dst)
        for w, cache in self.groups.items():
            cache.copy_prefix(src, dst, needs[w])
            cache.lens[dst] = h
        self.lens[dst] = h
        return True

# --- end NEW ---


def main(max_new_tokens: int = 16, draft_len: int = 4, load=None, prompts=None):
    """Gemma-3-270M continues a text past its window, or ``load()`` -> (model, None) continues token-id ``prompts``
    (notebooks/09_hybrid.ipynb runs a tiny random Gemma-style model)."""
    from minikv.textbook.demo import demo, engine, gemma3, one_by_one, past_the_window
    from minikv.textbook.s7_rollback import speculative_greedy

    def lesson(model, ids, n):
        c = model.config
        cache = HybridCache(c.layer_windows, c.num_kv_heads, c.head_dim, max_seqs=1, max_len=len(ids) + n,
                            rollback=draft_len, dtype=model.dtype)
        return speculative_greedy(model, cache, ids, n, draft_len)

    return demo("step 9, hybrid cache, speculative decoding after the rings wrapped", one_by_one(lesson),
                engine(cache="contiguous", speculative="ngram", draft_len=draft_len), max_new_tokens,
                questions=prompts or (past_the_window(),), load=load or gemma3, chat=False)


if __name__ == "__main__":
    main()
