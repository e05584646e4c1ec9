"""Step 6's quality: what each eviction policy does to SmolLM2's next-token distributions.

SmolLM2-135M (the GGUF, dequantized to float32) reads a fixed pydoc text (``reference_tokens``,
default 1,024 tokens) teacher-forced through each cache, and is compared position by position
with the full cache (one exact pass over the text):

* ``window``      the W latest tokens (S = 0), original positions;
* ``sinks``       4 sinks + the W - 4 latest (StreamingLLM), original positions;
* ``sinks in-cache``  the same with in-cache positions (keys re-rotated by rank);
* ``h2o``         budget B: B/2 recent + B/2 heavy hitters by raw accumulated attention;
* ``h2o normalized``  the same, scores divided by the queries that saw each key;
* ``snapkv``      the first half of the text is the prompt, compressed to B keys per (layer, KV head)
                  by its last 32 queries; the second half is decoded with no further eviction, so its
                  cache grows to B + 511 keys: not comparable with the others at equal memory.

Each at budgets (W = B) 64, 128 and 256, reporting perplexity, KLD(full || policy), top-1
agreement, and the per-position NLL (the curve of notebook 06). The issue's goals, checked at
B = 128: window-only perplexity at least 2x the full cache's; sinks + window within 1.8x.

How it is fed. A window evicts by position and SnapKV only at the prompt, so for them one chunk
equals its tokens one by one (``tests/test_window.py::test_chunked_feeding_equals_token_by_token``
proves it on tiny models): they run the text in one pass (SnapKV: prompt, then the rest). H2O
evicts after every step, so it is decoded token by token. ``--token-by-token`` feeds every policy
one token at a time (slower; the same numbers up to float32 rounding).

    PYTHONPATH=. python benchmarks/eviction_quality.py [--tokens 1024] [--budgets 64 128 256]
                                                        [--out benchmarks/results/eviction_quality.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from minikv.bench.corpus import reference_tokens
from minikv.bench.machine import describe, machine_info, write_result
from minikv.perplexity import SCORE_ROWS, VersusExact, log_softmax
from minikv.weights.gguf import find_model_file, load_model
from minikv.window import EvictingKVCache, H2OPolicy, SnapKVPolicy, WindowPolicy

ROOT = Path(__file__).resolve().parents[1]
SINKS = 4

# name -> (policy of budget B, chunked: feeding the text in one pass equals token by token)
POLICIES = {
    "window": (lambda b: WindowPolicy(b), True),
    "sinks": (lambda b: WindowPolicy(b, SINKS), True),
    "sinks in-cache": (lambda b: WindowPolicy(b, SINKS, "in-cache"), True),
    "h2o": (lambda b: H2OPolicy(b), False),
    "h2o normalized": (lambda b: H2OPolicy(b, score="normalized"), False),
    "snapkv": (lambda b: SnapKVPolicy(b, min(32, b // 2)), True),
}
GOALS_AT = 128


def run_policy(model, ids: np.ndarray, policy, chunked: bool, prompt: int) -> np.ndarray:
    """Logits [T - 1, V] float32 of positions 0 .. T-2 through an evicting cache."""
    rope = (model.cos, model.sin, model.config.rope_layout)
    cache = EvictingKVCache(**model.new_cache_args(), policy=policy, rope=rope, log=False)
    cache.add_sequence(0)
    fed = ids[:-1]
    parts = [model.forward([fed[:prompt]], cache, all_logits=True)]
    if chunked and prompt < fed.size:
        parts.append(model.forward([fed[prompt:]], cache, all_logits=True))
    else:
        parts += [model.forward([fed[t:t + 1]], cache) for t in range(prompt, fed.size)]
    return np.concatenate(parts)


def compare(exact: np.ndarray, lossy: np.ndarray, targets: np.ndarray) -> dict:
    """KLD, top-1, ppl of ``lossy`` against ``exact`` (logits [n, V]) and the per-position NLL curve."""
    versus = VersusExact(curve=True)
    for r in range(0, exact.shape[0], SCORE_ROWS):
        versus.update(log_softmax(exact[r:r + SCORE_ROWS]), log_softmax(lossy[r:r + SCORE_ROWS]),
                      targets[r:r + SCORE_ROWS])
    return versus.result()


def verdicts(rows: dict, ppl_full: float) -> dict:
    """The issue's two StreamingLLM goals at B = 128, measured."""
    w, s = rows[f"window B={GOALS_AT}"]["ppl"], rows[f"sinks B={GOALS_AT}"]["ppl"]
    return {"window_only_ppl_over_full": {"goal": ">= 2", "measured": w / ppl_full, "met": bool(w / ppl_full >= 2)},
            "sinks_ppl_over_full": {"goal": "<= 1.8", "measured": s / ppl_full, "met": bool(s / ppl_full <= 1.8)}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1024, help="reference text tokens (default 1024, the issue's)")
    ap.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--token-by-token", action="store_true", help="feed every policy one token at a time")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "eviction_quality.json"))
    args = ap.parse_args(argv)
    if GOALS_AT not in args.budgets or args.tokens < 2 * max(args.budgets):
        ap.error(f"--budgets must include {GOALS_AT} and --tokens be at least twice the largest budget")
    t0 = time.perf_counter()
    model, tok = load_model(find_model_file())
    ids = np.asarray(reference_tokens(tok, args.tokens))
    targets = ids[1:]
    exact = model.logits(ids[:-1])  # the full cache equals this uncached pass (tests/test_equivalence.py)
    full = compare(exact, exact, targets)
    print(f"SmolLM2-135M float32, {ids.size} reference tokens; full cache ppl {full['ppl']:.3f}", flush=True)
    rows = {}
    for b in args.budgets:
        for name, (make, chunked) in POLICIES.items():
            prompt = ids.size // 2 if name == "snapkv" else (1 if args.token_by_token or not chunked else ids.size - 1)
            if name == "snapkv" and args.token_by_token:
                chunked = False
            t1 = time.perf_counter()
            res = compare(exact, run_policy(model, ids, make(b), chunked, prompt), targets)
            policy = make(b).describe()
            rows[f"{name} B={b}"] = {"policy": policy, "budget": b, "prompt": prompt,
                                     "fed": "one pass" if chunked and prompt == ids.size - 1 else
                                     ("prompt, then one pass" if chunked else "token by token"),
                                     **{k: res[k] for k in ("ppl", "delta_ppl", "kld_vs_exact", "kld_max_vs_exact",
                                                            "top1_vs_exact")},
                                     "nll_curve": res["nll_curve"]["lossy"], "elapsed_s": time.perf_counter() - t1}
            r = rows[f"{name} B={b}"]
            print(f"{name + f' B={b}':22s} ppl {r['ppl']:8.3f} ({r['ppl'] / full['ppl']:.2f}x full)  "
                  f"KLD {r['kld_vs_exact']:.4f}  top-1 {r['top1_vs_exact']:.3f}  {r['elapsed_s']:.0f} s", flush=True)
    goals = verdicts(rows, full["ppl"])
    for k, v in goals.items():
        print(f"goal {k} {v['goal']}: measured {v['measured']:.2f} -> {'met' if v['met'] else 'NOT met'}")
    info = machine_info(("numpy",))
    payload = {"benchmark": "eviction_quality", "model": "SmolLM2-135M-Instruct (GGUF, float32)",
               "text": f"reference_tokens(tokenizer, {args.tokens})", "tokens": int(ids.size),
               "full": {"ppl": full["ppl"], "nll_curve": full["nll_curve"]["exact"]}, "sinks": SINKS,
               "runs": rows, "goals": goals, "total_s": time.perf_counter() - t0, "machine": info}
    print(f"total {payload['total_s']:.0f} s; wrote {write_result(args.out, payload)}")
    print(describe(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
