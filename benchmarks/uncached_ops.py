"""Where an uncached step (step 1: recompute the whole sequence) spends its time, minikv against transformers.

One uncached decode step of SmolLM2-135M at each context (default 256 and 1,024 tokens of real text):
a forward pass over the whole sequence with no cache, only the last row's logits computed, as
``benchmarks/decode_cpu.py`` times it. minikv's pass is split with ``decode_profile.py``'s ``OpTimer``
(its model functions, wrapped); transformers' with forward hooks on its modules, timed the same way
(torch runs CPU operations synchronously, so a hook's clock brackets the module's work):

* ``projections``: the Q/K/V/O and gate/up/down linear maps (``nn.Linear`` modules; ``linear``);
* ``attention``: the self-attention module minus its four projections (RoPE, the score and value
  products, softmax; minikv: ``attend`` and ``apply_rope``);
* ``norms``, ``activation`` (SiLU and the gated product; transformers: the MLP minus its three
  projections; minikv: ``gated_activation``), ``lm_head``, and ``other`` (the pass minus all of these).

Hooks slow transformers' pass (a Python call before and after each of its ~450 modules), so each round
also times transformers once more with the hooks removed: ``forward_unhooked``, the fair whole-pass
comparison (minikv's wrappers sit around ~250 calls of plain functions).

The two engines alternate in every round; medians over ``--reps`` rounds. Each operation's
minikv/transformers ratio says which part of the pass makes the whole ratio (above 1: minikv slower).

    python benchmarks/uncached_ops.py [--ctx 256 1024] [--reps 5] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from decode_cpu import TransformersRunner
from decode_profile import OpTimer, set_blas_threads

from minikv.bench.corpus import reference_tokens
from minikv.bench.machine import describe, machine_info, write_result
from minikv.kv_cache import NoCache
from minikv.weights.gguf import find_model_file, load_model

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("projections", "attention", "norms", "activation", "lm_head", "other")


def minikv_pass(model, ids) -> dict:
    """ms per part of one uncached pass of minikv's model over ``ids``."""
    cache = NoCache(**model.new_cache_args())
    timer = OpTimer(model)
    start = time.perf_counter()
    with timer.installed(cache):
        model.forward([ids], cache)
    whole = time.perf_counter() - start
    t = timer.totals
    parts = {"projections": t["projections"], "attention": t["attention"] + t["rope"] + t["cache_write"],
             "norms": t["norms"], "activation": t["activation"], "lm_head": t["lm_head"]}
    return _with_other(parts, whole)


def _with_other(parts: dict, whole: float) -> dict:
    ms = {k: v * 1e3 for k, v in parts.items()}
    ms["other"] = max(0.0, whole * 1e3 - sum(ms.values()))
    ms["forward"] = whole * 1e3
    return ms


class HookTimer:
    """Seconds per part of a transformers Llama pass, from pre/post forward hooks on its modules."""

    def __init__(self, hf):
        self.totals, self.starts, self.handles = dict.fromkeys(PARTS[:-1], 0.0), {}, []
        layers = hf.model.layers
        linear = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
        for layer in layers:
            for name, mod in [*layer.self_attn.named_children(), *layer.mlp.named_children()]:
                if name in linear:
                    self._hook(mod, "projections", +1)
            self._hook(layer.self_attn, "attention", +1)  # minus its projections, below
            self._hook(layer.mlp, "activation", +1)       # minus its projections, below
            self._hook(layer.input_layernorm, "norms", +1)
            self._hook(layer.post_attention_layernorm, "norms", +1)
            for name, mod in layer.self_attn.named_children():
                if name in linear:
                    self._hook(mod, "attention", -1)
            for name, mod in layer.mlp.named_children():
                if name in linear:
                    self._hook(mod, "activation", -1)
        self._hook(hf.model.norm, "norms", +1)
        self._hook(hf.lm_head, "lm_head", +1)

    def _hook(self, module, part: str, sign: int) -> None:
        key = (id(module), part, sign)

        def pre(mod, args):
            self.starts[key] = time.perf_counter()

        def post(mod, args, out):
            self.totals[part] += sign * (time.perf_counter() - self.starts[key])

        self.handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def remove(self) -> None:
        """Take every hook off the model (for a pass timed as ``decode_cpu.py`` times it)."""
        for handle in self.handles:
            handle.remove()


def transformers_pass(runner, ids) -> dict:
    """ms per part of one uncached pass of transformers' model, hooked as ``HookTimer`` times it; then the
    same pass with no hook on it (``forward_unhooked``): hooks cost transformers time minikv's wrappers do
    not cost minikv, so the whole pass is compared by the unhooked one."""
    timer = HookTimer(runner.model)
    start = time.perf_counter()
    runner.full_forward(ids)
    whole = time.perf_counter() - start
    timer.remove()
    start = time.perf_counter()
    runner.full_forward(ids)
    return {**_with_other(dict(timer.totals), whole), "forward_unhooked": (time.perf_counter() - start) * 1e3}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="BLAS and torch threads for both (default: theirs)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "uncached_ops.json"))
    args = ap.parse_args(argv)

    if args.threads is not None:
        set_blas_threads(args.threads)
    path = find_model_file(args.model)
    model, tok = load_model(path)
    peer = TransformersRunner(path)
    if args.threads is not None:
        peer.torch.set_num_threads(args.threads)
    ids_all = reference_tokens(tok, max(args.ctx) + 1)
    rows = []
    for ctx in args.ctx:
        ids = ids_all[:ctx + 1]
        minikv_pass(model, ids), transformers_pass(peer, ids)  # warm-up
        runs = {"minikv": [], "transformers": []}
        load = os.getloadavg()[0]
        for _ in range(args.reps):
            runs["minikv"].append(minikv_pass(model, ids))
            runs["transformers"].append(transformers_pass(peer, ids))
        med = {e: {p: statistics.median(r[p] for r in rs) for p in rs[0]} for e, rs in runs.items()}
        rows.append({"ctx": ctx, **med, "load_average_1min": [load, os.getloadavg()[0]]})
        print(f"\nuncached step at {ctx} tokens (ms; ratio minikv / transformers, above 1: minikv slower)")
        for p in ("forward", *PARTS):
            a, b = med["minikv"][p], med["transformers"][p]
            print(f"  {p:<12} minikv {a:8.1f}  transformers {b:8.1f}  ratio {a / b if b else float('nan'):5.2f}")
        b = med["transformers"]["forward_unhooked"]
        print(f"  {'unhooked':<12} {'':15}  transformers {b:8.1f}  ratio {med['minikv']['forward'] / b:5.2f}")
    info = machine_info(("numpy", "torch", "transformers"))
    print(describe(info))
    out = write_result(args.out, {
        "benchmark": "uncached_ops", "model": path.name, "dtype": "float32", "threads": args.threads,
        "method": f"{args.reps} alternating rounds, medians; minikv timed by decode_profile.OpTimer, transformers "
                  "by forward hooks; one uncached pass over ctx + 1 tokens, last row's logits",
        "parts": list(PARTS), "rows": rows, "machine": info})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
