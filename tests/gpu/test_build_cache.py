"""Compiled-module caches are keyed by every header a source includes, not by the .cu text alone.

The kernels ``#include "common.cuh"`` and friends; a cache key over the ``.cu`` text only would
silently reuse a stale module after a header edit. Here a temporary copy of a source that
includes a header (which includes another) is built, the inner header is edited, and the next
build must recompile: the kernel's result changes; a broken header must fail to compile.
"""

from __future__ import annotations

import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from minikv.errors import KernelCompileError
from minikv_gpu import cpu_sim, runtime
from minikv_gpu.cpu_sim.build import includes_digest, local_includes

SOURCE = """#include "value.cuh"
extern "C" __global__ void fill(float* out) { out[threadIdx.x] = value(); }
"""
VALUE_H = '#pragma once\n#include "inner.cuh"\n__device__ float value() { return VALUE; }\n'


def _inner(value: str) -> str:
    return f"#pragma once\n#define VALUE {value}\n"


@pytest.fixture()
def tree(tmp_path):
    (tmp_path / "value.cuh").write_text(VALUE_H)
    (tmp_path / "inner.cuh").write_text(_inner("1.0f"))
    (tmp_path / "fill.cu").write_text(SOURCE)
    return tmp_path


def _run_fill(folder) -> float:
    module = cpu_sim.load_module(SOURCE, str(folder / "fill.cu"), None, folder)
    out = np.zeros(32, np.float32)
    module.get_function("fill")((1,), (32,), (out,))
    return float(out[0])


def test_local_includes_are_followed_transitively(tree):
    assert local_includes(SOURCE, [tree]) == [(tree / "value.cuh").resolve(), (tree / "inner.cuh").resolve()]
    before = includes_digest(SOURCE, [tree])
    (tree / "inner.cuh").write_text(_inner("2.0f"))
    assert includes_digest(SOURCE, [tree]) != before


def test_editing_an_included_header_recompiles(sim_rt, tree):
    assert _run_fill(tree) == 1.0
    (tree / "inner.cuh").write_text(_inner("2.0f"))  # two includes deep; SOURCE itself is unchanged
    assert _run_fill(tree) == 2.0
    (tree / "inner.cuh").write_text(_inner("(1.0f +"))  # broken
    with pytest.raises(KernelCompileError):
        _run_fill(tree)
    (tree / "inner.cuh").write_text(_inner("1.0f"))  # back as it was: the first module again
    assert _run_fill(tree) == 1.0


class _FakeCupy:
    """Just enough of cupy for CupyRuntime._compile: records the code handed to RawModule."""

    ndarray = np.ndarray
    codes: list

    class RawModule:
        def __init__(self, code, options):
            _FakeCupy.codes.append(code)

        def get_function(self, name):
            return object()


def test_cupy_module_cache_key_covers_headers(tree):
    """CuPy's own disk cache hashes the code it is given: that code must change with a header."""
    _FakeCupy.codes = []
    rt = runtime.CupyRuntime(_FakeCupy)
    rt._compile(SOURCE, "fill.cu", "fill", None, tree)
    rt._compile(SOURCE, "fill.cu", "fill", None, tree)  # cached: no second RawModule
    (tree / "inner.cuh").write_text(_inner("2.0f"))
    rt._compile(SOURCE, "fill.cu", "fill", None, tree)
    assert len(_FakeCupy.codes) == 2 and _FakeCupy.codes[0] != _FakeCupy.codes[1]
    assert all(code.startswith(SOURCE) for code in _FakeCupy.codes)  # line numbers unchanged


@pytest.fixture(scope="module")
def own_cache(tmp_path_factory):
    """A simulator cache shared by the corruption cases (the runtime compiles once)."""
    return tmp_path_factory.mktemp("sim_cache")


@pytest.mark.parametrize("entry", ["module .so", "kernel list .json", "runtime .o", "digest"])
def test_a_corrupt_cache_entry_is_reported_and_rebuilt(sim_rt, tree, tmp_path, monkeypatch, entry, own_cache):
    # a cache of its own, and no module this process already loaded: the next load reads the disk again
    cache = own_cache
    monkeypatch.setenv("MINIKV_CACHE_DIR", str(cache))
    monkeypatch.setattr("minikv_gpu.cpu_sim.module._MODULES", {})
    assert _run_fill(tree) == 1.0
    pattern = {"module .so": "*.so", "kernel list .json": "*.json", "runtime .o": "runtime-*.o",
               "digest": "*.so.sha256"}[entry]
    victim = max((cache / "cpu_sim").glob(pattern), key=lambda p: p.stat().st_mtime_ns)  # this test's entry
    junk = tmp_path / "junk"
    junk.write_bytes(b"\x7fELF not really" if entry != "kernel list .json" else b'{"kernels": [')
    junk.replace(victim)  # a new file: never rewrite a .so this process has mapped
    monkeypatch.setattr("minikv_gpu.cpu_sim.module._MODULES", {})
    name = victim.name.removesuffix(".sha256")
    with pytest.warns(RuntimeWarning, match=f"{name} is corrupt"):
        assert _run_fill(tree) == 1.0
    monkeypatch.setattr("minikv_gpu.cpu_sim.module._MODULES", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # rebuilt: the next run finds it intact and says nothing
        assert _run_fill(tree) == 1.0


def test_two_builders_of_one_entry_compile_it_once(tmp_path, monkeypatch):
    """Two test processes (or two notebooks) building kernels over one cache at the same time: while one compiles
    an entry, the other waits for it (an flock per entry, the runtime objects' included) and loads it, instead
    of compiling the same thing a second time or finding a half-recorded object and removing it as corrupt.
    Two threads here, each opening the lock files itself, as two processes would, from a cold cache; every
    compile is slowed so that both ask while it is missing."""
    from minikv_gpu.cpu_sim import build as sim_build

    monkeypatch.setenv("MINIKV_CACHE_DIR", str(tmp_path))
    compiles, real_run = [], sim_build._run

    def slow_run(cmd, what, stdin=None):
        if what.startswith("compiling"):
            compiles.append(what)
            time.sleep(0.5)
        return real_run(cmd, what, stdin)

    monkeypatch.setattr(sim_build, "_run", slow_run)
    source = 'extern "C" __global__ void one(int* out) { out[0] = 1; }'
    start = threading.Barrier(2)

    def builder():
        start.wait()
        return sim_build.build(source, "race.cu")

    with ThreadPoolExecutor(max_workers=2) as pool:
        first, second = pool.map(lambda _: builder(), range(2))
    assert sorted(compiles) == sorted(set(compiles)) and any(w.startswith("compiling race.cu") for w in compiles), \
        compiles  # each runtime object and the module once
    assert first.path == second.path and [k.name for k in second.kernels] == ["one"]
