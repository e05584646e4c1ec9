"""Tensor-parallel decode of SmolLM2 over MPI ranks on this machine: tokens/s and bytes moved per token.

For tp in (1, 3) this launches ``mpiexec -n tp python benchmarks/parallel.py --rank-run ...`` (runs
alternate tp = 1, 3, 1, 3, ...; each rank loads the GGUF, one BLAS thread per rank). A run
prefills a fixed prompt and decodes G tokens greedily through a contiguous cache
(``minikv.parallel.tensor.generate``); it records the median decode step, the greedy tokens and, from the
collective trace of each decode step, the bytes every rank hands to the collectives (the payload:
2 L + 1 all-reduces of [1, H] and one all-gather of [1, V]) and what a ring moves per rank
(2 (p - 1) / p of an all-reduce's payload, (p - 1) / p of an all-gather's).

Caveat: this machine has 2 cores, so the 3 ranks of tp = 3 share them (and MPICH's shared-memory
transport busy-polls while a rank waits): the tokens/s here show the cost of the collectives and of
oversubscription, not the speed-up of one rank per GPU, where each rank streams 1/tp of the weights.

    python benchmarks/parallel.py [--new-tokens 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "benchmarks" / "results" / "parallel.json"
PROMPT = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"


def rank_run(tp: int, new_tokens: int, out: str) -> None:
    """One mpiexec run: every rank decodes; rank 0 writes the timings and the per-token bytes."""
    from minikv.parallel import ParallelModel
    from minikv.weights.gguf import load_model

    model, tok = load_model()
    pm = ParallelModel(model, tp=tp)
    del model
    ids = tok.encode(PROMPT)
    kv = pm.make_cache("contiguous", len(ids) + new_tokens)
    kv.add_sequence(0)
    logits = pm.forward([ids], kv)[0]
    steps, tokens, moved = [], [], []
    for _ in range(new_tokens):
        tokens.append(int(logits.argmax()))
        t0 = time.perf_counter()
        logits = pm.forward([[tokens[-1]]], kv)[0]
        steps.append(time.perf_counter() - t0)
        moved.append((sum(c.bytes for c in pm.trace), sum(c.wire_bytes for c in pm.trace), len(pm.trace)))
    bytes_per_rank = pm.cache_bytes_per_rank(kv)
    if pm.world.rank == 0:
        payload, wire, count = moved[-1]
        Path(out).write_text(json.dumps({
            "tp": tp, "decode_step_s": statistics.median(steps), "tokens": tokens,
            "collectives_per_token": count, "payload_bytes_per_token": payload,
            "ring_bytes_per_rank_per_token": wire, "cache_bytes_per_rank": bytes_per_rank,
            "prompt_tokens": len(ids), **pm.describe()}))


def launch(tp: int, new_tokens: int) -> dict:
    mpiexec = Path(sys.executable).with_name("mpiexec")
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        subprocess.run([str(mpiexec), "-launcher", "fork", "-n", str(tp), sys.executable, __file__, "--rank-run",
                        str(tp), "--new-tokens", str(new_tokens), "--out", str(out)], check=True, env=env,
                       timeout=900)
        return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rank-run", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_run is not None:
        return rank_run(args.rank_run, args.new_tokens, args.out)
    from minikv.bench.machine import describe, machine_info, write_result

    runs, load = {1: [], 3: []}, os.getloadavg()[0]
    for _ in range(args.rounds):
        for tp in runs:  # alternating, so both see the same machine
            runs[tp].append(launch(tp, args.new_tokens))
    results = {}
    for tp, rs in runs.items():
        step = statistics.median(r["decode_step_s"] for r in rs)
        last = rs[-1]
        results[f"tp{tp}"] = {
            "decode_tokens_per_s": 1.0 / step, "decode_step_s_runs": [r["decode_step_s"] for r in rs],
            "collectives_per_token": last["collectives_per_token"],
            "payload_bytes_per_token": last["payload_bytes_per_token"],
            "ring_bytes_per_rank_per_token": last["ring_bytes_per_rank_per_token"],
            "cache_bytes_per_rank": last["cache_bytes_per_rank"], "imbalance": last["imbalance"]["attention"]}
    same = all(r["tokens"] == runs[1][0]["tokens"] for rs in runs.values() for r in rs)
    info = machine_info(("numpy", "mpi4py", "mpich"))
    payload = {
        "benchmark": "parallel", "model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to float32)",
        "cache": "contiguous", "prompt_tokens": runs[1][0]["prompt_tokens"], "new_tokens": args.new_tokens,
        "rounds": args.rounds, "blas_threads_per_rank": 1,
        "method": "mpiexec -n tp on this machine (-launcher fork, shared memory), runs alternating tp 1, 3; per run "
                  "the median decode step; reported: the median over runs; bytes from the collective trace of a "
                  "decode step",
        "caveat": f"this machine has {info['cores']} cores: the 3 ranks of tp=3 share them, so tokens/s measures "
                  "the collectives and oversubscription, not the speed-up of one rank per GPU; other jobs share "
                  "the cores too (load average at the start and the end below), so the runs scatter",
        "load_average_1min": {"start": load, "end": os.getloadavg()[0]},
        "greedy_tokens_identical": same, "results": results, "machine": info}
    path = write_result(OUT, payload)
    for tp, r in results.items():
        print(f"{tp}: {r['decode_tokens_per_s']:.1f} tokens/s, {r['collectives_per_token']} collectives and "
              f"{r['payload_bytes_per_token']:,} payload bytes per token ({r['ring_bytes_per_rank_per_token']:,.0f} "
              f"on a ring per rank)")
    print(f"greedy tokens identical: {same}\n{describe(info)}\nwrote {path}")


if __name__ == "__main__":
    main()
