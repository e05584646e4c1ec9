"""Step 6: window and eviction (lesson: ``minikv.textbook.s6_window``).

``ring``       the policy interface, the window with sinks, attention over slots in any order, the contiguous
               evicting cache (a ring of W slots)
``scores``     H2O and SnapKV: keep the keys attention used
``manager``    a block manager whose tables can have holes (blocks given back mid-sequence)
``paged``      the same policies over a paged cache whose dead blocks return to the pool
``reference``  ``MaskedRecompute``: the exact reference, one forward with the mask the cache logged
"""

from minikv.window.manager import HOLE, EvictingBlockManager
from minikv.window.paged import PagedEvictingKVCache, reads_scores
from minikv.window.reference import MaskedRecompute
from minikv.window.ring import (
                                NEVER,
                                POSITIONS,
                                EvictingKVCache,
                                Policy,
                                WindowPolicy,
                                attend_in_cache,
                                attend_slots,
                                check_rope_table,
                                rank_positions,
                                truncate_refusal,
)
from minikv.window.scores import (
                                H2O_SCORES,
                                POLICIES,
                                POLICY_OPTIONS,
                                POOLINGS,
                                REQUIRED,
                                H2OPolicy,
                                PrefillOnly,
                                SnapKVPolicy,
                                make_policy,
                                pool1d,
)

__all__ = ["EvictingBlockManager", "EvictingKVCache", "H2OPolicy", "H2O_SCORES", "HOLE", "MaskedRecompute", "NEVER",
           "POLICIES", "POLICY_OPTIONS", "POOLINGS", "POSITIONS", "PagedEvictingKVCache", "Policy", "PrefillOnly",
           "REQUIRED", "SnapKVPolicy", "WindowPolicy", "attend_in_cache", "attend_slots", "check_rope_table",
           "make_policy", "pool1d", "rank_positions", "reads_scores", "truncate_refusal"]
