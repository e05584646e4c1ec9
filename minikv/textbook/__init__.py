"""The textbook: one short lesson per step, the idea and nothing else. Read them in this order.

s1_attention          attention from scratch: softmax, GQA heads, the causal mask; a "cache" that
                      keeps nothing, so every pass recomputes every K/V   (engine: minikv.kv_cache.NoCache)
s2_kv_cache           the seam (step / write / attend), the online softmax (m, l, acc), a contiguous
                      cache: prefill once, then one token per pass        (ContiguousKVCache)
s3_paged              a pool of blocks: free list, block table, slot mapping, attention over tiles
                      of blocks; stale slots never leak                   (minikv.paged.cache.PagedKVCache)
s3b_sharing_batching  chained block hashes, ref counts, prefix sharing, copy-on-write; continuous
                      batching                                            (PagedKVCache, minikv.scheduler)
s4_mla                DeepSeek's latent cache [c_kv ; k_pe], absorbed attention as MQA, decoupled
                      RoPE                                                (minikv.mla)
s5_quant              full blocks quantized once (q8_0), the open block the residual, dequantized
                      per tile inside attention                           (minikv.quant)
s6_window             a ring of W slots with n_sink attention sinks, positions per slot (minikv.window)
s7_rollback           speculative decoding by prompt lookup, and truncate (minikv.speculative)
s8_heads              tensor parallelism over heads: each rank caches its own KV heads, partial
                      outputs summed by the all-reduce                    (minikv.parallel)
s9_hybrid             per-layer caches from the layer pattern: a ring of W + K slots per sliding
                      layer, a slab per full one; a prefix hit needs only the W - 1 keys before
                      it; rollback of K after the ring wrapped            (minikv.hybrid)

A lesson is NumPy plus ``minikv.layers`` and the engine's ``minikv.model.Model``, which runs any
object that honours the seam. It imports the lesson it builds on, and the lines it adds are
fenced ``# --- NEW in step N ---`` ... ``# --- end NEW ---``. No validation, no fast paths: the
engine has those. Every lesson runs: ``python -m minikv.textbook.s3_paged`` answers a question
with SmolLM2 (step 9: Gemma-3-270M) through the lesson's cache and prints whether its tokens equal the
engine's.
``tests/test_textbook.py`` binds each lesson to its chapter (the same logits in float64, within
1e-12, on tiny random models whose pools start full of NaN; the same SmolLM2 tokens).
``demo`` is not a lesson: it is what the ``python -m`` runs share.
"""

LESSONS = ("s1_attention", "s2_kv_cache", "s3_paged", "s3b_sharing_batching", "s4_mla", "s5_quant", "s6_window",
           "s7_rollback", "s8_heads", "s9_hybrid")
