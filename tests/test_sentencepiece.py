"""SentencePiece BPE (``minikv.weights.sentencepiece``): the four moves on a hand-made vocabulary, then equal
to transformers' Gemma GGUF tokenizer, on the same tiny vocabulary and on Gemma-3's real one."""

from __future__ import annotations

import numpy as np
import pytest

from minikv.errors import InvalidInputError, ModelFormatError
from minikv.weights.sentencepiece import SentencePieceTokenizer

# A tiny Gemma-like vocabulary: controls, user-defined tokens (a newline run, a space run stored with real
# spaces as in Gemma's file, an HTML tag), the 256 byte tokens, then normal tokens in merge order.
HEAD = [("<pad>", 3), ("<eos>", 3), ("<bos>", 3), ("<unk>", 3), ("\n", 4), ("\n\n", 4), ("  ", 4), ("   ", 4),
        ("<td>", 4)]
BYTES = [(f"<0x{b:02X}>", 6) for b in range(256)]
NORMAL = ["▁", "a", "b", "c", "d", "x", "中", "文", "bc", "ab", "▁a", "aa", "▁ab", "cd", "bcd", "▁x", "<", ">", "td",
          "<t", "d>", "中文"]
TINY = HEAD + BYTES + [(t, 1) for t in NORMAL]
FIRST_NORMAL = len(HEAD) + len(BYTES)


def tiny() -> SentencePieceTokenizer:
    tokens = [t for t, _ in TINY]
    types = [k for _, k in TINY]
    scores = [-1000.0 if k in (3, 4) else 0.0 if k == 6 else -float(i - FIRST_NORMAL) for i, (_, k) in enumerate(TINY)]
    return SentencePieceTokenizer(tokens, scores, types, bos_token_id=2, eos_token_id=1, add_bos=True)


def pieces(tok: SentencePieceTokenizer, text: str) -> list[str]:
    return [tok.tokens[i] for i in tok.encode(text, add_special_tokens=False)]


# --- the four moves ----------------------------------------------------------------------------------------

def test_the_best_ranked_pair_merges_first():
    tok = tiny()
    assert pieces(tok, "abc") == ["a", "bc"]       # "bc" is listed before "ab", so it merges first
    assert pieces(tok, "abcd") == ["a", "bcd"]     # bc, then bc+d (cd never gets its chance)
    assert pieces(tok, "aaa") == ["aa", "a"]       # the same pair twice: the leftmost merges


def test_spaces_become_pieces_and_no_prefix_is_added():
    tok = tiny()
    assert pieces(tok, "ab ab") == ["ab", "▁ab"]
    assert pieces(tok, " x") == ["▁x"]
    assert pieces(tok, "a  b") == ["a", "  ", "b"]  # the space run is a token of its own (ranked first)


def test_added_tokens_are_cut_out_whole_longest_first():
    tok = tiny()
    assert pieces(tok, "x<td>\n\n\nx") == ["x", "<td>", "\n\n", "\n", "x"]
    assert tok.encode("<bos>a") == [2, 2, tok.tokens.index("a")]


def test_unknown_characters_fall_back_to_bytes():
    tok = tiny()
    assert pieces(tok, "é中文") == ["<0xC3>", "<0xA9>", "中文"]


def test_decode_undoes_encode_and_marks_broken_bytes():
    tok = tiny()
    for text in ["ab  cd\n\nx", " é 中文 <td>", ""]:
        assert tok.decode(tok.encode(text)) == "<bos>" + text
        assert tok.decode(tok.encode(text), skip_special_tokens=True) == text
    broken = [tok.tokens.index("<0xE4>"), tok.tokens.index("<0xB8>"), tok.tokens.index("a")]
    assert tok.decode(broken) == "\ufffd\ufffda"  # one U+FFFD per byte token of an invalid run
    assert "".join(tok.decode_stream(tok.encode("中文 é", add_special_tokens=False))) == "中文 é"


def test_bad_input_is_refused():
    tok = tiny()
    with pytest.raises(InvalidInputError):
        tok.encode(b"bytes")
    with pytest.raises(InvalidInputError):
        tok.decode([len(TINY)])
    with pytest.raises(ModelFormatError, match="byte tokens"):
        SentencePieceTokenizer(["a"], [0.0], [1])
    with pytest.raises(ModelFormatError, match="scores"):
        SentencePieceTokenizer(["a", "b"], [0.0], [1, 1])
    with pytest.raises(ModelFormatError, match="chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


# --- transformers' GGUF tokenizer for Gemma ------------------------------------------------------------------

def random_texts(alphabet: list[str], n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return ["".join(rng.choice(alphabet, size=rng.integers(0, 24))) for _ in range(n)]


@pytest.mark.reference
def test_tiny_vocabulary_equals_transformers(require):
    """transformers' builder for a Gemma GGUF (``gguf_tokenizer_mapping.convert_gguf_tokenizer``) on the tiny list."""
    require("transformers")
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    tok = tiny()
    hf, _ = convert_gguf_tokenizer("gemma3", {"tokenizer_type": "llama", "tokens": tok.tokens, "scores": tok.scores,
                                              "token_type": tok.token_types, "bos_token_id": 2, "eos_token_id": 1})
    alphabet = list("abcdx <>中文é\n\t") + ["<td>", "  ", "<bos>", "td>"]
    for text in random_texts(alphabet, 2000):
        assert tok.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False).ids, repr(text)


PROMPTS = [
    "The capital of France is",
    "   leading spaces, and trailing ones   ",
    "中文测试：你好，世界！机器学习很有趣。",
    "def f(x):\n    return x ** 2  # square\n\tprint(f(3))\n",
    "emoji 🤗🚀👩‍💻 and digits 12345 3.14159 2024-06-01",
    "Ωμέγα — naïve café, ḁ ẞ ﬁ",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "a" + " " * 40 + "b\n\n\n\n\n\tx\t\t\ty",
    "<table><tr><td>cell</td></tr></table> <0x41> [multimodal]",
    "",
]


@pytest.mark.gemma
@pytest.mark.reference
def test_gemma3_tokenizer_equals_transformers(gemma3, gemma3_hf_tokenizer):
    _, tok = gemma3
    hf = gemma3_hf_tokenizer
    for text in PROMPTS:
        ids = tok.encode(text)
        assert ids == hf(text).input_ids, repr(text)
        assert tok.decode(ids) == hf.decode(ids), repr(text)
        assert tok.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True), repr(text)
    alphabet = list("ab ▁\n\t<>0x1F中文🤗é=-_") + ["<bos>", "<0x41>", "  ", "<td>", "▁▁", "the", " of"]
    for text in random_texts(alphabet, 500):
        assert tok.encode(text) == hf(text).input_ids, repr(text)
    rng = np.random.default_rng(0)
    for _ in range(200):  # any ids, broken byte runs included
        ids = rng.integers(0, tok.vocab_size, 6).tolist() + rng.integers(238, 238 + 256, 6).tolist()
        rng.shuffle(ids)
        assert tok.decode(ids) == hf.decode(ids), ids


@pytest.mark.gemma
def test_gemma3_tokenizer_reads_the_file(gemma3):
    _, tok = gemma3
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_id, tok.add_bos) == (262144, 2, 1, True)
    assert tok.encode("The capital of France is") == [2, 818, 5279, 529, 7001, 563]  # transformers' ids
