"""Tensor and context parallelism (minikv.parallel, minikv.parallel.context) against one process.

The MPI runs are few: one ``mpiexec -n 9`` runs every tiny case (each on the first tp x cp ranks),
one runs SmolLM2 at tp = 2, 3, 9 (``model``), and short ones check faults and the CLI. Each runs
with a timeout in its own process group, on this machine only (``-launcher fork``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from minikv.bench.equivalence import assert_close
from minikv.cli import main
from minikv.errors import ConfigError, ParallelError
from minikv.generate import generate, make_cache
from minikv.parallel import ParallelModel, head_plan, imbalance, split_even
from tests.conftest import missing
from tests.parallel_worker import build_model, dump_weights, save_checkpoint, teacher_forced

ROOT = Path(__file__).resolve().parents[1]
WORKER = str(ROOT / "tests" / "parallel_worker.py")
RTOL = {"float64": 1e-10, "float32": 1e-5}  # the bars for a lossless split

GQA = dict(kind="gqa", num_heads=9, num_kv_heads=3, hidden_size=36, intermediate_size=50, vocab_size=97)
MQA = dict(kind="gqa", num_heads=6, num_kv_heads=1, head_dim=6, hidden_size=30, intermediate_size=40, vocab_size=89)
MLA = dict(kind="mla")
MLA_QLORA = dict(kind="mla", mla=dict(q_lora_rank=7))
DEVICE_MLA = dict(kind="mla", mla=dict(kv_lora_rank=16, qk_rope_head_dim=8))  # the GPU kernel's multiples of 8
IDS = [5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 14, 50]  # 12 tokens: 12 / cp is whole for cp = 1, 2, 3
PROMPT, NEW = [7, 1, 42, 19], 8                   # generation fills 4 + 8 = 12 slots too


def _case(name, model, dtype, tp, cp=1, cache="contiguous", **extra):
    return dict(name=name, model=model, dtype=dtype, tp=tp, cp=cp, cache=cache, ids=IDS, prefill=5,
                prompt=PROMPT, new=NEW, **extra)


TINY = [_case(f"gqa-{dt}-tp{tp}", GQA, dt, tp) for dt in ("float64", "float32") for tp in (1, 2, 3, 9)] + [
    _case("gqa-paged-tp2", GQA, "float64", 2, cache="paged", block_size=3),
    _case("gqa-paged-tp9", GQA, "float64", 9, cache="paged", block_size=4),
    _case("gqa-fp8-tp3", GQA, "float64", 3, cache="paged", options=dict(kv_dtype="fp8", group=8)),
    _case("gqa-window-tp2", GQA, "float64", 2, cache="window", options=dict(eviction=dict(window=5, sinks=1))),
    _case("gqa-window-tp9", GQA, "float64", 9, cache="window", options=dict(eviction=dict(window=5, sinks=1))),
    _case("mqa-tp3", MQA, "float64", 3),
    _case("mla-qlora-tp3", MLA_QLORA, "float64", 3),
    _case("mla-tp3-cp3", MLA, "float64", 3, cp=3),
    _case("mla-paged-cp2", MLA, "float64", 1, cp=2, cache="paged", block_size=2),
    _case("mla-float32-cp3", MLA, "float32", 1, cp=3),
] + [_case(f"mla-cp{cp}", MLA, "float64", 1, cp=cp) for cp in (1, 2, 3)]


def mpiexec() -> str:
    """The mpiexec of the ``parallel`` extra (the mpich wheel puts it next to python), else PATH's."""
    here = Path(sys.executable).with_name("mpiexec")
    found = str(here) if here.exists() else shutil.which("mpiexec")
    if found is None:
        missing('mpiexec not found; install the parallel extra: pip install -e ".[parallel]" (mpi4py, mpich)',
                "MINIKV_REQUIRE_MPI")
    return found


