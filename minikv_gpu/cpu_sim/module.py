"""Load a compiled simulator module with ctypes and launch its kernels.

Every launch reads the schedule from the environment (no rebuild: it is passed to the runtime):

``MINIKV_SIM_BLOCKS``    ``order`` (default: blockIdx order, x fastest), ``reverse``, or
                         ``random:SEED`` (a permutation drawn from SEED, the same on every run).
``MINIKV_SIM_SCHEDULE``  ``fifo`` (default: READY fibers resume oldest first), or ``random:SEED``
                         (a random READY fiber at every switch point: barriers, warp collectives,
                         yields; each block draws from its own stream of SEED).
"""

from __future__ import annotations

import ctypes
import os
import re
import threading
from pathlib import Path

import numpy as np

from minikv.errors import (
    BackendUnavailableError,
    InvalidInputError,
    KernelCompileError,
    KernelDeadlockError,
    KernelFaultError,
    KernelLaunchError,
)

from . import limits
from .build import DYN_SHARED_CAPACITY, BuildOptions, build, define_flags, includes_digest
from .signature import KernelDecl, Param, check_args

# Signal handlers and the watchdog timer are per process: one launch at a time.
_LAUNCH_LOCK = threading.Lock()
_ERRORS = {1: KernelFaultError, 2: KernelDeadlockError, 3: KernelLaunchError}
MAX_THREADS_PER_BLOCK = 1024
MAX_BLOCK_DIM = (1024, 1024, 64)
MAX_GRID_DIM = (2**31 - 1, 65535, 65535)
_MAX_PARAMS = 256


BLOCKS_ENV, SCHEDULE_ENV = "MINIKV_SIM_BLOCKS", "MINIKV_SIM_SCHEDULE"


class _Schedule(ctypes.Structure):  # minikv_sim::Schedule in cuda_sim.h
    _fields_ = [("block_order", ctypes.c_ulonglong), ("block_seed", ctypes.c_ulonglong),
                ("random_fibers", ctypes.c_ulonglong), ("fiber_seed", ctypes.c_ulonglong)]


def _seed(var: str, value: str, forms: str) -> int:
    m = re.fullmatch(r"random:(\d+)", value)
    if m is None or int(m.group(1)) >= 2**64:
        raise InvalidInputError(f"{var}={value!r}: use {forms} (SEED an integer from 0 to 2**64 - 1)")
    return int(m.group(1))


def schedule_from_env() -> tuple[int, int, int, int]:
    """(block order, block seed, random fibers, fiber seed) from MINIKV_SIM_BLOCKS and MINIKV_SIM_SCHEDULE."""
    blocks = os.environ.get(BLOCKS_ENV, "").strip().lower()
    fibers = os.environ.get(SCHEDULE_ENV, "").strip().lower()
    if blocks in ("", "order"):
        order = (0, 0)
    elif blocks == "reverse":
        order = (1, 0)
    else:
        order = (2, _seed(BLOCKS_ENV, blocks, "'order', 'reverse' or 'random:SEED'"))
    schedule = (0, 0) if fibers in ("", "fifo") else (1, _seed(SCHEDULE_ENV, fibers, "'fifo' or 'random:SEED'"))
    return order + schedule


class _ParamInfo(ctypes.Structure):
    _fields_ = [("is_pointer", ctypes.c_int), ("is_const", ctypes.c_int), ("dtype", ctypes.c_char_p),
                ("lanes", ctypes.c_int), ("size", ctypes.c_ulong)]


def launch_dims(value, what: str, limits: tuple[int, int, int]) -> tuple[int, int, int]:
    """An int or a 1-3 tuple of ints -> (x, y, z), each within CUDA's limits."""
    dims = (value,) if isinstance(value, (int, np.integer)) else value
    if not isinstance(dims, (tuple, list)) or not 1 <= len(dims) <= 3 or \
            not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) for d in dims):
        raise KernelLaunchError(f"{what} must be an int or a tuple of 1 to 3 ints, got {value!r}")
    dims = tuple(int(d) for d in dims) + (1,) * (3 - len(dims))
    for axis, d, limit in zip("xyz", dims, limits):
        if not 1 <= d <= limit:
            raise KernelLaunchError(f"{what}.{axis} = {d} is outside 1..{limit}")
    return dims


