"""Kernel runtime: CuPy when a CUDA GPU is usable, else the CPU simulator.

``MINIKV_CUPY_POOL=0`` turns CuPy's memory pools off (compute-sanitizer runs: a read past an array's end
then leaves the allocation instead of landing in the pool's next array).

    rt = get_runtime()                     # "cupy" or "sim"; env MINIKV_GPU_BACKEND=cupy|sim forces one
    k = rt.kernel("attention", "causal_softmax_v0", defines={"HEAD_DIM": 64})
    x = rt.asarray(np_x)                   # a device array (a NumPy copy on the sim)
    k((n_rows,), (128,), (x, out, np.int32(n_rows), ...), shared_mem=0)
    result = rt.asnumpy(out)

``kernel()`` loads ``minikv_gpu/kernels/<stem>.cu`` once and compiles it once per set of
defines. Launches take CuPy's RawKernel signature ``(grid, block, args, shared_mem=0)``:
arrays for pointer parameters, exact NumPy scalars (``np.int32(n)``, ``np.float32(x)``) for
value parameters. Both backends check every argument against the kernel's real parameter
list, because CuPy itself does not (a Python int is passed as 8 bytes, whatever the kernel
expects). Both also refuse, before launching, what a GPU refuses at launch (``cpu_sim/limits.py``):
more than 48 KiB of static plus dynamic shared memory unless the kernel opted in with
``k.max_dynamic_shared_size_bytes = n`` (the name of CuPy's RawKernel attribute), and more than
65536 registers per block.

On CuPy, kernels compile with NVRTC (``cupy.RawModule(code=..., options=("-std=c++17",
"-DNAME=VALUE", ...))``). Kernels that ``#include <cuda_fp16.h>`` need the CUDA headers:
NVRTC gets ``-I`` for the first folder holding ``cuda_fp16.h`` among ``$CUDA_PATH/include``,
``$CUDA_HOME/include``, ``/usr/local/cuda/include`` and the ``nvidia-*`` pip packages. If none
is found, set ``CUDA_PATH``.

Kernel sources ``#include "..."`` the headers next to them (``common.cuh``,
``online_softmax.cuh``, ...): both backends compile with the kernels folder on the include
path, and every compiled-module cache key (the simulator's on disk, CuPy's in memory and
CuPy's own on disk) covers the text of every header a source includes, transitively.

The device helpers that every step module (``attention``, ``kv_cache``, ``paged``,
``model``) shares live here too: ``device_f32``, ``head_dim_defines``, ``cache_defines``,
``check_device_rows``, ``host_array``, ``multiprocessors`` (from a per-device cache of the
device's attributes) and the launch constants ``STATIC_SMEM_LIMIT``, ``BLOCKS_PER_SM``,
``MAX_HEAD_DIM``. Both runtimes also offer pinned host memory, streams, events and asynchronous
block copies (``pinned_empty``, ``stream``, ``event``, ``copy_blocks_async``: ``minikv_gpu.streams``).
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import numpy as np

from minikv.errors import (
    BackendUnavailableError,
    ConfigError,
    DTypeError,
    InvalidInputError,
    KernelCompileError,
    ShapeError,
    check_float,
)

from . import cpu_sim
from .cpu_sim import limits
from .cpu_sim.signature import KernelDecl, check_args, find_kernels
from .cupy_status import cupy_or_reason
from .streams import CupyCopies, SimCopies

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
BACKENDS = ("cupy", "sim")
ENV_VAR = "MINIKV_GPU_BACKEND"
STATIC_SMEM_LIMIT = 48 * 1024     # static shared memory per block (the K/V tiles of the attention kernels)
MAX_HEAD_DIM = 128                # the attention kernels' register accumulators and tiles are sized for it
BLOCKS_PER_SM = 4  # split-K heuristics aim for this many blocks per multiprocessor (a block is only
#                    G warps, so one per SM leaves too few loads in flight to stream from HBM);
#                    a first guess: benchmarks/gpu_check.py sweeps the split count to tune it


class Runtime:
    """What kernels need from a backend. Subclasses: CupyRuntime, SimRuntime (each with its copy API)."""

    name: str
    xp: object  # cupy or numpy

    def __init__(self) -> None:
        self._sources: dict[str, str] = {}
        self._kernels: dict[tuple, object] = {}

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"

    def source(self, stem: str) -> str:
        """The text of minikv_gpu/kernels/<stem>.cu, read once."""
        if stem not in self._sources:
            if not isinstance(stem, str) or not stem or "/" in stem or "\\" in stem or stem.startswith("."):
                raise InvalidInputError(f"kernel file stem must be a plain name such as 'attention', got {stem!r}")
            path = KERNEL_DIR / f"{stem}.cu"
            if not path.is_file():
                available = sorted(p.stem for p in KERNEL_DIR.glob("*.cu"))
                raise InvalidInputError(f"no kernel file {path}; available stems: {available}")
            self._sources[stem] = path.read_text()
        return self._sources[stem]

    def kernel(self, stem: str, name: str, defines: dict | None = None):
        """Kernel ``name`` of minikv_gpu/kernels/<stem>.cu compiled with ``defines`` (cached)."""
        key = ("file", stem, name, _defines_key(defines))
        if key not in self._kernels:
            self._kernels[key] = self._compile(self.source(stem), f"minikv_gpu/kernels/{stem}.cu", name,
                                               defines, KERNEL_DIR)
        return self._kernels[key]

    def kernel_from_source(self, source: str, name: str, defines: dict | None = None, *,
                           include_kernels: bool = False):
        """Kernel ``name`` compiled from a source string (tests, notebooks).

        ``include_kernels``: put minikv_gpu/kernels on the include path, so the source may
        ``#include "online_softmax.cuh"`` and the other headers there.
        """
        if not isinstance(source, str):
            raise InvalidInputError(f"source must be a str of CUDA C, got {type(source).__name__}")
        key = ("source", source, name, _defines_key(defines), bool(include_kernels))
        if key not in self._kernels:
            self._kernels[key] = self._compile(source, "<source>", name, defines,
                                               KERNEL_DIR if include_kernels else None)
        return self._kernels[key]

    def _compile(self, source: str, filename: str, name: str, defines: dict | None, source_dir: Path | None):
        raise NotImplementedError

    def asarray(self, a, dtype=None):
        """Host array -> device array (always a copy, as a transfer to the GPU would be)."""
        raise NotImplementedError

    def asnumpy(self, a) -> np.ndarray:
        """Device array -> new NumPy array."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Wait until all launched kernels have finished."""

    def device_count(self) -> int:
        """How many devices this process can use."""
        return 1

    def use_device(self, index: int) -> None:
        """Make device ``index`` current for this process (what later launches and allocations use)."""
        if not 0 <= index < self.device_count():
            raise InvalidInputError(f"device {index} does not exist; this {self.name} runtime has "
                                    f"{self.device_count()} device(s)")
        self.device_id = index

    device_id = 0


