"""The interview guide is built for revision (issue 21), in English and Chinese.

* The questions are grouped by topic in learning order: the topics' steps never go back.
* Each question carries one level tag, core or advanced.
* The table of contents lists every question of the page, with its title, level and anchor, in the order
  of the page, and nothing else; the one-page list (questions.md) does the same, linking to the answers.
* Question numbers are kept: they run 1..N with no gap, because tests and pages cite them by number.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LANGS = {"en": (ROOT / "docs", "## Contents", ("*Core.*", "*Advanced.*"), ("core", "advanced"), "step"),
         "zh": (ROOT / "docs" / "zh", "## 目录", ("*基础。*", "*进阶。*"), ("基础", "进阶"), "第")}
QUESTION = re.compile(r"^### (Q\d+)\. (.+)$", re.M)
ENTRY = re.compile(r"^- \[(Q\d+)\. (.+)\]\(([^)]*)#([^)]+)\) · (\S+)$", re.M)


def questions(lang: str) -> list[tuple[str, str, str]]:
    """(number, title, level word) of every question on the page, in page order."""
    folder, _, tags, words, _ = LANGS[lang]
    text = (folder / "interview.md").read_text(encoding="utf-8")
    found = []
    for m in QUESTION.finditer(text):
        tag = text[m.end():].lstrip("\n").split("\n", 1)[0]
        assert tag in tags, f"{lang} {m.group(1)}: the line after the heading must be a tag {tags}, not {tag!r}"
        found.append((m.group(1), m.group(2), words[tags.index(tag)]))
    return found


def entries(text: str, target: str) -> list[tuple[str, str, str, str]]:
    return [(m.group(1), m.group(2), m.group(4), m.group(5)) for m in ENTRY.finditer(text) if m.group(3) == target]


def slug(heading: str) -> str | None:
    if importlib.util.find_spec("pymdownx") is None:
        return None
    from pymdownx.slugs import slugify

    return slugify(case="lower")(heading, "-")  # mkdocs.yml's toc slugify, GitHub's anchors


@pytest.mark.parametrize("lang", LANGS)
def test_numbers_are_kept_and_each_question_has_one_tag(lang):
    numbers = sorted(int(n[1:]) for n, _, _ in questions(lang))
    assert numbers == list(range(1, len(numbers) + 1)), f"{lang}: question numbers {numbers} have gaps"
    assert len(numbers) >= 49


@pytest.mark.parametrize("lang", LANGS)
@pytest.mark.parametrize("page, target", [("interview.md", ""), ("questions.md", "interview.md")])
def test_the_contents_list_every_question_and_nothing_else(lang, page, target):
    folder, contents, _, _, _ = LANGS[lang]
    text = (folder / page).read_text(encoding="utf-8")
    if page == "interview.md":
        text = text.split(contents + "\n", 1)[1].split("\n## ", 1)[0]  # the table of contents only
    listed = entries(text, target)
    on_page = questions(lang)
    assert [(n, t, w) for n, t, _, w in listed] == on_page, \
        f"{lang} {page}: the list and the questions differ (numbers, titles, levels or order)"
    for n, title, anchor, _ in listed:
        want = slug(f"{n}. {title}")
        assert want is None or anchor == want, f"{lang} {page}: {n} links #{anchor}, the heading's anchor is #{want}"


@pytest.mark.parametrize("lang", LANGS)
def test_topics_follow_the_learning_order(lang):
    folder, _, _, _, step_word = LANGS[lang]
    text = (folder / "interview.md").read_text(encoding="utf-8")
    topics = re.findall(r"^## (\d+)\. .*?(?:steps?|第) (\d+)", text, re.M)
    assert len(topics) >= 8, f"{lang}: {topics}"
    assert [int(t) for t, _ in topics] == list(range(1, len(topics) + 1))
    steps = [int(s) for _, s in topics]
    assert steps == sorted(steps), f"{lang}: topics out of learning order: steps {steps}"
    # chunked prefill sits beside continuous batching, FlashAttention beside decode (issue 21)
    order = [n for n, _, _ in questions(lang)]
    assert abs(order.index("Q39") - order.index("Q15")) == 1
    assert order.index("Q38") < order.index("Q11") and order.index("Q38") < order.index("Q30")
