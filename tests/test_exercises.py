"""The exercises (exercises/README.md): each stub fails its lesson's tests, the lesson's own function passes them.

Both runs go through the same route a learner's does: ``python -m exercises NAME`` (the pytest
plugin ``exercises.plugin`` swaps the functions into the lesson), with ``--reference`` for the lesson.
"""

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

from exercises import EXERCISES
from exercises.plugin import resolve

ROOT = Path(__file__).resolve().parents[1]


def run_exercise(name: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "exercises", name, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=env)


@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_the_empty_stub_fails_its_tests(name):
    proc = run_exercise(name)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, f"exit {proc.returncode} (1 = tests ran and failed)\n{out}"
    assert "NotImplementedError" in out and " failed" in out, out
    assert " passed" not in out.splitlines()[-1], "every selected test must use the exercise's functions\n" + out


@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_the_reference_passes_the_same_tests(name):
    proc = run_exercise(name, "--reference")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert " passed" in out and "failed" not in out and "skipped" not in out.splitlines()[-1], out


def test_an_exercise_needs_neither_torch_nor_transformers_nor_mpi(tmp_path):
    """``make exercise`` installs numpy, pytest, hypothesis and the model wheel only: importing more must fail."""
    for module in ("torch", "transformers", "mpi4py", "cupy"):
        (tmp_path / f"{module}.py").write_text(f"raise ImportError('an exercise imported {module}')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    for name in sorted(EXERCISES):
        proc = run_exercise(name, "--reference", env=env)
        assert proc.returncode == 0 and "skipped" not in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_each_stub_is_its_lesson_function_without_the_body(name):
    ex = EXERCISES[name]
    stub = __import__(f"exercises.{ex.stub}", fromlist=["_"])
    for fn, target in ex.targets:
        mine, lesson = inspect.signature(getattr(stub, fn)), inspect.signature(resolve(target)[2])
        assert [(p.name, p.default) for p in mine.parameters.values()] == \
               [(p.name, p.default) for p in lesson.parameters.values()], f"{ex.stub}.{fn} vs {target}"


def test_every_exercise_has_its_stub_and_is_listed_in_the_readme():
    readme = (ROOT / "exercises" / "README.md").read_text()
    for name, ex in EXERCISES.items():
        stub = ROOT / "exercises" / f"{ex.stub}.py"
        assert stub.exists(), stub
        assert "NotImplementedError(" in stub.read_text(), f"{stub.name} must stay an empty stub"
        assert f"`{name}`" in readme and f"{ex.stub}.py" in readme, f"README.md does not list {name}"


def test_listing_names_every_exercise():
    proc = subprocess.run([sys.executable, "-m", "exercises"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0
    for name in EXERCISES:
        assert name in proc.stdout
