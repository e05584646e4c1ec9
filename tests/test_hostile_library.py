"""Hostile calls to the library (issue 25): every one is a ``MinikvError``, and a refused call leaves no trace.

The property test drives two twin caches of one kind through the same random run of forward passes,
truncates and frees; one of them also receives hostile calls (outside a step, and inside one through
``Model.forward``'s ``then`` hook). Every refusal must be a ``MinikvError``, and afterwards the twins
must give bit-identical logits, lengths and outcomes: a refused call changes nothing that can be seen.
Every cache kind of ``make_cache`` takes part (quantized, evicting on both layouts, MLA, hybrid).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minikv.errors import ConfigError, DTypeError, InvalidInputError, MinikvError, ShapeError
from minikv.generate import make_cache
from minikv.kv_cache import ContiguousKVCache, NoCache
from minikv.paged.cache import PagedKVCache
from minikv.sampling import SamplingParams, sample
from minikv.weights.random_models import random_gemma_model, random_mla_model, random_model

# kind -> (model family, make_cache options); head_dim 32 where a codec groups 32 values
KINDS = {
    "none": ("gqa", dict(kind="none")),
    "contiguous": ("gqa", dict(kind="contiguous")),
    "contiguous-fp16": ("gqa", dict(kind="contiguous", dtype=np.float16)),
    "paged": ("gqa", dict(kind="paged", block_size=3)),
    "paged-int8": ("gqa32", dict(kind="paged", block_size=2, kv_dtype="int8")),
    "paged-int4": ("gqa32", dict(kind="paged", block_size=2, kv_dtype="int4")),
    "paged-kivi2": ("gqa32", dict(kind="paged", kv_dtype="kivi2", group=4, residual=4)),
    "paged-fp8": ("gqa32", dict(kind="paged", block_size=3, kv_dtype="fp8", group=8)),
    "window": ("gqa", dict(kind="window", eviction=dict(window=5, sinks=1))),
    "window-in-cache": ("gqa", dict(kind="window", eviction=dict(window=4, positions="in-cache"))),
    "window-paged": ("gqa", dict(kind="window", block_size=2, eviction=dict(window=5, layout="paged"))),
    "h2o": ("gqa", dict(kind="h2o", eviction=dict(budget=4))),
    "snapkv": ("gqa", dict(kind="snapkv", eviction=dict(budget=4, obs_window=2))),
    "mla-none": ("mla", dict(kind="none")),
    "mla-contiguous": ("mla", dict(kind="contiguous")),
    "mla-paged": ("mla", dict(kind="paged", block_size=2)),
    "hybrid-contiguous": ("gemma", dict(kind="contiguous")),
    "hybrid-none": ("gemma", dict(kind="none")),
}
MAX_LEN, VOCAB = 12, 61


def build(kind: str, hkv: int, group: int, dtype) -> tuple:
    family, opts = KINDS[kind]
    opts = dict(opts)
    if family == "mla":
        model = random_mla_model(vocab_size=VOCAB, dtype=dtype)
    elif family == "gemma":
        model = random_gemma_model(num_layers=3, vocab_size=VOCAB, dtype=dtype)
    else:
        d = 32 if family == "gqa32" else 4
        model = random_model(num_layers=2, hidden_size=12, num_heads=hkv * group, num_kv_heads=hkv, head_dim=d,
                             intermediate_size=10, vocab_size=VOCAB, dtype=dtype)
    return model, make_cache(opts.pop("kind"), model, max_len=MAX_LEN, max_seqs=3, **opts)


# --- the hostile calls -------------------------------------------------------------------------------

def _rows(cache, n, dtype=np.float32, heads=None):
    return np.ones((n, cache.num_kv_heads if heads is None else heads, cache.head_dim), dtype)


def outside_calls(cache, model, live: list) -> list:
    """(name, call) pairs that must be refused with no step open."""
    sid = live[0] if live else 0
    calls = [
        ("step no ids", lambda: cache.step([], []).__enter__()),
        ("num_new 0", lambda: cache.step([sid], [0]).__enter__()),
        ("num_new 2**70", lambda: cache.step([sid], [2**70]).__enter__()),
        ("num_new str", lambda: cache.step([sid], ["1"]).__enter__()),
        ("num_new float", lambda: cache.step([sid], [1.5]).__enter__()),
        ("num_new None", lambda: cache.step([sid], [None]).__enter__()),
        ("num_new two for one", lambda: cache.step([sid], [1, 1]).__enter__()),
        ("write outside", lambda: cache.write(0, _rows(cache, 1), _rows(cache, 1))),
        ("attend outside", lambda: cache.attend(0, _rows(cache, 1))),
        ("end_step outside", lambda: cache.end_step()),
        ("forward empty tokens", lambda: model.forward([[]], cache, [sid])),
        ("forward id past vocab", lambda: model.forward([[VOCAB]], cache, [sid])),
        ("forward negative id", lambda: model.forward([[-1]], cache, [sid])),
        ("forward float ids", lambda: model.forward([np.array([1.0])], cache, [sid])),
        ("forward ids mismatch", lambda: model.forward([[1], [2]], cache, [sid])),
    ]
    if not isinstance(cache, NoCache):
        calls += [
            ("step repeated id", lambda: cache.step([sid, sid], [1, 1]).__enter__()),
            ("step unknown id", lambda: cache.step(["nope"], [1]).__enter__()),
            ("free unknown", lambda: cache.free_sequence("nope")),
            ("truncate unknown", lambda: cache.truncate("nope", 0)),
            ("forward unknown id", lambda: model.forward([[1]], cache, ["nope"])),
        ]
    if live and not isinstance(cache, NoCache):
        n = cache.length(sid)
        calls += [("add existing", lambda: cache.add_sequence(sid)),
                  ("truncate -1", lambda: cache.truncate(sid, -1)),
                  ("truncate past length", lambda: cache.truncate(sid, n + 1)),
                  ("truncate str", lambda: cache.truncate(sid, "0")),
                  ("truncate 2**70", lambda: cache.truncate(sid, 2**70))]
    return calls


def inside_calls(cache, live: list) -> list:
    """(name, call) pairs that must be refused inside an open step whose every layer wrote."""
    n = cache._step.num_tokens
    sid = live[0]
    last = cache.num_layers
    return [
        ("nested step", lambda: cache.step([sid], [1]).__enter__()),
        ("free in step", lambda: cache.free_sequence(sid)),
        ("truncate in step", lambda: cache.truncate(sid, 0)),
        ("write layer past the end", lambda: cache.write(last, _rows(cache, n), _rows(cache, n))),
        ("write layer -1", lambda: cache.write(-1, _rows(cache, n), _rows(cache, n))),
        ("write layer float", lambda: cache.write(0.0, _rows(cache, n), _rows(cache, n))),
        ("write layer str", lambda: cache.write("0", _rows(cache, n), _rows(cache, n))),
        ("write wrong rows", lambda: cache.write(0, _rows(cache, n + 1), _rows(cache, n + 1))),
        ("write int k", lambda: cache.write(0, _rows(cache, n, np.int32), _rows(cache, n, np.int32))),
        ("write a list", lambda: cache.write(0, [[0.0]], [[0.0]])),
        ("attend layer past the end", lambda: cache.attend(last, _rows(cache, n))),
        ("attend int q", lambda: cache.attend(0, _rows(cache, n, np.int64))),
        ("attend wrong N", lambda: cache.attend(0, _rows(cache, n + 1))),
        ("attend 2-D q", lambda: cache.attend(0, np.ones((n, cache.head_dim), np.float32))),
    ] + ([("attend heads not a multiple", lambda: cache.attend(0, _rows(cache, n, heads=cache.num_kv_heads + 1)))]
         if cache.num_kv_heads > 1 else [])


def refused(name: str, call) -> str:
    """Run a hostile call: it must raise a MinikvError (anything else, or nothing, fails the test)."""
    try:
        call()
    except MinikvError as e:
        return type(e).__name__
    except Exception as e:  # noqa: BLE001  (the point: nothing but a MinikvError)
        pytest.fail(f"{name}: {type(e).__name__}: {e} is not a MinikvError")
    pytest.fail(f"{name}: accepted")


# --- the twins ---------------------------------------------------------------------------------------

def outcome(fn):
    try:
        return ("ok", fn())
    except MinikvError as e:
        return ("refused", type(e).__name__, str(e))


def apply(model, cache, op, live: list, hostile=None):
    """One valid operation; ``hostile`` (a chooser of inside calls) runs inside a forward's step."""
    kind, arg = op
    if kind == "add":
        return outcome(lambda: cache.add_sequence(arg))
    if kind == "free":
        return outcome(lambda: cache.free_sequence(arg))
    if kind == "truncate":
        sid, keep = arg
        return outcome(lambda: cache.truncate(sid, min(keep, cache.length(sid))))

    def then(_logits):
        if hostile is not None:
            name, call = hostile(inside_calls(cache, live))
            refused(name, call)

    seqs, toks = arg
    return outcome(lambda: model.forward(toks, cache, seqs, then=then).tolist())


