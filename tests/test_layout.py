"""The house rules of DESIGN.md section 1, checked on the source: sizes, the folder layout, import directions,
no import circle, chapters that hold their step and nothing later, and the pinned public names.

Sizes count *code* lines: docstrings, comments and blank lines do not count, so prose that teaches is
never trimmed to fit (a module at most 300 code lines, a class 300, a function 60).
"""

import ast
import importlib
import io
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = sorted(p for pkg in ("minikv", "minikv_gpu") for p in (ROOT / pkg).rglob("*.py"))
MAX_MODULE, MAX_FUNCTION, MAX_CLASS = 300, 60, 300

# --- the layout: the core at the top of minikv/, one folder per chapter ----------------------------
CORE = {"__init__", "__main__", "errors", "layers", "moe", "attention", "online_softmax", "seam", "kv_cache", "model",
        "model_config",
        "sampling", "generate", "scheduler", "speculative", "perplexity"}
FOLDERS = {"textbook", "paged", "mla", "quant", "window", "hybrid", "tiers", "parallel", "weights", "costs", "bench",
           "cli"}

# Import directions: a module may import its own level or a lower one, never a higher one.
LEVELS = [
    ["minikv.errors"],
    ["minikv.layers", "minikv.moe"],
    ["minikv.attention", "minikv.online_softmax", "minikv.seam"],
    ["minikv.kv_cache"],
    ["minikv.paged"],                                                    # step 3
    ["minikv.mla", "minikv.quant", "minikv.window", "minikv.hybrid"],    # steps 4, 5, 6, 9
    ["minikv.model_config"],
    ["minikv.model"],
    ["minikv.weights", "minikv.sampling", "minikv.speculative", "minikv.costs"],
    ["minikv.generate", "minikv.perplexity", "minikv.scheduler"],
    # step 7's tier hooks into the scheduler (minikv/tiers/scheduling.py), step 8 shards the model itself
    ["minikv.tiers", "minikv.parallel"],
    ["minikv.bench", "minikv.textbook"],
    ["minikv.cli", "minikv.__main__", "minikv"],
]

# A chapter holds its step and nothing later: identifiers of later steps that must not appear in its code.
STEP6 = {"HOLE", "release_block", "limit_sharing", "share_limit", "policy", "Policy", "evicted_at"}
STEP7 = {"tier", "OffloadTier", "speculative", "draft"}
LATER_NAMES = {
    "minikv/kv_cache.py": {"block_table", "BlockManager", "quantized", "latent"} | STEP6 | STEP7,
    "minikv/paged/allocator.py": {"quantized", "latent", "kv_dtype"} | STEP6 | STEP7,
    "minikv/paged/manager.py": {"quantized", "latent", "kv_dtype"} | STEP6 | STEP7,
    "minikv/paged/attention.py": {"latent", "kv_dtype"} | STEP6 | STEP7,
    "minikv/paged/cache.py": {"quantized", "latent", "kv_dtype"} | STEP6 | STEP7,
    "minikv/mla/latent.py": {"kv_dtype", "quantized"} | STEP6 | STEP7,
    "minikv/mla/caches.py": {"kv_dtype", "quantized"} | STEP6 | STEP7,
    "minikv/quant/cache.py": STEP6 | STEP7,
    "minikv/quant/formats.py": STEP6 | STEP7,
    "minikv/window/ring.py": STEP7,
    "minikv/window/paged.py": STEP7,
}
FENCED = {"minikv/quant/cache.py": ("# --- NEW in step 7", ("_keep_rows", "_truncate"))}


def rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


# --- counting code lines ---------------------------------------------------------------------------

def prose_lines(source: str) -> set[int]:
    """Line numbers that hold no code: blank lines, comment-only lines, and docstrings."""
    lines = source.splitlines()
    prose = {i + 1 for i, line in enumerate(lines) if not line.strip()}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and not lines[tok.start[0] - 1][:tok.start[1]].strip():
            prose.add(tok.start[0])
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and \
                    isinstance(first.value.value, str):
                prose.update(range(first.lineno, first.end_lineno + 1))
    return prose


def code_lines(source: str, start: int = 1, end: int | None = None, prose: set | None = None) -> int:
    """Lines start..end (1-based, inclusive) that are code."""
    prose = prose_lines(source) if prose is None else prose
    end = len(source.splitlines()) if end is None else end
    return sum(1 for i in range(start, end + 1) if i not in prose)


def test_code_lines_leave_out_prose():
    """A test must be able to fail: docstrings, comments and blank lines are not code; the rest is."""
    src = '"""Doc\n\nmore doc."""\n\n# a comment\nx = 1  # trailing\n\n\ndef f():\n    """Doc."""\n    return x\n'
    assert code_lines(src) == 3  # x = 1, def f():, return x
    assert code_lines("s = '''a\nb'''\n") == 2  # a string that is not a docstring is code


