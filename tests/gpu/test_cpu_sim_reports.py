"""What the CPU simulator reports: deadlocks, faults, the watchdog, compile errors, and the
argument and launch-configuration checks (the same on CuPy, where they run through runtime.py)."""

from __future__ import annotations

import numpy as np
import pytest
from sim_sources import check_warp_sums, dev, k, sim_k

from minikv.errors import (
    KernelCompileError,
    KernelDeadlockError,
    KernelFaultError,
    KernelLaunchError,
)

# ---- what the simulator reports ------------------------------------------------------------------

def test_barrier_after_early_return_is_a_deadlock(sim_rt):
    with pytest.raises(KernelDeadlockError, match=r"never reached by threads 16-31.*threads 0-15 wait"):
        sim_k(sim_rt, "barrier_after_exit")((1,), (32,), (np.zeros(32, np.float32),))


def test_barriers_in_divergent_branches_are_a_deadlock(sim_rt):
    with pytest.raises(KernelDeadlockError, match=r"different barriers: threads 0-15 at __syncthreads\(\) .*"
                                                  r"threads 16-31 at __syncthreads\(\)"):
        sim_k(sim_rt, "barrier_in_branch")((1,), (32,), (np.zeros(32, np.float32),))


def test_shuffle_waiting_on_a_barrier_is_a_deadlock(sim_rt):
    with pytest.raises(KernelDeadlockError, match=r"lane 0 waits at __syncthreads\(\)"):
        sim_k(sim_rt, "shuffle_then_barrier")((1,), (32,), (np.zeros(32, np.float32),))


def test_shuffle_from_an_exited_lane_is_a_fault(sim_rt):
    with pytest.raises(KernelFaultError, match=r"exited: lanes 16-31") as info:
        sim_k(sim_rt, "shuffle_exited_lane")((1,), (32,), (np.zeros(32, np.float32),))
    assert not isinstance(info.value, KernelDeadlockError)


def test_shuffle_with_a_mask_without_the_caller_is_a_fault(sim_rt, default_schedule):
    with pytest.raises(KernelFaultError, match=r"thread \(16,0,0\).*does not include the calling lane 16"):
        sim_k(sim_rt, "shuffle_foreign_mask")((1,), (32,), (np.zeros(32, np.float32),))


def test_lanes_in_different_collectives_with_one_mask_is_a_fault(sim_rt, default_schedule):
    with pytest.raises(KernelFaultError, match=r"meet in different collectives.*__shfl_sync.*__ballot_sync"):
        sim_k(sim_rt, "mixed_collectives")((1,), (32,), (np.zeros(32, np.uint32),))


def test_stack_overflow_is_reported_and_the_interpreter_survives(sim_rt):
    with pytest.raises(KernelFaultError, match="stack overflow"):
        sim_k(sim_rt, "recurse")((1,), (4,), (np.zeros(4, np.int32),))
    check_warp_sums(sim_rt)  # and the simulator still works


def test_wild_pointer_is_reported(sim_rt):
    with pytest.raises(KernelFaultError, match=r"invalid memory access"):
        sim_k(sim_rt, "wild_write")((1,), (1,), (np.zeros(1, np.float32),))


def test_assert_and_integer_division_by_zero_are_reported(sim_rt):
    out = np.zeros(4, np.int32)
    with pytest.raises(KernelFaultError, match=r"thread \(2,0,0\): assertion `x\[threadIdx.x\] >= 0` failed"):
        sim_k(sim_rt, "checks")((1,), (4,), (np.array([1, 2, -3, 4], np.int32), out))
    with pytest.raises(KernelFaultError, match="division by zero"):
        sim_k(sim_rt, "checks")((1,), (4,), (np.array([0, 2, 3, 4], np.int32), out))


def test_a_spin_wait_that_cannot_end_hits_the_watchdog(sim_rt, default_schedule, monkeypatch):
    monkeypatch.setenv("MINIKV_SIM_TIMEOUT", "0.3")  # seconds of CPU time
    with pytest.raises(KernelDeadlockError, match="CPU time limit"):
        sim_k(sim_rt, "spin_forever")((1,), (2,), (np.zeros(1, np.int32),))


