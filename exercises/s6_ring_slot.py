"""Step 6, exercise ``ring_slot``: the sliding window with attention sinks.

Reference: ``minikv.window.WindowPolicy.ring_slot`` and ``.visible``. Both functions replace the
methods of that name (they get ``self``, a WindowPolicy with ``self.window`` = W slots and
``self.sinks`` = S). Check: ``python -m exercises ring_slot``.
"""

import numpy as np


def ring_slot(self, p: int) -> int:
    """The slot that token position ``p`` is written to in a ring of W slots whose first S are sinks.

    The first S positions keep slots 0..S-1 forever; every later position cycles through the
    W - S slots after them, overwriting the oldest recent token.
    Example W=6, S=2: positions 0..9 -> slots 0 1 2 3 4 5 2 3 4 5; W=4, S=0: 0 1 2 3 0 1.
    Hint: 2 lines.
    """
    raise NotImplementedError("write me: the ring's slot of position p")


def visible(self, q_pos: np.ndarray, k_pos: np.ndarray) -> np.ndarray:
    """May query position q see key position k? q_pos [T], k_pos [Hkv, K] -> bool [Hkv, T, K].

    k_pos = -1 marks an empty slot (never visible). Otherwise visible iff k <= q (causal) and
    either k is a sink (k < S) or k is among the W - S most recent tokens: q - k < W - S
    (the window counts the query's own token).
    Hint: broadcast ``k_pos[:, None, :]`` against ``q_pos[None, :, None]``; one line.
    """
    raise NotImplementedError("write me: the window's visibility rule")
