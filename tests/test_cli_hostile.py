"""Hostile arguments to every subcommand: exit 2, one line on stderr that names the flag, never a traceback.

No model runs here. Every hostile value is refused before a model loads; the
argv that would otherwise run points ``--model`` at a file that is no model, so
a value that slipped through would be refused for ``--model`` instead, and the
test would fail on the flag it names.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minikv.cli import build_parser, main
from minikv.cli.common import FLOAT_FLAGS, INT_FLAGS

# text that int() refuses (" 7 ", "1_0" and other scripts' digits are integers to Python, so not here)
NOT_INTS = ["", "abc", "1.5", "1e3", "0x10", "--", "nan", "½", "1 2", "+-1"]
NOT_FLOATS = ["", "abc", "nan", "inf", "-inf", "1e999", "-1e999", "0x1p3", "1,5"]
MODEL_FILES = {"missing": None, "directory": None, "empty": b"", "junk": b"\x8c\x08\xbf\x22 not a model",
               "gguf junk": b"GGUF" + bytes(range(256)) * 4}
# token ids on the command line that parse_ids refuses (the vocabulary bound needs a model: see below)
NOT_IDS = ["", " ", "abc", "-1", "1.5", "1,,2", ",1", "1,", "1;2", "0x10", "½", "1e3", "+1", "9" * 30, "1 -2"]
# input files: kind -> content (None: no such file, or a directory); the ids-only kinds are valid text
INPUT_FILES = {"missing": None, "directory": None, "empty": b"", "blank": b" \n\t\n", "not utf-8": b"\xff\xfe\x00ab",
               "not ids": b"1, 2, abc", "negative ids": b"3 -1 4", "empty entry": b"1,,2"}
TEXT_FILE_KINDS = ("missing", "directory", "empty", "blank", "not utf-8")
GOOD_IDS = b"1, 2, 3\n4 5"  # five ids: valid for any vocabulary of more than 5 tokens


@pytest.fixture(scope="module")
def bad_models(tmp_path_factory) -> dict[str, str]:
    """kind -> a --model path that is not a usable GGUF file."""
    root = tmp_path_factory.mktemp("bad_models")
    paths = {"missing": root / "nope.gguf", "directory": root}
    for kind, data in MODEL_FILES.items():
        if data is not None:
            paths[kind] = root / f"{kind.replace(' ', '_')}.gguf"
            paths[kind].write_bytes(data)
    return {kind: str(p) for kind, p in paths.items()}


@pytest.fixture(scope="module")
def input_files(tmp_path_factory) -> dict[str, str]:
    """kind -> a --text-file/--ids-file path (see INPUT_FILES), plus "good": five valid ids."""
    root = tmp_path_factory.mktemp("inputs")
    paths = {"missing": root / "nope.txt", "directory": root}
    for kind, data in {**INPUT_FILES, "good": GOOD_IDS}.items():
        if data is not None:
            paths[kind] = root / f"{kind.replace(' ', '_')}.txt"
            paths[kind].write_bytes(data)
    return {kind: str(p) for kind, p in paths.items()}


GOOD_IDS_FILE = "<good ids file>"  # replaced by input_files["good"] in hostile_argv


def base_argv(command: str, bad_model: str, flag: str = "") -> list[str]:
    """An argv of ``command`` that would run (a benchmark, or up to loading ``bad_model``).

    ``flag`` is the one about to be added: a flag exclusive with one in the argv replaces it.
    """
    prompt = [] if flag == "--prompt-ids" else ["--prompt", "hi"]
    source = [] if flag == "--text-file" else ["--ids-file", GOOD_IDS_FILE]
    return {"generate": ["generate", *prompt, "--model", bad_model],
            "demo": ["demo", "--model", bad_model],
            "perplexity": ["perplexity", *source, "--model", bad_model],
            "memory": ["memory", "--preset", "smollm2-135m"],
            "compare": ["compare", *prompt, "--backend", "sim", "--model", bad_model],
            "bench": ["bench", "batching", "--requests=1"]}[command]


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def _flags() -> list[tuple[str, str, str, tuple]]:
    """(command, flag, kind, choices) for every option that takes a value, and bench's positional name."""
    out = []
    for command, p in _subparsers().items():
        for a in p._actions:
            if not a.option_strings:
                if a.choices:
                    out.append((command, a.dest, "positional", tuple(a.choices)))
                continue
            flag = a.option_strings[-1]
            if a.nargs == 0 or flag in ("--help", "-h"):
                continue  # store_true / --tied: nothing hostile to pass
            if a.choices:
                out.append((command, flag, "choice", tuple(a.choices)))
            elif a.type is int:
                out.append((command, flag, "int", ()))
            elif a.type is float:
                out.append((command, flag, "float", ()))
            elif flag == "--model":
                out.append((command, flag, "model", ()))
            elif flag == "--prompt":
                out.append((command, flag, "text", ()))
            elif flag == "--prompt-ids":
                out.append((command, flag, "ids", ()))
            elif flag in ("--text-file", "--ids-file"):
                out.append((command, flag, "file", ()))
            elif flag == "--nll-file":
                out.append((command, flag, "outfile", ()))
            else:
                out.append((command, flag, "unknown", ()))
    return out