@st.composite
def runs(draw):
    """A cache kind, its geometry, and a run: (op, hostile-before?, hostile-inside?) triples."""
    kind = draw(st.sampled_from(sorted(KINDS)))
    hkv, group = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    ops, live, next_id = [], [], 0
    for _ in range(draw(st.integers(2, 7))):
        choice = draw(st.sampled_from(["add", "forward", "forward", "truncate", "free"]))
        if choice == "add" or not live:
            live.append(next_id)
            ops.append(("add", next_id))
            next_id += 1
            continue
        if choice == "forward":
            seqs = draw(st.lists(st.sampled_from(live), min_size=1, max_size=len(live), unique=True))
            toks = [draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4)) for _ in seqs]
            ops.append(("forward", (seqs, toks)))
        elif choice == "truncate":
            ops.append(("truncate", (draw(st.sampled_from(live)), draw(st.integers(0, 4)))))
        else:
            sid = draw(st.sampled_from(live))
            live.remove(sid)
            ops.append(("free", sid))
    hostile = [(draw(st.integers(0, 2**16)), draw(st.integers(0, 2**16))) for _ in ops]
    return kind, hkv, group, dtype, ops, hostile


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(run=runs())
def test_a_refused_call_changes_nothing_on_any_cache(run):
    kind, hkv, group, dtype, ops, hostile = run
    model, twin_a = build(kind, hkv, group, dtype)
    _, twin_b = build(kind, hkv, group, dtype)
    live = []
    for op, (before, inside) in zip(ops, hostile):
        calls = outside_calls(twin_a, model, live)
        name, call = calls[before % len(calls)]
        refused(name, call)
        chooser = (lambda calls, k=inside: calls[k % len(calls)]) if op[0] == "forward" and live else None
        got = apply(model, twin_a, op, live, chooser)
        want = apply(model, twin_b, op, live)
        assert got == want, f"{kind}: {op}: {got[:2]} != {want[:2]} after a refused {name}"
        if op[0] == "add" and got[0] == "ok":
            live.append(op[1])
        if op[0] == "free" and got[0] == "ok":
            live.remove(op[1])
        if not isinstance(twin_a, NoCache):
            assert [twin_a.length(s) for s in live] == [twin_b.length(s) for s in live]


