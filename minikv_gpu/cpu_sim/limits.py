"""Per-block resources that a GPU checks when a kernel is launched.

A launch that asks for more shared memory or registers than a block may have fails on a GPU
("invalid argument", "too many resources requested for launch"), while the simulator has
neither limit by nature. Both backends run these checks before every launch, so that the
simulator refuses exactly the launches a GPU would, with a ``KernelLaunchError`` that names
the numbers and the fix.

Shared memory: static plus dynamic shared memory of a block may reach 48 KiB. Above that a
kernel must opt in, as with ``cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize,
n)`` (CuPy: ``RawKernel.max_dynamic_shared_size_bytes = n``); both runtimes' kernels take the
same attribute. The opt-in itself is capped at 227 KiB minus the static shared memory (H100/H200).

Registers: a block gets at most 65536 registers on sm_80 and sm_90, allocated per warp in
units of 256. The simulator takes the kernel's register count from the nvcc report
(``benchmarks/results/nvcc_report.json``, written by ``benchmarks/nvcc_report.py``: the larger
count of sm_80 and sm_90); a kernel, file or define set that is missing from the report is not
checked. CuPy reads the real count of the compiled kernel (``RawKernel.num_regs``).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

from minikv.errors import KernelLaunchError

DEFAULT_SHARED_LIMIT = 48 * 1024   # static + dynamic shared memory per block without an opt-in
OPT_IN_SHARED_LIMIT = 227 * 1024   # static + opted-in dynamic shared memory per block (H100/H200)
REGISTERS_PER_BLOCK = 65536        # sm_80 and sm_90
REGISTER_UNIT_PER_WARP = 256       # registers are allocated to a warp in units of 256
REPORT_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "nvcc_report.json"


def dynamic_shared_limit(static: int, opt_in: int | None) -> int:
    """The most dynamic shared memory a launch may ask for: the opt-in, else 48 KiB minus the static bytes."""
    return opt_in if opt_in is not None else max(0, DEFAULT_SHARED_LIMIT - static)


def check_opt_in(kernel: str, static: int, value) -> int:
    """Validate ``max_dynamic_shared_size_bytes = value`` for a kernel with ``static`` bytes of static shared memory."""
    cap = OPT_IN_SHARED_LIMIT - static
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value <= cap:
        raise KernelLaunchError(f"{kernel}: max_dynamic_shared_size_bytes = {value!r}: must be an int in 0..{cap} "
                                f"(227 KiB per block minus the kernel's {static} bytes of static shared memory)")
    return int(value)


def check_shared(kernel: str, static: int, dynamic: int, opt_in: int | None) -> None:
    """Refuse ``dynamic`` bytes of dynamic shared memory above the kernel's limit (``dynamic_shared_limit``)."""
    limit = dynamic_shared_limit(static, opt_in)
    if dynamic <= limit:
        return
    if opt_in is None:
        raise KernelLaunchError(
            f"{kernel}: shared_mem = {dynamic} bytes of dynamic shared memory plus {static} bytes of static shared "
            f"memory is more than the {DEFAULT_SHARED_LIMIT} bytes (48 KiB) a block gets without an opt-in; opt in "
            f"first with kernel.max_dynamic_shared_size_bytes = {dynamic} (at most {OPT_IN_SHARED_LIMIT - static})")
    raise KernelLaunchError(f"{kernel}: shared_mem = {dynamic} bytes is more than the kernel's opt-in "
                            f"max_dynamic_shared_size_bytes = {opt_in}; raise the opt-in or ask for less")


def block_registers(registers: int, threads: int) -> int:
    """Registers a block of ``threads`` threads takes at ``registers`` per thread (per-warp units of 256)."""
    warps = -(-threads // 32)
    per_warp = -(-registers * 32 // REGISTER_UNIT_PER_WARP) * REGISTER_UNIT_PER_WARP
    return warps * per_warp


def check_registers(kernel: str, registers: int | None, block3: tuple[int, int, int]) -> None:
    """Refuse a block whose registers exceed 65536; ``registers=None`` (unknown) is not checked."""
    if not registers:
        return
    threads = block3[0] * block3[1] * block3[2]
    need = block_registers(registers, threads)
    if need > REGISTERS_PER_BLOCK:
        per_warp = block_registers(registers, 32)
        most = REGISTERS_PER_BLOCK // per_warp * 32
        raise KernelLaunchError(
            f"{kernel}: a block of {threads} threads at {registers} registers per thread needs {need} registers "
            f"(allocated per warp in units of {REGISTER_UNIT_PER_WARP}), more than the {REGISTERS_PER_BLOCK} of a "
            f"block on sm_80/sm_90 (a GPU refuses it: too many resources requested for launch); launch at most "
            f"{most} threads per block, or cap the registers with __launch_bounds__")


@functools.lru_cache(maxsize=4)
def _report(path: str, mtime_ns: int) -> dict:
    rows = json.loads(Path(path).read_text()).get("kernels", [])
    usage: dict[tuple, tuple[int, int]] = {}
    for r in rows:
        key = (r["file"], r["kernel"], frozenset(r["defines"].split()))
        regs, smem = usage.get(key, (0, 0))
        usage[key] = (max(regs, int(r["registers"])), max(smem, int(r.get("smem_bytes", 0))))
    return usage


def report_usage(filename: str, kernel: str, define_flags: list[str]) -> tuple[int, int] | None:
    """(registers, static shared bytes) of a kernel in the nvcc report, the larger of its archs; None if absent.

    ``filename`` is the source as the runtime names it (``minikv_gpu/kernels/paged.cu``),
    ``define_flags`` as ``cpu_sim.define_flags`` writes them (``["-DHEAD_DIM=64"]``).
    """
    try:
        mtime = REPORT_PATH.stat().st_mtime_ns
    except OSError:
        return None
    key = (Path(filename).name, kernel, frozenset(f[2:] for f in define_flags))
    return _report(str(REPORT_PATH), mtime).get(key)