FLAGS = _flags()


def test_every_flag_has_a_rule():
    """A new integer or float flag cannot skip the checks: the table must have a row for it."""
    assert {c for c, *_ in FLAGS} == {"generate", "demo", "perplexity", "memory", "compare", "bench"}
    for command, flag, kind, _ in FLAGS:
        assert kind != "unknown", f"{command} {flag}: no hostile values defined for it"
        if kind == "int":
            assert flag in INT_FLAGS, f"{command} {flag} has no row in INT_FLAGS"
        if kind == "float":
            assert flag in FLOAT_FLAGS, f"{command} {flag} has no row in FLOAT_FLAGS"


def hostile(kind: str, flag: str, choices: tuple) -> st.SearchStrategy[str]:
    """Values of ``flag`` that must be refused."""
    if kind == "int":
        lo, hi, _ = INT_FLAGS[flag]
        return st.one_of(st.integers(max_value=lo - 1).map(str), st.integers(min_value=hi + 1).map(str),
                         st.sampled_from(NOT_INTS))
    if kind == "float":
        lo, hi, inclusive, _ = FLOAT_FLAGS[flag]
        below = st.floats(max_value=lo, exclude_max=inclusive, allow_nan=False, allow_infinity=False)
        above = st.floats(min_value=hi, exclude_min=True, allow_nan=False) if math.isfinite(hi) else st.nothing()
        return st.one_of(below.map(repr), above.map(repr), st.sampled_from(NOT_FLOATS))
    if kind == "choice":
        return st.text(max_size=12).filter(lambda s: s not in choices)
    if kind == "positional":  # a leading '-' would make it an option (and -h prints help)
        return st.text(max_size=12).filter(lambda s: s not in choices and not s.startswith("-"))
    if kind == "model":
        return st.sampled_from(sorted(MODEL_FILES))
    if kind == "ids":
        return st.one_of(st.sampled_from(NOT_IDS), st.integers(max_value=-1).map(str),
                         st.text(alphabet=" ,;-.x", max_size=6))
    if kind == "file":
        return st.sampled_from(file_kinds(flag))
    if kind == "outfile":  # an output path that cannot be written: a directory, a missing folder, nothing
        return st.sampled_from(["/", "/no/such/folder/curve.json", ""])
    return st.just("")  # --prompt


