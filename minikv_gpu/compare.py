"""NumPy path vs GPU path, token by token: the engine behind ``minikv compare``.

Both models get the same prompt and, at every decode step, the same next token:
the NumPy reference's greedy choice. So every step compares logits of the same
inputs, and a disagreement of the GPU's argmax shows up at the step where it
happens instead of derailing the rest of the run.

    step 0       prefill of the prompt (T tokens): logits of its last token -> new token 1
    step 1..N-1  one decode step each over the cache -> new tokens 2..N

Reported per step: max |Δlogit|, whether the argmaxes agree, and the wall time
of each path (the GPU time includes copying the logits back to the host).

A near tie is not a failure. Where the GPU's argmax differs but its token's NumPy logit lies within
the tolerance of NumPy's top logit (``StepResult.tie``), the two paths disagree only by rounding
smaller than the bar both are held to: a float16 cache decodes through top-1/top-2 gaps of about
0.0125 against a 1e-2 tolerance. Such a step counts as agreeing, and the report lists it as a tie.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import numpy as np

from minikv import hybrid as cpu_hybrid
from minikv import kv_cache as cpu_cache
from minikv import mla as cpu_mla
from minikv import paged as cpu_paged
from minikv.bench.equivalence import max_abs_err, rel_err
from minikv.errors import ConfigError, InvalidInputError, check_int
from minikv.generate import CACHE_KINDS  # the CPU side's registry of cache kinds: compare runs the lossless ones
from minikv.model import Model as CpuModel
from minikv.weights.random_models import random_model
from minikv_gpu import hybrid as gpu_hybrid
from minikv_gpu import kv_cache as gpu_cache
from minikv_gpu import mla as gpu_mla
from minikv_gpu import paged as gpu_paged
from minikv_gpu import runtime as _runtime
from minikv_gpu.model import from_cpu

# SmolLM2-135M's architecture (DESIGN.md section 3), for --random: the GPU machine runs the
# real shapes without the 98 MB GGUF file, which does not travel there.
SMOLLM2_SHAPES = dict(num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64,
                      intermediate_size=1536, vocab_size=49152, rope_theta=100000.0, max_position=8192,
                      rope_layout="interleaved")

# Pass criteria on max |Δlogit| (greedy tokens must agree as well). float32: both paths compute the same
# float32 math in a different order, so the logits agree to ~1e-5..1e-4 and 1e-3 is the bound.
# float16 cache: the two paths' float32 keys can differ in their last bit (another matmul order), and a
# value that sits on a float16 rounding boundary then rounds one float16 ulp (2^-11 relative) apart;
# over 30 layers those flips move SmolLM2's logits by a few 1e-3 (measured: 4.7e-3 on the simulator),
# still far below the float16 rounding's own effect on the logits.
DEFAULT_TOL = {"float32": 1e-3, "float16": 1e-2}
COMPARE_KINDS = tuple(k for k, spec in CACHE_KINDS.items() if not spec.evicts)


@dataclass
class StepResult:
    step: int
    kind: str              # "prefill" or "decode"
    tokens: int            # tokens fed in this step
    max_abs_logit_diff: float  # minikv.bench.equivalence.max_abs_err (the pass criterion, DEFAULT_TOL)
    rel_logit_diff: float      # minikv.bench.equivalence.rel_err (the yardstick of every other check)
    token_numpy: int
    token_gpu: int
    numpy_s: float
    gpu_s: float
    top_gap: float = float("inf")   # NumPy's top-1 minus top-2 logit
    gpu_token_gap: float = 0.0      # NumPy's top logit minus NumPy's logit of the GPU's token
    tol: float = 0.0                # the max |Δlogit| bar of this run (DEFAULT_TOL)

    @property
    def agree(self) -> bool:
        return self.token_numpy == self.token_gpu

    @property
    def tie(self) -> bool:
        """The argmaxes differ, but the GPU's token is within ``tol`` of NumPy's top logit (see the module
        docstring): a rounding-level disagreement, not a failure."""
        return not self.agree and self.gpu_token_gap <= self.tol


@dataclass
class CompareResult:
    backend: str
    cache: str
    cache_dtype: str
    fused: bool
    prompt_tokens: int
    steps: list = field(default_factory=list)
    block_size: int | None = None  # the paged caches' block size

    @property
    def max_abs_logit_diff(self) -> float:
        return max((s.max_abs_logit_diff for s in self.steps), default=0.0)

    @property
    def tokens_agree(self) -> bool:
        """Every step's argmaxes agree, or differ in a near tie."""
        return all(s.agree or s.tie for s in self.steps)

    @property
    def ties(self) -> list[int]:
        """The steps whose argmaxes differ in a near tie."""
        return [s.step for s in self.steps if s.tie]

    def summary(self) -> dict:
        """The JSON line of ``minikv compare --json``."""
        return {"max_abs_logit_diff": self.max_abs_logit_diff, "tokens_agree": self.tokens_agree,
                "ties": self.ties, "tol": self.steps[0].tol if self.steps else None,
                "steps": len(self.steps), "backend": self.backend, "cache": self.cache,
                "cache_dtype": self.cache_dtype, "fused": self.fused, "prompt_tokens": self.prompt_tokens,
                "block_size": self.block_size,
                "numpy_s": sum(s.numpy_s for s in self.steps), "gpu_s": sum(s.gpu_s for s in self.steps),
                "per_step": [{**asdict(s), "agree": s.agree, "tie": s.tie} for s in self.steps]}


