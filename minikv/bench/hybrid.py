"""Step 9's batching benchmark: a hybrid paged cache against the same model sized all-full, one memory budget.

Both sides run the same scheduler, model, workload and pool (the same bytes, the same blocks of S
layers x block_size tokens). The hybrid side's sliding groups give back the blocks that left every
window; the all-full side keeps every token of every layer (a sliding group with rollback K as long
as the longest request never gives a block back: what an engine that sizes every layer as full,
vLLM's ``disable_hybrid_kv_cache_manager``, holds). Attention is the same on both sides, so the
outputs must be identical; what differs is how many sequences fit at once.

``geometry_model`` builds a random model with a model's *cache geometry* (layers, layer types,
window, KV heads, head_dim; tiny hidden size and vocabulary): the bytes per token and the blocks a
sequence holds are the real model's, and the run takes minutes instead of hours on a CPU.
"""

from __future__ import annotations

import time
from dataclasses import asdict, replace
from typing import Callable

from minikv.bench.workloads import Workload
from minikv.errors import ConfigError
from minikv.hybrid import HybridPagedKVCache
from minikv.model import Model, ModelConfig
from minikv.scheduler import Scheduler


def geometry_model(config: ModelConfig, vocab_size: int = 256, hidden_size: int = 64, seed: int = 0) -> Model:
    """A random Gemma-style model with ``config``'s layers, layer types, window, query and KV heads and
    head_dim, a small hidden size, MLP and vocabulary (what the cache holds per token is ``config``'s)."""
    from minikv.weights.random_models import random_gemma_model

    if not any(w is not None for w in config.layer_windows):
        raise ConfigError("the model's layers are all full attention; the hybrid batching benchmark compares a "
                          "model with sliding layers against itself sized all-full (e.g. --model gemma3)")
    m = random_gemma_model(num_layers=config.num_layers, hidden_size=hidden_size, num_heads=config.num_heads,
                           num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                           intermediate_size=2 * hidden_size,
                           vocab_size=vocab_size, sliding_window=config.sliding_window,
                           max_position=config.max_position, seed=seed)
    return Model(replace(m.config, layer_types=config.layer_types), m.weights, dtype=m.dtype)


def hybrid_batching_benchmark(model: Model, workload: Workload, kv_budget_bytes: int, block_size: int = 16,
                              progress: Callable[[int], object] | None = None) -> dict:
    """Run ``workload`` twice through the scheduler on one pool of ``kv_budget_bytes``: hybrid, then all-full.

    Returns ``hybrid`` and ``all_full`` (concurrency, preemptions, steps, prefix hit rate, peak blocks,
    throughput), ``concurrency_ratio`` (hybrid / all-full max concurrent sequences), ``mean_concurrency_ratio``
    and ``identical_outputs``.
    """
    c = model.config
    cache_of = lambda k: HybridPagedKVCache(c.layer_windows, c.num_kv_heads, c.head_dim, 1, block_size,  # noqa: E731
                                            model.dtype, rollback=k)
    block = cache_of(0).block_bytes()
    num_blocks = int(kv_budget_bytes) // block
    reqs, sides, outputs = workload.requests(), {}, {}
    for side, rollback in (("hybrid", 0), ("all_full", workload.max_len)):
        cache = HybridPagedKVCache(c.layer_windows, c.num_kv_heads, c.head_dim, num_blocks, block_size, model.dtype,
                                   rollback=rollback)
        sched = Scheduler(model, cache, progress=progress)
        peak, t0 = 0, time.perf_counter()
        for r in reqs:
            sched.add_request(r)
        while sched.has_work():
            sched.step()
            peak = max(peak, cache.memory_stats()["blocks_in_use"])
        wall, st = time.perf_counter() - t0, sched.stats
        outputs[side] = {rid: list(s.output) for rid, s in sched.finished.items()}
        sides[side] = {"max_concurrency": st.max_concurrency,
                       "mean_concurrency": st.running_seq_steps / max(st.steps, 1),
                       "steps": st.steps, "preemptions": st.preemptions, "prefix_hit_rate": st.prefix_hit_rate,
                       "peak_blocks": peak, "generated_tokens": st.generated_tokens, "wall_s": wall,
                       "throughput_tokens_per_s": st.generated_tokens / wall}
    return {"workload": {**asdict(workload), "max_len": workload.max_len}, "kv_budget_bytes": int(kv_budget_bytes),
            "block_size": block_size, "block_bytes": block, "num_blocks": num_blocks,
            "layer_windows": list(c.layer_windows), "hybrid": sides["hybrid"], "all_full": sides["all_full"],
            "concurrency_ratio": sides["hybrid"]["max_concurrency"] / sides["all_full"]["max_concurrency"],
            "mean_concurrency_ratio": sides["hybrid"]["mean_concurrency"] / sides["all_full"]["mean_concurrency"],
            "identical_outputs": outputs["hybrid"] == outputs["all_full"]}


def format_hybrid_batching(res: dict) -> str:
    """The table ``minikv bench batching --model`` prints."""
    wl = res["workload"]
    lines = [f"workload: {wl['num_requests']} requests, prompts median {wl['prompt_median']:.0f} "
             f"(up to {wl['prompt_range'][1]}), outputs median {wl['output_median']:.0f}; one pool of "
             f"{res['num_blocks']} blocks of {res['block_size']} tokens ({res['kv_budget_bytes'] / 2**20:.1f} MiB)",
             f"{'':28s}{'hybrid':>12s}{'all-full':>12s}"]
    rows = [("max concurrent seqs", "max_concurrency", "{}"), ("mean concurrent seqs", "mean_concurrency", "{:.2f}"),
            ("steps", "steps", "{}"), ("preemptions", "preemptions", "{}"), ("peak blocks", "peak_blocks", "{}"),
            ("prefix hit rate", "prefix_hit_rate", "{:.1%}")]
    for label, key, fmt in rows:
        lines.append(f"{label:28s}{fmt.format(res['hybrid'][key]):>12s}{fmt.format(res['all_full'][key]):>12s}")
    lines.append(f"concurrency hybrid/all-full: {res['concurrency_ratio']:.2f}x max, "
                 f"{res['mean_concurrency_ratio']:.2f}x mean; identical outputs: {res['identical_outputs']}")
    return "\n".join(lines)


def longest_request_bytes(model: Model, workload: Workload, block_size: int) -> int:
    """Bytes of the blocks the workload's longest request may hold (``peak_blocks``: every group at full length,
    as a recompute-preempted request comes back in one prefill): a pool must hold at least that."""
    c = model.config
    cache = HybridPagedKVCache(c.layer_windows, c.num_kv_heads, c.head_dim, 1, block_size, model.dtype)
    return cache.peak_blocks(workload.max_len, workload.max_len) * cache.block_bytes()


__all__ = ["longest_request_bytes", "format_hybrid_batching", "geometry_model", "hybrid_batching_benchmark"]
