"""The kernel runtime around the simulator (minikv_gpu/runtime.py, cpu_sim/build.py): backend
selection, kernel files and names, transfers, defines, the on-disk module cache, the portable
context switch, AddressSanitizer builds and the signature parser CuPy's argument checks use.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from sim_sources import ROOT, SIM_SOURCE, SOURCE, asan_env

from minikv.errors import (
    BackendUnavailableError,
    InvalidInputError,
    KernelDeadlockError,
)
from minikv_gpu import cpu_sim, cupy_status, runtime
from minikv_gpu.cpu_sim.signature import find_kernels

# ---- runtime ---------------------------------------------------------------------------------------

def test_backend_selection(monkeypatch):
    monkeypatch.setenv("MINIKV_GPU_BACKEND", "sim")
    assert runtime.default_runtime().name == "sim" and runtime.default_runtime().xp is np
    assert runtime.get_runtime("sim") is runtime.get_runtime("sim")
    monkeypatch.setenv("MINIKV_GPU_BACKEND", "tpu")
    with pytest.raises(InvalidInputError, match="MINIKV_GPU_BACKEND='tpu'"):
        runtime.default_runtime()
    with pytest.raises(InvalidInputError, match="backend must be one of"):
        runtime.get_runtime("opencl")


def test_asking_for_cupy_without_a_gpu_raises(monkeypatch):
    cupy, reason = cupy_status.cupy_or_reason()
    if cupy is not None:
        pytest.skip("this machine has a usable GPU")
    with pytest.raises(BackendUnavailableError, match="backend 'cupy' cannot run here"):
        runtime.get_runtime("cupy")


def test_kernel_files_and_names_are_validated(sim_rt):
    with pytest.raises(InvalidInputError, match="available stems"):
        sim_rt.kernel("no_such_step", "k")
    with pytest.raises(InvalidInputError, match="plain name"):
        sim_rt.kernel("../secrets", "k")
    with pytest.raises(InvalidInputError, match=r"no kernel 'warp_sum' in .* it has \['block_sum'"):
        sim_rt.kernel_from_source(SOURCE, "warp_sum")  # a __device__ function, not a kernel
    with pytest.raises(InvalidInputError, match="not a C identifier"):
        sim_rt.kernel_from_source(SOURCE, "block_sum", defines={"A-B": 1})


def test_asarray_copies_like_a_transfer(sim_rt):
    host = np.arange(4, dtype=np.float32)
    d = sim_rt.asarray(host)
    d[0] = 9
    assert host[0] == 0 and sim_rt.asnumpy(d)[0] == 9 and sim_rt.asnumpy(d) is not d


def test_defines_reach_the_source(sim_rt):
    src = 'extern "C" __global__ void fill(int* out) { out[threadIdx.x] = VALUE * SCALE; }'
    out = np.zeros(2, np.int32)
    sim_rt.kernel_from_source(src, "fill", defines={"VALUE": 7, "SCALE": True})((1,), (2,), (out,))
    assert out.tolist() == [7, 7]


def test_compiled_modules_are_cached_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIKV_CACHE_DIR", str(tmp_path))
    src = 'extern "C" __global__ void one(int* out) { out[0] = 1; }'
    first = cpu_sim.build.build(src, "<cache test>")
    assert first.path.exists() and first.path.parent == tmp_path / "cpu_sim"

    def no_compiler(*args, **kwargs):
        raise AssertionError(f"recompiled: {args}")
    monkeypatch.setattr(cpu_sim.build.subprocess, "run", no_compiler)  # the compiler id stays cached
    second = cpu_sim.build.build(src, "<cache test>")
    assert second.path == first.path and second.kernels == first.kernels


def test_portable_ucontext_switch_gives_the_same_results(sim_rt, monkeypatch):
    monkeypatch.setenv("MINIKV_SIM_UCONTEXT", "1")
    module = cpu_sim.load_module(SOURCE, "ucontext.cu")
    x = np.arange(96, dtype=np.float32)
    out = np.zeros(96, np.float32)
    module.get_function("warp_sums")((3,), (32,), (x, out))
    np.testing.assert_array_equal(out, np.repeat(x.reshape(3, 32).sum(1), 32))
    with pytest.raises(KernelDeadlockError):
        cpu_sim.load_module(SIM_SOURCE, "ucontext.cu").get_function("barrier_after_exit")(
            (1,), (32,), (np.zeros(32, np.float32),))


# ---- AddressSanitizer ---------------------------------------------------------------------------

def test_asan_catches_an_out_of_bounds_write():
    script = textwrap.dedent("""
        import numpy as np
        from minikv_gpu import runtime
        src = 'extern "C" __global__ void oob(float* out) { out[threadIdx.x + 1] = 1.0f; }'
        out = np.zeros(32, np.float32)
        runtime.get_runtime("sim").kernel_from_source(src, "oob")((1,), (32,), (out,))
        print("not caught")
    """)
    proc = subprocess.run([sys.executable, "-c", script], env=asan_env(), capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "AddressSanitizer: heap-buffer-overflow" in proc.stderr and "WRITE of size 4" in proc.stderr
    assert re.search(r"in oob .*<source>:1", proc.stderr)
    assert "not caught" not in proc.stdout


def test_asan_catches_dynamic_shared_memory_beyond_the_launch_size():
    script = textwrap.dedent("""
        import numpy as np
        from minikv_gpu import runtime
        src = 'extern "C" __global__ void k(float* out) { extern __shared__ float s[]; s[threadIdx.x] = 1.0f; }'
        runtime.get_runtime("sim").kernel_from_source(src, "k")((1,), (32,), (np.zeros(1, np.float32),),
                                                                shared_mem=31 * 4)
        print("not caught")
    """)
    proc = subprocess.run([sys.executable, "-c", script], env=asan_env(), capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert proc.returncode != 0 and "AddressSanitizer: use-after-poison" in proc.stderr, proc.stderr[-3000:]


def test_asan_build_catches_a_misaligned_vector_load():
    """-fsanitize=alignment: a float4 load 4 bytes off its alignment faults on a GPU, and here too
    (without ASan, x86 loads it happily)."""
    script = textwrap.dedent('''
        import numpy as np
        from minikv.errors import KernelFaultError
        from minikv_gpu import runtime
        src = """extern "C" __global__ void shifted(const float* x, float* out, int offset) {
            const float4 v = *reinterpret_cast<const float4*>(x + offset + 4 * threadIdx.x);
            out[threadIdx.x] = v.x + v.y + v.z + v.w;
        }"""
        k = runtime.get_runtime("sim").kernel_from_source(src, "shifted")
        x, out = np.arange(40, dtype=np.float32), np.zeros(8, np.float32)
        k((1,), (8,), (x, out, np.int32(0)))
        assert out[1] == 4 + 5 + 6 + 7, out
        try:
            k((1,), (8,), (x, out, np.int32(1)))
        except KernelFaultError as exc:
            print("caught:", exc)
    ''')
    proc = subprocess.run([sys.executable, "-c", script], env=asan_env(), capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert re.search(r"caught: shifted<<<.*thread \(0,0,0\): misaligned address 0x[0-9a-f]*4 at <source>:2: "
                     r"a .*float4.* needs 16-byte alignment", proc.stdout), proc.stdout + proc.stderr[-3000:]


def test_asan_run_of_the_simulator_tests():
    """The simulator's kernel tests (test_cpu_sim*.py), compiled with -fsanitize=address: no report,
    same results."""
    selected = ("(block_reduction or warp_reduction or divergent_half or votes or atomics or dynamic_shared or "
                "missing_syncthreads or three_d or half_conversions or vector_types or spin_lock or barrier_after or "
                "shuffle_from_an_exited or stack_overflow or wild_pointer or arguments_are_checked) "
                "and not asan")
    files = [str(Path(__file__).with_name(n)) for n in ("test_cpu_sim.py", "test_cpu_sim_reports.py")]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files, "-k", selected],
                          env=asan_env(), capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "AddressSanitizer" not in proc.stderr
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= 16 and "failed" not in proc.stdout, proc.stdout[-2000:]


def test_signature_parser_reads_raw_source():
    """What CuPy's argument checks use where no g++ is around to preprocess the source."""
    src = textwrap.dedent("""
        typedef float real;
        // extern "C" __global__ void commented_out(int* x) {}
        extern "C" __global__ void __launch_bounds__(256, 2)
        k1(const real* __restrict__ a, float4* b, unsigned n, long long m, const __half2* h, int arr[],
           unsigned char* bytes, volatile int* flag, float** table) {}
        extern "C" __global__ void k2() {}
        extern "C" __global__ void k3(void);
        extern "C" __global__ void k3(void) {}
    """)
    decls = {d.name: d.params for d in find_kernels(src)}
    assert list(decls) == ["k1", "k2", "k3"] and decls["k2"] == () and decls["k3"] == ()
    got = [(p.name, p.pointer, p.const, p.dtype, p.lanes) for p in decls["k1"]]
    assert got == [("a", True, True, "float32", 1), ("b", True, False, "float32", 4), ("n", False, False, "uint32", 1),
                   ("m", False, False, "int64", 1), ("h", True, True, "float16", 2), ("arr", True, False, "int32", 1),
                   ("bytes", True, False, "uint8", 1), ("flag", True, False, "int32", 1),
                   ("table", True, False, None, 1)]
    assert decls["k1"][0].ctype == "const real*"


def test_device_attributes_are_read_once_per_device(monkeypatch):
    """cupy's Device().attributes makes one driver call per attribute: multiprocessors() (asked by every
    attend that picks a split) reads them once per device, from runtime.device_attributes' cache."""
    reads = []

    class FakeDevice:
        def __init__(self):
            self.id = 7

        @property
        def attributes(self):
            reads.append(self.id)
            return {"MultiProcessorCount": 132, "L2CacheSize": 50 << 20}

    class FakeRuntime:
        name = "cupy"

        class xp:  # noqa: N801 (stands for the cupy module)
            class cuda:  # noqa: N801
                Device = FakeDevice

    monkeypatch.setattr(runtime, "_DEVICE_ATTRIBUTES", {})
    assert [runtime.multiprocessors(FakeRuntime) for _ in range(3)] == [132] * 3
    assert runtime.device_attributes(FakeRuntime)["L2CacheSize"] == 50 << 20 and reads == [7]
    assert runtime.multiprocessors(runtime.get_runtime("sim")) == 1
