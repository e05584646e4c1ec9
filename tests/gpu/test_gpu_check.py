"""benchmarks/gpu_check.py, the script a lent GPU runs: what can be checked without one.

Without a GPU it must stop with exit status 2 and say why; ``--sim-smoke`` runs every stage
at toy sizes on the simulator (checks against NumPy, timing plumbing, JSON and Markdown).
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from minikv_gpu import runtime

ROOT = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


gpu_check = _load()


def _has_gpu() -> bool:
    try:
        runtime.get_runtime("cupy")
        return True
    except Exception:
        return False


@pytest.mark.skipif(_has_gpu(), reason="a GPU is present: the real check runs instead (bash benchmarks/gpu_check.sh)")
def test_without_a_gpu_it_says_so_and_exits_2(tmp_path, capsys):
    assert gpu_check.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no usable GPU" in err and "--sim-smoke" in err


def test_sim_smoke_runs_every_stage_and_writes_the_report(tmp_path):
    """bash benchmarks/gpu_check.sh OUT --sim-smoke: the script the GPU machine runs, every stage at toy sizes."""
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(tmp_path), "--sim-smoke"],
                          env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["ok"] is True and report["errors"] == []
    assert report["device"]["backend"] == "sim"
    assert set(report["stages"]) >= {"device", "copy", "compare", "quant", "tiers", "mla", "window", "model",
                                      "sanitizer", "tests"}
    assert list(report["stages"])[-1] == "tests"  # the long stage runs last
    assert all(s["status"] == "done" and s["estimate_s"] > 0 for s in report["stages"].values()), report["stages"]
    tests = report["tests"]  # every finished test in tests.jsonl, read back into the report
    assert tests["status"] == "passed" and tests["counts"] == {"passed": 2} and tests["failed"] == []
    lines = [json.loads(x) for x in (tmp_path / "tests.jsonl").read_text().splitlines()]
    assert {r["outcome"] for r in lines} == {"passed"} and len(lines) == 2
    assert tests["order"][:3] == ["tests/gpu/test_gpu_v3.py", "tests/gpu/test_gpu_v4.py", "tests/gpu/test_gpu_paged.py"]
    assert (tmp_path / "pytest.log").is_file() and report["sanitizer"]["status"] == "not run"
    assert len(report["compare"]) == 4 and all(c["tokens_agree"] for c in report["compare"])
    assert report["compare"][3]["cache"] == "paged" and all("ties" in c for c in report["compare"])
    assert report["copy"]["gb_per_s"] > 0
    assert report["tiers"]["ok"] and report["tiers"]["async"]["bit_identical"]
    assert report["attention"][0]["case"].startswith("goal") and report["attention"][0]["heads"] == "32/8"
    for row in report["attention"]:
        for variant, version in (("auto", 4), ("v1", 1), ("v2", 2), ("v3", 3), ("v4", 4), ("fused", None)):
            assert row[variant]["rel_err"] <= 1e-5 and row[variant]["within_tol"] and row[variant]["median_ms"] > 0
            assert version is None or row[variant]["version"] == version
        assert row["min_bytes"] > 0 and row["v3_split_sweep_ms"] and row["v4_split_sweep_ms"] and row["split_sweep_ms"]
        paged = row["paged"]  # step 3: paged v1..v4 against the contiguous kernel, SDPA on the gathered data
        for variant in ("v1", "v2", "v3", "v4", "auto"):
            assert paged[variant]["rel_err"] <= 1e-5 and paged[variant]["median_ms"] > 0
        assert (paged["v2"]["version"], paged["v3"]["version"], paged["v4"]["version"]) == (2, 3, 4)
        for sdpa in (row["torch_sdpa"], paged["torch_sdpa_gathered"]):
            assert set(sdpa["backends"]) == {"default", "FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"}
            assert all("median_ms" in e or "error" in e for e in sdpa["backends"].values())
            assert sdpa["backends"]["default"]["rel_err_vs_ours"] <= 1e-2  # float16 q and out
        ratios = row["ratios"]
        assert ratios["v4_of_copy"] > 0 and ratios["paged_v4_vs_v3"] > 0 and ratios["v4_vs_best_sdpa"] > 0
    window = report["window"]  # step 6: every variant checked against minikv.window, then timed
    for variant in ("v1", "v3", "v4", "v1_mass", "v3_rope", "v4_rope"):
        assert window[variant]["rel_err"] <= 1e-4 and window[variant]["median_ms"] > 0, window[variant]
    assert window["v1_mass"]["mass_rel_err"] <= 1e-4 and window["visible_keys"] > 0
    for kv in ("fp16", "int8", "fp8"):
        assert report["quant"][f"{kv}_v3"]["median_ms"] > 0 and report["quant"][f"{kv}_v4"]["median_ms"] > 0
    model = {m["case"]: m for m in report["model"]}  # gpu_model.py's predictions beside the measurements
    assert model["paged v4 fp16"]["predicted_us"] > 0 and model["quant int8 v4"]["measured_us"] > 0
    assert all(m["measured_us"] for m in model.values())  # every predicted case was measured (here: simulated)
    goal = report["goal"]
    assert goal["met"] is None and goal["v4_of_copy"] > 0 and goal["targets"]["v3_of_copy"] == 0.85
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| smoke gqa3 |" in md and "device-to-device copy" in md and "## paged decode attention" in md
    assert "goal (" in md and "## torch SDPA backends" in md and "## window decode" in md and "## the model" in md
    out = proc.stdout.rstrip()
    assert out.count("[stage] ") == len(report["stages"]) and f"within {gpu_check.PLAN_S} s" in out
    assert (tmp_path / "gpu_check.log").read_text().rstrip() == out  # the console, kept beside the report
    assert out.endswith(" s") and "gpu_check.md" in out.splitlines()[-1]
    print(f"sim smoke: {report['seconds']:.1f} s")  # must stay fast: CI runs it


def test_the_plan_fits_seven_minutes_on_an_h200():
    assert gpu_check.planned_total() <= gpu_check.PLAN_S == 420
    for stage in ("device", "copy", "quant", "tiers", "compare", "mla", "window", "model", "sanitizer", "tests"):
        assert gpu_check.stage_estimate(stage) > 0
    goal = gpu_check.stage_estimate("attention goal llama8b B64 S4096 float16")
    assert goal == gpu_check.ESTIMATE_S["attention goal"]


def test_a_timeout_kills_the_whole_process_group(tmp_path):
    """compute-sanitizer starts python, which a plain subprocess timeout left running: the group goes."""
    from gpu_check_tests import run_group

    pid_file = tmp_path / "child.pid"
    cmd = ["bash", "-c", f"sleep 60 & echo $! > {pid_file}; wait"]
    res = run_group(cmd, tmp_path / "log.txt", timeout_s=1.5)
    assert res["status"] == "timed out" and "process group" in (tmp_path / "log.txt").read_text()
    assert not _running(int(pid_file.read_text()))  # the grandchild is gone too


def _running(pid: int) -> bool:
    """True while ``pid`` runs. A killed process whose parent died waits as a zombie ("Z") until PID 1 reaps
    it, and a container's PID 1 may never do so: a zombie has stopped, so it counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def test_the_test_files_run_in_the_order_of_their_value():
    from gpu_check_tests import TEST_ORDER, ordered_test_files

    files = ordered_test_files()
    assert [f.split("/")[-1] for f in files[:len(TEST_ORDER)]] == TEST_ORDER
    assert sorted(files[len(TEST_ORDER):]) == files[len(TEST_ORDER):] and len(set(files)) == len(files)


