"""Step 5: KV quantization (lesson: ``minikv.textbook.s5_quant``).

``codecs``   pure functions: float groups to bytes and back (q8_0, q4_0, q4_1, asym, fp8, casts)
``formats``  a ``kv_dtype``: the codec and grouping axis of K and of V, and their bytes
``cache``    ``QuantizedPagedKVCache``: full blocks quantized once, dequantized per tile inside attention
"""

from minikv.quant import codecs
from minikv.quant.cache import QuantizedPagedKVCache, QuantizedStore, dequantized_pools, quantized_paged_attention
from minikv.quant.codecs import CODECS, Codec, codec
from minikv.quant.formats import KV_DTYPES, KVFormat, Side, is_kivi, kv_bytes_per_token, kv_format

__all__ = ["CODECS", "Codec", "KVFormat", "KV_DTYPES", "QuantizedPagedKVCache", "QuantizedStore", "Side", "codec",
           "codecs", "dequantized_pools", "is_kivi", "kv_bytes_per_token", "kv_format", "quantized_paged_attention"]
