"""Gemma-3-270M's hybrid KV cache against the same model sized all-full, side by side in one process (step 9).

"All-full" is what an engine that sizes every layer as a full-attention layer holds (vLLM with
``disable_hybrid_kv_cache_manager``): every layer keeps every token, and the sliding layers still attend
over their window only, so both sides compute the same logits and must emit the same tokens. In minikv it
is the hybrid cache built with a rollback K as long as the run (``rollback=max_len``): the rings and the
sliding groups then never give a slot or a block back.

Three measurements:

1. **Decode** on the real model (float32, greedy) after a prompt of the reference text longer than the
   window: decode tokens/s and cache bytes per token (``bytes_used / tokens``) for the contiguous and
   the paged layout, hybrid and all-full in alternating rounds (the order rotates), medians and the
   median of the per-round ratios.
2. **Concurrency at one memory budget**: ``minikv.bench.hybrid.hybrid_batching_benchmark`` (what
   ``minikv bench batching --model gemma3`` runs) with Gemma-3-270M's cache geometry (18 layers, 15
   sliding over 512, one KV head of 256) on small random weights; the same pool for both sides.
3. **Prefix hits on a multi-turn trace** (``minikv.bench.offload.ChatTrace``: conversations whose
   shared system prompt alone is longer than the window) through the scheduler on a hybrid paged
   cache, with the sliding-group rule (a hit needs the window's blocks only) and with step 6's rule
   (a sequence's blocks stop being shareable at its first eviction).

Results on a 2-core shared machine are noisy: read the ratios (the load average is recorded).

    python benchmarks/hybrid.py [--prompt-len 1536] [--new-tokens 24] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np

from minikv.bench.corpus import reference_tokens
from minikv.bench.hybrid import geometry_model, hybrid_batching_benchmark, longest_request_bytes
from minikv.bench.machine import describe, machine_info, write_result
from minikv.bench.offload import ChatTrace, run_trace
from minikv.bench.workloads import Workload
from minikv.hybrid import hybrid_cache
from minikv.scheduler import Scheduler
from minikv.weights.gemma import find_gemma_file
from minikv.weights.gguf import load_model

ROOT = Path(__file__).resolve().parents[1]


def cache_of(model, layout: str, side: str, max_len: int):
    """The hybrid cache of ``layout``; ``side`` "all_full" keeps every token in every layer (K = max_len)."""
    c = model.config
    return hybrid_cache(layout, c.layer_windows, c.num_kv_heads, c.head_dim, max_len, block_size=16,
                        rollback=max_len if side == "all_full" else 0)


def decode_run(model, ids: list[int], n: int, layout: str, side: str) -> dict:
    """Prefill ``ids``, then ``n`` greedy single-token steps; decode tokens/s, bytes per token, the tokens."""
    cache = cache_of(model, layout, side, len(ids) + n)
    cache.add_sequence(0)
    logits = model.forward([ids], cache)
    out, t0 = [int(np.argmax(logits[0]))], time.perf_counter()
    for _ in range(n - 1):
        out.append(int(np.argmax(model.forward([out[-1:]], cache)[0])))
    wall = time.perf_counter() - t0
    tokens = cache.length(0)
    return {"decode_tokens_per_s": (n - 1) / wall, "bytes_used": cache.bytes_used(), "tokens": tokens,
            "bytes_per_token": cache.bytes_used() / tokens, "token_ids": out}


def bench_decode(model, ids: list[int], n: int, rounds: int) -> dict:
    """Hybrid and all-full in alternating rounds, per layout."""
    res = {}
    for layout in ("contiguous", "paged"):
        sides, runs, ratio, last = ("hybrid", "all_full"), {"hybrid": [], "all_full": []}, [], {}
        for r in range(rounds):
            for side in sides[r % 2:] + sides[:r % 2]:
                last[side] = decode_run(model, ids, n, layout, side)
                runs[side].append(last[side]["decode_tokens_per_s"])
            ratio.append(runs["hybrid"][-1] / runs["all_full"][-1])
        res[layout] = {side: {"decode_tokens_per_s": statistics.median(runs[side]), "runs": runs[side],
                              **{k: last[side][k] for k in ("bytes_used", "tokens", "bytes_per_token")}}
                       for side in sides}
        res[layout].update(speed_ratio=statistics.median(ratio), speed_ratio_runs=ratio,
                           bytes_ratio=last["all_full"]["bytes_used"] / last["hybrid"]["bytes_used"],
                           identical_tokens=last["hybrid"]["token_ids"] == last["all_full"]["token_ids"])
        print(f"decode, {layout}: hybrid {res[layout]['hybrid']['decode_tokens_per_s']:.2f} tok/s, "
              f"{res[layout]['hybrid']['bytes_per_token']:,.0f} B/token; all-full "
              f"{res[layout]['all_full']['decode_tokens_per_s']:.2f} tok/s, "
              f"{res[layout]['all_full']['bytes_per_token']:,.0f} B/token; speed ratio "
              f"{res[layout]['speed_ratio']:.2f}x, memory {res[layout]['bytes_ratio']:.2f}x less; identical tokens "
              f"{res[layout]['identical_tokens']}")
    return res


def bench_concurrency(config, requests: int, budget_factor: float) -> dict:
    """The batching benchmark at a budget of ``budget_factor`` x what the longest request may hold."""
    wl = Workload(num_requests=requests)
    model = geometry_model(config, wl.vocab_size)
    budget = int(budget_factor * longest_request_bytes(model, wl, 16))
    res = hybrid_batching_benchmark(model, wl, budget, 16)
    print(f"concurrency at {budget / 2**20:.1f} MiB: hybrid max {res['hybrid']['max_concurrency']} "
          f"(mean {res['hybrid']['mean_concurrency']:.2f}), all-full max {res['all_full']['max_concurrency']} "
          f"(mean {res['all_full']['mean_concurrency']:.2f}); {res['concurrency_ratio']:.2f}x max, "
          f"{res['mean_concurrency_ratio']:.2f}x mean; preemptions {res['hybrid']['preemptions']} vs "
          f"{res['all_full']['preemptions']}; identical outputs {res['identical_outputs']}")
    return res


def bench_prefix(config, trace: ChatTrace, num_blocks: int) -> dict:
    """Prefix hit rate of the trace through the scheduler, with and without the sliding-group rule."""
    model = geometry_model(config, trace.vocab_size)
    c, res, outs = model.config, {}, {}
    for rule in (True, False):
        cache = hybrid_cache("paged", c.layer_windows, c.num_kv_heads, c.head_dim, block_size=16,
                             num_blocks=num_blocks, sliding_rule=rule)
        sched = Scheduler(model, cache)
        outs[rule] = run_trace(trace, sched)
        st = sched.stats
        res["sliding_rule" if rule else "step6_rule"] = {
            "prefix_hit_rate": st.prefix_hit_rate, "prefix_hit_tokens": st.prefix_hit_tokens,
            "prompt_tokens": st.prompt_tokens, "preemptions": st.preemptions, "steps": st.steps}
    res.update(identical_outputs=outs[True] == outs[False], num_blocks=num_blocks,
               trace={k: getattr(trace, k) for k in ("conversations", "turns", "system_len", "user_len",
                                                     "reply_len", "system_prompts")})
    print(f"prefix hits on the trace: sliding-group rule {res['sliding_rule']['prefix_hit_rate']:.1%}, "
          f"step 6's rule {res['step6_rule']['prefix_hit_rate']:.1%}; identical outputs {res['identical_outputs']}")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=1536, help="prompt tokens of the reference text")
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=24, help="concurrency: requests of the workload")
    ap.add_argument("--budget-factor", type=float, default=3.0, help="concurrency: pool / longest request")
    ap.add_argument("--conversations", type=int, default=12, help="prefix: conversations of the trace")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "hybrid.json"))
    args = ap.parse_args(argv)
    info = machine_info()
    print(describe(info))
    model, tok = load_model(find_gemma_file())
    payload = {"benchmark": "hybrid", "model": "gemma-3-270m-q4_k_m.gguf (float32)", "machine": info,
               "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
               "load_average_1min": {"before": os.getloadavg()[0]}, "prompt_tokens": args.prompt_len,
               "new_tokens": args.new_tokens, "rounds": args.rounds}

    def stage(name: str, result: dict) -> None:  # the JSON after every stage: a slow machine keeps what it measured
        payload[name] = result
        payload["load_average_1min"]["after"] = os.getloadavg()[0]
        write_result(args.out, payload)

    stage("decode", bench_decode(model, reference_tokens(tok, args.prompt_len), args.new_tokens, args.rounds))
    stage("concurrency", bench_concurrency(model.config, args.requests, args.budget_factor))
    trace = ChatTrace(conversations=args.conversations, turns=4, system_prompts=2, system_len=600,
                      user_len=(16, 48), reply_len=16, vocab_size=256)
    stage("prefix", bench_prefix(model.config, trace, num_blocks=6 * 3 * (trace.max_len() // 16 + 2)))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
