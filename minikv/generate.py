"""The generation loop: prefill once, then decode one token at a time.

    prefill: run the whole prompt, fill the cache, sample the first new token
    decode:  run only the newest token against the cached history, sample the next

With ``cache="none"`` every step re-runs the model over the whole sequence so
far (step 1's baseline); with a real cache each decode step runs one token.
Both must produce the same tokens under greedy decoding (tests prove it).

``CACHE_KINDS`` is the one registry of cache kinds: ``make_cache`` builds from
it and the ``--cache`` flags list its keys. ``sample(logits, params, rng)`` is
the one sampler, for this loop and for a scheduler's per-sequence rows alike.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np

from minikv.errors import (
    ConfigError,
    InvalidInputError,
    check_choice,
    check_int,
    check_memory,
    memory_need,
)
from minikv.kv_cache import ContiguousKVCache, KVCacheBase, NoCache
from minikv.model import Model
from minikv.paged.allocator import num_blocks_for
from minikv.paged.cache import BLOCK_BOOKKEEPING_BYTES
from minikv.sampling import GREEDY, SamplingParams, sample  # noqa: F401  (the loop's sampler, re-exported)
from minikv.speculative import SPECULATIVE_KINDS, SpecStats, speculative_decode

# --- the cache kinds -------------------------------------------------------------------------


def _paged_block_size(block_size) -> int:
    return check_int("block_size", block_size, hint="a paged cache needs a positive number of token slots per "
                     "block, e.g. block_size=16")


@dataclass(frozen=True)
class CacheKind:
    """One entry of ``CACHE_KINDS``: how to build that cache and how the loop feeds it.

    slots(max_len, max_seqs, block_size) -> token positions the cache reserves up front
    build(model_args, max_len, max_seqs, block_size, dtype) -> the cache
    recompute: the cache forgets, so every step feeds the whole sequence again
    evicts: the cache drops tokens (step 6): lossy, and built only with its ``eviction`` options
    """

    slots: Callable[[int, int, int], int]
    build: Callable[..., KVCacheBase]
    recompute: bool
    description: str
    evicts: bool = False


def _paged_blocks(max_len: int, max_seqs: int, block_size) -> int:
    """Blocks for every sequence's max length (a partial last block is a whole block)."""
    return max_seqs * num_blocks_for(max_len, _paged_block_size(block_size))


# An MLA model's ``new_cache_args`` carry its ``MLAConfig`` ("mla"): each kind then builds its
# latent twin (``minikv.mla``), which stores [c_kv ; k_pe] per token instead of K and V.

def _build_none(args: dict, max_len: int, max_seqs: int, block_size: int, dtype) -> KVCacheBase:
    from minikv.mla.caches import LatentNoCache

    return (LatentNoCache if "mla" in args else NoCache)(**args, dtype=dtype)


def _build_contiguous(args: dict, max_len: int, max_seqs: int, block_size: int, dtype) -> KVCacheBase:
    from minikv.mla.caches import LatentContiguousKVCache

    kind = LatentContiguousKVCache if "mla" in args else ContiguousKVCache
    return kind(**args, max_seqs=max_seqs, max_len=max_len, dtype=dtype)


def paged_cache(args: dict, num_blocks: int, block_size: int, dtype, kv_dtype: str | None = None,
                group: int = 32, residual: int | None = None, **options) -> KVCacheBase:
    """A paged cache of ``num_blocks`` blocks for ``model.new_cache_args()`` (the latent twin for MLA).

    ``kv_dtype`` (a key of ``minikv.quant.formats.KV_DTYPES``; None or "fp32": today's float cache) builds a
    ``QuantizedPagedKVCache`` with ``group`` values per scale. ``residual`` is KIVI's R: for kivi* it
    must equal ``block_size`` (the open block is the residual); other codecs have no R and ignore it.
    ``options`` go to the class (num_host_blocks, enable_prefix_caching, hash_fn, ...).
    """
    from minikv.mla.caches import LatentPagedKVCache
    from minikv.paged.cache import PagedKVCache
    from minikv.quant.cache import QuantizedPagedKVCache
    from minikv.quant.formats import is_kivi

    if kv_dtype not in (None, "fp32"):
        if "mla" in args:
            raise ConfigError(f"kv_dtype={kv_dtype!r}: the MLA latent cache is not quantized (step 5 covers "
                              "K/V caches); use kv_dtype=None")
        if is_kivi(kv_dtype) and residual is not None and residual != block_size:
            raise ConfigError(f"kv_dtype={kv_dtype!r} keeps its residual in the open block: residual={residual} "
                              f"must equal block_size={block_size}")
        return QuantizedPagedKVCache(**args, num_blocks=num_blocks, block_size=block_size, dtype=dtype,
                                     kv_dtype=kv_dtype, group=group, **options)
    kind = LatentPagedKVCache if "mla" in args else PagedKVCache
    return kind(**args, num_blocks=num_blocks, block_size=block_size, dtype=dtype, **options)


