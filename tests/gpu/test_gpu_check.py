"""benchmarks/gpu_check.py, the script a lent GPU runs: what can be checked without one.

Without a GPU it must stop with exit status 2 and say why; ``--sim-smoke`` runs every stage
at toy sizes on the simulator (checks against NumPy, timing plumbing, JSON and Markdown).
"""

import importlib.util
import json
import sys
from pathlib import Path

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


def test_sim_smoke_runs_every_stage_and_writes_the_report(tmp_path, capsys):
    assert gpu_check.main([str(tmp_path), "--sim-smoke"]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["ok"] is True and report["errors"] == []
    assert report["device"]["backend"] == "sim"
    assert len(report["compare"]) == 4 and all(c["tokens_agree"] for c in report["compare"])
    assert report["compare"][3]["cache"] == "paged"
    assert report["copy"]["gb_per_s"] > 0
    for row in report["attention"]:
        for variant in ("v1", "v1 unsplit", "v2 fused"):
            assert row[variant]["rel_err"] <= 1e-5 and row[variant]["median_ms"] > 0
        assert row["min_bytes"] > 0
        paged = row["paged"]  # step 3: paged v1/v2 against the contiguous kernel, and SDPA on the gathered data
        for variant in ("v1", "v2", "auto"):
            assert paged[variant]["rel_err"] <= 1e-5 and paged[variant]["median_ms"] > 0
        assert paged["v2"]["version"] == 2
        assert paged["torch_sdpa_gathered"]["rel_err_vs_ours"] <= 1e-2  # a float16 case: SDPA rounds q and out
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| smoke gqa3 |" in md and "device-to-device copy" in md and "## paged decode attention" in md
    assert capsys.readouterr().out.rstrip().endswith("gpu_check.md")


def test_markdown_reports_failures():
    report = {"ok": False, "seconds": 3.0, "device": {"gpu": "NVIDIA H200", "date": "today"},
              "tests": {"status": "failed", "summary": "1 failed, 9 passed"},
              "compare": [{"error": "ValueError: boom"}],
              "copy": {"gb_per_s": 4300.0, "bytes": 2 << 31},
              "attention": [{"case": "llama8b", "error": "AssertionError: relative error 1e-2"}],
              "errors": ["compare: Traceback ..."]}
    md = gpu_check.format_markdown(report)
    assert "**FAIL**" in md and "1 failed, 9 passed" in md and "boom" in md
    assert "4300 GB/s" in md and "relative error 1e-2" in md and "## errors" in md


def test_case_byte_counts():
    case = gpu_check.AttnCase("x", batch=2, context=9, num_heads=6, num_kv_heads=3, head_dim=64, dtype="float16")
    assert case.kv_bytes() == 2 * 2 * 3 * 10 * 64 * 2
    assert case.min_bytes() == case.kv_bytes() + 2 * 4 * 2 * 6 * 64
