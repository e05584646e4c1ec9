"""Every step page (docs/01..09_*.md and docs/zh/) is a lesson, in one shape (issue 21):

* the title carries the step number, and the page opens with its figure (docs/figures/, drawn by code);
* it quotes its textbook lesson, and every quoted block is the live source (docs_site/lessons.py);
* no test path in the body: the tests are listed once, in "Checked by" ("测试清单") near the end;
* it ends with its primary sources ("References", "参考文献"), which include the step's primary papers;
  every arXiv id on any page is well formed, and the bibliography (docs/references.md, zh) lists every
  source a step page cites.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
sys.path.insert(0, str(ROOT / "docs_site"))
from lessons import quotes, source_of  # noqa: E402

ORCA = "https://www.usenix.org/conference/osdi22/presentation/yu"
FLASH_DECODING = "https://crfm.stanford.edu/2023/10/12/flashdecoding.html"
ARC = "https://www.usenix.org/conference/fast-03/arc-self-tuning-low-overhead-replacement-cache"
PROMPT_LOOKUP = "https://github.com/apoorvumang/prompt-lookup-decoding"
VLLM_HYBRID = "https://docs.vllm.ai/en/latest/design/hybrid_kv_cache_manager/"
VLLM_RFC = "https://github.com/vllm-project/vllm/issues/11382"
STEPS = {  # step -> (page, lesson module, figure, primary sources: arXiv ids or official URLs)
    "1": ("01_naive_attention.md", "s1_attention", "01_recompute.svg", ["1706.03762", "1911.02150", "2305.13245"]),
    "2": ("02_kv_cache.md", "s2_kv_cache", "02_kv_cache.svg",
          ["1805.02867", "2205.14135", "2307.08691", FLASH_DECODING, "2104.09864"]),
    "3": ("03_paged.md", "s3_paged", "03_paged.svg", ["2309.06180", ORCA, "2403.02310", "2312.07104"]),
    "4": ("04_mla.md", "s4_mla", "04_mla.svg", ["2405.04434", "2412.19437"]),
    "5": ("05_quant.md", "s5_quant", "05_quant.svg", ["2402.02750", "2401.18079", "2209.05433"]),
    "6": ("06_window.md", "s6_window", "06_window.svg", ["2309.17453", "2306.14048", "2404.14469"]),
    "7": ("07_tiers_speculative.md", "s7_rollback", "07_tiers_speculative.svg",
          [ARC, "2211.17192", "2302.01318", PROMPT_LOOKUP]),
    "8": ("08_parallel.md", "s8_heads", "08_parallel.svg", ["1909.08053", "2401.09670"]),
    "9": ("09_hybrid.md", "s9_hybrid", "09_hybrid.svg", ["2503.19786", VLLM_HYBRID, VLLM_RFC]),
}
LANGS = {"en": (DOCS, "Step {n}", "## Checked by", "## References", "figures/"),
         "zh": (DOCS / "zh", "第 {n} 步", "## 测试清单", "## 参考文献", "../figures/")}
PAGES = [(lang, n) for lang in LANGS for n in STEPS]
ARXIV = re.compile(r"arXiv[: ](\d{4}\.\d{4,5})(?:v\d+)?")
ARXIV_LINK = re.compile(r"arxiv\.org/(?:abs|pdf)/(\d{4}\.\d{4,5})")
TEST_PATH = re.compile(r"tests/[\w/]+\.py")


def page(lang: str, n: str) -> str:
    return (LANGS[lang][0] / STEPS[n][0]).read_text(encoding="utf-8")


def parts(lang: str, n: str) -> tuple[str, str, str]:
    """(body, checked-by section, references section) of a step page."""
    text = page(lang, n)
    _, _, checked, refs, _ = LANGS[lang]
    assert text.count(f"\n{checked}\n") == 1, f"{lang} step {n}: no single {checked!r} section"
    assert text.count(f"\n{refs}\n") == 1, f"{lang} step {n}: no single {refs!r} section"
    body, rest = text.split(f"\n{checked}\n")
    assert refs in rest, f"{lang} step {n}: {refs!r} must come after {checked!r}"
    checked_by, references = rest.split(f"\n{refs}\n")
    assert not re.search(r"^## ", references, re.M), f"{lang} step {n}: the references must end the page"
    return body, checked_by, references


@pytest.mark.parametrize("lang, n", PAGES)
def test_title_has_the_step_number_and_the_figure_comes_first(lang, n):
    lines = [line for line in page(lang, n).splitlines() if line.strip()]
    assert lines[0].startswith("# " + LANGS[lang][1].format(n=n)), f"{lang} step {n}: title {lines[0]!r}"
    figure = LANGS[lang][4] + STEPS[n][2]
    assert re.fullmatch(rf"!\[[^\]]+\]\({re.escape(figure)}\)", lines[1]), \
        f"{lang} step {n}: the line after the title must be the figure ![...]({figure}), not {lines[1]!r}"
    assert (DOCS / "figures" / STEPS[n][2]).is_file()


@pytest.mark.parametrize("lang, n", PAGES)
def test_the_page_quotes_its_lesson_and_every_quote_is_current(lang, n):
    quoted = quotes(page(lang, n))
    assert any(path == f"minikv/textbook/{STEPS[n][1]}.py" for path, _, _ in quoted), \
        f"{lang} step {n} quotes nothing of minikv/textbook/{STEPS[n][1]}.py"
    for path, name, code in quoted:
        assert code == source_of(path, name), \
            f"{lang} step {n}: the quote of {path}::{name} is stale; run `python docs_site/lessons.py`"


@pytest.mark.parametrize("lang, n", PAGES)
def test_tests_are_listed_once_at_the_end_not_in_the_body(lang, n):
    body, checked_by, _ = parts(lang, n)
    assert not TEST_PATH.search(body), \
        f"{lang} step {n}: test paths in the body {TEST_PATH.findall(body)[:5]}; move them to the list at the end"
    assert re.search(r"tests/[\w/]+\.py::\w+", checked_by), f"{lang} step {n}: the list names no test"


@pytest.mark.parametrize("lang, n", PAGES)
def test_the_page_cites_its_primary_sources(lang, n):
    _, _, references = parts(lang, n)
    missing = [s for s in STEPS[n][3] if (f"arXiv:{s}" if "/" not in s else s) not in references]
    assert not missing, f"{lang} step {n}: references lack {missing}"


def _ids(text: str) -> set[str]:
    return set(ARXIV.findall(text)) | set(ARXIV_LINK.findall(text))


def test_arxiv_ids_are_well_formed_and_their_links_agree():
    for p in sorted(DOCS.glob("*.md")) + sorted((DOCS / "zh").glob("*.md")):
        text = p.read_text(encoding="utf-8")
        for i in _ids(text):
            yymm, number = i.split(".")
            yy, mm = int(yymm[:2]), int(yymm[2:])
            assert 7 <= yy and 1 <= mm <= 12, f"{p.name}: arXiv {i} has no valid year and month"
            assert len(number) == (5 if (yy, mm) >= (15, 1) else 4), f"{p.name}: arXiv {i}: wrong number width"
        for m in re.finditer(r"arXiv:(\d{4}\.\d{4,5})\]\(https://arxiv\.org/abs/([\d.]+)\)", text):
            assert m.group(1) == m.group(2), f"{p.name}: the text says arXiv:{m.group(1)}, the link {m.group(2)}"


@pytest.mark.parametrize("lang", LANGS)
def test_the_bibliography_lists_every_source_a_step_page_cites(lang):
    bibliography = (LANGS[lang][0] / "references.md").read_text(encoding="utf-8")
    for n in STEPS:
        _, _, references = parts(lang, n)
        missing = _ids(references) - _ids(bibliography)
        urls = set(re.findall(r"\((https?://[^)\s]+)\)", references)) - {f"https://arxiv.org/abs/{i}" for i in
                                                                         _ids(references)}
        missing |= {u for u in urls if u not in bibliography}
        assert not missing, f"{lang}: references.md lacks {sorted(missing)}, cited by step {n}"
