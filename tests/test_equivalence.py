"""The spine (DESIGN.md section 3): every registered cache kind equals the full uncached recompute.

One test, parametrized over ``minikv.generate.CACHE_KINDS``: a new lossless cache joins it by
being registered. Two sequences of unequal length share the cache; their prompts are
prefilled together, then teacher-forced decode steps run both at once, and every step's
logits must equal a full recompute of that sequence's text (float64 1e-10, float32 1e-4).
"""

import numpy as np
import pytest

from minikv.bench.equivalence import assert_close
from minikv.generate import CACHE_KINDS, make_cache
from minikv.weights.random_models import random_model

SHAPES = {"gqa-half": dict(num_heads=6, num_kv_heads=2, rope_layout="half"),
          "mqa-interleaved": dict(num_heads=4, num_kv_heads=1, head_dim=6, hidden_size=28,
                                  rope_layout="interleaved")}


# step 6's kinds evict; with a window/budget longer than the text they must keep everything (exact)
KEEP_ALL = {"window": {"window": 64, "sinks": 2}, "h2o": {"budget": 64, "recent": 8}, "snapkv": {"budget": 64}}


@pytest.mark.parametrize("kind", sorted(CACHE_KINDS))
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_cache_kind_equals_the_uncached_recompute(kind, dtype, shape):
    model = random_model(dtype=dtype, seed=3, **SHAPES[shape])
    rng = np.random.default_rng(7)
    texts = [rng.integers(0, model.config.vocab_size, n).tolist() for n in (9, 4)]  # unequal on purpose
    cache = make_cache(kind, model, max_len=20, max_seqs=2, block_size=3,  # 3: blocks fill mid-decode
                       eviction=KEEP_ALL.get(kind))
    ids = ["a", "b"]
    for sid in ids:
        cache.add_sequence(sid)
    feed = texts  # the whole prompts first
    for step in range(6):
        got = model.forward(feed, cache, ids)  # [2, V]: each sequence's last token
        for i, text in enumerate(texts):
            assert_close(got[i], model.logits(text)[-1], dtype, what=f"{kind} step {step} sequence {ids[i]}")
        new = [int(np.argmax(row)) for row in got]
        texts = [t + [n] for t, n in zip(texts, new, strict=True)]
        feed = texts if CACHE_KINDS[kind].recompute else [[n] for n in new]
    assert {k for k, v in CACHE_KINDS.items() if not v.recompute} >= {"contiguous", "paged"}
