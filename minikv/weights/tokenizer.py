"""SmolLM2's tokenizer: byte-level BPE (GPT-2 style), splitting text as llama.cpp does.

This module knows nothing of file formats: a ``Tokenizer`` is built from plain
lists (the vocabulary, its token types, the merges, the BOS/EOS ids and the
chat template). ``minikv.weights.gguf.load_tokenizer`` reads those lists out of a GGUF
file (``tokenizer.ggml.tokens``, ``tokenizer.ggml.merges``, ...)::

    tok = load_tokenizer()                          # from minikv.weights.gguf
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi"}]))

The vocabulary is built with the ``tokenizers`` library. Tokens of type 3
(control, e.g. ``<|im_start|>``) and 4 (user-defined) are matched whole in the
text before anything else.

Pre-tokenizer ``smollm`` (``tokenizer.ggml.pre``). llama.cpp maps it to
``LLAMA_VOCAB_PRE_TYPE_SMOLLM`` and splits the text with two regexes in turn,
each applied inside the pieces the previous one produced, keeping both the
matches and the text between them (``unicode_regex_split``):

1. ``\\p{N}``: every numeric character (Unicode category N) becomes its own
   piece;
2. GPT-2's ``'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+``,
   where the end of a piece counts as "not followed by non-space".

``tokenizers`` expresses the same rule as
``Sequence([Digits(individual_digits=True), ByteLevel(use_regex=True)])``.

Difference from transformers: transformers (checked with 5.24) builds the
GGUF tokenizer of this file with the plain GPT-2 regex and no digit split.
The vocabulary has no token that joins a digit to anything, so "2024" or
" 123" give the same ids both ways. But a run of two or more whitespace
characters before a digit is split differently: GPT-2's ``\\s+(?!\\S)`` leaves
the last space to join the number (" 7"), which the vocabulary cannot merge::

    "  7"  llama.cpp / minikv: ["ĠĠ", "7"]      = [256, 39]
           transformers:       ["Ġ", "Ġ", "7"]  = [216, 216, 39]

We follow llama.cpp, the runtime the file was made for. (Its converter names
a pre-tokenizer by hashing the ids the original Hugging Face tokenizer gives
on a test text, and files ``smollm`` under the digit-splitting rule, so that
rule is the one the model was trained with.)

Decoding maps every token back to its bytes (the inverse of GPT-2's
``bytes_to_unicode``) and decodes the concatenation as UTF-8. One character
can span several tokens (most emoji and CJK characters do), so the streaming
decoder (``StreamDecoder``) holds incomplete UTF-8 sequences back until they
complete.
"""

from __future__ import annotations

import codecs
import re
from typing import Iterable, Iterator

import numpy as np

from minikv.errors import InvalidInputError, ModelFormatError, ShapeError, check_choice, check_int

# tokenizer.ggml.pre -> the regexes llama.cpp applies in turn (see the module docstring)
SUPPORTED_PRE_TOKENIZERS = ("smollm", "gpt-2")
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

# llama.cpp's token types (tokenizer.ggml.token_type)
TOKEN_TYPE_NORMAL, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 1, 3, 4


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used to spell byte-level tokens.

    Printable Latin-1 bytes stand for themselves; the other 68 (controls, space,
    ...) are moved to U+0100 onwards in byte order, so a space is "Ġ" (U+0120)
    and a newline "Ċ".
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, shifted = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


# --- the chat template ------------------------------------------------------------------------

# SmolLM2-Instruct's chat template, with its default system prompt as a hole. Tokenizer
# renders exactly this in plain Python and refuses any other template rather than guess.
_CHATML_TEMPLATE = (
    "{{% for message in messages %}}{{% if loop.first and messages[0]['role'] != 'system' %}}"
    "{{{{ '<|im_start|>system\n{system}<|im_end|>\n' }}}}{{% endif %}}"
    "{{{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}}}"
    "{{% endfor %}}{{% if add_generation_prompt %}}{{{{ '<|im_start|>assistant\n' }}}}{{% endif %}}"
)


def _parse_chatml_system_prompt(template: str | None) -> str | None:
    """The default system prompt if ``template`` is SmolLM2's ChatML template, else None."""
    if not template:
        return None
    m = re.search(r"\{\{ '<\|im_start\|>system\n(.*?)<\|im_end\|>\n' \}\}", template, flags=re.S)
    if m is None or _CHATML_TEMPLATE.format(system=m.group(1)) != template:
        return None
    return m.group(1)


def _check_messages(messages) -> None:
    """Refuse anything but a non-empty list of {"role": str, "content": str} dicts."""
    if not isinstance(messages, (list, tuple)):
        raise InvalidInputError(f"messages must be a list of {{'role', 'content'}} dicts, "
                                f"got {type(messages).__name__}")
    if not messages:
        raise InvalidInputError("messages is empty; a conversation needs at least one message")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and all(isinstance(m.get(k), str) for k in ("role", "content"))):
            raise InvalidInputError(f"messages[{i}]={m!r}; each message must be a dict with str "
                                    "'role' and 'content'")


