"""The collectives of a parallel run, over mpi4py, each one recorded; and how a failing rank stops them all.

``Collectives`` wraps an MPI communicator (or none: one process) with the three operations
``minikv.parallel`` needs: a sum all-reduce of a NumPy array, an all-gather (of equal shapes, or of
column slices of different widths: the vocabulary shards of the logits), and the one-int error
flag. Each call appends a ``Collective`` (kind, group, shape, dtype, payload bytes) to a trace that
the tests check against the formula. A group of one rank moves nothing and records nothing.

Faults. A collective waits until every rank of its group calls it, so one rank that raises
while the others go on hangs the whole job. Two defences:

* ``agree(world, err)`` at the start of every step: an Allreduce(max) of "did I fail?". If any rank
  failed, every rank raises (the failing one its own error, the others ``RankFailedError`` naming
  it and its message), before any layer collective. The error carries ``agreed = True``.
* ``abort_on_error(world)``, the backstop around a whole run: an error that is not ``agreed``
  (it happened after the check, on some ranks only) prints and calls ``MPI_Abort``, which kills
  every rank of the job instead of leaving them in a collective.

A rank that raises nothing but stops answering (stuck, stopped) is the third case: every collective
here is nonblocking and waited on by a ``Watchdog`` (``minikv.parallel.watchdog``) for at most
``$MINIKV_MPI_TIMEOUT`` seconds, then ``CollectiveTimeoutError`` names the silent rank(s), and
``abort_on_error`` prints it once (the lowest rank still answering) and ends the job.

On GPUs (planned): the same three calls over ``cupy.cuda.nccl.NcclCommunicator`` (``allReduce``,
``allGather`` on device pointers, on the compute stream), or over CUDA-aware MPI, to which mpi4py
hands CuPy arrays directly (``__cuda_array_interface__``).
"""

from __future__ import annotations

import os
import pickle
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from minikv.errors import CollectiveTimeoutError, ParallelError, RankFailedError
from minikv.parallel.watchdog import GRACE_S, Watchdog

INSTALL = 'pip install "minikv[parallel]"  (or: pip install mpi4py mpich)'


def mpi_world():
    """``mpi4py.MPI.COMM_WORLD``, or ParallelError with the install command when mpi4py is missing."""
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise ParallelError(f"tensor parallelism needs MPI, and mpi4py cannot be imported ({e}); install it with "
                            f"{INSTALL}, then run: mpiexec -n P minikv generate --tp P ...") from None
    return MPI.COMM_WORLD


# --- the collectives, each one recorded ----------------------------------------------------------

@dataclass(frozen=True)
class Collective:
    """One collective as one rank saw it: kind, group ("world", "tp", "cp"), the array's shape and dtype,
    ``bytes`` = the payload (what is reduced, or the gathered result), ``ranks`` in the group."""

    kind: str
    group: str
    shape: tuple
    dtype: str
    bytes: int
    ranks: int

    @property
    def wire_bytes(self) -> float:
        """Bytes one rank sends in a ring: 2 (p-1)/p x payload for an all-reduce, (p-1)/p for an all-gather."""
        p = self.ranks
        return (2 if self.kind == "allreduce" else 1) * (p - 1) / p * self.bytes


