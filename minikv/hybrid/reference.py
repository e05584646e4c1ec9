"""Step 9, the reference: the uncached forward of a model whose sliding layers see only their window.

``SlidingNoCache`` is step 1's ``NoCache`` (it keeps nothing; every pass carries whole sequences)
that knows each layer's window: a full layer attends causally, a sliding layer's query t sees
keys t - W + 1 .. t. It is what ``Model.logits`` runs for such a model, the exact reference every
hybrid cache must equal (float64 1e-10), and what transformers' Gemma-3 computes: its sliding
mask is ``kv_idx > q_idx - sliding_window`` on top of the causal one (``masking_utils``).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from minikv.errors import check_int
from minikv.kv_cache import NoCache
from minikv.window.ring import WindowPolicy, attend_slots


class SlidingNoCache(NoCache):
    """``NoCache`` with a window per layer.

    windows: [L] the window W of each layer, None for a full-attention layer
    """

    def __init__(self, windows: Sequence[int | None], num_kv_heads: int, head_dim: int, dtype=np.float32):
        super().__init__(len(windows), num_kv_heads, head_dim, dtype)
        self.layer_windows = tuple(None if w is None else check_int(f"windows[{i}]", w) for i, w in enumerate(windows))
        # WindowPolicy.visible is the rule "k <= q and q - k < W": the ring's, written once (minikv.window.ring)
        self._rules = [None if w is None else WindowPolicy(w) for w in self.layer_windows]

    def _attend_sequence(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, sinks, softcap):
        """One whole sequence: q [T, Hq, D], k/v [Hkv, T, D] -> [T, Hq, D]; a full layer causally (step 1's),
        a sliding layer's query t over keys t - W + 1 .. t (sinks [Hq], softcap: ``minikv.online_softmax``'s)."""
        rule = self._rules[layer]
        if rule is None:
            return super()._attend_sequence(layer, q, k, v, sinks, softcap)
        q_pos = np.arange(q.shape[0])                  # whole sequences: query t is at position t
        k_pos = np.broadcast_to(q_pos, k.shape[:2])    # [Hkv, T]
        return attend_slots(q, [(k, v, k_pos)], lambda kp: rule.visible(q_pos, kp), sinks=sinks, softcap=softcap)
