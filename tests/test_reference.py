"""SmolLM2 in minikv against transformers loading the same GGUF file.

Both sides get the same token ids (from our tokenizer). transformers
dequantizes the file to float32 and un-permutes Q/K for ``rotate_half``; we run
the file's interleaved layout with our contiguous KV cache. Logits must agree
within 1e-3 at every prefill/decode step and greedy text must be identical.
"""

from __future__ import annotations

import numpy as np
import pytest

from minikv.kv_cache import ContiguousKVCache

pytestmark = [pytest.mark.model, pytest.mark.reference]

ATOL = 1e-3  # max |Δlogit|; logits are O(10), so this is ~1e-4 relative


@pytest.fixture(scope="module")
def hf_model(smollm2_path, require):
    """transformers' LlamaForCausalLM from the GGUF file, float32, loaded once for this module."""
    torch = require("torch")
    transformers = require("transformers")
    require("accelerate")  # transformers' GGUF loader needs it
    # transformers 5 renamed torch_dtype to dtype
    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, **{dtype_kw: torch.float32})
    return model.eval()


def hf_logits(hf_model, ids: list[int]) -> np.ndarray:
    """transformers' logits of every position of one uncached forward pass: [T, V]."""
    import torch

    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float().numpy()


def greedy_with_cache(model, prompt: list[int], max_new: int, eos: int | None = None):
    """Prefill ``prompt`` into a ContiguousKVCache, then decode one token per step.

    returns: new tokens, and the logits [V] that chose each of them
    """
    cache = ContiguousKVCache(**model.new_cache_args(), max_seqs=1, max_len=len(prompt) + max_new)
    cache.add_sequence(0)
    logits = model.forward([prompt], cache)[0]
    new, step_logits = [], []
    for _ in range(max_new):
        step_logits.append(logits)
        token = int(np.argmax(logits))
        new.append(token)
        if token == eos or len(new) == max_new:
            break
        logits = model.forward([[token]], cache)[0]
    return new, step_logits


def chat_prompt(tok) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))


@pytest.mark.parametrize("prompt_kind", ["plain", "chat"])
def test_logits_match_transformers_prefill_and_decode(smollm2, hf_model, prompt_kind):
    model, tok = smollm2
    prompt = tok.encode("The capital of France is") if prompt_kind == "plain" else chat_prompt(tok)
    # prefill + 10 decode steps: 11 next-token distributions
    new, ours = greedy_with_cache(model, prompt, max_new=11)
    assert len(new) == 11
    seq = prompt + new[:-1]
    theirs = hf_logits(hf_model, seq)[len(prompt) - 1:]  # the positions that predict new[0..10]
    deltas = [float(np.max(np.abs(o - t))) for o, t in zip(ours, theirs)]
    print(f"\n{prompt_kind}: max |Δlogit| per step (prefill, then 10 decodes): "
          + " ".join(f"{d:.1e}" for d in deltas))
    assert max(deltas) <= ATOL, deltas
    assert [int(np.argmax(t)) for t in theirs] == new  # greedy tokens identical at every step


@pytest.mark.parametrize("prompt_kind", ["plain", "chat"])
def test_greedy_text_matches_transformers(smollm2, hf_model, prompt_kind):
    import torch

    model, tok = smollm2
    prompt = tok.encode("The capital of France is") if prompt_kind == "plain" else chat_prompt(tok)
    ours, _ = greedy_with_cache(model, prompt, max_new=20, eos=tok.eos_token_id)
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=20, do_sample=False, eos_token_id=tok.eos_token_id,
                                pad_token_id=tok.eos_token_id)
    theirs = out[0, len(prompt):].tolist()
    text = tok.decode(ours, skip_special_tokens=True)
    print(f"\n{prompt_kind}: {text!r}")
    assert ours == theirs
    assert text == tok.decode(theirs, skip_special_tokens=True)
    assert "Paris" in text  # not just equal: the model actually works
