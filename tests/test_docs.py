"""The docs point only at things that exist, and their snippets run.

Checked in every docs/*.md:
  * every ```python block runs without error (fresh namespace each), except the lesson quotes;
  * every `minikv ...` command parses with the real CLI; `minikv memory` commands
    also run and exit 0 (they are pure arithmetic), and with --json end in a JSON line;
  * every `tests/<file>.py::test_name` names a test function that exists;
  * every `minikv/<module>.py::Name.attr` and `minikv.module.name` resolves on import;
  * every relative Markdown link and every repository path in a code span exists;
  * no code span is broken across lines (odd number of backticks on a line), which
    would hide a reference from these checks.
claims.md and interview.md also keep their structure: every claim has a verdict
and a check, every question a runnable snippet and a test.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import re
import shlex
from pathlib import Path

import pytest

from minikv.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
REQUIRED = ["index.md", "01_naive_attention.md", "02_kv_cache.md", "03_paged.md", "04_mla.md", "05_quant.md",
            "06_window.md", "gpu.md", "formulas.md", "claims.md", "interview.md"]
PAGES = sorted(DOCS.glob("*.md")) + sorted((DOCS / "zh").glob("*.md"))  # the Chinese edition is held to the same checks


def _name(page: Path) -> str:
    """A page as docs/ names it: "06_window.md", "zh/06_window.md"."""
    return page.relative_to(DOCS).as_posix()

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
SPAN = re.compile(r"`([^`\n]+)`")
TEST_REF = re.compile(r"\btests/[\w/]+\.py::\w+")
PATH_REF = re.compile(r"^(?:minikv|minikv_gpu|tests|docs|benchmarks|notebooks)/[\w/.-]*$")
SYMBOL_REF = re.compile(r"^(minikv(?:_gpu)?/[\w/]+\.py)::([\w.]+)$")
DOTTED_REF = re.compile(r"^minikv(?:_gpu)?(?:\.\w+)+$")
LINK = re.compile(r"\]\(([^)\s]+)\)")
MPIEXEC = re.compile(r"^mpiexec\s+-n\s+\d+\s+")


def _read(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def _prose(text: str) -> str:
    """The page without its fenced blocks."""
    return FENCE.sub("", text)


def _python_blocks():
    """Every runnable python block: not a lesson quote (a definition out of its module, kept current by
    tests/test_step_pages.py), which follows a ``<!-- lesson: ... -->`` line."""
    for page in PAGES:
        text = _read(page)
        for i, m in enumerate(FENCE.finditer(text)):
            quoted = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1].startswith("<!-- lesson:")
            if m.group(1) == "python" and not quoted:
                yield pytest.param(m.group(2), id=f"{_name(page)}-block{i}")


def _commands():
    """(page, command) for every `minikv ...` span and every `minikv ...` line of a fenced block."""
    found = {}
    for page in PAGES:
        text = _read(page)
        candidates = [s for s in SPAN.findall(_prose(text))]
        for m in FENCE.finditer(text):
            candidates += m.group(2).splitlines()
        for c in candidates:
            c = MPIEXEC.sub("", c.split(" #", 1)[0].strip())  # `mpiexec -n 3 minikv ...` is checked as `minikv ...`
            if c.startswith("minikv "):  # a bare `minikv` is the program's name, not a command
                found.setdefault(c, _name(page))
    return [pytest.param(cmd, id=f"{page}: {cmd}"[:120]) for cmd, page in sorted(found.items())]


def _all_text_refs(pattern: re.Pattern):
    refs = {}
    for page in PAGES:
        for ref in pattern.findall(_read(page)):
            refs.setdefault(ref, _name(page))
    return [pytest.param(ref, id=f"{page}: {ref}") for ref, page in sorted(refs.items())]


# --- the pages exist ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", REQUIRED)
def test_required_page_exists(name):
    assert (DOCS / name).is_file(), f"docs/{name} is missing"


def test_index_links_every_page():
    index = _read(DOCS / "index.md")
    for name in REQUIRED[1:]:
        assert f"]({name})" in index, f"docs/index.md does not link {name}"


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_no_code_span_is_broken_across_lines(page):
    for line in _prose(_read(page)).splitlines():
        assert line.count("`") % 2 == 0, f"{_name(page)}: a code span breaks across lines near: {line!r}"


# --- snippets run ------------------------------------------------------------------------------

@pytest.mark.parametrize("source", list(_python_blocks()))
def test_python_snippet_runs(source):
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(source, "<docs snippet>", "exec"), {"__name__": "__docs__"})


@pytest.mark.parametrize("command", _commands())
def test_minikv_command_resolves(command):
    argv = shlex.split(command)[1:]
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits on an unknown subcommand or flag
        pytest.fail(f"`{command}` does not parse (exit {e.code})")
    if args.command != "memory" or len(argv) == 1:
        return  # generate/demo need the model file, and `minikv memory` alone is a mention; parsing suffices
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(argv)
    assert rc == 0, f"`{command}` exited {rc}"
    if "--json" in argv:
        json.loads(out.getvalue().strip().splitlines()[-1])


# --- references resolve ------------------------------------------------------------------------

@pytest.mark.parametrize("ref", _all_text_refs(TEST_REF))
def test_test_reference_exists(ref):
    path, name = ref.split("::")
    file = ROOT / path
    assert file.is_file(), f"{path} does not exist"
    assert re.search(rf"^def {name}\(", file.read_text(), re.M), f"{path} has no test function {name}"


def _resolve(module: str, attrs: list[str]):
    obj = importlib.import_module(module)
    for a in attrs:
        obj = getattr(obj, a)
    return obj


def _span_problem(part: str) -> str | None:
    """Why a reference-looking word of a code span does not resolve (None if it does or is no reference)."""
    m = SYMBOL_REF.match(part)
    if m:
        try:
            _resolve(m.group(1)[:-3].replace("/", "."), m.group(2).split("."))
        except (ImportError, AttributeError) as e:
            return f"`{part}` does not resolve: {e}"
        return None
    if DOTTED_REF.match(part):
        names = part.split(".")
        for cut in range(len(names), 0, -1):  # the longest importable prefix, then attributes
            try:
                importlib.import_module(".".join(names[:cut]))
            except ImportError:
                continue
            try:
                _resolve(".".join(names[:cut]), names[cut:])
            except AttributeError as e:
                return f"`{part}` does not resolve: {e}"
            return None
        return f"`{part}` names no importable module"
    if PATH_REF.match(part) and not (ROOT / part).exists():
        return f"`{part}` does not exist in the repository"
    return None


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_code_span_references_resolve(page):
    problems = []
    for span in SPAN.findall(_prose(_read(page))):
        for part in re.split(r",\s*|\s+", span.strip()):
            problem = _span_problem(part.strip().rstrip(".:"))
            if problem:
                problems.append(problem)
    assert not problems, f"{_name(page)}:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_relative_links_exist(page):
    for target in LINK.findall(_read(page)):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#", 1)[0]).resolve()
        assert path.exists(), f"{_name(page)} links to {target}, which does not exist"


# --- claims.md and interview.md keep their shape -------------------------------------------------

def _sections(name: str, prefix: str) -> dict[str, str]:
    text = _read(DOCS / name)
    parts = re.split(rf"^{re.escape(prefix)}", text, flags=re.M)[1:]
    return {p.splitlines()[0].strip(): p for p in parts}


CLAIM_KEYS = [  # the seed claims issue 4 lists; each must keep its section
    "Llama-2 13B", "2 x B x L x H x d x max_seq_len", "4blh(s+t)", "DeepSeek-7B", "DeepSeek-V3",
    "1/5", "0.5 MB per token", "1000x", "O(N²) to O(N)", "INT8", "current page", "20–40%",
]
VERDICT = re.compile(r"\*\*Verdict: (true|false|depends|to be measured|memory: true)")


def test_every_seed_claim_has_a_section():
    titles = list(_sections("claims.md", "## "))
    for key in CLAIM_KEYS:
        assert any(key in t for t in titles), f"claims.md has no section for the claim about {key!r}"


@pytest.mark.parametrize("title, body", list(_sections("claims.md", "## ").items()))
def test_every_claim_has_a_verdict_and_a_check(title, body):
    assert VERDICT.search(body), f"claim {title!r} has no **Verdict: ...** line"
    check = body.split("**Check:**", 1)
    assert len(check) == 2, f"claim {title!r} has no **Check:** line"
    assert TEST_REF.search(check[1]) or "`minikv " in check[1], f"claim {title!r} checks nothing runnable"


@pytest.mark.parametrize("title, body", list(_sections("interview.md", "### Q").items()))
def test_every_question_has_a_snippet_and_a_test(title, body):
    assert "```python" in body or "`minikv " in body or "\nminikv " in body, f"Q{title} has no snippet"
    assert TEST_REF.search(body), f"Q{title} names no test"


def test_later_steps_are_marked_not_linked():
    """Code that later steps will write is announced as 'code: step N (coming)', never as a path."""
    for page in PAGES:
        for m in re.finditer(r"code: step (\d\w*) \(coming\)", _read(page)):
            assert m.group(1) in {"3", "3b", "4", "5", "6"}, f"{_name(page)}: unknown step {m.group(1)}"
