"""GGUF's block formats, dequantized in NumPy: F32, F16, Q8_0, Q4_0, Q4_1, Q5_0 and the K-quants Q4_K, Q6_K.

A quantized GGUF tensor is a run of fixed-size blocks. Each block stores a few float16 scales and
packed small integers; a value is ``scale * q`` (symmetric formats) or ``scale * q - min`` (the
ones with an offset). The layouts below are those of ggml (``ggml-common.h``: ``block_q4_0`` ...
``block_q6_K``) and of its reference dequantizers (``ggml-quants.c``: ``dequantize_row_q4_K`` ...).

    format  values  bytes  one block
    Q8_0      32     34    d f16 | q int8[32]                       x = d * q
    Q4_0      32     18    d f16 | 16 bytes of 4-bit q              x = d * (q - 8)
    Q4_1      32     20    d f16 | m f16 | 16 bytes of 4-bit q      x = d * q + m
    Q5_0      32     22    d f16 | qh u32 | 16 bytes of 4-bit q     x = d * (q - 16), q 5 bits (qh: 5th bits)
    Q4_K     256    144    d f16 | dmin f16 | 12 bytes of 6-bit scales and mins (8 sub-blocks of 32)
                           | 128 bytes of 4-bit q                   x = (d * sc) * q - (dmin * m)
    Q6_K     256    210    128 bytes low 4 bits | 64 bytes high 2 bits | int8 scales[16] (sub-blocks
                           of 16) | d f16                           x = (d * sc) * (q - 32)

Packing of 4-bit values (Q4_0, Q4_1, Q5_0): byte j holds value j in its low nibble and value
j + 16 in its high nibble. Q4_K packs 64 values per 32 bytes the same way (low nibbles first,
then high). Every product is taken in float32 in ggml's order (``d * sc`` first, then ``* q``),
so the results are bit-identical to ggml's and to the ``gguf`` package's
(``gguf.quants.dequantize``, which ``tests/test_gguf_kquants.py`` compares against).
"""

from __future__ import annotations

import numpy as np

from minikv.errors import ModelFormatError

# format -> (values per block, bytes per block)
BLOCKS = {
    "F32": (1, 4), "F16": (1, 2), "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22),
    "Q4_K": (256, 144), "Q6_K": (256, 210),
}


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte ``start`` of every block, as float32: [n, 1]."""
    return np.ascontiguousarray(blocks[:, start:start + 2]).view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """[..., 16 k] bytes -> [..., 32 k] values in 0..15: each 16-byte group's low nibbles, then its high ones."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _q8_0(b):
    return _f16(b, 0) * b[:, 2:].view(np.int8).astype(np.float32)


def _q4_0(b):
    return _f16(b, 0) * (_nibbles(b[:, 2:]).astype(np.float32) - np.float32(8))


def _q4_1(b):
    return _f16(b, 0) * _nibbles(b[:, 4:]).astype(np.float32) + _f16(b, 2)


def _q5_0(b):
    qh = np.ascontiguousarray(b[:, 2:6]).view("<u4")                        # [n, 1]: bit j is value j's 5th bit
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)    # [n, 32]
    q = _nibbles(b[:, 6:]) | (high << 4)
    return _f16(b, 0) * (q.astype(np.float32) - np.float32(16))


def _q4_k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 packed bytes [n, 12] -> 6-bit scales and mins [n, 8] (ggml's ``get_scale_min_k4``).

    Sub-blocks 0-3 keep their scale and min in the low 6 bits of bytes 0-3 and 4-7; sub-blocks 4-7
    keep their low 4 bits in the nibbles of bytes 8-11 and their top 2 bits in the spare top bits
    of bytes 0-3 (scales) and 4-7 (mins).
    """
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)], axis=1)
    mn = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q4_k(b):
    n = b.shape[0]
    sc, mn = _q4_k_scales(b[:, 4:16])
    scale = (_f16(b, 0) * sc)[:, :, None]                                   # [n, 8, 1]  d * sc
    offset = (_f16(b, 2) * mn)[:, :, None]                                  # [n, 8, 1]  dmin * m
    # 4 chunks of 32 bytes; each chunk's low nibbles are sub-block 2c, its high nibbles sub-block 2c + 1
    q = b[:, 16:].reshape(n, 4, 32)
    q = np.stack([q & 0x0F, q >> 4], axis=2).reshape(n, 8, 32).astype(np.float32)
    return (scale * q - offset).reshape(n, 256)


def _q6_k(b):
    n = b.shape[0]
    ql = b[:, :128].reshape(n, 2, 64)                                       # two halves of 128 values
    qh = b[:, 128:192].reshape(n, 2, 32)
    sc = b[:, 192:208].view(np.int8).astype(np.float32)                     # [n, 16]: one per 16 values
    # in each half, the four runs of 32 values take (low bits, high 2 bits) from:
    # (ql[0:32] low, qh bits 0-1), (ql[32:64] low, bits 2-3), (ql[0:32] high, bits 4-5), (ql[32:64] high, 6-7)
    low = [ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4]
    q = np.stack([lo | (((qh >> (2 * i)) & 3) << 4) for i, lo in enumerate(low)], axis=2)  # [n, 2, 4, 32]
    q = q.reshape(n, 16, 16).astype(np.float32) - np.float32(32)
    scale = (_f16(b, 208) * sc)[:, :, None]                                 # [n, 16, 1]  d * sc
    return (scale * q).reshape(n, 256)


_DEQUANTIZE = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q4_K": _q4_k, "Q6_K": _q6_k}


def dequantize(data: np.ndarray, fmt: str, shape: tuple) -> np.ndarray:
    """A GGUF tensor's stored data -> float32 values of ``shape``.

    data:  the tensor's bytes (uint8, any shape; for F32/F16 the float array itself is accepted)
    fmt:   a key of ``BLOCKS`` (GGUF's type name, ``tensor.tensor_type.name``)
    shape: the NumPy shape (GGUF's ``ne`` reversed: rows last-dimension-first, each row whole blocks)
    Raises ModelFormatError for an unknown format or a byte count that does not match ``shape``.
    """
    if fmt not in BLOCKS:
        raise ModelFormatError(f"tensor format {fmt!r} is not implemented; minikv reads {', '.join(BLOCKS)}")
    per_block, nbytes = BLOCKS[fmt]
    count = int(np.prod(shape, dtype=np.int64))
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if count % per_block or raw.size != count // per_block * nbytes:
        raise ModelFormatError(f"a {fmt} tensor of shape {tuple(shape)} needs {count // per_block * nbytes} bytes "
                               f"({per_block} values per {nbytes}-byte block); the file holds {raw.size}")
    if fmt == "F32":
        return raw.view("<f4").astype(np.float32).reshape(shape)
    if fmt == "F16":
        return raw.view("<f2").astype(np.float32).reshape(shape)
    return _DEQUANTIZE[fmt](raw.reshape(-1, nbytes)).reshape(shape)
