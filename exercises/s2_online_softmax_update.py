"""Step 2, exercise ``online_softmax_update``: ``minikv.textbook.s2_kv_cache.online_softmax_update``, body removed.

Every cache of the lessons from step 2 on attends through it, tile by tile.
Check: ``python -m exercises online_softmax_update``.
"""

from __future__ import annotations

import numpy as np


def online_softmax_update(m: np.ndarray, l: np.ndarray, acc: np.ndarray, scores: np.ndarray,
                          values: np.ndarray, mask: np.ndarray) -> tuple:
    """Fold one tile of K keys into the running state; return the new (m, l, acc).

    m, l:   [..., Q] running max of the scores seen so far, running sum of exp(score - m)
            (before the first tile: m = -inf, l = 0)
    acc:    [..., Q, D] running sum of exp(score - m) * value (before the first tile: 0)
    scores: [..., Q, K] this tile's already scaled scores;  values: [..., K, D] its value rows
    mask:   bool [Q, K] (broadcast against scores): False = that query may not see that key

    The math (FlashAttention's online softmax):
        m'   = max(m, max_k s_k)                        (per query row)
        p    = exp(s - m')                              [..., Q, K]
        l'   = exp(m - m') * l   + sum_k p
        acc' = exp(m - m') * acc + p @ values
    Edge cases the tests check:
    - masked scores count as -inf;
    - a row that has seen no visible key yet has m' = -inf: subtract ``np.maximum(m', np.finfo(m.dtype).min)``
      instead of m' itself, so exp(-inf - -inf) = NaN never happens (it gives exp(-inf) = 0);
    - a value row that *no* query of the tile may see can hold NaN (a stale slot): set it to 0
      before ``p @ values`` (0 * NaN is NaN). ``np.any(mask, axis=-2)`` says which keys someone sees.
    Keep the dtype of ``scores``. Hint: about 7 lines.
    """
    raise NotImplementedError("write me: the online-softmax update (see the docstring)")
