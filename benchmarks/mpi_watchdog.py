"""The watchdog's cost on the happy path: a blocking MPI all-reduce against the same all-reduce watched.

``python benchmarks/mpi_watchdog.py`` launches ``mpiexec -n 2`` of itself. In one process per rank it
alternates blocks of calls of the two peers on the same data: ``Blocking.allreduce`` (below: what
``minikv.parallel.collectives.Collectives.allreduce`` was before the watchdog, a blocking
``MPI_Allreduce``) and ``Collectives.allreduce`` (``MPI_Iallreduce`` polled by the watchdog). The payload is
[1, 576] float32, SmolLM2's decode all-reduce. Before every call rank 1 busy-waits a skew of 0, 1, 5
or 60 ms while rank 0 goes straight in: rank 0 waits for rank 1, as the faster rank of a real step waits
for the slower one (the watchdog spins for 50 ms, then naps: the 60 ms skew, with 1/20 of the calls,
measures the naps). Reported per skew: the median time of one call on rank 0, both peers, and
watched / blocking.

    python benchmarks/mpi_watchdog.py [--calls 200] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "benchmarks" / "results" / "mpi_watchdog.json"
SKEWS_MS = (0.0, 1.0, 5.0, 60.0)  # the last one past the watchdog's 50 ms of spinning: it naps


def rank_run(calls: int, rounds: int, out: str) -> None:
    from mpi4py import MPI

    from minikv.parallel.collectives import Collectives

    class Blocking(Collectives):
        def allreduce(self, a):
            a = np.ascontiguousarray(a)
            got = np.empty_like(a)
            self.comm.Allreduce(a, got, op=MPI.SUM)
            self._record("allreduce", a, a.nbytes)
            return got

    comm = MPI.COMM_WORLD
    peers = {"blocking": Blocking(comm), "watched": Collectives(comm)}
    x = np.ones((1, 576), dtype=np.float32)
    times = {f"{name}@{skew:g}ms": [] for skew in SKEWS_MS for name in peers}
    for _ in range(rounds):
        for skew in SKEWS_MS:
            for name, peer in peers.items():  # alternating blocks: both peers see the same machine
                for _ in range(calls if skew < 50 else max(calls // 20, 5)):
                    if comm.Get_rank() == 1:
                        end = time.perf_counter() + skew / 1e3
                        while time.perf_counter() < end:
                            pass
                    t0 = time.perf_counter()
                    peer.allreduce(x)
                    times[f"{name}@{skew:g}ms"].append(time.perf_counter() - t0)
                peer.trace.clear()
    if comm.Get_rank() == 0:
        Path(out).write_text(json.dumps(times))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--rank-run", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_run:
        return rank_run(args.calls, args.rounds, args.out)
    from minikv.bench.machine import describe, machine_info, write_result

    mpiexec = Path(sys.executable).with_name("mpiexec")
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        subprocess.run([str(mpiexec), "-launcher", "fork", "-n", "2", sys.executable, __file__, "--rank-run",
                        "--calls", str(args.calls), "--rounds", str(args.rounds), "--out", str(out)], check=True,
                       env=env, timeout=900)
        times = json.loads(out.read_text())
    results = {}
    for skew in SKEWS_MS:
        plain, watched = (statistics.median(times[f"{n}@{skew:g}ms"]) for n in ("blocking", "watched"))
        results[f"skew_{skew:g}ms"] = {"blocking_us": 1e6 * plain, "watched_us": 1e6 * watched,
                                       "watched_over_blocking": watched / plain}
        print(f"rank 1 late by {skew:g} ms: blocking {1e6 * plain:8.1f} us, watched {1e6 * watched:8.1f} us a call "
              f"on rank 0 (watched / blocking = {watched / plain:.3f})")
    info = machine_info(("numpy", "mpi4py", "mpich"))
    payload = {
        "benchmark": "mpi_watchdog", "payload": "[1, 576] float32 all-reduce, 2 ranks",
        "calls_per_block": args.calls, "rounds": args.rounds,
        "method": "mpiexec -n 2 (-launcher fork, shared memory); one process per rank runs both peers in "
                  "alternating blocks; rank 1 busy-waits the skew before every call; median time of a call on "
                  "rank 0",
        "caveat": f"this machine has {info['cores']} cores shared with other jobs (load average below): absolute "
                  "times scatter, the ratio is the point",
        "load_average_1min": {"start": load, "end": os.getloadavg()[0]}, "results": results, "machine": info}
    print(f"{describe(info)}\nwrote {write_result(OUT, payload)}")


if __name__ == "__main__":
    main()
