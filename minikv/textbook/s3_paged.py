"""Step 3: the paged KV cache. One pool of small blocks, handed out as sequences grow.

The contiguous cache of step 2 gives every sequence a slab of ``max_len`` positions when it
starts. A slab cannot grow in place, so it must be as long as the sequence could ever get:
most of it waits for tokens that never come (*reservation* waste), and slabs of different
sizes leave holes no sequence fits (*external* waste).

A paged cache preallocates one pool per layer cut into blocks of b token slots and hands out a
block only when a sequence needs one, from a free list. Any free block can take any sequence's
next token, so the only waste left is the unfilled tail of each sequence's last block (fewer
than b slots). The blocks of one sequence lie anywhere in the pool, as the pages of a process
lie anywhere in physical memory; a **block table** per sequence finds them:

* pool: ``k_pool, v_pool: [L, num_blocks, b, Hkv, D]``; a *slot* is one token row, and slot
  ``block * b + offset`` is row ``offset`` of that block (the pool seen as [num_blocks * b] rows);
* block table: entry j is the block holding the sequence's positions ``j*b .. j*b + b - 1``, so
  position p lives in slot ``table[p // b] * b + p % b``: the **slot mapping**, used by ``write``;
* paged attention reads the sequence's blocks through its table, a few blocks per tile, into
  step 2's online softmax. The history is never gathered into one array.

Paging changes where K and V live, not what attention computes: a query attends over *all*
blocks of its sequence (attending only within the current page would be another model).

Stale slots. The last block of a sequence is usually partly filled, and the rest of its slots
hold whatever an earlier owner left, possibly NaN. The causal mask ``key position <= query
position`` already hides them (their positions are >= S), and step 2's update selects their
value rows away, so a pool full of NaN gives the same numbers as a clean one.

Run it: ``python -m minikv.textbook.s3_paged`` (against ``minikv.paged.cache.PagedKVCache``).
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager

import numpy as np

from minikv.textbook.s2_kv_cache import Cache

# --- NEW in step 3 ---


class BlockAllocator:
    """The ids of a pool's blocks: a free list, nothing else (the tables know who holds what)."""

    def __init__(self, num_blocks: int):
        self.free_ids = deque(range(num_blocks))

    def allocate(self) -> int:
        return self.free_ids.popleft()  # an empty pool raises IndexError (step 3b admits only what fits)

    def free(self, block_id: int) -> None:
        self.free_ids.append(block_id)


def slot_mapping(block_table, positions: np.ndarray, block_size: int) -> np.ndarray:
    """The pool slot of each position of one sequence: [T] positions -> [T] int64 slots.

    Position p is row p % b of the sequence's (p // b)-th block, which is block table[p // b]
    of the pool: slot = table[p // b] * b + p % b. Table [7, 2], b = 4: positions 0..5 -> 28 29 30 31 8 9.
    """
    table = np.asarray(block_table, dtype=np.int64)
    return table[positions // block_size] * block_size + positions % block_size


class PagedCache(Cache):
    """Step 2's seam over a pool of blocks: ``k_pool, v_pool: [L, num_blocks, block_size, Hkv, D]``.

    ``tile_blocks``: blocks per tile of the online softmax.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int = 16,
                 dtype=np.float32, tile_blocks: int = 4):
        super().__init__(num_layers, num_kv_heads, head_dim)
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k_pool, self.v_pool = np.zeros(shape, dtype), np.zeros(shape, dtype)
        self.allocator = BlockAllocator(num_blocks)
        self.block_size, self.tile_blocks = block_size, tile_blocks
        self.tables: dict = {}  # seq_id -> its block table (a list of block ids)

    def add_sequence(self, seq_id) -> None:
        super().add_sequence(seq_id)
        self.tables[seq_id] = []

    def free_sequence(self, seq_id) -> None:
        """A finished sequence gives its blocks back, last block first."""
        for block in reversed(self.tables.pop(seq_id)):
            self.allocator.free(block)
        del self.lens[seq_id]

    @contextmanager
    def step(self, seq_ids, num_new):
        for sid, n in zip(seq_ids, num_new):  # a sequence takes a new block only when it needs one
            while len(self.tables[sid]) * self.block_size < self.lens[sid] + n:
                self.tables[sid].append(self.allocator.allocate())
        with super().step(seq_ids, num_new) as positions:
            yield positions

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """k, v: [N, Hkv, D]: each new token's row goes to its slot, through the slot mapping."""
        rows_of_pool = (-1, self.num_kv_heads, self.head_dim)  # one layer's pool as slots: a view, not a copy
        for sid, pos, rows in self.seqs:
            slots = slot_mapping(self.tables[sid], pos, self.block_size)
            self.k_pool[layer].reshape(rows_of_pool)[slots] = k[rows]
            self.v_pool[layer].reshape(rows_of_pool)[slots] = v[rows]

    def block_tiles(self, table: list):
        """(block ids, their positions [tile * b]) of the table, ``tile_blocks`` blocks at a time."""
        bs = self.block_size
        for j in range(0, len(table), self.tile_blocks):
            blocks = table[j:j + self.tile_blocks]
            yield blocks, np.arange(j * bs, (j + len(blocks)) * bs)

    def tiles(self, layer: int, seq_id, q_pos: np.ndarray):
        """The sequence's blocks read through its table: (k, v [tile * b, Hkv, D], mask [T, tile * b])."""
        rows = (-1, self.num_kv_heads, self.head_dim)
        for blocks, k_pos in self.block_tiles(self.tables[seq_id]):
            yield (self.k_pool[layer, blocks].reshape(rows), self.v_pool[layer, blocks].reshape(rows),
                   k_pos[None, :] <= q_pos[:, None])  # hides the future, and the stale slots past S

# --- end NEW ---


def main(max_new_tokens: int = 16):
    from minikv.textbook.demo import demo, engine, greedy_with
    from minikv.textbook.s1_attention import greedy

    return demo("step 3, paged cache", greedy_with(greedy, lambda model, n: PagedCache(
        **model.new_cache_args(), num_blocks=-(-n // 16), block_size=16, dtype=model.dtype)),
        engine(cache="paged", block_size=16), max_new_tokens)


if __name__ == "__main__":
    main()
