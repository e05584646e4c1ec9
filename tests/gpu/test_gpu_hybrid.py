"""Step 9 on the GPU (``minikv_gpu.hybrid``): a tiny random Gemma-3 through per-layer GPU caches, window kernels for
the sliding groups and paged (or contiguous) kernels for the full group, against the NumPy masked recompute; and
``minikv compare --model <gemma3.gguf> --backend sim``. Shapes are tiny: the simulator runs one fiber per thread."""

from __future__ import annotations

import json

import numpy as np
import pytest

from minikv.bench.equivalence import assert_close
from minikv.cli import main
from minikv.weights.random_models import random_gemma_model
from minikv_gpu import hybrid as gh
from minikv_gpu import paged as gpu_paged
from minikv_gpu.model import from_cpu

PROMPT = [3, 5, 7, 11, 2, 9]


def tiny(window: int = 4, **kw):
    """Four layers, full at 1 and 3; QK-norm, sandwich norms, GeGLU, a query_pre_attn_scalar that is not D."""
    return random_gemma_model(**{**dict(num_layers=4, hidden_size=40, num_heads=4, num_kv_heads=2, head_dim=16,
                                        intermediate_size=24, vocab_size=61, sliding_window=window, pattern=2,
                                        seed=3), **kw})


@pytest.mark.parametrize("kind", gh.HYBRID_KINDS)
def test_per_layer_dispatch_equals_the_masked_recompute(rt, kind):
    """Prefill past the window, then decode steps: each sliding group's decode runs the window kernel, the full
    group the paged (or contiguous) kernels; the logits equal ``Model.logits`` (each sliding layer masked)."""
    model = tiny()
    gpu, c = from_cpu(model, runtime=rt), model.config
    cache = gh.hybrid_cache(kind, c.layer_windows, c.num_kv_heads, c.head_dim, 12, block_size=3, runtime=rt)
    cache.add_sequence(0)
    ids = list(PROMPT)
    got = [rt.asnumpy(gpu.forward([ids], cache, all_logits=True))]
    for t in (4, 8, 1):
        ids.append(t)
        got.append(rt.asnumpy(gpu.forward([[t]], cache)))
    assert_close(np.concatenate(got), model.logits(ids)[[*range(len(PROMPT)), 6, 7, 8]], np.float32)
    sliding = [g for _, g in cache.groups if isinstance(g, gh.SlidingRingKVCache)]
    full = [g for _, g in cache.groups if not isinstance(g, gh.SlidingRingKVCache)]
    assert cache.layer_windows == (4, None, 4, None) and len(sliding) == len(full) == 1
    assert sliding[0].gpu_steps == 3 * 2  # three decode steps x two sliding layers on the window kernel
    assert isinstance(full[0], gpu_paged.PagedKVCache) == (kind == "paged")


def test_the_window_reaches_the_kernel(sim_rt):
    """A ring that ignored the window (K as long as the text: every key kept and, without the window rule, seen)
    would differ: the rule is the kernel's, not only the ring's."""
    model = tiny(window=2)
    gpu, c = from_cpu(model, runtime=sim_rt), model.config
    cache = gh.hybrid_cache("contiguous", c.layer_windows, c.num_kv_heads, c.head_dim, 12, rollback=8,
                            runtime=sim_rt)
    cache.add_sequence(0)
    gpu.forward([PROMPT], cache)
    got = sim_rt.asnumpy(gpu.forward([[4]], cache))[0]
    assert_close(got, model.logits(PROMPT + [4])[-1], np.float32)  # W + K slots hold 9 keys; 2 are visible
    whole = tiny(window=12)
    assert np.abs(whole.logits(PROMPT + [4])[-1] - got).max() > 1e-3


def test_minikv_compare_takes_a_gemma_file(tmp_path, capsys):
    from tests.test_gemma_gguf import write_gemma_gguf
    from tests.test_sentencepiece import TINY

    # the shapes and block size of the tests above: the simulator compiles each kernel variant once
    write_gemma_gguf(tmp_path / "g.gguf", tiny(window=3, vocab_size=len(TINY), seed=5))
    assert main(["compare", "--model", str(tmp_path / "g.gguf"), "--prompt", "ab x 中文 bcd", "--backend", "sim",
                 "--cache", "paged", "--block-size", "3", "--max-new-tokens", "4", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["tokens_agree"] and 0 < summary["max_abs_logit_diff"] <= 1e-3 and summary["steps"] == 4
    assert main(["compare", "--model", str(tmp_path / "g.gguf"), "--prompt", "ab", "--backend", "sim",
                 "--cache", "none"]) == 2
    assert "no per-layer uncached attention" in capsys.readouterr().err
