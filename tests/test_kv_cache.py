"""Step 2: the contiguous cache is exact (cached == uncached) and never corrupts silently."""

import numpy as np
import pytest

from minikv.bench.equivalence import EXACT_RTOL, rel_err
from minikv.errors import CacheFullError, ConfigError, DTypeError, InvalidInputError, ShapeError, UnknownSequenceError
from minikv.kv_cache import ContiguousKVCache, NoCache
from minikv.weights.random_models import random_model

# (num_heads, num_kv_heads, head_dim, hidden, intermediate): MHA, GQA, MQA, odd sizes
SHAPES = {
    "mha": dict(num_heads=4, num_kv_heads=4, head_dim=8, hidden_size=32, intermediate_size=64),
    "gqa": dict(num_heads=6, num_kv_heads=2, head_dim=10, hidden_size=42, intermediate_size=70),
    "mqa": dict(num_heads=5, num_kv_heads=1, head_dim=6, hidden_size=35, intermediate_size=33),
    "gqa9x3": dict(num_heads=9, num_kv_heads=3, head_dim=4, hidden_size=27, intermediate_size=41),
}



def cache_for(model, max_seqs=1, max_len=64, dtype=None):
    return ContiguousKVCache(**model.new_cache_args(), max_seqs=max_seqs, max_len=max_len,
                             dtype=model.dtype if dtype is None else dtype)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("prompt_len", [1, 7])
def test_cached_equals_uncached(shape, layout, dtype, prompt_len):
    """Prefill + one-token decode steps give the logits of a full recompute at every step."""
    model = random_model(rope_layout=layout, dtype=dtype, seed=3, **SHAPES[shape])
    ids = np.random.default_rng(5).integers(0, model.config.vocab_size, prompt_len + 12)
    reference = model.logits(ids)  # [T, V], no cache: every position recomputed
    cache = cache_for(model)
    cache.add_sequence("s")
    got = [model.forward([ids[:prompt_len]], cache, ["s"], all_logits=True)]
    for t in range(prompt_len, ids.size):
        got.append(model.forward([ids[t:t + 1]], cache, ["s"]))
        assert got[-1].dtype == dtype  # no silent promotion
    got = np.concatenate(got)
    assert got.shape == reference.shape
    assert rel_err(got, reference) <= EXACT_RTOL[dtype]
    assert np.array_equal(got.argmax(-1), reference.argmax(-1))
    assert cache.length("s") == ids.size


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_batched_decode_equals_single(dtype):
    """Sequences of unequal lengths prefilled and decoded together == each one alone."""
    model = random_model(dtype=dtype, seed=7, **SHAPES["gqa"])
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 101, n) for n in (3, 13, 1, 8)]
    steps = 6
    new_tokens = rng.integers(0, 101, (steps, len(prompts)))

    alone = []
    for i, p in enumerate(prompts):
        c = cache_for(model)
        c.add_sequence(0)
        out = [model.forward([p], c)]
        out += [model.forward([[new_tokens[s, i]]], c) for s in range(steps)]
        alone.append(np.concatenate(out))  # [1 + steps, V]

    batch = cache_for(model, max_seqs=len(prompts))
    ids = [10, 20, 30, 40]
    for sid in ids:
        batch.add_sequence(sid)
    together = [model.forward(prompts, batch, ids)]  # [B, V]: each sequence's last prompt token
    together += [model.forward([[t] for t in new_tokens[s]], batch, ids) for s in range(steps)]
    together = np.stack(together, axis=1)  # [B, 1 + steps, V]
    for i in range(len(prompts)):
        assert rel_err(together[i], alone[i]) <= EXACT_RTOL[dtype]
    assert [batch.length(s) for s in ids] == [p.size + steps for p in prompts]


def test_sequences_can_join_a_batch_mid_decode():
    """A sequence prefilled while another decodes in the same forward pass (mixed step)."""
    model = random_model(dtype=np.float64, seed=2)
    a, b = np.arange(9) % 101, (np.arange(5) * 7) % 101
    cache = cache_for(model, max_seqs=2)
    cache.add_sequence("a")
    model.forward([a[:6]], cache, ["a"])
    cache.add_sequence("b")
    out = model.forward([a[6:7], b], cache, ["a", "b"])  # a decodes one token, b prefills five
    assert rel_err(out[0], model.logits(a[:7])[-1]) <= 1e-10
    assert rel_err(out[1], model.logits(b)[-1]) <= 1e-10


def test_overflow_raises_and_changes_nothing():
    model = random_model(dtype=np.float64)
    cache = cache_for(model, max_len=8)
    cache.add_sequence(0)
    model.forward([np.arange(6)], cache)
    snapshot = cache.k.copy(), cache.v.copy()
    with pytest.raises(CacheFullError, match=r"holds 6 tokens.*adds 3.*max_len=8"):
        model.forward([np.arange(3)], cache)
    assert cache.length(0) == 6
    np.testing.assert_array_equal(cache.k, snapshot[0])
    np.testing.assert_array_equal(cache.v, snapshot[1])
    model.forward([np.arange(2)], cache)  # exactly full is fine
    assert cache.length(0) == 8