def mpirun(n: int, *args: str, timeout: float = 150, env: dict | None = None) -> subprocess.CompletedProcess:
    """``mpiexec -n n ARGS`` on this machine, in its own process group, killed whole after ``timeout``."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        missing('mpi4py is not installed; install the parallel extra: pip install -e ".[parallel]"',
                "MINIKV_REQUIRE_MPI")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", **(env or {})}
    cmd = [mpiexec(), "-launcher", "fork", "-n", str(n), *args]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"{' '.join(cmd)} still ran after {timeout} s (a hang in a collective?)\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def run_cases(cases: list[dict], folder: Path, world: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cases.json").write_text(json.dumps(cases))
    r = mpirun(world, sys.executable, WORKER, "cases", str(folder / "cases.json"), str(folder))
    assert r.returncode == 0, r.stderr[-4000:]
    return folder


def reference(case: dict, model) -> tuple[np.ndarray, list[int]]:
    """The same case in one process: the logits teacher-forced through the same cache kind, greedy tokens."""
    opts = case.get("options", {})
    kv = make_cache(case["cache"], model, len(case["ids"]), block_size=case.get("block_size", 16), **opts)
    kv.add_sequence(0)
    logits, _ = teacher_forced(model, kv, case["ids"], case["prefill"])
    res = generate(model, case["prompt"], case["new"], cache=case["cache"], block_size=case.get("block_size", 16),
                   **opts)
    return logits, res.token_ids


def check_case(case: dict, folder: Path, model) -> dict:
    got = np.load(folder / f"{case['name']}.npz")
    want_logits, want_tokens = reference(case, model)
    assert got["logits"].dtype == want_logits.dtype
    assert_close(got["logits"], want_logits, rtol=RTOL[case["dtype"]], what=case["name"])
    assert got["tokens"].tolist() == want_tokens
    return json.loads((folder / f"{case['name']}.json").read_text())


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    return run_cases(TINY, tmp_path_factory.mktemp("tp"), world=9)


# --- the split, in one process ------------------------------------------------------------------------

def test_head_plans_keep_gqa_groups_whole_replicate_and_split_unevenly():
    # SmolLM2's 9 query / 3 KV heads
    assert [(len(h.q), len(h.kv)) for h in head_plan(9, 3, 2)] == [(6, 2), (3, 1)]
    assert [(h.q, h.kv) for h in head_plan(9, 3, 3)] == [(range(3 * i, 3 * i + 3), range(i, i + 1)) for i in range(3)]
    nine = head_plan(9, 3, 9)  # each KV head replicated 3 times, one query head per rank
    assert [h.kv.start for h in nine] == [0, 0, 0, 1, 1, 1, 2, 2, 2] and [h.q.start for h in nine] == list(range(9))
    for tp in range(1, 10):  # every query head once, and always next to the KV head it reads
        plan = head_plan(9, 3, tp)
        assert sorted(q for h in plan for q in h.q) == list(range(9))
        assert all(q // 3 in h.kv for h in plan for q in h.q)
    assert imbalance(head_plan(9, 3, 2))["attention"] == pytest.approx(6 / 4.5)
    assert imbalance(head_plan(9, 3, 3))["attention"] == 1.0
    assert [len(r) for r in split_even(49152, 9)] == [5462] * 3 + [5461] * 6
    with pytest.raises(ConfigError, match="tp=10 is more than the model's 9 query heads"):
        head_plan(9, 3, 10)


class FakeComm:
    """Just enough of an MPI communicator for the setup checks."""

    def __init__(self, size):
        self.size = size

    def Get_rank(self):
        return 0

    def Get_size(self):
        return self.size


def test_setup_errors_are_typed_and_name_the_fix(monkeypatch):
    model = build_model(GQA, "float64")
    with pytest.raises(ParallelError, match=r"tp=2 x cp=1 needs 2 MPI ranks, but this run has 3; start it with "
                                            r"mpiexec -n 2"):
        ParallelModel(model, tp=2, comm=FakeComm(3))
    with pytest.raises(ConfigError, match="cp=2: context parallelism stripes MLA"):
        ParallelModel(model, cp=2, comm=FakeComm(2))
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # as if the parallel extra were not installed
    with pytest.raises(ParallelError, match=r'pip install "minikv\[parallel\]"'):
        ParallelModel(model, tp=2)


def test_one_rank_is_the_model_itself():
    model = build_model(GQA, "float64")
    pm = ParallelModel(model)
    assert_close(pm.logits(IDS), model.logits(IDS), rtol=0.0)
    assert pm.trace == []  # a group of one moves nothing


# --- the MPI runs ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", TINY, ids=[c["name"] for c in TINY])
def test_tokens_and_logits_equal_one_process(tiny_runs, case):
    check_case(case, tiny_runs, build_model(case["model"], case["dtype"]))


def test_cache_bytes_per_rank_follow_the_formula(tiny_runs):
    def per_rank(name):
        return json.loads((tiny_runs / f"{name}.json").read_text())["cache_bytes"]

    kv_bytes = 2 * 2 * 8 * 12 * 8  # K and V x L x D x 12 slots x float64, per KV head
    assert per_rank("gqa-float64-tp1") == [3 * kv_bytes]
    assert per_rank("gqa-float64-tp2") == [2 * kv_bytes, kv_bytes]  # uneven: 2 + 1 KV heads
    assert per_rank("gqa-float64-tp3") == [kv_bytes] * 3
    assert per_rank("gqa-float64-tp9") == [kv_bytes] * 9  # replicated: 9 copies of 3 heads
    assert sum(per_rank("gqa-float64-tp9")) == 3 * sum(per_rank("gqa-float64-tp3"))
    latent = 2 * 12 * (11 + 4) * 8  # L x 12 tokens x (r + dr) x float64
    for cp in (1, 2, 3):
        assert per_rank(f"mla-cp{cp}") == [latent // cp] * cp
    assert per_rank("mla-qlora-tp3") == [latent] * 3  # head sharding duplicates the latent
    assert per_rank("mla-tp3-cp3") == [latent // 3] * 9
    info = json.loads((tiny_runs / "gqa-float64-tp2.json").read_text())
    assert info["imbalance"]["query_heads"] == [6, 3] and info["imbalance"]["attention"] == pytest.approx(4 / 3)


def _gqa_trace(n_tokens, hidden, layers, vocab, dtype, itemsize, ranks):
    row = ["allreduce", "tp", [n_tokens, hidden], dtype, n_tokens * hidden * itemsize]
    return ([["flag", "world", [1], "int32", 4]] + [row] * (1 + 2 * layers)
            + [["allgather", "tp", [n_tokens, vocab], dtype, n_tokens * vocab * itemsize]])


def test_collectives_equal_the_formula(tiny_runs):
    def trace(name):
        return json.loads((tiny_runs / f"{name}.json").read_text())["trace"]

    prefill, decode = trace("gqa-float32-tp3")
    assert prefill == _gqa_trace(5, 36, 2, 97, "float32", 4, 3)  # all_logits: 5 rows of logits
    assert decode == _gqa_trace(1, 36, 2, 97, "float32", 4, 3)
    assert trace("gqa-float64-tp1") == [[], []]
    dv2 = 7 + 2  # a merged state row: acc (Dv) + m + l
    _, decode = trace("mla-cp3")
    assert decode == [["flag", "world", [1], "int32", 4]] + [["allgather", "cp", [3, 1, 3, dv2], "float64",
                                                             3 * 3 * dv2 * 8]] * 2
    _, decode = trace("mla-tp3-cp3")
    row = ["allreduce", "tp", [1, 36], "float64", 36 * 8]
    layer = [["allgather", "cp", [3, 1, 1, dv2], "float64", 3 * dv2 * 8], row, row]
    assert decode == [["flag", "world", [1], "int32", 4], row] + layer * 2 + [
        ["allgather", "tp", [1, 97], "float64", 97 * 8]]


@pytest.mark.model
def test_smollm2_tp_2_3_9_equals_one_process(smollm2, tmp_path):
    model = smollm2[0]
    folder = dump_weights(model, tmp_path / "weights")  # memory-mapped by the ranks: each copies its share
    ids = [1, 504, 3458, 314, 4649, 28, 7]
    spec = dict(kind="weights", folder=str(folder))
    cases = [dict(name=f"smollm2-tp{tp}", model=spec, dtype="float32", tp=tp, cp=1, cache="contiguous", ids=ids,
                  prefill=5, prompt=ids[:5], new=3) for tp in (9, 3, 2, 1)]
    try:
        out = run_cases(cases, tmp_path, world=9)
    finally:
        shutil.rmtree(folder)  # 540 MB
    for case in cases:
        info = check_case(case, out, model)
        kv_heads = info["imbalance"]["kv_heads"]  # 2 + 1, 1 + 1 + 1, or 9 x 1 (replicated)
        assert kv_heads == {9: [1] * 9, 3: [1] * 3, 2: [2, 1], 1: [3]}[case["tp"]]
        assert info["cache_bytes"] == [2 * 30 * h * 64 * 8 * 4 for h in kv_heads]  # K, V x L x D x 8 slots
    _, decode = json.loads((out / "smollm2-tp3.json").read_text())["trace"]
    assert decode == _gqa_trace(1, 576, 30, 49152, "float32", 4, 3)  # 60 all-reduces + embedding + logits
    assert sum(c[0] == "allreduce" for c in decode) == 61


def test_a_failing_rank_stops_every_rank_with_its_error():
    r = mpirun(3, sys.executable, WORKER, "faults", timeout=120)
    assert r.returncode != 0
    for rank in range(3):  # the bad token: rank 1 names it, the others name rank 1 and its message
        assert f"recovered on rank {rank}: length 3" in r.stderr
        assert f"exiting on rank {rank}:" in r.stderr
    assert "caught on rank 1: InvalidInputError: token id 97 in tokens[0] is outside [0, 97)" in r.stderr
    assert "caught on rank 0: RankFailedError: rank 0 stops because another rank failed the step (rank 1: " \
           "InvalidInputError: token id 97" in r.stderr
    assert "exiting on rank 2: CacheFullError" in r.stderr
    assert "exiting on rank 0: RankFailedError" in r.stderr and "(rank 2: CacheFullError" in r.stderr


def test_an_error_inside_a_layer_aborts_every_rank_instead_of_hanging():
    r = mpirun(3, sys.executable, WORKER, "abort", timeout=120)
    assert r.returncode != 0
    assert "minikv: error: rank 1: RuntimeError: attention broke on rank 1 (aborting all 3 ranks)" in r.stderr
    assert "finished" not in r.stdout


def test_the_gpu_wing_runs_each_rank_on_the_simulator(tmp_path):
    """minikv_gpu.parallel: each rank's share on its own device (here the CPU simulator), host-staged
    collectives; equal to the NumPy model in one process within the kernels' bar."""
    from minikv.bench.equivalence import KERNEL_RTOL

    r = mpirun(3, sys.executable, WORKER, "device", str(tmp_path), env={"MINIKV_GPU_BACKEND": "sim"})
    assert r.returncode == 0, r.stderr[-4000:]
    for name, spec in (("device-gqa", GQA), ("device-mla", DEVICE_MLA)):
        got = np.load(tmp_path / f"{name}.npz")
        want = build_model(spec, "float32").logits(got["ids"].tolist())
        assert_close(got["logits"], want, rtol=KERNEL_RTOL, what=name)
        assert int(got["collectives"]) == 1 + 1 + 2 * 2 + 1  # flag, embedding, 2 per layer, logits