def file_kinds(flag: str) -> list[str]:
    """The bad INPUT_FILES kinds for ``flag`` (some are valid text for --text-file)."""
    return sorted(TEXT_FILE_KINDS if flag == "--text-file" else INPUT_FILES)


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """``minikv argv`` in-process: (exit code, stdout, stderr); argparse's SystemExit is an exit code too."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


def hostile_argv(command: str, flag: str, kind: str, value: str, bad_models: dict, inputs: dict) -> list[str]:
    argv = [inputs["good"] if a == GOOD_IDS_FILE else a for a in base_argv(command, bad_models["junk"], flag)]
    if kind == "positional":
        return [command, value] + argv[2:]
    if kind == "model":
        value = bad_models[value]
    if kind == "file":
        value = inputs[value]
    return argv + [f"{flag}={value}"]  # --flag=value: a value that starts with '-' stays a value


def assert_refused(argv: list[str], names: str) -> str:
    rc, out, err = run_cli(argv)
    lines = err.strip().splitlines()
    assert "Traceback" not in err, f"{argv}: traceback\n{err}"
    assert rc == 2, f"{argv}: exit {rc}, stderr {err!r}"
    assert len(lines) == 1 and "error" in lines[0], f"{argv}: stderr is not one error line: {err!r}"
    assert names in lines[0], f"{argv}: the error does not name {names}: {lines[0]}"
    assert out == "", f"{argv}: printed {out!r} before refusing"
    return lines[0]


@settings(max_examples=120, deadline=None)
@given(data=st.data())
def test_hostile_arguments_are_refused_in_one_line(data, bad_models, input_files):
    command, flag, kind, choices = data.draw(st.sampled_from(FLAGS), label="flag")
    value = data.draw(hostile(kind, flag, choices), label="value")
    assert_refused(hostile_argv(command, flag, kind, value, bad_models, input_files), flag)


def _edge_values(kind: str, flag: str) -> list[str]:
    if kind == "int":
        lo, hi, _ = INT_FLAGS[flag]
        return [str(lo - 1), str(hi + 1), "abc"]
    if kind == "float":
        return ["nan", "inf", repr(FLOAT_FLAGS[flag][0] - 1)]
    if kind in ("choice", "positional"):
        return ["bogus", ""] if kind == "choice" else ["bogus"]
    if kind == "ids":
        return NOT_IDS
    if kind == "file":
        return file_kinds(flag)
    return sorted(MODEL_FILES) if kind == "model" else [""]


@pytest.mark.parametrize("command, flag, kind, choices", FLAGS, ids=[f"{c} {f}" for c, f, *_ in FLAGS])
def test_every_flag_refuses_its_edges(command, flag, kind, choices, bad_models, input_files):
    """Each flag's nearest bad values, deterministically (the property test samples the rest)."""
    for value in _edge_values(kind, flag):
        assert_refused(hostile_argv(command, flag, kind, value, bad_models, input_files), flag)


def test_a_length_past_the_context_is_refused_before_the_model_is_built():
    line = assert_refused(["compare", "--prompt", "hi", "--random", "--backend", "sim",
                           "--max-new-tokens", "100000000"], "--max-new-tokens")
    assert "max_position=8192" in line and "<= 8191" in line


@pytest.mark.parametrize("extra, names", [
    (["--prefill", "5"], "--prefill=5 is outside [1, 4]"),   # the five ids leave 4 positions to feed
    (["--prefill", "3", "--max-tokens", "3"], "--prefill=3 is outside [1, 2]"),
    (["--max-tokens", "1"], "--max-tokens=1"),
    (["--max-tokens", "0"], "--max-tokens=0"),
])
def test_perplexity_refuses_a_prefill_that_leaves_nothing_to_score(extra, names, bad_models, input_files):
    assert_refused(["perplexity", "--ids-file", input_files["good"], "--model", bad_models["junk"], *extra], names)


def test_perplexity_needs_exactly_one_input(bad_models, input_files):
    assert_refused(["perplexity", "--model", bad_models["junk"]], "--text-file")
    assert_refused(["perplexity", "--ids-file", input_files["good"], "--text-file", input_files["good"]],
                   "--text-file")
    one_id = input_files["directory"] + "/one_id.txt"
    with open(one_id, "w") as f:
        f.write("7\n")
    assert_refused(["perplexity", "--ids-file", one_id, "--model", bad_models["junk"]], "has 1 token(s)")


