"""``minikv bench NAME``: synthetic benchmarks. ``BENCHES`` maps a name to its run function."""

from __future__ import annotations

from minikv.cli.common import CACHE_FLAGS, print_json, progress
from minikv.errors import CacheFullError, InvalidInputError


def _check_budget(args, budget: int, bytes_per_token: int, max_len: int) -> None:
    """Refuse (naming the flags) a budget too small for one longest request, or larger than the machine has."""
    from minikv.paged.allocator import num_blocks_for

    block = bytes_per_token * args.block_size
    need = num_blocks_for(max_len, args.block_size)  # what the contiguous side reserves per sequence
    if budget // block < need:
        raise InvalidInputError(f"--kv-budget-mib={args.kv_budget_mib:g} holds {budget // block} blocks of "
                                f"--block-size={args.block_size} but one sequence of the workload may need {need} "
                                f"({max_len} tokens at {bytes_per_token} bytes each); use --kv-budget-mib >= "
                                f"{need * block / 2**20:g} or a smaller --block-size")
    # the paged and the contiguous pools may overlap for a moment; swap adds a host pool as large
    _check_budget_memory(args, budget, pools=3 if args.preemption == "swap" else 2)


def _check_budget_memory(args, budget: int, pools: int) -> None:
    """Refuse (naming --kv-budget-mib) ``pools`` pools of ``budget`` bytes that the memory available cannot hold."""
    from minikv.errors import available_memory_bytes

    have = available_memory_bytes()
    if have is not None and pools * budget > have:
        raise InvalidInputError(f"--kv-budget-mib={args.kv_budget_mib:g} needs {pools} x {budget:,} bytes but "
                                f"only {have:,} are available; lower --kv-budget-mib")


def _bench_batching(args) -> int:
    from minikv.bench.machine import describe, machine_info
    from minikv.bench.workloads import Workload, batching_benchmark, bench_model, format_benchmark
    from minikv.generate import bytes_per_token

    workload = Workload(num_requests=args.requests, seed=args.seed)
    if args.model is not None:  # step 9: a hybrid model's cache against itself sized all-full
        return _bench_hybrid(args, workload)
    model = bench_model(workload)
    budget = int(args.kv_budget_mib * 2**20)
    per_token = bytes_per_token(model.new_cache_args(), model.dtype)
    _check_budget(args, budget, per_token, workload.max_len)
    # both sides (paged, contiguous) generate every request's max_new_tokens: no EOS in the workload
    total = 2 * sum(r.max_new_tokens for r in workload.requests())
    try:
        with progress(total, "bench batching") as bar:
            res = batching_benchmark(workload, kv_budget_bytes=budget, block_size=args.block_size,
                                     preemption=args.preemption, model=model, progress=bar.update)
    except CacheFullError as e:
        raise CacheFullError(f"--kv-budget-mib={args.kv_budget_mib:g} is too small for this workload: {e}") from e
    print(format_benchmark(res))
    print(describe(machine_info()))
    if args.json:
        print_json(res)
    return 0


def _bench_hybrid(args, workload) -> int:
    """``bench batching --model``: the hybrid paged cache of ``--model``'s geometry against all-full, one budget."""
    from minikv.bench.hybrid import (
        format_hybrid_batching,
        geometry_model,
        hybrid_batching_benchmark,
        longest_request_bytes,
    )
    from minikv.bench.machine import describe, machine_info
    from minikv.cli.common import load_model_arg
    from minikv.generate import bytes_per_token

    model = geometry_model(load_model_arg(args.model)[0].config, workload.vocab_size, seed=args.seed)
    budget = int(args.kv_budget_mib * 2**20)
    _check_budget_memory(args, budget, pools=2)  # the hybrid side's pool and the all-full side's overlap a moment
    # a block of every layer: the all-full side needs at least that much per request, so a smaller budget cannot
    # hold the longest request anyway; refused here, before longest_request_bytes builds a block to measure it
    block = bytes_per_token(model.new_cache_args(), model.dtype) * args.block_size
    if block > budget:
        raise InvalidInputError(f"--block-size={args.block_size:,}: a block of every layer's K and V takes {block:,} "
                                f"bytes, more than --kv-budget-mib={args.kv_budget_mib:g} ({budget:,} bytes); use a "
                                "smaller --block-size or a larger --kv-budget-mib")
    need = longest_request_bytes(model, workload, args.block_size)
    if budget < need:
        raise InvalidInputError(f"--kv-budget-mib={args.kv_budget_mib:g} cannot hold the workload's longest request "
                                f"({workload.max_len} tokens in every group of this model's cache); use "
                                f"--kv-budget-mib >= {need / 2**20:.1f}")
    with progress(2 * sum(r.max_new_tokens for r in workload.requests()), "bench batching") as bar:
        res = hybrid_batching_benchmark(model, workload, budget, args.block_size, progress=bar.update)
    print(f"--model {args.model}: its cache geometry (layers {list(model.config.layer_windows)} as windows, "
          f"{model.config.num_kv_heads} KV heads of {model.config.head_dim}) on random weights")
    print(format_hybrid_batching(res))
    print(describe(machine_info()))
    if args.json:
        print_json(res)
    return 0