def judge_step(ref: np.ndarray, got: np.ndarray, tol: float, **times) -> dict:
    """The comparison fields of one step's logits (ref: NumPy's, got: the GPU's; [V] each) for StepResult."""
    top2 = np.partition(ref, -2)[-2:] if ref.size > 1 else np.array([-np.inf, ref.max()])
    tok_n, tok_g = int(np.argmax(ref)), int(np.argmax(got))
    return dict(max_abs_logit_diff=max_abs_err(got, ref), rel_logit_diff=rel_err(got, ref), token_numpy=tok_n,
                token_gpu=tok_g, top_gap=float(top2[1] - top2[0]), gpu_token_gap=float(ref[tok_n] - ref[tok_g]),
                tol=float(tol), **times)


def smollm2_random(seed: int = 0) -> CpuModel:
    """A NumPy model with SmolLM2-135M's shapes and random weights."""
    return random_model(seed=seed, **SMOLLM2_SHAPES)


def _latent_pair(kind: str, model: CpuModel, max_len: int, cache_dtype, block_size, rt):
    """``_cache_pair`` for an MLA model: the ``minikv.mla`` latent cache and its ``minikv_gpu.mla`` twin."""
    args = model.new_cache_args()
    if kind == "paged":
        check_int("block_size", block_size, hint="a positive number of token slots per block")
        args.update(num_blocks=cpu_paged.num_blocks_for(max_len, block_size), block_size=block_size, dtype=cache_dtype)
        return cpu_mla.LatentPagedKVCache(**args), gpu_mla.LatentPagedKVCache(**args, runtime=rt)
    if kind == "contiguous":
        args.update(max_seqs=1, max_len=max_len, dtype=cache_dtype)
        return cpu_mla.LatentContiguousKVCache(**args), gpu_mla.LatentContiguousKVCache(**args, runtime=rt)
    return cpu_mla.LatentNoCache(**args, dtype=model.dtype), gpu_mla.LatentNoCache(**args, runtime=rt)


def _hybrid_pair(kind: str, model: CpuModel, max_len: int, cache_dtype, block_size, rt):
    """``_cache_pair`` for a model with sliding layers: ``minikv.hybrid.hybrid_cache`` (the paged one shares a
    pool between groups) and ``minikv_gpu.hybrid.hybrid_cache`` (window kernels for the sliding groups, paged
    or contiguous ones for the full group)."""
    c = model.config
    if kind == "none":  # the GPU NoCache attends over every key: it has no window to mask a sliding layer with
        raise ConfigError("cache='none' on a model with sliding-window layers: the GPU path has no per-layer "
                          "uncached attention; compare its caches with cache='contiguous' or 'paged'")
    if kind == "paged":
        check_int("block_size", block_size, hint="a positive number of token slots per block")
    args = (kind, c.layer_windows, c.num_kv_heads, c.head_dim, max_len, 1, cache_dtype)
    return (cpu_hybrid.hybrid_cache(*args, block_size=block_size),
            gpu_hybrid.hybrid_cache(*args, block_size=block_size, runtime=rt))


