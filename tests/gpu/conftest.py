"""Fixtures for the kernel tests.

``rt``       every backend this machine has: always the CPU simulator ("sim"), plus CuPy
             ("cupy") where a CUDA GPU is usable. Kernel tests take ``rt`` and run on both.
``sim_rt``   the simulator only (tests of the simulator itself).
``cupy_rt``  CuPy only; skips where there is no GPU. Mark such tests ``@pytest.mark.gpu``:
             they skip cleanly here as well (full-size checks that would be too slow on the sim).
``default_schedule``  clears MINIKV_SIM_BLOCKS and MINIKV_SIM_SCHEDULE for a test that shows what
             the simulator's default schedule does (printf order, which thread a report names);
             CI also runs the kernel tests under the other schedules (Makefile ``test``).
"""

from __future__ import annotations

import functools

import pytest

from minikv_gpu import runtime


@functools.lru_cache(maxsize=1)
def _gpu_reason() -> str:
    """'' when CuPy can reach a CUDA device, else why not."""
    try:
        runtime.get_runtime("cupy")
    except Exception as exc:  # BackendUnavailableError, or a broken CUDA install
        return str(exc)
    return ""


def _backends() -> list:
    # The CuPy instances carry the ``gpu`` marker, so ``pytest -m gpu`` on a GPU machine selects
    # every kernel test on the real device (plus the cupy_rt full-size tests) and nothing else.
    return ["sim"] if _gpu_reason() else ["sim", pytest.param("cupy", marks=pytest.mark.gpu)]


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") and _gpu_reason():
        pytest.skip(f"needs a CUDA GPU: {_gpu_reason()}")


@pytest.fixture(scope="session", params=_backends())
def rt(request):
    return runtime.get_runtime(request.param)


@pytest.fixture(scope="session")
def sim_rt():
    return runtime.get_runtime("sim")


@pytest.fixture
def default_schedule(monkeypatch):
    monkeypatch.delenv("MINIKV_SIM_BLOCKS", raising=False)
    monkeypatch.delenv("MINIKV_SIM_SCHEDULE", raising=False)


@pytest.fixture(scope="session")
def cupy_rt():
    if _gpu_reason():
        pytest.skip(f"needs a CUDA GPU: {_gpu_reason()}")
    return runtime.get_runtime("cupy")
