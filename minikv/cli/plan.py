"""``minikv memory --model PATH``: the KV capacity planner (``minikv.costs.planner``) as a command.

PATH is a Hugging Face directory, a bare config.json, a GGUF file or a preset name (``minikv.costs.planner
.preset_names``: the planner's ``PLANS`` and every ``--preset``; ``minikv memory --list-presets`` lists them).
It prints the KV bytes per token of each layer type at the KV dtype, what one sequence of ``--context`` tokens
holds (per layer, and if every layer were sized full), and the two capacity answers under ``--kv-budget``: the
most sequences at ``--context``, the longest context at ``--sequences``. ``--json`` prints the same as one line.
"""

from __future__ import annotations

import os

from minikv.cli.common import print_json


def add_plan_flags(p) -> None:
    from minikv.costs.planner import KV_ITEMSIZE

    g = p.add_argument_group("capacity planner (with --model)")
    g.add_argument("--model", default=None,
                   help="HF directory, config.json, GGUF file or preset (--list-presets): plan its KV")
    g.add_argument("--kv", choices=sorted(KV_ITEMSIZE), default="bf16", help="KV dtype for --model (default bf16)")
    g.add_argument("--block-size", type=int, default=16,
                   help="tokens per block (default 16): the planner's rounding, a hybrid --preset's paged numbers")
    g.add_argument("--context", type=int, default=None, help="tokens per sequence (default: the model's maximum)")
    g.add_argument("--kv-budget", type=float, default=80.0, help="KV memory budget in GB (1e9 bytes; default 80)")
    g.add_argument("--sequences", type=int, default=1, help="concurrency N for the longest-context answer")


def run_plan(args) -> int:
    from minikv.costs.planner import KV_ITEMSIZE, plan_from_path
    from minikv.errors import MinikvError, check_int

    try:
        path = args.model
        if path == "gemma3" and not os.path.exists(path):  # the installed package's file, as --model gemma3 elsewhere
            from minikv.weights.gemma import find_gemma_file

            path = str(find_gemma_file())
        plan = plan_from_path(path)
    except MinikvError as e:  # one line naming the flag that gave the path
        raise type(e)(f"--model {args.model}: {e}") from e
    size, bs = KV_ITEMSIZE[args.kv], check_int("--block-size", args.block_size)
    ctx = plan.max_position if args.context is None else check_int("--context", args.context)
    budget, n = int(args.kv_budget * 1e9), check_int("--sequences", args.sequences)
    per_layer, full = plan.bytes_per_sequence(ctx, size, bs), plan.bytes_per_sequence(ctx, size, bs, all_full=True)
    rep = {"model": plan.name, "source": plan.source, "kv_dtype": args.kv, "block_size": bs, "context": ctx,
           "layers": {k: {"count": c, "bytes_per_token": b} for k, (c, b) in plan.by_type(size).items()},
           "bytes_per_sequence": per_layer, "bytes_per_sequence_all_full": full,
           "waste_of_all_full": plan.waste_of_all_full(ctx, bs), "budget_bytes": budget,
           "max_sequences": plan.max_sequences(budget, ctx, size, bs), "sequences": n,
           "max_context": plan.max_context(budget, n, size, bs)}
    print(f"{plan.name}: KV per token at {args.kv}" + (f"  ({plan.source})" if plan.source else ""))
    for kind, v in rep["layers"].items():
        print(f"  {v['count']:3d} x {kind:14s} {v['bytes_per_token']:>9,} B per token per layer")
    print(f"one sequence of {ctx:,} tokens (blocks of {bs}): {per_layer:,} B sized per layer; every layer sized full: "
          f"{full:,} B (all-full sizing wastes {rep['waste_of_all_full']:.2%})")
    print(f"budget {budget:,} B: at most {rep['max_sequences']:,} sequences of {ctx:,} tokens; "
          f"{n} sequence(s) reach {rep['max_context']:,} tokens (model maximum {plan.max_position:,})")
    if args.json:
        print_json(rep)
    return 0
