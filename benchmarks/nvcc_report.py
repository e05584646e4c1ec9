"""Compile every kernel source with nvcc for sm_80 and sm_90 and record what ptxas reports.

    python benchmarks/nvcc_report.py            # prints the table, writes benchmarks/results/nvcc_report.json

For each ``minikv_gpu/kernels/*.cu`` and each set of compile-time defines it is
launched with, runs ``nvcc -cubin -arch=sm_XX -Xptxas -v -I minikv_gpu/kernels`` (the
sources include ``common.cuh``, ``online_softmax.cuh``, ... from there) and parses, per
kernel: registers, static shared memory, stack frame, spill stores and loads. A kernel
defined in a shared header (``attention_reduce_v2``) is reported once per source.
Spills must be zero (DESIGN.md section 4); ``tests/gpu/test_nvcc.py`` asserts it.

Define sets: a source declares them in a comment line, for example

    // nvcc-check: HEAD_DIM=64,128 CACHE_HALF=0,1

which means the cartesian product (4 builds here). Several such lines mean the
union of their products (mla.cu: DeepSeek-V3's R=512, P=64 and a small geometry,
whose sizes do not mix). A source without such a line is compiled once, with its
own defaults. Dynamic shared memory is chosen
at launch and does not appear in ptxas's report.

NVRTC. On a GPU, CuPy compiles the same sources with NVRTC, which has no host
headers: ``INFINITY`` or ``FLT_MAX`` from <math.h> compile with nvcc and fail
there. When libnvrtc is found (``$MINIKV_NVRTC_LIB``, the ``nvidia-cuda-nvrtc``
pip package, or the CUDA toolkit's lib64), every source and define set is also
compiled with NVRTC under CuPy's options, so such a failure shows up before a
GPU is lent (``pip install nvidia-cuda-nvrtc==13.0.*`` provides it, 200 MB).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "minikv_gpu" / "kernels"
RESULT = ROOT / "benchmarks" / "results" / "nvcc_report.json"
ARCHS = ("sm_80", "sm_90")

_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:, used (\d+) barriers)?(?:, (\d+) bytes smem)?")


def find_nvcc() -> str | None:
    """Path of nvcc on PATH or in the usual CUDA prefix, else None."""
    found = shutil.which("nvcc")
    if found:
        return found
    for cand in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
        p = Path(cand) / "bin" / "nvcc"
        if cand and p.exists():
            return str(p)
    return None


def nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"release ([\d.]+), V([\d.]+)", out)
    return m.group(2) if m else out.strip().splitlines()[-1]


def define_sets(source: Path) -> list[dict]:
    """The define sets declared by the source's ``// nvcc-check:`` lines ([{}] when there is none):
    each line is a cartesian product, several lines their union (in order, duplicates dropped)."""
    sets: list[dict] = []
    for line in source.read_text().splitlines():
        m = re.match(r"\s*//\s*nvcc-check:\s*(.*)$", line)
        if m:
            names, choices = [], []
            for item in m.group(1).split():
                name, values = item.split("=", 1)
                names.append(name)
                choices.append(values.split(","))
            sets += [d for d in (dict(zip(names, combo)) for combo in itertools.product(*choices)) if d not in sets]
    return sets or [{}]


def parse_ptxas(text: str) -> list[dict]:
    """Per-kernel resource usage from ``-Xptxas -v`` output."""
    rows, current = [], None
    for line in text.splitlines():
        if m := _ENTRY.search(line):
            current = {"kernel": m.group(1), "arch": m.group(2)}
            rows.append(current)
        elif current is not None and (m := _FRAME.search(line)):
            current.update(stack_bytes=int(m.group(1)), spill_store_bytes=int(m.group(2)),
                           spill_load_bytes=int(m.group(3)))
        elif current is not None and (m := _USED.search(line)):
            current.update(registers=int(m.group(1)), barriers=int(m.group(2) or 0), smem_bytes=int(m.group(3) or 0))
    for r in rows:
        missing = {"stack_bytes", "spill_store_bytes", "spill_load_bytes", "registers"} - set(r)
        if missing:
            raise RuntimeError(f"could not parse ptxas report for {r['kernel']}: missing {sorted(missing)}\n{text}")
    return rows


def compile_one(nvcc: str, source: Path, arch: str, defines: dict) -> list[dict]:
    """Compile one (source, arch, defines) to a cubin; return its parsed rows. Raises on a compile error."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [nvcc, "-cubin", f"-arch={arch}", "-Xptxas", "-v", f"-I{source.parent}",
               *(f"-D{k}={v}" for k, v in defines.items()), "-o", str(Path(tmp) / "out.cubin"), str(source)]
        res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{res.stderr}")
    rows = parse_ptxas(res.stderr)
    define_str = " ".join(f"{k}={v}" for k, v in defines.items())
    for r in rows:
        r.update(file=source.name, defines=define_str)
    return rows


def build_report(nvcc: str, sources: list[Path] | None = None, archs=ARCHS) -> list[dict]:
    """Compile every (source, define set, arch); rows sorted by file, defines, arch, kernel."""
    sources = sorted(KERNELS.glob("*.cu")) if sources is None else sources
    jobs = [(s, a, d) for s in sources for d in define_sets(s) for a in archs]
    with ThreadPoolExecutor(max_workers=len(os.sched_getaffinity(0))) as pool:
        results = list(pool.map(lambda j: compile_one(nvcc, *j), jobs))
    rows = [r for rs in results for r in rs]
    order = ["file", "defines", "arch", "kernel", "registers", "smem_bytes", "stack_bytes", "spill_store_bytes",
             "spill_load_bytes", "barriers"]
    rows = [{k: r[k] for k in order} for r in rows]
    return sorted(rows, key=lambda r: (r["file"], r["defines"], r["arch"], r["kernel"]))


