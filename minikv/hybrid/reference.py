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

from minikv.errors import InvalidInputError, check_int
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

    def attend(self, layer: int, q: np.ndarray, sinks: np.ndarray | None = None,
               softcap: float | None = None) -> np.ndarray:
        """q: [N, Hq, D] -> [N, Hq, D]; each sequence's tokens see their own earlier tokens, within the window
        (sinks [Hq], softcap: ``minikv.online_softmax``'s options)."""
        self._check_layer(layer)
        rule = self._rules[layer]
        if rule is None:
            return super().attend(layer, q, sinks=sinks, softcap=softcap)
        step = self._check_query(layer, q)
        if self._k[layer] is None:
            raise InvalidInputError(f"attend(layer={layer}) before write(layer={layer}) in this step")
        out = np.empty_like(q)
        for i in range(len(step.seq_ids)):
            r = step.rows(i)
            k, v = self._k[layer][r].transpose(1, 0, 2), self._v[layer][r].transpose(1, 0, 2)  # [Hkv, T, D]
            q_pos = np.arange(r.stop - r.start)                                               # whole sequences
            k_pos = np.broadcast_to(q_pos, k.shape[:2])                                       # [Hkv, T]
            out[r] = attend_slots(q[r], [(k, v, k_pos)], lambda kp, q_pos=q_pos: rule.visible(q_pos, kp),
                                  sinks=sinks, softcap=softcap)
        return out
