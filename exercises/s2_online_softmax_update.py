"""Step 2, exercise ``online_softmax_update``: fold one tile of keys into the running softmax.

Reference: ``minikv.online_softmax.update``. Every attention in minikv (contiguous, paged, window,
MLA) calls it tile by tile. Check: ``python -m exercises online_softmax_update``.
"""

import numpy as np

from minikv.online_softmax import State


def update(state: State, scores: np.ndarray, values: np.ndarray, mask: np.ndarray | None = None,
           overwrite: bool = False) -> State:
    """Fold one tile into ``state`` (modify it in place) and return it.

    state:  State(m [..., Q], l [..., Q], acc [..., Q, D], seen): running max, running sum of
            exp(s - m), running sum of exp(s - m) * v; ``seen`` is False before the first tile
            (then m = -inf, l = 0, acc = 0).
    scores: [..., Q, K] already scaled scores of this tile's keys
    values: [..., K, D] this tile's value rows (``p @ values`` broadcasts)
    mask:   None, or bool broadcastable to ``scores``: False = that query may not see that key.
    overwrite: you may scribble on ``scores`` (an optimisation; ignoring it is fine).

    The math (FlashAttention's online softmax):
        m'   = max(m, max_k s)                      (per query row)
        p    = exp(s - m')                           [..., Q, K]
        l'   = exp(m - m') * l + sum_k p
        acc' = exp(m - m') * acc + p @ values
    Edge cases the tests check:
    - masked scores count as -inf;
    - a row that has seen no visible key yet has m = -inf: subtract ``np.maximum(m', finfo.min)``
      instead of m' itself, so exp(-inf - -inf) = NaN never happens (it gives exp(-inf) = 0);
    - a value row that *no* query of the tile may see can hold NaN (a stale slot): set it to 0
      before ``p @ values`` (0 * NaN is NaN).
    Keep the dtype of ``scores``. Hint: about 15 lines; set ``state.seen = True`` at the end.
    """
    raise NotImplementedError("write me: the online-softmax update (see the docstring)")
