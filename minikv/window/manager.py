"""Step 6, the bookkeeping: a block manager whose tables can have holes (blocks given back mid-sequence).

A paged evicting cache (``minikv.window.paged``) drops keys, and once every token of a full block
is dropped in every layer and KV head, nothing reads the block any more: the sequence gives it
back to the pool (``release_block``), as vLLM does for sliding windows. The table entry becomes a
``HOLE`` rather than disappearing, so every other entry stays at its index (position p stays in
entry p // b) and the slot mapping of step 3 is unchanged.

Step 3's ``BlockManager`` knows nothing of holes; this subclass fills its three table hooks:

* ``_held(table)``: the blocks a table holds are its entries minus the holes (fork, free, swap,
  ``held`` and ``slots_filled`` all go through it);
* ``_remap(table, fresh)``: a swap gives the held entries fresh blocks and keeps the holes in place;
* ``_shareable(seq_id, s)``: the prefix cache stops at the first hole, and at the sequence's
  sharing limit (``limit_sharing``): blocks filled after its first eviction were computed while
  some keys were already gone, so their K/V are not what a full run would compute for that prefix.
"""

from __future__ import annotations

from minikv.errors import InvalidInputError, check_int
from minikv.paged.manager import BlockManager, SeqState

HOLE = -1  # a block-table entry whose block went back to the pool: the sequence reads none of its tokens


class EvictingBlockManager(BlockManager):
    """A ``BlockManager`` whose sequences may give full blocks back (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.share_limit: dict = {}  # seq_id -> blocks from this index on never enter the prefix cache

    # -- the table hooks --------------------------------------------------------------------------
    def _held(self, table: list) -> list:
        return [b for b in table if b != HOLE]

    def _remap(self, table: list, fresh: list) -> list:
        it = iter(fresh)
        return [HOLE if b == HOLE else next(it) for b in table]  # holes stay at their index

    def _shareable(self, seq_id, s: SeqState) -> int:
        full = min(super()._shareable(seq_id, s), self.share_limit.get(seq_id, len(s.block_table)))
        holes = [j for j in range(s.num_registered, full) if s.block_table[j] == HOLE]
        return holes[0] if holes else full  # a chain cannot pass a released block

    # -- what eviction adds -----------------------------------------------------------------------
    def release_block(self, seq_id, index: int) -> None:
        """Give back full block ``index`` of a sequence that reads none of its tokens any more; the entry becomes HOLE.

        The block loses this sequence's reference only: other holders (fork, prefix hit) keep it,
        and a registered block stays in the prefix cache (its K/V are still exact).
        """
        self._no_open_step("release a block")
        s = self.resident(seq_id)
        index = check_int("index", index, minimum=0, maximum=s.length // self.block_size - 1,
                          error=InvalidInputError, hint="only a full block of the sequence can be released")
        if s.block_table[index] == HOLE:
            raise InvalidInputError(f"block {index} of sequence {seq_id!r} was already released")
        self.allocator.decref(s.block_table[index])
        s.block_table[index] = HOLE

    def limit_sharing(self, seq_id, num_blocks: int) -> None:
        """Never register blocks ``num_blocks`` on of the sequence (their K/V were computed under eviction)."""
        self.state(seq_id)  # UnknownSequenceError for an unknown id
        self.share_limit[seq_id] = min(self.share_limit.get(seq_id, num_blocks), num_blocks)

    # -- sequences: the limit follows the sequence ------------------------------------------------
    def fork(self, parent_id, child_id) -> None:
        super().fork(parent_id, child_id)
        if parent_id in self.share_limit:
            self.share_limit[child_id] = self.share_limit[parent_id]

    def free_sequence(self, seq_id) -> None:
        super().free_sequence(seq_id)
        self.share_limit.pop(seq_id, None)