def check_launch_config(grid, block, shared_mem) -> tuple[tuple[int, int, int], tuple[int, int, int], int]:
    grid3 = launch_dims(grid, "grid", MAX_GRID_DIM)
    block3 = launch_dims(block, "block", MAX_BLOCK_DIM)
    threads = block3[0] * block3[1] * block3[2]
    if threads > MAX_THREADS_PER_BLOCK:
        raise KernelLaunchError(f"block {block3} has {threads} threads; at most {MAX_THREADS_PER_BLOCK}")
    if not isinstance(shared_mem, (int, np.integer)) or isinstance(shared_mem, bool) or \
            not 0 <= shared_mem <= DYN_SHARED_CAPACITY:
        raise KernelLaunchError(f"shared_mem = {shared_mem!r} bytes: must be an int in 0..{DYN_SHARED_CAPACITY} "
                                "(227 KiB, the H100/H200 limit per block)")
    return grid3, block3, int(shared_mem)


def _asan_loaded() -> bool:
    try:
        ctypes.CDLL(None).__asan_init  # noqa: B018  (a symbol lookup)
    except AttributeError:
        return False
    return True


class SimKernel:
    """One kernel of a SimModule; call it like a CuPy RawKernel: ``k(grid, block, args, shared_mem=0)``.

    ``max_dynamic_shared_size_bytes = n`` opts in to more than 48 KiB of shared memory, as on CuPy.
    The launch checks of ``limits`` take the kernel's registers and static shared memory from the
    nvcc report; where the report lacks the kernel, its registers are not checked and its static
    shared memory counts as the module's (exact for a one-kernel module, else 0: unknown).
    """

    def __init__(self, module: SimModule, index: int, name: str, params: tuple[Param, ...]):
        self.module, self.index, self.name, self.params = module, index, name, params
        self._opt_in: int | None = None

    def _usage(self) -> tuple[int | None, int]:
        """(registers or None, static shared bytes) for the launch checks."""
        found = limits.report_usage(self.module.filename, self.name, self.module.define_flags)
        if found is not None:
            return found
        return None, self.module.static_shared if len(self.module.kernel_names) == 1 else 0

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        return limits.dynamic_shared_limit(self._usage()[1], self._opt_in)

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, value) -> None:
        self._opt_in = limits.check_opt_in(self.name, self._usage()[1], value)

    def __repr__(self) -> str:
        args = ", ".join(p.describe() for p in self.params)
        return f"<SimKernel {self.name}({args})>"

    def __call__(self, grid, block, args, shared_mem: int = 0) -> None:
        grid3, block3, shared_mem = check_launch_config(grid, block, shared_mem)
        check_args(self.name, self.params, args, array_type=np.ndarray, data_ptr=lambda a: a.ctypes.data,
                   strict=True, writable=lambda a: a.flags.writeable)
        registers, static = self._usage()
        limits.check_shared(self.name, static, shared_mem, self._opt_in)
        limits.check_registers(self.name, registers, block3)
        schedule = _Schedule(*schedule_from_env())
        argv = (ctypes.c_void_p * max(len(args), 1))()
        keep = []  # the argument bytes must outlive the call
        for i, (p, a) in enumerate(zip(self.params, args)):
            holder = ctypes.c_void_p(a.ctypes.data) if p.pointer else ctypes.create_string_buffer(a.tobytes())
            keep.append(holder)
            argv[i] = ctypes.addressof(holder)
        err = ctypes.create_string_buffer(4096)
        with _LAUNCH_LOCK:
            rc = self.module.lib.minikv_sim_launch(self.index, argv, (ctypes.c_uint * 3)(*grid3),
                                                   (ctypes.c_uint * 3)(*block3), shared_mem,
                                                   ctypes.byref(schedule), err, len(err))
        if rc:
            raise _ERRORS.get(rc, KernelFaultError)(f"{self.name}<<<{grid3}, {block3}>>>: "
                                                    f"{err.value.decode(errors='replace')}")


