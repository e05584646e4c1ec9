"""The offload benchmark: a multi-turn chat trace on a small device pool, with and without a host tier.

``ChatTrace``: conversations open one every ``arrival_every`` steps, each with one of a few shared
system prompts; a turn's prompt is the whole conversation so far plus a new user message, and
the next turn arrives ``think_steps`` steps after the reply is done. Between turns the small
device pool evicts the conversation's blocks; the host tier keeps them findable.

``offload_benchmark`` runs the trace through the same ``Scheduler`` (preemption by recompute):
once on an unlimited device pool (the reference tokens), once on the small pool alone
(``device_only``), and once per policy on the small pool plus the host tier. The tiny random
model computes in float64, so ``outputs_identical`` is an exact check.

The priced model
----------------
The block traffic is counted on the tiny model's run and priced as if the blocks were those of
``PRICED_AS`` (Llama-3-8B in fp16: 128 KiB of K/V per token, 16.06 GB of weights) on an H100
SXM (``HBM_BYTES_PER_S`` 3.35 TB/s, ``PEAK_FLOPS`` 989 TFLOP/s dense bf16, the NVIDIA H100
datasheet, as in docs/cheatsheet.md): a step computes for
``max((weights + kv_tokens x kv_bytes_per_token) / HBM, 2 x params x tokens / peak)``.
That lower bound ignores kernel overheads, so it hides less transfer time than a real step would.
"""

from __future__ import annotations

import heapq
from dataclasses import asdict, dataclass

import numpy as np

from minikv.costs import get_preset, kv_bytes_per_token, param_count, weights_bytes
from minikv.errors import check_choice, check_int
from minikv.generate import paged_cache
from minikv.paged.allocator import num_blocks_for
from minikv.paged.cache import check_pool_memory
from minikv.scheduler import Request, Scheduler
from minikv.tiers.scheduling import OffloadPolicy
from minikv.tiers.tier import LINKS, OffloadTier
from minikv.weights.random_models import random_model

PRICED_AS = ("llama3-8b", "fp16")
HBM_BYTES_PER_S = 3.35e12  # H100 SXM HBM3 (NVIDIA H100 Tensor Core GPU datasheet)
PEAK_FLOPS = 989e12        # H100 SXM dense bf16 (same datasheet)
BENCH_POLICIES = ("lru", "arc", "seen_twice")
DEFINITIONS = {
    "hit_rate": "prompt tokens of first admissions found cached (device prefix cache, or the host tier and "
                "promoted) / prompt tokens",
    "host_hit_rate": "full prompt blocks the device missed that the host served / full prompt blocks the device missed",
    "bytes_moved": "device->host + host->device bytes, blocks priced as priced_as",
    "stall_s": "transfer time steps waited for: promotions not prefetched, demotions, prefetch beyond its "
               "step's compute",
    "hidden_s": "prefetch transfer time under a step's compute",
    "compute_s": "sum over steps of max((weights + kv_tokens x kv_bytes_per_token) / HBM, 2 params tokens / peak)",
    "max_concurrency": "most sequences running in one step (the admitted concurrency)",
}


@dataclass(frozen=True)
class ChatTrace:
    """Multi-turn conversations sharing ``system_prompts`` system prompts (see the module docstring)."""

    conversations: int = 24
    turns: int = 4
    system_prompts: int = 3
    system_len: int = 64
    user_len: tuple = (8, 24)
    reply_len: int = 8
    think_steps: int = 3
    arrival_every: int = 2
    vocab_size: int = 101
    seed: int = 0

    def system(self) -> list[list[int]]:
        rng = np.random.default_rng([self.seed, 1])
        return [rng.integers(0, self.vocab_size - 1, self.system_len).tolist() for _ in range(self.system_prompts)]

    def user_messages(self) -> list[list[list[int]]]:
        """[conversation][turn] -> token ids (never the EOS id, which is vocab_size - 1)."""
        rng = np.random.default_rng([self.seed, 2])
        lo, hi = self.user_len
        return [[rng.integers(0, self.vocab_size - 1, int(rng.integers(lo, hi + 1))).tolist()
                 for _ in range(self.turns)] for _ in range(self.conversations)]

    def max_len(self) -> int:
        return self.system_len + self.turns * (self.user_len[1] + self.reply_len)