def _build_paged(args: dict, max_len: int, max_seqs: int, block_size: int, dtype, **quant) -> KVCacheBase:
    return paged_cache(args, _paged_blocks(max_len, max_seqs, block_size), block_size, dtype, **quant)


def bytes_per_token(args: dict, dtype) -> int:
    """Cache bytes per token for ``model.new_cache_args()``: 2 L Hkv D, or L (R + P) for MLA, x itemsize."""
    from minikv.mla.latent import latent_bytes_per_token

    if "mla" in args:
        return latent_bytes_per_token(args["mla"], args["num_layers"], dtype)
    return 2 * args["num_layers"] * args["num_kv_heads"] * args["head_dim"] * np.dtype(dtype).itemsize


def _build_evicting(kind: str):
    """The builder of an eviction kind (step 6): its policy over contiguous slots or paged blocks."""
    def build(args: dict, max_len: int, max_seqs: int, block_size: int, dtype, rope=None, layout="contiguous",
              log: bool = False, **options) -> KVCacheBase:
        from minikv.window.ring import EvictingKVCache
        from minikv.window.scores import make_policy

        if "mla" in args:
            raise ConfigError(f"cache {kind!r}: window and eviction (step 6) cover K/V caches, not the MLA latent; "
                              "use none, contiguous or paged with an MLA model")
        policy = make_policy(kind, **options)
        if layout == "paged":
            from minikv.window.paged import PagedEvictingKVCache

            return PagedEvictingKVCache(**args, num_blocks=_paged_blocks(max_len, max_seqs, block_size),
                                        block_size=_paged_block_size(block_size), policy=policy, dtype=dtype,
                                        rope=rope, log=log)
        check_choice("layout", layout, EVICTION_LAYOUTS)
        return EvictingKVCache(**args, policy=policy, max_seqs=max_seqs, dtype=dtype, rope=rope, log=log)
    return build


def _no_slots(max_len: int, max_seqs: int, block_size: int) -> int:
    """An evicting cache reserves only its window or budget, which the memory check does not bound."""
    return 0


EVICTION_LAYOUTS = ("contiguous", "paged")
EVICTION_KINDS = ("window", "h2o", "snapkv")

CACHE_KINDS: dict[str, CacheKind] = {
    "none": CacheKind(
        slots=lambda max_len, max_seqs, block_size: 0,
        build=_build_none,
        recompute=True, description="recompute K/V for the whole sequence every step (step 1)"),
    "contiguous": CacheKind(
        slots=lambda max_len, max_seqs, block_size: max_seqs * max_len,
        build=_build_contiguous,
        recompute=False, description="one [max_seqs, max_len] slab per layer, reserved up front (step 2)"),
    "paged": CacheKind(
        slots=lambda max_len, max_seqs, block_size: _paged_blocks(max_len, max_seqs, block_size) * block_size,
        build=_build_paged, recompute=False,
        description="fixed-size blocks from a shared pool, mapped by a block table (step 3)"),
    "window": CacheKind(
        slots=_no_slots, build=_build_evicting("window"), recompute=False, evicts=True,
        description="a ring of the --window latest tokens, plus --sinks first tokens kept for good (step 6)"),
    "h2o": CacheKind(
        slots=_no_slots, build=_build_evicting("h2o"), recompute=False, evicts=True,
        description="--budget keys per layer and head: the --recent latest plus the heaviest by accumulated "
                    "attention (step 6, H2O)"),
    "snapkv": CacheKind(
        slots=_no_slots, build=_build_evicting("snapkv"), recompute=False, evicts=True,
        description="the prompt compressed to --budget keys per layer and head by its last --obs-window queries "
                    "(step 6, SnapKV)"),
}


