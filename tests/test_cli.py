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
