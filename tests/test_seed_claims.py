"""Coverage of the seed articles' claims by docs/claims.md.

``seed_claims.md`` (in the shared folder beside the seeds) lists the checkable claims by id
(``| 0.13 | ...``). A claim section of docs/claims.md that answers one names it on a line
``**Seed id:** 0.13`` (several ids: ``**Seed id:** 0.11, 4.7``). This test checks that every id
named is a real one, and that coverage only grows: ``COVERED`` is the set covered when it was
written, and removing a section's id (or the section) fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CLAIMS = ROOT / "docs" / "claims.md"
SEED_CLAIMS = [ROOT / "shared" / "seed_claims.md", ROOT.parent / "shared" / "seed_claims.md"]
SEED_ID_LINE = re.compile(r"^\*\*Seed id:\*\*\s*(.+?)\s*$", re.M)
TABLE_ID = re.compile(r"^\|\s*(\d+\.\d+)\s*\|", re.M)

COVERED = {  # the ids docs/claims.md answered when this test was written; the set may only grow
    "0.2", "0.3", "0.4", "0.5", "0.6", "0.7", "0.9", "0.11", "0.12", "0.13", "0.14",
    "1.1", "1.2", "1.3",
    "2.1", "2.2", "2.3", "2.4", "2.5", "2.6", "2.7", "2.8", "2.9", "2.10", "2.11", "2.13", "2.14", "2.15",
    "2.16",
    "3.1", "3.2", "3.3", "3.6", "3.9",
    "4.1", "4.2", "4.4", "4.5", "4.6", "4.7",
    # added with claims 40-54
    "0.1", "0.8", "0.10", "0.15", "0.16", "0.17", "0.18", "0.19", "1.4", "2.12",
    "3.4", "3.5", "3.7", "3.8", "3.10", "3.11", "4.3",
}


def _sections() -> dict[str, str]:
    parts = re.split(r"^## ", CLAIMS.read_text(encoding="utf-8"), flags=re.M)[1:]
    return {p.splitlines()[0].strip(): p for p in parts}


def _named_ids() -> dict[str, list[str]]:
    """Claim title -> the seed ids its ``**Seed id:**`` lines name."""
    named = {}
    for title, body in _sections().items():
        ids = [i.strip() for m in SEED_ID_LINE.finditer(body) for i in m.group(1).split(",")]
        if ids:
            named[title] = ids
    return named


def _seed_ids() -> set[str] | None:
    for path in SEED_CLAIMS:
        if path.exists():
            return set(TABLE_ID.findall(path.read_text(encoding="utf-8")))
    return None


def test_seed_id_lines_are_well_formed_and_unique():
    seen: dict[str, str] = {}
    for title, ids in _named_ids().items():
        for i in ids:
            assert re.fullmatch(r"\d+\.\d+", i), f"claim {title!r}: {i!r} is not a seed id like 2.9"
            assert i not in seen, f"seed id {i} is named by two claims: {seen[i]!r} and {title!r}"
            seen[i] = title


def test_every_named_seed_id_is_a_real_one():
    real = _seed_ids()
    if real is None:
        pytest.skip("seed_claims.md is not in this checkout")
    assert len(real) > 50
    for title, ids in _named_ids().items():
        unknown = set(ids) - real
        assert not unknown, f"claim {title!r} names seed ids that seed_claims.md does not list: {sorted(unknown)}"


def _by_id(ids: set[str]) -> list[str]:
    return sorted(ids, key=lambda s: tuple(map(int, s.split("."))))


def test_coverage_only_grows():
    covered = {i for ids in _named_ids().values() for i in ids}
    lost = COVERED - covered
    assert not lost, f"seed ids no longer answered by docs/claims.md: {_by_id(lost)}"
    real = _seed_ids()
    if real is not None:
        print(f"seed claims covered: {len(covered)} of {len(real)}; open: {_by_id(real - covered)}")
