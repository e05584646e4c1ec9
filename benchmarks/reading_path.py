"""Reading paths: what a learner has to read to follow one decode step through a cache.

A one-layer random model prefills 21 tokens, then runs one decode step with the tracer on. Only the
cache's side of the seam is traced (``step``, ``write``, ``attend``, and ``truncate`` where the step
is a rollback): the model's own files (``model.py``, ``layers.py``, ``mla/block.py``) are the same
for every cache and are left out. For each textbook lesson and each engine cache it reports

* files:     the ``minikv`` files whose code ran, and their lengths (what a learner opens);
* functions: the functions entered;
* lines:     the distinct lines that ran (the route);
* jumps:     the distinct (caller file, callee file) pairs of calls that cross a file boundary.

The engine side uses only ``minikv.generate.make_cache``, so the same script measures an older
checkout too (``--label before``; lessons are skipped where the textbook does not exist).

    python benchmarks/reading_path.py [--label after] [--out benchmarks/results/reading_path.json]
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PKG = Path(importlib.import_module("minikv").__file__).resolve().parent
MODEL_SIDE = {"model.py", "layers.py", "mla/block.py"}
PROMPT, BS = 21, 4


class Route:
    """A tracer that records the cache's route while ``on`` (see the module docstring)."""

    def __init__(self):
        self.lines, self.functions, self.jumps, self.on = set(), set(), set(), False

    @staticmethod
    def name(frame) -> str | None:
        try:
            rel = str(Path(frame.f_code.co_filename).resolve().relative_to(PKG))
        except ValueError:
            return None
        return None if rel in MODEL_SIDE else rel

    def __call__(self, frame, event, arg):
        if not self.on or event != "call":
            return None
        me = self.name(frame)
        if me is None:
            return None
        self.functions.add((me, frame.f_code.co_firstlineno, frame.f_code.co_name))
        caller = self.name(frame.f_back) if frame.f_back else None
        if caller is not None and caller != me:
            self.jumps.add((caller, me))
        return self.local

    def local(self, frame, event, arg):
        if self.on and event == "line":
            self.lines.add((self.name(frame), frame.f_lineno))
        return self.local

    @contextmanager
    def tracing(self):
        self.on = True
        try:
            yield
        finally:
            self.on = False

    def summary(self) -> dict:
        files = sorted({f for f, _ in self.lines})
        return {"files": {f: len((PKG / f).read_text().splitlines()) for f in files},
                "num_files": len(files), "file_lines": sum(len((PKG / f).read_text().splitlines()) for f in files),
                "functions": len(self.functions), "lines": len(self.lines), "jumps": len(self.jumps)}


def traced(cache, route: Route):
    """Wrap the cache's seam so that only its own work is traced."""
    for name in ("write", "attend", "truncate"):
        if hasattr(cache, name):
            inner = getattr(cache, name)

            def wrapped(*args, _inner=inner, **kwargs):
                with route.tracing():
                    return _inner(*args, **kwargs)
            setattr(cache, name, wrapped)
    step = cache.step

    @contextmanager
    def traced_step(seq_ids, num_new):
        gen = step(seq_ids, num_new)
        with route.tracing():
            positions = gen.__enter__()
        try:
            yield positions
        finally:
            with route.tracing():
                gen.__exit__(None, None, None)
    cache.step = traced_step
    return cache


def models():
    try:
        from minikv.weights.random_models import random_mla_model, random_model
    except ImportError:  # an older checkout: the flat layout
        from minikv.random_models import random_mla_model, random_model
    return (random_model(num_layers=1, dtype=np.float64, max_position=64),
            random_mla_model(num_layers=1, dtype=np.float64, max_position=64),
            random_model(num_layers=1, head_dim=32, dtype=np.float64, max_position=64))  # q8_0 groups 32 values


