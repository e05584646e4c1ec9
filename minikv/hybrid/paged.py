"""Step 9, paged: one group's cache over the hybrid pool (``minikv.hybrid.pool``); sliding groups give blocks back.

Each group of a hybrid model is a step-3 ``PagedKVCache`` of its S layers whose manager allocates
from the shared pool (``GroupAllocator``) and whose storage is the shared ``[S, num_blocks, bs,
Hkv, D]`` pools: a block id belongs to one group at a time, so the groups never write the same
rows. A full group is exactly that (``GroupPagedKVCache``). A sliding group (``SlidingPagedKVCache``)
adds three things:

* **attention over its window**: a query at position t reads the blocks of t - W + 1 .. t only,
  through ``minikv.window.ring.attend_slots`` with the window rule (keys past the step: -1);
* **blocks go back**: after each commit the group holds the W - 1 + K newest positions (K: the
  rollback it was built for, ``minikv.hybrid.ring``); a full block all of whose positions are
  older goes back to the pool (step 6's ``EvictingBlockManager.release_block``: the table entry
  becomes a ``HOLE``; a registered block stays in the prefix cache until the LRU list evicts it);
* **a prefix cache anchored on the full group**. Step 6 stops sharing a sequence's blocks at its
  first eviction: under a window *policy* the later K/V were computed with keys already gone, so
  they are not what the model computes for that prefix. For a sliding *layer* the window is the
  model: its K/V are exact, and a hit at position h needs only the blocks of the last W - 1
  tokens before h. So the group registers every full block, under the hash of the full group's
  block at the same index (its *anchor*, whose chain of token and parent comparisons proves the
  prefix), and a hit checks the anchor's identity and the tokens (``GroupAllocator.twin``). The
  blocks before the window are not needed: the hit leaves ``HOLE``s there (``minikv.hybrid.blocks``
  chooses the hit over all groups). ``sliding_rule=False`` keeps step 6's rule, for comparison.
"""

from __future__ import annotations

import numpy as np

from minikv.errors import InvalidInputError
from minikv.hybrid.pool import GroupAllocator, SharedPool
from minikv.hybrid.ring import SlidingWindow, floor_after, rollback_refusal
from minikv.paged.allocator import Block, ceil_div, num_blocks_for
from minikv.paged.attention import default_blocks_per_tile, slot_mapping
from minikv.paged.cache import PagedKVCache
from minikv.paged.manager import BlockManager
from minikv.window.manager import HOLE, EvictingBlockManager
from minikv.window.ring import attend_slots


class _GroupManager:
    """What the hybrid manager (``minikv.hybrid.blocks.HybridBlocks``) asks every group's manager first."""

    def check_new(self, seq_id) -> None:
        """Refuse (InvalidInputError) an id no group may take, before any group changes."""
        self._check_new(seq_id)


class GroupBlockManager(_GroupManager, BlockManager):
    """A full group's block tables over the shared pool (``minikv.hybrid.pool.GroupAllocator``)."""

    def __init__(self, pool: SharedPool, block_size: int, enable_prefix_caching: bool = True):
        super().__init__(1, block_size, 0, enable_prefix_caching)
        self.allocator = GroupAllocator(pool, block_size, enable_prefix_caching)

    def attach(self, seq_id, tokens: list | None, hit: list) -> int:
        """Start ``seq_id`` on the blocks ``hit`` the hybrid manager chose for every group; its cached tokens."""
        self._check_new(seq_id)
        return self._add(seq_id, tokens, hit)


