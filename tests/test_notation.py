"""One notation on every page (issue 13): the letters docs/index.md defines mean the same thing everywhere.

P prompt tokens, G generated tokens, T tokens in this forward pass, S keys a query attends, N sequences
sharing a pool, R positions reserved (a slab), b block size, W window, n_sink sinks, budget / n_recent for an evicting
cache, g = Hq / Hkv; step-local: MLA's r, dr, Dl = r + dr, KIVI's n_res and gs.
Before this pass S meant prompt tokens on one page, keys on another, sequences or sinks on others; the
patterns below are those old uses, and each must be gone from the English and Chinese pages and from the
notebooks' text.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from minikv.cli import main

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "docs" / "zh").glob("*.md"))
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

OLD_USES = {  # pattern of an old use -> what the convention writes instead
    r"\(S \+ T\)|S \+ T = max_len": "P + G (prompt + generated)",
    r"`S` prompt|\$S\$ prompt": "P for prompt tokens",
    r"`T` generated|\$T\$ generated": "G for generated tokens",
    r"`S` sequences|\$S\$ running sequences|\(S x R\)": "N for the sequences sharing a pool",
    r"\bS sinks|sinks=S\b|\$S\$ sinks|k < S\b|W - S\b": "n_sink for the attention sinks",
    r"\bR \+ P\b|W = R \+ P": "r + dr (MLA's latent and RoPE dims), Dl for their sum",
    r"R = B ?/ ?2|B = 64: ppl|at B = 128|\$B = \d+\$": "budget / n_recent for an evicting cache",
    r"`ctx`": "S for the keys a token attends",
    r"slot of `?max_len|for every slot\b|length and cache slot|`R` slots|R reserved slots|预留的槽位数": (
        "slab for a sequence's region (a slot is one token row)"),
}


def _texts():
    for page in PAGES:
        yield page.relative_to(ROOT).as_posix(), page.read_text(encoding="utf-8")
    for nb in NOTEBOOKS:  # the text a reader sees: markdown cells and code comments
        cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
        yield nb.relative_to(ROOT).as_posix(), "\n".join("".join(c["source"]) for c in cells)


@pytest.mark.parametrize("pattern, fix", list(OLD_USES.items()), ids=list(OLD_USES.values()))
def test_no_page_keeps_an_old_meaning(pattern, fix):
    hits = [f"{name}: {m.group(0)!r}" for name, text in _texts() for m in re.finditer(pattern, text)]
    assert not hits, f"old notation (write {fix}): {hits[:8]}"


def test_index_defines_every_letter():
    conventions = (ROOT / "docs" / "index.md").read_text(encoding="utf-8").split("## Conventions", 1)[1]
    for letter in ["`P`", "`G`", "`T`", "`S`", "`N`", "`R`", "`b`", "`W`", "`n_sink`", "`budget`", "`n_recent`",
                   "`g = Hq / Hkv`", "`r`", "`dr`", "`Dl = r + dr`", "`n_res`", "`gs`"]:
        assert letter in conventions, f"docs/index.md's conventions do not define {letter}"


def test_memory_report_prints_the_same_letters(capsys):
    assert main(["memory", "--preset", "llama3-8b", "--prompt-len", "100", "--output-len", "28"]) == 0
    out = capsys.readouterr().out
    assert "batch B = 1 x (prompt P = 100 + generated G = 28) = 128 tokens per sequence" in out
    assert "attention scores (S = 128 keys)" in out
    assert "no cache (rerun T = 128 tokens)" in out
    assert "generating G = 28 tokens after a P = 100-token prompt" in out
