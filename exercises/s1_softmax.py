"""Step 1, exercise ``softmax``: ``minikv.textbook.s1_attention.softmax`` with its body removed.

Every attention of the step-1 lesson calls it. Check: ``python -m exercises softmax`` (the
step-1 lesson's tests in tests/test_textbook.py run with your function in the lesson).
"""

from __future__ import annotations

import numpy as np


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """``exp(x - max) / sum(exp(x - max))`` along ``axis``; same shape and dtype as ``x``.

    x: any shape, float32 or float64; may hold -inf (a masked score) and may have 0 entries on ``axis``.

    The three rules the tests check:
    - stable: subtract the maximum along ``axis`` first (``keepdims=True``), so ``exp`` never overflows
      (softmax([1000, 1001]) must equal softmax([0, 1]));
    - a row that is entirely -inf (a fully masked query) gives zeros, not 0/0 = NaN: clamp the max
      to ``np.finfo(x.dtype).min`` and the sum to ``np.finfo(x.dtype).tiny``;
    - an axis of length 0 returns an empty array (``np.max(..., initial=-np.inf)`` avoids the error).

    Hint: 3 lines. Keep ``x``'s dtype (no float64 upcast of a float32 input).
    """
    raise NotImplementedError("write me: the stable softmax (see the docstring)")
