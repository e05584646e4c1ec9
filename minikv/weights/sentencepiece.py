"""Gemma's tokenizer: SentencePiece BPE over a GGUF vocabulary (``tokenizer.ggml.model == "llama"``).

Like ``minikv.weights.tokenizer`` this module knows nothing of file formats: a
``SentencePieceTokenizer`` is built from plain lists (``tokenizer.ggml.tokens``, ``.scores``,
``.token_type`` and the special ids), which ``minikv.weights.gguf.load_tokenizer`` reads.

SentencePiece BPE, in four moves
--------------------------------
1. **Added tokens first.** Control tokens (type 3: ``<bos>``, ``<start_of_turn>``, ``<unused0>``...)
   and user-defined ones (type 4: runs of ``\\n`` or ``\\t``, ``<table>``...) written in the text
   are cut out whole, longest match first at the leftmost place, and become one id each.
2. **Spaces are pieces.** The text between them has every space replaced by ``▁`` (U+2581); there is
   no splitting into words, and (for Gemma: ``tokenizer.ggml.add_space_prefix = False``) no ``▁`` is
   prepended.
3. **Merge the best pair, again and again.** Start from single characters. Among neighbouring
   pairs whose concatenation is a token, merge the one whose token ranks best, the leftmost if it
   occurs more than once; repeat until no pair is a token.
4. **Byte fallback.** A character that is not a token becomes the tokens of its UTF-8 bytes,
   ``<0xE4>`` ``<0xB8>`` ... (type 6).

Which token "ranks best"? SentencePiece ranks by score, llama.cpp too. In Gemma-3's file every
normal token (type 1) scores minus its distance from the first normal token (id 494 scores 0,
id 495 scores -1, ...), so ranking by score and by position agree. Everything else scores
-1000 or 0; among them are 30 user-defined runs of 2..31 spaces (ids 138-167), which SentencePiece
keeps whole. transformers 5.24 (``integrations/gguf/gguf_tokenizer_mapping.py``, ``gemma_tokenizer``)
ranks *every* token by its position instead, and spells those space runs ``▁▁...``: they then
merge before any other pair and come out whole as well. minikv follows transformers exactly
(rank = position, and for two ways to build the same token, the longer left piece first, as its
``generate_merges`` orders them); ``tests/test_sentencepiece.py`` compares the ids on prompts
with Chinese, code, emoji, runs of spaces, digits and special tokens.

Decoding turns ``▁`` back into spaces and byte tokens into their bytes. As transformers does
(its ``ByteFallback`` decoder), a run of byte tokens that is not valid UTF-8 becomes one U+FFFD
per byte token.
"""

from __future__ import annotations

import heapq
import re
from typing import Iterable

from minikv.errors import InvalidInputError, ModelFormatError, check_int
from minikv.weights.tokenizer import TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED, TokenizerBase

TOKEN_TYPE_BYTE = 6  # llama.cpp's LLAMA_TOKEN_TYPE_BYTE: <0x00> .. <0xFF>
SPACE = "\u2581"     # "▁", SentencePiece's visible space
_BYTE_TOKEN = re.compile(r"<0x([0-9A-F]{2})>")


def _spelling(token: str) -> str:
    """A token as BPE sees it: a run of whitespace containing a space is spelled with ``▁``
    (the file stores Gemma's space runs as real spaces; transformers renames them the same way)."""
    return SPACE * len(token) if " " in token and not token.strip() else token