def test_prompt_and_prompt_ids_are_exclusive_and_checked(bad_models):
    assert_refused(["generate", "--prompt", "hi", "--prompt-ids", "1,2", "--model", bad_models["junk"]],
                   "--prompt-ids")
    assert_refused(["generate", "--model", bad_models["junk"]], "--prompt")
    assert_refused(["generate", "--prompt-ids", "1,2", "--chat", "--model", bad_models["junk"]], "--chat")
    line = assert_refused(["generate", "--prompt-ids", "1,x", "--model", bad_models["junk"]], "--prompt-ids")
    assert "entry 1 is 'x'" in line
    # no model needed to know SmolLM2's vocabulary under --random
    line = assert_refused(["compare", "--random", "--backend", "sim", "--prompt-ids", "1 49152"], "--prompt-ids")
    assert "token id 49152" in line and "[0, 49152)" in line


@pytest.mark.model
@pytest.mark.parametrize("argv", [
    ["perplexity", "--ids-file", "<ids>"], ["generate", "--prompt-ids", "5,49152,3"],
    ["compare", "--backend", "sim", "--prompt-ids", "5 49153"], ["demo", "--prompt-ids", "99999"],
])
def test_ids_past_the_vocabulary_are_refused_once_the_model_is_known(argv, smollm2_path, tmp_path):
    ids = tmp_path / "ids.txt"
    ids.write_text("1 2 3 49152 4")
    argv = [str(ids) if a == "<ids>" else a for a in argv]
    flag = "--ids-file" if "--ids-file" in argv else "--prompt-ids"
    line = assert_refused(argv + ["--model", str(smollm2_path)], flag)
    assert "vocabulary [0, 49152)" in line


def test_a_checkpoint_directory_without_minikv_checkpoints_is_refused(monkeypatch, tmp_path):
    import sys

    monkeypatch.setitem(sys.modules, "minikv.weights.checkpoints", None)  # importing it raises ImportError
    line = assert_refused(["generate", "--prompt-ids", "1,2", "--model", str(tmp_path)], "--model")
    assert "ModelFormatError" in line and "minikv.weights.checkpoints" in line


@pytest.mark.parametrize("command", ["generate", "perplexity"])
@pytest.mark.parametrize("cache", ["contiguous", "none"])
def test_a_quantized_kv_dtype_on_a_layout_without_blocks_is_refused(command, cache, bad_models, input_files):
    argv = [inputs if a == GOOD_IDS_FILE else a for a in base_argv(command, bad_models["junk"])
            for inputs in [input_files["good"]]]
    line = assert_refused([*argv, "--cache", cache, "--kv-dtype", "int8"], f"--cache {cache} --kv-dtype int8")
    assert "use --cache paged" in line
    # fp32 is the plain cache: any layout takes it (then the junk model is what is refused)
    assert_refused([*argv, "--cache", cache, "--kv-dtype", "fp32"], "--model")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
    """A 2-layer GGUF whose cache takes 256 bytes a token (head_dim 8: the smallest the GPU kernels take)."""
    from minikv.weights.random_models import random_model
    from tests.test_gguf import TINY_TOKENS, write_tiny_gguf

    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_tiny_gguf(path, random_model(num_layers=2, hidden_size=16, num_heads=2, num_kv_heads=2, head_dim=8,
                                       intermediate_size=12, vocab_size=len(TINY_TOKENS), max_position=64, seed=1))
    return str(path)


