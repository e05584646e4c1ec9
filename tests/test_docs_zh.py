"""The Chinese edition (docs/zh/) points only at things that exist, and keeps the English numbers.

Checked in every docs/zh/*.md, with the helpers of tests/test_docs.py:
  * every relative Markdown link exists (English pages are ../X.md, repository files ../../...);
  * every repository path, `minikv/<module>.py::Name` and `minikv.module.name` in a code span resolves;
  * every `tests/<file>.py::test_name` names a test function that exists;
  * every `minikv ...` command in a code span or fenced block parses with the real CLI;
  * no code span is broken across lines.
Parity: every number on a translated English page appears on its Chinese page.
The glossary: every row has three non-empty cells (English | 中文 | definition).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from test_docs import FENCE, LINK, SPAN, TEST_REF, _prose, _read, _span_problem

from minikv.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
ZH = DOCS / "zh"
ZH_PAGES = sorted(ZH.glob("*.md"))
TRANSLATED = ["06_window.md"]  # English pages with a Chinese version held to the number-parity rule
REQUIRED = ["index.md", "glossary.md", *TRANSLATED]

# A number: digits, optional thousands commas and decimals, an optional "x" (a ratio such as 2.82x).
# ASCII look-arounds, so that a number next to a Chinese character still counts.
NUMBER = re.compile(r"(?<![A-Za-z0-9_.])\d+(?:,\d{3})*(?:\.\d+)?x?(?![A-Za-z0-9_])")


def _numbers(text: str) -> set[str]:
    return set(NUMBER.findall(text))


@pytest.mark.parametrize("name", REQUIRED)
def test_zh_page_exists(name):
    assert (ZH / name).is_file(), f"docs/zh/{name} is missing"


def test_zh_index_links_every_translated_page():
    index = _read(ZH / "index.md")
    for name in REQUIRED[1:]:
        assert f"]({name})" in index, f"docs/zh/index.md does not link {name}"


@pytest.mark.parametrize("page", ZH_PAGES, ids=lambda p: p.name)
def test_zh_relative_links_exist(page):
    for target in LINK.findall(_read(page)):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#", 1)[0]).resolve()
        assert path.exists(), f"zh/{page.name} links to {target}, which does not exist"


@pytest.mark.parametrize("page", ZH_PAGES, ids=lambda p: p.name)
def test_zh_code_span_references_resolve(page):
    problems = []
    for span in SPAN.findall(_prose(_read(page))):
        for part in re.split(r",\s*|\s+", span.strip()):
            problem = _span_problem(part.strip().rstrip(".:"))
            if problem:
                problems.append(problem)
    assert not problems, f"zh/{page.name}:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("page", ZH_PAGES, ids=lambda p: p.name)
def test_zh_test_references_exist(page):
    for ref in TEST_REF.findall(_read(page)):
        path, name = ref.split("::")
        file = ROOT / path
        assert file.is_file(), f"zh/{page.name}: {path} does not exist"
        assert re.search(rf"^def {name}\(", file.read_text(), re.M), f"{path} has no test function {name}"


@pytest.mark.parametrize("page", ZH_PAGES, ids=lambda p: p.name)
def test_zh_code_spans_are_not_broken_across_lines(page):
    for line in _prose(_read(page)).splitlines():
        assert line.count("`") % 2 == 0, f"zh/{page.name}: a code span breaks across lines near: {line!r}"


@pytest.mark.parametrize("page", ZH_PAGES, ids=lambda p: p.name)
def test_zh_minikv_commands_parse(page):
    text = _read(page)
    candidates = SPAN.findall(_prose(text))
    for m in FENCE.finditer(text):
        candidates += m.group(2).splitlines()
    parser = build_parser()
    for c in candidates:
        c = c.split(" #", 1)[0].strip()
        if not c.startswith("minikv "):
            continue
        try:
            parser.parse_args(shlex.split(c)[1:])
        except SystemExit as e:
            pytest.fail(f"zh/{page.name}: `{c}` does not parse (exit {e.code})")


@pytest.mark.parametrize("name", TRANSLATED)
def test_zh_page_keeps_every_number_of_the_english_page(name):
    missing = _numbers(_read(DOCS / name)) - _numbers(_read(ZH / name))
    assert not missing, f"zh/{name} lacks numbers of docs/{name}: {sorted(missing)}"


def test_glossary_rows_have_three_non_empty_cells():
    rows = [line for line in _read(ZH / "glossary.md").splitlines() if line.startswith("|")]
    header, separator, body = rows[0], rows[1], rows[2:]
    assert re.fullmatch(r"\|(\s*-+\s*\|){3}", separator), f"glossary: not a three-column table: {separator!r}"
    assert len(body) >= 40, f"glossary has {len(body)} terms, fewer than 40"
    for row in [header, *body]:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        assert len(cells) == 3 and all(cells), f"glossary row without three non-empty cells: {row!r}"
