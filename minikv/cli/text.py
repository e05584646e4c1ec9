"""``minikv generate`` and ``minikv demo``: text from SmolLM2, with and without a KV cache."""

from __future__ import annotations

import sys

from minikv.cli.common import (
    add_eviction_flags,
    add_kv_dtype_flags,
    add_model_flag,
    add_prompt_flags,
    check_cache_fits,
    check_ids,
    eviction_options,
    load_model_arg,
    print_json,
    progress,
    require_tokenizer,
    resolve_cache,
)
from minikv.cli.parallel import add_parallel_flags, guard, json_fields, runner_of
from minikv.errors import InvalidInputError
from minikv.generate import CACHE_KINDS, EVICTION_KINDS
from minikv.speculative import SPECULATIVE_KINDS


def cache_help() -> str:
    """The ``--cache`` help, from the registry's descriptions."""
    return "; ".join(f"{name} = {kind.description}" for name, kind in CACHE_KINDS.items())


def generate_streaming(model, tok, prompt_ids, max_new_tokens: int, bar: str | None = None, **kwargs):
    """``minikv.generate.generate``, printing the text; returns the GenerationResult.

    Without ``bar`` the text streams to stdout token by token. With ``bar`` (its
    label) a progress bar counts the tokens on stderr and the text is printed
    when the run is done, so the two never interleave on a terminal.
    """
    from minikv.generate import generate

    generate = getattr(model, "generate", generate)  # a ParallelModel (--tp/--cp) brings its own loop
    printer = tok.stream_decoder(skip_special_tokens=True) if tok is not None else _IdPrinter()
    if bar is None:
        res = generate(model, prompt_ids, max_new_tokens,
                       on_token=lambda t: print(printer.push(t), end="", flush=True), **kwargs)
        print(printer.flush())
        return res
    pieces = []
    with progress(max_new_tokens, bar) as ticks:
        def on_token(t):
            pieces.append(printer.push(t))
            ticks.update(1)

        res = generate(model, prompt_ids, max_new_tokens, on_token=on_token, **kwargs)
    print("".join(pieces) + printer.flush())
    return res


