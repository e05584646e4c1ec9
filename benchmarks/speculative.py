"""SmolLM2-135M speculative decoding (prompt-lookup drafts) against plain greedy decoding, on the CPU.

Two tasks, both through the chat template, greedy:

* ``code_rewrite``: rewrite a given Python snippet with one name changed. The answer copies most
  of the prompt, so n-gram drafts from the prompt are often right: where speculation should pay.
* ``prose``: write a short story. Little of the answer repeats the prompt or itself: where it
  should not.

For each task, plain decoding and speculation with each draft length K run in alternating rounds
in this one process (the order rotates every round, so no variant always runs first), each a whole
``minikv.generate.generate`` call on a contiguous cache. Reported per variant: the median decode
tokens/s over the rounds, the speed-up (median of the per-round ratios to the plain run of the same
round), the ratio of the fastest runs (others' load on a shared machine only ever slows a run), the
acceptance rate (accepted / drafted), tokens per verify pass, and whether the tokens equal plain
greedy's (they must). It also times one forward pass of T = 1 and T = K + 1 tokens (all logits)
after the prompt: speculation wins only when tokens per pass beat that cost ratio. The cost model's
speed-up, ``speedup_predicted``: the plain passes for the same tokens, (accepted + steps) t(1), over
speculation's passes, (steps without a draft) t(1) + (steps with drafts) t(K + 1) (a pass with fewer
than K drafts is priced as K + 1 tokens).
The variant ``K=4 min1`` drafts on any match down to a 1-token suffix, as the engine did before its
rule (``minikv.speculative.MIN_NGRAM``: draft only from a match of 2 or more tokens), and ``K=4 no raise``
keeps that 2-token rule but drops its second part (``MISS_NGRAM``: after a wholly rejected draft, only a
3-token match drafts until a draft is accepted again): together they measure the rule.
Results on a 2-core shared machine are noisy: read the ratios (the 1-minute load average before and
after each task is recorded, so a busy run shows itself).

    python benchmarks/speculative.py [--draft-lens 2 4 8] [--rounds 9] [--max-new-tokens 96]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from functools import partial
from pathlib import Path
from unittest.mock import patch

import minikv.generate as generate_module
from minikv.bench.machine import describe, machine_info, write_result
from minikv.generate import GREEDY, generate, make_cache
from minikv.speculative import MIN_NGRAM, MISS_NGRAM, speculative_decode
from minikv.weights.gguf import find_model_file, load_model

ROOT = Path(__file__).resolve().parents[1]

SNIPPET = '''def summarize(items, limit=10):
    """Return the count, total and mean of the first `limit` items, skipping None."""
    count = 0
    total = 0.0
    for item in items[:limit]:
        if item is None:
            continue
        count += 1
        total += item
    mean = total / count if count else 0.0
    return {"count": count, "total": total, "mean": mean}
'''

TASKS = {
    "code_rewrite": ("Rewrite this Python function so that the parameter `items` is called `values` and the loop "
                     "variable `item` is called `value`. Change nothing else and reply with the code only.\n\n"
                     f"```python\n{SNIPPET}```"),
    "prose": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


OLD_RULE = "K=4 min1"  # the variant that drafts on any match, down to a 1-token suffix (before MIN_NGRAM)
NO_RAISE = "K=4 no raise"  # the 2-token rule without the raise after a miss (before MISS_NGRAM)
RULES = {OLD_RULE: dict(min_ngram=1, miss_ngram=1), NO_RAISE: dict(min_ngram=MIN_NGRAM, miss_ngram=MIN_NGRAM)}


def run(model, ids: list[int], n: int, k):
    """One greedy generation (k None: plain; an int: speculative with draft length k and the engine's
    drafting rule; a name in ``RULES``: K = 4 with that older rule); its result."""
    if k in RULES:
        with patch.object(generate_module, "speculative_decode", partial(speculative_decode, **RULES[k])):
            return run(model, ids, n, 4)
    kw = {} if k is None else dict(speculative="ngram", draft_len=k)
    return generate(model, ids, n, cache="contiguous", sampling=GREEDY, **kw)


def pass_ms(model, ids: list[int], sizes: list[int], rounds: int = 7) -> dict:
    """Median ms of one forward pass of T new tokens after ``ids`` (all logits, as a verify step), per T in
    ``sizes``, the sizes alternating. A verify pass of K + 1 tokens pays off only if it yields more tokens
    than it costs single-token passes."""
    times = {t: [] for t in sizes}
    cache = make_cache("contiguous", model, max_len=len(ids) + max(sizes))
    cache.add_sequence(0)
    model.forward([ids], cache)
    for _ in range(rounds):
        for t in sizes:
            t0 = time.perf_counter()
            model.forward([ids[:t]], cache, all_logits=True)
            times[t].append(time.perf_counter() - t0)
            cache.truncate(0, len(ids))
    return {str(t): statistics.median(v) * 1e3 for t, v in times.items()}


def bench_task(model, ids: list[int], n: int, draft_lens: list[int], rounds: int, settle: float) -> dict:
    """Alternating rounds of plain and speculative runs on one prompt; medians and per-round ratios."""
    variants = [None, *draft_lens, *RULES]
    speed = {v: [] for v in variants}
    ratio = {v: [] for v in variants[1:]}
    last = {}
    for r in range(rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]  # rotate who runs first
        got = {}
        for v in order:
            time.sleep(settle)  # let BLAS threads of the previous run go idle
            got[v] = run(model, ids, n, v)
            speed[v].append(got[v].decode_tokens_per_s)
        for k in variants[1:]:
            ratio[k].append(got[k].decode_tokens_per_s / got[None].decode_tokens_per_s)
        last = got
    plain = last[None]
    out = {"new_tokens": len(plain.token_ids), "finish_reason": plain.finish_reason,
           "plain": {"decode_tokens_per_s": statistics.median(speed[None]), "runs": speed[None]}}
    for k in variants[1:]:
        st = last[k].speculative
        name = k if k in RULES else f"K={k}"
        out[name] = {"draft_len": st.draft_len, "decode_tokens_per_s": statistics.median(speed[k]), "runs": speed[k],
                     "speedup": statistics.median(ratio[k]), "speedup_runs": ratio[k],
                     "speedup_of_best_runs": max(speed[k]) / max(speed[None]),
                     "acceptance_rate": st.acceptance_rate, "draft_tokens": st.drafted,
                     "accepted_tokens": st.accepted, "verify_steps": st.steps, "drafted_steps": st.drafted_steps,
                     "tokens_per_step": st.tokens_per_step,
                     "identical_to_plain": last[k].token_ids == plain.token_ids}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft-lens", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--settle", type=float, default=0.5, help="seconds of idle before each run")
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "speculative.json"))
    args = ap.parse_args(argv)

    model, tok = load_model(find_model_file(args.model))
    results = {}
    for name, text in TASKS.items():
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))
        load = os.getloadavg()[0]
        row = bench_task(model, ids, args.max_new_tokens, args.draft_lens, args.rounds, args.settle)
        row["load_average_1min"] = [load, os.getloadavg()[0]]  # before, after: other work on this machine
        row["prompt_tokens"] = len(ids)
        ms = row["forward_ms_by_tokens"] = pass_ms(model, ids, sorted({1, 5, *(k + 1 for k in args.draft_lens)}))
        for variant in [f"K={k}" for k in args.draft_lens] + [*RULES]:  # the cost model: plain passes for
            e = row[variant]                                                  # the same tokens / speculation's
            k = e["draft_len"]
            plain_ms = (e["accepted_tokens"] + e["verify_steps"]) * ms["1"]
            spec_ms = (e["verify_steps"] - e["drafted_steps"]) * ms["1"] + e["drafted_steps"] * ms[str(k + 1)]
            e["speedup_predicted"] = plain_ms / spec_ms
        row["answer_head"] = tok.decode(run(model, ids, 24, None).token_ids, skip_special_tokens=True)
        results[name] = row
        print(f"\n{name}: prompt {len(ids)} tokens, {row['new_tokens']} new ({row['finish_reason']}); "
              f"plain {row['plain']['decode_tokens_per_s']:.1f} tokens/s; one forward pass of T tokens (ms): "
              + ", ".join(f"T={t}: {ms:.1f}" for t, ms in row["forward_ms_by_tokens"].items()))
        for variant in [f"K={k}" for k in args.draft_lens] + [*RULES]:
            e = row[variant]
            print(f"  {variant}: {e['decode_tokens_per_s']:6.1f} tokens/s, speed-up {e['speedup']:.2f}x (best runs "
                  f"{e['speedup_of_best_runs']:.2f}x, cost model {e['speedup_predicted']:.2f}x), acceptance "
                  f"{e['acceptance_rate']:.0%}, {e['tokens_per_step']:.2f} tokens/pass, identical "
                  f"{e['identical_to_plain']}")
    info = machine_info(("numpy",))
    print(describe(info))
    payload = {"benchmark": "speculative", "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, float32)",
               "cache": "contiguous", "sampling": "greedy",
               "drafter": f"ngram (prompt lookup, n = 3..{MIN_NGRAM}, n = 3..{MISS_NGRAM} after a wholly rejected "
                          f"draft; '{OLD_RULE}': n = 3..1; '{NO_RAISE}': n = 3..{MIN_NGRAM} always)",
               "rounds": args.rounds, "max_new_tokens": args.max_new_tokens, "tasks": results,
               "thread_env": {v: os.environ.get(v) for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")},
               "machine": info}
    print(f"wrote {write_result(args.out, payload)}")
    return 0 if all(r[f"K={k}"]["identical_to_plain"] for r in results.values() for k in args.draft_lens) else 1


if __name__ == "__main__":
    raise SystemExit(main())
