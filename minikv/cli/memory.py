"""``minikv memory``: KV-cache and weight memory, FLOPs with and without a cache (pure arithmetic).

The command owns the mapping from its flags to ``minikv.costs`` field and
argument names (``SHAPE_FLAGS``, ``RUN_FLAGS``); the formulas know only the names.
"""

from __future__ import annotations

import argparse
import re

from minikv.cli import plan
from minikv.cli.common import print_json
from minikv.errors import ConfigError, MinikvError

# flag dest -> ModelShape field, for describing a model by hand (or overriding a preset's field)
SHAPE_FLAGS = {
    "layers": "num_layers", "kv_heads": "num_kv_heads", "head_dim": "head_dim", "hidden": "hidden_size",
    "heads": "num_heads", "intermediate": "intermediate_size", "vocab": "vocab_size",
    "kv_lora_rank": "kv_lora_rank", "rope_dim": "rope_dim", "q_lora_rank": "q_lora_rank",
    "v_head_dim": "v_head_dim",
}
# flag dest -> memory_report argument, where the two names differ or a message may name the argument
RUN_FLAGS = {"batch": "batch", "prompt_len": "prompt_len", "output_len": "output_len", "dtype": "dtype",
             "weights_dtype": "weights_dtype", "group_size": "group_size", "scale_bytes": "scale_bytes",
             "mlp": "mlp", "tied": "tie_embeddings"}


def flag_of(name: str) -> str:
    """The ``minikv memory`` flag that sets field or argument ``name`` (``name`` itself if none does)."""
    for dest, field in {**SHAPE_FLAGS, **RUN_FLAGS}.items():
        if field == name:
            return "--" + dest.replace("_", "-")
    return name


def _naming_flags(e: MinikvError) -> MinikvError:
    """``e`` again, its message followed by the flags of the fields it names."""
    names = [n for n in {**SHAPE_FLAGS, **RUN_FLAGS}.values() if re.search(rf"\b{n}\b", str(e))]
    if not names:
        return e
    return type(e)(f"{e} (set by {', '.join(dict.fromkeys(flag_of(n) for n in names))})")


def add_memory(sub) -> None:
    from minikv.costs import DTYPE_BITS, KV_DTYPE_COSTS, MLP_KINDS, PRESETS
    from minikv.costs.hybrid import HYBRID_PRESETS

    p = sub.add_parser("memory", help="KV-cache and weight memory; FLOPs per token with and without cache",
                       description="Memory and FLOPs of a model preset or of a shape given by flags "
                                   "(flags given with --preset override its fields). Sizes are printed in "
                                   "decimal GB (1e9 bytes) and binary GiB (2^30 bytes).")
    p.add_argument("--preset", choices=sorted({**PRESETS, **HYBRID_PRESETS}),
                   help="a model whose shape and source minikv knows")
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
    p.add_argument("--kv-dtype", choices=list(KV_DTYPE_COSTS), default=None,
                   help="also size the cache in a minikv.quant format (scales included, per K and V)")
    p.add_argument("--group", type=int, default=32, help="values per scale of --kv-dtype kivi*/fp8* (default 32)")
    g = p.add_argument_group("shape (instead of, or on top of, --preset)")
    for flag, field in SHAPE_FLAGS.items():
        g.add_argument("--" + flag.replace("_", "-"), type=int, default=None, dest=flag,
                       help=f"ModelShape.{field}")
    g.add_argument("--mlp", choices=MLP_KINDS, default=None, help="MLP kind (default swiglu)")
    g.add_argument("--tied", action=argparse.BooleanOptionalAction, default=None,
                   help="output head tied to the embedding")
    p.add_argument("--json", action="store_true", help="also print one JSON line last (kv_cache_bytes, ...)")
    plan.add_plan_flags(p)  # --model PATH: the capacity planner (minikv/cli/plan.py); --block-size
    p.set_defaults(func=_run_memory)


def _hybrid(args) -> tuple:
    """(shape, per-layer windows) of a hybrid ``--preset``; (None, None) otherwise (``--model``: the planner)."""
    from minikv.costs.hybrid import HYBRID_PRESETS

    return HYBRID_PRESETS.get(args.preset, (None, None))


