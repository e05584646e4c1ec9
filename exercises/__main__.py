"""``python -m exercises NAME [--reference] [pytest args...]``: run the lesson's tests on your function.

With no NAME: list the exercises. ``--reference``: the lesson's own function instead (passes).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from exercises import EXERCISES

ROOT = Path(__file__).resolve().parents[1]


def command(name: str) -> list[str]:
    """The pytest command line that checks exercise ``name``."""
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "exercises.plugin",
            *EXERCISES[name].tests]


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "list"):
        print(__doc__)
        for name, ex in EXERCISES.items():
            print(f"  {name:24s} step {ex.step}: exercises/{ex.stub}.py")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in EXERCISES:
        print(f"no exercise {name!r}; one of: {', '.join(EXERCISES)}", file=sys.stderr)
        return 2
    use = "stub"
    if "--reference" in rest:
        rest.remove("--reference")
        use = "reference"
    env = {**os.environ, "MINIKV_EXERCISE": name, "MINIKV_EXERCISE_USE": use}
    return subprocess.call(command(name) + rest, cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
