"""The host offload tier on a multi-turn chat trace: hit rate, bytes moved, stall time, concurrency per policy.

The same code as ``minikv bench offload`` (``minikv.bench.offload.offload_benchmark``): 24
conversations of 4 turns sharing 3 system prompts on a tiny float64 random model, a 48-block
device pool alone (``device_only``) and with a 64-block host tier per policy (lru, arc,
seen_twice), every output checked against an unlimited device pool. Block traffic is priced as
Llama-3-8B fp16 blocks on an H100 SXM (see that module's docstring for the compute-time bound).
Everything here is deterministic (no wall-clock numbers).

Besides the default run (PCIe 5.0 x16) it records the same trace on every link preset, on a
16-block device pool (the tier moves the most), and a long-prompt trace (``LONG``: 512-token system
prompts, 64-192-token user turns, 1024-token steps), where recomputing a prefix is compute-bound.

    python benchmarks/offload.py [--out benchmarks/results/offload.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from minikv.bench.machine import describe, machine_info, write_result
from minikv.bench.offload import ChatTrace, format_offload, offload_benchmark
from minikv.tiers import LINKS

ROOT = Path(__file__).resolve().parents[1]
PRICED = ("stall_s", "hidden_s", "compute_s")
LONG = dict(trace=ChatTrace(conversations=12, system_len=512, user_len=(64, 192)), device_blocks=96, host_blocks=128,
            max_step_tokens=1024)
KEPT = ("trace", "device_blocks", "host_blocks", "max_step_tokens", "policies", "device_only", "outputs_identical")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/offload.json"))
    args = ap.parse_args(argv)

    res = offload_benchmark(ChatTrace())
    print(format_offload(res))
    res["by_link"] = {}
    for link in LINKS:
        r = offload_benchmark(ChatTrace(), link=link)
        res["by_link"][link] = {name: {k: side[k] for k in PRICED} for name, side in r["policies"].items()}
    small = offload_benchmark(ChatTrace(), device_blocks=16)
    long = offload_benchmark(**LONG)
    for name, r in (("small_device_pool", small), ("long_prompts", long)):
        print(format_offload(r))
        res[name] = {k: r[k] for k in KEPT}
    res["machine"] = machine_info()
    print(describe(res["machine"]))
    print(f"wrote {write_result(args.out, res)}")
    return 0 if all(r["outputs_identical"] for r in (res, small, long)) else 1


if __name__ == "__main__":
    sys.exit(main())
