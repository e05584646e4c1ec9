"""Typed exceptions for minikv and minikv_gpu.

Every public entry point validates its input and raises one of these. Each
message names the offending value and says how to fix it. Catch
``MinikvError`` to catch them all; each class also derives from the matching
built-in (``ValueError``, ``KeyError``, ...) so generic handlers still work.
"""

from __future__ import annotations

import math
import numbers
import os
from time import monotonic


class MinikvError(Exception):
    """Base class of every error raised on purpose by minikv."""


# --- bad input -----------------------------------------------------------------

class ShapeError(MinikvError, ValueError):
    """An array has the wrong number of dimensions or a wrong size."""


class DTypeError(MinikvError, TypeError):
    """An array has a dtype the function does not accept."""


class InvalidInputError(MinikvError, ValueError):
    """A value is out of its allowed range (empty prompt, token id >= vocab, top_p > 1...)."""


class ConfigError(MinikvError, ValueError):
    """A model or cache configuration is inconsistent (e.g. heads not divisible by kv heads)."""


# --- caches and sequences ------------------------------------------------------

class UnknownSequenceError(MinikvError, KeyError):
    """A sequence id that the cache or scheduler has never seen (or already freed)."""

    def __str__(self) -> str:  # KeyError would otherwise print the message in quotes
        return str(self.args[0]) if self.args else ""


class CacheFullError(MinikvError):
    """Appending would exceed the cache's capacity. Nothing was written."""


class OutOfBlocksError(CacheFullError):
    """The paged block pool has no free block left. Nothing was allocated."""


# --- model files -----------------------------------------------------------------

class ModelFileNotFoundError(MinikvError, FileNotFoundError):
    """The GGUF model file could not be located. The message says how to get it."""


class ModelFormatError(MinikvError, ValueError):
    """The model file exists but is corrupt, truncated or of an unsupported architecture."""


# --- GPU wing --------------------------------------------------------------------

class BackendUnavailableError(MinikvError, RuntimeError):
    """The requested kernel backend (cupy or sim) cannot run on this machine."""


class KernelCompileError(MinikvError, RuntimeError):
    """A .cu source failed to compile (nvrtc/nvcc on a GPU, g++ in the simulator)."""


class KernelLaunchError(MinikvError, ValueError):
    """A launch was malformed: wrong argument count, kind or size, bad grid/block."""


class KernelFaultError(MinikvError, RuntimeError):
    """A kernel misbehaved while running: out-of-bounds access, stack overflow,
    a shuffle reading an exited lane, or a deadlock at a barrier."""


class KernelDeadlockError(KernelFaultError):
    """Threads of a block wait on each other forever (e.g. a barrier not reached by all)."""


# --- the one validator for integers, floats and choices ----------------------------

def check_int(name: str, val, *, minimum: int | None = 1, maximum: int | None = None,
              error: type[MinikvError] = ConfigError, hint: str = "") -> int:
    """``val`` as a Python int, or ``error`` naming ``name``, the value and the allowed range.

    ``True``/``False`` are refused (``bool`` is an ``int`` in Python, never a count here);
    NumPy integers are accepted. ``minimum``/``maximum`` are inclusive (None: unbounded).
    """
    lo = "-inf" if minimum is None else minimum
    hi = "inf" if maximum is None else maximum
    fix = f"; {hint}" if hint else ""
    if isinstance(val, bool) or not isinstance(val, numbers.Integral):
        raise error(f"{name}={val!r} must be an integer in [{lo}, {hi}]{fix}")
    if (minimum is not None and val < minimum) or (maximum is not None and val > maximum):
        raise error(f"{name}={val!r} is outside [{lo}, {hi}]{fix}")
    return int(val)


