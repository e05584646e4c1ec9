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
    add_eviction_flags,
    add_kv_dtype_flags,
    add_model_flag,
    check_cache_fits,
    check_ids,
    eviction_options,
    load_model_arg,
    parse_ids,
    print_json,
    progress,
    read_input_file,
    require_tokenizer,
    resolve_cache,
)
from minikv.cli.parallel import add_parallel_flags, guard, is_parallel, json_fields, perplexity_factory, runner_of
from minikv.cli.text import cache_help
from minikv.errors import InvalidInputError, check_int
from minikv.generate import CACHE_KINDS, cache_memory_bytes


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
    p.add_argument("--cache", choices=list(CACHE_KINDS), default=None,
                   help="(default: contiguous; paged with a quantized --kv-dtype) " + cache_help())
    p.add_argument("--block-size", type=int, default=16, help="tokens per block for --cache paged")
    add_kv_dtype_flags(p)
    add_eviction_flags(p)
    p.add_argument("--json", action="store_true",
                   help="print one JSON line last with tokens, mean_nll, ppl, ...; with a quantized --kv-dtype or an "
                        "eviction --cache also kld_vs_exact, top1_vs_exact, delta_ppl against the exact cache")
    p.add_argument("--nll-file", metavar="FILE", default=None,
                   help="with a lossy cache: write the per-position NLL of both runs to FILE as JSON")
    add_model_flag(p)
    add_parallel_flags(p)
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
        ids = tok.encode(args.text) if args.max_tokens is None else _encode_head(args, tok)
    if args.max_tokens is not None:
        ids = ids[: args.max_tokens]
    _check_counts(len(ids), args, where)
    check_ids(ids, model.config.vocab_size, where)
    context = model.config.max_position
    if len(ids) - 1 > context:
        raise InvalidInputError(f"{where} gives {len(ids)} tokens, past the model's context of max_position="
                                f"{context}; use --max-tokens {context + 1} or fewer")
    return ids, where


# tokens encoded past --max-tokens before the cut: a cut at a line end can change only the last few tokens
_CUT_MARGIN = 64


def _encode_head(args, tok) -> list[int]:
    """The first --max-tokens ids of --text-file, reading and encoding only a head of the file: it grows
    fourfold (from 16 bytes per token) until its ids pass --max-tokens by a margin or the file ends. The
    head ends at a line end, so its ids are those of the whole file up to the margin."""
    need, limit = args.max_tokens + _CUT_MARGIN, 16 * (args.max_tokens + _CUT_MARGIN)
    while True:
        text, complete = read_input_file(args.text_file, "--text-file", limit=limit)
        ids = tok.encode(text)
        if complete or len(ids) >= need:
            return ids[: args.max_tokens]
        limit *= 4


def _lossy_factory(args, model):
    """``factory(model, max_len)`` of the --kv-dtype or eviction cache, or None for an exact one; options the
    model's shape refuses are refused here, before any run (ConfigError)."""
    from minikv.generate import make_cache

    if not _lossy(args):
        return None

    def factory(m, n):
        return make_cache(args.cache, m, max_len=n, block_size=args.block_size, kv_dtype=args.kv_dtype,
                          group=args.group, residual=args.residual, eviction=args.eviction)

    factory(model, 1)
    return factory


def _lossy(args) -> bool:
    """The run's cache loses information: a quantized --kv-dtype or an evicting --cache."""
    return args.kv_dtype not in (None, "fp32") or args.eviction is not None


def _exact_cache(args) -> str | None:
    """The lossless cache kind a --kv-dtype or evicting run is compared with (None: no comparison, which
    includes a --tp/--cp run): the plain --cache, or contiguous beside an evicting one."""
    if not _lossy(args) or args.tp is not None or args.cp is not None:
        return None
    return "contiguous" if args.eviction is not None else args.cache


def _measure(model, ids, args, factory, bar) -> dict:
    """The run: ``perplexity``, or with a quantized --kv-dtype ``perplexity_vs_exact`` against the plain cache."""
    from minikv.perplexity import perplexity, perplexity_vs_exact

    made = None
    if is_parallel(model):  # the rank's caches; no comparison with the exact run (that is one process's)
        rank_factory, made = perplexity_factory(args, model)
        res = perplexity(model, ids, cache=args.cache, prefill=args.prefill, block_size=args.block_size,
                         cache_factory=rank_factory, progress=bar.update)
        res.update(json_fields(model, model.cache_bytes_per_rank(made[-1])))
    elif factory is None:
        res = perplexity(model, ids, cache=args.cache, prefill=args.prefill, block_size=args.block_size,
                         progress=bar.update)
    else:
        res = perplexity_vs_exact(model, ids, factory, prefill=args.prefill, exact_cache=_exact_cache(args),
                                  block_size=args.block_size, label=args.cache, progress=bar.update,
                                  curve=args.nll_file is not None)
    quantized = args.kv_dtype not in (None, "fp32")
    out = {**res, "kv_dtype": args.kv_dtype or "fp32", "group": args.group if quantized else None,
           "residual": args.residual if quantized and args.kv_dtype.startswith("kivi") else None}
    if args.eviction is not None:
        out["eviction"] = (made[-1] if made else factory(model, 1)).policy.describe()
    return out


