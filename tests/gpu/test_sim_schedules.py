"""The simulator's schedules: MINIKV_SIM_BLOCKS (order, reverse, random:SEED) and
MINIKV_SIM_SCHEDULE (fifo, random:SEED), read at every launch (no rebuild).

A fixed schedule hides dependencies a GPU does not honour: block b reading what block b-1
wrote in the same launch, thread t reading what thread t-1 wrote without a barrier. These
tests show that the default schedule lets such kernels pass and the other schedules catch them.
"""

from __future__ import annotations

import numpy as np
import pytest

from minikv.errors import InvalidInputError
from minikv_gpu import cpu_sim

# Deliberately broken kernels, and two that record the order in which blocks and threads run.
SOURCE = r"""
// Block b adds one to what block b-1 wrote: an inter-block dependency within one launch.
extern "C" __global__ void chain_blocks(float* out) {
    const unsigned b = blockIdx.x;
    if (threadIdx.x == 0) out[b] = b == 0 ? 1.0f : out[b - 1] + 1.0f;
}

// Thread t reads what thread t-1 wrote to shared memory, with no barrier in between. (Dynamic
// shared memory: it starts as 0xff bytes in every build, ASan's included.)
extern "C" __global__ void chain_threads(float* out) {
    extern __shared__ float s[];
    const unsigned t = threadIdx.x;
    s[t] = t == 0 ? 1.0f : s[t - 1] + 1.0f;
    out[t] = s[t];
}

extern "C" __global__ void block_order(unsigned* counter, unsigned* order) {
    if (threadIdx.x == 0) {
        const unsigned linear = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
        order[atomicAdd(counter, 1u)] = linear;
    }
}

// In which order threads start, leave a barrier and leave a shuffle: t, t + n, partner + 2n.
extern "C" __global__ void thread_order(unsigned* counter, unsigned* order) {
    const unsigned n = blockDim.x;
    order[atomicAdd(counter, 1u)] = threadIdx.x;
    __syncthreads();
    order[atomicAdd(counter, 1u)] = threadIdx.x + n;
    const unsigned v = __shfl_xor_sync(0xffffffffu, threadIdx.x, 1);
    order[atomicAdd(counter, 1u)] = v + 2 * n;
}
"""


def _run(sim_rt, monkeypatch, name, grid, block, *arrays, blocks=None, schedule=None, shared_mem=0):
    for var, value in (("MINIKV_SIM_BLOCKS", blocks), ("MINIKV_SIM_SCHEDULE", schedule)):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
    sim_rt.kernel_from_source(SOURCE, name)(grid, block, arrays, shared_mem=shared_mem)


def _chain(sim_rt, monkeypatch, name, **mode) -> bool:
    """Whether the broken kernel ``name`` gives the answer it would if its dependency were honoured."""
    out = np.full(64, np.nan, np.float32)
    grid, block = ((64,), (32,)) if name == "chain_blocks" else ((1,), (64,))
    _run(sim_rt, monkeypatch, name, grid, block, out, shared_mem=64 * 4, **mode)
    return bool(np.array_equal(out, np.arange(1, 65, dtype=np.float32)))


def test_default_schedule_hides_an_inter_block_dependency_that_other_orders_catch(sim_rt, monkeypatch):
    assert _chain(sim_rt, monkeypatch, "chain_blocks")  # passes: blocks run 0, 1, 2, ...
    assert not _chain(sim_rt, monkeypatch, "chain_blocks", blocks="reverse")
    assert not _chain(sim_rt, monkeypatch, "chain_blocks", blocks="random:12345")
    assert _chain(sim_rt, monkeypatch, "chain_blocks", blocks="order")  # the default, spelled out


def test_random_fiber_schedule_catches_a_missing_barrier(sim_rt, monkeypatch):
    assert _chain(sim_rt, monkeypatch, "chain_threads")  # each thread runs to its end before the next starts
    assert _chain(sim_rt, monkeypatch, "chain_threads", schedule="fifo")
    assert not _chain(sim_rt, monkeypatch, "chain_threads", schedule="random:12345")


