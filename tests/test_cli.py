"""The `minikv` command: --help lists every subcommand; generate --json on SmolLM2; typed errors exit 2."""

import json

import pytest

from minikv.cli import main

SUBCOMMANDS = ["generate", "demo", "perplexity", "memory", "compare", "bench"]


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
        assert r["cache_bytes_per_token"] == 2 * 30 * 3 * 64 * 4  # K and V, 30 layers, 3 KV heads of 64, float32
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


@pytest.mark.model
def test_generate_prompt_ids_equal_the_encoded_prompt(capsys, smollm2, smollm2_path):
    _, tok = smollm2
    ids = tok.encode("The capital of France is")
    runs = []
    for prompt in (["--prompt", "The capital of France is"], ["--prompt-ids", ", ".join(map(str, ids))]):
        assert main(["generate", *prompt, "--greedy", "--max-new-tokens", "3", "--json",
                     "--model", str(smollm2_path)]) == 0
        runs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert runs[0]["prompt_ids"] == runs[1]["prompt_ids"] == ids
    assert runs[0]["token_ids"] == runs[1]["token_ids"] and runs[1]["text"].startswith(" Paris")


@pytest.fixture
def checkpoint_dir(monkeypatch, tmp_path):
    """A --model directory that loads as a tiny random model without a tokenizer (what a checkpoint gives).

    ``minikv.weights.checkpoints`` is another step's module; here its loader is replaced so the CLI's
    tokenizer-less paths are tested on their own.
    """
    import numpy as np

    from minikv.cli import common
    from minikv.weights.random_models import random_model

    model = random_model(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, hidden_size=32,
                         vocab_size=64, dtype=np.float64)
    monkeypatch.setattr(common, "_load_checkpoint", lambda path: model)
    return str(tmp_path)


