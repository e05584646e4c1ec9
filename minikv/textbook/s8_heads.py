"""Step 8: tensor parallelism over heads, simulated in one process. Each rank caches its own KV heads.

When a model does not fit one device, Megatron-style tensor parallelism gives each of tp ranks
(devices) the whole residual stream x: [N, H] and a *slice* of every weight. For attention the
slice is a set of heads:

* Wq, Wk, Wv are split by columns: rank r computes only its query heads and its KV heads;
* each rank attends with its heads over **its own cache**, which holds only its KV heads;
* Wo is split by rows: rank r multiplies its heads' output by its rows of Wo and gets a
  *partial* [N, H]. The sum over ranks (an **all-reduce**) is the full attention output, since
  ``attn @ Wo = sum_r attn_r @ Wo_r`` over the column blocks of attn.

A query head must sit on the rank that holds the KV head it reads, so a whole GQA group (g =
Hq / Hkv query heads) goes with its KV head. No rank ever reads another rank's K or V: **the
cache is never gathered**, only activations cross ranks, one all-reduce per layer here.

How the heads split
-------------------
* tp <= Hkv: the KV heads go in contiguous chunks whose sizes differ by at most one (larger
  first), each with its g query heads. SmolLM2 (9 query, 3 KV heads) over tp = 2: 6 + 3 query
  heads and 2 + 1 KV heads; rank 0 does twice the attention and holds twice the cache.
* tp > Hkv: the ranks go in contiguous groups over the KV heads; every rank of a group holds a
  **replica** of that KV head and a share of its query heads. tp = 9 on SmolLM2: one query head per
  rank and three copies of each KV head, 3x the KV bytes of tp = 3 in total.

The engine (``minikv.parallel``) also splits the MLP (gate/up by columns, W_down by rows: a second
all-reduce per layer) and the vocabulary, and runs each rank in its own MPI process. Here the
ranks are objects in one process, the MLP runs whole, and the all-reduce is Python's ``sum``.

Run it: ``python -m minikv.textbook.s8_heads`` (SmolLM2's 3 KV heads over 2 ranks, against the
engine's single-process generation; ``tests/test_textbook.py`` also runs ``minikv.parallel``'s
ranks in threads).
"""

from __future__ import annotations

from contextlib import ExitStack

import numpy as np

from minikv.layers import apply_rope, rms_norm
from minikv.model import mlp_block
from minikv.textbook.s2_kv_cache import ContiguousCache

# --- NEW in step 8 ---


def split_even(n: int, parts: int) -> list:
    """``n`` items in ``parts`` contiguous ranges whose sizes differ by at most one, larger first."""
    q, r = divmod(n, parts)
    bounds = np.cumsum([0] + [q + (i < r) for i in range(parts)])
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def split_heads(num_heads: int, num_kv_heads: int, ranks: int) -> list:
    """Each rank's (query heads, KV heads), as ranges of head indices (see the module docstring)."""
    g = num_heads // num_kv_heads
    if ranks <= num_kv_heads:
        return [(range(kv.start * g, kv.stop * g), kv) for kv in split_even(num_kv_heads, ranks)]
    return [(range(kv * g + q.start, kv * g + q.stop), range(kv, kv + 1))  # a replica of KV head kv
            for kv, group in enumerate(split_even(ranks, num_kv_heads)) for q in split_even(g, len(group))]


class Rank:
    """One rank: its heads' columns of Wq, Wk, Wv and rows of Wo, per layer, and a cache of its KV heads."""

    def __init__(self, model, q_heads: range, kv_heads: range, max_len: int):
        cfg, d = model.config, model.config.head_dim
        cols = lambda w, heads: w[:, heads.start * d:heads.stop * d]  # noqa: E731
        self.layers = [(lw.attn_norm, cols(lw.wq, q_heads), cols(lw.wk, kv_heads), cols(lw.wv, kv_heads),
                        lw.wo[q_heads.start * d:q_heads.stop * d]) for lw in model.weights.layers]
        self.cache = ContiguousCache(cfg.num_layers, len(kv_heads), d, 1, max_len, model.dtype)
        self.cfg = cfg

    def attention(self, layer: int, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """x: [N, H] -> this rank's partial attention output [N, H] (the all-reduce adds the others)."""
        norm, wq, wk, wv, wo = self.layers[layer]
        n, d, c = x.shape[0], self.cfg.head_dim, self.cfg
        h = rms_norm(x, norm, c.rms_eps)
        q = apply_rope((h @ wq).reshape(n, -1, d), cos, sin, c.rope_layout)  # [N, its query heads, D]
        self.cache.write(layer, apply_rope((h @ wk).reshape(n, -1, d), cos, sin, c.rope_layout),
                         (h @ wv).reshape(n, -1, d))
        return self.cache.attend(layer, q).reshape(n, -1) @ wo


class TensorParallel:
    """``model`` with its heads over ``ranks`` ranks. It serves s1's ``greedy`` as the model and as the cache."""

    def __init__(self, model, ranks: int, max_len: int):
        self.model, self.config = model, model.config
        heads = split_heads(model.config.num_heads, model.config.num_kv_heads, ranks)
        self.ranks = [Rank(model, q, kv, max_len) for q, kv in heads]

    def add_sequence(self, seq_id) -> None:
        for rank in self.ranks:
            rank.cache.add_sequence(seq_id)

    def length(self, seq_id) -> int:
        return self.ranks[0].cache.length(seq_id)

    def forward(self, tokens: list, cache=None) -> np.ndarray:
        """tokens: [new ids] of sequence 0 -> logits [1, V] of its last token (``Model.forward``'s contract)."""
        m, ids = self.model, np.asarray(tokens[0])
        with ExitStack() as steps:  # every rank opens the same step on its own cache
            positions = [steps.enter_context(rank.cache.step([0], [ids.size])) for rank in self.ranks][0]
            cos, sin, x = m.cos[positions], m.sin[positions], m.embed[ids]
            for layer, lw in enumerate(m.prepared_layers):
                x = x + sum(rank.attention(layer, x, cos, sin) for rank in self.ranks)  # the all-reduce
                x = x + mlp_block(x, lw, self.config)
        return rms_norm(x[-1:], m.final_norm, self.config.rms_eps) @ m.lm_head.T

# --- end NEW ---


def main(max_new_tokens: int = 16):
    from minikv.textbook.demo import demo, engine, one_by_one
    from minikv.textbook.s1_attention import greedy

    def two_ranks(model, ids, n):
        tp = TensorParallel(model, 2, len(ids) + n)
        return greedy(tp, tp, ids, n)

    return demo("step 8, SmolLM2's heads over 2 ranks", one_by_one(two_ranks), engine(cache="contiguous"),
                max_new_tokens)


if __name__ == "__main__":
    main()
