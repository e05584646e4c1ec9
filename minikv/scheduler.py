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

Memory policy
-------------
*Whether* a request fits is the scheduler's one question to its ``policy``
(``PagedPolicy`` by default: the pool must hold the blocks of the prompt after
its prefix-cache hit, asked once per request). The policy also samples the
memory picture after every step. ``minikv.bench.workloads.ReserveMaxLen`` is the
contiguous baseline's policy, used only to measure what paging saves.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Callable, Hashable, Sequence

import numpy as np

from minikv.errors import CacheFullError, ConfigError, InvalidInputError, check_choice, check_int
from minikv.model import Model
from minikv.paged.allocator import num_blocks_for
from minikv.paged.cache import PagedKVCache
from minikv.sampling import GREEDY, SamplingParams, sample

PREEMPTION_MODES = ("recompute", "swap")


@dataclass
class Request:
    """One generation request.

    id:             any hashable, unique among the scheduler's requests
    prompt_ids:     the prompt's token ids (at least one)
    max_new_tokens: stop after this many generated tokens (>= 1)
    eos_token_id:   stop after generating this token (None: never; pass
                    ``model.config.eos_token_id`` for the usual behaviour)
    sampling:       how to pick its tokens (``minikv.sampling``; default greedy). A seeded
                    request gives the tokens ``generate`` gives it alone: it keeps its own rng.
    """

    id: Hashable
    prompt_ids: Sequence[int]
    max_new_tokens: int
    eos_token_id: int | None = None
    sampling: SamplingParams = GREEDY


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
    rng: np.random.Generator | None = None  # this request's sampler state (None for greedy)

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


class PagedPolicy:
    """The scheduler's memory policy: admit a request when the pool holds its prompt's blocks.

    Blocks come as tokens arrive; ``admit`` asks the cache once per request (one walk of
    the prefix cache), ``account`` samples the paged memory picture after each step.
    """

    def bind(self, cache: PagedKVCache) -> None:
        """Called once with the scheduler's cache (a policy may size itself from the pool)."""

    def check(self, request: Request, longest: int) -> None:
        """Refuse a request this policy could never run (raise CacheFullError); ``longest`` in tokens."""

    def admit(self, sched: "Scheduler", seq: "_Seq", free: int) -> tuple[int, int] | None:
        """Add ``seq`` to the cache if it fits in ``free`` blocks: (cached tokens, blocks consumed), or None."""
        return sched.cache.blocks.admit(seq.request.id, seq.tokens, free)

    def account(self, sched: "Scheduler") -> None:
        """Add this step's memory picture to ``sched.stats`` (before finished sequences leave)."""
        st, m = sched.stats, sched.cache.memory_stats()
        st.used_slot_steps += m["slots_used"]
        st.allocated_slot_steps += m["slots_allocated"]
        st.internal_waste_steps += m["internal_waste"]
        # any free block can take any sequence's next token, so there is no external waste


