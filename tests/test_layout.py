"""The house rules of DESIGN.md section 1, checked on the source: sizes and import directions."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = sorted(p for pkg in ("minikv", "minikv_gpu") for p in (ROOT / pkg).rglob("*.py"))
STEPS = ("attention", "online_softmax", "kv_cache", "paged/allocator", "paged/manager", "paged/attention",
         "paged/cache", "mla/latent", "mla/caches", "mla/block", "quant/codecs", "quant/formats", "quant/cache",
         "window/ring", "window/scores", "window/paged", "window/reference")
ABOVE_THE_STEPS = ("minikv.model", "minikv.generate", "minikv.scheduler", "minikv.cli", "minikv.costs",
                   "minikv.bench")
MAX_MODULE, MAX_FUNCTION, MAX_CLASS = 450, 60, 300


def rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


def imported_modules(path: Path) -> set[str]:
    """Every module an ``import`` or ``from ... import`` in ``path`` names, at any depth (lazy ones too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


@pytest.mark.parametrize("path", LIBRARY, ids=rel)
def test_modules_functions_and_classes_stay_small(path):
    text = path.read_text()
    assert len(text.splitlines()) <= MAX_MODULE, f"{rel(path)} has {len(text.splitlines())} lines"
    for node in ast.walk(ast.parse(text)):
        n = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            assert n <= MAX_FUNCTION, f"{rel(path)}:{node.lineno} {node.name}() has {n} lines"
        elif isinstance(node, ast.ClassDef):
            assert n <= MAX_CLASS, f"{rel(path)}:{node.lineno} class {node.name} has {n} lines"


@pytest.mark.parametrize("step", [s for s in STEPS if (ROOT / "minikv" / f"{s}.py").exists()])
def test_steps_import_nothing_above_them(step):
    bad = {m for m in imported_modules(ROOT / "minikv" / f"{step}.py")
           if any(m == a or m.startswith(a + ".") for a in ABOVE_THE_STEPS)}
    assert not bad, f"minikv/{step}.py imports {sorted(bad)}; a step must not know the model, the loops or bench"


@pytest.mark.parametrize("path", [p for p in LIBRARY if "minikv_gpu" not in p.parts and "cli" not in p.parts],
                         ids=rel)
def test_only_the_cli_imports_the_gpu_wing(path):
    bad = {m for m in imported_modules(path) if m.split(".")[0] == "minikv_gpu"}
    assert not bad, f"{rel(path)} imports {sorted(bad)}; only the CLI (minikv/cli/) may, lazily, for compare"


def test_the_tokenizer_knows_nothing_of_gguf():
    assert not {m for m in imported_modules(ROOT / "minikv" / "weights" / "tokenizer.py") if "gguf" in m}


def test_the_checker_sees_lazy_imports(tmp_path):
    """A test must be able to fail: an import inside a function is still found."""
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from minikv.model import Model\n    import minikv_gpu.paged\n")
    assert {"minikv.model", "minikv_gpu.paged"} <= imported_modules(f)
