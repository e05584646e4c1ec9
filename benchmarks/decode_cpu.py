"""SmolLM2-135M decode speed on the CPU: minikv vs transformers, with and without the KV cache.

Both load the same GGUF (dequantized to float32) and run in this one process,
in alternating rounds so that both see the same machine state. For each
context length (default 256 and 1024 tokens of real text):

* cached:   prefill ``ctx`` tokens, then time single-token decode steps
            (median over rounds; the first step of every round is a warm-up);
* generate(): the same decode through each library's own generation API
            (``minikv.generate.generate`` and transformers' ``model.generate``,
            greedy), timed from the arrival of the streamed tokens;
* uncached: time one full forward pass over ``ctx`` tokens, which is what every
            token costs when K/V are recomputed (the step-1 baseline).

It also measures the machine's read bandwidth (a float32 matrix-vector product
over a 512 MB matrix, i.e. one streaming read) and reports each cached decode
time against the floor ``weight bytes read per token / bandwidth``.

    python benchmarks/decode_cpu.py [--ctx 256 1024] [--rounds 7] [--threads N] [--out PATH]

``--threads N`` runs both libraries on N threads (NumPy's OpenBLAS and torch's intra-op pool); the default
leaves each library its own default. On a machine shared with other jobs, a pool of two threads on two busy
cores stalls in its barriers (a causal 256-token attention took 5-8x longer on 2 threads than on 1 under a
load average of 10), so a comparison there is fairer on ``--threads 1`` (the bandwidth floor is then measured
on one thread too); the quiet-machine run keeps the default.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from decode_profile import set_blas_threads

from minikv.bench.corpus import reference_tokens
from minikv.bench.machine import describe, machine_info, write_result
from minikv.generate import generate
from minikv.kv_cache import ContiguousKVCache, NoCache
from minikv.weights.gguf import find_model_file, load_model

ROOT = Path(__file__).resolve().parents[1]


def read_bandwidth_gbs(mbytes: int = 512, repeats: int = 7) -> float:
    """GB/s of one streaming read: y = W x with W float32 [rows, 1024] of ``mbytes``."""
    w = np.random.default_rng(0).random((mbytes * 2**20 // 4096, 1024), dtype=np.float32)
    x = np.ones(1024, dtype=np.float32)
    w @ x  # warm-up: threads started, pages touched
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        w @ x
        times.append(time.perf_counter() - t)
    return w.nbytes / statistics.median(times) / 1e9


def matmul_ms_per_token(model, repeats: int = 15) -> float:
    """Median ms of one decode step's matrix products alone (same weights, same calls as
    ``Model.forward`` with one token): the part of a step that streams the weights."""
    h = model.config.hidden_size
    x = np.ones((1, h), dtype=np.float32)
    y = np.ones((1, model.config.intermediate_size), dtype=np.float32)
    a = np.ones((1, model.config.num_heads * model.config.head_dim), dtype=np.float32)

    def step():
        for lw in model._layers:
            x @ lw.wqkv_t.T
            a @ lw.wo_t.T
            x @ lw.w_gate_up_t.T
            y @ lw.w_down_t.T
        x @ model.lm_head.T

    step()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def weight_bytes_per_token(model) -> int:
    """Bytes of weights one decode step must read: every layer matrix and norm, the LM head,
    and one embedding row."""
    layer = sum(a.nbytes for lw in model.weights.layers for a in vars(lw).values() if a is not None)
    return layer + model.lm_head.nbytes + model.final_norm.nbytes + model.embed[0].nbytes


class MinikvRunner:
    name = "minikv"

    def __init__(self, model):
        self.model = model

    def prefill(self, ids):
        self.cache = ContiguousKVCache(**self.model.new_cache_args(), max_seqs=1, max_len=len(ids) + 64)
        self.cache.add_sequence(0)
        return self.model.forward([ids], self.cache)[0]

    def decode(self, tok):
        return self.model.forward([[tok]], self.cache)[0]

    def full_forward(self, ids):
        return self.model.forward([ids], NoCache(**self.model.new_cache_args()))[0]

    def generate(self, ids, n: int, on_token) -> None:
        generate(self.model, ids, n, eos_token_id=-1, on_token=on_token)


class TransformersRunner:
    name = "transformers"

    def __init__(self, path: Path):
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging

        logging.set_verbosity_error()
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                          dtype=torch.float32).eval()

    def prefill(self, ids):
        from transformers import DynamicCache

        self.cache = DynamicCache()
        with self.torch.inference_mode():
            out = self.model(self.torch.tensor([ids]), cache=self.cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].numpy()

    def decode(self, tok):
        with self.torch.inference_mode():
            out = self.model(self.torch.tensor([[tok]]), cache=self.cache, use_cache=True)
        return out.logits[0, -1].numpy()

    def full_forward(self, ids):
        with self.torch.inference_mode():
            return self.model(self.torch.tensor([ids]), use_cache=False, logits_to_keep=1).logits[0, -1].numpy()

    def generate(self, ids, n: int, on_token) -> None:
        class Streamer:  # transformers calls put() with the prompt first, then with each new token
            def __init__(self):
                self.prompt_seen = False

            def put(self, value):
                if self.prompt_seen:
                    on_token(int(value.reshape(-1)[0]))
                self.prompt_seen = True

            def end(self):
                pass

        with self.torch.inference_mode():
            self.model.generate(self.torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                streamer=Streamer())


def time_decode(runner, ids, steps: int) -> list[float]:
    """Prefill ``ids``, then time ``steps`` greedy decode steps (the first one untimed)."""
    tok = int(np.argmax(runner.prefill(ids)))
    times = []
    for i in range(steps + 1):
        t = time.perf_counter()
        tok = int(np.argmax(runner.decode(tok)))
        if i:
            times.append(time.perf_counter() - t)
    return times


def time_generate(runner, ids, n: int) -> float:
    """Seconds per token of the library's own generation loop (greedy, ``n`` new tokens), from the
    arrival times of the streamed tokens after the first (which comes from the prefill)."""
    stamps = []
    runner.generate(ids, n, lambda tok: stamps.append(time.perf_counter()))
    assert len(stamps) == n, (runner.name, len(stamps))
    return (stamps[-1] - stamps[0]) / (n - 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--rounds", type=int, default=7, help="alternating rounds per context length")
    ap.add_argument("--steps", type=int, default=8, help="timed decode steps per round")
    ap.add_argument("--settle", type=float, default=0.5, help="seconds of idle before each engine's round")
    ap.add_argument("--threads", type=int, default=None, help="BLAS and torch threads for both (default: theirs)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "decode_cpu.json"))
    args = ap.parse_args(argv)

    if args.threads is not None:  # before the bandwidth is measured: the floor is then that of N threads
        set_blas_threads(args.threads)
    path = find_model_file(args.model)
    model, tok = load_model(path)
    ids_all = reference_tokens(tok, max(args.ctx))
    bw = read_bandwidth_gbs()  # measured before torch is loaded: no other thread pool around
    mm_ms = matmul_ms_per_token(model)
    wbytes = weight_bytes_per_token(model)
    floor_s = wbytes / (bw * 1e9)
    print(f"read bandwidth {bw:.1f} GB/s; weights read per token {wbytes / 1e6:.0f} MB "
          f"-> floor {floor_s * 1e3:.1f} ms/token ({1 / floor_s:.0f} tokens/s)")
    print(f"minikv's matrix products alone: {mm_ms:.1f} ms/token ({wbytes / mm_ms / 1e6:.1f} GB/s)")
    runners = [MinikvRunner(model), TransformersRunner(path)]
    if args.threads is not None:
        runners[1].torch.set_num_threads(args.threads)

    results = []
    for ctx in args.ctx:
        ids = ids_all[:ctx]
        cached = {r.name: [] for r in runners}
        uncached = {r.name: [] for r in runners}
        api = {r.name: [] for r in runners}
        for _ in range(args.rounds):
            for r in runners:  # alternate, so both sides see the same machine state
                # Let the other library's worker threads (OpenBLAS, OpenMP) finish spinning and
                # sleep first: on 2 cores a spinning idle pool steals a core and slows the next
                # timed run by 1.2-5x (measured with back-to-back alternation in one process).
                time.sleep(args.settle)
                cached[r.name] += time_decode(r, ids, args.steps)
                api[r.name].append(time_generate(r, ids, args.steps + 1))
                t = time.perf_counter()
                r.full_forward(ids)
                uncached[r.name].append(time.perf_counter() - t)
        row = {"ctx": ctx}
        for r in runners:
            c, u = statistics.median(cached[r.name]), statistics.median(uncached[r.name])
            g = statistics.median(api[r.name])
            row[r.name] = {"cached_tokens_per_s": 1 / c, "uncached_tokens_per_s": 1 / u,
                           "generate_api_tokens_per_s": 1 / g,
                           "cache_speedup": u / c, "share_of_bandwidth_floor": floor_s / c,
                           "cached_ms_per_token": c * 1e3, "uncached_ms_per_token": u * 1e3}
        row["minikv_over_transformers_cached"] = (row["minikv"]["cached_tokens_per_s"]
                                                  / row["transformers"]["cached_tokens_per_s"])
        row["minikv_over_transformers_uncached"] = (row["minikv"]["uncached_tokens_per_s"]
                                                    / row["transformers"]["uncached_tokens_per_s"])
        row["minikv_over_transformers_generate_api"] = (row["minikv"]["generate_api_tokens_per_s"]
                                                        / row["transformers"]["generate_api_tokens_per_s"])
        results.append(row)

    print(f"\n{'ctx':>5} {'engine':>13} {'cached tok/s':>13} {'generate() tok/s':>17} {'uncached tok/s':>15} "
          f"{'cache speedup':>14} {'of bw floor':>12}")
    for row in results:
        for name in ("minikv", "transformers"):
            e = row[name]
            print(f"{row['ctx']:>5} {name:>13} {e['cached_tokens_per_s']:>13.1f} "
                  f"{e['generate_api_tokens_per_s']:>17.1f} {e['uncached_tokens_per_s']:>15.2f} "
                  f"{e['cache_speedup']:>13.1f}x {e['share_of_bandwidth_floor']:>11.0%}")
        print(f"{'':>5} {'minikv / transformers:':>28} cached {row['minikv_over_transformers_cached']:.2f}x, "
              f"generate() {row['minikv_over_transformers_generate_api']:.2f}x, "
              f"uncached {row['minikv_over_transformers_uncached']:.2f}x")
    info = machine_info(("numpy", "torch", "transformers", "gguf"))
    print(describe(info))
    out = write_result(args.out, {
        "benchmark": "decode_cpu", "model": path.name, "dtype": "float32",
        "method": f"{args.rounds} alternating rounds x {args.steps} timed decode steps, {args.settle} s idle "
                  "before each engine's round; medians",
        "read_bandwidth_gbs": bw, "weight_bytes_per_token": wbytes, "bandwidth_floor_ms_per_token": floor_s * 1e3,
        "minikv_matmul_ms_per_token": mm_ms,
        "results": results, "threads": args.threads,
        "thread_env": {v: os.environ.get(v) for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")},
               "machine": info})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
