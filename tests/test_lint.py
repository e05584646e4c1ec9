"""ruff (configured in pyproject.toml) passes on the code, tests, benchmarks, exercises, notebooks, docs_site and
the figure scripts (docs/figures)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_is_clean():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if not Path(ruff).exists():
        pytest.fail("ruff is not installed; it comes with the dev extra: pip install -e '.[dev]'")
    paths = ["minikv", "minikv_gpu", "tests", "benchmarks", "exercises", "notebooks", "docs_site", "docs/figures"]
    proc = subprocess.run([ruff, "check", *paths], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
