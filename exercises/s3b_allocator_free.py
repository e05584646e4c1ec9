"""Step 3b, exercise ``allocator_free``: ``minikv.textbook.s3b_sharing_batching.SharingAllocator.free``, body removed.

Your function replaces that method (it gets ``self``, a ``SharingAllocator``): freeing a finished
sequence, copy-on-write and continuous batching all call it. Check: ``python -m exercises allocator_free``.
"""

from __future__ import annotations

from minikv.textbook.s3_paged import BlockAllocator


def free(self, block_id: int) -> None:
    """One owner fewer for block ``block_id``.

    What you can use on ``self`` (read minikv/textbook/s3b_sharing_batching.py):
        self.refs[block_id]     how many block tables hold the block
        self.free_ids           step 3's free list (a deque; ``allocate`` pops the left end)
        self.cached, self.hash_of  the prefix cache: hash -> block, block -> hash

    Rules:
    - refs[block_id] -= 1;
    - when it reaches 0 the block goes to the *end* of the free list (step 3's free:
      ``BlockAllocator.free(self, block_id)``; ``super()`` does not work outside the class);
    - its hash stays in the prefix cache: a later prompt can still revive the block, until
      ``allocate`` hands it out again.
    Hint: 3 lines.
    """
    raise NotImplementedError("write me: SharingAllocator.free (see the docstring)")


__all__ = ["free", "BlockAllocator"]
