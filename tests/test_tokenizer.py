"""The SmolLM2 tokenizer read from the GGUF file: round trips, llama.cpp's digit rule,
streaming decode, the chat template, and (marker ``reference``) agreement with transformers.
"""

from __future__ import annotations

import unicodedata

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minikv.errors import InvalidInputError, ModelFormatError, ShapeError
from minikv.weights.tokenizer import GPT2_SPLIT, Tokenizer

pytestmark = pytest.mark.model

# Texts without digits: transformers' GGUF tokenizer must give the same ids on these.
TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "你好，世界！这是一个测试。",
    "Emoji: 😀🎉 👩‍👩‍👧‍👦 🇫🇷 ❤️ done",
    "def f(x):\n\treturn x ** two  # square\n\n\nclass A:\n    pass\n",
    "  leading and trailing spaces  ",
    "tabs\tand\r\nwindows line endings\u00a0and a no-break space",
    "It's, we're, they'll, I'd, you've, 'quoted'",
    "Ünïcödé àccents — and “curly quotes” …",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "",
]
# Texts with numbers (Unicode category N: ASCII digits, Arabic-Indic digits, fractions).
DIGIT_TEXTS = [
    "in 2024 there were 12,345 people",
    "  7",
    "x =  42;\n\n1. first\t\t2. second",
    "pi is 3.14159, e is 2.71828",
    "٣ apples and ½ a pear cost $10.50",
]


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer) -> Tokenizer:
    return smollm2_tokenizer


def test_basic_properties(tok):
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_id) == (49152, 1, 2)
    assert tok.tokens[tok.eos_token_id] == "<|im_end|>" and tok.tokens[tok.bos_token_id] == "<|im_start|>"
    assert tok.pre == "smollm"


@pytest.mark.parametrize("text", TEXTS + DIGIT_TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(np.array(ids, dtype=np.int64)) == text


def test_special_tokens_are_single_ids(tok):
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "<|im_start|>user\nHi<|im_end|>"
    assert tok.decode(ids, skip_special_tokens=True) == "user\nHi"
    # SmolLM2's file asks for no BOS: the chat template writes its own markers
    assert tok.encode("Hi", add_special_tokens=True) == tok.encode("Hi", add_special_tokens=False)


# --- llama.cpp's smollm pre-tokenizer ---------------------------------------------------------------

def is_numeric(c: str) -> bool:
    return unicodedata.category(c).startswith("N")


@pytest.mark.parametrize("text", DIGIT_TEXTS)
def test_every_digit_is_its_own_piece(tok, text):
    pieces = tok.pre_tokenize(text)
    assert "".join(pieces) == text
    for p in pieces:
        assert len(p) == 1 or not any(is_numeric(c) for c in p), (p, pieces)
    # and so every numeric character is its own token
    for i in tok.encode(text):
        s = tok.decode([i])
        assert len(s) == 1 or not any(is_numeric(c) for c in s)


def test_digit_split_changes_ids_after_whitespace_runs(tok):
    """The documented difference, shown with the same vocabulary and the plain GPT-2 split."""
    gpt2 = Tokenizer(tok.tokens, tok.token_types, tok.merges, pre="gpt-2")
    assert tok.pre_tokenize("  7") == ["  ", "7"]
    assert gpt2.pre_tokenize("  7") == [" ", " 7"]
    assert tok.encode("  7") == [256, 39]           # "ĠĠ", "7"
    assert gpt2.encode("  7") == [216, 216, 39]     # "Ġ", "Ġ", "7": no token joins a space to a digit
    # a single space before a number gives the same ids either way
    assert tok.encode("in 2024 there were 12,345 people") == gpt2.encode("in 2024 there were 12,345 people")
    for text in TEXTS:
        assert tok.encode(text) == gpt2.encode(text)


def split_keeping_gaps(pieces: list[str], pattern: str, regex) -> list[str]:
    """llama.cpp's unicode_regex_split step: matches and the text between them, per piece."""
    out = []
    for piece in pieces:
        pos = 0
        for m in regex.finditer(pattern, piece):
            if m.start() > pos:
                out.append(piece[pos:m.start()])
            out.append(m.group())
            pos = m.end()
        if pos < len(piece):
            out.append(piece[pos:])
    return out


@pytest.mark.reference
@pytest.mark.parametrize("text", [t for t in TEXTS if "<|" not in t] + DIGIT_TEXTS)
def test_pre_tokenizer_is_llamacpp_smollm_rule(tok, require, text):
    """LLAMA_VOCAB_PRE_TYPE_SMOLLM: split on \\p{N}, then GPT-2's regex inside each piece."""
    regex = require("regex")  # installed with transformers; supports \p{..}
    expected = split_keeping_gaps(split_keeping_gaps([text], r"\p{N}", regex), GPT2_SPLIT, regex)
    assert tok.pre_tokenize(text) == expected


# --- decoding and streaming --------------------------------------------------------------------------

def test_stream_holds_back_partial_characters(tok):
    ids = tok.encode("🎉")
    assert len(ids) == 3  # b"\xf0\x9f", b"\x8e", b"\x89"
    dec = tok.stream_decoder()
    assert [dec.push(i) for i in ids] == ["", "", "🎉"]
    assert dec.flush() == ""


@pytest.mark.parametrize("text", TEXTS + DIGIT_TEXTS)
def test_stream_reproduces_decode(tok, text):
    ids = tok.encode(text)
    pieces = list(tok.decode_stream(ids))
    assert "".join(pieces) == tok.decode(ids) == text
    assert all(p and "\ufffd" not in p for p in pieces)
    skipped = "".join(tok.decode_stream(ids, skip_special_tokens=True))
    assert skipped == tok.decode(ids, skip_special_tokens=True)


token_ids = st.lists(st.one_of(st.integers(17, 300), st.integers(0, 49151)), max_size=16)


@settings(max_examples=150, deadline=None)
@given(ids=token_ids)
def test_stream_equals_decode_on_any_ids(smollm2_tokenizer, ids):
    """Even for ids that are not valid UTF-8 together (lone continuation bytes...)."""
    tok = smollm2_tokenizer
    assert "".join(tok.decode_stream(ids)) == tok.decode(ids)
    dec = tok.stream_decoder()
    assert "".join(dec.push(i) for i in ids) + dec.flush() == tok.decode(ids)


def test_stream_dangling_bytes_become_replacement(tok):
    first = tok.encode("🎉")[0]
    assert list(tok.decode_stream([first])) == ["\ufffd"]
    assert tok.decode([first]) == "\ufffd"


# --- chat template ------------------------------------------------------------------------------------

def test_chat_template_chatml(tok):
    assert tok.default_system_prompt == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    own = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                                  add_generation_prompt=False)
    assert own == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id and ids.count(tok.eos_token_id) == 2