class Scheduler:
    """Continuous batching of ``Request`` s on one model and one ``PagedKVCache``.

    model:            the ``Model`` to run
    cache:            a ``PagedKVCache`` built with ``model.new_cache_args()`` (its pool is the memory budget)
    preemption:       "recompute" or "swap" (swap needs ``num_host_blocks`` > 0 on the cache)
    max_num_seqs:     most sequences running at once
    max_step_tokens:  most tokens in one forward pass (None: no limit); longer prompts are chunked
    sample_fn:        ``sample_fn(logits [V], request) -> token id`` replaces the requests'
                      own ``sampling`` (None: ``minikv.sampling.sample`` with each request's params)
    policy:           the memory policy (default ``PagedPolicy``; see the module docstring)
    watermark_blocks: keep this many blocks free when admitting, so that a fresh
                      admission does not force a preemption at the very next step
    progress:         ``progress(n)`` is called after every step with the tokens it generated
                      (e.g. a tqdm bar's ``update``); None: no progress reporting
    """

    def __init__(self, model: Model, cache: PagedKVCache, preemption: str = "recompute", max_num_seqs: int = 256,
                 max_step_tokens: int | None = None, sample_fn: Callable | None = None,
                 policy: PagedPolicy | None = None, watermark_blocks: int = 0,
                 progress: Callable[[int], object] | None = None):
        if not isinstance(cache, PagedKVCache):
            raise ConfigError(f"the scheduler needs a PagedKVCache, got {type(cache).__name__}")
        c = model.config
        if (cache.num_layers, cache.num_kv_heads, cache.head_dim) != (c.num_layers, c.num_kv_heads, c.head_dim):
            raise ConfigError("cache geometry does not match the model; build it with model.new_cache_args()")
        self.preemption = check_choice("preemption", preemption, PREEMPTION_MODES)
        if preemption == "swap" and cache.blocks.host_allocator is None:
            raise ConfigError("preemption='swap' needs a host pool: build the cache with num_host_blocks > 0")
        self.max_num_seqs = check_int("max_num_seqs", max_num_seqs)
        self.watermark_blocks = check_int("watermark_blocks", watermark_blocks, minimum=0)
        self.max_step_tokens = None if max_step_tokens is None else check_int("max_step_tokens", max_step_tokens)
        for name, fn, use in (("sample_fn", sample_fn, "sample_fn(logits, request)"),
                              ("progress", progress, "progress(num_tokens)")):
            if fn is not None and not callable(fn):
                raise ConfigError(f"{name}={fn!r} must be callable as {use}")
        self.model, self.cache = model, cache
        self.sample_fn, self.progress = sample_fn, progress
        self.policy = PagedPolicy() if policy is None else policy
        self.policy.bind(cache)
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
        n = check_int(f"request {request.id!r}: max_new_tokens", request.max_new_tokens, error=InvalidInputError)
        # the last generated token is never fed back, so the cache holds at most prompt + n - 1 tokens
        longest = prompt.size + n - 1
        if longest > self.model.config.max_position:
            raise InvalidInputError(f"request {request.id!r} may reach {longest} tokens, beyond the model's "
                                    f"max_position={self.model.config.max_position}; lower max_new_tokens")
        need = self.cache.peak_blocks(prompt.size, longest)  # a window cache returns blocks as it slides
        if need > self.cache.num_blocks:
            raise CacheFullError(f"request {request.id!r} may need {need} blocks but the pool has only "
                                 f"{self.cache.num_blocks}; build a larger cache or lower max_new_tokens")
        self.policy.check(request, longest)
        if not isinstance(request.sampling, SamplingParams):
            raise InvalidInputError(f"request {request.id!r}: sampling={request.sampling!r}; "
                                    "pass a minikv.sampling.SamplingParams")
        seq = _Seq(request, self._arrivals, prompt.tolist(), prompt.size, rng=request.sampling.new_rng())
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

    def run(self, requests: Sequence[Request] = ()) -> dict:
        """Queue ``requests`` and step until everything is finished; returns {request id: generated ids}."""
        for r in requests:
            self.add_request(r)
        while self.has_work():
            self.step()
        return {rid: list(s.output) for rid, s in self.finished.items()}

    # -- one step: the phases of the module docstring ------------------------------------------------
    def step(self) -> list:
        """Schedule and run one forward pass. Returns the ids of requests that finished in it.

        1. keep the running sequences going (preempt the newest while they do not fit);
        2. swap in, then admit waiting requests in arrival order (skipped after a preemption);
        3. one forward pass over everything scheduled, then sample and retire.
        """
        t0, generated = time.perf_counter(), self.stats.generated_tokens
        seqs, nums, preempted = self._fit_running()
        if not preempted:
            free = self.cache.blocks.num_free - self._blocks_for(seqs, nums)
            free, budget = self._swap_in(free, self._budget() - sum(nums))
            self._admit(free, budget)
        # The final plan orders decodes first, so it can hand tokens out differently from the
        # estimates above; if it no longer fits, the newest sequences give way, as in phase 1.
        seqs, nums, _ = self._fit_running()
        if not seqs:
            if self.has_work():
                raise RuntimeError("scheduler made no progress although requests remain; this is a bug")
            return []
        done = self._forward(seqs, nums)
        self._record(nums, t0, generated)  # before finished sequences leave: they count in this step
        self._retire(done)
        return [s.request.id for s in done]

    def _record(self, nums: list, t0: float, generated: int) -> None:
        """The step's statistics: concurrency, the policy's memory picture, tokens, time, progress."""
        st = self.stats
        st.max_concurrency = max(st.max_concurrency, len(self.running))
        st.running_seq_steps += len(self.running)
        st.budget_slot_steps += self.cache.num_blocks * self.cache.block_size
        self.policy.account(self)
        st.steps += 1
        st.forward_tokens += sum(nums)
        st.wall_s += time.perf_counter() - t0
        if self.progress is not None:
            self.progress(st.generated_tokens - generated)

    def _budget(self) -> float:
        return self.max_step_tokens if self.max_step_tokens is not None else float("inf")

    def _plan(self) -> tuple[list, list]:
        """(sequences, token counts) of the running set under the step's token budget; decodes first."""
        budget = self._budget()
        seqs, nums = [], []
        for s in sorted(self.running, key=lambda s: (s.pending > 1, s.arrival)):
            n = min(s.pending, budget)
            if n > 0:
                seqs.append(s)
                nums.append(int(n))
                budget -= n
        return seqs, nums

    def _blocks_for(self, seqs, nums) -> int:
        return self.cache.blocks.blocks_needed([s.request.id for s in seqs], nums) if seqs else 0

    def _fit_running(self) -> tuple[list, list, bool]:
        """Phase 1: plan the running set; while it does not fit, preempt the newest sequence."""
        seqs, nums = self._plan()
        preempted = False
        while self._blocks_for(seqs, nums) > self.cache.blocks.num_free:
            self._preempt(self.running.pop())  # latest arrival: the least claim to the memory
            preempted = True
            seqs, nums = self._plan()
        return seqs, nums, preempted

    def _preempt(self, seq: _Seq) -> None:
        sid = seq.request.id
        blocks = self.cache.blocks
        if self.preemption == "swap" and blocks.host_allocator.num_free >= blocks.held(sid):
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

    def _swap_in(self, free: int, budget: float) -> tuple[int, float]:
        """Phase 2a: swapped sequences come back before anything new is admitted (they arrived earlier)."""
        cache = self.cache
        while self.swapped and len(self.running) < self.max_num_seqs:
            s = self.swapped[0]
            # its blocks come back, plus whatever its pending tokens (a decode, or a prefill chunk) need
            n = min(s.pending, budget)
            length = cache.length(s.request.id)
            need = cache.blocks.held(s.request.id) + (num_blocks_for(length + n, cache.block_size)
                                                          - num_blocks_for(length, cache.block_size))
            if n < 1 or need + (self.watermark_blocks if self.running else 0) > free:
                break
            self.swapped.popleft()
            cache.swap_in(s.request.id)
            self.stats.swap_ins += 1
            s.state = "running"
            bisect.insort(self.running, s, key=lambda x: x.arrival)
            free, budget = free - need, budget - n
        return free, budget

    def _admit(self, free: int, budget: float) -> None:
        """Phase 2b: new (or recompute-preempted) requests, strictly in arrival order, while they fit."""
        while not self.swapped and self.waiting and budget >= 1 and len(self.running) < self.max_num_seqs:
            s = self.waiting[0]
            got = self.policy.admit(self, s, free - (self.watermark_blocks if self.running else 0))
            if got is None:
                break
            cached, cost = got
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

    def _forward(self, seqs: list, nums: list) -> list:
        """Phase 3: one packed forward pass; a token for every sequence whose pending tokens are all in.

        The tokens are sampled before the cache commits the step (``Model.forward``'s ``then``): a
        sampler that raises rolls the step back and leaves every request as it was (its rng too), so
        the next ``step()`` runs the same tokens again. Nothing below that can fail changes state.
        """
        toks = [s.tokens[s.num_computed:s.num_computed + n] for s, n in zip(seqs, nums, strict=True)]
        picks: dict = {}  # index in seqs -> the token sampled for it

        def sample_all(logits: np.ndarray) -> None:  # [B, V]: each sequence's last fed token
            saved = [(s, s.rng.bit_generator.state) for s in seqs if s.rng is not None]
            try:
                for i, (s, n, row) in enumerate(zip(seqs, nums, logits, strict=True)):
                    if s.pending == n:  # this chunk completes what was pending (not a partial prefill)
                        picks[i] = self._sample(s, row)
            except BaseException:
                for s, state in saved:
                    s.rng.bit_generator.state = state
                picks.clear()
                raise

        self.model.forward(toks, self.cache, [s.request.id for s in seqs], then=sample_all)
        done = []
        for i, (s, n) in enumerate(zip(seqs, nums, strict=True)):
            s.num_computed += n
            if i not in picks:  # a prefill chunk: the prompt is not finished yet
                continue
            tok = picks[i]
            s.tokens.append(tok)
            self.cache.blocks.extend_token_ids(s.request.id, [tok])
            self.stats.generated_tokens += 1
            eos = s.request.eos_token_id
            if len(s.tokens) - s.num_prompt >= s.request.max_new_tokens or (eos is not None and tok == eos):
                done.append(s)
        return done

    def _sample(self, s: _Seq, row: np.ndarray) -> int:
        if self.sample_fn is None:
            return sample(row, s.request.sampling, s.rng)
        tok = self.sample_fn(row, s.request)
        vocab = self.model.config.vocab_size
        if not isinstance(tok, (int, np.integer)) or isinstance(tok, bool) or not 0 <= tok < vocab:
            raise InvalidInputError(f"sample_fn returned {tok!r} for request {s.request.id!r}; it must return a "
                                    f"token id in [0, {vocab})")
        return int(tok)

    def _retire(self, done: list) -> None:
        for s in done:
            self.cache.free_sequence(s.request.id)
            self.running.remove(s)
            s.state = "finished"
            self.finished[s.request.id] = s
        self.stats.finished += len(done)


__all__ = ["PREEMPTION_MODES", "PagedPolicy", "Request", "Scheduler", "SchedulerStats"]
