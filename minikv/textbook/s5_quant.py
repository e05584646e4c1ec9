"""Step 5: a quantized paged cache. Full blocks in 8 bits, each value quantized once.

For a long context K and V are most of the memory. Storing each value in 8 bits plus one scale
per small group keeps the rounding error relative to that group's own range, and roughly halves
an fp16 cache. The codec here is llama.cpp's **q8_0**, byte for byte:

    per group of 32 consecutive values g (along D, one token and one head):
        d = max|g| / 127                 computed in float32, stored as fp16 (2 bytes)
        q = roundf(g * (1 / d))          32 x int8; roundf rounds ties away from zero; 0 where d = 0
        record = d's 2 bytes, then q's 32 bytes   -> 34 bytes per 32 values: 8.5 bits per value
    decode: x = d * q                    (float32)

When a value is quantized
-------------------------
Exactly once, when its block becomes full: ``write`` encodes the blocks the step fills, and
their bytes never change again. Until then a block's tokens sit in full precision in the
step 3 pool: **the open last block is the residual**, 0 .. b - 1 of the newest tokens. So a
sequence is stored as codes for its full blocks plus one full-precision block.

What a query sees is a function of positions only: the query at position p reads block j
dequantized iff the block is full at p, ``(j + 1) * b <= p + 1``, else in full precision. A
prefill therefore sees exactly what feeding the tokens one at a time sees: its early queries
read a block's rows before the block is full, its later queries the codes. Attention
dequantizes a tile of blocks at a time inside step 2's online softmax and yields each tile
twice, as codes for the queries at which its blocks are full and as full-precision rows for
the others; the masks make each key count once per query. The history is never dequantized
as a whole.

(The engine's ``QuantizedPagedKVCache`` also stores step 5's other formats: q4_0, q4_1, KIVI's
per-channel keys, FP8. Like it, this lesson keeps a full-size pool for the residual rows.)

Run it: ``python -m minikv.textbook.s5_quant`` (against ``QuantizedPagedKVCache(kv_dtype="int8")``).
"""

from __future__ import annotations

import numpy as np

from minikv.textbook.s3_paged import PagedCache

QK = 32  # values per q8_0 group

# --- NEW in step 5 ---


def round_half_away(x: np.ndarray) -> np.ndarray:
    """Round to nearest, ties away from zero (C's roundf), exactly: the fractional part decides.

    (``floor(|x| + 0.5)`` is not exact: 0.49999997 + 0.5 rounds up to 1 in float32.)
    """
    a = np.abs(x)
    whole = np.floor(a)
    return np.sign(x) * (whole + (a - whole >= 0.5))


def encode_q8_0(x: np.ndarray) -> np.ndarray:
    """[..., n] floats (n a multiple of 32) -> [..., n // 32 * 34] uint8: per group, fp16 d then 32 int8."""
    g = x.astype(np.float32).reshape(*x.shape[:-1], x.shape[-1] // QK, QK)
    d = np.abs(g).max(axis=-1, keepdims=True) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)  # llama.cpp multiplies by 1/d
    q = round_half_away(g * inv).astype(np.int8)
    record = np.concatenate([d.astype("<f2").view(np.uint8), q.view(np.uint8)], axis=-1)  # [..., n / 32, 34]
    return record.reshape(*x.shape[:-1], record.shape[-2] * (QK + 2))


def decode_q8_0(b: np.ndarray) -> np.ndarray:
    """[..., m * 34] uint8 -> float32 [..., m * 32]: x = d * q per record."""
    rec = b.reshape(*b.shape[:-1], b.shape[-1] // (QK + 2), QK + 2)
    d = np.ascontiguousarray(rec[..., :2]).view("<f2").astype(np.float32)  # [..., m, 1]
    x = d * rec[..., 2:].view(np.int8)                                      # [..., m, 32]
    return x.reshape(*b.shape[:-1], x.shape[-2] * QK)


class QuantCache(PagedCache):
    """Step 3's paged cache whose full blocks live as q8_0 codes.

    k_codes, v_codes: [L, num_blocks, b, Hkv, D / 32 * 34] uint8 (one record per token and head);
    k_pool, v_pool (step 3): the full-precision rows, read only while a block is open.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        layers, blocks, bs, hkv, d = self.k_pool.shape
        self.k_codes = np.zeros((layers, blocks, bs, hkv, d // QK * (QK + 2)), np.uint8)
        self.v_codes = np.zeros_like(self.k_codes)

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        super().write(layer, k, v)
        for sid, pos, _ in self.seqs:  # the blocks this step fills: encoded now, and never again
            filled = self.tables[sid][pos[0] // self.block_size:(pos[-1] + 1) // self.block_size]
            self.k_codes[layer, filled] = encode_q8_0(self.k_pool[layer, filled])
            self.v_codes[layer, filled] = encode_q8_0(self.v_pool[layer, filled])

    def tiles(self, layer: int, seq_id, q_pos: np.ndarray):
        """Each tile of blocks twice: dequantized where its block is full at the query, as rows elsewhere."""
        bs, rows = self.block_size, (-1, self.num_kv_heads, self.head_dim)
        step3 = super().tiles(layer, seq_id, q_pos)  # the same walk over the table: rows and causal mask
        for (k, v, seen), (blocks, k_pos) in zip(step3, self.block_tiles(self.tables[seq_id])):
            full = (k_pos[None, :] // bs + 1) * bs <= q_pos[:, None] + 1   # [T, K] the key's block is full at q
            yield (decode_q8_0(self.k_codes[layer, blocks]).reshape(rows),
                   decode_q8_0(self.v_codes[layer, blocks]).reshape(rows), seen & full)
            yield k, v, seen & ~full

# --- end NEW ---


def main(max_new_tokens: int = 16):
    from minikv.textbook.demo import demo, engine, greedy_with
    from minikv.textbook.s1_attention import greedy

    return demo("step 5, q8_0 paged cache", greedy_with(greedy, lambda model, n: QuantCache(
        **model.new_cache_args(), num_blocks=-(-n // 16), block_size=16, dtype=model.dtype)),
        engine(cache="paged", block_size=16, kv_dtype="int8"), max_new_tokens)


if __name__ == "__main__":
    main()
