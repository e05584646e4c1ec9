"""Step 3b: blocks shared between sequences, and continuous batching over one pool.

Blocks make sharing cheap, because a block is the unit a table points at:

* **Prefix sharing.** A *full* block never changes again (sequences only append), so its K/V
  depend only on the tokens up to its end. Name each full block by a hash *chained* with the
  previous block's: ``h_j = hash((h_{j-1}, tokens of block j))``, so a hash names the whole
  prefix (the same b tokens after another prefix have other K/V: RoPE and attention mix the
  prefix in). A new prompt walks its blocks' hashes through the table of cached blocks and
  reuses every hit; the model then runs only the tokens after the last hit. (Python's ``hash``
  of ints is stable across runs; the engine also compares the tokens on a hit, since hashes
  can collide.)
* **Reference counts.** A block held by several tables is freed when the last one lets go. A
  freed full block keeps its hash until the free list hands it out again, so a later prompt
  can still revive it (the free list is first in, first out: the least recently freed block
  is reused first, an LRU for free).
* **Fork and copy-on-write.** Parallel sampling forks a sequence: the child's table points at
  the parent's blocks, nothing is copied. Full blocks are never written again; before a step
  writes into a *shared, partly filled* last block, the writer gets its own copy of that one.

**Continuous batching.** A static batch starts B prompts together and waits for the slowest.
Here the batch is re-formed every step: waiting prompts join as soon as the pool has blocks
for them, finished sequences leave at once, and one forward pass packs every running
sequence's new tokens (a prompt's uncached part next to other sequences' single tokens).
The lesson admits a prompt only when the pool holds its whole answer; the engine's
``minikv.scheduler.Scheduler`` admits on the prompt alone and preempts when blocks run out.

Run it: ``python -m minikv.textbook.s3b_sharing_batching`` (three questions in one small pool,
against ``minikv.scheduler.Scheduler`` on ``minikv.paged.cache.PagedKVCache``).
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager

import numpy as np

from minikv.textbook.s3_paged import BlockAllocator, PagedCache

# --- NEW in step 3b ---


def block_hashes(tokens: list, block_size: int) -> list:
    """The chained hash of every full block of ``tokens``: h_j = hash((h_{j-1}, block j's tokens))."""
    hashes, h = [], None
    for j in range(len(tokens) // block_size):
        h = hash((h, tuple(tokens[j * block_size:(j + 1) * block_size])))
        hashes.append(h)
    return hashes


class SharingAllocator(BlockAllocator):
    """Block ids with reference counts, and the cached full blocks by chained hash (the prefix cache)."""

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        self.refs = [0] * num_blocks
        self.cached: dict = {}   # chained hash -> the block holding that prefix's last block
        self.hash_of: dict = {}  # block id -> its hash, while ``cached`` names it

    def allocate(self) -> int:
        block = super().allocate()
        self.cached.pop(self.hash_of.pop(block, None), None)  # recycled: its old contents are gone
        self.refs[block] = 1
        return block

    def hold(self, block_id: int) -> None:
        """One more owner. A freed block found by its hash comes back out of the free list."""
        if self.refs[block_id] == 0:
            self.free_ids.remove(block_id)
        self.refs[block_id] += 1

    def free(self, block_id: int) -> None:
        """One owner fewer; the last one puts the block on the free list (its hash stays findable)."""
        self.refs[block_id] -= 1
        if self.refs[block_id] == 0:
            super().free(block_id)

    def register(self, block_id: int, h: int) -> None:
        if h not in self.cached:  # the first block of a prefix wins; an equal later one stays unnamed
            self.cached[h], self.hash_of[block_id] = block_id, h


class SharingCache(PagedCache):
    """Step 3's paged cache with shared blocks. ``tokens[seq_id]``: its token ids, for the hashes
    (the prompt, then what the caller appends before feeding it)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.allocator = SharingAllocator(len(self.allocator.free_ids))
        self.tokens: dict = {}

    def add_sequence(self, seq_id, prompt_ids=()) -> int:
        """Start a sequence; returns how many leading prompt tokens are cached already (run the rest)."""
        super().add_sequence(seq_id)
        self.tokens[seq_id] = list(prompt_ids)
        hit = []
        for h in block_hashes(self.tokens[seq_id], self.block_size):
            if h not in self.allocator.cached:
                break
            hit.append(self.allocator.cached[h])
        hit = hit[:(len(prompt_ids) - 1) // self.block_size]  # leave a token to run: its logits are the answer
        for block in hit:
            self.allocator.hold(block)
        self.tables[seq_id], self.lens[seq_id] = hit, len(hit) * self.block_size
        return self.lens[seq_id]

    def free_sequence(self, seq_id) -> None:
        super().free_sequence(seq_id)
        del self.tokens[seq_id]

    def fork(self, parent, child) -> None:
        """``child`` shares every block of ``parent``; nothing is copied until a shared block is written."""
        self.tables[child], self.lens[child] = list(self.tables[parent]), self.lens[parent]
        self.tokens[child] = list(self.tokens[parent])
        for block in self.tables[child]:
            self.allocator.hold(block)

    @contextmanager
    def step(self, seq_ids, num_new):
        for sid in seq_ids:  # copy-on-write: this step writes into a shared, partly filled last block
            table = self.tables[sid]
            if self.lens[sid] % self.block_size and self.allocator.refs[table[-1]] > 1:
                new = self.allocator.allocate()
                self.k_pool[:, new], self.v_pool[:, new] = self.k_pool[:, table[-1]], self.v_pool[:, table[-1]]
                self.allocator.free(table[-1])  # the other owners keep the original
                table[-1] = new
        with super().step(seq_ids, num_new) as positions:
            yield positions
        for sid in seq_ids:  # blocks the step filled can be shared from now on
            known = self.tokens[sid][:self.lens[sid]]
            for block, h in zip(self.tables[sid], block_hashes(known, self.block_size)):
                self.allocator.register(block, h)


def serve(model, cache: SharingCache, prompts: list, max_new_tokens: int) -> list:
    """Greedy answers to many prompts through one pool, continuously batched: [new ids] per prompt.

    ``cache`` starts empty; every prompt must fit its pool on its own: ceil((P + max_new_tokens - 1) / b) blocks.
    """
    eos, bs = model.config.eos_token_id, cache.block_size
    need = [-(-(len(p) + max_new_tokens - 1) // bs) for p in prompts]  # the most blocks each may hold
    waiting, out = deque(range(len(prompts))), {}

    def spare() -> int:  # free blocks that no running sequence may still claim
        return len(cache.allocator.free_ids) - sum(need[i] - len(cache.tables[i]) for i in cache.tables)

    while waiting or cache.lens:
        while waiting and need[waiting[0]] <= spare():  # admit in arrival order, while blocks last
            i = waiting.popleft()
            cache.add_sequence(i, prompts[i])
            out[i] = []
        running = list(cache.lens)
        logits = model.forward([cache.tokens[i][cache.lens[i]:] for i in running], cache, running)
        for i, row in zip(running, logits):
            out[i].append(int(np.argmax(row)))
            cache.tokens[i].append(out[i][-1])
            if len(out[i]) == max_new_tokens or out[i][-1] == eos:
                cache.free_sequence(i)  # retire at once: its blocks serve the next prompt
    return [out[i] for i in range(len(prompts))]

# --- end NEW ---


def scheduled(model, prompts: list, max_new_tokens: int, num_blocks: int = 8, block_size: int = 16) -> list:
    """The engine's answers: ``minikv.scheduler.Scheduler`` over a ``PagedKVCache`` of ``num_blocks`` blocks."""
    from minikv.paged.cache import PagedKVCache
    from minikv.scheduler import Request, Scheduler

    cache = PagedKVCache(**model.new_cache_args(), num_blocks=num_blocks, block_size=block_size, dtype=model.dtype)
    done = Scheduler(model, cache).run([Request(i, p, max_new_tokens, model.config.eos_token_id)
                                        for i, p in enumerate(prompts)])
    return [done[i] for i in range(len(prompts))]


def main(max_new_tokens: int = 16):
    from minikv.textbook.demo import demo

    questions = ("Write one sentence about the sea.", "Name three colors.", "What is the capital of France?")
    return demo("step 3b, continuous batching", lambda model, prompts, n: serve(model, SharingCache(
        **model.new_cache_args(), num_blocks=8, dtype=model.dtype), prompts, n), scheduled, max_new_tokens, questions)


if __name__ == "__main__":
    main()