def _bench_offload(args) -> int:
    from minikv.bench.machine import describe, machine_info
    from minikv.bench.offload import ChatTrace, format_offload, offload_benchmark
    from minikv.errors import check_int
    from minikv.paged.allocator import num_blocks_for

    trace = ChatTrace(conversations=check_int("--conversations", args.conversations, error=InvalidInputError),
                      seed=args.seed)
    need = num_blocks_for(trace.max_len(), args.block_size)
    check_int("--device-blocks", args.device_blocks, minimum=need, error=InvalidInputError,
              hint=f"the trace's longest request ({trace.max_len()} tokens) needs {need} blocks of --block-size")
    check_int("--host-blocks", args.host_blocks, error=InvalidInputError, hint="the tier needs a host pool")
    res = offload_benchmark(trace, device_blocks=args.device_blocks, host_blocks=args.host_blocks,
                            block_size=args.block_size, link=args.link,
                            names={**CACHE_FLAGS, "num_blocks": "--device-blocks",
                                   "num_host_blocks": "--host-blocks"})
    print(format_offload(res))
    print(describe(machine_info()))
    if args.json:
        print_json(res)
    return 0


# name -> run(args); add a benchmark by adding an entry
BENCHES = {"batching": _bench_batching, "offload": _bench_offload}


def add_bench(sub) -> None:
    from minikv.scheduler import PREEMPTION_MODES
    from minikv.tiers.tier import LINKS

    p = sub.add_parser("bench", help="synthetic benchmarks (batching: paged vs contiguous KV memory; "
                                     "offload: a host tier for paged blocks)",
                       description="batching: continuous batching of a synthetic workload (lognormal lengths, "
                                   "shared system prompt) on a tiny random model, paged vs a contiguous "
                                   "cache reserving max length, at the same KV budget in bytes. offload: a "
                                   "multi-turn chat trace on a small device pool, alone and with a host tier "
                                   "per policy (lru, arc, seen_twice); transfers priced by a link model.")
    p.add_argument("name", choices=sorted(BENCHES), help="which benchmark")
    p.add_argument("--requests", type=int, default=160, help="requests in the workload (default 160)")
    p.add_argument("--kv-budget-mib", type=float, default=4.0, help="KV memory budget in MiB (default 4)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    p.add_argument("--preemption", choices=PREEMPTION_MODES, default="recompute")
    p.add_argument("--seed", type=int, default=0, help="workload and model seed")
    p.add_argument("--conversations", type=int, default=24, help="offload: conversations in the trace (default 24)")
    p.add_argument("--device-blocks", type=int, default=48, help="offload: device pool blocks (default 48)")
    p.add_argument("--host-blocks", type=int, default=64, help="offload: host tier blocks (default 64)")
    p.add_argument("--link", choices=sorted(LINKS), default="pcie5", help="offload: host link (default pcie5)")
    p.add_argument("--json", action="store_true", help="print one JSON line last (batching: paged, contiguous, "
                   "ratios; offload: policies, device_only, outputs_identical)")
    p.add_argument("--model", metavar="PATH", default=None,
                   help="batching: a hybrid model (a GGUF file, or gemma3): its hybrid paged cache against itself "
                        "sized all-full, on random weights of its cache geometry, at --kv-budget-mib")
    p.set_defaults(func=lambda args: BENCHES[args.name](args))
