"""Step 1: attention from scratch, and a "cache" that keeps nothing.

A decoder layer turns every token into a query q, a key k and a value v. A token's output is
a weighted average of the values of the tokens up to and including itself; the weights are a
softmax of how well its query matches each key::

    out = softmax(q k^T / sqrt(D) + mask) v        q: [T, D], k, v: [S, D] -> out: [T, D]

Generation is a loop: run the model, pick the next token, append it, run again. This step
runs that loop the plain way: every pass feeds the *whole* sequence, so the keys and values
of the prefix are computed again and again although they never change. That baseline is the
reference every cache of the later steps must reproduce.

Notation: T tokens in this pass (their queries), S keys a query may attend (S >= T), Hq query
heads, Hkv key/value heads, g = Hq / Hkv, D head dim, N tokens of all sequences packed.

The model (``minikv.model.Model``) never knows which cache it runs on. For every pass it opens
a *step*, and per layer hands the cache its new keys and values and asks it to attend::

    with cache.step(seq_ids, num_new) as positions:    # positions: [N]
        cache.write(layer, k, v)                        # k, v: [N, Hkv, D], keys already rotated
        out = cache.attend(layer, q)                    # q: [N, Hq, D] -> [N, Hq, D]

``NoCache`` below honours that seam while remembering nothing: each pass carries each
sequence's whole history, whose K/V it attends causally and then forgets.

Run it: ``python -m minikv.textbook.s1_attention`` (SmolLM2, greedy, against the engine's
``minikv.kv_cache.NoCache``).
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """``exp(x - max) / sum(exp(x - max))`` along ``axis``; same shape and dtype as ``x``.

    Subtracting the maximum cancels in the ratio and keeps ``exp`` from overflowing. A row that
    is all -inf (every key masked) gives zeros, not 0/0 = NaN: its max is clamped to the lowest
    finite float (so ``exp`` gives 0) and its sum away from 0. An axis of length 0 gives an
    empty array.
    """
    m = np.maximum(np.max(x, axis=axis, keepdims=True, initial=-np.inf), np.finfo(x.dtype).min)
    e = np.exp(x - m)
    return e / np.maximum(np.sum(e, axis=axis, keepdims=True), np.finfo(x.dtype).tiny)


def kv_head_of(num_heads: int, num_kv_heads: int) -> np.ndarray:
    """Grouped-query attention: query head h reads KV head ``h // g``, g = Hq / Hkv. Returns [Hq].

    Hkv == Hq is multi-head attention (MHA), Hkv == 1 multi-query attention (MQA).
    """
    return np.arange(num_heads) // (num_heads // num_kv_heads)


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Scaled dot-product attention with a causal mask and GQA.

    q: [Hq, T, D], k, v: [Hkv, S, D] -> [Hq, T, D]. The T queries are the *last* T of the S
    positions: query t sits at position S - T + t and sees keys 0 .. S - T + t (the lower
    triangle when T == S; nothing masked when T == 1).
    """
    t, s, d = q.shape[1], k.shape[1], q.shape[2]
    kv = kv_head_of(q.shape[0], k.shape[0])
    scores = q @ k[kv].transpose(0, 2, 1) * q.dtype.type(1 / np.sqrt(d))  # [Hq, T, S]
    visible = np.arange(s)[None, :] <= np.arange(s - t, s)[:, None]      # [T, S]
    return softmax(np.where(visible, scores, -np.inf)) @ v[kv]


class NoCache:
    """Remembers nothing: every pass must bring each sequence's whole history (positions 0..T-1)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int):
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim

    def add_sequence(self, seq_id) -> None:
        pass

    def length(self, seq_id) -> int:
        return 0  # nothing is kept, so the caller feeds everything again

    @contextmanager
    def step(self, seq_ids, num_new):
        self.starts = np.cumsum([0, *num_new])  # sequence i owns packed rows starts[i]:starts[i+1]
        self.k, self.v = {}, {}                  # this pass's K/V, forgotten when the next one opens
        yield np.concatenate([np.arange(n) for n in num_new])

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        self.k[layer], self.v[layer] = k, v

    def attend(self, layer: int, q: np.ndarray) -> np.ndarray:
        out = np.empty_like(q)
        for a, b in zip(self.starts[:-1], self.starts[1:]):
            heads_first = [x[a:b].transpose(1, 0, 2) for x in (q, self.k[layer], self.v[layer])]  # [H, T, D]
            out[a:b] = causal_attention(*heads_first).transpose(1, 0, 2)
        return out


def greedy(model, cache, prompt_ids, max_new_tokens: int) -> list[int]:
    """Greedy decoding of one sequence through any cache that honours the seam; returns the new ids.

    Each pass feeds the tokens the cache does not hold yet: all of them for ``NoCache``, only the
    newest one for a cache that remembers (step 2). It stops at the model's end-of-sequence token.
    """
    cache.add_sequence(0)
    ids, new, eos = list(prompt_ids), [], model.config.eos_token_id
    while len(new) < max_new_tokens and (not new or new[-1] != eos):
        logits = model.forward([ids[cache.length(0):]], cache)[0]
        new.append(int(np.argmax(logits)))
        ids.append(new[-1])
    return new


def main(max_new_tokens: int = 16):
    from minikv.textbook.demo import demo, engine, greedy_with

    return demo("step 1, no cache", greedy_with(greedy, lambda model, n: NoCache(**model.new_cache_args())),
                engine(cache="none"), max_new_tokens)


if __name__ == "__main__":
    main()
