"""Launch checks a GPU enforces and the simulator would not notice by itself (cpu_sim/limits.py):
static + dynamic shared memory within 48 KiB unless the kernel opted in, and registers x threads
within the 65536 registers of a block. The same checks on the CuPy path: test_cupy_runtime.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from minikv.errors import KernelLaunchError
from minikv_gpu import cpu_sim
from minikv_gpu.cpu_sim import limits

STATIC = 16 * 1024
SOURCE = r"""
extern "C" __global__ void smem_user(float* out) {
    __shared__ float tile[4096];  // 16 KiB of static shared memory
    extern __shared__ float dyn[];
    tile[threadIdx.x] = 1.0f;
    dyn[threadIdx.x] = 2.0f;
    __syncthreads();
    out[threadIdx.x] = tile[threadIdx.x] + dyn[threadIdx.x];
}
"""
REG_SOURCE = 'extern "C" __global__ void many_regs(float* out) { out[threadIdx.x] = 3.0f; }'


@pytest.fixture
def smem_kernel(sim_rt):
    if cpu_sim.BuildOptions.from_env().asan:
        pytest.skip("ASan builds do not track static shared memory (its arrays are globals with redzones)")
    kern = sim_rt.kernel_from_source(SOURCE, "smem_user")
    assert kern.module.static_shared == STATIC
    kern._opt_in = None  # kernels are cached per process: start without an opt-in
    return kern


def _launch(kern, threads, shared_mem):
    out = np.zeros(threads, np.float32)
    kern((1,), (threads,), (out,), shared_mem=shared_mem)
    return out


def test_static_plus_dynamic_shared_memory_is_limited_to_48_kib(smem_kernel):
    limit = 48 * 1024 - STATIC
    assert smem_kernel.max_dynamic_shared_size_bytes == limit
    assert (_launch(smem_kernel, 32, limit) == 3.0).all()  # exactly at the limit
    with pytest.raises(KernelLaunchError, match=r"shared_mem = 32769 bytes .* plus 16384 bytes of static.*opt in"):
        _launch(smem_kernel, 32, limit + 1)


def test_an_opt_in_raises_the_limit(smem_kernel):
    smem_kernel.max_dynamic_shared_size_bytes = 64 * 1024
    assert (_launch(smem_kernel, 32, 64 * 1024) == 3.0).all()
    with pytest.raises(KernelLaunchError, match=r"65537 bytes is more than the kernel's opt-in .* = 65536"):
        _launch(smem_kernel, 32, 64 * 1024 + 1)
    smem_kernel.max_dynamic_shared_size_bytes = 227 * 1024 - STATIC  # the most a block may have
    assert (_launch(smem_kernel, 32, 227 * 1024 - STATIC) == 3.0).all()
    for bad in (227 * 1024 - STATIC + 1, -1, 1.5, True):
        with pytest.raises(KernelLaunchError, match=r"max_dynamic_shared_size_bytes = .*must be an int in 0\.\.216064"):
            smem_kernel.max_dynamic_shared_size_bytes = bad


def _report(tmp_path, rows):
    path = tmp_path / "nvcc_report.json"
    path.write_text(json.dumps({"kernels": rows}))
    return path


def _row(file, kernel, defines, arch, registers, smem=0):
    return {"file": file, "kernel": kernel, "defines": defines, "arch": arch, "registers": registers,
            "smem_bytes": smem}


def test_register_counts_come_from_the_nvcc_report(tmp_path, monkeypatch):
    monkeypatch.setattr(limits, "REPORT_PATH", _report(tmp_path, [
        _row("paged.cu", "k", "HEAD_DIM=64 CACHE_HALF=1", "sm_80", 40, 1000),
        _row("paged.cu", "k", "HEAD_DIM=64 CACHE_HALF=1", "sm_90", 44, 1000),
        _row("paged.cu", "k", "HEAD_DIM=128 CACHE_HALF=1", "sm_90", 60, 2000)]))
    flags = cpu_sim.define_flags({"HEAD_DIM": 64, "CACHE_HALF": True})  # sorted: the order does not matter
    assert limits.report_usage("minikv_gpu/kernels/paged.cu", "k", flags) == (44, 1000)  # the larger arch
    assert limits.report_usage("minikv_gpu/kernels/paged.cu", "k", cpu_sim.define_flags({"HEAD_DIM": 32})) is None
    assert limits.report_usage("minikv_gpu/kernels/paged.cu", "other", flags) is None
    monkeypatch.setattr(limits, "REPORT_PATH", tmp_path / "missing.json")
    assert limits.report_usage("minikv_gpu/kernels/paged.cu", "k", flags) is None  # no report: unchecked


def test_registers_times_threads_is_limited_per_block(sim_rt, tmp_path, monkeypatch):
    monkeypatch.setattr(limits, "REPORT_PATH", _report(tmp_path, [_row("<source>", "many_regs", "", "sm_90", 128)]))
    kern = sim_rt.kernel_from_source(REG_SOURCE, "many_regs")
    assert (_launch(kern, 512, 0) == 3.0).all()  # 16 warps x 4096 registers = 65536: at the limit
    with pytest.raises(KernelLaunchError, match=r"513 threads at 128 registers .* needs 69632 .* at most 512 threads"):
        _launch(kern, 513, 0)  # a 17th warp
    monkeypatch.setattr(limits, "REPORT_PATH", tmp_path / "missing.json")
    assert (_launch(kern, 1024, 0) == 3.0).all()  # not in the report: not checked


def test_register_allocation_rounds_per_warp():
    assert limits.block_registers(64, 1024) == 65536
    assert limits.block_registers(65, 1024) == 32 * 72 * 32  # 65 x 32 = 2080 rounds up to 2304 per warp
    assert limits.block_registers(128, 1) == 4096  # a partial warp takes a whole warp's registers
    limits.check_registers("k", 64, (1024, 1, 1))
    with pytest.raises(KernelLaunchError, match="73728 registers"):
        limits.check_registers("k", 65, (32, 32, 1))