def _cache_pair(kind: str, model: CpuModel, gpu, max_len: int, cache_dtype, block_size, rt):
    """The NumPy cache and its GPU twin of ``kind``, sized for one sequence of ``max_len`` tokens."""
    if model.config.mla is not None:
        return _latent_pair(kind, model, max_len, cache_dtype, block_size, rt)
    if any(w is not None for w in model.config.layer_windows):
        return _hybrid_pair(kind, model, max_len, cache_dtype, block_size, rt)
    if kind == "paged":  # pools just large enough for the run
        check_int("block_size", block_size, hint="a positive number of token slots per block")
        num_blocks = cpu_paged.num_blocks_for(max_len, block_size)
        args = dict(**model.new_cache_args(), num_blocks=num_blocks, block_size=block_size, dtype=cache_dtype)
        return cpu_paged.PagedKVCache(**args), gpu_paged.PagedKVCache(**args, runtime=rt)
    if kind == "contiguous":
        c_cpu = cpu_cache.ContiguousKVCache(**model.new_cache_args(), max_seqs=1, max_len=max_len,
                                            dtype=cache_dtype)
        return c_cpu, gpu.new_cache(max_seqs=1, max_len=max_len)
    return (cpu_cache.NoCache(**model.new_cache_args(), dtype=model.dtype),
            gpu_cache.NoCache(**model.new_cache_args(), runtime=rt))


def compare(model: CpuModel, prompt_ids, max_new_tokens: int = 4, *, backend: str | None = None,
            cache: str = "contiguous", cache_dtype=np.float32, fused: bool = False,
            on_step=None, block_size: int = 16, tol: float | None = None) -> CompareResult:
    """Run ``model`` (NumPy) and its GPU twin side by side; see the module docstring.

    max_new_tokens: steps to compare, the prefill included (>= 1)
    cache:          "contiguous" or "paged" (both paths cache K/V the same way), or "none" (both
                    recompute everything)
    cache_dtype:    what both caches store, float32 or float16
    fused:          the GPU path decodes with the fused RoPE + cache-write + attention kernel
    on_step:        called with each ``StepResult`` as soon as it is measured (for printing)
    block_size:     token slots per block of the paged caches
    tol:            the max |Δlogit| bar, also the near-tie margin (default ``DEFAULT_TOL[cache_dtype]``)
    """
    if cache not in COMPARE_KINDS:
        raise ConfigError(f"cache={cache!r}; compare supports {COMPARE_KINDS} (the eviction kinds' GPU path is "
                          "checked by tests/gpu/test_gpu_window.py)")
    check_int("max_new_tokens", max_new_tokens, error=InvalidInputError, hint="1 = prefill only")
    ids = [int(t) for t in prompt_ids]
    if not ids:
        raise InvalidInputError("the prompt encodes to no tokens; give some text")
    rt = _runtime.get_runtime(backend)
    cache_dtype = np.dtype(cache_dtype)
    tol = DEFAULT_TOL[cache_dtype.name] if tol is None else float(tol)
    gpu = from_cpu(model, runtime=rt, cache_dtype=cache_dtype, fused=fused)
    c_cpu, c_gpu = _cache_pair(cache, model, gpu, len(ids) + max_new_tokens, cache_dtype, block_size, rt)
    c_cpu.add_sequence(0)
    c_gpu.add_sequence(0)

    result = CompareResult(backend=rt.name, cache=cache, cache_dtype=cache_dtype.name, fused=fused,
                           prompt_tokens=len(ids), block_size=int(block_size) if cache == "paged" else None)
    history, feed = list(ids), list(ids)
    for step in range(max_new_tokens):
        t0 = time.perf_counter()
        ref = model.forward([feed], c_cpu)[0]
        t1 = time.perf_counter()
        got = rt.asnumpy(gpu.forward([feed], c_gpu)[0])
        rt.synchronize()
        t2 = time.perf_counter()
        if got.shape != ref.shape or got.dtype != np.float32:
            raise AssertionError(f"GPU logits {got.shape} {got.dtype} vs NumPy {ref.shape} {ref.dtype}")
        res = StepResult(step=step, kind="prefill" if step == 0 else "decode", tokens=len(feed),
                         **judge_step(ref, got, tol, numpy_s=t1 - t0, gpu_s=t2 - t1))
        result.steps.append(res)
        if on_step is not None:
            on_step(res)
        history.append(res.token_numpy)
        feed = list(history) if cache == "none" else [res.token_numpy]
    return result
