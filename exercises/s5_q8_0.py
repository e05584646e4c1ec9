"""Step 5, exercise ``q8_0``: llama.cpp's q8_0 block, byte for byte.

Reference: ``minikv.quant_codecs.encode_q8_0`` / ``decode_q8_0``; the tests compare your bytes with
the ``gguf`` package's own quantizer. Check: ``python -m exercises q8_0``.
"""

import numpy as np

from minikv.quant_codecs import round_half_away

QK = 32  # values per q8_0 block


def encode_q8_0(x: np.ndarray) -> np.ndarray:
    """[..., n] float (n a multiple of 32) -> [..., n // 32 * 34] uint8.

    Per group g of 32 consecutive values:
        d = max|g| / 127                 stored as float16: 2 bytes, little-endian
        q = roundf(g / d) as int8        32 bytes (0 where d == 0); roundf rounds ties away from
                                         zero: use ``round_half_away`` (np.round rounds to even)
    record = d's 2 bytes then q's 32 bytes; the records follow each other.
    Details that make the bytes exact: compute d in float32; divide by multiplying with
    ``1 / d`` in float32 (llama.cpp does); the scale stored is ``d.astype(np.float16)``.
    Hint: reshape to [..., n // 32, 32]; ``a.view(np.uint8)`` gives an array's bytes.
    """
    raise NotImplementedError("write me: q8_0 encode (see the docstring)")


def decode_q8_0(b: np.ndarray) -> np.ndarray:
    """[..., m * 34] uint8 -> float32 [..., m * 32]: per record x = d * q (d the fp16, q the int8s)."""
    raise NotImplementedError("write me: q8_0 decode")


__all__ = ["encode_q8_0", "decode_q8_0", "round_half_away", "QK"]
