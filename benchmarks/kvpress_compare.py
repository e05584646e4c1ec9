"""Step 6 side by side with NVIDIA kvpress: the same compression at prefill, the same continuation.

Protocol (the issue's): SmolLM2 reads a 384-token pydoc context, compressed to 50% (192 keys per
layer and KV head) at prefill; then 128 more tokens are teacher-forced with the original positions
and no further eviction. Three pairs, each minikv policy built to kvpress 0.5.5's definition
(read from its source; see docs/06_window.md):

    kvpress SnapKVPress (window 64, kernel 5)  ~ minikv SnapKVPolicy(192, obs_window=64, kernel=5, "avg")
    kvpress StreamingLLMPress (n_sink 4)       ~ minikv PrefillOnly(WindowPolicy(193, sinks=4))
                                                 (the window counts the next token: 4 sinks + 188 latest)
    kvpress ObservedAttentionPress             ~ minikv PrefillOnly(H2OPolicy(192, recent=0, "normalized"))

kvpress needs transformers 5.2.0, so it runs in its own virtual environment
(``bash benchmarks/kvpress_setup.sh``), as a subprocess (``benchmarks/kvpress_peer.py``) on the same
ids; minikv runs here. Reported per pair: both perplexities over the 128 predictions, and the
overlap of the kept sets per (layer, KV head). Where sets differ, each differing position's distance
from kvpress's own cut is measured in kvpress's scores (a near-tie flips with float rounding: the
two runs use different float32 models of the same GGUF).

    PYTHONPATH=. python benchmarks/kvpress_compare.py [--out benchmarks/results/kvpress_compare.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from minikv.bench.corpus import reference_tokens
from minikv.bench.machine import describe, machine_info, write_result
from minikv.perplexity import log_softmax
from minikv.weights.gguf import find_model_file, load_model
from minikv.window import EvictingKVCache, H2OPolicy, PrefillOnly, SnapKVPolicy, WindowPolicy

ROOT = Path(__file__).resolve().parents[1]
CONTEXT, TOKENS, KEEP = 384, 512, 192
PAIRS = {
    "SnapKVPress": ("snapkv", lambda: SnapKVPolicy(KEEP, obs_window=64, kernel=5, pooling="avg")),
    "StreamingLLMPress": ("sinks", lambda: PrefillOnly(WindowPolicy(KEEP + 1, sinks=4))),
    "ObservedAttentionPress": ("h2o normalized", lambda: PrefillOnly(H2OPolicy(KEEP, recent=0, score="normalized"))),
}


def nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    lp = log_softmax(logits)
    return -lp[np.arange(targets.size), targets]


def run_minikv(model, ids: np.ndarray, policy) -> tuple[list, np.ndarray]:
    """Kept positions after the prefill [L][Hkv] and the NLL of the 128 predictions t = 383 .. 510."""
    cache = EvictingKVCache(**model.new_cache_args(), policy=policy, log=False)
    cache.add_sequence(0)
    first = model.forward([ids[:CONTEXT]], cache, all_logits=True)[-1:]
    kept = [[p.tolist() for p in cache.kept_positions(0, layer)] for layer in range(model.config.num_layers)]
    rest = model.forward([ids[CONTEXT:-1]], cache, all_logits=True)
    return kept, nll(np.concatenate([first, rest]), ids[CONTEXT:])


def run_kvpress(ids: np.ndarray) -> dict:
    """kvpress_peer.py's JSON, or {"status": why it did not run}."""
    py = Path(os.environ.get("KVPRESS_VENV", ROOT / ".venv-kvpress")) / "bin" / "python"
    if not py.exists():
        return {"status": f"not run: no kvpress environment at {py.parent.parent} (bash benchmarks/kvpress_setup.sh)"}
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "ids.json", Path(tmp) / "peer.json"
        src.write_text(json.dumps({"ids": ids.tolist()}))
        cmd = [str(py), str(ROOT / "benchmarks" / "kvpress_peer.py"), "--gguf", str(find_model_file()),
               "--ids-file", str(src), "--context", str(CONTEXT), "--ratio", "0.5", "--out", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            return {"status": f"failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]}"}
        return json.loads(out.read_text())


def overlap(ours: list, theirs: list, scores: list | None) -> dict:
    """Kept-set agreement over layers x KV heads, and how close to kvpress's cut each difference lies."""
    same, fractions, gaps = 0, [], []
    for layer, (a_l, b_l) in enumerate(zip(ours, theirs, strict=True)):
        for h, (a, b) in enumerate(zip(a_l, b_l, strict=True)):
            a, b = set(a), set(b)
            same += a == b
            fractions.append(len(a & b) / len(b))
            if scores is not None and a != b:
                s = np.asarray(scores[layer][h], dtype=np.float64)
                cut = np.sort(s)[::-1][KEEP - 1: KEEP + 1].mean()  # between the last kept and the first dropped
                gaps += [abs(s[p] - cut) / abs(cut) for p in a ^ b]
    return {"identical_sets": same, "sets": len(fractions), "mean_overlap": float(np.mean(fractions)),
            "min_overlap": float(np.min(fractions)),
            "differing_positions": len(gaps), "max_relative_distance_from_kvpress_cut": max(gaps) if gaps else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "kvpress_compare.json"))
    args = ap.parse_args(argv)
    model, tok = load_model(find_model_file())
    ids = np.asarray(reference_tokens(tok, TOKENS))
    peer = run_kvpress(ids)
    base = nll(model.logits(ids[:-1])[CONTEXT - 1:], ids[CONTEXT:])  # the full cache equals the uncached pass
    rows = {"full cache": {"minikv_ppl": math.exp(base.mean()),
                           "kvpress_ppl": peer.get("baseline", {}).get("ppl")}}
    print(f"SmolLM2, {CONTEXT}-token context -> {KEEP} keys, then {TOKENS - CONTEXT} teacher-forced tokens; "
          f"full cache ppl minikv {rows['full cache']['minikv_ppl']:.4f}, kvpress {rows['full cache']['kvpress_ppl']}")
    for press, (name, make) in PAIRS.items():
        kept, ours = run_minikv(model, ids, make())
        row = {"minikv": name, "minikv_policy": make().describe(), "minikv_ppl": math.exp(ours.mean())}
        theirs = peer.get("presses", {}).get(press)
        if theirs is not None:
            row.update(kvpress_params=theirs["params"], kvpress_ppl=theirs["ppl"],
                       **overlap(kept, theirs["kept"], theirs.get("scores")))
        rows[press] = row
        print(f"{press:24s} vs minikv {name:15s} ppl {row['minikv_ppl']:.4f} vs {row.get('kvpress_ppl')}  "
              f"sets identical {row.get('identical_sets')}/{row.get('sets')}, mean overlap "
              f"{row.get('mean_overlap')}, differing positions {row.get('differing_positions')} "
              f"(max distance from kvpress's cut {row.get('max_relative_distance_from_kvpress_cut')})", flush=True)
    info = machine_info(("numpy",))
    payload = {"benchmark": "kvpress_compare", "context": CONTEXT, "tokens": TOKENS, "kept": KEEP,
               "kvpress": {k: peer.get(k) for k in ("kvpress", "transformers", "torch", "status") if k in peer},
               "pairs": rows, "machine": info}
    print(f"wrote {write_result(args.out, payload)}")
    print(describe(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
