"""Step 3b: continuous batching over the paged cache — admission, mixed steps, preemption.

A static batch starts B requests together and waits for the slowest one; its
slots idle as the short ones finish. *Continuous batching* re-forms the batch
at every step: finished sequences leave at once and waiting requests join as
soon as there are free blocks for them.

One step of ``Scheduler.step()``
--------------------------------
1. **Keep the running sequences going.** Each running sequence has *pending*
   tokens: its whole uncomputed prompt right after admission (prefill), or the
   one token it sampled last (decode). Prefill and decode are the same thing
   here: "run ``tokens[num_computed:]``". If the pool cannot hold what the
   running sequences need, the most recently admitted one is **preempted**,
   and so on until the rest fits:
     * ``"recompute"``: its blocks are freed and it goes back to the front of
       the waiting queue with prompt + generated tokens as its new prompt; a
       later prefill recomputes them (the prefix cache often still holds
       its full blocks, so little is really recomputed);
     * ``"swap"``: its blocks are copied to the cache's host pool and freed; it
       is copied back (``swap_in``) before any new request is admitted. If the
       host pool is full it falls back to recompute.
2. **Swap in**, then **admit** waiting requests in arrival order while the
   pool has the blocks their prompt needs (after the prefix-cache hit) and the
   step's token budget lasts. A request never jumps the queue.
3. **One forward pass** over all scheduled sequences, packed (prefill chunks
   and decode tokens mixed), then sample a token for every sequence whose
   pending tokens are all computed. A sequence stops at ``eos_token_id`` or
   after ``max_new_tokens`` and frees its blocks.

``max_step_tokens`` caps the tokens of one forward pass; prompts longer than
what is left are split over several steps (chunked prefill), decodes go first.

Preemption never changes the output: the same tokens are fed at the same
positions, so greedy decoding gives the tokens of a run with unlimited memory
(tests check it, in float64 where batch composition cannot flip a near tie).

The ``reserve_len`` policy ("contiguous")
-----------------------------------------
To compare with a contiguous cache *under the same scheduler and workload*,
``reserve_len=R`` makes every admitted sequence reserve R positions up
front, as a cache preallocated to the maximum length does: at most
``num_blocks // ceil(R / block_size)`` sequences run at once, and nothing
is ever preempted. The K/V still live in the paged pool (so the numbers stay
exact), but the accounting is the contiguous one: utilization is real tokens
divided by ``running * R``. We chose this over ``ContiguousKVCache`` so
that the two sides differ only in memory policy, not in code path.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Callable, Hashable, Sequence

import numpy as np

from minikv.errors import CacheFullError, ConfigError, InvalidInputError
from minikv.model import Model
from minikv.paged import PagedKVCache, num_blocks_for

PREEMPTION_MODES = ("recompute", "swap")


@dataclass
class Request:
    """One generation request.

    id:             any hashable, unique among the scheduler's requests
    prompt_ids:     the prompt's token ids (at least one)
    max_new_tokens: stop after this many generated tokens (>= 1)
    eos_token_id:   stop after generating this token (None: never; pass
                    ``model.config.eos_token_id`` for the usual behaviour)
    """

    id: Hashable
    prompt_ids: Sequence[int]
    max_new_tokens: int
    eos_token_id: int | None = None


def greedy(logits: np.ndarray, request: Request) -> int:
    """The default ``sample_fn``: argmax of logits [V]."""
    return int(np.argmax(logits))


@dataclass
class _Seq:
    """A request inside the scheduler. ``tokens`` = prompt + generated; K/V exist for ``tokens[:num_computed]``."""

    request: Request
    arrival: int
    tokens: list
    num_prompt: int
    num_computed: int = 0
    state: str = "waiting"  # waiting | running | swapped | finished
    admitted_once: bool = False

    @property
    def output(self) -> list:
        return self.tokens[self.num_prompt:]

    @property
    def pending(self) -> int:
        return len(self.tokens) - self.num_computed


@dataclass
class SchedulerStats:
    """Counters over a run. Slot sums add one sample per step, so ratios are step-weighted averages."""

    steps: int = 0
    forward_tokens: int = 0        # tokens run through the model (prefill + decode + recompute)
    generated_tokens: int = 0
    finished: int = 0
    preemptions_recompute: int = 0
    preemptions_swap: int = 0
    swap_ins: int = 0
    max_concurrency: int = 0       # most sequences holding K/V in one step
    running_seq_steps: int = 0     # running sequences summed over steps (mean concurrency = this / steps)
    prompt_tokens: int = 0         # prompt tokens of first admissions
    prefix_hit_tokens: int = 0     # of those, found in the prefix cache
    recompute_hit_tokens: int = 0  # tokens a re-admitted (preempted) sequence found cached
    used_slot_steps: int = 0       # token slots holding real tokens, summed over steps
    allocated_slot_steps: int = 0  # slots allocated (paged: blocks in use; contiguous: R per sequence)
    internal_waste_steps: int = 0  # empty tails of last blocks
    reservation_waste_steps: int = 0  # reserved for tokens not generated yet (contiguous only)
    external_waste_steps: int = 0  # free slots too scattered to hold one more sequence
    budget_slot_steps: int = 0     # the whole budget, summed over steps
    wall_s: float = 0.0            # time spent in step() (scheduling + forward passes)

    @property
    def preemptions(self) -> int:
        return self.preemptions_recompute + self.preemptions_swap

    @property
    def utilization(self) -> float:
        return self.used_slot_steps / self.allocated_slot_steps if self.allocated_slot_steps else 1.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def summary(self) -> dict:
        d = asdict(self)
        budget = max(self.budget_slot_steps, 1)
        d.update(preemptions=self.preemptions, utilization=self.utilization, prefix_hit_rate=self.prefix_hit_rate,
                 throughput_tokens_per_s=self.generated_tokens / self.wall_s if self.wall_s else float("nan"),
                 waste_of_budget={"internal": self.internal_waste_steps / budget,
                                  "reservation": self.reservation_waste_steps / budget,
                                  "external": self.external_waste_steps / budget})
        return d


class Scheduler:
    """Continuous batching of ``Request`` s on one model and one ``PagedKVCache``.

    model:            the ``Model`` to run
    cache:            a ``PagedKVCache`` built with ``model.new_cache_args()`` (its pool is the memory budget)
    preemption:       "recompute" or "swap" (swap needs ``num_host_blocks`` > 0 on the cache)
    max_num_seqs:     most sequences running at once
    max_step_tokens:  most tokens in one forward pass (None: no limit); longer prompts are chunked
    sample_fn:        ``sample_fn(logits [V], request) -> token id``; default greedy argmax
    reserve_len:      the contiguous policy (module docstring): each sequence reserves this many
                      positions up front; None = paged (allocate blocks as tokens arrive)
    watermark_blocks: keep this many blocks free when admitting, so that a fresh
                      admission does not force a preemption at the very next step
    """

    def __init__(self, model: Model, cache: PagedKVCache, preemption: str = "recompute", max_num_seqs: int = 256,
                 max_step_tokens: int | None = None, sample_fn: Callable | None = None,
                 reserve_len: int | None = None, watermark_blocks: int = 0):
        if not isinstance(cache, PagedKVCache):
            raise ConfigError(f"the scheduler needs a PagedKVCache, got {type(cache).__name__}")
        c = model.config
        if (cache.num_layers, cache.num_kv_heads, cache.head_dim) != (c.num_layers, c.num_kv_heads, c.head_dim):
            raise ConfigError("cache geometry does not match the model; build it with model.new_cache_args()")
        if preemption not in PREEMPTION_MODES:
            raise ConfigError(f"preemption={preemption!r}; use one of {PREEMPTION_MODES}")
        if preemption == "swap" and cache.host_allocator is None:
            raise ConfigError("preemption='swap' needs a host pool: build the cache with num_host_blocks > 0")
        for name, val, lo in (("max_num_seqs", max_num_seqs, 1), ("watermark_blocks", watermark_blocks, 0)):
            if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < lo:
                raise ConfigError(f"{name}={val!r} must be an integer >= {lo}")
        for name, val in (("max_step_tokens", max_step_tokens), ("reserve_len", reserve_len)):
            if val is not None and (isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < 1):
                raise ConfigError(f"{name}={val!r} must be a positive integer or None")
        if sample_fn is not None and not callable(sample_fn):
            raise ConfigError(f"sample_fn={sample_fn!r} must be callable as sample_fn(logits, request)")
        self.model, self.cache = model, cache
        self.preemption = preemption
        self.max_num_seqs = int(max_num_seqs)
        self.max_step_tokens = max_step_tokens
        self.sample_fn = greedy if sample_fn is None else sample_fn
        self.reserve_len = reserve_len
        self.watermark_blocks = int(watermark_blocks)
        self.contiguous_slots = None
        if reserve_len is not None:
            self.contiguous_slots = cache.num_blocks // num_blocks_for(reserve_len, cache.block_size)
            if self.contiguous_slots < 1:
                raise ConfigError(f"reserve_len={reserve_len} needs {num_blocks_for(reserve_len, cache.block_size)}"
                                  f" blocks but the pool has {cache.num_blocks}; add blocks or lower reserve_len")
        self.waiting: list = []          # _Seq, sorted by arrival
        self.running: list = []          # _Seq, sorted by arrival
        self.swapped: deque = deque()    # _Seq, in the order they were swapped out
        self.finished: dict = {}         # request id -> _Seq
        self._all: dict = {}             # request id -> _Seq
        self._arrivals = 0
        self.stats = SchedulerStats()

    # -- requests ---------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request. Raises if it is malformed or could never fit in the pool."""
        if not isinstance(request, Request):
            raise InvalidInputError(f"expected a Request, got {type(request).__name__}")
        try:
            known = request.id in self._all
        except TypeError:
            raise InvalidInputError(f"request id {request.id!r} is not hashable") from None
        if known:
            raise InvalidInputError(f"request id {request.id!r} is already queued; ids must be unique")
        (prompt,) = self.model.check_tokens([request.prompt_ids])  # raises on empty / out-of-vocab ids
        n = request.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise InvalidInputError(f"request {request.id!r}: max_new_tokens={n!r}; use an integer >= 1")
        # the last generated token is never fed back, so the cache holds at most prompt + n - 1 tokens
        longest = prompt.size + int(n) - 1
        if longest > self.model.config.max_position:
            raise InvalidInputError(f"request {request.id!r} may reach {longest} tokens, beyond the model's "
                                    f"max_position={self.model.config.max_position}; lower max_new_tokens")
        need = num_blocks_for(longest, self.cache.block_size)
        if need > self.cache.num_blocks:
            raise CacheFullError(f"request {request.id!r} may need {need} blocks but the pool has only "
                                 f"{self.cache.num_blocks}; build a larger cache or lower max_new_tokens")
        if self.reserve_len is not None and longest > self.reserve_len:
            raise CacheFullError(f"request {request.id!r} may reach {longest} tokens but reserve_len="
                                 f"{self.reserve_len}; raise reserve_len")
        seq = _Seq(request, self._arrivals, prompt.tolist(), prompt.size)
        self._arrivals += 1
        self._all[request.id] = seq
        self.waiting.append(seq)  # arrivals only grow, so the list stays sorted

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def output(self, request_id) -> list[int]:
        """Generated token ids of a request so far (finished or not)."""
        try:
            return list(self._all[request_id].output)
        except (KeyError, TypeError):
            raise InvalidInputError(f"no request with id {request_id!r}") from None

    # -- preemption ---------------------------------------------------------------------------------
    def _preempt(self, seq: _Seq) -> None:
        sid = seq.request.id
        if self.preemption == "swap" and self.cache.host_allocator.num_free >= len(self.cache.block_table(sid)):
            self.cache.swap_out(sid)
            seq.state = "swapped"
            self.swapped.append(seq)
            self.stats.preemptions_swap += 1
            return
        # recompute: forget the K/V; the generated tokens become part of the prompt to prefill again
        self.cache.free_sequence(sid)
        seq.num_computed = 0
        seq.state = "waiting"
        bisect.insort(self.waiting, seq, key=lambda s: s.arrival)
        self.stats.preemptions_recompute += 1

    # -- one step -------------------------------------------------------------------------------------
    def _plan(self) -> tuple[list, list]:
        """(sequences, token counts) of the running set under the step's token budget; decodes first."""
        budget = self.max_step_tokens if self.max_step_tokens is not None else float("inf")
        order = sorted(self.running, key=lambda s: (s.pending > 1, s.arrival))
        seqs, nums = [], []
        for s in order:
            n = min(s.pending, budget)
            if n <= 0:
                continue
            seqs.append(s)
            nums.append(int(n))
            budget -= n
        return seqs, nums

    def _blocks_for(self, seqs, nums) -> int:
        return self.cache.blocks_needed([s.request.id for s in seqs], nums) if seqs else 0

    def step(self) -> list:
        """Schedule and run one forward pass. Returns the ids of requests that finished in it."""
        t0 = time.perf_counter()
        cache = self.cache
        preempted = False
        # 1. the running sequences must fit; otherwise preempt the newest ones
        seqs, nums = self._plan()
        while self._blocks_for(seqs, nums) > cache.num_free_blocks:
            victim = self.running.pop()  # latest arrival: the least claim to the memory
            self._preempt(victim)
            preempted = True
            seqs, nums = self._plan()
        free = cache.num_free_blocks - self._blocks_for(seqs, nums)
        budget = (self.max_step_tokens if self.max_step_tokens is not None else float("inf")) - sum(nums)

        # 2. swapped sequences come back before anything new is admitted (they arrived earlier)
        while not preempted and self.swapped and len(self.running) < self.max_num_seqs:
            s = self.swapped[0]
            sid = s.request.id
            # its blocks come back, plus whatever its pending tokens (a decode, or a prefill chunk) need
            n = min(s.pending, budget)
            need = num_blocks_for(cache.length(sid) + n, cache.block_size)
            if n < 1 or need + (self.watermark_blocks if self.running else 0) > free:
                break
            self.swapped.popleft()
            cache.swap_in(sid)
            self.stats.swap_ins += 1
            s.state = "running"
            bisect.insort(self.running, s, key=lambda x: x.arrival)
            free -= need
            budget -= n

        # then new (or recompute-preempted) requests, strictly in arrival order
        while not preempted and not self.swapped and self.waiting and budget >= 1 \
                and len(self.running) < self.max_num_seqs:
            s = self.waiting[0]
            if self.contiguous_slots is not None:
                if len(self.running) >= self.contiguous_slots:
                    break
            elif cache.admission_cost(s.tokens) + (self.watermark_blocks if self.running else 0) > free:
                break
            sid = s.request.id
            cost = cache.admission_cost(s.tokens)
            cached = cache.add_sequence(sid, prompt_ids=s.tokens)
            if not s.admitted_once:
                self.stats.prompt_tokens += s.num_prompt
                self.stats.prefix_hit_tokens += cached
                s.admitted_once = True
            else:
                self.stats.recompute_hit_tokens += cached
            s.num_computed = cached
            s.state = "running"
            self.waiting.pop(0)
            bisect.insort(self.running, s, key=lambda x: x.arrival)
            free -= cost
            budget -= min(s.pending, budget)

        # 3. one forward pass over everything scheduled. The final plan orders decodes first, so
        # it can hand tokens out differently from the estimates above; if it no longer fits, the
        # newest sequences give way, exactly as in phase 1.
        seqs, nums = self._plan()
        while self._blocks_for(seqs, nums) > cache.num_free_blocks:
            self._preempt(self.running.pop())
            seqs, nums = self._plan()
        if not seqs:
            if self.has_work():
                raise RuntimeError("scheduler made no progress although requests remain; this is a bug")
            return []
        ids = [s.request.id for s in seqs]
        toks = [s.tokens[s.num_computed:s.num_computed + n] for s, n in zip(seqs, nums, strict=True)]
        logits = self.model.forward(toks, cache, ids)  # [B, V]: each sequence's last fed token
        done = []
        for s, n, row in zip(seqs, nums, logits, strict=True):
            s.num_computed += n
            if s.pending:  # a prefill chunk: the prompt is not finished yet
                continue
            tok = int(self.sample_fn(row, s.request))
            s.tokens.append(tok)
            cache.extend_token_ids(s.request.id, [tok])
            self.stats.generated_tokens += 1
            out = len(s.tokens) - s.num_prompt
            if out >= s.request.max_new_tokens or (s.request.eos_token_id is not None
                                                   and tok == s.request.eos_token_id):
                done.append(s)
        self._account()
        for s in done:
            cache.free_sequence(s.request.id)
            self.running.remove(s)
            s.state = "finished"
            self.finished[s.request.id] = s
        self.stats.finished += len(done)
        self.stats.steps += 1
        self.stats.forward_tokens += sum(nums)
        self.stats.wall_s += time.perf_counter() - t0
        return [s.request.id for s in done]

    def _account(self) -> None:
        """Sample the memory picture after a forward pass (before finished sequences leave)."""
        st, cache = self.stats, self.cache
        st.max_concurrency = max(st.max_concurrency, len(self.running))
        st.running_seq_steps += len(self.running)
        budget = cache.num_blocks * cache.block_size
        st.budget_slot_steps += budget
        if self.reserve_len is None:
            m = cache.memory_stats()
            st.used_slot_steps += m["slots_used"]
            st.allocated_slot_steps += m["slots_allocated"]
            st.internal_waste_steps += m["internal_waste"]
            # paged: any free block can take any sequence's next token, so no external waste
        else:
            used = sum(cache.length(s.request.id) for s in self.running)
            reserved = len(self.running) * self.reserve_len
            st.used_slot_steps += used
            st.allocated_slot_steps += reserved
            st.reservation_waste_steps += reserved - used
            # whatever is left over once every slab of R is carved out can never hold a sequence
            st.external_waste_steps += budget - self.contiguous_slots * self.reserve_len

    def run(self, requests: Sequence[Request] = ()) -> dict:
        """Queue ``requests`` and step until everything is finished; returns {request id: generated ids}."""
        for r in requests:
            self.add_request(r)
        while self.has_work():
            self.step()
        return {rid: list(s.output) for rid, s in self.finished.items()}


