"""The one yardstick every equivalence check uses.

``rel_err(got, want) = max |got - want| / max |want|``: the worst element's error, relative
to the largest value of the reference (logits, attention outputs). DESIGN.md sets the bars:
a lossless strategy must equal the full uncached recompute within ``EXACT_RTOL[dtype]``
(float64 1e-10, float32 1e-4 on logits, with identical greedy tokens), and a GPU kernel must
equal NumPy within ``KERNEL_RTOL`` (float32 1e-5).
"""

from __future__ import annotations

import numpy as np

EXACT_RTOL = {np.float64: 1e-10, np.float32: 1e-4}
KERNEL_RTOL = 1e-5


def rel_err(got, want) -> float:
    """max |got - want| / max |want| as a Python float; 0.0 for empty arrays.

    An all-zero reference divides by a tiny number instead of 0, so any error shows as huge.
    """
    got, want = np.asarray(got), np.asarray(want)
    if want.size == 0:
        return 0.0
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))