# --- the tokenizer ------------------------------------------------------------------------------

def _hf_tokenizer(tokens: list[str], merges: list[str], pre: str, added: list[int], special_ids: frozenset):
    """The ``tokenizers`` BPE tokenizer doing the work: vocabulary, pre-tokenizer, added tokens."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    vocab = {t: i for i, t in enumerate(tokens)}
    tk = HFTokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges]))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    digits = pre_tokenizers.Digits(individual_digits=True)
    tk.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level]) if pre == "smollm" else byte_level
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(tokens[i], normalized=False, special=True)
                           for i in added if i in special_ids])
    tk.add_tokens([AddedToken(tokens[i], normalized=False, special=False)
                   for i in added if i not in special_ids])
    return tk


def _token_bytes(tokens: list[str], added: list[int]) -> list[bytes]:
    """Token id -> its bytes: the inverse byte alphabet for normal tokens, UTF-8 for added ones."""
    inverse = {c: b for b, c in bytes_to_unicode().items()}
    out = [bytes(inverse[c] for c in t) if all(c in inverse for c in t) else t.encode("utf-8") for t in tokens]
    for i in added:  # added tokens are written as plain text, not in the byte alphabet
        out[i] = tokens[i].encode("utf-8")
    return out


class TokenizerBase:
    """What every tokenizer shares on the way back from ids: validation, per-token bytes, streaming.

    A subclass sets ``tokens`` ([V] strings), ``special_ids`` (the control tokens) and ``_bytes``
    ([V] the bytes each token stands for), and writes ``encode`` and ``decode``.
    """

    tokens: list[str]
    special_ids: frozenset
    _bytes: list[bytes]

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def _check_id(self, i) -> int:
        return check_int("token id", i, minimum=0, maximum=self.vocab_size - 1, error=InvalidInputError,
                         hint=f"the vocabulary has {self.vocab_size} tokens; was it produced by this model?")

    def check_ids(self, ids: Iterable[int], skip_special_tokens: bool = False) -> list[int]:
        """``ids`` ([T] ints, a list or a 1-D array) validated as Python ints, special ones dropped if asked."""
        if isinstance(ids, (str, bytes)):
            raise InvalidInputError(f"ids must be a sequence of token ids, got {type(ids).__name__}")
        if isinstance(ids, np.ndarray):
            if ids.ndim != 1:
                raise ShapeError(f"ids.shape={ids.shape}; decode one sequence (a 1-D list of ids) at a time")
            ids = ids.tolist()
        ids = [self._check_id(i) for i in ids]
        return [i for i in ids if i not in self.special_ids] if skip_special_tokens else ids

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (may be part of a UTF-8 character)."""
        return self._bytes[self._check_id(token_id)]

    def stream_decoder(self, skip_special_tokens: bool = False) -> "StreamDecoder":
        """A decoder fed one id at a time that only ever returns whole characters."""
        return StreamDecoder(self, skip_special_tokens)

    def decode_stream(self, ids: Iterable[int], skip_special_tokens: bool = False) -> Iterator[str]:
        """Yield text pieces as ``ids`` arrive; for valid UTF-8 their concatenation equals ``decode(ids)``."""
        dec = self.stream_decoder(skip_special_tokens)
        for i in ids:
            piece = dec.push(i)
            if piece:
                yield piece
        tail = dec.flush()
        if tail:
            yield tail


