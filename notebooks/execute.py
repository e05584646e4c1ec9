"""Execute notebooks top to bottom and write their outputs back, so GitHub shows the plots.

    python notebooks/execute.py                      # every notebooks/*.ipynb
    python notebooks/execute.py notebooks/01_naive_attention.ipynb [--timeout 600]

Each notebook runs in a fresh ``python3`` kernel whose working directory is
``notebooks/``; a cell that raises stops the run with a non-zero exit status and
leaves the file untouched. ``tests/test_notebooks.py`` uses ``run_notebook`` to
execute the same notebooks in memory, without writing.

Progress bars print many carriage-return updates; before a notebook is saved
each stream output keeps only the last state of every line, so the committed
file shows the finished bar instead of hundreds of frames.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent


def _last_frame(text: str) -> str:
    """What a terminal would show: for each line, the text after its last carriage return."""
    lines = text.split("\n")
    return "\n".join(line.rstrip("\r").rsplit("\r", 1)[-1] for line in lines)


def clean_progress_output(nb) -> None:
    """Collapse carriage-return animation (tqdm) in every stream output, in place."""
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                out["text"] = _last_frame(out["text"])


def run_notebook(path: str | Path, timeout: int = 600):
    """Execute the notebook at ``path`` in a fresh kernel and return it with outputs (nothing is written).

    timeout: seconds allowed per cell. Raises ``nbclient.exceptions.CellExecutionError``
    (naming the cell and the error) if any cell fails.
    """
    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                            coalesce_streams=True, resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    clean_progress_output(nb)
    return nb


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path,
                        help="notebooks to execute (default: every notebooks/*.ipynb)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds allowed per cell (default 600)")
    args = parser.parse_args(argv)
    paths = args.notebooks or sorted(HERE.glob("*.ipynb"))
    if not paths:
        parser.error(f"no notebooks found in {HERE}")
    for path in paths:
        if not path.is_file():
            parser.error(f"{path} does not exist")
    for path in paths:
        t0 = time.perf_counter()
        nb = run_notebook(path, args.timeout)
        nbformat.write(nb, path)
        print(f"{path}: executed in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
