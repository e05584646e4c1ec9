"""Step 3, exercise ``slot_mapping``: where a token of a paged sequence lives in the pool.

Reference: ``minikv.paged.slot_mapping``; ``PagedKVCache`` writes and reads every token through it.
Check: ``python -m exercises slot_mapping``.
"""

import numpy as np


def slot_mapping(block_table: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """The pool slot of each position of one sequence: [T] positions -> [T] int64 slots.

    block_table: [num_blocks_of_the_sequence] ints, the i-th logical block's physical block id
    positions:   [T] token positions in the sequence (0, 1, 2, ...)
    block_size:  tokens per block

    Position p is in logical block p // block_size, at offset p % block_size; that logical block
    is physical block table[p // block_size], whose first slot is block_id * block_size:
        slot = table[p // bs] * bs + p % bs
    Example: table [7, 2], bs 4: positions 0..5 -> slots 28 29 30 31 8 9.
    Hint: 3 lines; convert both arrays to int64 with np.asarray first (lists are allowed).
    """
    raise NotImplementedError("write me: slot = table[p // bs] * bs + p % bs")