def _block_order(sim_rt, monkeypatch, grid, blocks) -> list[int]:
    n = int(np.prod(grid))
    counter, order = np.zeros(1, np.uint32), np.full(n, 2**32 - 1, np.uint32)
    _run(sim_rt, monkeypatch, "block_order", grid, (32,), counter, order, blocks=blocks)
    return order.tolist()


@pytest.mark.parametrize("grid", [(7,), (3, 4, 5)])
def test_block_orders_are_permutations(sim_rt, monkeypatch, grid):
    n = int(np.prod(grid))
    assert _block_order(sim_rt, monkeypatch, grid, None) == list(range(n))
    assert _block_order(sim_rt, monkeypatch, grid, "reverse") == list(range(n))[::-1]
    first = _block_order(sim_rt, monkeypatch, grid, "random:7")
    assert sorted(first) == list(range(n)) and first not in (list(range(n)), list(range(n))[::-1])
    assert _block_order(sim_rt, monkeypatch, grid, "random:7") == first  # a seed gives one order
    assert _block_order(sim_rt, monkeypatch, grid, "random:8") != first


def _thread_order(sim_rt, monkeypatch, schedule) -> list[list[int]]:
    """Thread ids in the order they started, left the barrier, left the shuffle (as partner ^ 1)."""
    n = 64
    counter, order = np.zeros(1, np.uint32), np.zeros(3 * n, np.uint32)
    _run(sim_rt, monkeypatch, "thread_order", (1,), (n,), counter, order, schedule=schedule)
    return [[int(v) - p * n for v in order if p * n <= v < (p + 1) * n] for p in range(3)]


def test_random_fiber_schedule_reorders_threads_at_every_switch_point(sim_rt, monkeypatch):
    ids = list(range(64))
    start, barrier, shuffle = _thread_order(sim_rt, monkeypatch, None)
    assert start == ids and barrier == ids  # FIFO: oldest first
    rand = _thread_order(sim_rt, monkeypatch, "random:3")
    start, barrier, shuffle = rand
    assert sorted(start) == ids and sorted(barrier) == ids and start != ids and barrier != ids
    assert start != barrier  # the order after the barrier is drawn anew
    assert sorted(v ^ 1 for v in shuffle) == ids  # the shuffle still pairs lanes t and t ^ 1
    assert _thread_order(sim_rt, monkeypatch, "random:3") == rand
    assert _thread_order(sim_rt, monkeypatch, "random:4") != rand


@pytest.mark.parametrize("var,value", [
    ("MINIKV_SIM_BLOCKS", "backwards"), ("MINIKV_SIM_BLOCKS", "random"), ("MINIKV_SIM_BLOCKS", "random:-1"),
    ("MINIKV_SIM_SCHEDULE", "random:x"), ("MINIKV_SIM_SCHEDULE", "reverse"),
    ("MINIKV_SIM_SCHEDULE", f"random:{2**64}"),
])
def test_bad_schedule_values_are_refused(sim_rt, monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    with pytest.raises(InvalidInputError, match=rf"{var}=.*use .*random:SEED"):
        sim_rt.kernel_from_source(SOURCE, "chain_blocks")((1,), (32,), (np.zeros(1, np.float32),))


def test_schedules_need_no_rebuild(sim_rt, monkeypatch):
    """The schedule is passed at launch: the same compiled module serves every mode."""
    monkeypatch.delenv("MINIKV_SIM_BLOCKS", raising=False)
    monkeypatch.delenv("MINIKV_SIM_SCHEDULE", raising=False)
    first = cpu_sim.load_module(SOURCE)

    def no_compiler(*args, **kwargs):
        raise AssertionError(f"recompiled: {args}")
    monkeypatch.setattr(cpu_sim.build, "_run", no_compiler)
    monkeypatch.setenv("MINIKV_SIM_BLOCKS", "random:5")
    monkeypatch.setenv("MINIKV_SIM_SCHEDULE", "random:5")
    assert cpu_sim.load_module(SOURCE) is first
    cpu_sim.build.build(SOURCE, "<source>")  # the on-disk cache, too, is found without compiling
