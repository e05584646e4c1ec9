"""minikv: LLM KV caches from scratch, step by step (NumPy reference).

Steps: ``attention`` (1, no cache) -> ``kv_cache`` (2, contiguous) -> ``paged`` (3)
-> ``mla`` (4) -> ``quant`` (5) -> ``window`` (6). ``model`` assembles a
Llama-style decoder that runs on any of them.
"""

__version__ = "0.1.0"