def cache_kind(kind: str) -> CacheKind:
    """The ``CACHE_KINDS`` entry called ``kind``; InvalidInputError listing the kinds otherwise."""
    spec = CACHE_KINDS.get(kind) if isinstance(kind, str) else None
    if spec is None:
        raise InvalidInputError(f"cache kind {kind!r}; use one of {tuple(CACHE_KINDS)}")
    return spec


def _memory_terms(kind: str, spec: CacheKind, args: dict, dtype, max_len: int, max_seqs: int, block_size,
                  eviction: dict | None, names: dict) -> dict | None:
    """What a cache's storage takes, as ``check_memory``'s arguments (name, value, unit_bytes, fixed, what,
    hint), naming what sizes it: max_len (or block_size, when one block outgrows the sequence), or an
    evicting cache's window / budget, each as ``names`` calls it. None: nothing to store, or a size the
    policy refuses itself. A quantized cache counts its full-precision pool alone."""
    per_token, ev, name = bytes_per_token(args, dtype), eviction or {}, lambda arg: names.get(arg, arg)
    if spec.evicts:  # each slot also keeps its position, score and count (int64, float64, int64)
        per_token += 24 * args["num_layers"] * args.get("num_kv_heads", 1)
        if ev.get("layout", "contiguous") != "paged":
            arg = "window" if kind == "window" else "budget"
            if not isinstance(ev.get(arg), int) or isinstance(ev.get(arg), bool):  # the policy refuses it
                return None
            return dict(name=name(arg), value=ev[arg], unit_bytes=per_token * max_seqs, fixed=0, hint="",
                        what=f"a {kind} cache of {max_seqs} sequence(s) (K, V and bookkeeping per slot)")
        slots = _paged_blocks(max_len, max_seqs, block_size) * block_size
    else:
        slots = spec.slots(max_len, max_seqs, block_size)
    if slots == 0:
        return None
    blocked = kind == "paged" or spec.evicts  # (an evicting cache that gets here has the paged layout)
    if blocked and slots > max_seqs * max_len and block_size > max_len:
        # one block per sequence, bigger than the sequence; each block also keeps its bookkeeping, as the
        # pool's own check counts it (minikv.paged.cache), so the largest size named here is one it accepts
        arg, value, fixed = "block_size", block_size, max_seqs * BLOCK_BOOKKEEPING_BYTES
    else:
        arg, value, fixed = "max_len", max_len, (slots - max_seqs * max_len) * per_token
    seqs = "" if max_seqs == 1 else ", max_seqs"
    return dict(name=name(arg), value=value, unit_bytes=per_token * max_seqs, fixed=fixed,
                what=f"a {kind} cache of {max_seqs} x {max_len:,} tokens (K and V)",
                hint=f"lower {name('max_len')}{seqs}" + (f" or {name('block_size')}" if blocked else ""))


def _check_cache_memory(kind: str, spec: CacheKind, args: dict, dtype, max_len: int, max_seqs: int,
                        block_size, eviction: dict | None, names: dict, beside: int = 0) -> None:
    """Refuse (ConfigError) a cache whose storage would not fit in the memory available now, together with
    ``beside`` bytes that another structure alive at the same time takes, before it is built
    (``_memory_terms``). Those bytes are fixed ones, as a paged pool counts its device blocks beside its host tier."""
    terms = _memory_terms(kind, spec, args, dtype, max_len, max_seqs, block_size, eviction, names)
    if terms is None:
        return
    if beside:
        terms["fixed"] += beside
        terms["what"] += f", together with the {beside:,} bytes of the cache it runs beside"
    check_memory(**terms)


def cache_memory_bytes(kind: str, model: Model, max_len: int, max_seqs: int = 1, block_size: int = 16,
                       dtype=None) -> int:
    """The bytes ``make_cache`` would take for K and V of a lossless cache of ``kind`` (not built)."""
    spec, args, max_len, max_seqs, dtype, block_size, _, names = _prepared(
        kind, model, max_len, max_seqs, block_size, dtype, kv_dtype=None, group=32, residual=128, names=None)
    if spec.evicts:
        raise ConfigError(f"cache_memory_bytes sizes a lossless cache, and {kind!r} evicts: its window or budget "
                          "sizes it; use 'contiguous' or 'paged'")
    terms = _memory_terms(kind, spec, args, dtype, max_len, max_seqs, block_size, None, names)
    return 0 if terms is None else memory_need(terms["value"], terms["unit_bytes"], terms["fixed"])