def run_trace(trace: ChatTrace, sched: Scheduler) -> dict:
    """Feed the trace's turns as they arrive and step until all are done; {(conversation, turn): tokens}."""
    system, users = trace.system(), trace.user_messages()
    convs = {c: list(system[c % trace.system_prompts]) for c in range(trace.conversations)}
    arrivals = [(c * trace.arrival_every, c, 0) for c in range(trace.conversations)]
    heapq.heapify(arrivals)
    step, outputs = 0, {}
    while arrivals or sched.has_work():
        while arrivals and arrivals[0][0] <= step:
            _, c, t = heapq.heappop(arrivals)
            convs[c] += users[c][t]
            sched.add_request(Request((c, t), list(convs[c]), trace.reply_len))
        if not sched.has_work():
            step = arrivals[0][0]
            continue
        for c, t in sched.step():
            outputs[(c, t)] = sched.output((c, t))
            convs[c] += outputs[(c, t)]
            if t + 1 < trace.turns:
                heapq.heappush(arrivals, (step + trace.think_steps, c, t + 1))
        step += 1
    return outputs


def priced_model() -> dict:
    """The geometry the blocks are priced as, and the compute-time bound's inputs (module docstring)."""
    shape = get_preset(PRICED_AS[0])
    return {"model": PRICED_AS[0], "dtype": PRICED_AS[1], "kv_bytes_per_token": kv_bytes_per_token(shape, PRICED_AS[1]),
            "weights_bytes": weights_bytes(shape, PRICED_AS[1]), "params": param_count(shape)["total"],
            "hbm_bytes_per_s": HBM_BYTES_PER_S, "peak_flops": PEAK_FLOPS,
            "source": "NVIDIA H100 SXM datasheet: 3.35 TB/s HBM3, 989 TFLOP/s dense bf16"}


def step_seconds(priced: dict):
    """compute_s(tokens, kv_tokens) of ``OffloadPolicy``: the larger of the bytes bound and the FLOPs bound."""
    def compute_s(tokens: int, kv_tokens: int) -> float:
        read = priced["weights_bytes"] + kv_tokens * priced["kv_bytes_per_token"]
        return max(read / priced["hbm_bytes_per_s"], 2 * priced["params"] * tokens / priced["peak_flops"])
    return compute_s


def _side(stats, policy: OffloadPolicy) -> dict:
    tier = policy.tier
    out = {"hit_rate": stats.prefix_hit_rate, "bytes_moved": 0, "stall_s": 0.0, "compute_s": policy.compute_total_s,
           "max_concurrency": stats.max_concurrency,
           "mean_concurrency": stats.running_seq_steps / stats.steps if stats.steps else 0.0,
           "steps": stats.steps, "forward_tokens": stats.forward_tokens, "preemptions": stats.preemptions}
    if tier is not None:
        t = tier.stats
        out.update(bytes_moved=t.bytes_moved, stall_s=t.stall_s, hidden_s=t.hidden_s,
                   host_hit_rate=t.host_hits / t.host_lookups if t.host_lookups else 0.0,
                   demoted=t.demoted, promoted=t.promoted, prefetched=t.prefetched,
                   prefetch_used=t.prefetch_used, host_evictions=t.host_evictions)
    return out