class SlidingBlockManager(_GroupManager, EvictingBlockManager):
    """A sliding group's block tables: holes where blocks went back, a floor per sequence, twin registration.

    anchor:       the full group's manager whose blocks anchor this group's prefix cache (None: no sharing)
    window, rollback: W and K (``minikv.hybrid.ring.SlidingWindow``)
    sliding_rule: True: register every full block, hit on the window's blocks; False: step 6's rule
    """

    def __init__(self, pool: SharedPool, block_size: int, window: int, rollback: int = 0,
                 anchor: BlockManager | None = None, enable_prefix_caching: bool = True, sliding_rule: bool = True):
        super().__init__(1, block_size, 0, enable_prefix_caching and anchor is not None)
        self.allocator = GroupAllocator(pool, block_size, self.allocator.enable_prefix_caching)
        self.policy, self.anchor, self.sliding_rule = SlidingWindow(window, rollback), anchor, sliding_rule
        self.floor: dict = {}      # seq_id -> the oldest position still held (minikv.hybrid.ring)
        self._released: dict = {}  # seq_id -> leading table entries already given back (or never held)

    def attach(self, seq_id, tokens: list | None, hit: list) -> int:
        """As ``GroupBlockManager.attach``; ``hit`` may start with HOLEs (blocks before the window)."""
        self._check_new(seq_id)
        n = self._add(seq_id, tokens, [b for b in hit if b != HOLE])
        s = self.seqs[seq_id]
        s.block_table, s.length, s.num_registered = list(hit), len(hit) * self.block_size, len(hit)
        self.prefix_hit_tokens += s.length - n if tokens is not None and self.allocator.enable_prefix_caching else 0
        self.floor[seq_id] = floor_after(s.length, self.policy.window, 0)  # a hit brings the window, not K more
        self._released[seq_id] = hit.count(HOLE)
        return s.length

    def add_sequence(self, seq_id, prompt_ids=None) -> int:
        """A sequence with nothing cached (the hybrid manager chooses prefix hits: ``attach``)."""
        return self.attach(seq_id, None if prompt_ids is None else [int(t) for t in prompt_ids], [])

    def first_needed(self, n: int) -> int:
        """The first block a hit of ``n`` blocks must reuse: the one of position n * bs - (W - 1) (0: step 6's rule)."""
        if not self.sliding_rule:
            return 0
        return max(0, n * self.block_size - (self.policy.window - 1)) // self.block_size

    def twins(self, anchors: list[Block], tokens, lo: int, n: int) -> tuple[list | None, int]:
        """This group's blocks lo .. n - 1 for a prompt whose anchor blocks are ``anchors``:
        (their ids, n), or (None, the first index that is not cached)."""
        bs, out = self.block_size, []
        for j in range(lo, n):
            bid = self.allocator.twin(anchors[j], tokens[j * bs:(j + 1) * bs])
            if bid is None:
                return None, j
            out.append(bid)
        return out, n

    def _register_full(self, seq_id, s) -> None:
        """Register the sequence's newly full blocks as twins of the anchor's (which registered them first)."""
        if not self.allocator.enable_prefix_caching or s.token_ids is None or seq_id not in self.anchor.seqs:
            return
        bs, table = self.block_size, self.anchor.seqs[seq_id].block_table
        for i in range(s.num_registered, min(self._shareable(seq_id, s), len(table))):
            anchor = self.anchor.allocator.blocks[table[i]]
            if anchor.hash is None:
                break
            self.allocator.register_twin(s.block_table[i], anchor, s.token_ids[i * bs:(i + 1) * bs])
            s.num_registered = i + 1

    def commit(self, step) -> None:
        """Lengths advance and full blocks register (step 3); then the floors rise and old blocks go back."""
        w, k = self.policy.window, self.policy.rollback
        for sid, past, n in zip(step.seq_ids, step.past, step.num_new):
            if not self.sliding_rule and floor_after(int(past + n), w, k) > 0:
                self.limit_sharing(sid, int(past) // self.block_size)  # step 6: the first drop ends sharing
        super().commit(step)
        for sid in step.seq_ids:
            self.floor[sid] = max(self.floor[sid], floor_after(self.seqs[sid].length, w, k))
            self._release_below(sid)

    def _release_below(self, seq_id) -> None:
        """Give back every block all of whose positions are older than the floor."""
        s, j = self.seqs[seq_id], self._released[seq_id]
        while (j + 1) * self.block_size <= self.floor[seq_id]:
            if s.block_table[j] != HOLE:
                self.release_block(seq_id, j)
            j += 1
        self._released[seq_id] = j

    def refusal(self, seq_id, new_len: int):
        """The ``RollbackError`` of truncating ``seq_id`` to ``new_len`` tokens, or None (``minikv.hybrid.ring``)."""
        s, p = self.state(seq_id), self.policy
        return rollback_refusal(seq_id, s.length, new_len, self.floor[seq_id], p.window, p.rollback)

    def fork(self, parent_id, child_id) -> None:
        super().fork(parent_id, child_id)
        self.floor[child_id], self._released[child_id] = self.floor[parent_id], self._released[parent_id]

    def free_sequence(self, seq_id) -> None:
        super().free_sequence(seq_id)
        del self.floor[seq_id], self._released[seq_id]

    def alive_slots(self) -> np.ndarray:
        """The pool slots (block * bs + offset) some sequence still reads: its positions floor .. length - 1."""
        slots = [slot_mapping(s.block_table, np.arange(self.floor[sid], s.length), self.block_size)
                 for sid, s in self.seqs.items() if s.host_table is None]
        return np.unique(np.concatenate(slots)) if slots else np.zeros(0, np.int64)


class GroupPagedKVCache(PagedKVCache):
    """One group's paged cache: a ``PagedKVCache`` whose manager and pools are the hybrid cache's.

    storage: (k_pool, v_pool), each [S', num_blocks, bs, Hkv, D], views of the shared pools (S' the group's layers)
    manager: its ``GroupBlockManager`` or ``SlidingBlockManager``
    """

    def __init__(self, num_kv_heads: int, head_dim: int, storage: tuple, manager: BlockManager,
                 blocks_per_tile: int | None = None):
        self._storage, self._manager = storage, manager
        k = storage[0]
        super().__init__(k.shape[0], num_kv_heads, head_dim, k.shape[1], k.shape[2], k.dtype,
                         enable_prefix_caching=manager.allocator.enable_prefix_caching, blocks_per_tile=blocks_per_tile)

    def _new_manager(self, *args) -> BlockManager:
        return self._manager

    def _new_store(self, num_blocks: int, host: bool) -> tuple:
        return super()._new_store(num_blocks, host) if host else self._storage

    def refusal(self, seq_id, new_len: int):
        """A full group can always take tokens back (a shared last block is copied: ``copies_needed``)."""
        return None

    def copies_needed(self, seq_id, new_len: int) -> tuple[int, int]:
        """(blocks a truncate to ``new_len`` must copy, blocks it gives back to the pool), without changing anything."""
        s, a, bs = self.blocks.state(seq_id), self.blocks.allocator, self.block_size
        keep = num_blocks_for(new_len, bs)
        held = [b for b in s.block_table[keep:] if b != HOLE]
        last = s.block_table[keep - 1] if new_len % bs else None
        return int(last is not None and a.ref_count(last) > 1), sum(a.ref_count(b) == 1 for b in held)

    def alive_slots(self) -> np.ndarray:
        """The pool slots holding a token of some sequence (a shared block counted once)."""
        filled = self.blocks.slots_filled()
        return np.concatenate([b * self.block_size + np.arange(n) for b, n in filled.items()]) if filled else \
            np.zeros(0, np.int64)

    def bytes_used(self) -> int:
        """2 x S' x Hkv x D x itemsize per alive slot: what this group's layers store for tokens still read."""
        return int(self.alive_slots().size) * self.bytes_per_token()


class SlidingPagedKVCache(GroupPagedKVCache):
    """A sliding group's paged cache (see the module docstring); ``policy`` is its ``SlidingWindow``."""

    def __init__(self, num_kv_heads: int, head_dim: int, storage: tuple, manager: SlidingBlockManager,
                 blocks_per_tile: int | None = None):
        super().__init__(num_kv_heads, head_dim, storage, manager, blocks_per_tile)
        self.policy = manager.policy

    def attend(self, layer: int, q: np.ndarray, sinks: np.ndarray | None = None,
               softcap: float | None = None) -> np.ndarray:
        """Each query over the keys of its window, read from the sequence's blocks: q [N, Hq, D] -> [N, Hq, D]
        (sinks [Hq], softcap: ``minikv.online_softmax``'s options, applied per tile as every cache does)."""
        step = self._check_query(layer, q)
        bs, hkv, d, w = self.block_size, self.num_kv_heads, self.head_dim, self.policy.window
        per = self.blocks_per_tile or default_blocks_per_tile(bs)
        out = np.empty_like(q)
        for i in range(len(step.seq_ids)):
            r, past, n = step.rows(i), int(step.past[i]), int(step.past[i] + step.num_new[i])
            first = max(0, past - w + 1) // bs  # the oldest block a query of this step reads: never a hole
            tiles = []
            for j in range(first, ceil_div(n, bs), per):
                idx = np.arange(j, min(j + per, ceil_div(n, bs)))
                pos = (idx[:, None] * bs + np.arange(bs)).ravel()                            # [K]
                blocks = self._step_tables[i, idx].astype(np.int64)
                k = self.k_pool[layer, blocks].reshape(-1, hkv, d).transpose(1, 0, 2)       # [Hkv, K, D]
                v = self.v_pool[layer, blocks].reshape(-1, hkv, d).transpose(1, 0, 2)
                tiles.append((k, v, np.broadcast_to(np.where(pos < n, pos, -1), (hkv, pos.size))))
            q_pos = step.positions[r]
            out[r] = attend_slots(q[r], tiles, lambda kp, q_pos=q_pos: self.policy.visible(q_pos, kp),
                                  sinks=sinks, softcap=softcap)
        return out

    def refusal(self, seq_id, new_len: int):
        return self.blocks.refusal(seq_id, new_len)

    def _truncate(self, seq_id, new_len: int) -> None:
        error = self.refusal(seq_id, new_len)
        if error is not None:
            raise error
        super()._truncate(seq_id, new_len)

    def alive_slots(self) -> np.ndarray:
        return self.blocks.alive_slots()

    def read_kv(self, seq_id, layer: int):
        """Not defined once blocks went back to the pool: the history is no longer whole."""
        if HOLE in self.blocks.state(seq_id).block_table:
            raise InvalidInputError(f"sequence {seq_id!r} gave blocks back to the pool; its history is no longer "
                                    "whole, so read_kv cannot gather it")
        return super().read_kv(seq_id, layer)

    def peak_blocks(self, prompt_len: int, longest: int) -> int:
        """The most blocks one sequence may hold: a step writes every one of its tokens before the commit gives
        blocks back, and a sequence preempted by recompute comes back with prompt + generated tokens in one
        prefill step, so the bound is the full length's; what the window saves is what is held between steps."""
        return num_blocks_for(longest, self.block_size)
