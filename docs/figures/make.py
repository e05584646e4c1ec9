"""Draw every figure of the step pages into docs/figures/*.svg (``make figures``).

    python docs/figures/make.py              # rewrite docs/figures/*.svg
    python docs/figures/make.py --out DIR    # write them elsewhere (tests/test_figures.py compares the two)
    python docs/figures/make.py --png DIR    # PNG previews, for a quick look

Each figure is a function of minikv's own code and numbers (the costs, the presets), so a change to
either shows up as a stale figure: the SVG output is deterministic, and the test regenerates every
figure and compares it byte for byte with the committed one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]  # kit and the step modules; this checkout's minikv

import step_9  # noqa: E402
import steps_1_4  # noqa: E402
import steps_5_8  # noqa: E402
from kit import plt, save  # noqa: E402

FIGURES = {  # file name -> the function that draws it
    "01_recompute.svg": steps_1_4.fig_recompute,
    "02_kv_cache.svg": steps_1_4.fig_kv_cache,
    "02_flash_io.svg": steps_1_4.fig_flash_io,
    "03_paged.svg": steps_1_4.fig_paged,
    "04_mla.svg": steps_1_4.fig_mla,
    "05_quant.svg": steps_5_8.fig_quant,
    "06_window.svg": steps_5_8.fig_window,
    "07_tiers_speculative.svg": steps_5_8.fig_tiers,
    "08_parallel.svg": steps_5_8.fig_parallel,
    "09_hybrid.svg": step_9.fig_hybrid,
}


def write_all(out: Path, png: bool = False) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, draw in FIGURES.items():
        fig = draw()
        if png:
            path = out / name.replace(".svg", ".png")
            fig.savefig(path, dpi=110, bbox_inches="tight")
            plt.close(fig)
        else:
            path = out / name
            save(fig, path)
        written.append(path)
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE, help="folder for the SVGs (default: docs/figures)")
    parser.add_argument("--png", type=Path, help="write PNG previews to this folder instead")
    args = parser.parse_args(argv)
    for path in write_all(args.png or args.out, png=args.png is not None):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