def _policy_words(res: dict) -> str:
    ev = res.get("eviction")
    return "" if ev is None else "; " + ", ".join(f"{k} {v}" for k, v in ev.items() if k != "policy")


def _run_perplexity(args) -> int:
    # the input is read and checked before the model loads
    args.cache = resolve_cache(args)
    args.eviction = eviction_options(args)
    if args.nll_file is not None:
        _check_out_path(args.nll_file)
        if not _lossy(args):
            raise InvalidInputError("--nll-file compares a lossy cache with the exact run: add --kv-dtype or "
                                    "--cache window|h2o|snapkv")
    ids = None
    if args.ids_file is not None:
        ids = parse_ids(read_input_file(args.ids_file, "--ids-file"), f"--ids-file={args.ids_file!r}")
        _check_counts(len(ids[: args.max_tokens]), args, f"--ids-file={args.ids_file!r}")
    else:  # with --max-tokens only a head is read here, to check it; _encode_head reads what it needs
        if args.max_tokens is None:
            args.text = read_input_file(args.text_file, "--text-file")
        else:
            read_input_file(args.text_file, "--text-file", limit=16 * (args.max_tokens + _CUT_MARGIN))
    model, tok = load_model_arg(args.model)
    ids, where = _eval_ids(args, model, tok, ids)
    length = f"the tokens fed from {where.split('=')[0]}, cut by --max-tokens"
    beside, exact = 0, _exact_cache(args)
    if exact is not None:  # the lossless run goes in lockstep with the lossy one: both caches are held at once
        check_cache_fits(args, model, len(ids) - 1, length, cache=exact)
        beside = cache_memory_bytes(exact, model, len(ids) - 1, block_size=args.block_size)
    check_cache_fits(args, model, len(ids) - 1, length, eviction=args.eviction, beside=beside)
    factory = _lossy_factory(args, model)
    runner = runner_of(args, model)  # --tp/--cp: this rank's share (minikv.parallel)
    with progress(len(ids) - 1, f"perplexity ({args.cache})") as bar, guard(runner):
        res = _measure(runner, ids, args, factory, bar)
    print(f"{where}: {res['tokens']} tokens, {res['scored_tokens']} scored through the {args.cache} cache "
          f"(kv_dtype {res['kv_dtype']}{_policy_words(res)}, prefill {res['prefill']}): "
          f"mean NLL {res['mean_nll']:.4f} nats, "
          f"perplexity {res['ppl']:.3f}; {res['cache_bytes_per_token']:,} cache bytes per token; "
          f"{res['elapsed_s']:.2f} s ({res['tokens_per_s']:.1f} tokens/s)")
    if "kld_vs_exact" in res:
        print(f"against the plain {args.cache} cache: KL {res['kld_vs_exact']:.3e} nats per token, top-1 agreement "
              f"{res['top1_vs_exact']:.4f}, perplexity {res['delta_ppl']:+.3%} ({res['ppl_exact']:.3f} exact)")
    if args.nll_file is not None:
        _write_curve(args.nll_file, res.pop("nll_curve"), res)
    if args.json:
        print_json(res)
    return 0


def _check_out_path(path: str) -> None:
    """Refuse an --nll-file that cannot be written, before the long run (not after it): a directory, a
    missing folder, something that is no regular file (a FIFO, /dev/full), or a path that cannot be opened
    for writing (a read-only place such as /proc). A file the check creates is removed again."""
    import os
    import stat

    where = f"--nll-file={path!r}"
    if not path or os.path.isdir(path) or not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise InvalidInputError(f"{where} is not a writable file path (a directory, or its folder does not "
                                "exist); give a file name such as nll.json")
    existed = os.path.lexists(path)
    if existed and not stat.S_ISREG(os.stat(path).st_mode):
        raise InvalidInputError(f"{where} exists and is not a regular file; give a file name such as nll.json")
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NONBLOCK, 0o644))
    except OSError as e:
        raise InvalidInputError(f"{where} cannot be written ({e.strerror or e}); pick a writable path") from e
    if not existed:
        os.remove(path)


def _write_curve(path: str, curve: dict, res: dict) -> None:
    """The per-position NLL of both runs as JSON (position t predicts token t + 1)."""
    import json

    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"cache": res["cache"], "eviction": res.get("eviction"), "kv_dtype": res["kv_dtype"],
                       "prefill": res["prefill"], "nll_exact": curve["exact"], "nll": curve["lossy"]}, f)
    except OSError as e:
        raise InvalidInputError(f"--nll-file={path!r} cannot be written ({e.strerror}); pick a writable path") from e