def find_nvrtc() -> str | None:
    """Path of libnvrtc.so: $MINIKV_NVRTC_LIB, the nvidia-cuda-nvrtc wheel on sys.path, or the toolkit."""
    if os.environ.get("MINIKV_NVRTC_LIB"):
        return os.environ["MINIKV_NVRTC_LIB"]
    dirs = [Path(p) / "nvidia" / sub / "lib" for p in sys.path if p for sub in ("cu13", "cuda_nvrtc", "cu12")]
    dirs += [Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "lib64", Path("/usr/local/cuda/lib64")]
    for d in dirs:
        found = sorted(d.glob("libnvrtc.so*")) if d.is_dir() else []
        if found:
            return str(found[0])
    return None


def _cuda_include() -> Path:
    """The toolkit's include folder (cuda_fp16.h, math_constants.h), searched as minikv_gpu.runtime does."""
    nvcc = find_nvcc()
    roots = [os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda",
             str(Path(nvcc).resolve().parents[1]) if nvcc else None]
    for root in filter(None, roots):
        if (Path(root) / "include" / "cuda_fp16.h").is_file():
            return Path(root) / "include"
    raise RuntimeError("no CUDA include folder with cuda_fp16.h found; set CUDA_PATH")


def nvrtc_compile(lib_path: str, source: Path, arch: str, defines: dict) -> tuple[bool, str]:
    """Compile like cupy.RawModule does (-std=c++17, the CUDA include dir); return (ok, compiler log)."""
    lib_dir = Path(lib_path).parent
    for builtins in sorted(lib_dir.glob("libnvrtc-builtins.so*")):  # must be loadable by name
        ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
        break
    lib = ctypes.CDLL(lib_path)
    include = _cuda_include()
    opts = ["-std=c++17", f"-I{include}", f"-I{source.parent}", f"--gpu-architecture=compute_{arch[3:]}",
            *(f"-D{k}={v}" for k, v in defines.items())]
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.read_bytes(), source.name.encode(), 0, None, None):
        raise RuntimeError(f"nvrtcCreateProgram failed for {source}")
    try:
        argv = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        status = lib.nvrtcCompileProgram(prog, len(opts), argv)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return status == 0, log.value.decode(errors="replace").strip()


def nvrtc_report(lib_path: str, sources: list[Path] | None = None, archs=ARCHS) -> list[dict]:
    """NVRTC compile status of every (source, define set, arch), in that order.

    The compiles run one per CPU at a time, in threads: NVRTC allows concurrent calls on different
    programs, and ctypes releases the GIL for the length of each call."""
    sources = sorted(KERNELS.glob("*.cu")) if sources is None else sources
    jobs = [(s, a, d) for s in sources for d in define_sets(s) for a in archs]
    with ThreadPoolExecutor(max_workers=len(os.sched_getaffinity(0))) as pool:
        results = list(pool.map(lambda j: nvrtc_compile(lib_path, *j), jobs))
    return [{"file": s.name, "defines": " ".join(f"{k}={v}" for k, v in d.items()), "arch": a, "ok": ok, "log": log}
            for (s, a, d), (ok, log) in zip(jobs, results)]


def format_table(rows: list[dict]) -> str:
    """A Markdown table of the report."""
    head = "| file | defines | arch | kernel | regs | smem B | stack B | spill st B | spill ld B |"
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        lines.append(f"| {r['file']} | {r['defines'] or '-'} | {r['arch']} | {r['kernel']} | {r['registers']} | "
                     f"{r['smem_bytes']} | {r['stack_bytes']} | {r['spill_store_bytes']} | {r['spill_load_bytes']} |")
    return "\n".join(lines)


def main() -> int:
    nvcc = find_nvcc()
    if nvcc is None:
        print("nvcc not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin); install the CUDA toolkit", file=sys.stderr)
        return 1
    rows = build_report(nvcc)
    print(format_table(rows))
    sys.path.insert(0, str(ROOT))
    from minikv.bench.machine import machine_info, write_result

    lib = find_nvrtc()
    nvrtc = nvrtc_report(lib) if lib else []
    nvrtc_rows = [{k: r[k] for k in ("file", "defines", "arch", "ok")} for r in nvrtc]
    write_result(RESULT, {"nvcc": nvcc_version(nvcc), "archs": list(ARCHS), "machine": machine_info(),
                          "kernels": rows, "nvrtc": nvrtc_rows})
    spills = [r for r in rows if r["spill_store_bytes"] or r["spill_load_bytes"]]
    failed = [r for r in nvrtc if not r["ok"]]
    for r in failed:
        print(f"NVRTC failed: {r['file']} {r['defines']} {r['arch']}\n{r['log']}")
    print(f"\n{len(rows)} kernel builds, {len(spills)} with spills; NVRTC: "
          f"{f'{len(nvrtc) - len(failed)}/{len(nvrtc)} compile' if lib else 'libnvrtc not found, not checked'}; "
          f"wrote {RESULT.relative_to(ROOT)}")
    return 1 if spills or failed else 0


if __name__ == "__main__":
    sys.exit(main())
