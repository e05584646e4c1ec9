"""minikv: LLM KV caches from scratch, step by step (the NumPy reference). The reading map.

Two tiers. Read a step's **lesson** first (``minikv/textbook/``: the idea alone, one short file that
runs as ``python -m minikv.textbook.<lesson>``), then its **chapter** of the engine (validation,
rollback, fast paths, every combination); ``tests/test_textbook.py`` proves the two equal.

step  the idea               lesson (textbook/)     engine chapter                            notebook, doc
1     attention, no cache    s1_attention           attention.py                              01
2     a contiguous cache     s2_kv_cache            kv_cache.py, online_softmax.py            02
3     a paged cache          s3_paged               paged/                                    03
3b    sharing, batching      s3b_sharing_batching   paged/, scheduler.py                      03b, 03
4     MLA's latent cache     s4_mla                 mla/                                      04
5     KV quantization        s5_quant               quant/                                    05
6     window and eviction    s6_window              window/                                   06
7     tiers, speculative     s7_rollback            tiers/, speculative.py, paged/truncate.py 07
8     across MPI ranks       s8_heads               parallel/                                 08
9     hybrid models          s9_hybrid              hybrid/                                   09

Notebook NN is ``notebooks/NN_*.ipynb``, doc page NN ``docs/NN_*.md`` (``docs/zh/`` in Chinese); the
learning path is ``docs/index.md``.

The core, at the top of the package: ``errors`` (typed exceptions, the one int/choice validator),
``layers`` (RMSNorm, activations, RoPE), ``moe`` (a mixture-of-experts MLP: the MLP half of a layer,
which never sees the cache), ``attention`` (step 1), ``online_softmax`` (the running
max/sum/accumulator every attention here walks its keys with), ``kv_cache`` (step 2: ``Step``, the
``step``/``write``/``attend`` seam, ``NoCache``, ``ContiguousKVCache``), ``model`` (the decoder, which
never knows which cache it runs on), ``sampling``, ``generate`` (one sequence; the registry of cache
kinds), ``scheduler`` (many sequences: continuous batching), ``speculative``, ``perplexity``.
Around them: ``weights/`` (GGUF, tokenizer, Hugging Face checkpoints, random models), ``costs/``
(formulas and presets), ``bench/`` (measuring tools), ``cli/`` (the ``minikv`` command).

Imports point down: errors, layers -> attention, online_softmax -> kv_cache -> paged -> mla, quant,
window, hybrid -> model -> generate, scheduler -> tiers, parallel -> cli (``tests/test_layout.py``). The GPU
wing, ``minikv_gpu``, mirrors each step with CUDA C kernels under the same names.
"""

__version__ = "0.1.0"