def _shape(args, base=None):
    """The ModelShape the flags describe: a preset (or ``base``, a model's), with fields overridden, or a custom one."""
    from minikv.costs import ModelShape, get_preset

    fields = {field: getattr(args, flag) for flag, field in SHAPE_FLAGS.items() if getattr(args, flag) is not None}
    if args.mlp is not None:
        fields["mlp"] = args.mlp
    if args.tied is not None:
        fields["tie_embeddings"] = args.tied
    if args.preset or base is not None:
        shape = base if base is not None else get_preset(args.preset)
        if fields:
            shape = shape.replace(name=f"{shape.name} (modified: {', '.join(sorted(fields))})", source="",
                                  published_params=None, **fields)
        return shape
    if "num_layers" not in fields:
        raise ConfigError("give --preset NAME (see --list-presets) or at least --layers with --kv-heads and "
                          "--head-dim (or --kv-lora-rank and --rope-dim for MLA)")
    return ModelShape(name="custom", **fields)


def _run_memory(args) -> int:
    from minikv.costs import PRESETS, memory_report, render_report

    if args.model is not None:  # the capacity planner: minikv/cli/plan.py
        return plan.run_plan(args)
    if args.list_presets:  # one list: --preset takes the shapes, --model (the planner) every name
        from minikv.costs.hybrid import HYBRID_PRESETS
        from minikv.costs.planner import PLANS

        for name, shape in {**PRESETS, **{k: v[0] for k, v in HYBRID_PRESETS.items()}}.items():
            print(f"{name:16s} {shape.attention_kind}  {shape.source}")
        for name, kv in PLANS.items():
            if name not in PRESETS:
                print(f"{name:16s} KV only (--model, not --preset)  {kv.source}")
        return 0
    try:
        base, windows = _hybrid(args)
        shape = _shape(args, base)
        rep = memory_report(shape, args.batch, args.prompt_len, args.output_len, args.dtype, args.weights_dtype,
                            args.group_size, args.scale_bytes)
    except MinikvError as e:
        raise _naming_flags(e) from e
    print(render_report(rep, shape, field_label=flag_of))
    if windows is not None and any(w is not None for w in windows):
        rep["hybrid"] = _hybrid_lines(shape, windows, args, rep["tokens_per_sequence"])
    if args.kv_dtype is not None:
        rep.update(_kv_dtype_lines(shape, args, rep["tokens_per_sequence"] * args.batch))
    if args.json:
        print_json(rep)
    return 0


def _hybrid_lines(shape, windows, args, tokens: int) -> dict:
    """Print a hybrid model's bytes per layer type against all-full (``minikv.costs.hybrid``); its JSON."""
    from minikv.costs.hybrid import hybrid_kv_bytes, render_hybrid

    rep = hybrid_kv_bytes(shape, windows, tokens, args.dtype, args.batch, block_size=args.block_size)
    print(render_hybrid(rep))
    return rep


def _kv_dtype_lines(shape, args, tokens: int) -> dict:
    """Print the --kv-dtype formula per side; its JSON keys."""
    from minikv.costs import kv_bytes_per_token, kv_dtype_bytes_per_token, kv_dtype_sides

    try:
        per_token = kv_dtype_bytes_per_token(shape, args.kv_dtype, args.group)
    except MinikvError as e:
        raise type(e)(f"{e} (set by --kv-dtype)") from e
    parts = []
    for side, (dtype, group, scale) in zip("KV", kv_dtype_sides(args.kv_dtype, args.group)):
        half = kv_bytes_per_token(shape, dtype, group, scale) // 2
        how = f"{dtype}" if group is None else f"{dtype} + a {scale}-byte scale per {group} values"
        parts.append(f"{side}: {shape.num_layers} x {shape.num_kv_heads} x {shape.head_dim} values as {how} "
                     f"= {half:,} B")
    print(f"--kv-dtype {args.kv_dtype} (group {args.group}): {'; '.join(parts)}; {per_token:,} bytes per token, "
          f"{per_token * tokens:,} bytes for {tokens:,} tokens")
    return {"kv_dtype": args.kv_dtype, "kv_dtype_group": args.group, "kv_dtype_bytes_per_token": per_token,
            "kv_dtype_cache_bytes": per_token * tokens}