def check_float(name: str, val, *, positive: bool = True, error: type[MinikvError] = ConfigError,
                hint: str = "") -> float:
    """``val`` as a Python float, or ``error`` naming ``name`` and the value: a real number (NumPy
    floats and ints accepted, ``bool`` refused), finite, and > 0 when ``positive``."""
    fix = f"; {hint}" if hint else ""
    if isinstance(val, bool) or not isinstance(val, numbers.Real):
        raise error(f"{name}={val!r} must be a {'positive ' if positive else ''}real number{fix}")
    if not math.isfinite(val) or (positive and val <= 0):
        raise error(f"{name}={val!r} must be {'a positive' if positive else 'a'} finite number{fix}")
    return float(val)


def check_choice(name: str, val, choices, *, error: type[MinikvError] = ConfigError):
    """``val`` if it is one of ``choices``, else ``error`` listing them."""
    if val not in tuple(choices):
        raise error(f"{name}={val!r} is not one of {', '.join(repr(c) for c in choices)}")
    return val


# --- memory: the one check before an allocation a user's number sizes ------------------------

# The system's answer is kept this long (monotonic clock): a decode step checks its positions against it, and
# reading /proc/meminfo costs about 25 us, as much as a small step's whole bookkeeping. A request far past the
# memory is still refused: within half a second the answer moves by what was allocated meanwhile, no more.
MEMORY_ANSWER_S = 0.5
_memory_answer = [-math.inf, None]  # [monotonic() when read, bytes]


def available_memory_bytes() -> int | None:
    """RAM the system can give without swapping: /proc/meminfo's MemAvailable, else physical RAM, else None;
    read at most once per ``MEMORY_ANSWER_S`` seconds (the last answer is returned in between)."""
    now = monotonic()
    if now - _memory_answer[0] >= MEMORY_ANSWER_S:
        _memory_answer[:] = [now, _read_available_memory()]
    return _memory_answer[1]


def _read_available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file counts kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def memory_need(value: int, unit_bytes, fixed: int = 0) -> int:
    """The bytes ``value`` units of ``unit_bytes`` each (rounded up) take, plus ``fixed``: what ``check_memory``
    compares with the memory available."""
    return fixed + int(value) * math.ceil(unit_bytes)


def check_memory(name: str, value: int, unit_bytes, *, what: str, fixed: int = 0, have: int | None = None,
                 error: type[MinikvError] = ConfigError, hint: str = "") -> None:
    """Refuse, before allocating it, what ``value`` units of ``unit_bytes`` bytes each (plus ``fixed``) would take
    when that is more than the memory available now (``have``, default ``available_memory_bytes()``).

    ``error`` names ``name`` (the flag, argument or file field that sized it), the bytes, and the largest
    value that fits. Python integers throughout: a product of counts never overflows. No answer about the
    memory (``have`` unknown): nothing is refused.
    """
    have = available_memory_bytes() if have is None else have
    unit = math.ceil(unit_bytes)
    need = memory_need(value, unit_bytes, fixed)
    if have is None or need <= have:
        return
    largest = max(have - fixed, 0) // unit if unit else 0
    fix = f"; {hint}" if hint else ""
    raise error(f"{name}={value:,} needs {need:,} bytes for {what}, but only {have:,} are available; the largest "
                f"{name} that fits is {largest:,}{fix}")


# --- parallel runs (minikv.parallel) -----------------------------------------------

class ParallelError(MinikvError, RuntimeError):
    """A parallel (MPI) run cannot go on: mpi4py missing, a world size that is not tp x cp, a failed rank."""


class RankFailedError(ParallelError):
    """Another rank failed a step; every other rank raises this instead of waiting in a collective."""


class CollectiveTimeoutError(ParallelError):
    """A rank waited in a collective longer than the watchdog allows: the message names the silent rank(s)."""


# --- rollback (speculative decoding) -------------------------------------------------

class RollbackError(MinikvError, RuntimeError):
    """A cache cannot take tokens back (``truncate``): the message says why (an evicting cache has
    already dropped tokens it would need, a quantized block's full-precision rows are gone, ...)."""
