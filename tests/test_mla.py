"""Step 4: MLA latent caches are exact: absorbed == expanded == uncached, contiguous and paged.

Tiny random MLA models with odd sizes (R=11, Dn=5, P=4, Dv=7: v_head_dim differs from
qk_nope_head_dim), the query's low-rank path off and on, both RoPE layouts, YaRN off and on.
Every decode step's logits must equal the uncached recompute (float64 1e-10, float32 1e-4).
"""

import numpy as np
import pytest

from minikv.bench.equivalence import assert_close, rel_err
from minikv.errors import ConfigError, InvalidInputError, ShapeError
from minikv.generate import CACHE_KINDS, make_cache
from minikv.layers import YarnConfig
from minikv.mla import (
    LatentContiguousKVCache,
    LatentPagedKVCache,
    LatentUp,
    MLAConfig,
    latent_attention,
    reference_attention,
)
from minikv.scheduler import Request, Scheduler
from minikv.weights.random_models import default_mla, random_mla_model, random_model

YARN = YarnConfig(factor=4.0, original_max_position=16, mscale=1.0, mscale_all_dim=0.8)
VARIANTS = {
    "plain-interleaved": default_mla(),
    "q-lora-half": default_mla(q_lora_rank=6, rope_interleave=False),
    "yarn-interleaved": default_mla(yarn=YARN),
    "yarn-q-lora-half": default_mla(q_lora_rank=9, rope_interleave=False, yarn=YARN),
}
BS = 3  # blocks fill mid-prefill and mid-decode


def latent_cache(kind, model, form, max_len=24, max_seqs=2, nan=True):
    cache = make_cache(kind, model, max_len=max_len, max_seqs=max_seqs, block_size=BS)
    cache.form = form
    if nan and kind == "paged":  # never-written slots hold NaN: a stale read shows at once
        cache.pool[:] = np.nan
    return cache


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("kind", ["contiguous", "paged"])
@pytest.mark.parametrize("form", ["auto", "absorbed", "expanded"])
def test_every_form_equals_the_uncached_recompute_at_every_step(variant, dtype, kind, form):
    """Two sequences of unequal length; the prompts are prefilled in two chunks (so the second
    chunk's prefill attends over a cached history: absorbed history + expanded chunk under
    "auto"), then teacher-forced decode steps run both sequences at once."""
    model = random_mla_model(VARIANTS[variant], dtype=dtype, seed=3)
    rng = np.random.default_rng(7)
    texts = [rng.integers(0, model.config.vocab_size, n).tolist() for n in (10, 5)]
    cache = latent_cache(kind, model, form)
    for sid in (0, 1):
        cache.add_sequence(sid)
    model.forward([t[:4] for t in texts], cache, [0, 1])
    got = model.forward([t[4:] for t in texts], cache, [0, 1], all_logits=True)
    for i, rows in enumerate((slice(0, 6), slice(6, 7))):
        assert_close(got[rows], model.logits(texts[i])[4:], dtype, what=f"{form} chunked prefill of {i}")
    last = got[[5, 6]]
    for step in range(6):
        new = [int(np.argmax(row)) for row in last]
        texts = [t + [n] for t, n in zip(texts, new, strict=True)]
        last = model.forward([[n] for n in new], cache, [0, 1])
        for i, text in enumerate(texts):
            assert_close(last[i], model.logits(text)[-1], dtype, what=f"{kind}/{form} step {step} sequence {i}")


@pytest.mark.parametrize("past, t", [(0, 1), (0, 7), (9, 1), (9, 5), (130, 3)])
def test_the_three_forms_agree_with_the_textbook_formula(past, t):
    """The attention alone, on random latents: tiles of 4 keys, queries after a history of ``past``."""
    rng = np.random.default_rng(past + t)
    m = default_mla(yarn=YARN)
    hq = 3
    up = LatentUp.from_kv_b(rng.standard_normal((m.kv_lora_rank, hq * (m.qk_nope_head_dim + m.v_head_dim))), hq, m)
    lat = rng.standard_normal((past + t, m.latent_dim))
    q_all = rng.standard_normal((past + t, hq, m.qk_head_dim))
    want = reference_attention(q_all, lat, up, m)[past:]  # causal over all past + t tokens
    outs = {form: latent_attention(q_all[past:], lambda k0, k1: lat[k0:k1], past, up, m, form, key_tile=4)
            for form in ("auto", "absorbed", "expanded")}
    for form, got in outs.items():
        assert got.shape == (t, hq, m.v_head_dim)
        assert rel_err(got, want) <= 1e-12, form
    assert rel_err(outs["absorbed"], outs["expanded"]) <= 1e-12