# --- bad input --------------------------------------------------------------------------------------------

def test_bad_input(tok):
    with pytest.raises(InvalidInputError, match="bytes"):
        tok.encode(b"hello")
    with pytest.raises(InvalidInputError, match="NoneType"):
        tok.encode(None)
    with pytest.raises(InvalidInputError, match="49152"):
        tok.decode([5, 49152])
    with pytest.raises(InvalidInputError, match="-1"):
        tok.decode([-1])
    with pytest.raises(InvalidInputError, match="1.5"):
        tok.decode([1.5])
    with pytest.raises(InvalidInputError, match="str"):
        tok.decode("hello")
    with pytest.raises(ShapeError, match=r"\(2, 2\)"):
        tok.decode(np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(InvalidInputError, match="49152"):
        tok.stream_decoder().push(49152)
    with pytest.raises(InvalidInputError, match="messages\\[0\\]"):
        tok.apply_chat_template([{"role": "user"}])
    with pytest.raises(InvalidInputError, match="empty"):
        tok.apply_chat_template([])
    with pytest.raises(InvalidInputError, match="list"):
        tok.apply_chat_template("Hi")


def test_bad_lists():
    """A Tokenizer is built from plain lists; lists that disagree are a format error."""
    tokens, types = ["a", "b", "ab", "<s>"], [1, 1, 1, 3]
    assert Tokenizer(tokens, types, ["a b"], bos_token_id=3).encode("ab<s>") == [2, 3]
    with pytest.raises(ModelFormatError, match="3 token types for 4 tokens"):
        Tokenizer(tokens, types[:3], [])
    with pytest.raises(ModelFormatError, match="pre='bpe'"):
        Tokenizer(tokens, types, [], pre="bpe")
    with pytest.raises(ModelFormatError, match="bos_token_id=4"):
        Tokenizer(tokens, types, [], bos_token_id=4)
    with pytest.raises(ModelFormatError, match="eos_token_id=True"):  # a bool is not a token id
        Tokenizer(tokens, types, [], eos_token_id=True)
    with pytest.raises(InvalidInputError, match="True"):
        Tokenizer(tokens, types, []).decode([True])


# --- against transformers ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_tok(smollm2_path, require):
    transformers = require("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)


@pytest.mark.reference
@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_transformers_without_digits(tok, hf_tok, text):
    assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=True)
    ids = tok.encode(text)
    assert tok.decode(ids) == hf_tok.decode(ids)
    assert tok.decode(ids, skip_special_tokens=True) == hf_tok.decode(ids, skip_special_tokens=True)


@pytest.mark.reference
def test_digits_documented_difference_from_transformers(tok, hf_tok):
    """transformers skips the digit split (see minikv.weights.tokenizer): whitespace runs before numbers differ."""
    assert tok.encode("  7") == [256, 39]
    assert hf_tok.encode("  7") == [216, 216, 39]
    assert tok.encode("x =  42") != hf_tok.encode("x =  42")
    # with one space (or none) before each number the ids agree
    for text in ("in 2024 there were 12,345 people", "2024", " 123", "pi is 3.14159, e is 2.71828"):
        assert tok.encode(text) == hf_tok.encode(text)
    # and both decode back to the same text
    for text in DIGIT_TEXTS:
        assert hf_tok.decode(tok.encode(text)) == text


@pytest.mark.reference
def test_decode_matches_transformers_on_any_ids(tok, hf_tok):
    rng = np.random.default_rng(0)
    for _ in range(100):
        ids = rng.integers(0, tok.vocab_size, size=int(rng.integers(1, 12))).tolist()
        ids += rng.integers(17, 300, size=4).tolist()  # single bytes: often invalid UTF-8
        assert tok.decode(ids) == hf_tok.decode(ids)


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Capital of Italy?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Say 你好 and 🎉, then stop.\n\nThanks"}],
    [{"role": "user", "content": ""}],
]


@pytest.mark.reference
@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok, hf_tok, messages, add_generation_prompt):
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