BIG = "2147483640"  # a multiple of 8, so that --residual stays a multiple of --group 8
# every subcommand with a flag that sizes a cache: (argv, the start of the refusal that names the flag)
CACHE_SIZE_FLAGS = [
    (["generate", "--prompt", "hi", "--cache", "paged", "--block-size", BIG], "--block-size=2,147,483,640 needs"),
    (["generate", "--prompt", "hi", "--kv-dtype", "kivi4", "--group", "8", "--residual", BIG],
     "--residual=2,147,483,640 needs"),
    (["generate", "--prompt", "hi", "--cache", "window", "--window", BIG], "--window=2,147,483,640 needs"),
    (["generate", "--prompt", "hi", "--cache", "h2o", "--budget", BIG], "--budget=2,147,483,640 needs"),
    (["generate", "--prompt", "hi", "--cache", "window", "--window", "4", "--layout", "paged", "--block-size", BIG],
     "--block-size=2,147,483,640 needs"),
    (["generate", "--prompt", "hi", "--cache", "window", "--window", "4", "--positions", "in-cache", "--layout",
      "paged", "--max-new-tokens", BIG], "max_len (prompt + --max-new-tokens)=2,147,483,642 needs"),
    (["perplexity", "--ids-file", "<ids>", "--cache", "paged", "--block-size", BIG], "--block-size=2,147,483,640"),
    (["perplexity", "--ids-file", "<ids>", "--cache", "snapkv", "--budget", BIG], "--budget=2,147,483,640 needs"),
    (["compare", "--prompt-ids", "1 2", "--backend", "sim", "--cache", "paged", "--block-size", BIG],
     "--block-size=2,147,483,640 needs"),
    (["bench", "offload", "--block-size", BIG], "--block-size=2,147,483,640 needs"),
    (["bench", "batching", "--requests", "1", "--block-size", BIG], f"--block-size={BIG}"),
]


@pytest.mark.parametrize("argv, names", CACHE_SIZE_FLAGS, ids=[" ".join(a[:1] + a[-2:]) for a, _ in CACHE_SIZE_FLAGS])
def test_a_cache_size_flag_past_memory_is_refused_by_its_flag_before_any_output(argv, names, tiny_gguf, input_files,
                                                                                monkeypatch):
    # the caches' own checks name their arguments (block_size, window); the command names what the user typed,
    # and checks before it echoes the prompt or starts a progress bar
    monkeypatch.setattr("minikv.errors.available_memory_bytes", lambda: 2**30)
    model = [] if argv[0] == "bench" else ["--model", tiny_gguf]
    argv = [input_files["good"] if a == "<ids>" else a for a in argv] + model
    line = assert_refused(argv, names)
    if "needs" in names:
        assert f"the largest {names.split('=')[0]} that fits is" in line
    if "--cache paged --block-size" in " ".join(argv):  # 256 bytes a token, 2^30 available
        assert "the largest --block-size that fits is 4,194,303" in line, line


# (the lossy flags, the exact cache beside them, its bytes, the bytes available): 4 scored tokens of 256 bytes;
# the exact cache and the lossy one each fit alone (paged: a 16-token block each, 4,352 bytes with its
# bookkeeping; a 4-slot window ring: 1,408 bytes beside a 1,024-byte contiguous cache), the two together do not
BESIDE = [(["--kv-dtype", "fp16"], "paged", 4352, 6000),
          (["--cache", "window", "--window", "4"], "contiguous", 1024, 2000)]


@pytest.mark.parametrize("lossy, exact, need, available", BESIDE, ids=["fp16", "window"])
def test_perplexity_counts_the_exact_cache_it_runs_beside(lossy, exact, need, available, tiny_gguf, input_files,
                                                           monkeypatch):
    # perplexity_vs_exact runs the exact and the lossy cache in lockstep: both are held at once
    from minikv.errors import ConfigError
    from minikv.generate import cache_memory_bytes
    from minikv.weights.gguf import load_model

    model = load_model(tiny_gguf)[0]
    assert cache_memory_bytes(exact, model, 4, block_size=16) == need
    with pytest.raises(ConfigError, match="evicts"):  # an evicting cache is sized by its window, not max_len
        cache_memory_bytes("window", model, 4)
    monkeypatch.setattr("minikv.errors.available_memory_bytes", lambda: available)
    argv = ["perplexity", "--ids-file", input_files["good"], "--model", tiny_gguf, *lossy]
    line = assert_refused(argv, "needs")
    assert f"together with the {need:,} bytes of the cache it runs beside" in line, line
    monkeypatch.setattr("minikv.errors.available_memory_bytes", lambda: 2 * available)
    rc, out, err = run_cli(argv)  # room for both: it runs
    assert rc == 0, err