# --- the causes of issue 25, one by one ----------------------------------------------------------------

def _open(cache):
    cache.add_sequence(0)
    return cache


@pytest.mark.parametrize("make", [lambda: ContiguousKVCache(2, 3, 4, max_seqs=1, max_len=8),
                                  lambda: PagedKVCache(2, 3, 4, num_blocks=8, block_size=2),
                                  lambda: NoCache(2, 3, 4)])
@pytest.mark.parametrize("num_new, what", [([2**70], "outside"), ([2**40], "outside"), (["3"], "integer"),
                                           (["x"], "integer"), ([2.5], "integer"), ([True], "integer")])
def test_a_num_new_that_overflows_or_is_no_integer_is_refused(make, num_new, what):
    cache = _open(make())
    with pytest.raises(InvalidInputError, match=f"num_new=.*{what}"):
        with cache.step([0], num_new):
            pass
    assert cache._step is None


def test_a_step_too_large_for_memory_is_refused_before_its_positions_exist():
    cache = _open(NoCache(1, 1, 2))
    with pytest.raises(InvalidInputError, match=r"num_new=2,147,483,647 needs .* largest num_new that fits"):
        with cache.step([0], [2**31 - 1]):
            pass


def _written(cache, heads=3):
    cache.begin_step([0], [1])
    for layer in range(cache.num_layers):
        cache.write(layer, np.ones((1, heads, 4), np.float32), np.ones((1, heads, 4), np.float32))
    return cache


