"""MLA decode on the CPU: the absorbed form against the expanded form, over the same latent cache.

The model is DeepSeek-V3's attention geometry per head, scaled down to run on a laptop:

* kept from DeepSeek-V3: kv_lora_rank R = 512, qk_rope_head_dim P = 64, qk_nope_head_dim Dn = 128,
  v_head_dim Dv = 128 (so each token caches W = R + P = 576 values per layer);
* scaled down: 2 layers (V3: 61), 16 heads (V3: 128), hidden 512 (V3: 7168), a dense SwiGLU
  MLP of width 512, a plain q_proj (V3: q_lora_rank 1536), 256-token vocabulary, random weights
  (``minikv.weights.random_models.random_mla_model``), float32.

For each context length the prompt is prefilled once into a paged latent cache
(``LatentPagedKVCache``; the context is a multiple of the block size). Each timed decode step
runs on a fresh ``fork`` of that sequence, so every step sees exactly ``ctx`` cached tokens
and writes into a block of its own (no copy-on-write); the fork is freed afterwards. The two
forms (``cache.form = "absorbed"`` / ``"expanded"``) alternate step by step in one process;
the figures are medians, and the two forms' logits are checked equal (float32 bar).

It also prints, from the shapes alone, what one decode step reads and computes per cached
token and layer in each form, for this model and for the full DeepSeek-V3 (128 heads, bf16):

* absorbed: reads the W-wide latent row once; every head scores it (2 W FLOPs) and adds
  its first R values (2 R FLOPs): MQA with one 576-wide key head;
* expanded: reads the same row, then builds each head's key (Dn + P) and value (Dv):
  Hq x (Dn + P + Dv) values, at 2 R (Dn + Dv) FLOPs per head, before ordinary attention;
* MHA equivalent: a cache of those per-head K and V (what MLA avoids) reads Hq x (Dn + P + Dv);
* GQA equivalent: 8 KV heads of K and V with 128 dims each (claims.md, claim 6) reads 2 x 8 x 128.

It runs on one BLAS thread (set before NumPy loads; export OPENBLAS_NUM_THREADS to change it):
on a shared 2-core machine a second BLAS thread that spin-waits for a busy core makes single
timings several times slower at random, and the two forms would not see the same machine.

    python benchmarks/mla_decode.py [--ctx 128 512 2048] [--rounds 9] [--quick]
"""