def test_every_registered_cache_kind_builds_a_latent_cache_and_is_exact():
    model = random_mla_model(dtype=np.float64, seed=5)
    text = np.random.default_rng(2).integers(0, 97, 8).tolist()
    want = model.logits(text)
    for kind, spec in CACHE_KINDS.items():
        if spec.evicts:  # step 6 covers K/V caches; an MLA model is refused (tests/test_window.py)
            continue
        cache = make_cache(kind, model, max_len=12, block_size=BS)
        assert type(cache).__name__.startswith("Latent"), kind
        cache.add_sequence(0)
        if spec.recompute:
            got = model.forward([text], cache, all_logits=True)
        else:
            got = np.concatenate([model.forward([text[:5]], cache, all_logits=True)] +
                                 [model.forward([[tok]], cache) for tok in text[5:]])
        assert_close(got, want, np.float64, what=kind)


def test_fork_then_copy_on_write_copies_exactly_one_block():
    model = random_mla_model(default_mla(q_lora_rank=6), dtype=np.float64, seed=2)
    ids = np.random.default_rng(1).integers(0, 97, 7).tolist()  # 2 blocks + 1 token
    cache = latent_cache("paged", model, "auto", max_seqs=3)
    cache.add_sequence("a")
    model.forward([ids], cache, ["a"])
    before = cache.read_latent("a", 1).copy()
    cache.fork("a", "b")
    free = cache.blocks.num_free
    lb = model.forward([[17]], cache, ["b"])
    assert cache.blocks.cow_copies == 1 and cache.blocks.num_free == free - 1
    table_a, table_b = cache.blocks.table("a").tolist(), cache.blocks.table("b").tolist()
    assert table_a[:2] == table_b[:2] and table_a[2] != table_b[2]
    np.testing.assert_array_equal(cache.read_latent("a", 1), before)  # the parent's latents are untouched
    la = model.forward([[42]], cache, ["a"])
    assert cache.blocks.cow_copies == 1
    assert_close(lb[0], model.logits(ids + [17])[-1], np.float64, what="child")
    assert_close(la[0], model.logits(ids + [42])[-1], np.float64, what="parent")


def test_prefix_sharing_and_swapping_stay_exact():
    """A second request reuses the first one's full blocks (its prefill then attends over a shared
    history); a swapped-out sequence comes back and decodes on."""
    model = random_mla_model(dtype=np.float64, seed=8)
    rng = np.random.default_rng(3)
    system = rng.integers(0, 97, 6).tolist()
    a, b = system + [5, 6], system + [7, 8, 9]
    cache = LatentPagedKVCache(**model.new_cache_args(), num_blocks=12, block_size=BS, dtype=np.float64,
                               num_host_blocks=8)
    cache.add_sequence("a", a)
    model.forward([a], cache, ["a"])
    hit = cache.add_sequence("b", b)
    assert hit == 6
    assert_close(model.forward([b[hit:]], cache, ["b"])[0], model.logits(b)[-1], np.float64, what="prefix hit")
    cache.swap_out("a")
    cache.swap_in("a")
    assert_close(model.forward([[3]], cache, ["a"])[0], model.logits(a + [3])[-1], np.float64, what="swapped")


def test_the_scheduler_runs_an_mla_model_unchanged():
    model = random_mla_model(dtype=np.float64, seed=4, max_position=64)
    rng = np.random.default_rng(0)
    requests = [Request(f"r{i}", rng.integers(0, 97, int(rng.integers(2, 9))).tolist(), 5) for i in range(4)]
    cache = LatentPagedKVCache(**model.new_cache_args(), num_blocks=10, block_size=BS, dtype=np.float64)
    cache.pool[:] = np.nan
    out = Scheduler(model, cache).run(requests)
    for r in requests:
        alone = make_cache("contiguous", model, max_len=16)
        alone.add_sequence(0)
        toks, feed = [], r.prompt_ids
        for _ in range(r.max_new_tokens):
            toks.append(int(np.argmax(model.forward([feed], alone)[0])))
            feed = [toks[-1]]
        assert out[r.id] == toks, r.id


def test_bytes_per_token_is_one_latent_per_layer():
    model = random_mla_model(num_layers=3, dtype=np.float32)
    m = model.config.mla
    for kind in (k for k, spec in CACHE_KINDS.items() if not spec.evicts):
        cache = make_cache(kind, model, max_len=10, block_size=BS)
        assert cache.bytes_per_token() == (m.kv_lora_rank + m.qk_rope_head_dim) * 3 * 4 == 180, kind
    cache = make_cache("paged", model, max_len=10, block_size=BS)
    assert cache.pool.shape == (3, cache.num_blocks, BS, 15) and cache.k_pool is cache.v_pool is cache.pool
    assert cache.bytes_allocated() == cache.pool.nbytes
    cache.add_sequence(0)
    model.forward([[1, 2, 3, 4]], cache)
    assert cache.bytes_used() == 4 * 180
    contiguous = make_cache("contiguous", model, max_len=10)
    assert contiguous.latent.shape == (3, 1, 1, 10, 15) and contiguous.bytes_allocated() == 3 * 10 * 15 * 4


def test_rope_layouts_and_yarn_change_the_model():
    """The variants above are different models (so their equivalence tests test something)."""
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    logits = {v: random_mla_model(m, dtype=np.float64, seed=1).logits(ids) for v, m in
              {"interleaved": default_mla(), "half": default_mla(rope_interleave=False),
               "yarn": default_mla(yarn=YARN)}.items()}
    assert rel_err(logits["half"], logits["interleaved"]) > 1e-3
    assert rel_err(logits["yarn"], logits["interleaved"]) > 1e-3


