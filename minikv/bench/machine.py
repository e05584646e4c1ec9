"""Where a measurement ran: every benchmark result records this next to its numbers."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (Linux), else whatever platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def source_commit() -> str | None:
    """The commit of minikv's checkout that ran the benchmark, with ``+changes`` when its code (``minikv/``,
    ``benchmarks/`` less the results) differs from it; None outside a git checkout of minikv (an installed
    wheel, even one inside another repository)."""
    root = Path(__file__).resolve().parents[2]

    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], cwd=root, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != root:
            return None
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", "minikv", "benchmarks",
                    ":(exclude)benchmarks/results")
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+changes" if dirty else "")


def machine_info(packages: tuple[str, ...] = ("numpy",)) -> dict:
    """CPU, cores, OS, Python, the versions of ``packages`` that are installed, the date (UTC), and
    the commit of the code that ran (``source_commit``)."""
    versions = {}
    for name in packages:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "packages": versions,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": source_commit(),
    }


def describe(info: dict) -> str:
    """One line for the end of a benchmark's printout."""
    pk = ", ".join(f"{k} {v}" for k, v in info["packages"].items() if v)
    return f"machine: {info['cpu']}, {info['cores']} cores, {info['os']}, python {info['python']}, {pk}"


def write_result(path: str | os.PathLike, payload: dict) -> Path:
    """Write a benchmark's JSON (pretty, stable key order) and return its path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    return path