from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from minikv.bench.equivalence import assert_close  # noqa: E402
from minikv.bench.machine import describe, machine_info, write_result  # noqa: E402
from minikv.mla import LatentPagedKVCache, MLAConfig  # noqa: E402
from minikv.weights.random_models import random_mla_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
V3 = MLAConfig(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
SCALED = dict(num_layers=2, num_heads=16, hidden_size=512, intermediate_size=512, vocab_size=256)
BLOCK = 16
FORMS = ("absorbed", "expanded")


def per_key_costs(mla: MLAConfig, heads: int, itemsize: int) -> dict:
    """Bytes read (or built) and FLOPs per cached token and layer of one decode step, per form."""
    r, w, dn, p, dv = mla.kv_lora_rank, mla.latent_dim, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
    per_head_kv = dn + p + dv
    rows = {
        "absorbed": {"bytes": w * itemsize, "flops": heads * 2 * (w + r)},
        "expanded": {"bytes": w * itemsize, "built_bytes": heads * per_head_kv * itemsize,
                     "flops": heads * (2 * r * (dn + dv) + 2 * per_head_kv)},
        "mha_equivalent": {"bytes": heads * per_head_kv * itemsize, "flops": heads * 2 * per_head_kv},
        "gqa8_equivalent": {"bytes": 2 * 8 * 128 * itemsize, "flops": heads * 2 * 2 * 128},
    }
    for row in rows.values():
        row["flops_per_byte"] = row["flops"] / (row["bytes"] + row.get("built_bytes", 0))
    return rows


def per_query_flops(mla: MLAConfig, heads: int) -> dict:
    """FLOPs per new token and layer that do not grow with the context: absorbing W_UK into the
    query and applying W_UV to the latent output (absorbed form only)."""
    r = mla.kv_lora_rank
    return {"absorb_query": heads * 2 * mla.qk_nope_head_dim * r, "w_uv_output": heads * 2 * r * mla.v_head_dim}


def prefilled_cache(model, ctx: int, seed: int) -> LatentPagedKVCache:
    """A paged latent cache holding one sequence ("p") of ``ctx`` random tokens, prefilled in one pass."""
    blocks = ctx // BLOCK + 2 * len(FORMS) + 2  # the prompt, plus one fresh block per live fork
    cache = LatentPagedKVCache(**model.new_cache_args(), num_blocks=blocks, block_size=BLOCK, dtype=model.dtype,
                               enable_prefix_caching=False)
    cache.add_sequence("p")
    ids = np.random.default_rng(seed).integers(0, model.config.vocab_size, ctx).tolist()
    model.forward([ids], cache, ["p"])
    return cache


def timed_decode(model, cache, form: str, tok: int) -> tuple[float, np.ndarray]:
    """Seconds of one decode step (one token over ``ctx`` cached ones) in ``form``, on a fork."""
    cache.form = form
    cache.fork("p", "c")
    t = time.perf_counter()
    logits = model.forward([[tok]], cache, ["c"])[0]
    dt = time.perf_counter() - t
    cache.free_sequence("c")
    return dt, logits


def run(ctxs: list[int], rounds: int, steps: int) -> list[dict]:
    model = random_mla_model(V3, max_position=max(ctxs) + 8, seed=0, dtype=np.float32, **SCALED)
    results = []
    for ctx in ctxs:
        cache = prefilled_cache(model, ctx, seed=ctx)
        times = {f: [] for f in FORMS}
        for _ in range(rounds):
            for i in range(steps + 1):  # the first step of each round is a warm-up
                order = FORMS if i % 2 == 0 else FORMS[::-1]  # alternate which form goes first
                got = {}
                for form in order:
                    dt, got[form] = timed_decode(model, cache, form, tok=7 + i)
                    if i:
                        times[form].append(dt)
                assert_close(got["absorbed"], got["expanded"], np.float32, what=f"ctx {ctx} logits")
        med = {f: statistics.median(times[f]) for f in FORMS}
        results.append({"ctx": ctx, **{f"{f}_ms_per_token": med[f] * 1e3 for f in FORMS},
                        "absorbed_over_expanded_time": med["absorbed"] / med["expanded"],
                        "expanded_over_absorbed_time": med["expanded"] / med["absorbed"],
                        "samples_per_form": len(times["absorbed"])})
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--rounds", type=int, default=9, help="rounds per context length")
    ap.add_argument("--steps", type=int, default=4, help="timed decode steps per form and round")
    ap.add_argument("--quick", action="store_true",
                    help="contexts 64 and 128, 2 rounds of 2 steps (seconds); writes no JSON unless --out is given")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/mla_decode.json (full runs only)")
    args = ap.parse_args(argv)
    if args.quick:
        args.ctx, args.rounds, args.steps = [64, 128], 2, 2
    bad = [c for c in args.ctx if c < BLOCK or c % BLOCK]
    if bad:
        ap.error(f"--ctx {bad}: each context must be a positive multiple of the block size {BLOCK}")

    heads = SCALED["num_heads"]
    print(f"BLAS threads: {os.environ['OPENBLAS_NUM_THREADS']}")
    print(f"model: DeepSeek-V3 per-head geometry (R {V3.kv_lora_rank}, P {V3.qk_rope_head_dim}, "
          f"Dn {V3.qk_nope_head_dim}, Dv {V3.v_head_dim}), scaled to {SCALED}, float32")
    costs = {"this_model_float32": per_key_costs(V3, heads, 4), "deepseek_v3_bf16": per_key_costs(V3, 128, 2)}
    query = {"this_model": per_query_flops(V3, heads), "deepseek_v3": per_query_flops(V3, 128)}
    for name, rows in costs.items():
        print(f"\nper cached token and layer, one decode step ({name}):")
        print(f"  {'form':>16} {'bytes read':>11} {'bytes built':>12} {'FLOPs':>9} {'FLOPs/byte':>11}")
        for form, row in rows.items():
            print(f"  {form:>16} {row['bytes']:>11,} {row.get('built_bytes', 0):>12,} {row['flops']:>9,} "
                  f"{row['flops_per_byte']:>11.1f}")
        a, e = rows["absorbed"], rows["expanded"]
        print(f"  absorbed / expanded: bytes {a['bytes'] / (e['bytes'] + e['built_bytes']):.3f}, "
              f"FLOPs {a['flops'] / e['flops']:.3f}; absorbed / MHA-equivalent bytes "
              f"{a['bytes'] / rows['mha_equivalent']['bytes']:.4f}")

    results = run(args.ctx, args.rounds, args.steps)
    print(f"\n{'ctx':>6} {'absorbed ms/token':>18} {'expanded ms/token':>18} {'absorbed / expanded':>20} "
          f"{'expanded / absorbed':>20}")
    for row in results:
        print(f"{row['ctx']:>6} {row['absorbed_ms_per_token']:>18.2f} {row['expanded_ms_per_token']:>18.2f} "
              f"{row['absorbed_over_expanded_time']:>19.3f}x {row['expanded_over_absorbed_time']:>19.1f}x")
    info = machine_info(("numpy",))
    print(describe(info))
    if args.quick and args.out is None:
        print("quick run: no JSON written (the committed results are a full run; pass --out to keep this one)")
        return 0
    out = write_result(args.out or ROOT / "benchmarks" / "results" / "mla_decode.json", {
        "benchmark": "mla_decode", "dtype": "float32",
        "model": {"mla": {"kv_lora_rank": V3.kv_lora_rank, "qk_rope_head_dim": V3.qk_rope_head_dim,
                          "qk_nope_head_dim": V3.qk_nope_head_dim, "v_head_dim": V3.v_head_dim},
                  **SCALED, "q_lora_rank": None, "weights": "random (random_mla_model, seed 0)",
                  "scaled_from": "deepseek-v3: 61 layers, 128 heads, hidden 7168, q_lora_rank 1536"},
        "blas_threads": os.environ["OPENBLAS_NUM_THREADS"],
        "method": (f"paged latent cache (block {BLOCK}), prefilled once per context; each timed decode step on "
                   f"a fresh fork (exactly ctx cached tokens), forms alternating step by step; {args.rounds} rounds "
                   f"x {args.steps} timed steps per form (plus one warm-up per round); medians; logits of the two "
                   "forms checked equal"),
        "quick": args.quick, "per_key_costs": costs, "per_query_flops": query,
        "results": results, "machine": info})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
