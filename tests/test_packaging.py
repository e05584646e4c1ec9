"""pyproject.toml and environment.yml list the same dependencies (conda users get what pip users get)."""

import re
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10: pip vendors the same parser
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def _pip_lines_of_environment_yml() -> set[str]:
    lines, in_pip = set(), False
    for raw in (ROOT / "environment.yml").read_text().splitlines():
        line = raw.split("#", 1)[0].rstrip()
        if re.match(r"^\s+- pip:\s*$", line):
            in_pip = True
            continue
        m = re.match(r"^\s+- (.+)$", line)
        if in_pip and m and raw.startswith(" " * 6):
            lines.add(m.group(1).strip())
    return lines


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    expected = set(project["dependencies"])
    for extra in ("ref", "dev", "notebooks", "docs", "parallel"):  # "gpu" (CuPy) is optional: environment.yml says how
        expected |= set(project["optional-dependencies"][extra])
    listed = _pip_lines_of_environment_yml()
    assert "-e ." in listed, "environment.yml must install minikv itself"
    listed.discard("-e .")
    assert listed == expected, f"only in environment.yml: {sorted(listed - expected)}; " \
                               f"only in pyproject.toml: {sorted(expected - listed)}"


def test_python_requirement_matches():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=3.10"
    assert "python>=3.10" in (ROOT / "environment.yml").read_text()
