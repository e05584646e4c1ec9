"""Step 7, the scheduler's side of the host tier: prefetch for the next requests after each step, price the step.

``OffloadPolicy`` is a memory policy of ``minikv.scheduler.Scheduler`` (it extends ``PagedPolicy``):
admission is the paged cache's, and after every step it promotes the host blocks of the next waiting
requests into free device blocks (``OffloadTier.prefetch``) and closes the step's transfer accounting
(``OffloadTier.end_step``). This is the one file of the tier that knows the scheduler; the tier
itself (``minikv.tiers.tier``) only knows the paged cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from minikv.errors import ConfigError, check_int
from minikv.paged.cache import PagedKVCache
from minikv.scheduler import PagedPolicy
from minikv.tiers.tier import OffloadTier


@dataclass
class OffloadPolicy(PagedPolicy):
    """The scheduler's policy with a tier: after every step, prefetch for the next requests and price the step.

    compute_s(tokens, kv_tokens) -> seconds: the compute time of a step that ran ``tokens`` tokens
    over ``kv_tokens`` stored K/V tokens (the bench derives it from a model's bytes, FLOPs and a
    GPU's peaks); None: 0 (nothing is hidden). lookahead: waiting requests whose host blocks are
    prefetched; prefetch=False turns prefetching off. ``tier=None`` only prices the steps (a
    device-only baseline); ``compute_total_s`` sums the steps' compute times either way.
    """

    tier: OffloadTier | None
    compute_s: Callable[[int, int], float] | None = None
    lookahead: int = 4
    prefetch: bool = True
    compute_total_s: float = 0.0
    _computed: dict = field(default_factory=dict)  # request id -> tokens computed at the last look

    def bind(self, cache: PagedKVCache) -> None:
        if self.tier is not None and cache is not self.tier.cache:
            raise ConfigError("OffloadPolicy's tier belongs to another cache; build the tier on the scheduler's")
        check_int("lookahead", self.lookahead, minimum=0)

    def admit(self, sched, seq, free: int) -> tuple[int, int] | None:
        got = super().admit(sched, seq, free)
        if got is not None:
            self._computed[seq.request.id] = got[0]  # cached tokens cost no compute
        return got

    def account(self, sched) -> None:
        super().account(sched)
        cache, tokens = sched.cache, 0
        for s in sched.running:
            tokens += s.num_computed - self._computed.get(s.request.id, 0)
            self._computed[s.request.id] = s.num_computed
        kv = sum(cache.length(s.request.id) for s in sched.running)
        seconds = 0.0 if self.compute_s is None else float(self.compute_s(tokens, kv))
        self.compute_total_s += seconds
        if self.tier is None:
            return
        if self.prefetch and self.lookahead:
            # leave one free block per running sequence for its next token
            room = cache.blocks.num_free - len(sched.running) - sched.watermark_blocks
            self.tier.prefetch([s.tokens for s in sched.waiting[:self.lookahead]], max(room, 0))
        self.tier.end_step(seconds)
