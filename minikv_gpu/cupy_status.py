"""Whether CuPy can run here, and if not, why and what to install: one line for ``minikv compare --backend
cupy`` and every other place that asks for the CuPy runtime (``minikv_gpu.runtime.get_runtime``).

The driver is asked first, without CuPy (libcuda's ``cuDriverGetVersion``), so the answer can name the
wheel that fits it: ``minikv[cuda12]`` for a CUDA 12 driver (Colab, most cloud images), ``minikv[cuda13]``
for CUDA 13. Then CuPy: missing, installed but not loading (two cupy-cuda* wheels, missing libraries),
built for a newer CUDA than the driver's (cudaErrorInsufficientDriver, 35), or seeing no device
(cudaErrorNoDevice, 100, e.g. CUDA_VISIBLE_DEVICES="").
"""

from __future__ import annotations

import ctypes
import os

__all__ = ["CUDA_ERROR_INSUFFICIENT_DRIVER", "CUDA_ERROR_NO_DEVICE", "cupy_or_reason", "driver_cuda_version"]

CUDA_ERROR_INSUFFICIENT_DRIVER, CUDA_ERROR_NO_DEVICE = 35, 100  # cudaError_t: driver too old, no device


def driver_cuda_version() -> int | None:
    """The CUDA version the NVIDIA driver supports (12040 for 12.4; libcuda's cuDriverGetVersion), or None
    where there is no driver. Asked without CuPy, so it also says which CuPy wheel a machine needs."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int(0)
        return version.value if lib.cuDriverGetVersion(ctypes.byref(version)) == 0 and version.value else None
    except (OSError, AttributeError):
        return None


def _wheel_for(driver: int | None) -> str:
    """The pip line for a driver: minikv[cuda12] or minikv[cuda13] (both name their CuPy wheel)."""
    if driver is None:
        return "on a machine with an NVIDIA driver, pip install 'minikv[cuda12]' (CUDA 12) or 'minikv[cuda13]' (13)"
    extra = "cuda13" if driver >= 13000 else "cuda12"
    return f"pip install 'minikv[{extra}]' (the driver supports CUDA {driver // 1000}.{driver % 1000 // 10})"


def cupy_or_reason():
    """(cupy module, "") when a CUDA device is usable, else (None, why not and what to install: one line)."""
    driver = driver_cuda_version()
    try:
        import cupy
    except ImportError as exc:
        return None, f"CuPy is not installed ({exc}); {_wheel_for(driver)}"
    except Exception as exc:  # a wheel whose CUDA libraries cannot load (e.g. two cupy-cuda* wheels)
        return None, f"CuPy is installed but does not load ({type(exc).__name__}: {exc}); pip uninstall the " \
                     f"cupy-cuda* wheels, then {_wheel_for(driver)}"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDA driver missing, too old for the wheel, no device, ...
        status = getattr(exc, "status", None)
        if driver is None:
            return None, f"CuPy finds no NVIDIA driver (libcuda.so.1): {exc}"
        if status == CUDA_ERROR_INSUFFICIENT_DRIVER:
            return None, f"the NVIDIA driver (CUDA {driver // 1000}.{driver % 1000 // 10}) is older than this " \
                         f"CuPy's CUDA toolkit: pip uninstall the cupy-cuda* wheels, then {_wheel_for(driver)}"
        if status == CUDA_ERROR_NO_DEVICE:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            return None, "the driver sees no CUDA device" + (f" (CUDA_VISIBLE_DEVICES={visible!r})"
                                                             if visible is not None else "")
        return None, f"CuPy cannot reach a CUDA device: {exc}"
    if count < 1:
        return None, "CuPy sees no CUDA device"
    return cupy, ""
