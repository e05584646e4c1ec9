"""``minikv perplexity``: teacher-forced next-token NLL of a text through a KV cache.

    minikv perplexity --text-file notes.txt --max-tokens 256 --cache paged --json
    minikv perplexity --model ckpt/ --ids-file ids.txt --prefill 16

The library function is ``minikv.perplexity.perplexity``; this command reads the
input, checks every flag against it before the model loads where it can, and
prints the result (one JSON line last with ``--json``). The lossy steps add their
flags here (a codec, a window) and their metrics there (KL against the exact run).
"""

from __future__ import annotations

from minikv.cli.common import (
    add_model_flag,
    check_ids,
    load_model_arg,
    parse_ids,
    print_json,
    progress,
    read_input_file,
    require_tokenizer,
)
from minikv.cli.text import cache_help
from minikv.errors import InvalidInputError, check_int
from minikv.generate import CACHE_KINDS


def add_perplexity(sub) -> None:
    p = sub.add_parser("perplexity", help="teacher-forced next-token NLL and perplexity of a text through a cache",
                       description="Feeds the text's first --prefill tokens in one pass, then the rest one token at "
                                   "a time, so every token attends over the cached history; reports the mean "
                                   "negative log-likelihood of each next token and its exp (perplexity).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text-file", metavar="FILE", help="UTF-8 text, encoded with the model's tokenizer")
    src.add_argument("--ids-file", metavar="FILE",
                     help="token ids separated by commas and/or whitespace (for a model without a tokenizer)")
    p.add_argument("--max-tokens", type=int, default=None, help="evaluate only the first N tokens (default: all)")
    p.add_argument("--prefill", type=int, default=1,
                   help="tokens fed in the first pass (default 1: every later token is decoded through the cache)")
    p.add_argument("--cache", choices=list(CACHE_KINDS), default="contiguous", help=cache_help())
    p.add_argument("--block-size", type=int, default=16, help="tokens per block for --cache paged")
    p.add_argument("--json", action="store_true", help="print one JSON line last with tokens, mean_nll, ppl, ...")
    add_model_flag(p)
    p.set_defaults(func=_run_perplexity)


def _check_counts(n: int, args, where: str) -> None:
    """Refuse too few tokens for the run, or a --prefill that leaves nothing to decode past the text."""
    if n < 2:
        raise InvalidInputError(f"{where} has {n} token(s); a perplexity needs at least 2 (each token is scored "
                                "by the ones before it)")
    check_int("--prefill", args.prefill, minimum=1, maximum=n - 1, error=InvalidInputError,
              hint=f"{where} gives {n} tokens, so the first pass can feed 1 to {n - 1} of them (the last "
                   "token is only a target)")


def _eval_ids(args, model, tok, ids) -> tuple[list[int], str]:
    """The token ids to evaluate, cut to --max-tokens and checked against the model; and their source."""
    where = f"--ids-file={args.ids_file!r}" if args.ids_file is not None else f"--text-file={args.text_file!r}"
    if ids is None:  # a text file: encoded now that the tokenizer is known
        require_tokenizer(tok, "--text-file", "--ids-file FILE (token ids) instead")
        ids = tok.encode(args.text)
    if args.max_tokens is not None:
        ids = ids[: args.max_tokens]
    _check_counts(len(ids), args, where)
    check_ids(ids, model.config.vocab_size, where)
    context = model.config.max_position
    if len(ids) - 1 > context:
        raise InvalidInputError(f"{where} gives {len(ids)} tokens, past the model's context of max_position="
                                f"{context}; use --max-tokens {context + 1} or fewer")
    return ids, where


def _run_perplexity(args) -> int:
    from minikv.perplexity import perplexity

    # the input is read and checked before the model loads
    ids = None
    if args.ids_file is not None:
        ids = parse_ids(read_input_file(args.ids_file, "--ids-file"), f"--ids-file={args.ids_file!r}")
        _check_counts(len(ids[: args.max_tokens]), args, f"--ids-file={args.ids_file!r}")
    else:
        args.text = read_input_file(args.text_file, "--text-file")
    model, tok = load_model_arg(args.model)
    ids, where = _eval_ids(args, model, tok, ids)
    with progress(len(ids) - 1, f"perplexity ({args.cache})") as bar:
        res = perplexity(model, ids, cache=args.cache, prefill=args.prefill, block_size=args.block_size,
                         progress=bar.update)
    print(f"{where}: {res['tokens']} tokens, {res['scored_tokens']} scored through the {args.cache} cache "
          f"(prefill {res['prefill']}): mean NLL {res['mean_nll']:.4f} nats, perplexity {res['ppl']:.3f}; "
          f"{res['cache_bytes_per_token']:,} cache bytes per token; {res['elapsed_s']:.2f} s "
          f"({res['tokens_per_s']:.1f} tokens/s)")
    if args.json:
        print_json(res)
    return 0
