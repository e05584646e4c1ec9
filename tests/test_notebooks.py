"""The notebooks run top to bottom, and the committed copies carry their outputs.

* Every ``notebooks/*.ipynb`` executes in a fresh kernel without a cell error. It runs
  in memory: the committed file is not rewritten. The notebooks load SmolLM2, hence the
  ``model`` marker.
* Every committed notebook was executed in order and kept its outputs, with at least
  one PNG plot, so that GitHub shows the plots.
* The notebooks import ``minikv`` rather than paste a copy of it: no notebook defines a
  function or class under the name of one that minikv defines.

New notebooks are picked up by the glob; ``python notebooks/execute.py`` (``make notebooks``)
re-executes them and writes their outputs back.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import pkgutil
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
REQUIRED = ["01_naive_attention.ipynb", "02_kv_cache.ipynb", "03_paged_attention.ipynb",
            "03b_continuous_batching.ipynb", "04_mla.ipynb", "05_quantization.ipynb", "06_window_eviction.ipynb",
            "07_tiers_speculative.ipynb", "08_parallel.ipynb"]
IMPORTS_MINIKV = re.compile(r"^\s*(?:from|import)\s+minikv\b", re.M)


def _need(name: str):
    """Import a notebook-only dependency, or skip (locally) / fail (in CI, which installs them)."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        msg = f"{name} is not installed ({e}); install the notebook extras: pip install -e '.[dev,notebooks]'"
        if os.environ.get("CI"):
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)


def _read(path: Path):
    return _need("nbformat").read(path, as_version=4)


def _code_cells(nb) -> list:
    return [c for c in nb.cells if c.cell_type == "code"]


def _executor():
    """notebooks/execute.py as a module (the notebooks folder is not a package)."""
    _need("nbclient")
    spec = importlib.util.spec_from_file_location("minikv_notebook_execute", NOTEBOOK_DIR / "execute.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _minikv_names() -> set[str]:
    """Names of every function and class defined in a minikv module, subpackages included."""
    import minikv

    names = set()
    for info in pkgutil.walk_packages(minikv.__path__, "minikv."):
        if info.name.endswith("__main__"):  # importing it would run the command line
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__module__ == module.__name__:
                names.add(name)
    return names


notebooks = pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])


def test_every_step_has_its_notebook():
    missing = [name for name in REQUIRED if not (NOTEBOOK_DIR / name).is_file()]
    assert not missing, f"notebooks missing from {NOTEBOOK_DIR}: {missing}"


@notebooks
def test_committed_notebook_is_executed_with_plots(path):
    cells = _code_cells(_read(path))
    counts = [c.execution_count for c in cells]
    assert counts == list(range(1, len(cells) + 1)), (
        f"{path.name}: execution counts {counts}; run it top to bottom with `python notebooks/execute.py "
        f"notebooks/{path.name}` and commit the result")
    errors = [o.get("ename") for c in cells for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{path.name} was committed with errors: {errors}"
    pngs = [o for c in cells for o in c.outputs if "image/png" in o.get("data", {})]
    assert pngs, f"{path.name} has no PNG output, so GitHub would show no plot"


@notebooks
def test_notebook_imports_minikv_instead_of_copying_it(path):
    cells = _code_cells(_read(path))
    assert any(IMPORTS_MINIKV.search(c.source) for c in cells), f"{path.name} never imports minikv"
    defined = set()
    for c in cells:
        for node in ast.walk(ast.parse(c.source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
    copied = sorted(defined & _minikv_names())
    assert not copied, f"{path.name} defines {copied}, which minikv already has; import them instead"


@pytest.mark.model
@notebooks
def test_notebook_runs_top_to_bottom(path, smollm2_path):
    nb = _executor().run_notebook(path)  # raises CellExecutionError naming the failing cell
    assert any("image/png" in o.get("data", {}) for c in _code_cells(nb) for o in c.outputs)
