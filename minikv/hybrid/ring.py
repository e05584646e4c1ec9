"""Step 9, the sliding group's ring: step 6's window ring with K more slots, so that it can roll back.

A sliding layer's query t sees keys t - W + 1 .. t. Between steps its ring needs only the W - 1
newest keys (the next query brings its own), so step 6's ring of W slots holds W - 1 keys then,
and a step's new keys are attended from where ``write`` left them. That ring cannot take tokens
back: once it has wrapped, the key a rolled-back query needs has been overwritten.

Speculative decoding writes a verify step of 1 + k tokens and may take up to k of them back
(``truncate``). After a truncate to ``new_len`` the next query, at position new_len, needs the
keys new_len - W + 1 .. new_len - 1. So a ring that keeps **W + K slots** (K: the largest draft
length in use) holds the W - 1 + K newest keys between steps, and any truncate that takes back
at most K tokens finds every key it needs::

    W = 4, K = 2: slots p mod 6; after the step that wrote position 9 the ring holds 5 6 7 8 9 (W - 1 + K)
    truncate to 8 (2 back): the query at 8 needs 5 6 7: held    truncate to 7 (3 back): needs 4 5 6: 4 is gone

The rule is what the ring holds, not how far one call goes: every commit raises the sequence's
``floor`` (the oldest position still held, never lowered by a truncate), and a truncate is exact
iff the keys it needs start at or after the floor. Two truncates of K each with no step between
them need 2K; the second raises ``RollbackError`` naming K. A verify step of 1 + k tokens (k <= K)
always fits: after it the ring holds the W - 1 + K keys before the new length, and taking back k of
them leaves the W - 1 the next query needs.

``SlidingRingKVCache`` is ``minikv.window.ring.EvictingKVCache`` with that policy (``SlidingWindow``)
and a ``truncate``; the paged sliding group (``minikv.hybrid.paged``) keeps the same floor.
"""

from __future__ import annotations

import numpy as np

from minikv.errors import ConfigError, RollbackError, check_int
from minikv.kv_cache import lookup_sequence
from minikv.window.ring import EvictingKVCache, WindowPolicy


class SlidingWindow(WindowPolicy):
    """A sliding layer's window W (no sinks) kept in a ring of W + K slots: the W - 1 + K newest keys
    survive each step, so that a truncate of up to K tokens stays exact."""

    name = "sliding"

    def __init__(self, window: int, rollback: int = 0):
        super().__init__(window)
        self.rollback = check_int("rollback", rollback, minimum=0, error=ConfigError,
                                  hint="K, the largest draft length a verify step may take back (0: none)")
        self.capacity = self.window + self.rollback

    def keep(self, pos, score, seen, last, first_step):
        return (pos >= 0) & (last + 1 - pos < self.capacity)

    def ring_slot(self, p: int) -> int:
        return p % self.capacity

    def describe(self):
        return {**super().describe(), "rollback": self.rollback}


def floor_after(length: int, window: int, rollback: int) -> int:
    """The oldest position a sliding group still holds after a step that ended at ``length`` tokens:
    the W - 1 + K newest keys are kept."""
    return max(0, length - (window - 1) - rollback)


def rollback_refusal(seq_id, length: int, new_len: int, floor: int, window: int, rollback: int):
    """The ``RollbackError`` of a truncate from ``length`` to ``new_len`` tokens that needs keys below
    ``floor`` (the oldest one held), or None when every key the next query needs is held."""
    need = max(0, new_len - (window - 1))
    if need >= floor or new_len == length:
        return None
    return RollbackError(
        f"sequence {seq_id!r}: truncating from {length} to {new_len} tokens needs the keys from position {need} "
        f"on, but this sliding group (window W={window}) keeps only the W - 1 + K = {window - 1 + rollback} newest "
        f"(K={rollback}, the largest draft length it was built for), from position {floor}; take back at most "
        f"K={rollback} tokens between steps, or build the cache with rollback >= {length - new_len}")


class SlidingRingKVCache(EvictingKVCache):
    """The ring of one sliding group: per sequence ``W + K`` slots per layer and KV head (step 6's storage).

    num_layers:  the group's layers; window: W; rollback: K (0: truncate only what no commit dropped)
    Storage as ``EvictingKVCache`` (no eviction log: a sliding layer's mask is its window, nothing to log).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, window: int, rollback: int = 0,
                 max_seqs: int = 1, dtype=np.float32):
        super().__init__(num_layers, num_kv_heads, head_dim, SlidingWindow(window, rollback), max_seqs, dtype,
                         log=False)
        self._floor: dict = {}  # seq_id -> the oldest position still held

    def add_sequence(self, seq_id) -> None:
        super().add_sequence(seq_id)
        self._floor[seq_id] = 0

    def free_sequence(self, seq_id) -> None:
        super().free_sequence(seq_id)
        del self._floor[seq_id]

    def _commit(self, step) -> None:
        super()._commit(step)
        p = self.policy
        for sid in step.seq_ids:
            self._floor[sid] = max(self._floor[sid], floor_after(self._seqs[sid].length, p.window, p.rollback))

    def refusal(self, seq_id, new_len: int):
        """Why ``truncate(seq_id, new_len)`` would be refused (a ``RollbackError``), or None."""
        s, p = lookup_sequence(self._seqs, seq_id), self.policy
        return rollback_refusal(seq_id, s.length, new_len, self._floor[seq_id], p.window, p.rollback)

    def _truncate(self, seq_id, new_len: int) -> None:
        error = self.refusal(seq_id, new_len)
        if error is not None:
            raise error
        s = self._seqs[seq_id]
        s.pos[s.pos >= new_len] = -1  # their slots are free again; the next step's tokens take them
        s.length = new_len
