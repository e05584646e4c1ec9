"""Peer run of NVIDIA kvpress on SmolLM2-135M, for minikv's window/eviction step.

Runs inside the separate kvpress venv (benchmarks/kvpress_setup.sh); it does not import minikv.

    .venv-kvpress/bin/python benchmarks/kvpress_peer.py --gguf PATH --ids-file IDS.json \
        --context 384 --ratio 0.5 --out OUT.json

Protocol, for no press (baseline) and each press at --ratio with kvpress's default parameters:
  1. prefill ids[:context] with the press active (kvpress compresses each layer's cache in a forward
     hook right after that layer's attention, so the prefill itself attends to the full context);
  2. record the kept positions per layer and KV head: the press's own `score` is wrapped to capture
     the scores, the indices are `scores.topk(n_kept, dim=-1).indices` exactly as in
     ScorerPress.compress, and they are checked against the compressed cache that kvpress really
     wrote (gathered keys and values must be bit-identical), then sorted;
  3. without the press, teacher-force ids[context:] in one forward with position_ids
     context..len-1 passed explicitly (as kvpress's own pipeline does for the question), and record
     the NLL of ids[t+1] for t = context-1 .. len-2 (t = context-1 from the prefill's last logits),
     log-softmax in float64.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata as md
import json
import math
import os
import time

os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF de-quantization bar is a bare tqdm

import torch  # noqa: E402
from kvpress import ObservedAttentionPress, SnapKVPress, StreamingLLMPress  # noqa: E402
from kvpress.utils import compute_n_kept  # noqa: E402
from transformers import AutoModelForCausalLM, DynamicCache  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

# press name -> (class, attn_implementation it runs under). ObservedAttentionPress reads the layer's
# attention weights, which only eager attention returns; SnapKV and StreamingLLM run under sdpa
# (attention weights None), as in kvpress's default pipeline: SnapKV then recomputes the window
# attention itself (SnapKVPress.compute_window_attention).
PRESSES = {
    "SnapKVPress": (SnapKVPress, "sdpa"),
    "StreamingLLMPress": (StreamingLLMPress, "sdpa"),
    "ObservedAttentionPress": (ObservedAttentionPress, "eager"),
}


def load(gguf: str, attn: str):
    d, name = os.path.split(os.path.abspath(gguf))
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32, attn_implementation=attn)
    return model.eval()


def nll_of(logits: torch.Tensor, targets: torch.Tensor) -> list[float]:
    logp = torch.log_softmax(logits.double(), dim=-1)
    return (-logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)).tolist()


class Recorder:
    """Wraps a press instance's score/compress to capture what it keeps (per layer)."""

    def __init__(self, press):
        self.press = press
        self.scores: dict[int, torch.Tensor] = {}
        self.kept: dict[int, torch.Tensor] = {}
        self.cache_order: dict[int, torch.Tensor] = {}
        orig_score, orig_compress = press.score, press.compress

        def score(module, hidden_states, keys, values, attentions, kwargs):
            s = orig_score(module, hidden_states, keys, values, attentions, kwargs)
            self.scores[module.layer_idx] = s.detach().clone()
            return s

        def compress(module, hidden_states, keys, values, attentions, kwargs):
            k_in, v_in = keys.clone(), values.clone()
            k_out, v_out = orig_compress(module, hidden_states, keys, values, attentions, kwargs)
            s = self.scores[module.layer_idx]
            n_kept = compute_n_kept(keys.shape[2], press.compression_ratio)
            idx = s.topk(n_kept, dim=-1).indices  # the very call ScorerPress.compress makes
            g = idx.unsqueeze(-1).expand(-1, -1, -1, module.head_dim)
            assert k_out.shape[2] == n_kept, (k_out.shape, n_kept)
            assert torch.equal(k_in.gather(2, g), k_out), f"layer {module.layer_idx}: kept keys differ"
            assert torch.equal(v_in.gather(2, g), v_out), f"layer {module.layer_idx}: kept values differ"
            self.cache_order[module.layer_idx] = idx[0].clone()
            self.kept[module.layer_idx] = idx[0].sort(dim=-1).values
            return k_out, v_out

        press.score = score  # instance attributes shadow the class methods the hook calls
        press.compress = compress