class Tokenizer(TokenizerBase):
    """Byte-level BPE tokenizer, splitting text as llama.cpp does.

    tokens:       [V] token strings in GPT-2's byte alphabet (``bytes_to_unicode``)
    token_types:  [V] llama.cpp token types (1 normal, 3 control, 4 user-defined)
    merges:       BPE merges "a b", best first
    bos_token_id, eos_token_id: ids in [0, V), or None
    pre:          "smollm" (digits split, then GPT-2's regex) or "gpt-2" (GPT-2's regex only)
    add_bos:      ``encode`` prepends BOS (``tokenizer.ggml.add_bos_token`` in a GGUF file)
    chat_template: the jinja template; only SmolLM2's ChatML one can be rendered
    Control and user-defined tokens (``<|im_start|>``...) are matched whole in the text.
    Raises ModelFormatError if the lists disagree (they come from a model file).
    """

    def __init__(self, tokens: list[str], token_types: list[int], merges: list[str], *,
                 bos_token_id: int | None = None, eos_token_id: int | None = None, pre: str = "smollm",
                 add_bos: bool = False, chat_template: str | None = None):
        check_choice("pre", pre, SUPPORTED_PRE_TOKENIZERS, error=ModelFormatError)
        if len(token_types) != len(tokens):
            raise ModelFormatError(f"{len(token_types)} token types for {len(tokens)} tokens")
        self.tokens, self.merges, self.pre, self.add_bos = list(tokens), list(merges), pre, bool(add_bos)
        self.chat_template = chat_template
        self.token_types = np.asarray(token_types, dtype=np.int32)
        for name, tid in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id)):
            if tid is not None:
                check_int(name, tid, minimum=0, maximum=len(self.tokens) - 1, error=ModelFormatError,
                          hint=f"the vocabulary has {len(self.tokens)} tokens")
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id

        added = np.flatnonzero(np.isin(self.token_types, (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED))).tolist()
        self.special_ids = frozenset(np.flatnonzero(self.token_types == TOKEN_TYPE_CONTROL).tolist())
        self._tk = _hf_tokenizer(self.tokens, self.merges, pre, added, self.special_ids)
        self._bytes = _token_bytes(self.tokens, added)
        self.default_system_prompt = _parse_chatml_system_prompt(chat_template)

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, pre={self.pre!r}, bos={self.bos_token_id}, "
                f"eos={self.eos_token_id})")

    # -- text -> ids --------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. Special tokens written in the text (``<|im_start|>``) become one id each.

        add_special_tokens: prepend BOS if the tokenizer asks for it (``add_bos``; False for
        SmolLM2, whose chat template carries its own markers).
        """
        if not isinstance(text, str):
            raise InvalidInputError(f"text must be a str, got {type(text).__name__}"
                                    + ("; decode bytes with .decode('utf-8') first" if isinstance(text, bytes)
                                       else ""))
        ids = self._tk.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def pre_tokenize(self, text: str) -> list[str]:
        """The pieces BPE sees, as plain text (special tokens are matched before this step)."""
        if not isinstance(text, str):
            raise InvalidInputError(f"text must be a str, got {type(text).__name__}")
        return [text[a:b] for _, (a, b) in self._tk.pre_tokenizer.pre_tokenize_str(text)]

    # -- ids -> text --------------------------------------------------------------------------
    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` ([T] ints): their bytes concatenated, decoded as UTF-8 (invalid bytes -> U+FFFD)."""
        ids = self.check_ids(ids, skip_special_tokens)
        return b"".join(self._bytes[i] for i in ids).decode("utf-8", errors="replace")

    # -- chat ---------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render a conversation as SmolLM2's ChatML template does (without jinja2).

        messages: [{"role": "system" | "user" | "assistant", "content": str}, ...]
        Like the template, a conversation that does not start with a system message gets the
        default one ("You are a helpful AI assistant named SmolLM, ...").
        add_generation_prompt: end with "<|im_start|>assistant\\n" so the model answers next.
        The string is for reading; to run it use ``encode_chat``, which keeps control-token text
        typed inside a message as text (``encode`` of this string would not).
        """
        return "".join(text for text, _ in self._chat_parts(messages, add_generation_prompt))

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the conversation in the chat template ([T] ints), each message's content encoded as
        plain text: ``<|im_start|>system`` typed by a user becomes the tokens of those characters, not the
        control token, so a message cannot forge a turn. The template's own markers are control tokens.
        For content without control-token text the ids equal ``encode(apply_chat_template(...))``."""
        ids = [self.bos_token_id] if self.add_bos and self.bos_token_id is not None else []
        for text, is_content in self._chat_parts(messages, add_generation_prompt):
            if not is_content:
                ids += self._tk.encode(text, add_special_tokens=False).ids
                continue
            self._tk.encode_special_tokens = True  # special tokens' text is split like any other text
            try:
                ids += self._tk.encode(text, add_special_tokens=False).ids
            finally:
                self._tk.encode_special_tokens = False
        return ids

    def _chat_parts(self, messages: list[dict], add_generation_prompt: bool) -> list[tuple[str, bool]]:
        """The template as [(text, is a message's content)] in order."""
        if self.default_system_prompt is None:
            raise ModelFormatError("this file's tokenizer.chat_template is not the SmolLM2 ChatML template "
                                   "that minikv renders in plain Python; render it with jinja2 "
                                   f"(template starts {str(self.chat_template)[:60]!r})")
        _check_messages(messages)
        parts = []
        for i, m in enumerate(messages):
            if i == 0 and m["role"] != "system":
                parts.append((f"<|im_start|>system\n{self.default_system_prompt}<|im_end|>\n", False))
            parts += [(f"<|im_start|>{m['role']}\n", False), (m["content"], True), ("<|im_end|>\n", False)]
        if add_generation_prompt:
            parts.append(("<|im_start|>assistant\n", False))
        return parts


class StreamDecoder:
    """Incremental detokenizer: ``push(id)`` returns the text completed by that token.

    A token may end in the middle of a UTF-8 character (an emoji is often 2-4
    tokens of one byte each). The incomplete bytes are held back until the
    character completes; ``flush()`` ends the stream (a dangling partial
    character becomes U+FFFD, as in ``Tokenizer.decode``).
    """

    def __init__(self, tokenizer: TokenizerBase, skip_special_tokens: bool = False):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        b = self.tokenizer.token_bytes(token_id)  # validates the id
        if self.skip_special_tokens and int(token_id) in self.tokenizer.special_ids:
            return ""
        return self._utf8.decode(b)

    def flush(self) -> str:
        """Text still held back (as U+FFFD), and reset for a new stream."""
        tail = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return tail