@pytest.mark.parametrize("path", LIBRARY, ids=rel)
def test_modules_functions_and_classes_stay_small(path):
    text = path.read_text()
    prose = prose_lines(text)
    n = code_lines(text, prose=prose)
    assert n <= MAX_MODULE, f"{rel(path)} has {n} lines of code (docstrings and comments not counted)"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            n = code_lines(text, node.lineno, node.end_lineno, prose)
            limit = MAX_CLASS if isinstance(node, ast.ClassDef) else MAX_FUNCTION
            assert n <= limit, f"{rel(path)}:{node.lineno} {node.name} has {n} lines of code (limit {limit})"


# --- the layout ------------------------------------------------------------------------------------

def test_the_core_sits_at_the_top_and_every_chapter_in_its_folder():
    top = {p.stem for p in (ROOT / "minikv").glob("*.py")}
    assert top <= CORE, f"flat modules outside the core: {sorted(top - CORE)}; put a step's code in its chapter folder"
    folders = {p.name for p in (ROOT / "minikv").iterdir() if p.is_dir() and not p.name.startswith(("_", "."))}
    assert folders <= FOLDERS, f"unknown folders {sorted(folders - FOLDERS)} (DESIGN.md section 1)"
    for folder in folders:
        assert (ROOT / "minikv" / folder / "__init__.py").exists(), f"minikv/{folder}/ is not a package"


# --- imports -----------------------------------------------------------------------------------------

def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    p = ROOT / name.replace(".", "/")
    return p.with_suffix(".py").exists() or (p / "__init__.py").exists()


def imported_modules(path: Path) -> set[str]:
    """Every module an ``import`` or ``from ... import`` in ``path`` names, at any depth (lazy ones too);
    ``from pkg import sub`` names the submodule ``pkg.sub`` when ``sub`` is one."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names}
            names.update({s for s in subs if is_module(s)} or {node.module})
            if any(not is_module(s) for s in subs):
                names.add(node.module)
    return names


def level(name: str) -> int | None:
    """The level of module ``name``: that of the longest LEVELS entry it is (or is inside of)."""
    best = None
    for i, group in enumerate(LEVELS):
        for g in group:
            if (name == g or name.startswith(g + ".")) and (best is None or len(g) > best[1]):
                best = (i, len(g))
    return None if best is None else best[0]


MINIKV = [p for p in LIBRARY if p.parts[len(ROOT.parts)] == "minikv"]


@pytest.mark.parametrize("path", MINIKV, ids=rel)
def test_imports_point_down(path):
    me = level(module_name(path))
    assert me is not None, f"{rel(path)} has no level in LEVELS"
    up = {m: level(m) for m in imported_modules(path) if m.startswith("minikv.") and level(m) is not None}
    bad = sorted(m for m, lv in up.items() if lv > me)
    assert not bad, f"{rel(path)} (level {me}) imports {bad}, which sit higher: imports point down (DESIGN.md)"


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules it names (explicit imports only, lazy ones included)."""
    return {module_name(p): {m for m in imported_modules(p) if m.split(".")[0] in ("minikv", "minikv_gpu")}
            for p in LIBRARY}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A list of modules that import each other in a circle, or None."""
    color, stack = {}, []

    def visit(u):
        color[u] = 1
        stack.append(u)
        for v in sorted(graph.get(u, ())):
            if color.get(v) == 1:
                return stack[stack.index(v):] + [v]
            if v in graph and not color.get(v):
                found = visit(v)
                if found:
                    return found
        stack.pop()
        color[u] = 2
        return None

    for u in sorted(graph):
        if not color.get(u):
            found = visit(u)
            if found:
                return found
    return None


def test_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_checkers_can_fail(tmp_path):
    """A lazy import is still found, a circle is found, and a step importing upward is flagged."""
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from minikv.model import Model\n    import minikv_gpu.paged\n")
    assert {"minikv.model", "minikv_gpu.paged"} <= imported_modules(f)
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert level("minikv.paged.cache") < level("minikv.model") < level("minikv.generate")


@pytest.mark.parametrize("path", [p for p in LIBRARY if "minikv_gpu" not in p.parts and "cli" not in p.parts],
                         ids=rel)
def test_only_the_cli_imports_the_gpu_wing(path):
    bad = {m for m in imported_modules(path) if m.split(".")[0] == "minikv_gpu"}
    assert not bad, f"{rel(path)} imports {sorted(bad)}; only the CLI (minikv/cli/) may, lazily, for compare"


def test_the_tokenizer_knows_nothing_of_gguf():
    assert not {m for m in imported_modules(ROOT / "minikv" / "weights" / "tokenizer.py") if "gguf" in m}


# --- chapters hold their step ----------------------------------------------------------------------

def identifiers(source: str) -> set[str]:
    """Names the code uses or defines (not prose): names, attributes, definitions, arguments, keywords."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
        elif isinstance(node, ast.keyword) and node.arg:
            out.add(node.arg)
    return out