def _defines_key(defines: dict | None) -> tuple:
    if defines is not None and not isinstance(defines, dict):
        raise InvalidInputError(f"defines must be a dict such as {{'HEAD_DIM': 64}}, got {type(defines).__name__}")
    return tuple(cpu_sim.define_flags(defines))


class SimRuntime(SimCopies, Runtime):
    """Kernels compiled with g++ and run on the CPU, one fiber per CUDA thread (minikv_gpu/cpu_sim)."""

    name = "sim"
    xp = np

    def __init__(self, devices: int = 1) -> None:
        super().__init__()
        cpu_sim.build.compiler()  # fail now, with a clear message, if there is no g++
        self.devices = devices  # how many GPUs it stands in for (one host memory serves them all)

    def device_count(self) -> int:
        return self.devices

    def _compile(self, source, filename, name, defines, source_dir):
        return cpu_sim.load_module(source, filename, defines, source_dir).get_function(name)

    def asarray(self, a, dtype=None) -> np.ndarray:
        return np.array(a, dtype=dtype, order="C", copy=True)

    def asnumpy(self, a) -> np.ndarray:
        return np.array(a, copy=True)


class _CupyKernel:
    """A cupy.RawKernel behind the same argument and resource checks as the simulator.

    ``max_dynamic_shared_size_bytes = n`` opts in to more than 48 KiB of shared memory (it sets
    the RawKernel attribute of that name); without it a launch above the limit is refused here,
    as on the simulator (``cpu_sim.limits``). Registers and static shared memory are the
    compiled kernel's own (``RawKernel.num_regs``, ``shared_size_bytes``), read once.
    """

    def __init__(self, raw, name: str, decl: KernelDecl | None, cupy):
        self._raw, self._cupy = raw, cupy
        self.name = name
        self.params = decl.params if decl else None  # None: the parser could not read them; unchecked
        self._opt_in: int | None = None
        self._usage: tuple[int, int] | None = None

    def _resources(self) -> tuple[int, int]:
        if self._usage is None:  # each read is a driver call (and compiles the module on first use)
            self._usage = (int(self._raw.num_regs), int(self._raw.shared_size_bytes))
        return self._usage

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        return limits.dynamic_shared_limit(self._resources()[1], self._opt_in)

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, value) -> None:
        self._opt_in = limits.check_opt_in(self.name, self._resources()[1], value)
        self._raw.max_dynamic_shared_size_bytes = self._opt_in

    def __call__(self, grid, block, args, shared_mem: int = 0) -> None:
        grid3, block3, shared_mem = cpu_sim.check_launch_config(grid, block, shared_mem)
        if self.params is not None:  # CuPy arrays are always writable: no writable= check
            check_args(self.name, self.params, args, array_type=self._cupy.ndarray,
                       data_ptr=lambda a: a.data.ptr, strict=False)
        registers, static = self._resources()
        limits.check_shared(self.name, static, shared_mem, self._opt_in)
        limits.check_registers(self.name, registers, block3)
        self._raw(grid3, block3, tuple(args), shared_mem=shared_mem)