class SimModule:
    """A .cu source compiled for the simulator: ``module.get_function(name)`` like cupy.RawModule."""

    def __init__(self, path: Path, kernels: tuple[KernelDecl, ...], asan: bool = False,
                 filename: str = "<source>", define_flags: tuple[str, ...] = ()):
        if asan and not _asan_loaded():
            raise BackendUnavailableError(
                "MINIKV_SIM_ASAN=1 builds need the ASan runtime loaded first: run Python as "
                "LD_PRELOAD=$(g++ -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0 python ...")
        self.path, self.filename, self.define_flags = path, filename, list(define_flags)
        lib = ctypes.CDLL(str(path))
        lib.minikv_sim_launch.restype = ctypes.c_int
        lib.minikv_sim_launch.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                          ctypes.c_ulong, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_ulong]
        lib.minikv_sim_kernel_name.restype = ctypes.c_char_p
        lib.minikv_sim_kernel_params.argtypes = [ctypes.c_int, ctypes.POINTER(_ParamInfo), ctypes.c_int]
        lib.minikv_sim_static_shared_bytes.restype = ctypes.c_ulong
        self.lib = lib
        self.static_shared = int(lib.minikv_sim_static_shared_bytes())  # all kernels' static __shared__ bytes
        self._kernels: dict[str, SimKernel] = {}
        for i, decl in enumerate(kernels):
            if lib.minikv_sim_kernel_name(i).decode() != decl.name:
                raise KernelCompileError(f"{path}: kernel table out of date; delete it and retry")
            table = (_ParamInfo * _MAX_PARAMS)()
            n = lib.minikv_sim_kernel_params(i, table, _MAX_PARAMS)
            if n > _MAX_PARAMS:
                raise KernelCompileError(f"{decl.name} has {n} parameters; the simulator handles {_MAX_PARAMS}")
            named = len(decl.params) == n  # the text parse names the parameters; C++ gives the types
            params = []
            for j in range(n):
                info = table[j]
                text = decl.params[j] if named else None
                params.append(Param(name=text.name if text else f"arg{j}", pointer=bool(info.is_pointer),
                                    const=bool(info.is_const),
                                    dtype=info.dtype.decode() if info.dtype else None,
                                    lanes=max(info.lanes, 1), ctype=text.ctype if text else ""))
            self._kernels[decl.name] = SimKernel(self, i, decl.name, tuple(params))

    @property
    def kernel_names(self) -> list[str]:
        return list(self._kernels)

    def get_function(self, name: str) -> SimKernel:
        try:
            return self._kernels[name]
        except KeyError:
            raise InvalidInputError(f"no kernel {name!r} in {self.path.name}; it has {self.kernel_names}") from None


_MODULES: dict[tuple, SimModule] = {}


def load_module(source: str, filename: str = "<source>", defines: dict | None = None,
                source_dir: Path | None = None) -> SimModule:
    """Compile (or fetch from the caches) and load ``source`` for the simulator.

    Both caches (this process's loaded modules and the compiled ones on disk) are keyed by the
    text of the source and of every local header it includes from ``source_dir``.
    """
    opts = BuildOptions.from_env()
    headers = includes_digest(source, [source_dir] if source_dir else [])
    key = (source, headers, filename, tuple(sorted((defines or {}).items())), str(source_dir), opts)
    if key not in _MODULES:
        built = build(source, filename, defines, source_dir, opts)
        _MODULES[key] = SimModule(built.path, built.kernels, built.asan, filename, tuple(define_flags(defines)))
    return _MODULES[key]
