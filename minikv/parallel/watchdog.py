"""The watchdog: how long a rank waits in a collective, and which rank(s) it waited for when it gives up.

Why
---
An MPI collective returns once every rank of its group has called it. A rank that stops answering in
the middle of a run (stuck in I/O, swapped out, stopped with SIGSTOP, looping) never calls it, and a
blocking ``MPI_Allreduce`` on the other ranks then waits for ever: MPI has no deadline of its own. (A rank
that *dies* is another matter: mpiexec sees the exit and ends the job within a second.)

How
---
Each collective is started nonblocking (``Iallreduce``, ``Iallgather``, ``Iallgatherv``) and then
polled with ``Test``: in a tight loop for ``SPIN_S`` (50 ms; a blocking wait busy-polls too, MPICH's
shared-memory transport does), yielding the core after the first ``YIELD_AFTER_S`` so that a rank sharing
it (more ranks than cores) can run, then with naps of 5% of the time waited so far, at most ``MAX_NAP_S``:
a wait that long is a prefill on another rank, and comes back at most 5% late. Measured on this 2-core
machine (``benchmarks/mpi_watchdog.py``, results in ``benchmarks/results/mpi_watchdog.json``): the
watched all-reduce takes what the blocking one takes, within the noise. Past ``timeout`` seconds the rank
holds a roll call: it tells every rank of the group which collective it waits in (a small point-to-point
message under ``ROLL_CALL_TAG``) and listens for ``GRACE_S``. A rank that waits in a collective answers
such a message at its next poll, so the ranks that stay silent are the ones that never came:
``CollectiveTimeoutError`` names them (as ``COMM_WORLD`` ranks), the collective and its number. If the
collective completes during the roll call, the rank was only slow and the wait returns normally.

The deadline is ``$MINIKV_MPI_TIMEOUT`` seconds, default 600, the same knob as the start-up exchange
(``minikv.cli.mpi_start``): it must exceed the longest honest gap between ranks, the slowest rank's
model load at start-up and, during a run, a long prefill on one rank while the others already wait
(seconds to minutes for a large prompt on a CPU); a stall is then reported within ten minutes rather
than never. After the error the group's communicator still holds the unfinished collective: the run
cannot go on, and ``abort_on_error`` (``minikv.parallel.collectives``) ends the job, printed once by
the lowest rank still answering.
"""

from __future__ import annotations

import os
import time

from minikv.errors import CollectiveTimeoutError, ParallelError, check_float

TIMEOUT_ENV = "MINIKV_MPI_TIMEOUT"
DEFAULT_TIMEOUT_S = 600.0
ROLL_CALL_TAG = 25_003  # apart from the start-up exchange's tags (25_001, 25_002)
SPIN_S = 0.05
YIELD_AFTER_S = 0.0002
MAX_NAP_S = 0.01
GRACE_S = 1.0
_yield = getattr(os, "sched_yield", lambda: time.sleep(0))  # POSIX; sleep(0) yields on the others


def timeout_s() -> float:
    """``$MINIKV_MPI_TIMEOUT`` as seconds (default ``DEFAULT_TIMEOUT_S``); ParallelError if it is not a
    positive finite number."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        val = float(raw)
    except ValueError:
        val = raw
    return check_float(f"${TIMEOUT_ENV}", val, error=ParallelError, hint="seconds a rank waits for the others")


class Watchdog:
    """Waits on one communicator's nonblocking collectives, each for at most ``timeout`` seconds.

    comm: an mpi4py communicator; name: its group's name in messages ("world", "tp", "cp");
    timeout: seconds (None: ``timeout_s()``). ``count`` numbers the collectives waited on, the same on
    every rank of a correct run: the roll call compares it.
    """

    def __init__(self, comm, name: str, timeout: float | None = None):
        self.comm, self.name = comm, name
        self.timeout = timeout_s() if timeout is None else check_float("timeout", timeout, error=ParallelError)
        self.count = 0
        self._spin = min(SPIN_S, self.timeout)
        self._heard: dict = {}     # group rank -> (count, kind) it said it waits in, during this wait
        self._told: set = set()    # group ranks this rank told where it waits, during this wait
        self._sent: list = []      # our roll-call messages still in flight (mpi4py keeps their buffers)

    def wait(self, req, kind: str) -> None:
        """Return once ``req`` (an MPI request) completes; CollectiveTimeoutError after ``timeout`` seconds."""
        self.count += 1
        start = time.monotonic()
        while not req.Test():
            waited = time.monotonic() - start
            if waited < self._spin:
                if waited > YIELD_AFTER_S:
                    _yield()  # runnable, but a rank sharing this core (oversubscribed) gets it first
                continue
            self._listen(kind)
            if waited > self.timeout:
                self._roll_call(req, kind)
                break
            time.sleep(min(0.05 * waited, MAX_NAP_S))
        if self._heard or self._told:
            self._heard, self._told = {}, set()

    def _listen(self, kind: str) -> None:
        """Read the roll calls other ranks sent and answer each once: this rank waits in ``kind`` #count."""
        from mpi4py import MPI

        status = MPI.Status()
        while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=ROLL_CALL_TAG, status=status):
            src = status.Get_source()
            said = self.comm.recv(source=src, tag=ROLL_CALL_TAG)
            self._heard[src] = said
            self._tell(src, kind)
        self._sent = [r for r in self._sent if not r.Test()]

    def _tell(self, dest: int, kind: str) -> None:
        """Tell rank ``dest`` (once per wait) which collective this rank waits in."""
        if dest not in self._told:
            self._told.add(dest)
            self._sent.append(self.comm.isend((self.count, kind), dest=dest, tag=ROLL_CALL_TAG))

    def _roll_call(self, req, kind: str) -> None:
        """Ask every rank of the group where it waits; return if ``req`` completes meanwhile, else raise."""
        me, size = self.comm.Get_rank(), self.comm.Get_size()
        for r in range(size):
            if r != me:
                self._tell(r, kind)
        end = time.monotonic() + min(GRACE_S, self.timeout)
        while time.monotonic() < end:
            if req.Test():
                return  # a slow rank, not a silent one
            self._listen(kind)
            time.sleep(0.005)
        raise self._error(kind, me, size)

    def _error(self, kind: str, me: int, size: int) -> CollectiveTimeoutError:
        """The error naming the silent ranks (and any rank found waiting in another collective)."""
        from mpi4py import MPI

        group, world = self.comm.Get_group(), MPI.COMM_WORLD.Get_group()
        to_world = dict(zip(range(size), MPI.Group.Translate_ranks(group, list(range(size)), world)))
        silent = [to_world[r] for r in range(size) if r != me and r not in self._heard]
        elsewhere = {to_world[r]: said for r, said in self._heard.items() if said != (self.count, kind)}
        answered = [to_world[r] for r in range(size) if r == me or r in self._heard]
        where = f"{kind} #{self.count} of the {self.name} group"
        text = (f"rank(s) {', '.join(map(str, silent))} of {MPI.COMM_WORLD.Get_size()} did not reach {where} "
                f"in {self.timeout:g} s (stopped, stuck, or slower than ${TIMEOUT_ENV} allows)" if silent else
                f"every rank answered, but {where} did not complete in {self.timeout:g} s")
        if elsewhere:
            text += "; waiting in another collective: " + ", ".join(
                f"rank {r} in {k} #{n}" for r, (n, k) in sorted(elsewhere.items()))
        err = CollectiveTimeoutError(f"{text}; raise ${TIMEOUT_ENV} if a step may take that long")
        err.rank, err.speaker = to_world[me], min(answered)
        return err
