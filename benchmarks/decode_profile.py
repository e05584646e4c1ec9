"""Where a SmolLM2-135M forward pass spends its time on the CPU, per operation, for T new tokens after a context.

For each context (default 256 and 1,024 tokens of real text, prefilled into a contiguous cache) and each
number of new tokens T (default 1, 2, 4, 8 and 64: a decode step, speculative verify passes, a prefill
chunk), with one and with two BLAS threads, it times

* the whole forward pass (``Model.forward(all_logits=True)``, as a verify pass runs it; the cache is
  truncated back to the context after every pass), median over ``--reps`` passes, the T alternating;
* the same pass with every operation timed (the model's own functions, wrapped for the run):
  ``projections`` (Q/K/V, O, gate/up, down: ``minikv.layers.linear`` on the layer weights), ``lm_head``
  (``linear`` on the output embedding), ``attention`` (``cache.attend``), ``cache_write``
  (``cache.write``), ``norms`` (``rms_norm``), ``rope`` (``apply_rope``) and ``activation`` (SiLU and the gated
  product: ``gated_activation``);
* ``other``: the whole pass minus the timed operations (embedding, residual adds, slicing, validation,
  the step's bookkeeping: what Python costs around the operations), also given per layer.

Timing wrappers add about a microsecond per call, so the operations' sum can exceed the unwrapped pass
by a little; ``other`` is then clipped at 0. The table prints each operation's milliseconds and the
pass's cost relative to T = 1 at the same context and thread count (the 1.3x goal of issue 24).

    python benchmarks/decode_profile.py [--ctx 256 1024] [--tokens 1 2 4 8 64] [--threads 1 2] [--reps 7]
                                        [--cache contiguous|paged|none] [--scores]

``--cache paged`` profiles the paged cache (blocks of 16) instead of the contiguous one; ``--cache none``
the uncached step of step 1 (``NoCache``): each pass recomputes the context and the T new tokens, and
only the last row's logits are computed, as an uncached decode step does (use ``--tokens 1``). ``--scores`` first
sweeps the attention's score product alone (``minikv.online_softmax.tile_scores`` against the plain
``q @ k^T``, for 1-24 query rows over 128-1,024 keys, head_dim 64, 3 KV heads) and prints the plain form's
time over the chosen form's: where OpenBLAS's small-matrix kernel ends, the plain form turns 2-5x slower.
A quick look on a busy machine: ``--ctx 256 --tokens 1 2 4 8 --threads 1 --reps 3``.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

import minikv.model as model_module
from minikv import online_softmax
from minikv.bench.corpus import reference_tokens
from minikv.bench.machine import describe, machine_info, write_result
from minikv.generate import make_cache
from minikv.weights.gguf import find_model_file, load_model

ROOT = Path(__file__).resolve().parents[1]
OPS = ("projections", "attention", "cache_write", "norms", "rope", "activation", "lm_head", "other")


def _blas_library():
    """NumPy's OpenBLAS, found among the loaded libraries, with the name of its thread setter."""
    with open("/proc/self/maps") as f:
        paths = sorted({line.split()[-1] for line in f if "openblas" in line.lower() and ".so" in line})
    for path in paths:
        lib = ctypes.CDLL(path)
        for name in ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
                     "openblas_set_num_threads64_", "openblas_set_num_threads"):
            if hasattr(lib, name):
                return getattr(lib, name)
    raise RuntimeError("NumPy's OpenBLAS was not found among the loaded libraries: cannot set its threads")


def set_blas_threads(n: int) -> None:
    """Set the number of OpenBLAS threads NumPy's matrix products use from now on."""
    _blas_library()(int(n))


class OpTimer:
    """Wraps the model's operations for one pass and sums the seconds spent in each."""

    def __init__(self, model):
        self.model = model
        self.totals = dict.fromkeys(OPS, 0.0)

    def _timed(self, fn, name_of):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            self.totals[name_of(*args)] += time.perf_counter() - t
            return out
        return wrapper

    @contextmanager
    def installed(self, cache):
        """Swap the wrapped functions in (module globals and the cache's methods), then back."""
        m = model_module
        head = self.model.lm_head
        saved = {name: getattr(m, name) for name in ("linear", "rms_norm", "apply_rope", "gated_activation")}
        m.linear = self._timed(saved["linear"], lambda x, w: "lm_head" if w is head else "projections")
        m.rms_norm = self._timed(saved["rms_norm"], lambda *a: "norms")
        m.apply_rope = self._timed(saved["apply_rope"], lambda *a: "rope")
        m.gated_activation = self._timed(saved["gated_activation"], lambda *a: "activation")
        cache.write = self._timed(cache.write, lambda *a: "cache_write")
        cache.attend = self._timed(cache.attend, lambda *a: "attention")
        try:
            yield self
        finally:
            for name, fn in saved.items():
                setattr(m, name, fn)
            del cache.write, cache.attend


