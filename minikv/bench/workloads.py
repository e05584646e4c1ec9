"""The batching benchmark: one synthetic workload, a paged cache against a contiguous one, same budget.

``Workload`` draws requests with lognormal prompt and output lengths, some
sharing a system prompt. ``batching_benchmark`` runs it twice through the same
``Scheduler`` on the same KV budget: once paged (``PagedPolicy``), once with the
contiguous baseline's policy.

The ``ReserveMaxLen`` policy ("contiguous")
-------------------------------------------
To compare with a contiguous cache *under the same scheduler and workload*,
``ReserveMaxLen(R)`` makes every admitted sequence reserve R positions up
front, as a cache preallocated to the maximum length does: at most
``num_blocks // ceil(R / block_size)`` sequences run at once, and nothing
is ever preempted. The K/V still live in the paged pool (so the numbers stay
exact), but the accounting is the contiguous one: utilization is real tokens
divided by ``running * R``. We chose this over ``ContiguousKVCache`` so
that the two sides differ only in memory policy, not in code path.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np

from minikv.errors import CacheFullError, ConfigError, check_int
from minikv.generate import bytes_per_token, paged_cache
from minikv.model import Model
from minikv.paged.allocator import num_blocks_for
from minikv.paged.cache import PagedKVCache
from minikv.scheduler import PagedPolicy, Request, Scheduler


class ReserveMaxLen(PagedPolicy):
    """The contiguous baseline: each running sequence holds ``reserve_len`` positions from admission on."""

    def __init__(self, reserve_len: int):
        self.reserve_len = check_int("reserve_len", reserve_len)
        self.slots = None

    def bind(self, cache: PagedKVCache) -> None:
        need = num_blocks_for(self.reserve_len, cache.block_size)
        self.slots = cache.num_blocks // need  # slabs of R that the pool can carve out
        if self.slots < 1:
            raise ConfigError(f"reserve_len={self.reserve_len} needs {need} blocks but the pool has "
                              f"{cache.num_blocks}; add blocks or lower reserve_len")

    def check(self, request: Request, longest: int) -> None:
        if longest > self.reserve_len:
            raise CacheFullError(f"request {request.id!r} may reach {longest} tokens but reserve_len="
                                 f"{self.reserve_len}; raise reserve_len")

    def admit(self, sched: Scheduler, seq, free: int) -> tuple[int, int] | None:
        if len(sched.running) >= self.slots:
            return None
        return sched.cache.blocks.admit(seq.request.id, seq.tokens, free_blocks=sched.cache.num_blocks)

    def account(self, sched: Scheduler) -> None:
        st = sched.stats
        used = sum(sched.cache.length(s.request.id) for s in sched.running)
        reserved = len(sched.running) * self.reserve_len
        st.used_slot_steps += used
        st.allocated_slot_steps += reserved
        st.reservation_waste_steps += reserved - used
        # whatever is left over once every slab of R is carved out can never hold a sequence
        st.external_waste_steps += sched.cache.num_blocks * sched.cache.block_size - self.slots * self.reserve_len


@dataclass(frozen=True)
class Workload:
    """Synthetic requests: lognormal prompt/output lengths, a shared system prompt on some of them.

    Lengths are drawn as ``round(median * exp(sigma * N(0, 1)))``, clipped to [lo, hi].
    """

    num_requests: int = 160
    prompt_median: float = 160.0
    prompt_sigma: float = 0.7
    prompt_range: tuple = (8, 640)
    output_median: float = 100.0
    output_sigma: float = 0.8
    output_range: tuple = (4, 320)
    shared_prefix_len: int = 64
    shared_fraction: float = 0.5
    vocab_size: int = 256
    seed: int = 0

    @property
    def max_len(self) -> int:
        """The longest a request can get: the reservation of a cache preallocated to max length."""
        return self.shared_prefix_len + self.prompt_range[1] + self.output_range[1] - 1

    def requests(self) -> list[Request]:
        rng = np.random.default_rng(self.seed)

        def lengths(median, sigma, lo_hi):
            x = np.round(median * np.exp(sigma * rng.standard_normal(self.num_requests)))
            return np.clip(x, *lo_hi).astype(int)

        p_len = lengths(self.prompt_median, self.prompt_sigma, self.prompt_range)
        o_len = lengths(self.output_median, self.output_sigma, self.output_range)
        system = rng.integers(0, self.vocab_size, self.shared_prefix_len).tolist()
        shared = rng.random(self.num_requests) < self.shared_fraction
        out = []
        for i in range(self.num_requests):
            body = rng.integers(0, self.vocab_size, p_len[i]).tolist()
            out.append(Request(i, (system + body) if shared[i] else body, int(o_len[i])))
        return out


def bench_model(workload: Workload) -> Model:
    """The tiny random model the batching benchmark runs by default (2 layers: seconds, not minutes)."""
    from minikv.weights.random_models import random_model

    return random_model(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                        intermediate_size=96, vocab_size=workload.vocab_size, max_position=2048, seed=workload.seed)


def batching_benchmark(workload: Workload | None = None, kv_budget_bytes: int = 4 << 20, block_size: int = 16,
                       preemption: str = "recompute", model: Model | None = None,
                       progress: Callable[[int], object] | None = None) -> dict:
    """Run one workload twice on the same KV budget — paged, and contiguous (reserve max_len) — and compare.

    The model defaults to a tiny random one (``random_model``, 2 layers) so the
    run takes seconds; memory behaviour does not depend on the model's size,
    only on bytes per token. Returns a dict with ``paged``, ``contiguous`` and
    ``concurrency_ratio`` (paged / contiguous max concurrent sequences). ``progress(n)``
    hears of every generated token of both runs (``2 * sum(max_new_tokens)`` in all).
    """
    wl = workload or Workload()
    model = bench_model(wl) if model is None else model
    if model.config.max_position < wl.max_len:
        raise ConfigError(f"model max_position={model.config.max_position} < workload max_len={wl.max_len}")
    per_token = bytes_per_token(model.new_cache_args(), model.dtype)  # the latent for an MLA model
    num_blocks = int(kv_budget_bytes) // (per_token * block_size)
    reqs = wl.requests()
    results = {}
    outputs = {}
    for side in ("paged", "contiguous"):
        paged = side == "paged"
        cache = paged_cache(model.new_cache_args(), num_blocks, block_size, model.dtype, enable_prefix_caching=paged,
                            num_host_blocks=num_blocks if paged and preemption == "swap" else 0)
        policy = None if paged else ReserveMaxLen(num_blocks_for(wl.max_len, block_size) * block_size)
        sched = Scheduler(model, cache, preemption=preemption if paged else "recompute", policy=policy,
                          progress=progress)
        t0 = time.perf_counter()
        outputs[side] = sched.run(reqs)
        results[side] = _side_summary(sched, time.perf_counter() - t0)
    lost = [r.id for r in reqs if r.id not in outputs["paged"] or r.id not in outputs["contiguous"]]
    return {
        "workload": {**asdict(wl), "max_len": wl.max_len},
        "kv_budget_bytes": int(kv_budget_bytes),
        "block_size": block_size,
        "num_blocks": num_blocks,
        "budget_tokens": num_blocks * block_size,
        "bytes_per_token": int(per_token),
        "preemption": preemption,
        "paged": results["paged"],
        "contiguous": results["contiguous"],
        "concurrency_ratio": results["paged"]["max_concurrency"] / results["contiguous"]["max_concurrency"],
        "throughput_ratio": results["paged"]["throughput_tokens_per_s"]
        / results["contiguous"]["throughput_tokens_per_s"],
        "requests_lost": len(lost),
        "identical_outputs": outputs["paged"] == outputs["contiguous"],
    }


def _side_summary(sched: Scheduler, wall: float) -> dict:
    """One side's numbers: utilization, concurrency, throughput, preemptions, waste."""
    st = sched.stats
    allocated = max(st.allocated_slot_steps, 1)
    return {
        "utilization": st.utilization,
        "max_concurrency": st.max_concurrency,
        "mean_concurrency": st.running_seq_steps / max(st.steps, 1),
        "throughput_tokens_per_s": st.generated_tokens / wall,
        "wall_s": wall,
        "steps": st.steps,
        "generated_tokens": st.generated_tokens,
        "forward_tokens": st.forward_tokens,
        "preemptions": st.preemptions,
        "preemptions_recompute": st.preemptions_recompute,
        "preemptions_swap": st.preemptions_swap,
        "prefix_hit_rate": st.prefix_hit_rate,
        "waste_of_allocated": {"internal": st.internal_waste_steps / allocated,
                               "reservation": st.reservation_waste_steps / allocated},
        "waste_of_budget": st.summary()["waste_of_budget"],
        "reserve_len": getattr(sched.policy, "reserve_len", None),
    }