def test_compile_error_carries_the_gcc_message(sim_rt):
    src = 'extern "C" __global__ void broken(float* x) {\n    x[0] = undeclared_name;\n}\n'
    with pytest.raises(KernelCompileError, match=r"<source>:2:12: error: .undeclared_name. was not declared"):
        sim_rt.kernel_from_source(src, "broken")


# ---- launch checks -------------------------------------------------------------------------------

def test_arguments_are_checked_against_the_real_parameter_types(rt):
    kern = k(rt, "block_sum")  # (const float* x, float* out, int n)
    x, out = dev(rt, np.zeros(8, np.float32)), dev(rt, np.zeros(1, np.float32))
    with pytest.raises(KernelLaunchError, match=r"argument 0 'x' \(const float\*\) needs a float32 array, got float64"):
        kern((1,), (32,), (dev(rt, np.zeros(8)), out, np.int32(8)))
    with pytest.raises(KernelLaunchError, match=r"argument 2 'n' \(int\) is a scalar: pass an exact NumPy scalar"):
        kern((1,), (32,), (x, out, 8))
    with pytest.raises(KernelLaunchError, match=r"'n' \(int\) needs np.int32, got np.int64"):
        kern((1,), (32,), (x, out, np.int64(8)))
    with pytest.raises(KernelLaunchError, match=r"block_sum takes 3 arguments \(x, out, n\), got 2"):
        kern((1,), (32,), (x, out))
    with pytest.raises(KernelLaunchError, match=r"'out' \(float\*\) is a pointer"):
        kern((1,), (32,), (x, np.float32(0), np.int32(8)))
    with pytest.raises(KernelLaunchError, match="not C-contiguous"):
        kern((1,), (32,), (dev(rt, np.zeros(16, np.float32))[::2], out, np.int32(8)))


def test_vector_pointer_checks(rt):
    kern = k(rt, "vectors")  # (const float4* x, float4* out, const __half2* h, float* hsum, int n4)
    h, hsum = dev(rt, np.zeros(20, np.float16)), dev(rt, np.zeros(10, np.float32))
    with pytest.raises(KernelLaunchError, match="not a multiple of 4"):
        kern((1,), (16,), (dev(rt, np.zeros(10, np.float32)), dev(rt, np.zeros(40, np.float32)), h, hsum, np.int32(2)))
    buf = dev(rt, np.zeros(44, np.float32))
    with pytest.raises(KernelLaunchError, match="16-byte aligned"):
        kern((1,), (16,), (buf[1:41], dev(rt, np.zeros(40, np.float32)), h, hsum, np.int32(10)))


def test_read_only_array_for_a_writable_pointer(sim_rt):
    out = np.zeros(1, np.float32)
    out.flags.writeable = False
    with pytest.raises(KernelLaunchError, match="read-only"):
        k(sim_rt, "block_sum")((1,), (32,), (np.zeros(8, np.float32), out, np.int32(8)))


@pytest.mark.parametrize("grid,block,shared,match", [
    ((1,), (1025,), 0, r"block.x = 1025 is outside 1..1024"),
    ((1,), (33, 32), 0, "1056 threads"),
    ((1,), (32, 32, 2), 0, "2048 threads"),
    ((0,), (32,), 0, r"grid.x = 0 is outside"),
    ((1, 70000), (32,), 0, r"grid.y = 70000"),
    ((1,), (1, 1, 65), 0, r"block.z = 65"),
    ((1, 1, 1, 1), (32,), 0, "tuple of 1 to 3 ints"),
    ((1,), (32,), 227 * 1024 + 1, "227 KiB"),
    ((1,), (32.0,), 0, "tuple of 1 to 3 ints"),
])
def test_launch_configuration_limits(rt, grid, block, shared, match):
    x, out = dev(rt, np.zeros(8, np.float32)), dev(rt, np.zeros(1, np.float32))
    with pytest.raises(KernelLaunchError, match=match):
        k(rt, "block_sum")(grid, block, (x, out, np.int32(8)), shared_mem=shared)


def test_ints_are_accepted_as_one_dimensional_grid_and_block(rt):
    x = np.arange(64, dtype=np.float32)
    out = dev(rt, np.zeros(64, np.float32))
    k(rt, "warp_sums")(2, 32, (dev(rt, x), out))
    assert rt.asnumpy(out)[0] == x[:32].sum()
