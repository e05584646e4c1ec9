"""Drawing helpers for the step figures: cells, rows of cells, boxes, arrows, one palette.

A figure is drawn on a canvas whose units are cells (y grows downwards, as one reads), then saved as
SVG with nothing that changes between runs: a fixed ``svg.hashsalt`` for the ids, no date, no creator,
glyphs as paths from the font matplotlib ships (so no installed font changes a byte).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyBboxPatch, Rectangle  # noqa: E402


class C:
    """The palette."""

    INK, MUTED, GRID = "#1f2430", "#6b7280", "#9ca3af"
    BLUE, LIGHT, ORANGE, GREEN, RED = "#4c78a8", "#b9d3ee", "#f58518", "#54a24b", "#e45756"
    GREY, WHITE, PURPLE, PALE_GREEN, YELLOW = "#e5e7eb", "#ffffff", "#b279a2", "#c7e9c0", "#eeca3b"


INK, WHITE = C.INK, C.WHITE

STYLE = {"svg.hashsalt": "minikv", "svg.fonttype": "path", "font.family": "DejaVu Sans", "font.size": 10,
         "axes.edgecolor": C.INK, "axes.labelcolor": C.INK, "xtick.color": C.INK, "ytick.color": C.INK,
         "text.color": C.INK, "figure.dpi": 100}
plt.rcParams.update(STYLE)


def canvas(width: float, height: float, scale: float = 0.42):
    """A figure whose axes span ``width`` x ``height`` cell units, y pointing down, no frame."""
    fig = plt.figure(figsize=(width * scale, height * scale))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(height, 0)
    ax.set_aspect("equal")
    ax.axis("off")
    return fig, ax


def cell(ax, x, y, text="", fc=WHITE, ec=INK, w=1.0, h=1.0, size=8, color=INK, hatch=None, lw=0.8):
    """One cell with its top-left corner at (x, y) and ``text`` centred in it."""
    ax.add_patch(Rectangle((x, y), w, h, facecolor=fc, edgecolor=ec, lw=lw, hatch=hatch))
    if text != "":
        ax.text(x + w / 2, y + h / 2, str(text), ha="center", va="center", fontsize=size, color=color)


def cells(ax, x, y, items, w=1.0, h=1.0, size=8, **kw):
    """A row of cells from (x, y) rightwards; ``items`` are (text, facecolor) pairs."""
    for i, (text, fc) in enumerate(items):
        cell(ax, x + i * w, y, text, fc=fc, w=w, h=h, size=size, **kw)


def box(ax, x, y, w, h, text="", fc=WHITE, ec=INK, size=9, color=INK, weight="normal", lw=1.0, round_=True):
    """A labelled box (rounded unless ``round_`` is False)."""
    style = "round,pad=0,rounding_size=0.25" if round_ else "square,pad=0"
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle=style, facecolor=fc, edgecolor=ec, lw=lw))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size, color=color,
                fontweight=weight, linespacing=1.3)


def label(ax, x, y, text, size=9, ha="left", va="center", color=INK, weight="normal", style="normal"):
    ax.text(x, y, text, ha=ha, va=va, fontsize=size, color=color, fontweight=weight, fontstyle=style,
            linespacing=1.3)


def arrow(ax, start, end, color=INK, text="", size=8, lw=1.1, rad=0.0, text_at=0.5, offset=(0.0, -0.35),
          style="-|>"):
    """An arrow from ``start`` to ``end`` (curved by ``rad``), with ``text`` near the point ``text_at`` of it."""
    ax.annotate("", xy=end, xytext=start, arrowprops=dict(arrowstyle=style, color=color, lw=lw,
                                                          connectionstyle=f"arc3,rad={rad}",
                                                          shrinkA=1, shrinkB=1))
    if text:
        x = start[0] + (end[0] - start[0]) * text_at + offset[0]
        y = start[1] + (end[1] - start[1]) * text_at + offset[1]
        ax.text(x, y, text, ha="center", va="center", fontsize=size, color=color)


def title(ax, x, y, text, size=10.5):
    label(ax, x, y, text, size=size, weight="bold")


def save(fig, path: Path) -> None:
    """The SVG, byte for byte the same on every run."""
    fig.savefig(path, format="svg", bbox_inches="tight", pad_inches=0.06, metadata={"Date": None, "Creator": None})
    plt.close(fig)
