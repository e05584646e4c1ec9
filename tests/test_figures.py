"""The step pages' figures (docs/figures/*.svg) are current: ``python docs/figures/make.py`` (``make figures``)
draws each from minikv's own code and numbers, deterministically, so redrawing them into a temporary folder
must give the committed files byte for byte. A stale figure fails here, naming the command that fixes it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "docs" / "figures"


@pytest.fixture(scope="module")
def make():
    pytest.importorskip("matplotlib", reason="the figures need matplotlib: pip install -e '.[notebooks]'")
    spec = importlib.util.spec_from_file_location("minikv_docs_figures", FIGURES / "make.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    for name in ("kit", "steps_1_4", "steps_5_8", "step_9"):  # make.py put its own folder on sys.path
        sys.modules.pop(name, None)


def test_every_committed_figure_is_drawn_by_make_py(make):
    committed = sorted(p.name for p in FIGURES.glob("*.svg"))
    assert committed == sorted(make.FIGURES), "docs/figures/*.svg and make.py's FIGURES differ"


def test_committed_figures_are_current(make, tmp_path):
    make.write_all(tmp_path)
    stale = [name for name in make.FIGURES if (tmp_path / name).read_bytes() != (FIGURES / name).read_bytes()]
    assert not stale, f"stale figures {stale}: run `python docs/figures/make.py` (make figures) and commit them"


def test_drawing_twice_gives_the_same_bytes(make, tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    make.write_all(first)
    make.write_all(second)
    for name in make.FIGURES:
        data = (first / name).read_bytes()
        assert data == (second / name).read_bytes(), f"{name} is not deterministic"
        assert b"<dc:date>" not in data and b"Matplotlib v" not in data, f"{name} carries a date or a version"