def offload_benchmark(trace: ChatTrace = ChatTrace(), device_blocks: int = 48, host_blocks: int = 64,
                      block_size: int = 16, link: str = "pcie5", max_step_tokens: int = 128,
                      names: dict | None = None) -> dict:
    """Run the trace: unlimited pool (reference), small pool alone, small pool + tier per policy.

    Every pool is checked against the memory available before the first run (``names``: the flags that
    set ``block_size``, ``num_blocks`` (device_blocks) and ``num_host_blocks``, for the refusal)."""
    check_int("device_blocks", device_blocks)
    check_int("host_blocks", host_blocks)
    check_choice("link", link, tuple(LINKS))
    model = random_model(vocab_size=trace.vocab_size, max_position=trace.max_len() + 1, seed=trace.seed,
                         dtype=np.float64)
    args, priced = model.new_cache_args(), priced_model()
    unlimited = trace.conversations * num_blocks_for(trace.max_len(), check_int("block_size", block_size)) + 1
    check_pool_memory(**args, num_blocks=max(unlimited, device_blocks), block_size=block_size, dtype=np.float64,
                      num_host_blocks=host_blocks, names=names)
    block_bytes = priced["kv_bytes_per_token"] * block_size
    compute_s = step_seconds(priced)

    def run(num_blocks: int, policy: str | None):
        cache = paged_cache(args, num_blocks, block_size, np.float64, num_host_blocks=host_blocks if policy else 0)
        tier = None if policy is None else OffloadTier(cache, policy, link=link, bytes_per_block=block_bytes)
        pol = OffloadPolicy(tier, compute_s=compute_s)
        sched = Scheduler(model, cache, max_step_tokens=max_step_tokens, policy=pol)
        outputs = run_trace(trace, sched)
        if tier is not None:
            tier.finish()
        return outputs, _side(sched.stats, pol)

    reference, _ = run(unlimited, None)
    device_outputs, device_only = run(device_blocks, None)
    policies, identical = {}, device_outputs == reference
    for name in BENCH_POLICIES:
        outputs, policies[name] = run(device_blocks, name)
        identical = identical and outputs == reference
    return {"trace": asdict(trace), "device_blocks": device_blocks, "host_blocks": host_blocks,
            "block_size": block_size, "max_step_tokens": max_step_tokens, "link": link,
            "link_bytes_per_s": LINKS[link].bytes_per_s, "priced_as": priced, "kv_bytes_per_block": block_bytes,
            "policies": policies, "device_only": device_only, "outputs_identical": identical,
            "definitions": DEFINITIONS}


def format_offload(res: dict) -> str:
    """The human-readable table of ``offload_benchmark``'s result."""
    lines = [f"bench offload: {res['trace']['conversations']} conversations x {res['trace']['turns']} turns, "
             f"device pool {res['device_blocks']} blocks + host {res['host_blocks']} blocks of {res['block_size']}, "
             f"link {res['link']}; blocks priced as {res['priced_as']['model']} {res['priced_as']['dtype']}",
             f"{'policy':<12}{'hit rate':>9}{'host hits':>10}{'MB moved':>10}{'stall ms':>10}{'hidden ms':>10}"
             f"{'compute ms':>11}{'max conc':>9}{'steps':>7}"]
    rows = [("device_only", res["device_only"])] + list(res["policies"].items())
    for name, r in rows:
        lines.append(f"{name:<12}{r['hit_rate']:>9.3f}{r.get('host_hit_rate', 0.0):>10.3f}"
                     f"{r['bytes_moved'] / 1e6:>10.1f}{r['stall_s'] * 1e3:>10.3f}{r.get('hidden_s', 0.0) * 1e3:>10.3f}"
                     f"{r.get('compute_s', float('nan')) * 1e3:>11.1f}{r['max_concurrency']:>9}{r['steps']:>7}")
    lines.append(f"outputs identical to an unlimited device pool: {res['outputs_identical']}")
    return "\n".join(lines)


__all__ = ["BENCH_POLICIES", "ChatTrace", "format_offload", "offload_benchmark", "priced_model", "run_trace",
           "step_seconds"]
