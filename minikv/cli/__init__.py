"""The ``minikv`` command. Each subcommand has an ``add_<name>(subparsers)`` in a module of this package,
which sets the parser's ``func`` to its ``_run_<name>(args)``; ``common`` holds the flag table they share.

    minikv generate --prompt "The capital of France is" --greedy
    minikv --help

Bad input never ends in a traceback: every flag is checked (``common.check_args``)
before a subcommand starts, and every refusal is one line on stderr, exit code 2.
"""

from __future__ import annotations

import os
import sys

from minikv.cli import bench, compare, memory, mpi_start, perplexity, text
from minikv.cli.common import Parser, check_args, one_line
from minikv.errors import MinikvError, ParallelError

# the order --help lists them in
SUBCOMMANDS = [text.add_generate, text.add_demo, perplexity.add_perplexity, memory.add_memory, compare.add_compare,
               bench.add_bench]


def build_parser() -> Parser:
    parser = Parser(
        prog="minikv",
        description="LLM KV caches from scratch: NumPy reference + CUDA kernels, proven equal.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for add_fn in SUBCOMMANDS:
        add_fn(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``minikv`` with ``argv`` (default: ``sys.argv[1:]``); the exit code (2: refused input).

    argparse's refusals raise ``SystemExit(2)``; refusals of values it parsed return 2. What the streams
    do is handled in one line too: Ctrl-C exits 130 (128 + SIGINT, as a shell reports it), a reader that
    closed stdout (``| head -c 1``) ends the run with 141 (128 + SIGPIPE), and a stdout that cannot encode
    some text (``PYTHONIOENCODING=ascii``) gets it escaped (``\\xe9``) rather than a traceback.
    """
    parser = build_parser()
    if getattr(sys.stdout, "errors", None) == "strict" and hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="backslashreplace")
    try:
        # under mpiexec: in MPI before any check, argparse's refusals raised to be agreed (minikv.cli.mpi_start)
        Parser.raising = mpi_start.join() is not None
        args = parser.parse_args(argv)
        if Parser.raising and not hasattr(args, "tp"):
            raise ParallelError(f"minikv {args.command} runs in one process (it has no --tp/--cp); run it "
                                "without mpiexec")
        check_args(args)
        return int(args.func(args) or 0)
    except MinikvError as e:
        return _refused(e)
    except KeyboardInterrupt:
        return _say("minikv: interrupted (Ctrl-C); nothing was saved", 130)
    except BrokenPipeError:
        # the reader is gone: point stdout at /dev/null so the interpreter's last flush cannot fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return _say("minikv: stdout was closed by its reader (broken pipe); stopped", 141)


def _refused(e: MinikvError) -> int:
    """One line on stderr, exit 2; under mpiexec the ranks agree first and rank 0 alone prints."""
    try:
        mpi_start.agree(f"{type(e).__name__}: {one_line(e)}")
    except MinikvError as agreed:
        e = agreed
    if mpi_start.silent_about(e):
        return 2
    code = _say(f"minikv: error: {type(e).__name__}: {one_line(e)}", 2)
    mpi_start.abort_after(e)
    return code


def _say(line: str, code: int) -> int:
    """Print ``line`` on stderr (if stderr itself is gone, say nothing) and return ``code``."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass
    return code
