"""Step 6, paged: window and eviction policies over a paged KV cache (``PagedEvictingKVCache``).

The contiguous form (``minikv.window.ring.EvictingKVCache``) moves survivors into a ring of W slots.
A paged cache does not move anything: storage stays **append-only**, position p lives in slot
``table[p // bs] * bs + p % bs`` as in ``minikv.paged``, and ``write`` is inherited. What eviction
changes is bookkeeping, kept per sequence and indexed by *position*:

    alive, score, seen, evicted_at: [L, Hkv, n]      (n = the sequence's length)

``attend`` walks the sequence's blocks a tile at a time and gives ``window.attend_slots`` each
key's position where it is alive (the step's new tokens always are) and -1 elsewhere: a dropped
key, a stale slot past the length. The policy's rule (``visible``) does the rest, so every policy
of ``window`` and ``eviction`` runs unchanged, and with ``in-cache`` positions the alive keys go
through ``window.attend_in_cache``. At commit the masses feed ``score`` and ``seen`` and the
policy drops keys exactly as the contiguous cache does (the tests check both against
``eviction.MaskedRecompute``).

Blocks go back
--------------
Dropping a key frees nothing by itself: its slot is in the middle of a block. Once *every* token
of a full block is dropped in every layer and KV head, nothing can read the block any more and the
sequence gives it back (``EvictingBlockManager.release_block``; the table entry becomes a ``HOLE``), as
vLLM does for sliding windows. A window cache then holds about W / bs + 2 blocks however long the
text, and the scheduler sees the freed blocks as room to admit more. (H2O keeps scattered keys
per head, so its blocks rarely empty: paging saves it little; SnapKV frees the prompt's blocks
that no head kept.) A shared block (fork, prefix hit) loses only this sequence's reference.

Prefix sharing stays exact
--------------------------
A block is only worth sharing if its K/V equal what a full run would compute for that prefix. A
sequence's tokens are exact until its first eviction (until then every query saw every earlier
key: a window query that misses a key drops it at that step's commit). So at the first commit
that drops anything the sequence stops registering (``limit_sharing``: blocks filled before that
step stay shareable, the rest never enter the prefix cache), before the commit registers anything.
A registered block whose tokens a sequence later drops keeps exact K/V, so it stays shareable.
Score-based policies (H2O, SnapKV) refuse prefix caching: a prefix hit skips running those
tokens, so their scores (and SnapKV's prompt step) would be missing.
"""

from __future__ import annotations

import copy

import numpy as np

from minikv.errors import ConfigError, InvalidInputError
from minikv.paged.allocator import ceil_div, num_blocks_for
from minikv.paged.attention import default_blocks_per_tile
from minikv.paged.cache import PagedKVCache
from minikv.window.manager import HOLE, EvictingBlockManager
from minikv.window.ring import (
    NEVER,
    Policy,
    WindowPolicy,
    attend_in_cache,
    attend_slots,
    check_rope_table,
    truncate_refusal,
)


def reads_scores(policy: Policy) -> bool:
    """Whether ``policy`` needs the attention mass of its keys (H2O, SnapKV) rather than positions only."""
    return type(policy).mass_queries is not Policy.mass_queries


class _Book:
    """One sequence's eviction bookkeeping, by position: alive [L, Hkv, n] bool, score [L, Hkv, n]
    float64, seen [L, Hkv, n] int64, evicted_at [L, Hkv, n] int64 (None without a log), and
    ``evicted``: whether the sequence has dropped anything yet (then it shares no new block)."""

    def __init__(self, num_layers: int, num_kv_heads: int, n: int, log: bool):
        shape = (num_layers, num_kv_heads, n)
        self.alive = np.ones(shape, dtype=bool)
        self.score, self.seen = np.zeros(shape), np.zeros(shape, dtype=np.int64)
        self.evicted_at = np.full(shape, NEVER, dtype=np.int64) if log else None
        self.evicted = False

    def grow(self, t: int) -> None:
        """Append t new tokens: alive, no score yet, never evicted."""
        pad = [(0, 0), (0, 0), (0, t)]
        self.alive = np.pad(self.alive, pad, constant_values=True)
        self.score, self.seen = np.pad(self.score, pad), np.pad(self.seen, pad)
        if self.evicted_at is not None:
            self.evicted_at = np.pad(self.evicted_at, pad, constant_values=NEVER)

    def copy(self) -> _Book:
        return copy.deepcopy(self)


