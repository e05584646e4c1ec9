"""The ``minikv`` command. Each subcommand is a pair ``_add_<name>(subparsers)`` / ``_run_<name>(args)``.

    minikv generate --prompt "The capital of France is" --greedy
    minikv --help
"""

from __future__ import annotations

import argparse
import json
import sys

from minikv.errors import MinikvError


def _print_json(obj: dict) -> None:
    """The machine-readable summary: always one JSON line, printed last."""
    print(json.dumps(obj, ensure_ascii=False))


SUBCOMMANDS: list = []  # (add_parser_fn, run_fn), in the order --help lists them


def subcommand(add_fn):
    """Register ``add_fn(subparsers) -> parser``; the parser's ``func`` default runs it."""
    SUBCOMMANDS.append(add_fn)
    return add_fn


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="minikv",
        description="LLM KV caches from scratch: NumPy reference + CUDA kernels, proven equal.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for add_fn in SUBCOMMANDS:
        add_fn(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except MinikvError as e:
        print(f"minikv: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