def test_markdown_reports_failures():
    report = {"ok": False, "seconds": 3.0, "device": {"gpu": "NVIDIA H200", "date": "today"},
              "tests": {"status": "failed", "summary": "1 failed, 9 passed"},
              "compare": [{"error": "ValueError: boom"}],
              "copy": {"gb_per_s": 4300.0, "bytes": 2 << 31},
              "attention": [{"case": "llama8b", "cache_dtype": "float16",
                             "error": "AssertionError: relative error 1e-2"}],
              "errors": ["compare: Traceback ..."]}
    md = gpu_check.format_markdown(report)
    assert "**FAIL**" in md and "1 failed, 9 passed" in md and "boom" in md
    assert "4300 GB/s" in md and "relative error 1e-2" in md and "## errors" in md


def test_case_byte_counts():
    case = gpu_check.AttnCase("x", batch=2, context=9, num_heads=6, num_kv_heads=3, head_dim=64, dtype="float16")
    assert case.kv_bytes() == 2 * 2 * 3 * 10 * 64 * 2
    assert case.min_bytes() == case.kv_bytes() + 2 * 4 * 2 * 6 * 64


def test_a_tolerance_miss_is_recorded_and_keeps_the_row():
    """A variant beyond its tolerance: the miss is kept in the row (and later in the report's errors, so the
    run fails), and the caller goes on to time it, instead of losing the whole row to an exception."""
    from gpu_check_kv_cache import check_variant
    from gpu_check_report import format_markdown
    from gpu_check_window import _check, errors

    row = {"case": "goal x", "cache_dtype": "float16"}
    assert check_variant(row, "v4", 3e-3, 1e-5) == {"rel_err": 3e-3, "within_tol": False}
    assert check_variant(row, "v3", 1e-7, 1e-5)["within_tol"]
    assert row["misses"] == ["v4: relative error 3.00e-03 > 1e-05"]
    md = format_markdown({"attention": [row], "device": {}})
    assert "tolerance miss, goal x float16: v4: relative error 3.00e-03" in md
    entry: dict = {}
    _check(entry, "v4", np.ones(3), np.ones(3) * 1.1)
    assert entry["rel_err"] > 0.05 and len(entry["misses"]) == 1
    assert errors({"v4": {**entry, "median_ms": 1.0}}) == [f"window v4: {entry['misses'][0]}"]
