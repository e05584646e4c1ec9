"""The watchdog over a run's collectives (issue 25): a rank that stops answering inside a step ends the
other ranks' wait after ``$MINIKV_MPI_TIMEOUT`` seconds with one ``CollectiveTimeoutError`` line naming it.

Each case is one ``mpiexec`` run of ``minikv.cli.main``; the stuck rank is made by a test hook in the
rank's own process (below: its MLP sleeps for ten minutes at its n-th call), not by the library.
Without the watchdog the other ranks wait in ``MPI_Allreduce`` until ``mpirun``'s timeout fails the test.
"""

from __future__ import annotations

import pytest

from minikv.errors import ParallelError
from minikv.parallel.watchdog import TIMEOUT_ENV, Watchdog, timeout_s
from tests.conftest import require_module
from tests.test_cli_reliability import tiny_gguf  # noqa: F401  (the fixture)
from tests.test_mpi_start import errors, generate, run_ranks

# rank r runs argv; at its MLP call number `stall_at` (0: never) it sleeps, as a rank stuck in a step would
STALLING = """
import json, os, sys, time
from mpi4py import MPI
import minikv.parallel.tensor as tensor
argv, stall_at = json.loads(sys.argv[1])[int(os.environ["PMI_RANK"])]
calls, mlp = [0], tensor.mlp_block
def stalling(*args):
    calls[0] += 1
    if calls[0] == stall_at:
        time.sleep(600)
    return mlp(*args)
tensor.mlp_block = stalling
from minikv.cli import main
sys.exit(main(argv))
"""


def test_a_rank_stuck_inside_a_step_is_named_by_the_others_in_one_line(tiny_gguf):  # noqa: F811
    # 2 layers: MLP call 4 is the second layer of the first decode step, after 9 collectives of the run
    r = run_ranks([[generate(tiny_gguf), 0], [generate(tiny_gguf), 4]], env={TIMEOUT_ENV: "3"}, script=STALLING,
                  timeout=60)
    assert r.returncode == 2, r.stderr[-2000:]
    (line,) = errors(r.stderr)
    assert line.startswith("minikv: error: rank 0: CollectiveTimeoutError: rank(s) 1 of 2 did not reach allreduce #")
    assert "of the tp group in 3 s" in line and TIMEOUT_ENV in line


def test_a_stuck_rank_0_is_named_once_by_the_lowest_rank_still_answering(tiny_gguf):  # noqa: F811
    argv = generate(tiny_gguf)
    argv[argv.index("--tp") + 1] = "3"
    r = run_ranks([[argv, 2], [argv, 0], [argv, 0]], env={TIMEOUT_ENV: "3"}, script=STALLING, timeout=60)
    assert r.returncode != 0, r.stderr[-2000:]  # MPICH's mpiexec reports rank 0's end: killed (9), not rank 1's 2
    (line,) = errors(r.stderr)
    assert line.startswith("minikv: error: rank 1: CollectiveTimeoutError: rank(s) 0 of 3 did not reach allreduce #")


@pytest.mark.parametrize("raw", ["soon", "0", "-1", "nan", "inf"])
def test_the_deadline_must_be_a_positive_number_of_seconds(monkeypatch, raw):
    monkeypatch.setenv(TIMEOUT_ENV, raw)
    with pytest.raises(ParallelError, match=rf"\${TIMEOUT_ENV}=.* seconds a rank waits"):
        timeout_s()
    with pytest.raises(ParallelError, match=TIMEOUT_ENV):
        Watchdog(None, "world")


def test_the_default_deadline_is_ten_minutes(monkeypatch):
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert timeout_s() == 600.0


class FakeComm:
    """Rank 0 of 2, in one process: ``inbox`` holds the roll calls rank 1 sent; ``sent`` what rank 0 sends."""

    def __init__(self, inbox: list):
        self.inbox, self.sent = list(inbox), []

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 2

    def Iprobe(self, source, tag, status):
        if self.inbox:
            status.source = 1
        return bool(self.inbox)

    def recv(self, source, tag):
        return self.inbox.pop(0)

    def isend(self, obj, dest, tag):
        self.sent.append((dest, obj))
        return Done()


class Done:
    """An MPI request that completes once ``ready()`` is true."""

    def __init__(self, ready=lambda: True):
        self.ready = ready

    def Test(self):
        return self.ready()


def test_a_rank_late_past_the_deadline_but_in_time_for_the_roll_call_is_not_an_error():
    require_module("mpi4py")
    comm = FakeComm([])
    dog = Watchdog(comm, "world", timeout=0.1)
    dog.wait(Done(lambda: bool(comm.sent)), "allreduce")  # the other rank comes once the roll call went out
    assert comm.sent == [(1, (1, "allreduce"))]


def test_a_waiting_rank_answers_each_roll_call_once():
    require_module("mpi4py")
    comm = FakeComm([(4, "allgather"), (4, "allgather")])  # rank 1 asks twice where rank 0 waits
    dog = Watchdog(comm, "tp", timeout=60)
    dog.count = 3
    dog.wait(Done(lambda: not comm.inbox), "allgather")  # past the 50 ms of spinning it reads its messages
    assert comm.sent == [(1, (4, "allgather"))]
