"""GPU check, the last two stages: compute-sanitizer over a few GPU tests, then the GPU tests themselves.

Both run pytest in a child process that is the leader of its own process group, so a timeout kills the
whole group (compute-sanitizer's child python included, which a plain ``subprocess.run(timeout=)`` left
running). Each finished test is appended to ``OUTDIR/tests.jsonl`` the moment it finishes (the pytest
plugin ``gpu_check_results``, next to this file), so a run cut short still names every test that passed or
failed; the stage's summary is read back from that file.

Tests run in the order of their value (``TEST_ORDER``: the register-resident decode kernels first, then
paged, contiguous, window, MLA, quant, the rest), verbose, each under ``--timeout`` (pytest-timeout) and
spread over ``-n`` workers by file (pytest-xdist) where those plugins are installed, as on the lent H200's
image; without them the same run is serial and unbounded per test. The sanitized tests run with CuPy's
memory pool off (``MINIKV_CUPY_POOL=0``, ``minikv_gpu.runtime``): every array is its own allocation, so
memcheck sees a read past an array's end instead of the pool's next array.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from gpu_check_common import ROOT

TEST_ORDER = ["test_gpu_v3.py", "test_gpu_v4.py", "test_gpu_paged.py", "test_gpu_kv_cache.py", "test_gpu_window.py",
              "test_gpu_mla.py", "test_gpu_quant.py"]
SANITIZER_TESTS = ["tests/gpu/test_gpu_v4.py", "tests/gpu/test_gpu_paged.py", "-k",
                   "cupy and (v4_equals_v3 or (v2_partitions_merge_to_v1 and 32))"]
SMOKE_SELECT = "sim and (split_equals_unsplit or v4_equals_v3)"
PER_TEST_TIMEOUT_S = 120
WORKERS = 8  # pytest-xdist workers on the GPU machine (16 cores; each compiles its own NVRTC modules)


def ordered_test_files(folder: Path = ROOT / "tests" / "gpu") -> list[str]:
    """Every tests/gpu/test_*.py, the valuable ones first (TEST_ORDER), the rest by name."""
    files = sorted(p.name for p in folder.glob("test_*.py"))
    first = [f for f in TEST_ORDER if f in files]
    return [f"tests/gpu/{f}" for f in first + [f for f in files if f not in first]]


def plugins() -> dict:
    """Which optional pytest plugins this machine has: {"xdist": bool, "timeout": bool}."""
    return {name: importlib.util.find_spec(mod) is not None
            for name, mod in (("xdist", "xdist"), ("timeout", "pytest_timeout"))}


def pytest_command(select: list[str], smoke: bool) -> list[str]:
    """pytest over ``select``: verbose, the results plugin, and xdist/timeout where installed."""
    cmd = [sys.executable, "-m", "pytest", *select, "-v", "-p", "no:cacheprovider", "-p", "gpu_check_results"]
    have = plugins()
    if have["timeout"]:
        cmd += ["--timeout", str(PER_TEST_TIMEOUT_S)]
    if have["xdist"] and not smoke:
        cmd += ["-n", str(WORKERS), "--dist", "loadfile"]
    return cmd


def run_group(cmd: list[str], log: Path, timeout_s: float, env: dict | None = None, append: bool = False) -> dict:
    """Run ``cmd`` from the repository root as a process-group leader, its output into ``log``; past
    ``timeout_s`` the whole group is killed (TERM, then KILL after 5 s) and what it printed is kept."""
    env = {**os.environ, **(env or {}),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH", "")])}
    t0 = time.perf_counter()
    with log.open("a" if append else "w") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code, status = proc.wait(timeout=max(1.0, timeout_s)), None
        except subprocess.TimeoutExpired:
            code, status = None, "timed out"
            _kill_group(proc)
            f.write(f"\n[timed out after {timeout_s:.0f} s: process group {proc.pid} killed]\n")
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    status = status or ("passed" if code == 0 else "failed")
    return {"status": status, "returncode": code, "summary": (lines[-1] if lines else "").strip("= "),
            "seconds": round(time.perf_counter() - t0, 1)}


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def read_results(path: Path) -> dict:
    """The per-test results written so far: counts by outcome, the failures' ids, the slowest tests."""
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.is_file() else []
    counts: dict = {}
    for r in rows:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    return {"counts": counts, "failed": [r["nodeid"] for r in rows if r["outcome"] in ("failed", "error")],
            "slowest": sorted(((round(r["seconds"], 2), r["nodeid"]) for r in rows), reverse=True)[:5],
            "results_file": str(path)}


def run_tests(outdir: Path, timeout_s: float, smoke: bool) -> dict:
    """The test stage: every GPU test on CuPy (smoke: a few simulator tests), results as they finish."""
    if importlib.util.find_spec("pytest") is None:
        return {"status": "not run", "reason": "pytest is not installed; the compare and timing stages still "
                                               "check every kernel against NumPy"}
    results = outdir / "tests.jsonl"
    results.unlink(missing_ok=True)
    select = ["tests/gpu/test_gpu_v3.py", "tests/gpu/test_gpu_v4.py", "-k", SMOKE_SELECT] if smoke else \
        ["-m", "gpu", *ordered_test_files()]
    res = run_group(pytest_command(select, smoke), outdir / "pytest.log", timeout_s,
                    env={"MINIKV_TEST_RESULTS": str(results)})
    res.update(read_results(results), plugins=plugins(), order=ordered_test_files())
    return res


def run_sanitizer(outdir: Path, timeout_s: float, smoke: bool) -> dict:
    """compute-sanitizer memcheck and racecheck over SANITIZER_TESTS, each given half the time. A report
    (exit code 3) fails the run; a timeout is recorded as such and does not."""
    tool = shutil.which("compute-sanitizer") or next(
        (p for p in ("/usr/local/cuda/bin/compute-sanitizer",) if Path(p).is_file()), None)
    if smoke or tool is None:
        return {"status": "not run", "reason": "on the simulator" if smoke else "compute-sanitizer not found"}
    res: dict = {"tool": tool}
    for i, check in enumerate(("memcheck", "racecheck")):
        cmd = [tool, "--tool", check, "--error-exitcode", "3", sys.executable, "-m", "pytest", *SANITIZER_TESTS,
               "-q", "-p", "no:cacheprovider"]
        res[check] = run_group(cmd, outdir / "sanitizer.log", timeout_s / 2, env={"MINIKV_CUPY_POOL": "0"},
                               append=i > 0)
    states = {res[c]["status"] for c in ("memcheck", "racecheck")}
    res["status"] = "failed" if "failed" in states else "timed out" if "timed out" in states else "passed"
    return res
