"""The Chinese edition (docs/zh/) keeps the English numbers.

tests/test_docs.py holds docs/zh/*.md to every check of the English pages (links, repository paths and
names in code spans, test references, `minikv ...` commands, python blocks, unbroken code spans).
Here: every English page has a Chinese page, and the zh index links them all.
Parity: every number of an English page appears on its Chinese page; every interview question (## Qn.)
and every claim (## n.) of the English guide has its Chinese counterpart with the same number, and the
same tests back it.
The glossary: every row has three non-empty cells (English | 中文 | definition).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_docs import _read

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
ZH = DOCS / "zh"
TRANSLATED = sorted(p.name for p in DOCS.glob("*.md"))  # every English page has a Chinese version
REQUIRED = ["index.md", "glossary.md", *[n for n in TRANSLATED if n != "index.md"]]

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


@pytest.mark.parametrize("name", TRANSLATED)
def test_zh_page_keeps_every_number_of_the_english_page(name):
    missing = _numbers(_read(DOCS / name)) - _numbers(_read(ZH / name))
    assert not missing, f"zh/{name} lacks numbers of docs/{name}: {sorted(missing)}"


def _headings(text: str, pattern: str) -> dict[str, str]:
    """Section number -> its body, for headings such as "### Q7." (interview) or "## 12." (claims)."""
    parts = re.split(rf"(?m)^#{{2,3}} ({pattern})\.", text)
    return dict(zip(parts[1::2], parts[2::2]))


@pytest.mark.parametrize("name, pattern", [("interview.md", r"Q\d+"), ("claims.md", r"\d+")])
def test_every_question_and_claim_has_its_counterpart(name, pattern):
    en, zh = _headings(_read(DOCS / name), pattern), _headings(_read(ZH / name), pattern)
    assert list(en) == list(zh), f"zh/{name} sections {list(zh)} differ from docs/{name}'s {list(en)}"
    for key, body in en.items():
        tests = set(re.findall(r"tests/[\w/]+\.py::\w+", body))
        missing = tests - set(re.findall(r"tests/[\w/]+\.py::\w+", zh[key]))
        assert not missing, f"zh/{name} section {key} lacks the tests of the English one: {sorted(missing)}"


def test_glossary_rows_have_three_non_empty_cells():
    rows = [line for line in _read(ZH / "glossary.md").splitlines() if line.startswith("|")]
    header, separator, body = rows[0], rows[1], rows[2:]
    assert re.fullmatch(r"\|(\s*-+\s*\|){3}", separator), f"glossary: not a three-column table: {separator!r}"
    assert len(body) >= 40, f"glossary has {len(body)} terms, fewer than 40"
    for row in [header, *body]:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        assert len(cells) == 3 and all(cells), f"glossary row without three non-empty cells: {row!r}"