class SentencePieceTokenizer(TokenizerBase):
    """SentencePiece BPE with byte fallback, as transformers builds it for a Gemma GGUF file.

    tokens:       [V] token strings (``▁`` for a space, ``<0xAB>`` for a byte)
    scores:       [V] floats (kept for inspection; the ranking is by position, see the module docstring)
    token_types:  [V] llama.cpp types (1 normal, 3 control, 4 user-defined, 6 byte)
    bos_token_id, eos_token_id: ids in [0, V), or None
    add_bos:      ``encode`` prepends BOS (``tokenizer.ggml.add_bos_token``)
    Raises ModelFormatError if the lists disagree or a byte token is missing.
    """

    def __init__(self, tokens: list[str], scores: list[float], token_types: list[int], *,
                 bos_token_id: int | None = None, eos_token_id: int | None = None, add_bos: bool = True):
        if not len(tokens) == len(scores) == len(token_types):
            raise ModelFormatError(f"{len(tokens)} tokens, {len(scores)} scores and {len(token_types)} token types; "
                                   "the vocabulary lists must have one entry per token")
        self.tokens, self.scores, self.token_types = list(tokens), list(scores), [int(t) for t in token_types]
        for name, tid in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id)):
            if tid is not None:
                check_int(name, tid, minimum=0, maximum=len(self.tokens) - 1, error=ModelFormatError,
                          hint=f"the vocabulary has {len(self.tokens)} tokens")
        self.bos_token_id, self.eos_token_id, self.add_bos = bos_token_id, eos_token_id, bool(add_bos)
        self.special_ids = frozenset(i for i, t in enumerate(self.token_types) if t == TOKEN_TYPE_CONTROL)
        # spelling -> id; a spelling that occurs twice keeps its last id (a dict, as transformers builds it)
        self._rank = {_spelling(t): i for i, t in enumerate(self.tokens)}
        self._added = {t: i for i, (t, kind) in enumerate(zip(self.tokens, self.token_types))
                       if kind == TOKEN_TYPE_CONTROL or (kind == TOKEN_TYPE_USER_DEFINED and _spelling(t) == t)}
        self._added_lengths = sorted({len(t) for t in self._added}, reverse=True)
        self._added_first = {t[0] for t in self._added if t}
        self._byte_id = {}
        for i, t in enumerate(self.tokens):
            m = _BYTE_TOKEN.fullmatch(t)
            if m and self.token_types[i] == TOKEN_TYPE_BYTE:
                self._byte_id[int(m.group(1), 16)] = i
        if len(self._byte_id) != 256:
            raise ModelFormatError(f"the vocabulary has {len(self._byte_id)} of the 256 byte tokens <0x00>..<0xFF> "
                                   "(type 6) that byte fallback needs")
        self._bytes = [bytes([int(_BYTE_TOKEN.fullmatch(t).group(1), 16)]) if k == TOKEN_TYPE_BYTE
                       else t.replace(SPACE, " ").encode("utf-8") for t, k in zip(self.tokens, self.token_types)]

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer(vocab_size={self.vocab_size}, bos={self.bos_token_id}, eos={self.eos_token_id})"

    # -- text -> ids --------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` ([T] ints); BOS first if ``add_special_tokens`` and the file asks for it."""
        if not isinstance(text, str):
            raise InvalidInputError(f"text must be a str, got {type(text).__name__}"
                                    + ("; decode bytes with .decode('utf-8') first" if isinstance(text, bytes)
                                       else ""))
        ids = [self.bos_token_id] if add_special_tokens and self.add_bos and self.bos_token_id is not None else []
        for piece, added_id in self._split_added(text):
            ids.extend([added_id] if added_id is not None else self._bpe(piece.replace(" ", SPACE)))
        return ids

    def _split_added(self, text: str) -> list[tuple[str, int | None]]:
        """Move 1: [(text, None) | (added token, its id)] in order, added tokens matched leftmost-longest."""
        out, start, i = [], 0, 0
        while i < len(text):
            hit = None
            if text[i] in self._added_first:
                hit = next((text[i:i + n] for n in self._added_lengths if text[i:i + n] in self._added), None)
            if hit is None:
                i += 1
                continue
            if start < i:
                out.append((text[start:i], None))
            out.append((hit, self._added[hit]))
            i = start = i + len(hit)
        if start < len(text):
            out.append((text[start:], None))
        return out

    def _bpe(self, piece: str) -> list[int]:
        """Moves 3 and 4 on one piece (spaces already ``▁``): merge the best-ranked pair until none is left.

        The symbols form a linked list over their first character's index; a heap holds the
        candidate merges keyed by (rank of the merged token, longer left piece first, leftmost).
        A popped candidate whose symbols have changed since it was pushed is stale and skipped.
        """
        sym = list(piece)                                  # sym[i]: the symbol starting at char i ("" once merged)
        nxt, prv = list(range(1, len(sym) + 1)), list(range(-1, len(sym) - 1))
        heap: list = []

        def push(i: int) -> None:
            j = nxt[i] if i >= 0 else len(sym)
            if i >= 0 and j < len(sym) and sym[i] in self._rank and sym[j] in self._rank:
                rank = self._rank.get(sym[i] + sym[j])
                if rank is not None:
                    heapq.heappush(heap, (rank, -len(sym[i]), i, sym[i], sym[j]))

        for i in range(len(sym) - 1):
            push(i)
        while heap:
            _, _, i, left, right = heapq.heappop(heap)
            j = nxt[i]
            if sym[i] != left or j >= len(sym) or sym[j] != right:
                continue                                   # stale: one side was merged into something else
            sym[i], sym[j] = left + right, ""
            nxt[i] = nxt[j]
            if nxt[i] < len(sym):
                prv[nxt[i]] = i
            push(prv[i])
            push(i)
        ids = []
        for s in sym:
            if s in self._rank:
                ids.append(self._rank[s])
            elif s:                                        # move 4: a character that is no token
                ids.extend(self._byte_id[b] for b in s.encode("utf-8"))
        return ids

    # -- ids -> text --------------------------------------------------------------------------
    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` ([T] ints): ``▁`` -> space, byte tokens -> bytes (invalid runs: U+FFFD per byte)."""
        parts, run = [], []
        for i in [*self.check_ids(ids, skip_special_tokens), None]:
            if i is not None and self.token_types[i] == TOKEN_TYPE_BYTE:
                run.append(self._bytes[i])
                continue
            if run:
                try:
                    parts.append(b"".join(run).decode("utf-8"))
                except UnicodeDecodeError:
                    parts.append("\ufffd" * len(run))
                run = []
            if i is not None:
                parts.append(self._bytes[i].decode("utf-8"))
        return "".join(parts)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        raise ModelFormatError("this Gemma file carries no chat template (tokenizer.chat_template): it is the base "
                               "model; feed it plain text")
