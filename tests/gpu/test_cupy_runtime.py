"""The CuPy runtime's launch path (runtime._CupyKernel) with stand-ins for CuPy's own objects.

CI has no GPU, and the simulator's arrays are NumPy arrays: a check that reads an attribute
only NumPy has (``flags.writeable``, ``ctypes``, ``base``...) passes there and fails on every
launch on a GPU. These stand-ins expose what a ``cupy.ndarray`` and a ``cupy.RawKernel`` expose
(as far as the runtime reads them) and nothing else, so such a slip fails here.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
from sim_sources import SOURCE

from minikv.errors import KernelLaunchError
from minikv_gpu import cupy_status, runtime


class _Flags:
    """cupy._core.flags.Flags: exactly three read-only attributes, and item access by their upper-case names."""

    __slots__ = ("_c", "_f", "_o")

    def __init__(self, c_contiguous: bool, f_contiguous: bool, owndata: bool):
        self._c, self._f, self._o = c_contiguous, f_contiguous, owndata

    c_contiguous = property(lambda self: self._c)
    f_contiguous = property(lambda self: self._f)
    owndata = property(lambda self: self._o)

    def __getitem__(self, name):
        names = {"C_CONTIGUOUS": self._c, "F_CONTIGUOUS": self._f, "OWNDATA": self._o}
        if name not in names:
            raise KeyError(f"{name} is not defined for cupy.ndarray.flags")
        return names[name]


class _Pointer:
    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr


class FakeDeviceArray:
    """A cupy.ndarray as the launch checks see it: shape, dtype, size, strides, nbytes, ndim, flags, data.ptr.

    No ``ctypes``, ``base`` or buffer protocol; ``np.asarray`` of it raises TypeError, as CuPy's does.
    The memory is a host NumPy array kept aside, so a test can still look at the "device" data.
    """

    __slots__ = ("_host", "shape", "dtype", "size", "strides", "nbytes", "ndim", "flags", "data")
    __module__ = "cupy"

    def __init__(self, host: np.ndarray, owndata: bool = True):
        self._host = host
        self.shape, self.dtype, self.size = host.shape, host.dtype, host.size
        self.strides, self.nbytes, self.ndim = host.strides, host.nbytes, host.ndim
        self.flags = _Flags(host.flags.c_contiguous, host.flags.f_contiguous, owndata)
        self.data = _Pointer(host.__array_interface__["data"][0])

    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct a "
                        "NumPy array explicitly.")

    def __getitem__(self, index):
        view = self._host[index]
        return FakeDeviceArray(view, owndata=False)


FakeDeviceArray.__name__ = "ndarray"


class FakeRawKernel:
    """cupy.RawKernel: records launches; num_regs, shared_size_bytes, max_dynamic_shared_size_bytes."""

    def __init__(self, num_regs=32, shared_size_bytes=1024):
        self.num_regs, self.shared_size_bytes = num_regs, shared_size_bytes
        self.max_dynamic_shared_size_bytes = 48 * 1024 - shared_size_bytes  # CUDA's default attribute
        self.launches = []

    def __call__(self, grid, block, args, shared_mem=0):
        assert isinstance(args, tuple)
        self.launches.append((grid, block, args, shared_mem))


class FakeCupy:
    ndarray = FakeDeviceArray

    class RawModule:
        def __init__(self, code, options):
            self.kernels = {}

        def get_function(self, name):
            return self.kernels.setdefault(name, FakeRawKernel())


@pytest.fixture
def cupy_kernel():
    rt = runtime.CupyRuntime(FakeCupy)
    return rt.kernel_from_source(SOURCE, "block_sum")  # (const float* x, float* out, int n)


def dev(a) -> FakeDeviceArray:
    return FakeDeviceArray(np.ascontiguousarray(a))


def test_stand_in_is_as_strict_as_cupy():
    a = dev(np.zeros(4, np.float32))
    assert not hasattr(a.flags, "writeable") and not hasattr(a, "ctypes") and not hasattr(a, "base")
    with pytest.raises(KeyError):
        a.flags["WRITEABLE"]  # noqa: B018
    with pytest.raises(TypeError, match="Implicit conversion"):
        np.asarray(a)


def test_a_launch_with_cupy_arrays_passes_the_checks(cupy_kernel):
    x, out = dev(np.ones(8, np.float32)), dev(np.zeros(1, np.float32))
    cupy_kernel((1,), (256,), (x, out, np.int32(8)))
    (grid, block, args, shared), = cupy_kernel._raw.launches
    assert grid == (1, 1, 1) and block == (256, 1, 1) and args[0] is x and args[1] is out and shared == 0


@pytest.mark.parametrize("args,match", [
    (lambda: (dev(np.ones(8, np.float64)), dev(np.zeros(1, np.float32)), np.int32(8)), "needs a float32 array"),
    (lambda: (dev(np.ones((4, 4), np.float32))[:, 1], dev(np.zeros(1, np.float32)), np.int32(4)),
     "not C-contiguous"),
    (lambda: (np.ones(8, np.float32), dev(np.zeros(1, np.float32)), np.int32(8)), r"pass a cupy.ndarray"),
    (lambda: (dev(np.ones(8, np.float32)), dev(np.zeros(1, np.float32)), 8), "exact NumPy scalar"),
])
def test_cupy_arguments_are_still_checked(cupy_kernel, args, match):
    with pytest.raises(KernelLaunchError, match=match):
        cupy_kernel((1,), (256,), args())
    assert cupy_kernel._raw.launches == []


def test_cupy_launches_get_the_simulators_resource_checks(cupy_kernel):
    raw = cupy_kernel._raw  # static shared 1024 bytes, 32 registers
    x, out = dev(np.ones(8, np.float32)), dev(np.zeros(1, np.float32))
    cupy_kernel((1,), (256,), (x, out, np.int32(8)), shared_mem=48 * 1024 - 1024)  # at the limit
    with pytest.raises(KernelLaunchError, match="48 KiB.*opt in first"):
        cupy_kernel((1,), (256,), (x, out, np.int32(8)), shared_mem=48 * 1024 - 1023)
    cupy_kernel.max_dynamic_shared_size_bytes = 100_000  # the explicit opt-in sets CuPy's attribute
    assert raw.max_dynamic_shared_size_bytes == 100_000
    cupy_kernel((1,), (256,), (x, out, np.int32(8)), shared_mem=100_000)
    with pytest.raises(KernelLaunchError, match="opt-in"):
        cupy_kernel((1,), (256,), (x, out, np.int32(8)), shared_mem=100_001)
    raw.num_regs, cupy_kernel._usage = 128, None
    cupy_kernel((1,), (512,), (x, out, np.int32(8)))
    with pytest.raises(KernelLaunchError, match="69632 registers"):
        cupy_kernel((1,), (544,), (x, out, np.int32(8)))
    assert [launch[3] for launch in raw.launches] == [48 * 1024 - 1024, 100_000, 0]


# --- when CuPy cannot start: which problem, and what to install, in one line --------------------------------

class _CudaError(Exception):
    def __init__(self, status):
        super().__init__(f"cudaError {status}")
        self.status = status


def _fake_cupy(status):
    def count():
        raise _CudaError(status)
    return types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=count)))


@pytest.mark.parametrize("driver, status, says", [
    (12040, None, ["not installed", "minikv[cuda12]", "CUDA 12.4"]),   # Colab: a CUDA 12 driver, no CuPy
    (13000, None, ["not installed", "minikv[cuda13]"]),
    (None, None, ["not installed", "minikv[cuda12]", "minikv[cuda13]", "NVIDIA driver"]),
    (12020, 35, ["older than this CuPy", "uninstall", "minikv[cuda12]"]),  # cupy-cuda13x on a CUDA 12 driver
    (13000, 100, ["no CUDA device"]),
])
def test_cupy_that_cannot_start_says_why_and_what_to_install(monkeypatch, driver, status, says):
    monkeypatch.setattr(cupy_status, "driver_cuda_version", lambda: driver)
    monkeypatch.setitem(sys.modules, "cupy", None if status is None else _fake_cupy(status))
    cupy, reason = cupy_status.cupy_or_reason()
    assert cupy is None and "\n" not in reason
    for word in says:
        assert word in reason, (word, reason)


def test_compare_with_backend_cupy_fails_in_one_line_before_building_the_model(monkeypatch, capsys):
    from minikv import cli

    monkeypatch.setattr(cupy_status, "driver_cuda_version", lambda: 12040)
    monkeypatch.setitem(sys.modules, "cupy", None)
    monkeypatch.setattr(runtime, "_RUNTIMES", {})
    code = cli.main(["compare", "--backend", "cupy", "--random", "--prompt", "hi", "--max-new-tokens", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "minikv[cuda12]" in err[0] and "CUDA 12.4" in err[0]