def measure(model, cache, rollback: bool = False) -> dict:
    """Prefill, then trace one decode step (and, for ``rollback``, a truncate of 2 tokens)."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, model.config.vocab_size, PROMPT + 1).tolist()
    cache.add_sequence(0)
    model.forward([ids[:PROMPT]], cache)
    route = Route()
    traced(cache, route)
    sys.settrace(route)
    try:
        model.forward([ids[PROMPT:]], cache)
        if rollback:
            cache.truncate(0, PROMPT - 1)
    finally:
        sys.settrace(None)
    return route.summary()


def engine_cases(gqa, mla, d32) -> dict:
    from minikv.generate import make_cache

    n = PROMPT + 8
    window = dict(window=12, sinks=2)
    return {
        "1 none": lambda: measure(gqa, make_cache("none", gqa, n)),
        "2 contiguous": lambda: measure(gqa, make_cache("contiguous", gqa, n)),
        "3 paged": lambda: measure(gqa, make_cache("paged", gqa, n, block_size=BS)),
        "4 MLA paged": lambda: measure(mla, make_cache("paged", mla, n, block_size=BS)),
        "5 quant int8 paged": lambda: measure(d32, make_cache("paged", d32, n, block_size=BS, kv_dtype="int8")),
        "6 window": lambda: measure(gqa, make_cache("window", gqa, n, eviction=window)),
        "6 window paged": lambda: measure(gqa, make_cache("window", gqa, n, block_size=BS,
                                                          eviction={**window, "layout": "paged"})),
        "7 paged rollback": lambda: measure(gqa, make_cache("paged", gqa, n, block_size=BS), rollback=True),
    }


def lesson_cases(gqa, mla, d32) -> dict:
    if not (PKG / "textbook").exists():  # a checkout from before the textbook
        return {}
    from minikv.textbook import (
        s1_attention,
        s2_kv_cache,
        s3_paged,
        s3b_sharing_batching,
        s4_mla,
        s5_quant,
        s6_window,
        s7_rollback,
    )

    args, n = gqa.new_cache_args(), PROMPT + 8
    return {
        "s1_attention": lambda: measure(gqa, s1_attention.NoCache(**args)),
        "s2_kv_cache": lambda: measure(gqa, s2_kv_cache.ContiguousCache(**args, max_seqs=1, max_len=n,
                                                                         dtype=np.float64)),
        "s3_paged": lambda: measure(gqa, s3_paged.PagedCache(**args, num_blocks=16, block_size=BS, dtype=np.float64)),
        "s3b_sharing_batching": lambda: measure(gqa, s3b_sharing_batching.SharingCache(
            **args, num_blocks=16, block_size=BS, dtype=np.float64)),
        "s4_mla": lambda: measure(mla, s4_mla.LatentCache(**mla.new_cache_args(), max_seqs=1, max_len=n,
                                                          dtype=np.float64)),
        "s5_quant": lambda: measure(d32, s5_quant.QuantCache(**d32.new_cache_args(), num_blocks=16, block_size=BS,
                                                            dtype=np.float64)),
        "s6_window": lambda: measure(gqa, s6_window.RingCache(**args, window=12, sinks=2, max_seqs=1,
                                                              dtype=np.float64)),
        "s7_rollback": lambda: measure(gqa, s7_rollback.RollbackCache(**args, num_blocks=16, block_size=BS,
                                                                       dtype=np.float64), rollback=True),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", default="after", help="the key this checkout's numbers go under")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/reading_path.json"))
    args = ap.parse_args(argv)
    ms = models()
    res = {"lessons": {k: f() for k, f in lesson_cases(*ms).items()},
           "engine": {k: f() for k, f in engine_cases(*ms).items()}}
    out = Path(args.out)
    payload = json.loads(out.read_text()) if out.exists() else {}
    payload[args.label] = res
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"{'case':24s} {'files':>5s} {'file lines':>10s} {'functions':>9s} {'route lines':>11s} {'jumps':>5s}")
    for side in ("lessons", "engine"):
        for k, r in res[side].items():
            print(f"{k:24s} {r['num_files']:5d} {r['file_lines']:10d} {r['functions']:9d} {r['lines']:11d} "
                  f"{r['jumps']:5d}")
    print(f"wrote {out} under {args.label!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
