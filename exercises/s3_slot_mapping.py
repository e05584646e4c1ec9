"""Step 3, exercise ``slot_mapping``: ``minikv.textbook.s3_paged.slot_mapping`` with its body removed.

The lesson's paged cache writes every token through it. Check: ``python -m exercises slot_mapping``.
"""

from __future__ import annotations

import numpy as np


def slot_mapping(block_table, positions: np.ndarray, block_size: int) -> np.ndarray:
    """The pool slot of each position of one sequence: [T] positions -> [T] int64 slots.

    block_table: the sequence's block ids (a list or an array): entry j is the physical block
                 holding its positions j*b .. j*b + b - 1
    positions:   [T] int token positions in the sequence (0, 1, 2, ...)
    block_size:  b, token slots per block

    Position p is in logical block p // b, at offset p % b; that logical block is physical
    block table[p // b], whose first slot is table[p // b] * b:
        slot = table[p // b] * b + p % b
    Example: table [7, 2], b = 4: positions 0..5 -> slots 28 29 30 31 8 9.
    Hint: 2 lines; turn the table into an int64 array first (it may be a list).
    """
    raise NotImplementedError("write me: slot = table[p // b] * b + p % b")
