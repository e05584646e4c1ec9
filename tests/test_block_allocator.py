"""Step 3 bookkeeping without K/V: the block allocator (ids, ref counts, prefix cache) and the block manager's plans."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minikv.errors import ConfigError, InvalidInputError, OutOfBlocksError
from minikv.kv_cache import make_step
from minikv.paged import BlockAllocator, BlockManager, chain_hash


def test_bad_calls_raise_typed_errors_and_change_nothing():
    alloc = BlockAllocator(3, 2)
    with pytest.raises(InvalidInputError):
        alloc.decref(0)  # free already
    with pytest.raises(InvalidInputError):
        alloc.incref(1)  # free, not cached
    with pytest.raises(InvalidInputError):
        alloc.ref_count(3)
    with pytest.raises(OutOfBlocksError):
        alloc.allocate_many(4)
    assert alloc.num_free == 3  # all or nothing
    for bad in (0, -1, True, 2.0, "4"):
        with pytest.raises(ConfigError, match="num_blocks"):
            BlockAllocator(bad, 2)
    with pytest.raises(ConfigError, match="hash_fn"):
        BlockAllocator(3, 2, hash_fn=42)
    alloc.check()


def test_ref_counts_free_list_and_unallocate():
    alloc = BlockAllocator(4, 2)
    a, b = alloc.allocate(), alloc.allocate()
    assert (a, b) == (0, 1) and alloc.num_free == 2 and alloc.free_block_ids() == [2, 3]
    alloc.incref(a)
    alloc.decref(a)
    assert alloc.ref_count(a) == 1
    alloc.decref(a)  # unregistered: plain free, at the back of the list
    assert alloc.free_block_ids() == [2, 3, 0]
    alloc.unallocate(b)  # an aborted step's block goes to the *front*: the next step gets it back
    assert alloc.free_block_ids() == [1, 2, 3, 0]
    alloc.check()


def register_chain(alloc, tokens):
    ids, prev = [], None
    for i in range(len(tokens) // alloc.block_size):
        bid = alloc.allocate()
        alloc.register(bid, prev, tokens[i * alloc.block_size:(i + 1) * alloc.block_size])
        ids.append(bid)
        prev = bid
    return ids


def test_match_follows_the_chain_and_stops_at_the_first_difference():
    alloc = BlockAllocator(8, 2)
    ids = register_chain(alloc, [1, 2, 3, 4, 5, 6])
    assert alloc.match([1, 2, 3, 4, 5, 6, 7]) == ids
    assert alloc.match([1, 2, 3, 9, 5, 6]) == ids[:1]
    assert alloc.match([3, 4, 5, 6]) == []  # the same tokens after another prefix are another block
    assert alloc.match([1]) == []            # no full block
    assert chain_hash(None, [1, 2]) != chain_hash(chain_hash(None, [0, 0]), [1, 2])


@pytest.mark.parametrize("hash_fn", [lambda prefix, toks: 0, lambda prefix, toks: chain_hash(None, toks)])
def test_colliding_hashes_only_cost_misses(hash_fn):
    """Every block hashes alike (or ignores its prefix): a hit is still always right, only rarer.

    Both allocators hand out the same ids in the same order, so the colliding one's hit
    must be a prefix of the honest one's.
    """
    honest, bad = BlockAllocator(12, 2), BlockAllocator(12, 2, hash_fn=hash_fn)
    chains = [[1, 2, 3, 4], [9, 9, 3, 4], [1, 2, 5, 5], [3, 4, 3, 4]]
    for alloc in (honest, bad):
        for c in chains:
            register_chain(alloc, c)
        alloc.check()
    for query in chains + [[1, 2, 3, 4, 7], [3, 4], [9, 9, 1, 2]]:
        want, got = honest.match(query), bad.match(query)
        assert got == want[:len(got)], (query, got, want)
    assert honest.match([9, 9, 3, 4]) == [2, 3]  # the honest hash finds whole chains


def test_freed_registered_blocks_are_cached_then_evicted_least_recent_first():
    alloc = BlockAllocator(3, 2)
    ids = register_chain(alloc, [1, 2, 3, 4, 5, 6])
    for bid in reversed(ids):  # a sequence frees its last block first
        alloc.decref(bid)
    assert alloc.cached_block_ids() == ids[::-1] and alloc.num_free == 3
    alloc.incref(ids[0])  # a prefix hit revives the head
    assert alloc.cached_block_ids() == [ids[2], ids[1]]
    assert alloc.allocate() == ids[2] and alloc.evictions == 1  # the tail is evicted first
    assert alloc.match([1, 2, 3, 4, 5, 6]) == ids[:2]
    alloc.check()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("aidr"), st.integers(0, 5), st.integers(0, 2)), max_size=80))
def test_random_operations_keep_the_invariants(ops):
    alloc = BlockAllocator(6, 2)
    held: list[int] = []
    for op, i, tok in ops:
        if op == "a" and alloc.num_free:
            held.append(alloc.allocate())
        elif op == "i" and held:
            alloc.incref(held[i % len(held)])
            held.append(held[i % len(held)])
        elif op == "d" and held:
            alloc.decref(held.pop(i % len(held)))
        elif op == "r" and held:
            alloc.register(held[i % len(held)], None, [tok, tok])
        alloc.check()
        assert alloc.num_used == len(set(held))


def test_manager_fork_plans_exactly_one_copy_and_rollback_undoes_it():
    mgr = BlockManager(num_blocks=8, block_size=4)
    mgr.add_sequence("p", [1, 2, 3, 4, 5, 6])
    mgr.reserve(make_step(["p"], [6], [0]))
    mgr.commit(make_step(["p"], [6], [0]))
    mgr.fork("p", "c")
    free = mgr.allocator.num_free
    plan = mgr.reserve(make_step(["c"], [1], [6]))  # the shared, partly filled last block is written
    old = mgr.state("p").block_table[1]
    assert len(plan.copies) == 1 and plan.copies[0][0] == old and plan.tables[0][1] == plan.copies[0][1]
    assert mgr.allocator.num_free == free - 1 and mgr.cow_copies == 1
    mgr.rollback()
    assert mgr.state("c").block_table == mgr.state("p").block_table and mgr.allocator.num_free == free
    assert mgr.allocator.ref_count(old) == 2 and mgr.cow_copies == 0
    mgr.allocator.check()


def test_manager_swap_plans_pair_device_and_host_blocks():
    mgr = BlockManager(num_blocks=4, block_size=2, num_host_blocks=4)
    mgr.add_sequence(0)
    mgr.reserve(make_step([0], [3], [0]))
    mgr.commit(make_step([0], [3], [0]))
    table = list(mgr.state(0).block_table)
    dev, host = mgr.swap_out(0)
    assert dev == table and len(host) == 2 and mgr.allocator.num_free == 4
    with pytest.raises(InvalidInputError, match="swapped out"):
        mgr.fork(0, 1)
    back_host, back_dev = mgr.swap_in(0)
    assert back_host == host and mgr.state(0).block_table == back_dev and mgr.host_allocator.num_free == 4
    assert np.all(np.asarray(back_dev) >= 0)
