"""Step 4: multi-head latent attention (MLA, DeepSeek-V2/V3). Cache one small latent per token.

A GQA cache stores 2 x Hkv x D numbers per token and layer. MLA stores one row instead: the
token's hidden state h compressed to a latent ``c_kv`` of r numbers (``kv_lora_rank``, 512 in
DeepSeek-V3), next to one small RoPE key ``k_pe`` of dr numbers (64) shared by every head.
Every head's key and value are linear functions of that row (``kv_b_proj`` = [W_UK | W_UV])::

    [c_kv ; k_pe] = h W_DKV;  c_kv = RMSNorm(c_kv);  k_pe = RoPE(k_pe)    cached: Dl = r + dr values
    k_h = [c_kv W_UK[h] ; k_pe]      (Dn + dr)        v_h = c_kv W_UV[h]   (Dv)

DeepSeek-V3 caches 576 values per token and layer, where full per-head K and V would take
128 x (192 + 128).

Absorbed attention: never decompress
------------------------------------
Products associate, so W_UK folds into the query and W_UV moves after the attention::

    q_h . k_j = q_nope_h . (c_kv_j W_UK[h]) + q_pe_h . k_pe_j = [q_nope_h W_UK[h]^T ; q_pe_h] . [c_kv_j ; k_pe_j]
    out_h     = sum_j p_j (c_kv_j W_UV[h]) = (sum_j p_j c_kv_j) W_UV[h]

So every head scores the *same* cached rows: attention becomes multi-query attention (MQA: one
"KV head" for all Hq heads) over Dl-wide keys whose values are their first r entries, and
W_UV is applied once per head to the output. That is step 2's tiles with Hkv = 1; the only new
lines are the fold before and the product after. (Absorbed decode does *more* multiply-adds
per key than decompressing would; what it saves is the bytes read, and decode is bound by those.)

Decoupled RoPE: why k_pe exists
-------------------------------
RoPE rotates a key by R(p), a rotation that depends on the key's position. Had the whole key
been rotated, ``q . R(p_j) (c_kv_j W_UK)`` would put a different R(p_j) between the query and
W_UK for every key j, and W_UK could not be folded into the query once for all keys. MLA
therefore rotates only a separate small part, the last dr dims of each query (``q_pe``) and
``k_pe``; the Dn position-free dims absorb. The model (``minikv.mla.block.mla_attention_block``)
hands this cache ``[c_kv ; RoPE(k_pe)]`` as the key and ``[q_nope ; RoPE(q_pe)]`` as the query.

Shapes: Hq heads, Dn = qk_nope_head_dim, dr = qk_rope_head_dim, Dv = v_head_dim, r =
kv_lora_rank, Dl = r + dr; scale = 1 / sqrt(Dn + dr) (the query's width, not Dl).

Run it: ``python -m minikv.textbook.s4_mla``. No MLA model ships here, so it generates with a tiny
random DeepSeek-style model (float64), against ``minikv.mla.caches.LatentContiguousKVCache``.
"""

from __future__ import annotations

import numpy as np

from minikv.textbook.s2_kv_cache import ContiguousCache, attend_tiles

# --- NEW in step 4 ---


class LatentCache(ContiguousCache):
    """One latent row ``[c_kv ; k_pe]`` per token: ``k`` = ``v`` = [L, max_seqs, max_len, 1, Dl], one array.

    num_heads, mla, up: the model's Hq, its ``MLAConfig`` and per layer W_UK [Hq, r, Dn], W_UV
    [Hq, r, Dv] (``LatentUp``); ``Cache(**model.new_cache_args(), ...)`` passes all three.
    """

    def __init__(self, num_layers: int, num_heads: int, mla, up: list, max_seqs: int, max_len: int,
                 dtype=np.float32, tile: int = 64):
        super().__init__(num_layers, 1, mla.latent_dim, max_seqs, max_len, dtype, tile)
        self.v = self.k  # the key row is the value too (its first r entries): one store, under both names
        self.mla, self.up = mla, up

    def write(self, layer: int, latent: np.ndarray, v=None) -> None:
        """latent: [N, 1, Dl] (the model passes v = None: there is no separate value)."""
        super().write(layer, latent, latent)

    def attend_one(self, layer: int, q: np.ndarray, tiles) -> np.ndarray:
        """Absorbed MLA for one sequence: q [T, Hq, Dn + dr] -> [T, Hq, Dv]."""
        dn, r, up = self.mla.qk_nope_head_dim, self.mla.kv_lora_rank, self.up[layer]
        q_nope = q[:, :, :dn].transpose(1, 0, 2)                                   # [Hq, T, Dn]
        q_lat = np.concatenate([(q_nope @ up.w_uk.transpose(0, 2, 1)).transpose(1, 0, 2), q[:, :, dn:]], axis=-1)
        lat = attend_tiles(q_lat, tiles, 1, self.mla.softmax_scale)  # [T, Hq, Dl]: sum_j p_j [c_kv ; k_pe]_j
        return (lat[:, :, :r].transpose(1, 0, 2) @ up.w_uv).transpose(1, 0, 2)  # its c_kv part times W_UV

# --- end NEW ---


def random_deepseek():
    """(a tiny random DeepSeek-style MLA model in float64, no tokenizer): r 11, Dn 5, dr 4, Dv 7, Hq 3."""
    from minikv.weights.random_models import random_mla_model

    return random_mla_model(dtype=np.float64), None


def main(max_new_tokens: int = 16):
    from minikv.textbook.demo import demo, engine, greedy_with
    from minikv.textbook.s1_attention import greedy

    return demo("step 4, MLA latent cache (random model)", greedy_with(greedy, lambda model, n: LatentCache(
        **model.new_cache_args(), max_seqs=1, max_len=n, dtype=model.dtype)), engine(cache="contiguous"),
        max_new_tokens, questions=([5, 17, 3, 88, 41, 9],), load=random_deepseek)


if __name__ == "__main__":
    main()