def _prepared(kind: str, model: Model, max_len, max_seqs, block_size, dtype, kv_dtype, group, residual,
              names: dict | None):
    """What ``make_cache`` builds from, checked: (spec, model args, max_len, max_seqs, dtype, block_size,
    quantization options, names). A kivi* ``kv_dtype`` makes ``residual`` the block size (and its name)."""
    names = dict(names or {})
    spec = cache_kind(kind)
    max_len = check_int(names.get("max_len", "max_len"), max_len, error=InvalidInputError)
    max_seqs = check_int("max_seqs", max_seqs, error=InvalidInputError)
    quant = {}
    if kv_dtype not in (None, "fp32"):
        from minikv.quant.formats import is_kivi

        if kind != "paged":
            raise ConfigError(f"kv_dtype={kv_dtype!r} needs the paged cache (quantized blocks); use kind='paged'")
        if is_kivi(kv_dtype):
            names["block_size"] = names.get("residual", "residual")
            block_size = check_int(names["block_size"], residual, hint="KIVI's full-precision tokens, e.g. 128")
        quant = dict(kv_dtype=kv_dtype, group=group)
    dtype = model.dtype if dtype is None else dtype
    return spec, model.new_cache_args(), max_len, max_seqs, dtype, block_size, quant, names


def check_cache_memory(kind: str, model: Model, max_len: int, max_seqs: int = 1, block_size: int = 16,
                       dtype=None, kv_dtype: str | None = None, group: int = 32, residual: int = 128,
                       eviction: dict | None = None, names: dict | None = None, beside: int = 0) -> None:
    """Refuse (ConfigError, InvalidInputError) the cache ``make_cache`` would build with these arguments when
    it would not fit in the memory available now, without building anything. ``names`` maps the arguments
    (max_len, block_size, residual, window, budget) to what the user typed, e.g. a CLI flag, for the refusal:
    a command checks before its first output, so that a refusal is all it prints. ``beside``: bytes another
    cache held at the same time takes (a lossy run beside its exact one, ``cache_memory_bytes``)."""
    spec, args, max_len, max_seqs, dtype, block_size, _, names = _prepared(
        kind, model, max_len, max_seqs, block_size, dtype, kv_dtype, group, residual, names)
    _check_cache_memory(kind, spec, args, dtype, max_len, max_seqs, block_size, eviction, names, beside)