def test_failed_step_rolls_back():
    """An error in the middle of a forward pass leaves the lengths as they were."""
    model = random_model(dtype=np.float64, max_position=10)
    cache = cache_for(model, max_len=32)
    cache.add_sequence(0)
    model.forward([np.arange(9)], cache)
    with pytest.raises(InvalidInputError, match="max_position"):
        model.forward([np.arange(3)], cache)
    assert cache.length(0) == 9
    cache.k[:, :, :, 9:] = np.nan  # poison the slots the failed step wrote into: they must never be read
    expected = model.logits(np.concatenate([np.arange(9), [5]]))[-1]
    assert rel_err(model.forward([[5]], cache)[0], expected) <= 1e-10


def test_slots_are_reused_and_unknown_sequences_rejected():
    model = random_model()
    cache = cache_for(model, max_seqs=2)
    cache.add_sequence("a")
    cache.add_sequence("b")
    with pytest.raises(CacheFullError, match="2 slots"):
        cache.add_sequence("c")
    with pytest.raises(InvalidInputError, match="already"):
        cache.add_sequence("a")
    cache.free_sequence("a")
    cache.add_sequence("c")  # a's slot is free again
    assert cache.length("c") == 0
    with pytest.raises(UnknownSequenceError, match="'a'"):
        model.forward([[1]], cache, ["a"])
    with pytest.raises(UnknownSequenceError):
        cache.free_sequence("zzz")


def test_memory_accounting():
    model = random_model(num_layers=3, num_kv_heads=2, head_dim=8)
    cache = cache_for(model, max_seqs=4, max_len=50)
    per_token = 2 * 3 * 2 * 8 * 4  # K and V x layers x kv heads x head_dim x float32 bytes
    assert cache.bytes_per_token() == per_token
    assert cache.bytes_allocated() == 4 * 50 * per_token
    cache.add_sequence(0)
    cache.add_sequence(1)
    model.forward([np.arange(10), np.arange(3)], cache, [0, 1])
    assert cache.bytes_used() == 13 * per_token


def test_fp16_cache_stays_close_to_fp32():
    """fp16 storage rounds K/V to 11 significant bits; logits move by a bounded amount."""
    model = random_model(seed=4)
    ids = np.random.default_rng(0).integers(0, 101, 20)
    ref = model.logits(ids)[-1]
    cache = cache_for(model, dtype=np.float16)
    cache.add_sequence(0)
    model.forward([ids[:10]], cache)
    for t in range(10, 20):
        out = model.forward([ids[t:t + 1]], cache)[0]
    assert out.dtype == np.float32
    err = rel_err(out, ref)
    assert 0 < err < 1e-2  # nonzero: fp16 really rounds; small: the rounding is only ~5e-4 per value


def test_nocache_forgets_between_steps():
    model = random_model(dtype=np.float64)
    cache = NoCache(**model.new_cache_args(), dtype=np.float64)
    ids = np.arange(12) % 101
    full = model.forward([ids], cache)[0]
    assert cache.length(0) == 0
    np.testing.assert_allclose(model.forward([ids], cache)[0], full, rtol=0, atol=0)


def test_bad_inputs():
    model = random_model()
    cache = cache_for(model, max_seqs=2)
    cache.add_sequence(0)
    with pytest.raises(InvalidInputError, match="empty"):
        model.forward([[]], cache)
    with pytest.raises(InvalidInputError, match="101"):
        model.forward([[5, 101]], cache)
    with pytest.raises(InvalidInputError, match="-1"):
        model.forward([[-1]], cache)
    with pytest.raises(DTypeError, match="float"):
        model.forward([np.array([1.0, 2.0])], cache)
    with pytest.raises(ShapeError):
        model.forward(np.arange(4), cache)
    with pytest.raises(ShapeError, match="seq_ids"):
        model.forward([[1], [2]], cache, [0])
    wrong = ContiguousKVCache(num_layers=1, num_kv_heads=2, head_dim=8, max_seqs=1, max_len=8)
    wrong.add_sequence(0)
    with pytest.raises(ConfigError, match="geometry"):
        model.forward([[1]], wrong)
    with pytest.raises(DTypeError, match="int8"):
        ContiguousKVCache(num_layers=1, num_kv_heads=1, head_dim=2, max_seqs=1, max_len=2, dtype=np.int8)
    with pytest.raises(ConfigError, match="max_len"):
        ContiguousKVCache(num_layers=1, num_kv_heads=1, head_dim=2, max_seqs=1, max_len=0)
    with pytest.raises(ShapeError, match="expected"):
        with cache.step([0], [2]):
            cache.write(0, np.zeros((3, 2, 8), np.float32), np.zeros((3, 2, 8), np.float32))
    assert cache.length(0) == 0  # the failed step rolled back
    with pytest.raises(InvalidInputError, match="no step"):
        cache.attend(0, np.zeros((1, 6, 8), np.float32))