class Collectives:
    """Sum all-reduce, all-gather and the error flag over an mpi4py communicator (None: one process).

    A group of one rank returns its input and records nothing: nothing is moved. Each call waits at most
    ``timeout`` seconds (None: ``$MINIKV_MPI_TIMEOUT``, default 600) for the other ranks, then raises
    ``CollectiveTimeoutError`` naming the ranks that never came (``minikv.parallel.watchdog``).
    """

    def __init__(self, comm=None, name: str = "world", trace: list | None = None, timeout: float | None = None):
        self.comm, self.name = comm, name
        self.rank = 0 if comm is None else comm.Get_rank()
        self.size = 1 if comm is None else comm.Get_size()
        self.trace = [] if trace is None else trace  # shared by the groups of one model
        self.watchdog = None if self.size == 1 else Watchdog(comm, name, timeout)

    def _record(self, kind: str, a: np.ndarray, nbytes: int) -> None:
        self.trace.append(Collective(kind, self.name, tuple(a.shape), a.dtype.name, int(nbytes), self.size))

    def split(self, color: int, name: str) -> "Collectives":
        """The sub-group of the ranks with the same ``color`` (MPI Comm_split), sharing this trace."""
        sub = None if self.comm is None else self.comm.Split(color, self.rank)
        return Collectives(sub, name, self.trace, None if self.watchdog is None else self.watchdog.timeout)

    def allreduce(self, a: np.ndarray) -> np.ndarray:
        """The element-wise sum of every rank's ``a`` (same shape and dtype on every rank)."""
        if self.size == 1:
            return a
        from mpi4py import MPI

        a = np.ascontiguousarray(a)
        out = np.empty_like(a)
        self.watchdog.wait(self.comm.Iallreduce(a, out, op=MPI.SUM), "allreduce")
        self._record("allreduce", a, a.nbytes)
        return out

    def allgather(self, a: np.ndarray, widths: Sequence[int] | None = None) -> np.ndarray:
        """Every rank's ``a``: [rows, w_r] joined along the last axis (``widths`` = every w_r), or, without
        ``widths``, stacked: [size, *a.shape] (the same shape on every rank)."""
        a = np.ascontiguousarray(a)
        if self.size == 1:
            return a if widths is not None else a[None]
        if widths is None:
            out = np.empty((self.size,) + a.shape, dtype=a.dtype)
            self.watchdog.wait(self.comm.Iallgather(a, out), "allgather")
        else:
            rows = a.shape[0]
            counts = [rows * int(w) for w in widths]
            flat = np.empty(sum(counts), dtype=a.dtype)
            self.watchdog.wait(self.comm.Iallgatherv(a, [flat, counts]), "allgather")
            parts = np.split(flat, np.cumsum(counts)[:-1])
            out = np.concatenate([p.reshape(rows, int(w)) for p, w in zip(parts, widths)], axis=1)
        self._record("allgather", out, out.nbytes)
        return out

    def any_flag(self, flag: bool) -> bool:
        """True on every rank if any rank passed True (an Allreduce(max) of one int32)."""
        if self.size == 1:
            return bool(flag)
        from mpi4py import MPI

        f = np.array([int(bool(flag))], dtype=np.int32)
        out = np.empty_like(f)
        self.watchdog.wait(self.comm.Iallreduce(f, out, op=MPI.MAX), "flag")
        self._record("flag", f, f.nbytes)
        return bool(out[0])

    def gather_objects(self, obj) -> list:
        """Every rank's (small, picklable) ``obj``, in rank order; not traced (setup and reports only).
        Pickled bytes in two watched collectives: their lengths, then the bytes (an Allgatherv)."""
        if self.size == 1:
            return [obj]
        data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
        sizes = np.empty(self.size, dtype=np.int64)
        self.watchdog.wait(self.comm.Iallgather(np.array([data.size], dtype=np.int64), sizes), "gather")
        flat = np.empty(int(sizes.sum()), dtype=np.uint8)
        self.watchdog.wait(self.comm.Iallgatherv(data, [flat, sizes.tolist()]), "gather")
        return [pickle.loads(part.tobytes()) for part in np.split(flat, np.cumsum(sizes)[:-1])]


def agree(world: Collectives, err: BaseException | None) -> None:
    """Raise on every rank if any rank failed: its own error where it failed, ``RankFailedError`` elsewhere.

    One Allreduce of a flag when all is well; the messages travel only after a failure. The raised
    exception carries ``agreed = True``: every rank raises it, so it needs no abort.
    """
    if not world.any_flag(err is not None):
        return
    msgs = world.gather_objects(None if err is None else f"{type(err).__name__}: {err}")
    if err is None:
        failed = "; ".join(f"rank {r}: {m}" for r, m in enumerate(msgs) if m is not None)
        err = RankFailedError(f"rank {world.rank} stops because another rank failed the step ({failed})")
    err.agreed = True
    raise err


@contextmanager
def abort_on_error(world: Collectives):
    """The backstop: an error that not every rank raises (``agreed``) prints and aborts the communicator,
    so the other ranks, waiting in a collective, are killed instead of hanging. A ``CollectiveTimeoutError``
    (a silent rank) ends the job by ``end_after_timeout``."""
    try:
        yield
    except BaseException as e:
        if world.size == 1 or getattr(e, "agreed", False) or isinstance(e, SystemExit):
            raise
        if isinstance(e, CollectiveTimeoutError):
            end_after_timeout(world, e)
        print(f"minikv: error: rank {world.rank}: {type(e).__name__}: {e} (aborting all {world.size} ranks)",
              file=sys.stderr, flush=True)
        world.comm.Abort(1)
        raise  # MPI_Abort may return before the runtime kills this process: never carry on past the error


def end_after_timeout(world: Collectives, e: CollectiveTimeoutError) -> None:
    """End every rank after a watchdog timeout, with one line on stderr and exit code 2 (the run is refused).

    The lowest rank that answered the roll call (``e.speaker``) prints and exits; mpiexec (MPICH's Hydra,
    Open MPI's mpirun) then kills the other ranks, the silent one included, as it does whenever a rank
    exits without finalizing. An exit rather than ``MPI_Abort``: MPICH's abort adds a line of its own. The
    other ranks print nothing, give the speaker ``2 GRACE_S``, and abort the job themselves if it is
    still running then (a launcher that does not end a job on one rank's exit)."""
    speaker = getattr(e, "speaker", world.rank) == world.rank
    if speaker:
        print(f"minikv: error: rank {world.rank}: CollectiveTimeoutError: {e} (ending all {world.size} ranks)",
              file=sys.stderr, flush=True)
    else:
        time.sleep(2 * GRACE_S)
    try:
        sys.stdout.flush()  # what the run printed so far: os._exit skips Python's buffers
    except (OSError, ValueError):
        pass
    if not speaker:
        world.comm.Abort(2)
    os._exit(2)