def test_a_checkpoint_takes_ids_and_refuses_text(capsys, checkpoint_dir, tmp_path):
    for argv, fix in ((["generate", "--prompt", "hi"], "use --prompt-ids"), (["demo"], "use --prompt-ids"),
                      (["compare", "--prompt", "hi", "--backend", "sim"], "use --prompt-ids")):
        assert main(argv + ["--model", checkpoint_dir]) == 2
        line = _one_error_line(capsys.readouterr().err)
        assert "--prompt needs a tokenizer" in line and fix in line
    assert main(["generate", "--prompt-ids", "1 2 3", "--max-new-tokens", "4", "--greedy", "--json",
                 "--model", checkpoint_dir]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    r = json.loads(out[-1])
    assert out[0].startswith("1 2 3 ") and r["text"] is None and r["prompt_ids"] == [1, 2, 3]
    assert len(r["token_ids"]) == 4 or r["finish_reason"] == "eos"  # the random model's EOS is id 63
    assert r["cache_bytes_per_token"] == 2 * 2 * 2 * 8 * 8  # K and V, 2 layers, 2 KV heads of 8, float64
    assert main(["demo", "--prompt-ids", "5,6", "--max-new-tokens", "3", "--model", checkpoint_dir]) == 0
    assert "identical tokens: True" in capsys.readouterr().out
    text = tmp_path / "t.txt"
    text.write_text("some words")
    assert main(["perplexity", "--text-file", str(text), "--model", checkpoint_dir]) == 2
    assert "use --ids-file" in _one_error_line(capsys.readouterr().err)


def test_perplexity_on_a_checkpoint_equals_the_library(capsys, checkpoint_dir, tmp_path):
    from minikv.cli import common
    from minikv.perplexity import perplexity

    ids = tmp_path / "ids.txt"
    ids.write_text("1, 2, 3, 4\n5 6 7 8 9 10 11 12\n")
    assert main(["perplexity", "--ids-file", str(ids), "--cache", "paged", "--block-size", "3", "--prefill", "4",
                 "--max-tokens", "10", "--json", "--model", checkpoint_dir]) == 0
    captured = capsys.readouterr()
    r = json.loads(captured.out.strip().splitlines()[-1])
    assert "perplexity (paged)" in captured.err and "tok/s" in captured.err  # the bar, on stderr
    want = perplexity(common._load_checkpoint(checkpoint_dir), list(range(1, 11)), prefill=4)
    assert r["tokens"] == 10 and r["scored_tokens"] == 9 and r["cache"] == "paged" and r["prefill"] == 4
    assert r["mean_nll"] == pytest.approx(want["mean_nll"], rel=1e-10) and r["ppl"] == pytest.approx(want["ppl"])
    assert r["cache_bytes_per_token"] == 2 * 2 * 2 * 8 * 8 and r["elapsed_s"] > 0


@pytest.mark.model
def test_perplexity_of_a_text_file_on_smollm2(capsys, smollm2, smollm2_path, tmp_path):
    from minikv.bench.corpus import reference_text, reference_tokens

    text = tmp_path / "text.txt"
    text.write_text(reference_text())
    assert main(["perplexity", "--text-file", str(text), "--max-tokens", "32", "--prefill", "4", "--json",
                 "--model", str(smollm2_path)]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ids = tmp_path / "ids.txt"
    ids.write_text(" ".join(map(str, reference_tokens(smollm2[1], 32))))
    assert main(["perplexity", "--ids-file", str(ids), "--prefill", "4", "--json", "--model", str(smollm2_path)]) == 0
    same = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["tokens"] == same["tokens"] == 32 and r["mean_nll"] == same["mean_nll"]
    assert 1 < r["ppl"] < 100 and set(r) >= {"cache", "cache_bytes_per_token", "elapsed_s"}


def test_compare_takes_prompt_ids_and_reports_them(capsys):
    assert main(["compare", "--random", "--backend", "sim", "--prompt-ids", "7, 300 49151", "--max-new-tokens", "2",
                 "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["prompt_ids"] == [7, 300, 49151] and r["prompt_tokens"] == 3 and r["tokens_agree"]


def test_perplexity_kv_dtype_reports_the_error_against_the_plain_cache(capsys, checkpoint_dir, tmp_path):
    from minikv.cli import common
    from minikv.generate import make_cache
    from minikv.perplexity import perplexity_vs_exact

    ids = tmp_path / "ids.txt"
    ids.write_text(" ".join(str(i) for i in range(1, 21)))
    argv = ["perplexity", "--ids-file", str(ids), "--prefill", "2", "--json", "--model", checkpoint_dir]
    assert main([*argv, "--kv-dtype", "kivi4", "--group", "4", "--residual", "8"]) == 0  # default --cache: paged
    out = capsys.readouterr().out.strip().splitlines()
    r = json.loads(out[-1])
    assert "against the plain paged cache: KL" in out[-2]
    assert r["cache"] == "paged" and r["kv_dtype"] == "kivi4" and r["group"] == 4 and r["residual"] == 8
    model = common._load_checkpoint(checkpoint_dir)
    want = perplexity_vs_exact(model, list(range(1, 21)), lambda m, n: make_cache(
        "paged", m, max_len=n, kv_dtype="kivi4", group=4, residual=8), prefill=2, exact_cache="paged")
    for key in ("kld_vs_exact", "top1_vs_exact", "delta_ppl", "ppl", "cache_bytes_per_token"):
        assert r[key] == pytest.approx(want[key], rel=1e-12, abs=1e-300), key
    assert r["kld_vs_exact"] > 0 and 0 <= r["top1_vs_exact"] <= 1
    assert main([*argv, "--kv-dtype", "fp32"]) == 0  # the plain cache: no comparison to make
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert plain["kv_dtype"] == "fp32" and plain["cache"] == "contiguous" and "kld_vs_exact" not in plain


def test_generate_kv_dtype_defaults_to_the_paged_cache(capsys, checkpoint_dir):
    argv = ["generate", "--prompt-ids", "1 2 3", "--max-new-tokens", "12", "--greedy", "--json",
            "--model", checkpoint_dir]
    assert main([*argv, "--kv-dtype", "fp16"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["cache"] == "paged" and r["kv_dtype"] == "fp16" and r["token_ids"]
    assert r["cache_bytes_per_token"] == 2 * 2 * 2 * 8 * 2  # fp16 K and V
    assert main([*argv, "--kv-dtype", "kivi2", "--group", "4", "--residual", "4"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["kv_dtype"] == "kivi2" and r["token_ids"] and r["cache_bytes_per_token"] < 2 * 2 * 2 * 8 * 8


def test_a_group_the_shape_refuses_is_one_line(capsys, checkpoint_dir, tmp_path):
    ids = tmp_path / "ids.txt"
    ids.write_text("1 2 3 4 5")
    assert main(["perplexity", "--ids-file", str(ids), "--kv-dtype", "int8", "--model", checkpoint_dir]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "head_dim=8" in err[0] and "kv_dtype='int8'" in err[0]


def test_perplexity_through_an_eviction_cache_reports_the_error_and_the_curve(capsys, checkpoint_dir, tmp_path):
    from minikv.cli import common
    from minikv.generate import make_cache
    from minikv.perplexity import perplexity_vs_exact

    ids = tmp_path / "ids.txt"
    ids.write_text(" ".join(str(i % 60 + 1) for i in range(30)))
    curve = tmp_path / "nll.json"
    argv = ["perplexity", "--ids-file", str(ids), "--prefill", "3", "--json", "--model", checkpoint_dir]
    assert main([*argv, "--cache", "window", "--window", "8", "--sinks", "2", "--nll-file", str(curve)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    r = json.loads(out[-1])
    assert r["eviction"] == {"policy": "window", "positions": "original", "window": 8, "sinks": 2}
    assert "against the plain window cache" in out[-2] and "nll_curve" not in r
    model = common._load_checkpoint(checkpoint_dir)
    want = perplexity_vs_exact(model, [i % 60 + 1 for i in range(30)], lambda m, n: make_cache(
        "window", m, max_len=n, eviction={"window": 8, "sinks": 2}), prefill=3, curve=True)
    for key in ("kld_vs_exact", "top1_vs_exact", "delta_ppl", "ppl", "ppl_exact"):
        assert r[key] == pytest.approx(want[key], rel=1e-12), key
    assert r["kld_vs_exact"] > 0
    saved = json.loads(curve.read_text())
    assert saved["nll"] == pytest.approx(want["nll_curve"]["lossy"]) and len(saved["nll_exact"]) == 29
    assert saved["eviction"]["policy"] == "window"
    for bad, flag in ((["--cache", "h2o", "--window", "8"], "--window"), (["--cache", "window"], "window"),
                      (["--cache", "paged", "--budget", "4"], "--budget"), (["--nll-file", str(curve)], "--nll-file")):
        assert main([*argv, *bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and flag in err[0], err