def _cuda_include_dir() -> str | None:
    candidates = [os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    dirs = [Path(c) / "include" for c in candidates if c]
    for site in map(Path, sys.path):
        nvidia = site / "nvidia"
        if nvidia.is_dir():
            dirs += sorted(nvidia.glob("*/include"))
    for d in dirs:
        if (d / "cuda_fp16.h").is_file():
            return str(d)
    return None


class CupyRuntime(CupyCopies, Runtime):
    """Kernels compiled by NVRTC through cupy.RawModule, run on the current CUDA device."""

    name = "cupy"

    def __init__(self, cupy) -> None:
        super().__init__()
        self.xp = cupy
        if os.environ.get("MINIKV_CUPY_POOL") == "0":  # every array its own cudaMalloc: memcheck sees overruns
            cupy.cuda.set_allocator(None)
            cupy.cuda.set_pinned_memory_allocator(None)
        self._modules: dict[tuple, tuple] = {}
        include = _cuda_include_dir()
        self._base_options = ("-std=c++17",) + ((f"-I{include}",) if include else ())

    def _compile(self, source, filename, name, defines, source_dir):
        options = self._base_options + tuple(cpu_sim.define_flags(defines))
        dirs = [source_dir] if source_dir is not None else []
        options += tuple(f"-I{d}" for d in dirs)
        # CuPy's own disk cache hashes the code and options, not the headers: a trailing comment with
        # the headers' digest makes an edited header a new module (and the line numbers stay as they are).
        code = source + f"\n// minikv includes: {cpu_sim.build.includes_digest(source, dirs)}\n"
        key = (code, options)
        if key not in self._modules:
            self._modules[key] = (self.xp.RawModule(code=code, options=options),
                                  _declared_kernels(source, filename, defines, source_dir))
        module, decls = self._modules[key]
        try:
            raw = module.get_function(name)
        except Exception as exc:  # NVRTC compile errors surface here, on first use
            raise KernelCompileError(f"{filename}: cannot get kernel {name!r} (defines {defines}): {exc}") from exc
        return _CupyKernel(raw, name, decls.get(name), self.xp)

    def device_count(self) -> int:
        return int(self.xp.cuda.runtime.getDeviceCount())

    def use_device(self, index: int) -> None:
        super().use_device(index)
        self.xp.cuda.Device(index).use()

    def asarray(self, a, dtype=None):
        return self.xp.array(a, dtype=dtype, order="C", copy=True)

    def asnumpy(self, a) -> np.ndarray:
        return self.xp.asnumpy(a)

    def synchronize(self) -> None:
        self.xp.cuda.get_current_stream().synchronize()


def _declared_kernels(source: str, filename: str, defines, source_dir) -> dict[str, KernelDecl]:
    """Parameter lists for the CuPy checks: from the preprocessed source if g++ exists, else the raw text."""
    try:
        text = cpu_sim.build.scan_source(source, filename, defines, [source_dir] if source_dir else [])
        marker = cpu_sim.signature.KERNEL_MARK
    except (BackendUnavailableError, KernelCompileError):
        text, marker = source, "__global__"
    return {k.name: k for k in find_kernels(text, marker=marker)}


@functools.lru_cache(maxsize=1)
def _auto_backend() -> str:
    return "cupy" if cupy_or_reason()[0] is not None else "sim"


_RUNTIMES: dict[str, Runtime] = {}


def get_runtime(backend: str | Runtime | None = None) -> Runtime:
    """The runtime for ``backend`` ("cupy" or "sim"); None: $MINIKV_GPU_BACKEND, else cupy if usable, else sim.

    A ``Runtime`` is returned as it is, so that ``runtime=`` arguments take either.
    """
    if isinstance(backend, Runtime):
        return backend
    if backend is None:
        backend = os.environ.get(ENV_VAR, "").strip().lower() or None
        if backend is not None and backend not in BACKENDS:
            raise InvalidInputError(f"{ENV_VAR}={backend!r}: must be one of {BACKENDS} (or unset for auto)")
    if backend is not None and backend not in BACKENDS:
        raise InvalidInputError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend is None:
        backend = _auto_backend()
    if backend not in _RUNTIMES:
        if backend == "cupy":
            cupy, reason = cupy_or_reason()
            if cupy is None:
                raise BackendUnavailableError(f"backend 'cupy' cannot run here: {reason}. Use backend='sim' "
                                              f"(or {ENV_VAR}=sim) for the CPU simulator.")
            _RUNTIMES[backend] = CupyRuntime(cupy)
        else:
            _RUNTIMES[backend] = SimRuntime()
    return _RUNTIMES[backend]


def default_runtime() -> Runtime:
    """get_runtime(None): the backend chosen by the environment."""
    return get_runtime(None)


# --- device helpers shared by the step modules ------------------------------------------------

def device_f32(rt: Runtime, a, name: str):
    """``a`` as a C-contiguous float32 array on ``rt``'s device.

    Host NumPy arrays are copied over; anything that is not float32 raises
    DTypeError rather than being cast silently (a float64 input usually means a
    float64 scalar promoted something upstream, which is a bug worth seeing).
    """
    dtype = getattr(a, "dtype", None)
    if dtype is None or not hasattr(a, "shape"):
        raise DTypeError(f"{name} must be an array, got {type(a).__name__}")
    if np.dtype(dtype) != np.float32:
        raise DTypeError(f"{name}.dtype={dtype}; the GPU kernels compute in float32, "
                         f"cast with {name}.astype(np.float32)")
    if not isinstance(a, rt.xp.ndarray):
        a = rt.asarray(a)  # host -> device (on the simulator the "device" is the host: no copy needed)
    return rt.xp.ascontiguousarray(a)


def head_dim_defines(head_dim: int) -> dict:
    """The compile-time defines of a kernel specialised to ``head_dim``; raises ConfigError if unsupported."""
    if not (isinstance(head_dim, (int, np.integer)) and 8 <= head_dim <= MAX_HEAD_DIM and head_dim % 8 == 0):
        raise ConfigError(f"head_dim={head_dim}: the GPU kernels need a multiple of 8 between 8 and "
                          f"{MAX_HEAD_DIM} (use the NumPy reference in minikv for other sizes)")
    return {"HEAD_DIM": int(head_dim)}


def cache_defines(head_dim: int, dtype) -> dict:
    """``head_dim_defines`` plus ``CACHE_HALF`` for a cache storing ``dtype`` (float32 or float16)."""
    return {**head_dim_defines(head_dim), "CACHE_HALF": int(np.dtype(dtype) == np.float16)}


def check_device_rows(cache, rt: Runtime, name: str, a, heads: int) -> None:
    """``KVCacheBase._check_rows`` for device arrays: a [N, heads, D] float32 array of this step."""
    step = cache._require_step()
    want = (step.num_tokens, heads, cache.head_dim)
    if not isinstance(a, (rt.xp.ndarray, np.ndarray)) or a.shape != want:
        got = getattr(a, "shape", type(a).__name__)
        raise ShapeError(f"{name}.shape={got}, expected [N, heads, D] = {want} for this step")
    if a.dtype != np.float32:
        raise DTypeError(f"{name}.dtype={a.dtype}; the GPU cache takes float32 activations, "
                         f"cast with {name}.astype(np.float32)")


def check_device_query(cache, rt: Runtime, q):
    """``KVCacheBase._check_query`` for device arrays: q [N, Hq, D] of this step, Hq a multiple of Hkv.
    Returns the open step."""
    step = cache._require_step()
    if not isinstance(q, (rt.xp.ndarray, np.ndarray)) or q.ndim != 3 or q.shape[0] != step.num_tokens \
            or q.shape[2] != cache.head_dim or q.shape[1] % cache.num_kv_heads:
        raise ShapeError(f"q.shape={getattr(q, 'shape', type(q).__name__)}, expected [N={step.num_tokens}, "
                         f"Hq, D={cache.head_dim}] with Hq a multiple of Hkv={cache.num_kv_heads}")
    return step


def score_options(rt: Runtime, n_heads: int, sinks=None, softcap=None) -> tuple:
    """The attention kernels' trailing ``(sinks, use_sinks, softcap)`` arguments for ``minikv.online_softmax``'s
    options (kernels/online_softmax.cuh's Options). sinks: [Hq] learned sink logits, float32, or None;
    softcap: a positive cap, or None. Neither: zeros, 0 and 0.0 (the kernels then apply nothing).
    ShapeError / DTypeError / ConfigError name a bad one."""
    if sinks is not None and getattr(sinks, "shape", None) != (n_heads,):
        raise ShapeError(f"sinks.shape={getattr(sinks, 'shape', None)}, expected one logit per query head: "
                         f"({n_heads},)")
    cap = 0.0 if softcap is None else check_float("softcap", softcap, hint="a positive cap, or None for none")
    dev = rt.xp.zeros(max(n_heads, 1), dtype=np.float32) if sinks is None else device_f32(rt, sinks, "sinks")
    return dev, np.int32(sinks is not None), np.float32(cap)


def host_array(rt: Runtime, a) -> np.ndarray:
    """A small index array (host or device) as a NumPy array."""
    return rt.asnumpy(a) if isinstance(a, rt.xp.ndarray) else np.asarray(a)


_DEVICE_ATTRIBUTES: dict[int, dict] = {}


def device_attributes(rt: Runtime) -> dict:
    """The current CUDA device's attributes (``cupy.cuda.Device().attributes``), read once per device:
    building the dict costs one driver call per attribute. Empty on the simulator."""
    if rt.name != "cupy":
        return {}
    dev = rt.xp.cuda.Device()
    if dev.id not in _DEVICE_ATTRIBUTES:
        _DEVICE_ATTRIBUTES[dev.id] = dict(dev.attributes)
    return _DEVICE_ATTRIBUTES[dev.id]


def multiprocessors(rt: Runtime) -> int:
    """Streaming multiprocessors of the current device (1 on the simulator)."""
    return int(device_attributes(rt).get("MultiProcessorCount", 1))


__all__ = ["BACKENDS", "BLOCKS_PER_SM", "MAX_HEAD_DIM", "STATIC_SMEM_LIMIT", "CupyRuntime", "Runtime", "SimRuntime",
           "cache_defines", "check_device_rows", "default_runtime", "device_attributes", "device_f32", "get_runtime",
           "head_dim_defines", "host_array", "multiprocessors", "score_options"]
