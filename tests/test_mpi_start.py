"""Start-up under mpiexec (issue 25): ranks join MPI before any check, agree on refusals (one line, printed
by rank 0, naming the rank), refuse ranks that parsed other arguments, and bound the start-up wait.

Each case is one ``mpiexec -n 2`` run of ``minikv.cli.main`` with a command line per rank.
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.test_cli_reliability import tiny_gguf  # noqa: F401  (the fixture)
from tests.test_parallel import mpirun

# each rank joins MPI (MPI_Init waits for every rank), then naps (a slow or stuck rank), then runs its argv
PER_RANK = ("import json, os, sys, time; from mpi4py import MPI; r = int(os.environ['PMI_RANK']); "
            "argv, nap = json.loads(sys.argv[1])[r]; time.sleep(nap); from minikv.cli import main; "
            "sys.exit(main(argv))")


def run_ranks(per_rank: list, env: dict | None = None, script: str = PER_RANK, timeout: float = 120):
    """``mpiexec -n len(per_rank) python -c script``; rank r reads its entry of ``per_rank`` from argv[1]."""
    return mpirun(len(per_rank), sys.executable, "-c", script, json.dumps(per_rank), timeout=timeout, env=env)


def errors(stderr: str) -> list[str]:
    assert "Traceback" not in stderr, stderr[-3000:]
    return [line for line in stderr.splitlines() if line.startswith("minikv")]


def generate(model: str, *extra: str) -> list[str]:
    return ["generate", "--model", model, "--prompt", "hello", "--max-new-tokens", "3", "--greedy", "--tp", "2",
            *extra]


def test_a_rank_that_refuses_its_input_ends_every_rank_in_one_line(tiny_gguf, tmp_path):  # noqa: F811
    r = run_ranks([[generate(tiny_gguf), 0], [generate(str(tmp_path / "absent.gguf")), 0]])
    assert r.returncode == 2
    (line,) = errors(r.stderr)
    assert "rank 1 of 2 refused" in line and "does not exist" in line


def test_a_bad_flag_on_one_rank_is_agreed_too(tiny_gguf):  # noqa: F811
    r = run_ranks([[generate(tiny_gguf, "--top-k", "nope"), 0], [generate(tiny_gguf), 0]])
    assert r.returncode == 2
    (line,) = errors(r.stderr)
    assert "rank 0 of 2 refused" in line and "--top-k" in line


@pytest.mark.parametrize("flag, value", [("--seed", "7"), ("--max-new-tokens", "2")])
def test_ranks_with_other_arguments_are_refused_before_any_collective(tiny_gguf, flag, value):  # noqa: F811
    r = run_ranks([[generate(tiny_gguf), 0], [generate(tiny_gguf, flag, value), 0]])
    assert r.returncode == 2
    (line,) = errors(r.stderr)
    assert "rank(s) 1 of 2 run with other arguments than rank 0" in line


def test_a_silent_rank_ends_the_start_up_wait_naming_it(tiny_gguf):  # noqa: F811
    r = run_ranks([[generate(tiny_gguf), 0], [generate(tiny_gguf), 30]], env={"MINIKV_MPI_TIMEOUT": "2"})
    assert r.returncode != 0
    assert any("CollectiveTimeoutError" in line and "rank(s) 1 of 2 sent nothing in 2 s" in line
               for line in errors(r.stderr)), r.stderr[-2000:]


def test_ranks_that_agree_run(tiny_gguf):  # noqa: F811
    r = run_ranks([[generate(tiny_gguf), 0], [generate(tiny_gguf), 0]])
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("hello")


def test_ranks_with_another_model_file_are_refused(tiny_gguf, tmp_path):  # noqa: F811
    from minikv.weights.random_models import random_model
    from tests.test_gguf import TINY_TOKENS, write_tiny_gguf

    other = tmp_path / "tiny.gguf"  # same shapes and name, other weights: only the checksum tells them apart
    write_tiny_gguf(other, random_model(num_layers=2, hidden_size=16, num_heads=4, num_kv_heads=2, head_dim=4,
                                        intermediate_size=12, vocab_size=len(TINY_TOKENS), max_position=64, seed=2))
    r = run_ranks([[generate(tiny_gguf), 0], [generate(str(other)), 0]])
    assert r.returncode == 2
    (line,) = errors(r.stderr)
    assert "rank(s) 1 of 2 run with other model (config or weights) than rank 0" in line
