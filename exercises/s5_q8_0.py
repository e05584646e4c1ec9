"""Step 5, exercise ``q8_0``: ``minikv.textbook.s5_quant.encode_q8_0`` / ``decode_q8_0`` with their bodies removed.

The tests compare your bytes with the ``gguf`` package's own quantizer (llama.cpp's format), then
run the lesson's quantized cache on them. Check: ``python -m exercises q8_0``.
"""

from __future__ import annotations

import numpy as np

from minikv.textbook.s5_quant import QK, round_half_away


def encode_q8_0(x: np.ndarray) -> np.ndarray:
    """[..., n] floats (n a multiple of 32) -> [..., n // 32 * 34] uint8.

    Per group g of 32 consecutive values along the last axis:
        d = max|g| / 127                 computed in float32, stored as float16: 2 bytes, little-endian
        q = roundf(g * (1 / d)) as int8  32 bytes (0 where d == 0); roundf rounds ties away from
                                         zero: use ``round_half_away`` (np.round rounds to even)
    record = d's 2 bytes then q's 32 bytes; the records follow each other.
    Details that make the bytes exact: cast x to float32 first; divide by multiplying with
    ``1 / d`` in float32 (llama.cpp does); the scale stored is ``d.astype("<f2")``.
    Hint: reshape to [..., n // 32, 32] (not with -1: the leading axes may be empty);
    ``a.view(np.uint8)`` gives an array's bytes.
    """
    raise NotImplementedError("write me: q8_0 encode (see the docstring)")


def decode_q8_0(b: np.ndarray) -> np.ndarray:
    """[..., m * 34] uint8 -> float32 [..., m * 32]: per record x = d * q (d the fp16, q the int8s)."""
    raise NotImplementedError("write me: q8_0 decode")


__all__ = ["encode_q8_0", "decode_q8_0", "round_half_away", "QK"]