@torch.no_grad()
def prefill(model, ids: torch.Tensor, context: int, press=None):
    cache = DynamicCache()
    ctx = press(model) if press is not None else _null()
    with ctx:
        out = model(input_ids=ids[:, :context], past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache, out.logits[0, -1]


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@torch.no_grad()
def continuation(model, ids: torch.Tensor, context: int, cache, last_logits, stepwise: bool = False):
    n = ids.shape[1]
    targets = ids[0, context:]
    if not stepwise:
        pos = torch.arange(context, n, dtype=torch.long).unsqueeze(0)
        out = model(input_ids=ids[:, context:], past_key_values=cache, position_ids=pos, use_cache=True)
        logits = torch.cat([last_logits[None], out.logits[0, :-1]], dim=0)
    else:  # one token at a time, the kvpress pipeline's decode loop (cross-check of the one-forward mask)
        rows = [last_logits]
        for t in range(context, n - 1):
            out = model(input_ids=ids[:, t : t + 1], past_key_values=cache,
                        position_ids=torch.tensor([[t]]), use_cache=True)
            rows.append(out.logits[0, -1])
        logits = torch.stack(rows)
    nll = nll_of(logits, targets)
    return nll, math.exp(sum(nll) / len(nll))


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--ids-file", required=True)
    ap.add_argument("--context", type=int, default=384)
    ap.add_argument("--ratio", type=float, default=0.5)
    ap.add_argument("--out", required=True)
    ap.add_argument("--no-scores", action="store_true", help="leave the per-position scores out of the JSON")
    ap.add_argument("--check-stepwise", action="store_true",
                    help="also decode token by token and record the max |NLL difference| vs the one-forward run")
    ap.add_argument("--threads", type=int, default=0)
    return ap.parse_args()


def run_baselines(models, ids, a, res) -> None:
    """The full cache under both attention implementations (eager's is a check)."""
    for attn in ("sdpa", "eager"):
        cache, last = prefill(models[attn], ids, a.context)
        nll, ppl = continuation(models[attn], ids, a.context, cache, last)
        key = "baseline" if attn == "sdpa" else "baseline_eager"
        (res if attn == "sdpa" else res["checks"])[key] = {"attn_implementation": attn, "nll": nll, "ppl": ppl}
        print(f"{key:24s} ppl {ppl:.4f}", flush=True)


def run_press(models, ids, a, name, cls, attn, layers: int, res) -> None:
    """One press: compress at prefill, record what it kept, continue teacher-forced."""
    t1 = time.time()
    press = cls(compression_ratio=a.ratio)
    params = dataclasses.asdict(press)
    rec = Recorder(press)
    cache, last = prefill(models[attn], ids, a.context, press)
    lens = {cache.layers[i].keys.shape[2] for i in range(len(cache.layers))}
    assert len(rec.kept) == layers, "press did not run on every layer"
    nll, ppl = continuation(models[attn], ids, a.context, cache, last)
    entry = {
        "params": params, "attn_implementation": attn,
        "n_kept": compute_n_kept(a.context, a.ratio), "cache_len_after_prefill": sorted(lens),
        "kept": [rec.kept[i].tolist() for i in range(layers)],
        "cache_order": [rec.cache_order[i].tolist() for i in range(layers)],
        "nll": nll, "ppl": ppl,
    }
    if not a.no_scores:
        entry["scores"] = [rec.scores[i][0].tolist() for i in range(layers)]
    res["presses"][name] = entry
    print(f"{name:24s} ppl {ppl:.4f}  params {params}  cache len {sorted(lens)}  ({time.time() - t1:.1f}s)",
          flush=True)
    if a.check_stepwise:
        cache2, last2 = prefill(models[attn], ids, a.context, cls(compression_ratio=a.ratio))
        nll2, _ = continuation(models[attn], ids, a.context, cache2, last2, stepwise=True)
        d = max(abs(x - y) for x, y in zip(nll, nll2))
        res["checks"][f"{name}_stepwise_max_abs_nll_diff"] = d
        print(f"  stepwise decode vs one forward: max |dNLL| = {d:.3g}", flush=True)


def check_snapkv_eager(models, ids, a, cfg, res) -> None:
    """SnapKV's second code path: under eager attention it takes the window rows of the layer's own
    attention weights instead of recomputing them. Record whether both keep the same."""
    press = SnapKVPress(compression_ratio=a.ratio)
    rec = Recorder(press)
    cache, last = prefill(models["eager"], ids, a.context, press)
    nll, ppl = continuation(models["eager"], ids, a.context, cache, last)
    ref = res["presses"]["SnapKVPress"]["kept"]
    diff = sum(len(set(ref[i][h]) ^ set(rec.kept[i][h].tolist()))
               for i in range(cfg.num_hidden_layers) for h in range(cfg.num_key_value_heads))
    res["checks"]["SnapKVPress_eager"] = {"ppl": ppl, "kept_symmetric_difference_vs_sdpa": diff}
    print(f"{'SnapKVPress (eager path)':24s} ppl {ppl:.4f}  kept sets differ from sdpa path in {diff} entries",
          flush=True)


def main():
    a = parse_args()
    hf_logging.disable_progress_bar()  # the GGUF de-quantization and weight-loading bars
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    ids = torch.tensor([json.load(open(a.ids_file))["ids"]], dtype=torch.long)
    assert a.context < ids.shape[1], "need tokens after the context"
    t0 = time.time()
    models = {attn: load(a.gguf, attn) for attn in ("sdpa", "eager")}
    cfg = models["sdpa"].config
    print(f"loaded {type(models['sdpa']).__name__}: {cfg.num_hidden_layers} layers, {cfg.num_attention_heads} q heads,"
          f" {cfg.num_key_value_heads} kv heads, head_dim {cfg.head_dim} ({time.time() - t0:.1f}s)", flush=True)
    res = {
        "kvpress": md.version("kvpress"), "transformers": md.version("transformers"), "torch": torch.__version__,
        "model": os.path.basename(a.gguf), "context": a.context, "n_tokens": ids.shape[1],
        "n_predictions": ids.shape[1] - a.context, "nll_positions": [a.context - 1, ids.shape[1] - 2],
        "kept_note": "kept = sorted(scores.topk(n_kept).indices) of the press's own scores, verified "
                     "bit-exact against the compressed cache kvpress wrote; cache_order = the order kvpress "
                     "stores them in (topk order)",
        "presses": {}, "checks": {},
    }
    run_baselines(models, ids, a, res)
    for name, (cls, attn) in PRESSES.items():
        run_press(models, ids, a, name, cls, attn, cfg.num_hidden_layers, res)
    check_snapkv_eager(models, ids, a, cfg, res)
    res["wall_s"] = time.time() - t0
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f)
    print(f"wrote {a.out} ({res['wall_s']:.1f}s)")


if __name__ == "__main__":
    main()
