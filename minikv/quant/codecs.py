"""Step 5, the codecs: pure functions that turn float rows into bytes and back.

Every codec works on the **last axis** of its input, in groups of ``group`` values,
and writes each group as one fixed-size record of bytes (scales and zero points
included), so ``encode(x)`` maps ``[..., n]`` float to ``[..., n // group * group_bytes]``
uint8 and ``decode`` maps it back to ``[..., n]`` float32. ``n`` must be a multiple of
the group (ShapeError naming the group otherwise: minikv refuses, it does not pad).

========  =====  ====================================================  ===========
codec     group  one group's record (little-endian)                    bits/value
========  =====  ====================================================  ===========
q8_0      32     fp16 d = amax/127, then 32 x int8 q; x = d q           8.5
q4_0      32     fp16 d = max/-8, then 16 bytes: q[i] | q[i+16] << 4;   4.5
                 x = d (q - 8)  (``max``: the signed value of largest |x|)
q4_1      32     fp16 d = (max-min)/15, fp16 m = min, 16 bytes as q4_0;  5.0
                 x = d q + m
asym<b>   g      fp16 s = (max-min)/(2^b-1), fp16 z = min, g*b/8 bytes,  (32 + g b)/g
                 value i in bits b*(i % (8/b)) of byte i // (8/b);
                 x = s q + z                                  (b = 2 or 4)
fp8       g      fp16 s = amax/448, then g x float8_e4m3fn; x = s f      (16 + 8 g)/g
fp8_e5m2  g      fp16 s = amax/57344, then g x float8_e5m2              (16 + 8 g)/g
fp16/bf16 1      the value itself (bf16: ``ml_dtypes.bfloat16``)        16
fp32      1      the value itself                                       32
========  =====  ====================================================  ===========

q8_0, q4_0 and q4_1 are llama.cpp's block formats, byte for byte (the tests compare
against ``gguf.quants.quantize``): the quantizer uses the float32 scale and its
reciprocal, the record stores the scale rounded to fp16. Rounding is what ggml does:
q8_0 rounds half away from zero (C's ``roundf``), q4_0 and q4_1 truncate ``x/d + 8.5`` and
``(x - min)/d + 0.5``. The asymmetric and fp8 codecs quantize with the *stored* fp16
scale (and zero), so what ``decode`` sees is what ``encode`` used.

FP8 is OCP E4M3FN (4 exponent bits, 3 mantissa bits, no infinity, largest 448; NaN is the
only special value) unless E5M2 is named (largest 57344, has infinity). ``ml_dtypes``
turns an out-of-range float into NaN for E4M3FN, so ``to_fp8`` clips to +-max before
the cast: an overflow *saturates*.

Values a record cannot store: large ones saturate, NaN and inf are refused
--------------------------------------------------------------------------
A record keeps its scale (and zero point) in fp16, whose largest finite value is 65504. A group
whose scale would be larger than that used to store inf, and decode turned the *whole group*
(for KIVI's keys, a channel across a block) into NaN or inf. Now every codec **saturates**: the
scale is clamped to 65504, the zero point to [-65504, 65504], the codes to their range. Every
value of the group stays finite; values inside the limits below are stored as before (byte for
byte llama.cpp's records), larger magnitudes are cut to the largest the record can hold.

=========  ===============================================================
codec      stored without saturating
=========  ===============================================================
q8_0       abs(x) <= 127 x 65504, about 8.3e6
q4_0       abs(x) <= 8 x 65504, about 5.2e5
q4_1       min >= -65504 and max - min <= 15 x 65504 (about 9.8e5)
asym2/4    min in [-65504, 65504], max - min <= 3 or 15 x 65504 (2.0e5 / 9.8e5)
fp8        abs(x) <= 448 x 65504, about 2.9e7 (fp8_e5m2: 57344 x 65504, about 3.8e9)
fp16/bf16  abs(x) <= 65504 (bf16: its largest finite, about 3.39e38)
=========  ===============================================================

Why saturate rather than refuse a large finite value: it is a legal input (an outlier channel),
saturation keeps the rest of its group usable, and it is what the fp8 cast already did per value.
A NaN or an infinity has no value to saturate to: it means the model has already overflowed, and
stored it would poison up to ``group - 1`` finite neighbours, so ``encode`` **refuses** it
(``InvalidInputError`` naming the codec); a cache step that would quantize it rolls back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import ml_dtypes
import numpy as np

from minikv.errors import ConfigError, InvalidInputError, ShapeError

__all__ = ["Codec", "CODECS", "codec", "round_half_away", "pack_bits", "unpack_bits", "to_fp8",
           "encode_q8_0", "decode_q8_0", "encode_q4_0", "decode_q4_0", "encode_q4_1", "decode_q4_1",
           "encode_asym", "decode_asym", "encode_fp8", "decode_fp8", "encode_cast", "decode_cast"]

QK = 32  # llama.cpp's block of values for q8_0, q4_0, q4_1
FP8 = {"e4m3fn": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
CASTS = {"fp32": np.dtype(np.float32), "fp16": np.dtype(np.float16), "bf16": np.dtype(ml_dtypes.bfloat16)}
F16_MAX = np.float32(65504.0)  # the largest finite fp16: the most a record's scale or zero point can hold


# --- helpers ---------------------------------------------------------------------------------

def _groups(x: np.ndarray, group: int, name: str) -> np.ndarray:
    """x [..., n] as float32 [..., n // group, group]; ShapeError naming the group if it does not divide n,
    InvalidInputError naming the codec ``name`` if x holds NaN or inf (see the module docstring)."""
    x = np.asarray(x)
    if x.ndim == 0 or x.shape[-1] % group:
        raise ShapeError(f"the last axis ({x.shape[-1] if x.ndim else 'a scalar'}) is not a multiple of the "
                         f"group of {group} values; use a group that divides it")
    _check_finite(x, name)
    return x.astype(np.float32, copy=False).reshape(*x.shape[:-1], x.shape[-1] // group, group)


def _check_finite(x: np.ndarray, name: str) -> None:
    if not np.isfinite(x).all():
        raise InvalidInputError(f"{name}: {int(np.sum(~np.isfinite(x)))} of the {x.size} values to encode are NaN "
                                "or inf, which no record stores (they would turn their whole group into NaN); the "
                                "model's activations overflowed before the cache")


def _saturate(a: np.ndarray) -> np.ndarray:
    """A scale or zero point clamped to fp16's finite range (float32 in, float32 out)."""
    return np.clip(a, -F16_MAX, F16_MAX).astype(np.float32)


def _records(b: np.ndarray, group_bytes: int) -> np.ndarray:
    """packed [..., m] uint8 as [..., m // group_bytes, group_bytes]."""
    b = np.asarray(b)
    if b.dtype != np.uint8 or b.ndim == 0 or b.shape[-1] % group_bytes:
        raise ShapeError(f"packed bytes of shape {b.shape} and dtype {b.dtype}: expected uint8 with a last axis "
                         f"that is a multiple of the {group_bytes}-byte group record")
    return b.reshape(*b.shape[:-1], b.shape[-1] // group_bytes, group_bytes)


def _flat(rec: np.ndarray) -> np.ndarray:
    """[..., groups, bytes] -> [..., groups * bytes] (the inverse of ``_records``/``_groups``)."""
    return rec.reshape(*rec.shape[:-2], rec.shape[-2] * rec.shape[-1])


def _fp16_bytes(a: np.ndarray) -> np.ndarray:
    """float32 [..., 1] -> its fp16 rounding as 2 little-endian bytes [..., 2]."""
    return a.astype("<f2").view(np.uint8)


def _fp16_of(rec: np.ndarray, at: int) -> np.ndarray:
    """The fp16 stored at bytes ``at, at+1`` of every record, as float32 [..., 1]."""
    return np.ascontiguousarray(rec[..., at:at + 2]).view("<f2").astype(np.float32)


def _inverse(d: np.ndarray) -> np.ndarray:
    """1/d, and 0 where d == 0 (an all-zero or constant group quantizes to code 0, never NaN)."""
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)


def round_half_away(x: np.ndarray) -> np.ndarray:
    """Round to nearest, ties away from zero (C's roundf), exactly, in x's dtype.

    ``floor(|x| + 0.5)`` is not exact (0.49999997 + 0.5 rounds up to 1 in float32); the
    fractional part ``|x| - floor(|x|)`` is exact, so it decides instead.
    """
    a = np.abs(x)
    whole = np.floor(a)
    return np.sign(x) * (whole + (a - whole >= 0.5))


def pack_bits(q: np.ndarray, bits: int) -> np.ndarray:
    """Codes [..., n] (each < 2**bits, bits in 2/4/8) -> [..., n * bits / 8] uint8, value i in bits b*(i % k)."""
    per = 8 // bits
    q = np.asarray(q, dtype=np.uint8)
    q = q.reshape(*q.shape[:-1], q.shape[-1] // per, per)
    shifts = (np.arange(per, dtype=np.uint8) * bits)
    return np.bitwise_or.reduce(q << shifts, axis=-1).astype(np.uint8)


def unpack_bits(b: np.ndarray, bits: int) -> np.ndarray:
    """The inverse of ``pack_bits``: [..., m] uint8 -> [..., m * 8 / bits] uint8 codes."""
    per = 8 // bits
    shifts = (np.arange(per, dtype=np.uint8) * bits)
    q = (np.asarray(b, dtype=np.uint8)[..., None] >> shifts) & np.uint8((1 << bits) - 1)
    return q.reshape(*q.shape[:-2], q.shape[-2] * per)


# --- llama.cpp's q8_0, q4_0, q4_1 --------------------------------------------------------------

def encode_q8_0(x: np.ndarray) -> np.ndarray:
    """[..., n] -> [..., n/32 * 34] uint8: per 32 values fp16 d = amax/127, then int8 roundf(x/d)."""
    g = _groups(x, QK, "q8_0")
    d = _saturate(np.abs(g).max(axis=-1, keepdims=True) / np.float32(127))
    q = np.clip(round_half_away(g * _inverse(d)), -127, 127).astype(np.int8)
    return _flat(np.concatenate([_fp16_bytes(d), q.view(np.uint8)], axis=-1))


def decode_q8_0(b: np.ndarray) -> np.ndarray:
    """[..., n/32 * 34] uint8 -> float32 [..., n]: x = d q."""
    rec = _records(b, 2 + QK)
    return _flat(_fp16_of(rec, 0) * rec[..., 2:].view(np.int8).astype(np.float32))


def _nibbles(q: np.ndarray) -> np.ndarray:
    """32 codes < 16 -> 16 bytes, ggml's order: byte i = q[i] | q[i + 16] << 4."""
    return q[..., :QK // 2] | (q[..., QK // 2:] << np.uint8(4))


def _unnibble(b: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 codes (low nibbles first, then high nibbles), uint8."""
    return np.concatenate([b & np.uint8(0x0F), b >> np.uint8(4)], axis=-1)


def encode_q4_0(x: np.ndarray) -> np.ndarray:
    """[..., n] -> [..., n/32 * 18] uint8: fp16 d = max/-8 (signed largest |x|), codes trunc(x/d + 8.5)."""
    g = _groups(x, QK, "q4_0")
    big = np.take_along_axis(g, np.abs(g).argmax(axis=-1)[..., None], axis=-1)  # first index on ties
    d = _saturate(big / np.float32(-8))
    q = np.clip(np.trunc(g * _inverse(d) + np.float32(8.5)), 0, 15).astype(np.uint8)
    return _flat(np.concatenate([_fp16_bytes(d), _nibbles(q)], axis=-1))


def decode_q4_0(b: np.ndarray) -> np.ndarray:
    """[..., n/32 * 18] uint8 -> float32 [..., n]: x = d (q - 8)."""
    rec = _records(b, 2 + QK // 2)
    return _flat(_fp16_of(rec, 0) * (_unnibble(rec[..., 2:]).astype(np.float32) - np.float32(8)))


def encode_q4_1(x: np.ndarray) -> np.ndarray:
    """[..., n] -> [..., n/32 * 20] uint8: fp16 d = (max-min)/15, fp16 m = min, codes trunc((x-min)/d + 0.5)."""
    g = _groups(x, QK, "q4_1")
    lo, hi = g.min(axis=-1, keepdims=True), g.max(axis=-1, keepdims=True)
    with np.errstate(over="ignore"):  # max - min past float32's range: inf, which saturates
        d = _saturate((hi - lo) / np.float32(15))
        lo = _saturate(lo)
        q = np.clip(np.trunc((g - lo) * _inverse(d) + np.float32(0.5)), 0, 15).astype(np.uint8)
    return _flat(np.concatenate([_fp16_bytes(d), _fp16_bytes(lo), _nibbles(q)], axis=-1))


def decode_q4_1(b: np.ndarray) -> np.ndarray:
    """[..., n/32 * 20] uint8 -> float32 [..., n]: x = d q + m."""
    rec = _records(b, 4 + QK // 2)
    return _flat(_fp16_of(rec, 0) * _unnibble(rec[..., 4:]).astype(np.float32) + _fp16_of(rec, 2))


# --- asymmetric 2/4-bit (KIVI's quantizer) -----------------------------------------------------

def encode_asym(x: np.ndarray, bits: int, group: int) -> np.ndarray:
    """[..., n] -> [..., n/group * (4 + group*bits/8)] uint8: fp16 scale, fp16 zero (= min), packed codes.

    s = fp16((max - min) / (2^b - 1)), z = fp16(min), q = clip(roundf((x - z) / s), 0, 2^b - 1).
    """
    g = _groups(x, group, f"asym{bits}")
    top = np.float32((1 << bits) - 1)
    lo, hi = g.min(axis=-1, keepdims=True), g.max(axis=-1, keepdims=True)
    with np.errstate(over="ignore"):  # max - min past float32's range: inf, which saturates
        s = _saturate((hi - lo) / top).astype(np.float16).astype(np.float32)
        z = _saturate(lo).astype(np.float16).astype(np.float32)
        q = np.clip(round_half_away((g - z) * _inverse(s)), 0, top).astype(np.uint8)
    return _flat(np.concatenate([_fp16_bytes(s), _fp16_bytes(z), pack_bits(q, bits)], axis=-1))


def decode_asym(b: np.ndarray, bits: int, group: int) -> np.ndarray:
    """[..., n/group * (4 + group*bits/8)] uint8 -> float32 [..., n]: x = s q + z."""
    rec = _records(b, 4 + group * bits // 8)
    return _flat(_fp16_of(rec, 0) * unpack_bits(rec[..., 4:], bits).astype(np.float32) + _fp16_of(rec, 2))


# --- fp8 with a scale per group ------------------------------------------------------------------

def to_fp8(x: np.ndarray, fmt: str = "e4m3fn") -> np.ndarray:
    """Cast to FP8 ``fmt`` saturating: clip to +-max first (E4M3FN has no infinity; ml_dtypes gives NaN)."""
    dt = FP8[fmt]
    big = np.float32(ml_dtypes.finfo(dt).max)
    return np.clip(np.asarray(x, dtype=np.float32), -big, big).astype(dt)


def encode_fp8(x: np.ndarray, group: int, fmt: str = "e4m3fn") -> np.ndarray:
    """[..., n] -> [..., n/group * (2 + group)] uint8: fp16 s = amax/max_fp8, then fp8(x / s) saturated."""
    g = _groups(x, group, f"fp8_{fmt}")
    big = np.float32(ml_dtypes.finfo(FP8[fmt]).max)
    s = _saturate(np.abs(g).max(axis=-1, keepdims=True) / big).astype(np.float16).astype(np.float32)
    f = to_fp8(g * _inverse(s), fmt)
    return _flat(np.concatenate([_fp16_bytes(s), f.view(np.uint8)], axis=-1))


def decode_fp8(b: np.ndarray, group: int, fmt: str = "e4m3fn") -> np.ndarray:
    """[..., n/group * (2 + group)] uint8 -> float32 [..., n]: x = s f."""
    rec = _records(b, 2 + group)
    return _flat(_fp16_of(rec, 0) * np.ascontiguousarray(rec[..., 2:]).view(FP8[fmt]).astype(np.float32))


# --- plain storage -----------------------------------------------------------------------------

def encode_cast(x: np.ndarray, name: str) -> np.ndarray:
    """[..., n] -> [..., n * itemsize] uint8: the values cast to fp32/fp16/bf16 (saturated), as their bytes."""
    x = np.asarray(x)
    _check_finite(x, name)
    big = ml_dtypes.finfo(CASTS[name]).max if name != "fp32" else None
    x = x if big is None else np.clip(x, -big, big)
    return np.ascontiguousarray(x.astype(CASTS[name])).view(np.uint8).reshape(
        *x.shape[:-1], x.shape[-1] * CASTS[name].itemsize)


def decode_cast(b: np.ndarray, name: str) -> np.ndarray:
    """[..., n * itemsize] uint8 -> float32 [..., n]."""
    return _flat(_records(b, CASTS[name].itemsize)).view(CASTS[name]).astype(np.float32)


# --- the registry -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Codec:
    """One codec: ``encode`` [..., n] float -> [..., bytes_for(n)] uint8, ``decode`` back to float32.

    group:       values per record (1 for plain casts); n must be a multiple of it
    group_bytes: bytes per record, scales and zero points included
    """

    name: str
    group: int
    group_bytes: int
    encode: Callable[[np.ndarray], np.ndarray]
    decode: Callable[[np.ndarray], np.ndarray]

    @property
    def bytes_per_value(self) -> float:
        """group_bytes / group (q8_0: 34/32 = 1.0625)."""
        return self.group_bytes / self.group

    @property
    def bits(self) -> float:
        return 8 * self.bytes_per_value

    def bytes_for(self, n: int) -> int:
        """Bytes that ``n`` values take (n a multiple of ``group``): n / group * group_bytes."""
        if n % self.group:
            raise ShapeError(f"{n} values are not a multiple of {self.name}'s group of {self.group}")
        return n // self.group * self.group_bytes


def _asym(bits: int) -> Callable[[int], Codec]:
    return lambda g: Codec(f"asym{bits}", g, 4 + g * bits // 8, lambda x: encode_asym(x, bits, g),
                           lambda b: decode_asym(b, bits, g))


def _fp8(fmt: str) -> Callable[[int], Codec]:
    return lambda g: Codec(f"fp8_{fmt}", g, 2 + g, lambda x: encode_fp8(x, g, fmt), lambda b: decode_fp8(b, g, fmt))


def _cast(name: str) -> Callable[[int], Codec]:
    return lambda g: Codec(name, 1, CASTS[name].itemsize, lambda x: encode_cast(x, name),
                           lambda b: decode_cast(b, name))


def _fixed(name: str, nbytes: int, enc, dec) -> Callable[[int], Codec]:
    return lambda g: Codec(name, QK, nbytes, enc, dec)


# name -> build(group); q8_0/q4_x have llama.cpp's fixed group of 32, casts a group of 1
CODECS: dict[str, Callable[[int], Codec]] = {
    "q8_0": _fixed("q8_0", 2 + QK, encode_q8_0, decode_q8_0),
    "q4_0": _fixed("q4_0", 2 + QK // 2, encode_q4_0, decode_q4_0),
    "q4_1": _fixed("q4_1", 4 + QK // 2, encode_q4_1, decode_q4_1),
    "asym2": _asym(2), "asym4": _asym(4),
    "fp8_e4m3fn": _fp8("e4m3fn"), "fp8_e5m2": _fp8("e5m2"),
    "fp32": _cast("fp32"), "fp16": _cast("fp16"), "bf16": _cast("bf16"),
}
GROUPED = ("asym2", "asym4", "fp8_e4m3fn", "fp8_e5m2")  # the codecs whose group is a choice


def codec(name: str, group: int = QK) -> Codec:
    """The codec ``name`` with ``group`` values per record (ConfigError naming a bad name or group).

    q8_0/q4_0/q4_1 take only group=32 (llama.cpp's block); asym2 needs an even group and asym4 a
    multiple of 2 (whole bytes); casts ignore the group.
    """
    if name not in CODECS:
        raise ConfigError(f"codec {name!r}; use one of {tuple(CODECS)}")
    if isinstance(group, bool) or not isinstance(group, (int, np.integer)) or group < 1:
        raise ConfigError(f"group={group!r} must be a positive integer (values per scale)")
    if name.startswith("q") and group != QK:
        raise ConfigError(f"group={group}: {name} is llama.cpp's block of {QK} values; use group={QK}")
    bits = {"asym2": 2, "asym4": 4}.get(name, 8)
    if (group * bits) % 8:
        raise ConfigError(f"group={group}: {name} packs {8 // bits} values per byte; use a multiple of "
                          f"{8 // bits}")
    return CODECS[name](int(group))