def make_cache(kind: str, model: Model, max_len: int, max_seqs: int = 1, block_size: int = 16,
               dtype=None, kv_dtype: str | None = None, group: int = 32, residual: int = 128,
               eviction: dict | None = None, rollback: int = 0) -> KVCacheBase:
    """Build a cache of ``kind`` (a key of ``CACHE_KINDS``) sized for ``max_seqs`` x ``max_len`` tokens.

    An MLA model gets the latent cache of that kind (``minikv.mla``). ``kv_dtype`` (a key of
    ``minikv.quant.formats.KV_DTYPES``) stores K/V quantized (paged kind only; None or "fp32": unchanged);
    ``group`` is the values per scale of kivi*/fp8*; for kivi* the block holds ``residual`` tokens
    (KIVI's R; ``block_size`` is replaced by it). Refuses (ConfigError) a cache whose K and V
    would not fit in the memory available now, before allocating anything (``check_cache_memory``).
    ``eviction``: the options of a step-6 kind (window/h2o/snapkv): ``minikv.window.scores.make_policy``'s
    (window, sinks, positions, budget, recent, score, obs_window, kernel, pooling), ``layout``
    ("contiguous" slots, the default, or "paged" blocks) and ``log`` (keep the eviction log that
    ``MaskedRecompute`` needs; default False: it grows with the text); other kinds refuse it.
    A model that shards itself over ranks (``minikv.parallel.tensor.ParallelModel``) builds its rank's cache.
    A model with sliding-window layers gets a hybrid cache of ``kind`` (``minikv.hybrid``): its sliding groups
    keep ``rollback`` (K) more tokens so that a truncate of up to K stays exact; a quantized ``kv_dtype`` or an
    eviction kind applies to its full layers only.
    """
    if hasattr(model, "make_cache"):
        options = dict(kv_dtype=kv_dtype, group=group, residual=residual, eviction=eviction)
        if dtype is not None:
            options["dtype"] = dtype
        return model.make_cache(kind, max_len, max_seqs, block_size, **options)
    spec, args, max_len, max_seqs, dtype, block_size, quant, names = _prepared(
        kind, model, max_len, max_seqs, block_size, dtype, kv_dtype, group, residual, None)
    _check_cache_memory(kind, spec, args, dtype, max_len, max_seqs, block_size, eviction, names)
    if any(w is not None for w in model.config.layer_windows):  # step 9: sliding layers get their own caches
        from minikv.hybrid import hybrid_cache

        full = None
        if quant or kind in EVICTION_KINDS:  # step 9's combinations: a quantized or evicting cache of the full layers
            extra = quant or dict(rope=(model.cos, model.sin, model.config.rope_layout), **(eviction or {}))
            full = lambda n: spec.build({**args, "num_layers": n}, max_len, max_seqs, block_size, dtype, **extra)  # noqa: E731
        elif eviction:
            raise ConfigError(f"eviction options {sorted(eviction)} need an eviction cache kind {EVICTION_KINDS}")
        return hybrid_cache("contiguous" if full else kind, model.config.layer_windows,
                            args["num_kv_heads"], args["head_dim"], max_len, max_seqs, dtype, block_size=block_size,
                            rollback=rollback, full_group=full)
    if kind in EVICTION_KINDS:  # (a quantized kv_dtype was refused above: it needs kind "paged")
        rope = (model.cos, model.sin, model.config.rope_layout)
        return spec.build(args, max_len, max_seqs, block_size, dtype, rope=rope, **(eviction or {}))
    if eviction:
        raise ConfigError(f"eviction options {sorted(eviction)} need an eviction cache kind {EVICTION_KINDS}; "
                          f"cache {kind!r} keeps every token")
    return spec.build(args, max_len, max_seqs, block_size, dtype, **quant)


def check_context(max_position: int, prompt_len: int, max_new_tokens: int, name: str = "max_new_tokens") -> None:
    """Refuse a generation that would run past a model's ``max_position`` (InvalidInputError naming ``name``).

    The last new token is never fed back, so positions 0 .. prompt_len + max_new_tokens - 2 run.
    """
    if prompt_len + max_new_tokens - 1 > max_position:
        room = max_position - prompt_len + 1
        fix = f"use {name} <= {room}" if room >= 1 else f"the {prompt_len}-token prompt alone is too long"
        raise InvalidInputError(f"{name}={max_new_tokens} after a {prompt_len}-token prompt runs past the "
                                f"model's context of max_position={max_position} tokens; {fix}")


# --- the loop ------------------------------------------------------------------------------------


@dataclass
class GenerationResult:
    """What one ``generate`` call produced, with its timings.

    prefill_s is the time to the first new token (the prompt's forward pass);
    decode_tokens_per_s counts the tokens after the first, each of which needs
    one decode forward pass.
    """

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    cache: str = "contiguous"
    prefill_s: float = 0.0
    decode_s: float = 0.0
    finish_reason: str = "length"  # "length" or "eos"
    speculative: SpecStats | None = None  # drafted/accepted counts of a speculative run, else None

    @property
    def decode_tokens_per_s(self) -> float:
        n = len(self.token_ids) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else float("nan")


