"""``minikv compare``: the NumPy path and the GPU path (CuPy or the simulator), token by token.

The one place the ``minikv`` command reaches into ``minikv_gpu``: imported
lazily, so ``minikv`` itself never depends on the GPU wing.
"""

from __future__ import annotations

from minikv.cli.common import (
    add_model_flag,
    add_prompt_flags,
    check_cache_fits,
    check_ids,
    load_model_arg,
    print_json,
)
from minikv.cli.text import cache_help, prompt_ids_of
from minikv.generate import CACHE_KINDS


def add_compare(sub) -> None:
    p = sub.add_parser("compare", help="run the NumPy path and the GPU path (CuPy or simulator) token by token")
    add_prompt_flags(p)
    p.add_argument("--max-new-tokens", type=int, default=8, help="steps to compare, the prefill included")
    p.add_argument("--backend", choices=["cupy", "sim"], default=None,
                   help="GPU path: CuPy or the CPU simulator (default: $MINIKV_GPU_BACKEND, else CuPy if usable)")
    p.add_argument("--cache", choices=[k for k, spec in CACHE_KINDS.items() if not spec.evicts], default="contiguous",
                   help=cache_help())
    p.add_argument("--block-size", type=int, default=16, help="tokens per block for --cache paged")
    p.add_argument("--cache-dtype", choices=["float32", "float16"], default="float32",
                   help="what both caches store (attention computes in float32 either way)")
    p.add_argument("--fused", action="store_true", help="decode with the fused RoPE + cache-write + attention kernel")
    p.add_argument("--random", action="store_true",
                   help="SmolLM2-135M's shapes with random weights (no GGUF file needed; --prompt's UTF-8 bytes "
                        "as ids, or --prompt-ids)")
    p.add_argument("--seed", type=int, default=0, help="weights seed for --random")
    p.add_argument("--tol", type=float, default=None,
                   help="exit 1 if max |Δlogit| exceeds this or tokens differ (default 1e-3; 1e-2 with a float16 "
                        "cache, whose rounding turns last-bit differences into float16 ulps)")
    p.add_argument("--json", action="store_true", help="print one JSON line last with the summary")
    add_model_flag(p)
    p.set_defaults(func=_run_compare)


def _model_and_ids(args):
    """(model, prompt ids, label), refusing a run past the model's context before it is built or loaded."""
    from minikv.errors import ConfigError
    from minikv.generate import check_context
    from minikv_gpu.compare import SMOLLM2_SHAPES, smollm2_random

    if args.random:
        if args.model:
            raise ConfigError("give either --model PATH or --random, not both")
        if args.prompt_ids is not None:
            ids = check_ids(args.prompt_ids, SMOLLM2_SHAPES["vocab_size"], "--prompt-ids")
        else:
            ids = list(args.prompt.encode("utf-8"))  # byte values are valid ids of any vocab >= 256
        check_context(SMOLLM2_SHAPES["max_position"], len(ids), args.max_new_tokens, name="--max-new-tokens")
        return smollm2_random(args.seed), ids, f"SmolLM2-135M shapes, random weights (seed {args.seed})"
    model, tok = load_model_arg(args.model)
    ids = prompt_ids_of(args, model, tok, chat=False)
    check_context(model.config.max_position, len(ids), args.max_new_tokens, name="--max-new-tokens")
    label = ("SmolLM2-135M" if args.model is None else args.model) + " (GGUF)"
    return model, ids, label if tok is not None else f"checkpoint {args.model}"


def _run_compare(args) -> int:
    from minikv_gpu import runtime
    from minikv_gpu.compare import DEFAULT_TOL, compare

    rt = runtime.get_runtime(args.backend)  # first: a machine that cannot run CuPy says why in one line, at once
    model, ids, label = _model_and_ids(args)
    check_cache_fits(args, model, len(ids) + args.max_new_tokens, "prompt + --max-new-tokens", dtype=args.cache_dtype)
    paged = f", block size {args.block_size}" if args.cache == "paged" else ""
    print(f"{label}; prompt {len(ids)} tokens; GPU path: {rt.name}, cache {args.cache} ({args.cache_dtype}{paged})"
          f"{', fused decode kernel' if args.fused else ''}")
    print(f"{'step':>4} {'kind':>7} {'tokens':>6} {'max|Δlogit|':>12} {'numpy':>7} {'gpu':>7}  agree "
          f"{'numpy ms':>9} {'gpu ms':>9}")

    def show(s):
        agree = "yes" if s.agree else "tie" if s.tie else "NO "
        print(f"{s.step:>4} {s.kind:>7} {s.tokens:>6} {s.max_abs_logit_diff:>12.3e} {s.token_numpy:>7} "
              f"{s.token_gpu:>7}  {agree:>5} {1e3 * s.numpy_s:>9.1f} {1e3 * s.gpu_s:>9.1f}", flush=True)

    tol = DEFAULT_TOL[args.cache_dtype] if args.tol is None else args.tol
    res = compare(model, ids, args.max_new_tokens, backend=rt.name, cache=args.cache, cache_dtype=args.cache_dtype,
                  fused=args.fused, on_step=show, block_size=args.block_size, tol=tol)
    ok = res.tokens_agree and res.max_abs_logit_diff <= tol
    ties = (f" ({len(res.ties)} a near tie: steps {res.ties}, where the GPU's token is within the tolerance of "
            f"NumPy's top logit)") if res.ties else ""
    print(f"max |Δlogit| {res.max_abs_logit_diff:.3e} over {len(res.steps)} steps (tolerance {tol:g}); "
          f"greedy tokens {'agree' if res.tokens_agree else 'DIFFER'}{ties}")
    if args.json:
        print_json({**res.summary(), "prompt_ids": [int(t) for t in ids]})
    return 0 if ok else 1
