"""Step 3, exercise ``allocator_decref``: give a block back to the allocator.

Reference: ``minikv.block_allocator.BlockAllocator.decref``. Your function replaces that method
(it gets ``self``, a BlockAllocator); freeing a sequence, preemption and copy-on-write all call it.
Check: ``python -m exercises allocator_decref``.
"""

from minikv.errors import InvalidInputError


def decref(self, block_id: int) -> None:
    """One owner fewer for block ``block_id``.

    What you can use on ``self`` (read minikv/block_allocator.py):
        b = self.blocks[self._check_id(block_id)]    a Block: ref_count, hash, block_id, forget()
        self._free                                    deque of free block ids (allocate pops the left)
        self._cached_free                             dict block_id -> None, the LRU list of freed
                                                      blocks that still hold a cached prefix
        self._table                                   dict hash -> the block id that owns that hash

    Rules:
    - ref_count already 0: raise ``InvalidInputError`` (a double free), changing nothing;
    - otherwise ref_count -= 1, and when it reaches 0:
      - a block registered in the prefix cache (``b.hash is not None`` and ``self._table.get(b.hash)``
        is this block) joins the *end* of ``self._cached_free`` (most recently freed, evicted last);
      - any other block calls ``b.forget()`` and is appended to ``self._free``.
    Hint: about 10 lines.
    """
    raise NotImplementedError("write me: BlockAllocator.decref (see the docstring)")


__all__ = ["decref", "InvalidInputError"]
