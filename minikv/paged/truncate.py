"""Step 7's rollback of a block table: take the last tokens of a sequence back (speculative decoding).

A verify step of speculative decoding writes K draft tokens into the cache and then keeps only the
accepted ones: ``PagedKVCache.truncate(seq_id, new_len)`` cuts the sequence back to ``new_len``
tokens, and afterwards the cache is what it would be had the dropped tokens never been written.
On a block table that means:

* blocks wholly past ``new_len`` lose this sequence's reference (``decref``); one that no other
  sequence holds also leaves the prefix cache (``BlockAllocator.forget``): its hash named tokens
  that are gone;
* the partly kept last block must become writable again. If another sequence shares it (a fork,
  a prefix hit), this sequence gets a fresh copy now (copy-on-write at truncate time) and the
  caller copies ``src -> dst`` at once, so a block in the prefix cache is never written again;
  if it is this sequence's alone, it leaves the prefix cache and is written in place from now on.

Like the rest of the manager, this code never touches K/V numbers: it returns the copy plan.
"""

from __future__ import annotations

from minikv.errors import OutOfBlocksError
from minikv.paged.allocator import num_blocks_for
from minikv.paged.manager import BlockManager


def truncate_table(m: BlockManager, seq_id, new_len: int) -> list[tuple[int, int]]:
    """Cut sequence ``seq_id`` back to ``new_len`` tokens (0 <= new_len <= length); returns [(src, dst)] to copy.

    OutOfBlocksError, changing nothing, when the shared last block needs a copy and no block is free.
    """
    m._no_open_step("truncate")
    a, s, bs = m.allocator, m.resident(seq_id), m.block_size
    keep = num_blocks_for(new_len, bs)
    dropped = s.block_table[keep:]
    last = s.block_table[keep - 1] if new_len % bs else None  # the partly kept block, if any
    if last is not None and a.ref_count(last) > 1 and a.num_free + sum(a.ref_count(b) == 1 for b in dropped) < 1:
        raise OutOfBlocksError(f"truncating {seq_id!r} to {new_len} tokens must copy its shared last block, "
                               "but no block is free; free or preempt a sequence first")
    for bid in reversed(dropped):
        if a.ref_count(bid) == 1:
            a.forget(bid)
        a.decref(bid)
    del s.block_table[keep:]
    copies = []
    if last is not None and a.ref_count(last) > 1:
        new = a.allocate()
        copies.append((last, new))  # `last` stays held (and cached) by its other owners
        a.decref(last)
        s.block_table[keep - 1] = new
    elif last is not None:
        a.forget(last)  # written in place from now on
    s.length, s.num_registered = new_len, min(s.num_registered, new_len // bs)
    if s.token_ids is not None:
        del s.token_ids[new_len:]
    m.cow_copies += len(copies)
    return copies