def format_benchmark(res: dict) -> str:
    """The human-readable table of ``batching_benchmark``'s result."""
    wl = res["workload"]
    lines = [f"workload: {wl['num_requests']} requests, lognormal prompts (median {wl['prompt_median']:.0f}) and "
             f"outputs (median {wl['output_median']:.0f}), {wl['shared_prefix_len']}-token system prompt on "
             f"{wl['shared_fraction']:.0%}; KV budget {res['kv_budget_bytes'] / 2**20:.2f} MiB = "
             f"{res['budget_tokens']} tokens ({res['num_blocks']} blocks of {res['block_size']}); "
             f"contiguous reserves {res['contiguous']['reserve_len']} per sequence",
             f"{'':30s}{'paged':>12s}{'contiguous':>12s}"]
    rows = [("utilization", "utilization", "{:.1%}"), ("max concurrent seqs", "max_concurrency", "{}"),
            ("throughput (tok/s)", "throughput_tokens_per_s", "{:.0f}"), ("steps", "steps", "{}"),
            ("preemptions", "preemptions", "{}"), ("prefix hit rate", "prefix_hit_rate", "{:.1%}")]
    for label, key, fmt in rows:
        lines.append(f"{label:30s}{fmt.format(res['paged'][key]):>12s}{fmt.format(res['contiguous'][key]):>12s}")
    for kind in ("internal", "reservation", "external"):
        p, c = res["paged"]["waste_of_budget"][kind], res["contiguous"]["waste_of_budget"][kind]
        lines.append(f"{kind + ' waste (of budget)':30s}{p:>12.1%}{c:>12.1%}")
    lines.append(f"concurrency ratio paged/contiguous: {res['concurrency_ratio']:.2f}x, throughput ratio "
                 f"{res['throughput_ratio']:.2f}x, requests lost: {res['requests_lost']}, "
                 f"identical outputs: {res['identical_outputs']}")
    return "\n".join(lines)


__all__ = ["ReserveMaxLen", "Workload", "bench_model", "batching_benchmark", "format_benchmark"]