@pytest.mark.parametrize("file", sorted(LATER_NAMES))
def test_a_chapter_holds_its_step_and_nothing_later(file):
    found = identifiers((ROOT / file).read_text()) & LATER_NAMES[file]
    assert not found, f"{file} uses {sorted(found)}, names of a later step: extend the step there (a subclass, " \
                      "a hook it installs), do not branch here"


@pytest.mark.parametrize("file", sorted(FENCED))
def test_a_later_steps_code_sits_in_its_fenced_last_section(file):
    fence, names = FENCED[file]
    text = (ROOT / file).read_text()
    assert fence in text, f"{file} has no {fence!r} section"
    start = text.index(fence)
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef) and node.name in names:
            offset = sum(len(line) + 1 for line in text.splitlines()[:node.lineno - 1])
            assert offset > start, f"{file}: {node.name} belongs in the {fence!r} section at the end"


# --- the public names, pinned ------------------------------------------------------------------------

PUBLIC = {
    "minikv.paged": ["Block", "BlockAllocator", "BlockManager", "HashFn", "PagedKVCache", "SeqState", "StepPlan",
                     "TileLoader", "ceil_div", "chain_hash", "check_paged_attention_args", "default_blocks_per_tile",
                     "gather_blocks", "num_blocks_for", "paged_attention", "query_positions", "slot_mapping",
                     "truncate_table"],
    "minikv.mla": ["FORMS", "LatentContiguousKVCache", "LatentNoCache", "LatentPagedKVCache", "LatentUp", "MLAConfig",
                   "MLALayer", "MLALayerWeights", "Reader", "absorbed_state", "expand", "expanded_state",
                   "latent_attention", "latent_bytes_per_token", "mla_attention_block", "mla_weight_shapes",
                   "reference_attention"],
    "minikv.quant": ["CODECS", "Codec", "KVFormat", "KV_DTYPES", "QuantizedPagedKVCache", "QuantizedStore", "Side",
                     "codec", "codecs", "dequantized_pools", "is_kivi", "kv_bytes_per_token", "kv_format",
                     "quantized_paged_attention"],
    "minikv.window": ["EvictingBlockManager", "EvictingKVCache", "H2OPolicy", "H2O_SCORES", "HOLE", "MaskedRecompute",
                      "NEVER", "POLICIES", "POLICY_OPTIONS", "POOLINGS", "POSITIONS", "PagedEvictingKVCache", "Policy",
                      "PrefillOnly", "REQUIRED", "SnapKVPolicy", "WindowPolicy", "attend_in_cache", "attend_slots",
                      "check_rope_table", "make_policy", "pool1d", "rank_positions", "reads_scores",
                      "truncate_refusal"],
    "minikv.tiers": ["ARC", "CacheStorage", "HostEntry", "LINKS", "LRU", "Link", "OffloadPolicy", "OffloadTier",
                     "POLICIES", "SeenTwice", "TierStats", "make_policy"],
    "minikv.parallel": ["Collective", "Collectives", "ParallelModel", "RankHeads", "STRIPED_KINDS",
                        "StripedLatentCache", "abort_on_error", "agree", "from_flags", "generate", "head_plan",
                        "imbalance", "mpi_world", "quiet_output", "shard_model", "split_even", "striped_cache",
                        "striped_positions", "striped_state"],
}


@pytest.mark.parametrize("package", sorted(PUBLIC))
def test_public_names_are_pinned_and_import(package):
    mod = importlib.import_module(package)
    assert sorted(mod.__all__) == sorted(PUBLIC[package]), \
        f"{package}.__all__ changed: added {sorted(set(mod.__all__) - set(PUBLIC[package]))}, " \
        f"removed {sorted(set(PUBLIC[package]) - set(mod.__all__))}; public imports must stay stable"
    missing = [n for n in mod.__all__ if not hasattr(mod, n)]
    assert not missing, f"{package} lists {missing} but does not define them"


def test_the_reading_map_names_every_lesson_and_chapter():
    """``minikv/__init__.py``'s docstring is the reading map: every lesson and every chapter folder is on it."""
    import minikv
    from minikv.textbook import LESSONS

    missing = [n for n in LESSONS if n not in minikv.__doc__]
    chapters = sorted(p.name for p in (ROOT / "minikv").iterdir() if (p / "__init__.py").exists())
    missing += [f"{c}/" for c in chapters if f"{c}/" not in minikv.__doc__]
    assert not missing, f"the reading map in minikv/__init__.py lacks {missing}"
