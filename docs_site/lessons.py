"""The lesson code the step pages quote, kept in step with the textbook.

A step page quotes a lesson's function or class with a marker line and the fenced block after it::

    <!-- lesson: minikv/textbook/s3_paged.py::slot_mapping -->
    ```python
    def slot_mapping(block_table, positions: np.ndarray, block_size: int) -> np.ndarray:
        ...
    ```

The block must be the live source of that object (``inspect.getsource``, dedented). ``python
docs_site/lessons.py`` rewrites every quoted block of docs/*.md and docs/zh/*.md from the source;
tests/test_step_pages.py fails on a block that differs, so a page can never show stale lesson code.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUOTE = re.compile(r"^<!-- lesson: (minikv/textbook/\w+\.py)::([\w.]+) -->\n```python\n(.*?)^```$", re.S | re.M)


def source_of(path: str, name: str) -> str:
    """The dedented source of ``name`` (``Class``, ``function`` or ``Class.method``) in the lesson at ``path``."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    obj = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    for part in name.split("."):
        obj = getattr(obj, part)
    return textwrap.dedent(inspect.getsource(obj))


def quotes(text: str) -> list[tuple[str, str, str]]:
    """(path, name, quoted code) of every lesson quote of a page."""
    return [(m.group(1), m.group(2), m.group(3)) for m in QUOTE.finditer(text)]


def sync(text: str) -> str:
    """The page with every quoted block replaced by the live source."""
    return QUOTE.sub(lambda m: f"<!-- lesson: {m.group(1)}::{m.group(2)} -->\n```python\n"
                               f"{source_of(m.group(1), m.group(2))}```", text)


def main() -> int:
    for page in sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "docs" / "zh").glob("*.md")):
        text = page.read_text(encoding="utf-8")
        new = sync(text)
        if new != text:
            page.write_text(new, encoding="utf-8")
            print(f"updated {page.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
