"""NumPy's BLAS threads: how many OpenBLAS runs, and setting that number.

``minikv.layers.linear`` shares a thin product's rows among as many threads as OpenBLAS uses, so the
two numbers must agree: ``set_threads`` is the one knob for both (``OPENBLAS_NUM_THREADS`` at start-up
sets the first value, as OpenBLAS reads it). Only OpenBLAS, the BLAS that NumPy's wheels ship, is looked
for, among the libraries this process has loaded (``/proc/self/maps``, so Linux). Elsewhere (Accelerate,
MKL, another OS) ``threads()`` says 1 and thin products run on the calling thread alone.
"""

from __future__ import annotations

import ctypes
import functools

from minikv.errors import BackendUnavailableError, InvalidInputError, check_int

# OpenBLAS's thread getter and setter, by the names its builds export: scipy-openblas (NumPy's wheels,
# 64-bit integers with a suffix), then a system OpenBLAS.
_PREFIXES = ("scipy_openblas", "openblas")
_SUFFIXES = ("64_", "")


@functools.cache
def _openblas() -> tuple | None:
    """(get_num_threads, set_num_threads) of the OpenBLAS NumPy loaded, or None where none is found."""
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "openblas" in line.lower() and ".so" in line})
    except OSError:
        return None
    for path in paths:
        lib = ctypes.CDLL(path)
        for prefix in _PREFIXES:
            for suffix in _SUFFIXES:
                get = getattr(lib, f"{prefix}_get_num_threads{suffix}", None)
                put = getattr(lib, f"{prefix}_set_num_threads{suffix}", None)
                if get is not None and put is not None:
                    return get, put
    return None


def threads() -> int:
    """The number of threads NumPy's OpenBLAS uses now (1 where no OpenBLAS is found)."""
    found = _openblas()
    return max(1, int(found[0]())) if found else 1


def set_threads(n: int) -> None:
    """Run NumPy's matrix products, and ``linear``'s shared thin products, on ``n`` threads from now on."""
    n = check_int("threads", n, minimum=1, maximum=256, error=InvalidInputError,
                  hint="the number of cores to use")
    found = _openblas()
    if found is None:
        raise BackendUnavailableError(
            f"threads={n}: NumPy's OpenBLAS was not found among the loaded libraries, so its thread count "
            "cannot be set from here; set your BLAS's own variable (e.g. MKL_NUM_THREADS) before starting")
    found[1](n)