def score_sweep(reps: int = 30) -> list[dict]:
    """Plain ``q @ k^T`` over ``online_softmax.tile_scores`` (best of ``reps``), per query rows and keys."""
    rng = np.random.default_rng(0)

    def best(fn, q, k):
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn(q, k)
            times.append(time.perf_counter() - t)
        return min(times)

    def plain(q, k):
        return q @ np.swapaxes(k, -1, -2)

    rows = []
    for r in (1, 2, 3, 4, 6, 9, 12, 24):
        for keys in (128, 256, 512, 1024):
            q, k = rng.standard_normal((3, r, 64), np.float32), rng.standard_normal((3, keys, 64), np.float32)
            ratio = best(plain, q, k) / best(online_softmax.tile_scores, q, k)
            rows.append({"rows": r, "keys": keys, "plain_over_chosen": ratio})
        print(f"rows {r:>2}: " + "  ".join(f"{x['keys']:>4} keys {x['plain_over_chosen']:.2f}x" for x in rows[-4:]))
    return rows


def profile_context(model, ids: list[int], ctx: int, tokens: list[int], reps: int, kind: str = "contiguous") -> dict:
    """{T: {"forward_ms": ..., op: ms, ...}} for one context, the sizes alternating within every round."""
    cache = make_cache(kind, model, max_len=ctx + max(tokens))
    cache.add_sequence(0)
    new = ids[ctx:ctx + max(tokens)]
    if kind == "none":  # no cache to fill: each pass recomputes the context and the new tokens
        def one_pass(t):
            start = time.perf_counter()
            model.forward([ids[:ctx + t]], cache)
            return time.perf_counter() - start
    else:
        model.forward([ids[:ctx]], cache)

        def one_pass(t):
            start = time.perf_counter()
            model.forward([new[:t]], cache, all_logits=True)
            cache.truncate(0, ctx)
            return time.perf_counter() - start

    for t in tokens:  # warm-up: first touches, BLAS threads started
        one_pass(t)
    whole = {t: [] for t in tokens}
    parts = {t: {op: [] for op in OPS[:-1]} for t in tokens}
    for _ in range(reps):
        for t in tokens:
            whole[t].append(one_pass(t))
            timer = OpTimer(model)
            with timer.installed(cache):
                one_pass(t)
            for op in OPS[:-1]:
                parts[t][op].append(timer.totals[op])
    out = {}
    layers = model.config.num_layers
    for t in tokens:
        fwd = statistics.median(whole[t]) * 1e3
        row = {"forward_ms": fwd, **{op: statistics.median(v) * 1e3 for op, v in parts[t].items()}}
        row["other"] = max(0.0, fwd - sum(row[op] for op in OPS[:-1]))
        row["other_per_layer_ms"] = row["other"] / layers
        out[t] = row
    for t in tokens:
        out[t]["ratio_to_T1"] = out[t]["forward_ms"] / out[tokens[0]]["forward_ms"]
    return out


def print_table(rows: list[dict]) -> None:
    print(f"\n{'ctx':>5} {'thr':>3} {'T':>3} {'forward':>8} {'xT=1':>5} "
          + " ".join(f"{op[:11]:>11}" for op in OPS) + f" {'other/layer':>11}   (ms)")
    for r in rows:
        print(f"{r['ctx']:>5} {r['threads']:>3} {r['tokens']:>3} {r['forward_ms']:>8.1f} {r['ratio_to_T1']:>5.2f} "
              + " ".join(f"{r[op]:>11.2f}" for op in OPS) + f" {r['other_per_layer_ms']:>11.3f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 64], help="new tokens T (first: the base)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="BLAS threads")
    ap.add_argument("--reps", type=int, default=7, help="rounds; each runs every T once plain and once profiled")
    ap.add_argument("--cache", choices=("contiguous", "paged", "none"), default="contiguous")
    ap.add_argument("--scores", action="store_true", help="first sweep the score product alone (tile_scores)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "decode_profile.json"))
    args = ap.parse_args(argv)

    sweep = score_sweep() if args.scores else None
    path = find_model_file(args.model)
    model, tok = load_model(path)
    ids = reference_tokens(tok, max(args.ctx) + max(args.tokens))
    rows = []
    for threads in args.threads:
        set_blas_threads(threads)
        for ctx in args.ctx:
            load = os.getloadavg()[0]
            for t, row in profile_context(model, ids, ctx, args.tokens, args.reps, args.cache).items():
                rows.append({"ctx": ctx, "threads": threads, "tokens": t, **row,
                             "load_average_1min": [load, os.getloadavg()[0]]})
            print_table(rows[-len(args.tokens):])
    print_table(rows)
    info = machine_info(("numpy",))
    print(describe(info))
    out = write_result(args.out, {
        "benchmark": "decode_profile", "model": path.name, "dtype": "float32", "cache": args.cache,
        "method": f"{args.reps} rounds, each running every T once whole and once with its operations timed; "
                  "medians; all logits (a verify pass); load_average_1min before and after each context",
        "ops": list(OPS), "rows": rows, "score_sweep": sweep, "machine": info})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