@pytest.mark.parametrize("make", [lambda: ContiguousKVCache(2, 3, 4, max_seqs=1, max_len=8),
                                  lambda: PagedKVCache(2, 3, 4, num_blocks=8, block_size=2)])
def test_an_integer_query_and_heads_that_are_no_multiple_of_kv_heads_are_refused(make):
    cache = _written(_open(make()))
    with pytest.raises(DTypeError, match="q: int64"):
        cache.attend(0, np.ones((1, 3, 4), np.int64))
    with pytest.raises(ShapeError, match="multiple of the 3 KV heads"):
        cache.attend(0, np.ones((1, 5, 4), np.float32))
    assert cache.attend(0, np.ones((1, 6, 4), np.float32)).shape == (1, 6, 4)


@pytest.mark.parametrize("make", [lambda: ContiguousKVCache(2, 3, 4, max_seqs=1, max_len=8),
                                  lambda: PagedKVCache(2, 3, 4, num_blocks=8, block_size=2)])
def test_free_sequence_inside_a_step_is_refused_and_the_step_still_commits(make):
    cache = _written(_open(make()))
    with pytest.raises(InvalidInputError, match=r"free_sequence\(0\) while a step is open"):
        cache.free_sequence(0)
    cache.end_step()
    assert cache.length(0) == 1


@pytest.mark.parametrize("temperature", [1e-320, 5e-324, 1e-300])
def test_a_tiny_temperature_samples_the_argmax(temperature):
    params = SamplingParams(temperature=temperature, seed=0)
    logits = np.array([0.5, 3.0, -2.0, 2.999], np.float32)
    assert sample(logits, params, params.new_rng()) == 1


@pytest.mark.parametrize("params", [SamplingParams(greedy=True), SamplingParams(seed=0)])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_logits_with_nan_or_inf_are_refused_not_sampled_as_token_0(params, bad):
    logits = np.array([0.5, bad, 1.0], np.float32)
    with pytest.raises(InvalidInputError, match="NaN or inf"):
        sample(logits, params, params.new_rng())


@pytest.mark.parametrize("field, value", [("temperature", float("nan")), ("temperature", float("inf")),
                                          ("top_p", float("nan")), ("temperature", "0.5")])
def test_sampling_params_refuse_nan_inf_and_strings(field, value):
    with pytest.raises(InvalidInputError, match=field):
        SamplingParams(**{field: value})


def test_huge_weights_end_in_a_refusal_not_in_token_0():
    from minikv.generate import generate

    model = random_model(vocab_size=VOCAB)
    model.weights.layers[0].w_up[:] = 1e38  # finite, so the loaders accept it; the activations overflow
    model.__post_init__()
    with pytest.raises(InvalidInputError, match="NaN or inf"):
        generate(model, [1, 2, 3], 4)


@pytest.mark.parametrize("kind, eviction, name", [
    ("window", dict(window=2**31 - 1), "window"), ("h2o", dict(budget=2**40), "budget"),
    ("snapkv", dict(budget=2**40), "budget"), ("window", dict(window=4, layout="paged"), "max_len"),
    ("h2o", dict(budget=4, layout="paged"), "max_len"),
])
def test_an_evicting_cache_too_large_for_memory_is_refused_before_allocating(kind, eviction, name):
    model = random_model()
    max_len = 2**31 - 1 if eviction.get("layout") == "paged" else 16
    with pytest.raises(ConfigError, match=rf"{name}=.* needs .* bytes .* the largest {name} that fits is"):
        make_cache(kind, model, max_len=max_len, eviction=eviction)


def test_a_block_larger_than_memory_is_refused_naming_block_size():
    with pytest.raises(ConfigError, match=r"block_size=1,099,511,627,776 needs .* the largest block_size that fits"):
        make_cache("paged", random_model(), max_len=10, block_size=2**40)