# --- the seam's two rules (issue 25): a layer attends only after it wrote; a step commits only once every
#     layer wrote. Before them a step that wrote nothing committed, and its sequence held zeros or another
#     sequence's stale rows.
SEAM_KINDS = [("contiguous", {}), ("paged", {}), ("paged", {"kv_dtype": "int8"}), ("window", {}), ("none", {})]


def _seam_cache(kind: str, extra: dict):
    from minikv.generate import make_cache

    model = random_model(num_layers=3, head_dim=32, dtype=np.float64)
    eviction = {"window": 6} if kind == "window" else None
    cache = make_cache(kind, model, max_len=16, block_size=4, eviction=eviction, **extra)
    cache.add_sequence(0)
    return model, cache


@pytest.mark.parametrize("kind,extra", SEAM_KINDS, ids=lambda x: x if isinstance(x, str) else str(x))
def test_a_step_that_wrote_no_layer_or_only_some_is_refused_and_rolled_back(kind, extra):
    model, cache = _seam_cache(kind, extra)
    model.forward([[1, 2, 3]], cache)
    before = cache.length(0)
    k = np.ones((1, model.config.num_kv_heads, model.config.head_dim))
    for layers in ([], [0], [0, 2]):
        with pytest.raises(InvalidInputError, match="wrote no K/V for layers"):
            with cache.step([0], [1]):
                for li in layers:
                    cache.write(li, k, k)
        assert cache.length(0) == before
    # the cache still works, and gives what a cache that never saw the refused steps gives
    feed = [1, 2, 3, 4] if kind == "none" else [4]  # (no cache: every pass brings the whole sequence)
    _, fresh = _seam_cache(kind, extra)
    model.forward([[1, 2, 3]], fresh)
    assert np.array_equal(model.forward([feed], cache), model.forward([feed], fresh))


@pytest.mark.parametrize("kind,extra", SEAM_KINDS, ids=lambda x: x if isinstance(x, str) else str(x))
def test_attend_before_write_and_a_bad_layer_are_typed_errors(kind, extra):
    model, cache = _seam_cache(kind, extra)
    q = np.ones((1, model.config.num_heads, model.config.head_dim))
    k = np.ones((1, model.config.num_kv_heads, model.config.head_dim))
    for layer, match in ((1, "before write"), (1.5, "layer=1.5"), ("0", "layer='0'"), (3, "layer=3"), (-1, "layer=-1")):
        with pytest.raises(InvalidInputError, match=match):
            with cache.step([0], [1]):
                cache.write(0, k, k)
                cache.attend(layer, q)
        assert cache.length(0) == 0


# --- the memory check of every step: the system is asked at most once per MEMORY_ANSWER_S --------------------

def test_the_system_memory_answer_is_kept_for_a_moment_then_read_again(monkeypatch):
    import minikv.errors as errors

    reads, clock = [], [100.0]
    monkeypatch.setattr(errors, "_memory_answer", [-np.inf, None])  # fresh, whatever ran before
    monkeypatch.setattr(errors, "_read_available_memory", lambda: reads.append(clock[0]) or 1000 * len(reads))
    monkeypatch.setattr(errors, "monotonic", lambda: clock[0])
    assert errors.available_memory_bytes() == 1000
    clock[0] += errors.MEMORY_ANSWER_S / 2
    assert errors.available_memory_bytes() == 1000 and len(reads) == 1  # kept: no second read
    clock[0] += errors.MEMORY_ANSWER_S / 2
    assert errors.available_memory_bytes() == 2000 and len(reads) == 2  # stale: read again


def test_a_request_far_past_the_memory_right_after_a_small_one_is_still_refused():
    from minikv.errors import available_memory_bytes, check_memory

    check_memory("small", 1, 1, what="one byte")  # reads the system's answer and keeps it
    far = 2 * available_memory_bytes() + 2**30
    with pytest.raises(ConfigError, match=f"far={far:,} needs {far:,} bytes"):
        check_memory("far", far, 1, what="twice the memory")


def test_every_step_is_checked_against_the_memory_small_ones_too(monkeypatch):
    # a step's positions and slot maps take 32 bytes a token; no step is too small to be checked
    model = random_model(dtype=np.float64)
    cache = cache_for(model, max_len=128)
    cache.add_sequence(0)
    monkeypatch.setattr("minikv.errors.available_memory_bytes", lambda: 32 * 99)
    with pytest.raises(InvalidInputError, match="num_new=100 needs 3,200 bytes"):
        model.forward([np.arange(100)], cache)
    assert cache.length(0) == 0  # refused before anything was written
