"""The `minikv` command: --help lists every subcommand; generate --json on SmolLM2; typed errors exit 2."""

import json

import pytest

from minikv.cli import main

SUBCOMMANDS = ["generate", "demo", "memory", "compare", "bench"]


def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert name in out, f"`minikv --help` does not list {name}"


@pytest.mark.model
def test_generate_json_is_the_last_line_and_caches_agree(capsys, smollm2_path):
    runs = {}
    for cache in ("none", "contiguous", "paged"):
        assert main(["generate", "--prompt", "The capital of France is", "--greedy", "--max-new-tokens", "6",
                     "--cache", cache, "--json", "--model", str(smollm2_path)]) == 0
        last = capsys.readouterr().out.strip().splitlines()[-1]
        runs[cache] = json.loads(last)
    for cache, r in runs.items():
        assert set(r) >= {"prompt_ids", "token_ids", "text", "prefill_s", "decode_tokens_per_s", "cache"}
        assert r["cache"] == cache and len(r["token_ids"]) == 6 and r["prefill_s"] > 0
    assert runs["none"]["token_ids"] == runs["contiguous"]["token_ids"] == runs["paged"]["token_ids"]
    assert runs["contiguous"]["text"].startswith(" Paris")


@pytest.mark.model
def test_demo_reports_both_speeds_and_identical_tokens(capsys, smollm2_path):
    assert main(["demo", "--max-new-tokens", "4", "--model", str(smollm2_path)]) == 0
    out = capsys.readouterr().out
    assert "without KV cache" in out and "with contiguous KV cache" in out
    assert "decode speed-up from the cache" in out and "identical tokens: True" in out


def test_missing_model_file_exits_2_with_the_fix(capsys, tmp_path):
    assert main(["generate", "--prompt", "hi", "--model", str(tmp_path / "nope.gguf")]) == 2
    err = capsys.readouterr().err
    assert "ModelFileNotFoundError" in err and "nope.gguf" in err


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.model
def test_a_length_past_the_context_is_refused_before_anything_is_allocated(capsys, smollm2_path):
    """Once this tried to allocate 2.1 TiB and died with a bare ArrayMemoryError traceback."""
    for command in (["generate", "--prompt", "hi"], ["demo"]):
        assert main(command + ["--max-new-tokens", "100000000", "--model", str(smollm2_path)]) == 2
        captured = capsys.readouterr()
        line = _one_error_line(captured.err)
        assert "InvalidInputError" in line and "--max-new-tokens=100000000" in line and "max_position=8192" in line
        assert captured.out == ""  # refused before the prompt or the demo's header is printed


def test_a_corrupt_model_file_is_refused_naming_the_flag(capsys, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(100))
    assert main(["generate", "--prompt", "hi", "--model", str(bad)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "ModelFormatError" in line and "--model" in line and "bad.gguf" in line


def test_memory_names_the_flags_of_an_inconsistent_shape(capsys):
    assert main(["memory", "--layers", "2", "--kv-heads", "3", "--head-dim", "4", "--heads", "4"]) == 2
    assert "(set by --kv-heads, --heads)" in _one_error_line(capsys.readouterr().err)
    assert main(["memory", "--preset", "smollm2-135m", "--group-size", "64"]) == 2
    assert "(set by --dtype, --group-size)" in _one_error_line(capsys.readouterr().err)


def test_bench_refuses_a_budget_without_room_for_the_longest_request(capsys):
    assert main(["bench", "batching", "--kv-budget-mib", "0.1"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "--kv-budget-mib=0.1 holds 12 blocks of --block-size=16" in line and "--kv-budget-mib >= 0.5" in line


def test_bench_progress_goes_to_stderr_and_json_stays_last(capsys):
    assert main(["bench", "batching", "--requests", "3", "--kv-budget-mib", "1", "--json"]) == 0
    captured = capsys.readouterr()
    assert "bench batching" in captured.err and "tok" in captured.err  # the bar
    assert "bench batching:" not in captured.out
    json.loads(captured.out.strip().splitlines()[-1])


@pytest.mark.model
def test_demo_progress_goes_to_stderr_and_the_text_to_stdout(capsys, smollm2_path):
    assert main(["demo", "--max-new-tokens", "3", "--model", str(smollm2_path)]) == 0
    captured = capsys.readouterr()
    assert "no cache" in captured.err and "no cache" not in captured.out
    text = captured.out.split("--- without KV cache (recompute everything)\n", 1)[1].split("\n", 1)[0]
    cached = captured.out.split("--- with contiguous KV cache\n", 1)[1].split("\n", 1)[0]
    assert text and text == cached  # printed after the bar, the same text the streamed run printed


def test_memory_names_flags_where_the_formulas_name_fields(capsys):
    """minikv.costs knows field names only; `minikv memory` prints its flags instead."""
    assert main(["memory", "--layers", "2", "--kv-heads", "2", "--head-dim", "8", "--json"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1])["params"] is None
    assert "need the whole shape: --hidden, --heads, --intermediate, --vocab" in out
