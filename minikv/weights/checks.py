"""What the loaders check in a file before they build anything from it (issue 25).

* ``Fields``: a ``config.json`` object whose values are read with their JSON type checked, so that
  ``num_hidden_layers: 2.7`` is refused (not truncated to 2), ``tie_word_embeddings: "false"`` is refused
  (not read as true), a float is finite and positive where the math needs it, and a nested object
  (``rope_parameters``) that is a list or null is named instead of raising ``AttributeError``.
* ``check_finite``: a tensor's values are finite, or ``ModelFormatError`` naming it. One float64 sum
  per tensor: NaN and inf propagate through it, so the check is a single fast pass.
* ``check_rope_memory``: the RoPE tables a ``max_position`` sizes (from ``context_length`` or
  ``max_position_embeddings``) fit in memory, or an error naming the file's field and the largest
  value that fits, before ``Model`` builds them.
* ``model_file``: a path given as a model file is a regular file: a FIFO or a device (``/dev/zero``)
  would block or never end, and is named as what it is, not as "does not exist".
* ``check_weights_memory``, ``check_layer_count``: a layer count whose weights cannot fit in memory, or
  that the file's tensors cannot back, is refused before one name per layer is built (a GGUF header
  may say ``block_count = 2^31``).
"""

from __future__ import annotations

import numbers
import stat
from pathlib import Path

import numpy as np

from minikv.errors import ConfigError, ModelFileNotFoundError, ModelFormatError, check_float, check_int, check_memory

REQUIRED = object()  # the default of a field that must be present


class Fields(dict):
    """A JSON object from a model file; ``where`` names the file (and the path to the object) in errors.

    ``integer``/``number``/``flag``/``obj`` return the value checked for its type (a missing key gives
    ``default``; without one, ``ModelFormatError`` naming the key); ``get`` is the dict's, unchecked.
    """

    def __init__(self, value, where: str):
        if not isinstance(value, dict):
            raise ModelFormatError(f"{where} holds {_kind(value)}, not a JSON object of fields; it is not a "
                                   "Hugging Face config (re-save it with save_pretrained)")
        super().__init__(value)
        self.where = where

    def _value(self, key: str, default):
        val = dict.get(self, key, default)
        if val is REQUIRED:
            raise ModelFormatError(f"{self.where} lacks {key!r}, which this architecture needs")
        return val

    def integer(self, key: str, default=REQUIRED, minimum: int | None = 1):
        """An integer (JSON ``2``, not ``2.7``, ``"2"`` or ``true``); None passes when it is the default."""
        val = self._value(key, default)
        if val is None and default is None:
            return None
        return check_int(f"{self.where}: {key}", val, minimum=minimum, error=ModelFormatError)

    def number(self, key: str, default=REQUIRED, positive: bool = True):
        """A finite number (positive unless ``positive=False``); None passes when it is the default."""
        val = self._value(key, default)
        if val is None and default is None:
            return None
        return check_float(f"{self.where}: {key}", val, positive=positive, error=ModelFormatError)

    def flag(self, key: str, default: bool) -> bool:
        """A JSON ``true``/``false`` (the string ``"false"`` is refused: it would read as true)."""
        val = self._value(key, default)
        if not isinstance(val, bool):
            raise ModelFormatError(f"{self.where}: {key}={val!r} must be true or false (a JSON boolean)")
        return val

    def obj(self, key: str) -> "Fields":
        """A nested JSON object (absent or null: an empty one)."""
        val = dict.get(self, key)
        return Fields({} if val is None else val, f"{self.where}: {key}")


def _kind(value) -> str:
    return "null" if value is None else f"a JSON {type(value).__name__} ({str(value)[:40]!r})"


def check_finite(name: str, a: np.ndarray, where: str) -> np.ndarray:
    """``a`` if every value is finite, else ModelFormatError naming tensor ``name`` of ``where``."""
    if a.size and not np.isfinite(np.sum(a, dtype=np.float64)):  # NaN and inf propagate through the sum
        bad = int(np.sum(~np.isfinite(a)))
        raise ModelFormatError(f"{where}: tensor {name!r} holds {bad} NaN or inf value(s) of {a.size}; the file "
                               "is corrupt or was saved from a diverged model")
    return a


def check_rope_memory(field: str, max_position, head_dim: int, tables: int, dtype) -> None:
    """Refuse a ``max_position`` (read from ``field``) whose RoPE tables would not fit in memory: ``tables``
    (cos, sin) pairs of [max_position, head_dim / 2] in ``dtype``, built from float64 angles."""
    if not isinstance(max_position, numbers.Integral) or isinstance(max_position, bool):
        return  # ModelConfig names it
    per_position = (head_dim // 2) * (2 * tables * np.dtype(dtype).itemsize + 3 * 8)
    check_memory(field, max_position, per_position, what="the RoPE tables (cos and sin at every position)",
                 error=ConfigError, hint="the file's context length is what sizes them")


def check_weights_memory(field: str, layers: int, hidden: int, intermediate: int, vocab: int, where: str) -> None:
    """Refuse a shape whose float32 weights cannot fit in memory, before anything is built per layer: the
    embedding and one layer's MLP first (naming hidden_size), then ``layers`` of them (naming ``field``).
    Every layer holds at least its MLP (3 H I floats) and two norms, the embedding V x H."""
    check_memory("hidden_size", hidden, 4 * (vocab + 3 * intermediate + 2), error=ModelFormatError,
                 what=f"the float32 embedding (vocab_size={vocab:,}) and one layer's MLP (intermediate_size="
                      f"{intermediate:,}) that {where} describes")
    check_memory(field, layers, 4 * (3 * hidden * intermediate + 2 * hidden), fixed=4 * vocab * hidden,
                 what=f"the float32 weights {where} describes (at least)", error=ModelFormatError)


def check_layer_count(field: str, layers: int, tensors: int, where: str) -> None:
    """Refuse ``layers`` (read from ``field``) when the file holds fewer tensors than that: each layer has
    several, so such a count is a corrupt header (a near miss is left to the loader's "missing tensors")."""
    if layers > tensors:
        raise ModelFormatError(f"{where}: {field}={layers:,} layers, but the file holds only {tensors:,} tensors "
                               "(each layer has several); the header is corrupt")


def model_file(p: Path, origin: str, hint: str) -> Path:
    """``p`` if it is a regular file. A missing path is ModelFileNotFoundError; anything else that is no
    regular file (a FIFO, a character device such as ``/dev/zero``, a socket) is ModelFormatError saying what
    it is, before a reader opens it (a FIFO blocks the open; ``/dev/zero`` reads without end)."""
    try:
        mode = p.stat().st_mode
    except FileNotFoundError:
        raise ModelFileNotFoundError(f"model file {p} (from {origin}) does not exist.\n{hint}") from None
    except OSError as e:
        raise ModelFileNotFoundError(f"model file {p} (from {origin}) cannot be read ({e.strerror or e}).\n{hint}") \
            from None
    if not stat.S_ISREG(mode):
        kind = ("a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a character device" if stat.S_ISCHR(mode)
                else "a block device" if stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "not a regular file")
        raise ModelFormatError(f"model file {p} (from {origin}) is {kind}, not a regular file; pass the model "
                               "file itself (a stream cannot be memory-mapped)")
    return p
