"""What the attention fast paths save: each one switched off in turn, timed against the code as it is.

The online softmax (``minikv.online_softmax.update``) and paged attention (``minikv.paged.attention``)
carry two shortcuts that make the code longer to read, kept because this benchmark shows they matter:

* ``overwrite``: the caller's score tile is scratch, so masking, shifting and exp happen in place
  (switched off: ``update`` is called with ``overwrite=False``, which copies the tile twice);
* row subsets: paged attention skips, per tile, the queries that see none of its keys (a prefill's
  early queries, a batch's short sequences) and uses views when every query takes part (switched
  off: every query takes part in every tile, masked).

A third, ``seen`` (skip the rescale on the first tile), was measured here and removed: it saved
about 10% of a 256-token decode's attention (0.004 ms of 0.04 ms per layer, under 1% of a SmolLM2
decode step) and nothing measurable elsewhere.

Shapes are SmolLM2-135M's attention (9 query heads, 3 KV heads, head_dim 64) in float32, per layer:
decode at 256 and 1,024 tokens (contiguous and paged, block 16), a batch of 8 decodes of 64..1,024
tokens (paged), and a 512-token prefill (contiguous and paged). Variants alternate in one process
over ``--rounds`` rounds; medians are reported with the ratio to the baseline (> 1: the shortcut
saves that much). One BLAS thread.

    python benchmarks/fast_paths.py [--rounds 7] [--out benchmarks/results/fast_paths.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

import minikv.online_softmax as osm  # noqa: E402
import minikv.paged.attention as pa  # noqa: E402
from minikv.bench.machine import describe, machine_info, write_result  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HQ, HKV, D, BS = 9, 3, 64, 16


@contextmanager
def switched_off(name: str):
    """Run the block with one shortcut switched off (see the module docstring)."""
    update = osm.update
    if name == "overwrite":
        osm.update = lambda state, scores, values, mask=None, overwrite=False: update(state, scores, values, mask)
    elif name == "row_subsets":
        class AllRows:  # paged attention's only np.flatnonzero: the queries a tile has; here all of them
            def __getattr__(self, attr):
                return getattr(np, attr)

            @staticmethod
            def flatnonzero(a):
                return np.arange(np.size(a))
        pa.np = AllRows()
    try:
        yield
    finally:
        osm.update, pa.np = update, np


def cases(rng) -> dict:
    """name -> a function that runs one layer's attention once."""
    def contiguous(t: int, s: int):
        q = rng.standard_normal((1, HQ, t, D), dtype=np.float32)
        k, v = (rng.standard_normal((1, HKV, s, D), dtype=np.float32) for _ in range(2))
        return lambda: osm.attend_contiguous(q, k, v)

    def paged(query_lens: list, context_lens: list):
        n, width = sum(query_lens), -(-max(context_lens) // BS)
        num_blocks = len(context_lens) * width
        q = rng.standard_normal((n, HQ, D), dtype=np.float32)
        k_pool, v_pool = (rng.standard_normal((num_blocks, BS, HKV, D), dtype=np.float32) for _ in range(2))
        tables = rng.permutation(num_blocks).reshape(len(context_lens), width).astype(np.int32)
        return lambda: pa.paged_attention(q, k_pool, v_pool, tables, np.array(context_lens), np.array(query_lens))

    batch = [64, 128, 192, 256, 384, 512, 768, 1024]
    return {"contiguous decode 256": contiguous(1, 256), "contiguous decode 1024": contiguous(1, 1024),
            "contiguous prefill 512": contiguous(512, 512), "paged decode 256": paged([1], [256]),
            "paged decode 1024": paged([1], [1024]), "paged batch of 8 decodes": paged([1] * 8, batch),
            "paged prefill 512": paged([512], [512])}


def timed(fn, repeat: int) -> float:
    best = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best.append(time.perf_counter() - t0)
    return min(best)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/fast_paths.json"))
    args = ap.parse_args(argv)
    runs, variants = cases(np.random.default_rng(0)), ("baseline", "overwrite", "row_subsets")
    times = {c: {v: [] for v in variants} for c in runs}
    for _ in range(args.rounds):
        for c, fn in runs.items():
            for v in variants:
                with switched_off(v):
                    times[c][v].append(timed(fn, 5 if "prefill" in c else 20))
    res = {}
    print(f"{'case':28s} {'baseline ms':>11s}   ratio with the shortcut off: " + "  ".join(variants[1:]))
    for c in runs:
        med = {v: statistics.median(times[c][v]) for v in variants}
        res[c] = {"baseline_ms": med["baseline"] * 1e3,
                  **{f"{v}_off_ratio": med[v] / med["baseline"] for v in variants[1:]}}
        print(f"{c:28s} {med['baseline'] * 1e3:11.3f}   " +
              "  ".join(f"{res[c][f'{v}_off_ratio']:.3f}x" for v in variants[1:]))
    write_result(args.out, {"machine": machine_info(("numpy",)), "rounds": args.rounds, "cases": res})
    print(describe(machine_info(("numpy",))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
