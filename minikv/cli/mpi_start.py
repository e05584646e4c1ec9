"""Under ``mpiexec``: every rank joins MPI before it checks anything, and the ranks agree at start-up.

Without this, a rank that refuses its input (a model file missing on one node, a bad flag) exits at
once and leaves the others waiting in their first collective for ever, and ranks that parsed other
arguments (another ``--seed``, ``--max-new-tokens`` or prompt) run on with garbage or hang.

The rule: each rank calls ``agree`` exactly once before its first collective, either on the way to
building its share of the model (``minikv.cli.parallel.runner_of``, with a digest of its parsed
arguments and of its model: config and a weight checksum) or from ``minikv.cli.main``'s error
handler (with its refusal). The ranks exchange what they bring; if any refused, or if the digests
differ, every rank raises the same ``ParallelError`` and rank 0 alone prints it, naming the rank.
The exchange is point to point with a deadline (``MINIKV_MPI_TIMEOUT`` seconds, default 600: it
covers the slowest rank's model load), so a silent rank ends in ``CollectiveTimeoutError`` naming
it instead of a hang. The collectives of the run itself wait under the same deadline
(``minikv.parallel.watchdog``).
"""

from __future__ import annotations

import hashlib
import json
import os
import time

import numpy as np

from minikv.errors import CollectiveTimeoutError, ParallelError
from minikv.parallel.watchdog import TIMEOUT_ENV, timeout_s

_TAG = 25_001  # the start-up exchange's messages (apart from any other point-to-point traffic)
_state: dict = {"comm": None, "done": False}


def launched_ranks() -> int:
    """How many ranks mpiexec started, from its environment (MPICH's PMI_SIZE, Open MPI's), without MPI."""
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 1


def join():
    """COMM_WORLD when mpiexec started more than one rank (before any check), else None. Ranks other
    than 0 then print nothing but error lines (``minikv.parallel.tensor.quiet_output``)."""
    if launched_ranks() <= 1:
        return None
    from minikv.parallel.collectives import mpi_world
    from minikv.parallel.tensor import quiet_output

    comm = mpi_world()
    _state.update(comm=comm, done=False)
    if comm.Get_rank() != 0:
        quiet_output()
    return comm


def silent() -> bool:
    """Whether this rank leaves the printing of an agreed refusal to rank 0."""
    return _state["comm"] is not None and _state["comm"].Get_rank() != 0


def digest(args, model) -> tuple[str, str]:
    """(arguments, model) digests: the parsed flags but --model's path, and the config with a checksum of
    every weight (its float64 sum and every 97th value's bytes: one cheap pass; weights that differ
    almost surely change the sum, though the checksum is no proof of equality)."""
    # --model's path may differ between nodes (a local copy each): the model is compared by its content
    flags = {k: v for k, v in sorted(vars(args).items()) if k not in ("func", "model")}
    h_args = hashlib.sha256(json.dumps(flags, sort_keys=True, default=repr).encode()).hexdigest()[:16]
    h = hashlib.sha256(repr(model.config).encode())
    w = model.weights
    for a in [w.embed, w.final_norm, w.lm_head, *(v for lw in w.layers for v in vars(lw).values())]:
        if isinstance(a, np.ndarray):
            h.update(np.float64(np.sum(a, dtype=np.float64)).tobytes())
            h.update(np.ascontiguousarray(a.reshape(-1)[::97]).tobytes())
    return h_args, h.hexdigest()[:16]


def agree(error: str | None, digests: tuple | None = None) -> None:
    """This rank's start-up report (a refusal, or its digests); returns once every rank reported and none
    refused and all digests match, else raises the same ParallelError on every rank. Once per run."""
    comm = _state["comm"]
    if comm is None or _state["done"]:
        return
    _state["done"] = True
    reports = _exchange(comm, (None if error is None else error[:2000], digests), timeout_s())
    verdict = _verdict(reports, comm.Get_size())
    if verdict is not None:
        verdict.startup_agreed = True  # every rank raises it: rank 0 alone prints it (silent_about)
        raise verdict


def silent_about(error: Exception) -> bool:
    """Whether this rank leaves ``error`` to rank 0: a refusal every rank agreed on at start-up."""
    return silent() and getattr(error, "startup_agreed", False)


def _verdict(reports: list, size: int) -> ParallelError | None:
    """The error every rank raises for these start-up reports, or None when all may go on."""
    refused = [r for r, (e, _) in enumerate(reports) if e is not None]
    if refused:
        more = f" (rank(s) {', '.join(map(str, refused[1:]))} refused too)" if len(refused) > 1 else ""
        return ParallelError(f"rank {refused[0]} of {size} refused: {reports[refused[0]][0]}{more}")
    for i, what in enumerate(("arguments", "model (config or weights)")):
        odd = [r for r, (_, d) in enumerate(reports) if d[i] != reports[0][1][i]]
        if odd:
            return ParallelError(f"rank(s) {', '.join(map(str, odd))} of {size} run with other {what} than rank 0; "
                                "every rank must get the same command line and the same model file")
    return None


def _exchange(comm, item, timeout: float) -> list:
    """Every rank's ``item``, in rank order, on every rank: sent to rank 0, which answers all. Each wait is
    polled against the deadline; CollectiveTimeoutError names the ranks still silent."""
    rank, size = comm.Get_rank(), comm.Get_size()
    deadline = time.monotonic() + timeout
    if rank == 0:
        got, pending = {0: item}, {r: comm.irecv(source=r, tag=_TAG) for r in range(1, size)}
        while pending:
            for r, req in list(pending.items()):
                done, val = req.test()
                if done:
                    got[r] = val
                    del pending[r]
            if pending and time.monotonic() > deadline:
                raise CollectiveTimeoutError(
                    f"rank(s) {', '.join(map(str, pending))} of {size} sent nothing in {timeout:g} s at start-up "
                    f"(stopped, or slower than ${TIMEOUT_ENV}); raise ${TIMEOUT_ENV} for slow model loads")
            time.sleep(0.005)
        reports = [got[r] for r in range(size)]
        for r in range(1, size):
            comm.send(reports, dest=r, tag=_TAG + 1)
        return reports
    sent, req = comm.isend(item, dest=0, tag=_TAG), comm.irecv(source=0, tag=_TAG + 1)
    while True:
        done, reports = req.test()
        if done:
            sent.wait()
            return reports
        if time.monotonic() > deadline:
            raise CollectiveTimeoutError(f"rank 0 of {size} did not answer in {timeout:g} s at start-up; raise "
                                         f"${TIMEOUT_ENV} for slow model loads")
        time.sleep(0.005)


# MPICH's Hydra forwards a rank's stderr through its proxy, and MPI_Abort tears the job down at once: a line
# still in the proxy's pipe is lost. Without a pause, 4 of 12 runs of tests/test_mpi_start.py printed nothing
# at all, not even MPICH's own abort line; the refusal is printed and flushed first, then the job waits this long.
FORWARD_S = 0.5


def abort_after(error: Exception) -> None:
    """A start-up wait that timed out: end every rank of the job (the silent one may never return), once
    the launcher has had ``FORWARD_S`` to pass the refusal line on."""
    comm = _state["comm"]
    if comm is not None and isinstance(error, CollectiveTimeoutError):
        time.sleep(FORWARD_S)
        comm.Abort(2)
