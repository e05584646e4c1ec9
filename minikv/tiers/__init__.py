"""Step 7: a host offload tier for paged blocks (lesson: ``minikv.textbook.s7_rollback`` covers step 7's other half).

``tier``        ``OffloadTier``: demote on eviction, promote on a prefix hit, prefetch, a link cost model
``policies``    which blocks the host keeps: LRU, ARC, a seen-twice admission filter
``scheduling``  ``OffloadPolicy``: the scheduler's hook (prefetch for the next requests, price each step)
"""

from minikv.tiers.policies import ARC, LRU, POLICIES, SeenTwice, make_policy
from minikv.tiers.scheduling import OffloadPolicy
from minikv.tiers.tier import LINKS, CacheStorage, HostEntry, Link, OffloadTier, TierStats

__all__ = ["ARC", "CacheStorage", "HostEntry", "LINKS", "LRU", "Link", "OffloadPolicy", "OffloadTier", "POLICIES",
           "SeenTwice", "TierStats", "make_policy"]