# --- a synthetic workload and the batching benchmark ----------------------------------------------------

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


def batching_benchmark(workload: Workload | None = None, kv_budget_bytes: int = 4 << 20, block_size: int = 16,
                       preemption: str = "recompute", model: Model | None = None) -> dict:
    """Run one workload twice on the same KV budget — paged, and contiguous (reserve max_len) — and compare.

    The model defaults to a tiny random one (``random_model``, 2 layers) so the
    run takes seconds; memory behaviour does not depend on the model's size,
    only on bytes per token. Returns a dict with ``paged``, ``contiguous`` and
    ``concurrency_ratio`` (paged / contiguous max concurrent sequences).
    """
    from minikv.model import random_model

    wl = workload or Workload()
    if model is None:
        model = random_model(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                             intermediate_size=96, vocab_size=wl.vocab_size, max_position=2048, seed=wl.seed)
    if model.config.max_position < wl.max_len:
        raise ConfigError(f"model max_position={model.config.max_position} < workload max_len={wl.max_len}")
    per_token = 2 * model.config.num_layers * model.config.num_kv_heads * model.config.head_dim \
        * np.dtype(model.dtype).itemsize
    num_blocks = int(kv_budget_bytes) // (per_token * block_size)
    reqs = wl.requests()
    results = {}
    outputs = {}
    for side in ("paged", "contiguous"):
        paged = side == "paged"
        cache = PagedKVCache(**model.new_cache_args(), num_blocks=num_blocks, block_size=block_size,
                             dtype=model.dtype, enable_prefix_caching=paged,
                             num_host_blocks=num_blocks if paged and preemption == "swap" else 0)
        sched = Scheduler(model, cache, preemption=preemption if paged else "recompute",
                          reserve_len=None if paged else num_blocks_for(wl.max_len, block_size) * block_size)
        t0 = time.perf_counter()
        outputs[side] = sched.run(reqs)
        wall = time.perf_counter() - t0
        st = sched.stats
        summary = st.summary()
        results[side] = {
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
            "waste_of_allocated": {
                "internal": st.internal_waste_steps / max(st.allocated_slot_steps, 1),
                "reservation": st.reservation_waste_steps / max(st.allocated_slot_steps, 1)},
            "waste_of_budget": summary["waste_of_budget"],
            "reserve_len": sched.reserve_len,
        }
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


__all__ = ["PREEMPTION_MODES", "Request", "Scheduler", "SchedulerStats", "Workload", "batching_benchmark",
           "format_benchmark", "greedy"]