class _IdPrinter:
    """What streams to stdout when the model has no tokenizer (a checkpoint): the token ids."""

    def push(self, token: int) -> str:
        return f" {token}"

    def flush(self) -> str:
        return ""


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    """The prompt's ids; with ``chat`` in the chat template, the prompt's text kept as text (``encode_chat``)."""
    if chat:
        return tokenizer.encode_chat([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return tokenizer.encode(prompt)


def prompt_ids_of(args, model, tok, chat: bool) -> list[int]:
    """The prompt's token ids: ``--prompt-ids`` checked against the vocabulary, or ``--prompt`` encoded
    (in the chat template if ``chat``)."""
    if args.prompt_ids is not None:
        return check_ids(args.prompt_ids, model.config.vocab_size, "--prompt-ids")
    require_tokenizer(tok, "--prompt", "--prompt-ids 1,2,3 (token ids) instead")
    ids = encode_prompt(tok, args.prompt, chat)
    if not ids:  # refused before the prompt is echoed or anything runs
        raise InvalidInputError(f"--prompt={args.prompt[:40]!r} encodes to no tokens with this model's tokenizer "
                                "(only characters its vocabulary lacks); give text it can encode, or --prompt-ids")
    return ids


def cache_bytes_per_token(model, cache: str, block_size: int, **quant) -> float:
    """``bytes_per_token()`` of the cache ``generate`` builds for ``model``: a 1-token cache of that kind
    (``quant``: kv_dtype, group, residual; a quantized one counts its full blocks)."""
    from minikv.generate import make_cache

    bpt = make_cache(cache, model, max_len=1, block_size=block_size, **quant).bytes_per_token()
    return int(bpt) if float(bpt).is_integer() else float(bpt)


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text with SmolLM2, with or without a KV cache")
    add_prompt_flags(p)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's ChatML chat template")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--greedy", action="store_true", help="argmax decoding (ignores temperature/top-k/top-p)")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", choices=list(CACHE_KINDS), default=None,
                   help="(default: contiguous; paged with a quantized --kv-dtype) " + cache_help())
    p.add_argument("--block-size", type=int, default=16, help="tokens per block for --cache paged")
    add_kv_dtype_flags(p)
    add_eviction_flags(p)
    p.add_argument("--speculative", choices=list(SPECULATIVE_KINDS), default=None,
                   help="ngram = draft tokens by prompt lookup, verify them in one pass, roll the cache back "
                        "(needs --greedy; also runs plain greedy once to report the speed-up)")
    p.add_argument("--draft-len", type=int, default=4, help="draft tokens per pass for --speculative (K)")
    p.add_argument("--json", action="store_true", help="print one JSON line last with ids, text and timings")
    add_model_flag(p)
    add_parallel_flags(p)
    p.set_defaults(func=_run_generate)


def _run_generate(args) -> int:
    from minikv.generate import SamplingParams, check_context

    sampling = SamplingParams(greedy=args.greedy, temperature=args.temperature, top_k=args.top_k,
                              top_p=args.top_p, seed=args.seed)
    if args.speculative is not None and not args.greedy:  # refused before the model loads
        raise InvalidInputError("--speculative accepts drafts greedily (argmax); add --greedy")
    if args.speculative is not None and (args.tp is not None or args.cp is not None):
        raise InvalidInputError("--speculative runs in one process (its rollback is per cache); drop --tp/--cp "
                                "or --speculative")
    if args.speculative is not None and args.cache in EVICTION_KINDS:  # refused before the model loads
        raise InvalidInputError(f"--speculative rolls rejected drafts back, and --cache {args.cache} evicts tokens "
                                "a rollback would need; use --cache contiguous or paged with --speculative")
    if args.chat and args.prompt_ids is not None:  # refused before the model loads
        raise InvalidInputError("--chat wraps --prompt text in the chat template; with --prompt-ids give the "
                                "ids of the whole templated prompt and drop --chat")
    args.cache = resolve_cache(args)
    quant = dict(kv_dtype=args.kv_dtype, group=args.group, residual=args.residual, eviction=eviction_options(args))
    model, tok = load_model_arg(args.model)
    prompt_ids = prompt_ids_of(args, model, tok, args.chat)
    if (quant["eviction"] or {}).get("positions") != "in-cache":  # in-cache positions run past the context
        check_context(model.config.max_position, len(prompt_ids), args.max_new_tokens, name="--max-new-tokens")
    check_cache_fits(args, model, len(prompt_ids) + args.max_new_tokens, "prompt + --max-new-tokens",
                     eviction=quant["eviction"])
    policy = _policy_of(model, args, quant)
    runner = runner_of(args, model)  # --tp/--cp: this rank's share (minikv.parallel); refused before any output
    if not args.chat:
        echo = args.prompt if args.prompt_ids is None else (
            tok.decode(prompt_ids) if tok is not None else " ".join(map(str, prompt_ids)))
        print(echo, end="", flush=True)
    spec = {} if args.speculative is None else dict(speculative=args.speculative, draft_len=args.draft_len)
    with guard(runner):
        res = generate_streaming(runner, tok, prompt_ids, args.max_new_tokens, cache=args.cache, sampling=sampling,
                                 block_size=args.block_size, **quant, **spec)
    label = args.cache if args.kv_dtype is None else f"{args.cache}, kv_dtype {args.kv_dtype}"
    if policy is not None:
        label += ", " + ", ".join(f"{k} {v}" for k, v in policy.items() if k != "policy")
    print(f"[{label} cache] prompt {len(prompt_ids)} tokens, prefill {res.prefill_s:.3f} s, "
          f"decode {res.decode_tokens_per_s:.1f} tokens/s, {len(res.token_ids)} new tokens ({res.finish_reason})",
          file=sys.stderr)
    spec_report = {} if not spec else _speculative_report(model, prompt_ids, args, res, quant)
    if args.json:
        print_json({"prompt_ids": res.prompt_ids, "token_ids": res.token_ids,
                    "text": None if tok is None else tok.decode(res.token_ids, skip_special_tokens=True),
                    "prefill_s": res.prefill_s, "decode_tokens_per_s": res.decode_tokens_per_s,
                    "cache": args.cache, "finish_reason": res.finish_reason,
                    "kv_dtype": args.kv_dtype or "fp32",
                    "cache_bytes_per_token": cache_bytes_per_token(model, args.cache, args.block_size, **quant),
                    **({"eviction": policy} if policy is not None else {}), **spec_report,
                    **json_fields(runner, getattr(runner, "cache_bytes", None))})
    return 0


def _speculative_report(model, prompt_ids, args, res, quant: dict) -> dict:
    """Run plain greedy decoding once more on the same cache and print what speculation did (stderr);
    returns the fields ``--json`` adds."""
    from minikv.generate import GREEDY, generate

    plain = generate(model, prompt_ids, args.max_new_tokens, cache=args.cache, sampling=GREEDY,
                     block_size=args.block_size, **quant)
    st = res.speculative
    speedup = res.decode_tokens_per_s / plain.decode_tokens_per_s
    same = plain.token_ids == res.token_ids
    print(f"[speculative {args.speculative}, K={args.draft_len}] acceptance {st.acceptance_rate:.0%} "
          f"({st.accepted} of {st.drafted} draft tokens), {st.tokens_per_step:.2f} tokens per pass; plain greedy "
          f"decode {plain.decode_tokens_per_s:.1f} tokens/s: speed-up {speedup:.2f}x; identical tokens: {same}",
          file=sys.stderr)
    return {"speculative": args.speculative, "draft_len": args.draft_len,
            "acceptance_rate": st.acceptance_rate if st.drafted else None, "draft_tokens": st.drafted,
            "accepted_tokens": st.accepted, "verify_steps": st.steps,
            "tokens_per_step": st.tokens_per_step, "plain_decode_tokens_per_s": plain.decode_tokens_per_s,
            "speedup": speedup, "identical_to_plain": same}


def _policy_of(model, args, quant: dict) -> dict | None:
    """The eviction policy's description (positions contract included), built once to refuse bad options
    before generating; None for a cache that keeps every token."""
    from minikv.generate import make_cache

    if quant["eviction"] is None:
        return None
    return make_cache(args.cache, model, max_len=1, block_size=args.block_size, **quant).policy.describe()


def add_demo(sub) -> None:
    p = sub.add_parser("demo", help="generate with SmolLM2 (or --model) twice, without and with the KV cache; "
                                          "compare speeds")
    add_prompt_flags(p, default="Explain in one paragraph why the sky is blue.")
    p.add_argument("--max-new-tokens", type=int, default=64)
    add_model_flag(p)
    p.set_defaults(func=_run_demo)


def _run_demo(args) -> int:
    from minikv.bench.machine import describe, machine_info
    from minikv.generate import GREEDY, check_context

    model, tok = load_model_arg(args.model)
    # ids are fed as given; so is text to a base model without a chat template (Gemma-3-270M)
    chat = args.prompt_ids is None and getattr(tok, "chat_template", None) is not None
    prompt_ids = prompt_ids_of(args, model, tok, chat)
    check_context(model.config.max_position, len(prompt_ids), args.max_new_tokens, name="--max-new-tokens")
    check_cache_fits(args, model, len(prompt_ids) + args.max_new_tokens, "prompt + --max-new-tokens",
                     cache="contiguous")
    name = ("SmolLM2-135M" if args.model is None else args.model) if tok is not None else f"checkpoint {args.model}"
    print(f"{name}, greedy, prompt of {len(prompt_ids)} tokens{' (chat template)' if chat else ''}, "
          f"up to {args.max_new_tokens} new tokens\n")
    runs = {}
    for cache in ("none", "contiguous"):
        label = "without KV cache (recompute everything)" if cache == "none" else "with contiguous KV cache"
        print(f"--- {label}")
        # the uncached run is the slow one (about a minute on a busy machine): it gets a progress bar
        res = generate_streaming(model, tok, prompt_ids, args.max_new_tokens, cache=cache, sampling=GREEDY,
                                 bar="no cache" if cache == "none" else None)
        total = res.prefill_s + res.decode_s
        print(f"    {len(res.token_ids)} tokens in {total:.2f} s: prefill {res.prefill_s:.3f} s, "
              f"decode {res.decode_tokens_per_s:.1f} tokens/s\n")
        runs[cache] = res
    same = runs["none"].token_ids == runs["contiguous"].token_ids
    ratio = runs["contiguous"].decode_tokens_per_s / runs["none"].decode_tokens_per_s
    print(f"decode speed-up from the cache: {ratio:.1f}x  (identical tokens: {same})")
    print(describe(machine_info()))
    return 0 if same else 1
