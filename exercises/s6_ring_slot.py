"""Step 6, exercise ``ring_slot``: ``minikv.textbook.s6_window.ring_slot`` and ``visible`` with their bodies removed.

The lesson's ring cache places every token with ``ring_slot`` and masks every tile with
``visible``. Check: ``python -m exercises ring_slot``.
"""

from __future__ import annotations

import numpy as np


def ring_slot(p: np.ndarray, window: int, sinks: int) -> np.ndarray:
    """The slot each token position ``p`` ([T] ints) is written to in a ring of W = ``window`` slots
    whose first S = ``sinks`` are sinks.

    The first S positions keep slots 0..S-1 forever; every later position cycles through the
    W - S slots after them, overwriting the oldest recent token.
    Example W=6, S=2: positions 0..9 -> slots 0 1 2 3 4 5 2 3 4 5; W=4, S=0: 0 1 2 3 0 1.
    Hint: 1 line (``np.where``).
    """
    raise NotImplementedError("write me: the ring's slot of position p")


def visible(q_pos: np.ndarray, k_pos: np.ndarray, window: int, sinks: int) -> np.ndarray:
    """May query position q see key position k? q_pos [T], k_pos [K] -> bool [T, K].

    k_pos = -1 marks an empty slot (never visible). Otherwise visible iff k <= q (causal) and
    either k is a sink (k < S) or k is among the W - S most recent tokens: q - k < W - S
    (the window counts the query's own token).
    Hint: broadcast ``k_pos[None, :]`` against ``q_pos[:, None]``; 2 lines.
    """
    raise NotImplementedError("write me: the window's visibility rule")
