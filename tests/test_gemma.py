"""Gemma-3-270M, a real hybrid model, through minikv's per-layer caches, against transformers 5.24 on the same GGUF.

Costs on a quiet 2-core machine (loading both models once per session: about 35 s for minikv, 90 s for
transformers): the teacher-forced fixture about 4 minutes (transformers' pass 35 s; minikv 1,039 single-token
steps, about 10 tokens/s, each with a 262,144-wide LM head; the window-ignored run in chunks of 64, about
70 s); the greedy runs 5-30 s each. On a loaded machine (8 runnable processes on 2 cores) the whole module took
14 minutes.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from minikv.bench.corpus import reference_tokens
from minikv.bench.equivalence import assert_close
from minikv.hybrid import hybrid_cache
from minikv.model import Model

pytestmark = [pytest.mark.gemma, pytest.mark.reference, pytest.mark.slow]

N_TEXT = 1040  # tokens of the reference text: past 2 W, so every ring wraps twice
CHUNK = 64


def hybrid(model, max_len: int):
    c = model.config
    cache = hybrid_cache("contiguous", c.layer_windows, c.num_kv_heads, c.head_dim, max_len)
    cache.add_sequence(0)
    return cache


def nll(logits: np.ndarray, targets) -> np.ndarray:
    """Per-row negative log-likelihood of ``targets`` under ``logits`` [T, V], in float64: [T]."""
    z = logits.astype(np.float64)
    top = z.max(-1)
    return top + np.log(np.exp(z - top[:, None]).sum(-1)) - z[np.arange(len(targets)), targets]


def test_the_file_is_read_as_gemma3(gemma3):
    c = gemma3[0].config
    assert [i for i, t in enumerate(c.layer_types) if t == "full_attention"] == [5, 11, 17]
    assert (c.sliding_window, c.rope_theta, c.sliding_rope_theta, c.query_pre_attn_scalar) == (512, 1e6, 1e4, 256)
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size) == (18, 4, 1, 256, 640)
    assert (c.rope_layout, c.hidden_act, c.qk_norm, c.sandwich_norms) == ("half", "gelu_pytorch_tanh", True, True)


def test_logits_match_transformers(gemma3, gemma3_hf, require):
    torch = require("torch")
    model, tok = gemma3
    for text in ["The capital of France is", "机器学习是人工智能的一个分支，", "for i in range(10):\n    print("]:
        ids = tok.encode(text)
        with torch.no_grad():
            want = gemma3_hf(torch.tensor([ids])).logits[0].numpy()
        assert_close(model.logits(ids), want, np.float32, what=repr(text))


@pytest.fixture(scope="module")
def teacher_forced(gemma3, gemma3_hf, require) -> dict:
    """Per-token NLL of the first N_TEXT tokens of the reference text: transformers (one pass), minikv through
    the hybrid cache one token at a time, and minikv with the window ignored (a window as long as the text:
    every layer sees every earlier token), in chunks."""
    torch = require("torch")
    model, tok = gemma3
    ids = reference_tokens(tok, N_TEXT)
    inputs, targets = ids[:-1], np.array(ids[1:])
    with torch.no_grad():
        hidden = gemma3_hf.model(torch.tensor([ids])).last_hidden_state[0, :-1]
        hf = np.concatenate([nll(gemma3_hf.lm_head(hidden[a:a + CHUNK]).numpy(), targets[a:a + CHUNK])
                             for a in range(0, len(targets), CHUNK)])
    cache = hybrid(model, N_TEXT)
    ours = np.array([nll(model.forward([[t]], cache), targets[i:i + 1])[0] for i, t in enumerate(inputs)])
    whole = Model(replace(model.config, sliding_window=N_TEXT), model.weights)
    cache = hybrid(whole, N_TEXT)
    ignored = np.concatenate([nll(whole.forward([inputs[a:a + CHUNK]], cache, all_logits=True), targets[a:a + CHUNK])
                              for a in range(0, len(targets), CHUNK)])
    return {"transformers": hf, "hybrid": ours, "window ignored": ignored}


def test_nll_through_the_hybrid_cache_matches_transformers(teacher_forced):
    hf, ours = teacher_forced["transformers"].mean(), teacher_forced["hybrid"].mean()
    print(f"mean NLL over {N_TEXT - 1} tokens: transformers {hf:.6f}, minikv hybrid cache {ours:.6f}, "
          f"relative difference {abs(ours - hf) / hf:.2e}")
    assert abs(ours - hf) / hf <= 1e-4


def test_ignoring_the_window_changes_the_nll(teacher_forced):
    """The check above can fail: keeping every layer whole (as an engine that ignores layer_types would)
    moves the NLL by far more than the bar, and only after the first W tokens."""
    hf, ignored = teacher_forced["transformers"], teacher_forced["window ignored"]
    print(f"window ignored: mean NLL {ignored.mean():.6f}, relative difference "
          f"{abs(ignored.mean() - hf.mean()) / hf.mean():.2e}")
    assert abs(ignored.mean() - hf.mean()) / hf.mean() > 1e-3
    assert np.abs(ignored[:511] - hf[:511]).max() < 1e-3  # tokens 1..511 see the same keys either way


PROMPTS = {
    "english": "The history of the printing press begins",
    "chinese": "北京是中国的首都，也是",
    "code": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "past the window": None,  # the reference text's first 600 tokens: the rings have wrapped before decoding
}


@pytest.mark.parametrize("name", list(PROMPTS))
def test_greedy_tokens_match_transformers(gemma3, gemma3_hf, require, name):
    torch = require("torch")
    model, tok = gemma3
    ids = reference_tokens(tok, 600) if PROMPTS[name] is None else tok.encode(PROMPTS[name])
    n = 16
    with torch.no_grad():
        want = gemma3_hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()
    cache, step, got = hybrid(model, len(ids) + n), ids, []
    for _ in range(len(want)):
        got.append(int(np.argmax(model.forward([step], cache)[0])))
        step = got[-1:]
    assert got == want, f"{tok.decode(got)!r} != {tok.decode(want)!r}"
