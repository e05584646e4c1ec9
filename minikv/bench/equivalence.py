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


def max_abs_err(got, want) -> float:
    """max |got - want| in float64 as a Python float; inf if ``got`` holds a NaN or an infinity."""
    got, want = np.asarray(got), np.asarray(want)
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.max(np.abs(got.astype(np.float64) - want), initial=0.0))


def tolerance(dtype) -> float:
    """The relative bar for a lossless result computed in ``dtype`` (float64 1e-10, float32 1e-4)."""
    dt = np.dtype(dtype).type
    if dt not in EXACT_RTOL:
        raise ValueError(f"no exactness bar for dtype {np.dtype(dtype)}; compare float32 or float64 results")
    return EXACT_RTOL[dt]


def assert_close(got, want, dtype=None, rtol: float | None = None, what: str = "result") -> float:
    """Assert ``rel_err(got, want) <= rtol`` (default: the bar of ``dtype``, or of ``want``'s dtype).

    On failure the message says where they differ: the worst element's index, both values,
    the error and the bar. Returns the measured relative error.
    """
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {got.shape} != reference shape {want.shape}")
    bar = tolerance(want.dtype if dtype is None else dtype) if rtol is None else rtol
    err = rel_err(got, want)
    if not err <= bar:  # also catches NaN
        diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
        worst = np.unravel_index(int(np.nanargmax(np.where(np.isnan(diff), np.inf, diff))), diff.shape)
        off = int(np.count_nonzero(~(diff <= bar * max(float(np.max(np.abs(want))), 1e-30))))
        raise AssertionError(f"{what}: relative error {err:.3g} > {bar:.0e}; worst at index {tuple(map(int, worst))}: "
                             f"got {got[worst]!r}, want {want[worst]!r} ({off} of {want.size} elements off)")
    return err