def test_yarn_scales_the_softmax_and_the_rope_part():
    assert MLAConfig(8, 4, 2, 3).softmax_scale == pytest.approx(6 ** -0.5)
    m = default_mla(yarn=YARN)
    assert m.softmax_scale == pytest.approx(9 ** -0.5 * (0.1 * 0.8 * np.log(4.0) + 1) ** 2)
    assert YARN.cos_sin_factor == pytest.approx((0.1 * np.log(4) + 1) / (0.08 * np.log(4) + 1))


@pytest.mark.reference
def test_yarn_frequencies_match_transformers(require):
    transformers = require("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
                beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=0.707)
    cfg = transformers.DeepseekV3Config(qk_rope_head_dim=64, max_position_embeddings=163840, rope_parameters=rope)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    ours = YarnConfig(factor=40.0, original_max_position=4096, mscale=1.0, mscale_all_dim=0.707)
    assert rel_err(ours.inv_freq(64, 10000.0), inv_freq.double().numpy()) < 1e-6
    assert ours.cos_sin_factor == pytest.approx(factor, rel=1e-12)


def test_misuse_raises_typed_errors():
    model = random_mla_model(dtype=np.float64)
    llama_cache = make_cache("contiguous", random_model(num_layers=2), max_len=8)
    with pytest.raises(ConfigError, match="latent cache"):
        model.forward([[1, 2]], llama_cache)
    cache = make_cache("paged", model, max_len=8, block_size=BS)
    cache.add_sequence(0)
    w = model.config.mla.latent_dim
    for error, match, misuse in [
            (InvalidInputError, "write\\(layer, latent, None\\)", lambda: cache.write(0, np.zeros((2, 1, w)),
                                                                                       np.zeros((2, 1, w)))),
            (ShapeError, "latent.shape", lambda: cache.write(0, np.zeros((2, 1, w + 1)), None)),
            (ShapeError, "Dn \\+ dr",
             lambda: cache.write(0, np.zeros((2, 1, w)), None) or cache.attend(0, np.zeros((2, 3, w)))),
            (InvalidInputError, "before write", lambda: cache.attend(1, np.zeros((2, 3, w))))]:
        with pytest.raises(error, match=match):
            with cache.step([0], [2]):
                misuse()
        assert cache.length(0) == 0 and cache.blocks.num_free == cache.num_blocks  # the step rolled back
    with pytest.raises(ConfigError, match="MLAConfig"):
        LatentContiguousKVCache(2, 3, None, [], max_seqs=1, max_len=4)
    with pytest.raises(ShapeError, match="LatentUp"):
        LatentContiguousKVCache(2, 3, model.config.mla, [], max_seqs=1, max_len=4)
    with pytest.raises(ConfigError, match="even"):
        MLAConfig(8, 4, 3, 4)


def test_decode_never_decompresses_and_prefill_does(monkeypatch):
    """form="auto": a decode step is absorbed only (no per-head K/V is built); a prefill expands its own tokens."""
    import minikv.mla.latent as mla

    model = random_mla_model(dtype=np.float64, seed=6)
    cache = make_cache("paged", model, max_len=12, block_size=BS)
    cache.add_sequence(0)
    calls = []
    real = mla.expand
    monkeypatch.setattr(mla, "expand", lambda lat, up: calls.append(lat.shape[0]) or real(lat, up))
    model.forward([[1, 2, 3, 4, 5]], cache)
    assert calls and sum(calls) == 5 * model.config.num_layers  # each layer decompresses the 5 new tokens once
    calls.clear()
    for tok in (6, 7, 8):
        model.forward([[tok]], cache)
    assert calls == []


def test_costs_and_the_batching_budget_see_the_latent_not_per_head_kv():
    """The cost formulas and the benchmark's pool sizing read an MLA model's latent width."""
    from minikv.bench.workloads import Workload, batching_benchmark
    from minikv.costs import kv_bytes_per_token, shape_from_config
    from minikv.weights.random_models import default_mla, random_mla_model

    mla = default_mla()
    model = random_mla_model(mla=mla, vocab_size=64, max_position=512)
    c = model.config
    want = c.num_layers * (mla.kv_lora_rank + mla.qk_rope_head_dim)
    paged = make_cache("paged", model, 8)
    assert kv_bytes_per_token(shape_from_config(c), "fp32") == want * 4 == paged.bytes_per_token()
    wl = Workload(num_requests=3, prompt_median=8, prompt_range=(2, 16), output_median=4, output_range=(1, 8),
                  shared_prefix_len=4, vocab_size=64)
    res = batching_benchmark(wl, kv_budget_bytes=64 * want * np.dtype(model.dtype).itemsize, block_size=4,
                             model=model)
    assert res["bytes_per_token"] == want * np.dtype(model.dtype).itemsize and res["budget_tokens"] == 64
    assert res["identical_outputs"] and res["requests_lost"] == 0
