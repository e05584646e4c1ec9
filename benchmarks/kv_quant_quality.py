"""Step 5's quality: what each quantized KV format does to SmolLM2's next-token distributions.

SmolLM2-135M (the GGUF, dequantized to float32) reads a fixed pydoc text
(``reference_tokens``, default 512 tokens) teacher-forced through the cache: a 1-token
prefill, then one token per forward pass, so every prediction attends over what the cache
stored. Each kv_dtype runs in lockstep with the exact float32 cache over the same ids
(``minikv.perplexity.perplexity_vs_exact``) and reports

* ``kld_vs_exact``: mean KL(exact || quantized) of the next-token distributions, nats;
* ``top1_vs_exact``: fraction of positions whose argmax agrees with the exact run;
* ``ppl`` and ``delta_ppl`` = ppl / ppl_exact - 1; ``cache_bytes_per_token`` of the full blocks.

fp8 also runs after a 64-token prefill (the issue asks for its goal whatever the prompt length).

The peer: transformers' ``QuantizedCache`` (``transformers.cache_utils``) on the same text,
transformers' model loaded from the same GGUF, teacher-forced token by token the same way and
compared with its own exact run (``DynamicCache``). Backends: ``quanto`` (optimum-quanto, int4
and int2, ``q_group_size`` and ``residual_length`` set to minikv's group and residual, the
library's default ``axis_key=0, axis_value=0``) and ``fp8`` (one per-tensor scale, frozen
after the first update; it takes no group options). A peer that cannot be imported is
recorded as such. Each goal is printed as met / not met against the measured value; nothing
here is tuned to a goal.

    PYTHONPATH=. python benchmarks/kv_quant_quality.py [--tokens 512] [--no-peer]
                                                       [--out benchmarks/results/kv_quant_quality.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import numpy as np

from minikv.bench.corpus import reference_tokens
from minikv.bench.machine import describe, machine_info, write_result
from minikv.generate import make_cache
from minikv.perplexity import SCORE_ROWS, VersusExact, log_softmax, perplexity_vs_exact
from minikv.weights.gguf import find_model_file, load_model

ROOT = Path(__file__).resolve().parents[1]
GROUP, RESIDUAL = 32, 128

# name -> (kv_dtype, prefill, goals). Goals: the issue's, against the exact run.
RUNS = {
    "int8": ("int8", 1, {"kld_vs_exact": 1e-3, "abs_delta_ppl": 0.005}),
    "int4": ("int4", 1, {}),
    "q4_1": ("q4_1", 1, {}),
    "kivi4": ("kivi4", 1, {"kld_vs_exact": 5e-3}),
    "kivi2": ("kivi2", 1, {"kld_vs_exact": 0.15}),
    "fp8": ("fp8", 1, {"kld_vs_exact": 2e-3, "abs_delta_ppl": 0.01}),
    "fp8 prefill 64": ("fp8", 64, {"kld_vs_exact": 2e-3, "abs_delta_ppl": 0.01}),
    "fp8_e5m2": ("fp8_e5m2", 1, {}),
    "k16v8": ("k16v8", 1, {"kld_vs_exact": 1e-4}),
    "fp16": ("fp16", 1, {}),
    "bf16": ("bf16", 1, {}),
}
# peer name -> (QuantizedCache options, the minikv run at equal bits, group and residual)
PEERS = {
    "quanto int4": ({"backend": "quanto", "nbits": 4, "q_group_size": GROUP, "residual_length": RESIDUAL,
                     "axis_key": 0, "axis_value": 0}, "kivi4"),
    "quanto int2": ({"backend": "quanto", "nbits": 2, "q_group_size": GROUP, "residual_length": RESIDUAL,
                     "axis_key": 0, "axis_value": 0}, "kivi2"),
    "fp8 (per tensor)": ({"backend": "fp8"}, "fp8"),
}
KEEP = ("ppl", "ppl_exact", "delta_ppl", "kld_vs_exact", "kld_max_vs_exact", "top1_vs_exact",
        "scored_tokens", "elapsed_s")


def verdicts(res: dict, goals: dict) -> dict:
    """{goal: {"goal", "measured", "met"}} for each goal of a run."""
    out = {}
    for key, bound in goals.items():
        val = abs(res["delta_ppl"]) if key == "abs_delta_ppl" else res[key]
        out[key] = {"goal": bound, "measured": val, "met": bool(val <= bound)}
    return out


def run_minikv(model, ids: list[int]) -> dict:
    out = {}
    for name, (kv_dtype, prefill, goals) in RUNS.items():
        def factory(m, n, kv_dtype=kv_dtype):
            return make_cache("paged", m, max_len=n, kv_dtype=kv_dtype, group=GROUP, residual=RESIDUAL)

        res = perplexity_vs_exact(model, ids, factory, prefill=prefill, label="paged")
        row = {"cache": "paged", "kv_dtype": kv_dtype, "group": GROUP,
               "residual": RESIDUAL if kv_dtype.startswith("kivi") else None, "prefill": prefill,
               "cache_bytes_per_token": res["cache_bytes_per_token"], **{k: res[k] for k in KEEP}}
        row["goals"] = verdicts(res, goals)
        out[name] = row
        print(line(name, row), flush=True)
    return out


def line(name: str, row: dict) -> str:
    goals = "; ".join(f"{k} {v['measured']:.3g} <= {v['goal']:g}: {'met' if v['met'] else 'NOT met'}"
                      for k, v in row.get("goals", {}).items())
    bpt = row.get("cache_bytes_per_token")
    size = f" {bpt:8.1f} B/token" if bpt is not None else ""
    return (f"{name:18s} KLD {row['kld_vs_exact']:.3e}  top-1 {row['top1_vs_exact']:.4f}  ppl {row['ppl']:.4f}  "
            f"dppl {row['delta_ppl']:+.3%}{size}  {row['elapsed_s']:.0f} s" + (f"  [{goals}]" if goals else ""))


# --- the peer: transformers' QuantizedCache ------------------------------------------------------


def peer_missing(opts: dict) -> str | None:
    """Why the peer cannot run here, or None."""
    if opts["backend"] == "quanto" and importlib.util.find_spec("optimum.quanto") is None:
        return "optimum-quanto is not installed (pip install optimum-quanto)"
    return None


def load_hf(path: Path):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32)
    return model.eval()


def hf_teacher_forced(hf, ids: np.ndarray, cache, prefill: int):
    """Yield ``(start, logits [n, V] float64)`` like ``minikv.perplexity.teacher_forced_logits``."""
    import torch

    with torch.no_grad():
        chunks = [(0, ids[:prefill])] + [(t, ids[t: t + 1]) for t in range(prefill, ids.size - 1)]
        for start, new in chunks:
            out = hf(input_ids=torch.as_tensor(new[None, :]), past_key_values=cache, use_cache=True)
            yield start, out.logits[0].double().numpy()


def run_peer(hf, ids: list[int], opts: dict, prefill: int = 1) -> dict:
    from transformers import DynamicCache, QuantizedCache

    arr = np.asarray(ids, dtype=np.int64)
    versus, t0 = VersusExact(), time.perf_counter()
    exact, lossy = DynamicCache(config=hf.config), QuantizedCache(config=hf.config, **opts)
    for (start, ex), (_, lo) in zip(hf_teacher_forced(hf, arr, exact, prefill),
                                    hf_teacher_forced(hf, arr, lossy, prefill)):
        for row in range(0, ex.shape[0], SCORE_ROWS):
            n = ex[row: row + SCORE_ROWS].shape[0]
            versus.update(log_softmax(ex[row: row + n]), log_softmax(lo[row: row + n]),
                          arr[start + row + 1: start + row + 1 + n])
    res = {**versus.result(), "elapsed_s": time.perf_counter() - t0}
    return {"options": opts, "prefill": prefill, **{k: res[k] for k in KEEP}}


def run_peers(hf_path: Path, ids: list[int], minikv: dict) -> dict:
    out, hf = {}, None
    for name, (opts, twin) in PEERS.items():
        why = peer_missing(opts)
        if why is None and hf is None:
            hf = load_hf(hf_path)
        row = {"options": opts, "status": why} if why else run_peer(hf, ids, opts)
        row["minikv_twin"] = twin
        if why is None:
            ratio = minikv[twin]["kld_vs_exact"] / row["kld_vs_exact"] if row["kld_vs_exact"] > 0 else None
            row["kld_ratio_minikv_over_peer"] = ratio
            row["goal_ratio_at_most_0.5"] = {"goal": 0.5, "measured": ratio,
                                             "met": ratio is not None and ratio <= 0.5}
            print(line(f"peer {name}", row) + f"  minikv {twin} / peer KLD = "
                  f"{ratio:.3g} (goal <= 0.5: {'met' if ratio is not None and ratio <= 0.5 else 'NOT met'})",
                  flush=True)
        else:
            print(f"peer {name}: not run ({why})", flush=True)
        out[name] = row
    return out


def notes(tokens: int) -> list[str]:
    """What a short run cannot show (kivi* quantize a block only once R tokens are in it)."""
    if tokens - 1 < RESIDUAL:
        return [f"{tokens - 1} tokens fed < residual R={RESIDUAL}: kivi2/kivi4 quantized no block, so their "
                "error here is that of the full-precision residual only (rounding); run --tokens 512"]
    return []


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=512, help="reference text tokens (default 512, the issue's)")
    ap.add_argument("--no-peer", action="store_true", help="skip transformers' QuantizedCache")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "kv_quant_quality.json"))
    args = ap.parse_args(argv)
    if args.tokens < 66:
        ap.error(f"--tokens={args.tokens}: the 64-token fp8 prefill needs at least 66 tokens; use 66 or more")
    t0 = time.perf_counter()
    path = find_model_file()
    model, tok = load_model(path)
    ids = reference_tokens(tok, args.tokens)
    exact_bpt = int(make_cache("contiguous", model, max_len=1).bytes_per_token())
    print(f"SmolLM2-135M float32, {len(ids)} reference tokens, teacher-forced, group {GROUP}, residual "
          f"{RESIDUAL} (kivi*); exact float32 cache: {exact_bpt} B/token", flush=True)
    minikv = run_minikv(model, ids)
    peers = {} if args.no_peer else run_peers(path, ids, minikv)
    total = time.perf_counter() - t0
    info = machine_info(("numpy", "torch", "transformers", "optimum-quanto"))
    payload = {"benchmark": "kv_quant_quality", "model": "SmolLM2-135M-Instruct (GGUF, float32)",
               "text": f"reference_tokens(tokenizer, {args.tokens})", "tokens": len(ids),
               "exact": {"cache": "contiguous", "bytes_per_token": exact_bpt},
               "group": GROUP, "residual": RESIDUAL, "minikv": minikv, "peer": peers,
               "notes": notes(len(ids)), "total_s": total, "machine": info}
    print(f"total {total:.0f} s; wrote {write_result(args.out, payload)}")
    print(describe(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
