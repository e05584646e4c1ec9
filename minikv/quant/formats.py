"""Step 5, the formats: which codec stores K and which stores V, grouped along which axis, in how many bytes.

The formats (``KV_DTYPES``: one name space, the ``kv_dtype=`` of ``make_cache``)
---------------------------------------------------------------------------
============  =====================================  =====================================
kv_dtype      K                                      V
============  =====================================  =====================================
fp32          float32 (the plain ``PagedKVCache``)   float32
fp16, bf16    the value cast                         the value cast
int8          q8_0 per token along D (group 32)      q8_0 per token along D
int4          q4_0 per token along D (group 32)      q4_0
q4_1          q4_1 per token along D (group 32)      q4_1
kivi2, kivi4  asym 2/4-bit **per channel**, groups   asym 2/4-bit per token, groups of
              of ``group`` tokens (KIVI)             ``group`` channels along D
fp8           e4m3fn, fp16 scale per ``group``       the same
              values of a token along D
fp8_e5m2      e5m2, the same                         the same
k16v8         fp16                                   q8_0
============  =====================================  =====================================

Every kv_dtype runs on the paged layout only (``QuantizedPagedKVCache``; "fp32" there is lossless,
and ``make_cache`` gives the plain ``PagedKVCache`` for it); there is no contiguous variant (a
notebook can call the codecs on arrays directly). A group must divide what it groups
(``head_dim``; ``block_size`` for KIVI's keys): other sizes are refused, never padded.

Bytes (``bytes_per_token``: averaged over a full, quantized block)
-----------------------------------------------------------------
A full block of ``bs`` tokens takes per layer ``bs * Hkv * bytes_for(D)`` per side for a
per-token codec and ``Hkv * D * bytes_for(bs)`` for KIVI's per-channel keys; ``bytes_per_token``
is ``L * (K + V) / bs`` (a float: KIVI-2 with G = 32 is 12 bytes per 32 values). A residual token
costs ``2 L Hkv D itemsize(dtype)``. ``bytes_used`` = full quantized blocks in use x their bytes +
residual tokens x their bytes, shared blocks counted once. (This reference keeps a
full-size full-precision pool for the open blocks, so ``bytes_allocated`` is larger.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minikv.errors import ConfigError
from minikv.quant.codecs import GROUPED, QK, Codec, codec

# kv_dtype -> (K codec, K axis, V codec, V axis); axis "token": groups along D of one token,
# "channel": groups along the tokens of one channel (KIVI's keys)
KV_DTYPES: dict[str, tuple[str, str, str, str]] = {
    "fp32": ("fp32", "token", "fp32", "token"),
    "fp16": ("fp16", "token", "fp16", "token"),
    "bf16": ("bf16", "token", "bf16", "token"),
    "int8": ("q8_0", "token", "q8_0", "token"),
    "int4": ("q4_0", "token", "q4_0", "token"),
    "q4_1": ("q4_1", "token", "q4_1", "token"),
    "kivi2": ("asym2", "channel", "asym2", "token"),
    "kivi4": ("asym4", "channel", "asym4", "token"),
    "fp8": ("fp8_e4m3fn", "token", "fp8_e4m3fn", "token"),
    "fp8_e5m2": ("fp8_e5m2", "token", "fp8_e5m2", "token"),
    "k16v8": ("fp16", "token", "q8_0", "token"),
}


def is_kivi(kv_dtype: str) -> bool:
    """Whether ``kv_dtype`` groups its keys along tokens (its block size is then KIVI's residual)."""
    return KV_DTYPES.get(kv_dtype, ("", "token"))[1] == "channel"


@dataclass(frozen=True)
class Side:
    """How one of K, V is stored in a full block ``[bs, Hkv, D]``: a codec and the axis it groups along."""

    codec: Codec
    axis: str  # "token" or "channel"

    def block_bytes(self, bs: int, hkv: int, d: int) -> int:
        """Bytes of one layer's full block: bs*Hkv*bytes_for(D) ("token") or Hkv*D*bytes_for(bs) ("channel")."""
        return bs * hkv * self.codec.bytes_for(d) if self.axis == "token" else hkv * d * self.codec.bytes_for(bs)

    def encode(self, x: np.ndarray) -> np.ndarray:
        """Full blocks [..., bs, Hkv, D] -> uint8 [..., block_bytes]."""
        lead = x.shape[:-3]
        if self.axis == "channel":
            x = np.moveaxis(x, -3, -1)  # [..., Hkv, D, bs]: groups of tokens per channel
        out = self.codec.encode(x)
        return out.reshape(*lead, int(np.prod(out.shape[len(lead):])))  # (explicit: lead may be empty)

    def decode(self, b: np.ndarray, bs: int, hkv: int, d: int) -> np.ndarray:
        """uint8 [..., block_bytes] -> float32 [..., bs, Hkv, D]."""
        lead = b.shape[:-1]
        if self.axis == "token":
            return self.codec.decode(b.reshape(*lead, bs, hkv, self.codec.bytes_for(d)))
        return np.moveaxis(self.codec.decode(b.reshape(*lead, hkv, d, self.codec.bytes_for(bs))), -1, -3)


@dataclass(frozen=True)
class KVFormat:
    """A ``kv_dtype`` made concrete for a geometry: the K side, the V side and their bytes."""

    name: str
    k: Side
    v: Side
    block_size: int
    num_kv_heads: int
    head_dim: int

    def block_bytes(self) -> tuple[int, int]:
        """(K, V) bytes of one layer's full block."""
        geo = (self.block_size, self.num_kv_heads, self.head_dim)
        return self.k.block_bytes(*geo), self.v.block_bytes(*geo)


def kv_format(kv_dtype: str, group: int, block_size: int, num_kv_heads: int, head_dim: int) -> KVFormat:
    """The format ``kv_dtype`` for blocks [block_size, Hkv, D]; ConfigError naming what does not fit.

    A group must divide what it groups: ``head_dim`` for per-token sides, ``block_size`` for KIVI's
    per-channel keys (q8_0/q4_x: group 32 only). minikv refuses rather than pads.
    """
    if kv_dtype not in KV_DTYPES:
        raise ConfigError(f"kv_dtype={kv_dtype!r}; use one of {', '.join(KV_DTYPES)}")
    kc, ka, vc, va = KV_DTYPES[kv_dtype]
    sides = []
    for name, axis in ((kc, ka), (vc, va)):
        c = codec(name, group if name in GROUPED else QK)
        n, what = (head_dim, "head_dim") if axis == "token" else (block_size, "block_size (KIVI's residual)")
        if n % c.group:
            raise ConfigError(f"kv_dtype={kv_dtype!r}: {what}={n} is not a multiple of {c.name}'s group of "
                              f"{c.group}; pick a group that divides {n}")
        sides.append(Side(c, axis))
    return KVFormat(kv_dtype, sides[0], sides[1], block_size, num_kv_heads, head_dim)


def kv_bytes_per_token(kv_dtype: str, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                       group: int = 32) -> float:
    """``QuantizedPagedKVCache.bytes_per_token`` without building one: L (K + V block bytes) / block_size.

    For kivi* pass KIVI's residual as ``block_size`` (that is the block it uses).
    """
    fmt = kv_format(kv_dtype, group, block_size, num_kv_heads, head_dim)
    return num_layers * sum(fmt.block_bytes()) / block_size