class PagedEvictingKVCache(PagedKVCache):
    """A paged cache that keeps what ``policy`` keeps (see the module docstring).

    policy:  a ``window.Policy`` (``WindowPolicy``, ``eviction.H2OPolicy``, ``eviction.SnapKVPolicy``)
    rope:    (cos, sin, layout), needed by ``in-cache`` positions only (the pools then hold pre-RoPE keys)
    log:     keep ``evicted_at`` (what ``MaskedRecompute`` needs)
    enable_prefix_caching: None = on for position-only policies (the window), off for H2O/SnapKV;
             True with a score-based policy raises ConfigError
    paged_options: the rest of ``PagedKVCache``'s options (num_host_blocks, hash_fn, blocks_per_tile)

    Storage: ``k_pool, v_pool: [L, num_blocks, block_size, Hkv, D]`` as in ``PagedKVCache``; per
    sequence a ``_Book`` of [L, Hkv, n] arrays.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int = 16, policy: Policy | None = None, dtype=np.float32, rope: tuple | None = None,
                 log: bool = True, enable_prefix_caching: bool | None = None, **paged_options):
        if not isinstance(policy, Policy):
            raise ConfigError(f"policy={policy!r}: pass a window.Policy, e.g. policy=WindowPolicy(128)")
        if enable_prefix_caching and reads_scores(policy):
            raise ConfigError(f"enable_prefix_caching=True with the {policy.name} policy: a prefix hit skips "
                              "running the cached tokens, so the attention scores the policy ranks keys by "
                              "(SnapKV: its whole prompt step) would be missing; use enable_prefix_caching=False")
        if policy.positions == "in-cache" and rope is None:
            raise ConfigError("positions='in-cache' re-rotates keys at attention time: pass rope=(cos, sin, layout)")
        check_rope_table(policy, rope)
        share = not reads_scores(policy) if enable_prefix_caching is None else bool(enable_prefix_caching)
        super().__init__(num_layers, num_kv_heads, head_dim, num_blocks, block_size, dtype,
                         enable_prefix_caching=share, **paged_options)
        self.policy, self.rope, self.log = policy, rope, bool(log)
        self.rotates_in_cache = policy.positions == "in-cache"
        self._books: dict = {}
        self._attended: set = set()  # layers that attended in the open step
        self._masses: dict = {}  # (layer, step index) -> (mass [Hkv, n], seen [Hkv, n]) of the open step

    def _new_manager(self, *args) -> EvictingBlockManager:
        return EvictingBlockManager(*args)  # tables with holes: blocks go back to the pool mid-sequence

    # -- sequences: the manager's bookkeeping, plus ours ---------------------------------------
    def _book(self, seq_id) -> _Book:
        """The sequence's eviction bookkeeping, started on first use with every cached token alive (a
        sequence added by ``add_sequence``, or admitted by the scheduler through ``blocks.admit``)."""
        if seq_id not in self._books:
            self._books[seq_id] = _Book(self.num_layers, self.num_kv_heads, self.length(seq_id), self.log)
        return self._books[seq_id]

    def free_sequence(self, seq_id) -> None:
        super().free_sequence(seq_id)
        self._books.pop(seq_id, None)

    def fork(self, parent_id, child_id) -> None:
        """The child shares the parent's blocks and starts from a copy of its bookkeeping."""
        book = self._book(parent_id)
        super().fork(parent_id, child_id)
        self._books[child_id] = book.copy()

    def _truncate(self, seq_id, new_len: int) -> None:
        raise truncate_refusal(self.policy, seq_id)

    # -- a step: attend over alive keys, then let the policy drop and give back empty blocks ----
    def _tiles(self, layer: int, i: int, book: _Book, n: int, t: int) -> list:
        """Tiles (k [Hkv, K, D], v, k_pos [Hkv, K]) of sequence i's real blocks; k_pos -1 = not alive."""
        bs, hkv, d = self.block_size, self.num_kv_heads, self.head_dim
        table = self._step_tables[i, :ceil_div(n, bs)].astype(np.int64)
        real = np.flatnonzero(table != HOLE)  # a hole holds no alive key: skip it
        alive = np.concatenate([book.alive[layer], np.ones((hkv, t), dtype=bool)], -1)   # [Hkv, n]
        per = self.blocks_per_tile or default_blocks_per_tile(bs)
        tiles = []
        for j in range(0, real.size, per):
            idx = real[j:j + per]
            pos = (idx[:, None] * bs + np.arange(bs)).ravel()                             # [K]
            live = np.zeros((hkv, pos.size), dtype=bool)
            live[:, pos < n] = alive[:, pos[pos < n]]
            k = self.k_pool[layer, table[idx]].reshape(-1, hkv, d).transpose(1, 0, 2)     # [Hkv, K, D]
            v = self.v_pool[layer, table[idx]].reshape(-1, hkv, d).transpose(1, 0, 2)
            tiles.append((k, v, np.where(live, pos, -1)))
        return tiles

    def attend(self, layer: int, q: np.ndarray) -> np.ndarray:
        """Attention of the step's queries (q: [N, Hq, D]) over each sequence's alive keys -> [N, Hq, D]."""
        step = self._check_query(layer, q)
        out = np.empty_like(q)
        self._attended.add(layer)
        for i, sid in enumerate(step.seq_ids):
            r, past, t = step.rows(i), int(step.past[i]), int(step.num_new[i])
            q_pos = step.positions[r]
            tiles = self._tiles(layer, i, self._book(sid), past + t, t)
            if self.rotates_in_cache:
                k, v, kp = (np.concatenate(x, 1) for x in zip(*tiles))
                out[r] = attend_in_cache(q[r], k, v, kp, q_pos, self.policy.visible, self.rope)
                continue
            rows = self.policy.mass_queries(past, t)
            res = attend_slots(q[r], tiles, lambda kp, q_pos=q_pos: self.policy.visible(q_pos, kp), rows)
            if rows is None:
                out[r] = res
                continue
            out[r] = res[0]
            mass, seen = np.zeros((self.num_kv_heads, past + t)), np.zeros((self.num_kv_heads, past + t), np.int64)
            for (_, _, kp), m, s in zip(tiles, res[1], res[2]):
                pos = kp.max(0)         # [K]: the slot's position where any head has it alive, else -1
                ok = pos >= 0           # masked keys got no mass: scattering only real positions is exact
                mass[:, pos[ok]], seen[:, pos[ok]] = m[:, ok], s[:, ok]
            self._masses[layer, i] = (mass, seen)
        return out

    def _commit(self, step) -> None:
        missing = sorted(set(range(self.num_layers)) - self._attended)
        if missing:  # checked before anything changes: a half-run step must not half-commit
            raise InvalidInputError(f"the step attended no queries at layers {missing}; every layer must write "
                                    "and attend before the step ends")
        self._attended.clear()
        for i, sid in enumerate(step.seq_ids):
            self._settle(i, sid, step)
        super()._commit(step)  # lengths advance; newly full blocks register, up to each share_limit
        for sid in step.seq_ids:
            self._release_dead(sid)
        self._masses.clear()

    def _rollback(self, step) -> None:
        self._masses.clear()
        self._attended.clear()
        super()._rollback(step)

    def _settle(self, i: int, sid, step) -> None:
        """Fold the step into one sequence's bookkeeping: scores, the policy's drops (logged), sharing."""
        b, past, t = self._book(sid), int(step.past[i]), int(step.num_new[i])
        last = past + t - 1
        b.grow(t)
        pos = np.where(b.alive, np.arange(past + t), -1)                    # [L, Hkv, n]
        dropped = False
        for layer in range(self.num_layers):
            if (layer, i) in self._masses:
                m, s = self._masses[layer, i]
                b.score[layer] += m
                b.seen[layer] += s
            keep = self.policy.keep(pos[layer], b.score[layer], b.seen[layer], last, past == 0)
            gone = b.alive[layer] & ~keep
            if gone.any():
                dropped = True
                if b.evicted_at is not None:
                    h, j = np.nonzero(gone)
                    b.evicted_at[layer, h, j] = self.policy.dropped_at(j, last)
            b.alive[layer] &= keep
            b.score[layer][~keep], b.seen[layer][~keep] = 0, 0
        if dropped and not b.evicted:
            # this step's tokens may have been computed under the mask: share only the blocks full before it
            b.evicted = True
            self.blocks.limit_sharing(sid, past // self.block_size)

    def _release_dead(self, sid) -> None:
        """Give back every full block none of whose tokens is alive in any layer and KV head."""
        b, s, bs = self._book(sid), self.blocks.state(sid), self.block_size
        full = s.length // bs
        if full == 0:
            return
        live = b.alive[:, :, :full * bs].reshape(self.num_layers, self.num_kv_heads, full, bs).any(axis=(0, 1, 3))
        for j in np.flatnonzero(~live):
            if s.block_table[j] != HOLE:
                self.blocks.release_block(sid, int(j))

    # -- inspection ------------------------------------------------------------------------------
    def peak_blocks(self, prompt_len: int, longest: int) -> int:
        """A window holds at most its sinks' blocks, the blocks its W - S - 1 latest keys span and the block
        being filled; a prompt step writes all of its tokens before the commit drops any. Other policies
        free only blocks whose every key they dropped, so their bound stays the full length's."""
        full = num_blocks_for(longest, self.block_size)
        if not isinstance(self.policy, WindowPolicy):
            return full
        bs, w, s = self.block_size, self.policy.window, self.policy.sinks
        window = ceil_div(s, bs) + (ceil_div(w - s - 1, bs) + 1) + 1
        return min(full, max(num_blocks_for(prompt_len, bs) + 1, window))

    def kept_positions(self, seq_id, layer: int) -> list[np.ndarray]:
        """The positions each KV head keeps at ``layer``, sorted: Hkv arrays."""
        self._check_layer(layer)
        self.blocks.state(seq_id)  # UnknownSequenceError for an unknown id
        return [np.flatnonzero(a) for a in self._book(seq_id).alive[layer]]

    def evicted_at(self, seq_id) -> np.ndarray:
        """[L, Hkv, n]: the first query position that no longer saw each key (NEVER: still kept)."""
        b = self._book(seq_id)
        if b.evicted_at is None:
            raise ConfigError("this cache was built with log=False, so it kept no eviction log")
        return b.evicted_at.copy()

    def read_kv(self, seq_id, layer: int):
        """Not defined once blocks are released (holes): read ``kept_positions`` and the pools instead."""
        if HOLE in self.blocks.state(seq_id).block_table:
            raise InvalidInputError(f"sequence {seq_id!r} gave blocks back to the pool; its history is no "
                                    "longer contiguous, so read_kv cannot gather it")
        return super().read_kv(seq_id, layer)

    def _live_slots(self) -> dict:
        """Device block id -> [L, Hkv, bs] bool: the (layer, head, slot)s some holder still reads."""
        bs, live = self.block_size, {}
        for sid, s in self.blocks.seqs.items():
            b = self._book(sid)
            for j, bid in enumerate(s.block_table):  # empty while swapped out
                if bid == HOLE:
                    continue
                a = b.alive[:, :, j * bs:(j + 1) * bs]
                a = np.pad(a, [(0, 0), (0, 0), (0, bs - a.shape[-1])])  # the tail past the length: nothing
                live[bid] = live[bid] | a if bid in live else a
        return live

    def memory_stats(self) -> dict:
        """``PagedKVCache.memory_stats`` with eviction: slots_used counts slots some holder still reads
        (in any layer and head); evicted_slots are filled slots nobody reads, in blocks still held."""
        st = super().memory_stats()
        used = sum(int(m.any(axis=(0, 1)).sum()) for m in self._live_slots().values())
        alloc = st["slots_allocated"]
        st.update(evicted_slots=st["slots_used"] - used, slots_used=used,
                  utilization=used / alloc if alloc else 1.0)
        return st

    def bytes_used(self) -> int:
        """Bytes of the K/V still read: 2 x D x itemsize per alive (layer, head, slot); a shared block once."""
        per = 2 * self.head_dim * self.dtype.itemsize
        return int(sum(int(m.sum()) for m in self._live_slots().values())) * per