def stream(model: Model, prompt_ids: Sequence[int], max_new_tokens: int, cache: str = "contiguous",
           sampling: SamplingParams = GREEDY, eos_token_id: int | None = None, block_size: int = 16,
           result: GenerationResult | None = None, kv_dtype: str | None = None, group: int = 32,
           residual: int = 128, eviction: dict | None = None, speculative: str | None = None,
           draft_len: int = 4) -> Iterator[int]:
    """Yield new token ids one by one as they are generated; stops at EOS or ``max_new_tokens``.

    ``kv_dtype``/``group``/``residual``: the quantized K/V of ``make_cache`` (paged cache only);
    ``eviction``: the options of a window/h2o/snapkv cache (``make_cache``).
    ``speculative="ngram"``: prompt-lookup drafts of up to ``draft_len`` tokens, verified in one step
    and rolled back (``minikv.speculative``); greedy only, same tokens as without it.

    ``result`` (optional) is filled in as generation proceeds: timings and
    tokens, for the caller to read when the iterator is exhausted.
    """
    (prompt,) = model.check_tokens([prompt_ids])
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, minimum=0, error=InvalidInputError)
    spec = cache_kind(cache)
    eos = model.config.eos_token_id if eos_token_id is None else eos_token_id
    result = GenerationResult(prompt_ids=[]) if result is None else result
    result.prompt_ids, result.cache = prompt.tolist(), cache
    if max_new_tokens == 0:
        return
    if (eviction or {}).get("positions") != "in-cache":  # in-cache positions never pass the window: no limit
        check_context(model.config.max_position, prompt.size, max_new_tokens)
    rng = sampling.new_rng()
    kv = make_cache(cache, model, max_len=prompt.size + max_new_tokens, block_size=block_size, kv_dtype=kv_dtype,
                    group=group, residual=residual, eviction=eviction, rollback=draft_len if speculative else 0)
    kv.add_sequence(0)
    if speculative is not None:
        _check_speculative(speculative, draft_len, sampling, spec, kv)
    ids = prompt.tolist()

    def next_logits(new: Sequence[int]) -> np.ndarray:
        if spec.recompute:  # a cache that forgets: feed it the whole sequence so far
            return model.forward([ids], kv)[0]
        return model.forward([new], kv)[0]

    t0 = time.perf_counter()
    logits = next_logits(ids)
    result.prefill_s = time.perf_counter() - t0
    if speculative is not None:
        first = sample(logits, sampling)
        yield from speculative_decode(model, kv, ids, first, max_new_tokens, eos, result, draft_len)
        return
    for i in range(max_new_tokens):
        tok = sample(logits, sampling, rng)
        ids.append(tok)
        result.token_ids.append(tok)
        yield tok  # the consumer's time while we are suspended is not counted below
        if eos is not None and tok == eos:
            result.finish_reason = "eos"
            break
        if i + 1 < max_new_tokens:
            t0 = time.perf_counter()
            logits = next_logits([tok])
            result.decode_s += time.perf_counter() - t0


def _check_speculative(speculative, draft_len, sampling: SamplingParams, spec: CacheKind, kv: KVCacheBase) -> None:
    """Refuse what speculative decoding cannot do: sampling, a recomputing cache, a cache that cannot roll back."""
    check_choice("speculative", speculative, SPECULATIVE_KINDS, error=InvalidInputError)
    check_int("draft_len", draft_len, error=InvalidInputError, hint="draft tokens verified per step, e.g. 4")
    if not sampling.greedy:
        raise InvalidInputError("speculative decoding here accepts drafts greedily (argmax); use greedy sampling "
                                "(--greedy) or turn speculation off")
    if spec.recompute:
        raise ConfigError("speculative decoding verifies drafts against cached K/V, and cache='none' keeps none; "
                          "use a contiguous or paged cache")
    kv.truncate(0, 0)  # a cache that cannot roll back (window, eviction) says why here: RollbackError


def generate(model: Model, prompt_ids: Sequence[int], max_new_tokens: int, cache: str = "contiguous",
             sampling: SamplingParams = GREEDY, eos_token_id: int | None = None, block_size: int = 16,
             on_token: Callable[[int], None] | None = None, kv_dtype: str | None = None, group: int = 32,
             residual: int = 128, eviction: dict | None = None, speculative: str | None = None,
             draft_len: int = 4) -> GenerationResult:
    """Generate up to ``max_new_tokens`` tokens after ``prompt_ids``; see ``stream``."""
    result = GenerationResult(prompt_ids=[])  # stream() fills it in
    for tok in stream(model, prompt_ids, max_new_tokens, cache, sampling, eos_token_id, block_size, result,
                      kv_dtype=kv_dtype, group=group, residual=residual, eviction=eviction,
                      speculative=speculative, draft_len=draft_len):
        if on_token is not None:
            on_token(tok)
    return result