# --- the command line -----------------------------------------------------------------------------------

def _cli(n: int, *args: str) -> subprocess.CompletedProcess:
    return mpirun(n, sys.executable, "-m", "minikv", *args, timeout=120)


def _last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {"llama": save_checkpoint(build_model(GQA, "float32"), root / "llama"),
            "deepseek": save_checkpoint(build_model(MLA, "float32"), root / "deepseek")}


@pytest.mark.parametrize("arch, flags, ranks", [("llama", ("--tp", "2"), 2), ("deepseek", ("--cp", "3"), 3)])
def test_cli_generate_and_perplexity_across_ranks_equal_one_process(capsys, tmp_path, checkpoints, arch, flags,
                                                                    ranks):
    gen = ["generate", "--model", str(checkpoints[arch]), "--prompt-ids", "1,2,3,4", "--greedy",
           "--max-new-tokens", "5", "--json"]
    assert main(gen) == 0
    want = _last_json(capsys.readouterr().out)
    r = _cli(ranks, *gen, *flags)
    assert r.returncode == 0, r.stderr
    got = _last_json(r.stdout)
    assert got["token_ids"] == want["token_ids"] and r.stdout.count('"token_ids"') == 1  # rank 0 prints
    assert len(got["cache_bytes_per_rank"]) == ranks
    assert (got["tp"], got["cp"]) == ((ranks, 1) if flags[0] == "--tp" else (1, ranks))
    ids = tmp_path / "ids.txt"
    ids.write_text(" ".join(str(i) for i in IDS))
    ppl = ["perplexity", "--model", str(checkpoints[arch]), "--ids-file", str(ids), "--prefill", "3", "--json"]
    assert main(ppl) == 0
    want = _last_json(capsys.readouterr().out)
    r = _cli(ranks, *ppl, *flags)
    assert r.returncode == 0, r.stderr
    got = _last_json(r.stdout)
    assert got["mean_nll"] == pytest.approx(want["mean_nll"], rel=1e-5) and len(got["cache_bytes_per_rank"]) == ranks


def test_cli_refuses_a_world_that_is_not_tp_ranks_on_every_rank(checkpoints):
    gen = ["generate", "--model", str(checkpoints["llama"]), "--prompt-ids", "1,2"]
    r = _cli(2, *gen, "--tp", "3")
    assert r.returncode == 2
    # every rank refuses the same way; rank 0 alone prints it (issue 25)
    assert r.stderr.count("minikv: error: ParallelError: tp=3 x cp=1 needs 3 MPI ranks, but this run has 2") == 1
    r = _cli(2, *gen)  # mpiexec without --tp: two copies of one run would each print
    assert r.returncode == 2
    assert r.stderr.count("ParallelError: this command runs on 2 MPI ranks but has no --tp or --cp; pass --tp 2") == 1
    assert r.stderr.count("minikv: error") == 1 and "rank 0 of 2 refused" in r.stderr
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "minikv", *gen, "--tp", "2"], capture_output=True, text=True, env=env,
                       timeout=120)  # no mpiexec: a world of one
    assert r.returncode == 2 and "start it with mpiexec -n 2" in r.stderr and r.stderr.count("\n") == 1
