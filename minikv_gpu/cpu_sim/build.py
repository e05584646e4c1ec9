"""Compile a .cu source with g++ into a shared library that the simulator loads with ctypes.

Steps (cached on disk by a hash of everything that goes in: the source, every local header it
``#include "..."``s, transitively, the flags, the compiler and the simulator's own headers):
1. rewrite ``extern __shared__`` to ``extern __minikv_extern_shared__`` (the one textual change:
   a ``static`` shared array cannot be ``extern``, so the two need different macros);
2. preprocess with ``-DMINIKV_SIM_SCAN`` and read the kernels and dynamic shared arrays from
   the result (macros, ``#if`` and typedefs are resolved by then);
3. append a generated wrapper: one ``void entry(void** args)`` per kernel, each kernel's
   parameter table (from C++ type traits), the dynamic shared memory buffer that every
   ``extern __shared__`` array aliases, and the C entry points that Python calls;
4. link it with the runtime (``sim_runtime.cpp`` + ``switch_x86_64.S``, compiled once).

One process (or thread) at a time looks an entry up and compiles it if missing (an flock on
``<key>.lock``; the runtime objects too): another that wants the same entry meanwhile waits and loads it.

Every cache entry carries the sha256 of its bytes (``entries``): a corrupt one is reported
(``RuntimeWarning`` naming the file), removed and rebuilt, instead of breaking every later run.

Environment: ``MINIKV_CACHE_DIR`` (default ``~/.cache/minikv``; files go to its ``cpu_sim/``),
``CXX`` (default ``g++``), ``MINIKV_SIM_ASAN=1`` (AddressSanitizer build, with misaligned accesses
reported too: ``-fsanitize=alignment``),
``MINIKV_SIM_UCONTEXT=1`` (portable swapcontext switch instead of the assembly one).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from minikv.errors import BackendUnavailableError, InvalidInputError, KernelCompileError

from .entries import intact, record, report_unreadable
from .signature import EXTERN_SHARED_MARK, KERNEL_MARK, KernelDecl, Param, find_extern_shared, find_kernels

SIM_DIR = Path(__file__).resolve().parent
INCLUDE_DIR = SIM_DIR / "include"
DYN_SHARED_CAPACITY = 227 * 1024  # H100/H200 opt-in maximum of shared memory per block
_FORMAT_VERSION = "5"  # bump when the generated wrapper or the cache entries change shape (5: digests)


@dataclass(frozen=True)
class BuildOptions:
    asan: bool = False
    ucontext: bool = False

    @classmethod
    def from_env(cls) -> BuildOptions:
        def flag(name: str) -> bool:
            return os.environ.get(name, "0").strip().lower() not in ("", "0", "false", "no")
        return cls(asan=flag("MINIKV_SIM_ASAN"), ucontext=flag("MINIKV_SIM_UCONTEXT"))


def cache_dir() -> Path:
    root = os.environ.get("MINIKV_CACHE_DIR")
    if root:
        base = Path(root).expanduser()
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "minikv"
    path = base / "cpu_sim"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BackendUnavailableError(f"cannot create the simulator's cache folder {path} ({exc}); "
                                      "point MINIKV_CACHE_DIR at a writable folder") from exc
    return path


def compiler() -> str:
    cxx = os.environ.get("CXX") or "g++"
    found = shutil.which(cxx)
    if not found:
        raise BackendUnavailableError(f"the CPU simulator needs a C++17 compiler, but {cxx!r} is not on PATH; "
                                      "install g++ (apt-get install g++) or set CXX")
    return found


@functools.lru_cache(maxsize=None)
def _compiler_id(cxx: str) -> str:
    out = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
    return out.splitlines()[0] if out else cxx


def define_flags(defines: dict | None) -> list[str]:
    """{"HEAD_DIM": 64, "CACHE_HALF": True} -> ["-DCACHE_HALF=1", "-DHEAD_DIM=64"] (sorted, validated)."""
    flags = []
    for key, value in sorted((defines or {}).items()):
        if not isinstance(key, str) or not re.fullmatch(r"[A-Za-z_]\w*", key):
            raise InvalidInputError(f"define name {key!r} is not a C identifier")
        if isinstance(value, bool):
            value = int(value)
        if not isinstance(value, (int, float, str)) or (isinstance(value, str) and "\n" in value):
            raise InvalidInputError(f"define {key}={value!r}: use an int, float, bool or one-line str")
        flags.append(f"-D{key}={value}")
    return flags


def _base_flags(opts: BuildOptions) -> list[str]:
    flags = ["-std=c++17", "-fPIC", "-fvisibility=hidden", "-pthread",
             "-fstack-clash-protection",  # big frames probe every page, so they cannot jump the guard
             "-fno-strict-aliasing",      # CUDA code reinterprets float* as float4* and __half* as uint4*
             "-ffp-contract=off",         # no FMA contraction (nvcc does contract: compare with tolerances)
             "-Wno-unknown-pragmas",      # #pragma unroll
             f"-I{INCLUDE_DIR}"]
    if opts.asan:
        # -fsanitize=alignment: a misaligned float4/uint4 access faults on a GPU; here the runtime's own
        # handler (sim_runtime.cpp) turns it into a KernelFaultError.
        flags += ["-O1", "-g", "-fsanitize=address,alignment", "-fno-sanitize-recover=alignment",
                  "-fno-omit-frame-pointer"]
    else:
        flags += ["-O2"]
    if opts.ucontext:
        flags += ["-DMINIKV_SIM_UCONTEXT"]
    return flags


def _digest(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else p.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def _headers_digest() -> str:
    return _digest(*(p.name + p.read_text() for p in sorted(INCLUDE_DIR.iterdir()) if p.suffix == ".h"))


_LOCAL_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)


def local_includes(source: str, include_dirs: list[Path]) -> list[Path]:
    """The local headers (``#include "name"``) ``source`` pulls in, transitively, in first-seen order.

    A name resolves against the including header's folder first (as the preprocessor does), then
    ``include_dirs``; one that resolves nowhere is left for the compiler to report.
    """
    found: list[Path] = []
    pending = [(source, None)]
    while pending:
        text, folder = pending.pop()
        for name in _LOCAL_INCLUDE.findall(text):
            dirs = ([folder] if folder is not None else []) + [Path(d) for d in include_dirs]
            path = next((d / name for d in dirs if (d / name).is_file()), None)
            if path is None or path.resolve() in found:
                continue
            found.append(path.resolve())
            pending.append((path.read_text(), path.resolve().parent))
    return found


def includes_digest(source: str, include_dirs: list[Path]) -> str:
    """A digest of the name and text of every local header ``source`` includes (``local_includes``)."""
    return _digest(*(str(p) + "\0" + p.read_text() for p in local_includes(source, include_dirs)))


def _run(cmd: list[str], what: str, stdin: str | None = None) -> str:
    proc = subprocess.run(cmd, input=stdin, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        err = proc.stderr.strip()
        if len(err) > 6000:
            err = err[:6000] + "\n... (truncated)"
        raise KernelCompileError(f"{what} failed (g++ exit {proc.returncode}):\n{err}")
    return proc.stdout


def _atomic_write(path: Path, write) -> None:
    """Create path via a temporary file in the same folder, so parallel processes never see half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _runtime_objects(cxx: str, opts: BuildOptions) -> list[Path]:
    """sim_runtime.cpp and the context switch, compiled once per compiler, flags and source."""
    sources = [SIM_DIR / "sim_runtime.cpp"]
    if platform.machine() in ("x86_64", "AMD64") and not opts.ucontext:
        sources.append(SIM_DIR / "switch_x86_64.S")
    flags = _base_flags(opts)
    key = _digest(_FORMAT_VERSION, _compiler_id(cxx), " ".join(flags), _headers_digest(),
                  *(s.read_text() for s in sources))
    objects = []
    with _building(f"runtime-{key}"):  # the same lock as a module's: one process checks and compiles them
        for src in sources:
            obj = cache_dir() / f"runtime-{key}-{src.stem}.o"
            if not intact(obj):
                _atomic_write(obj, lambda tmp, src=src: _run([cxx, *flags, "-c", str(src), "-o", str(tmp)],
                                                             f"compiling the simulator runtime {src.name}"))
                record(obj, _atomic_write)
            objects.append(obj)
    return objects


def rewrite_extern_shared(source: str) -> str:
    return re.sub(r"\bextern\s+__shared__\b", f"extern {EXTERN_SHARED_MARK}", source)


def _generate_wrapper(kernels: list[KernelDecl], extern_shared: list[tuple[str, str]], asan: bool) -> str:
    cap = DYN_SHARED_CAPACITY
    lines = ["", '#line 1 "<minikv_sim generated wrapper>"',
             "// Dynamic shared memory. On a GPU every `extern __shared__` array starts at the same address:",
             "// the first one is the buffer, the others alias it. (ASan would put a redzone after each alias,",
             "// on top of whatever follows, so ASan builds give each name a buffer of its own.)"]
    for i, (ctype, name) in enumerate(extern_shared):
        if i == 0 or asan:
            lines.append(f"alignas(128) {ctype} {name}[{cap} / sizeof({ctype})];")
        else:
            first = extern_shared[0][1]
            lines.append(f'extern {ctype} {name}[{cap} / sizeof({ctype})] __attribute__((alias("{first}")));')
    buffers = [name for i, (_, name) in enumerate(extern_shared) if i == 0 or asan]
    lines.append("char* const minikv_dyn_buffers[] = {" + "".join(f"(char*){n}, " for n in buffers) + "nullptr};")
    lines.append("namespace {")
    for i, k in enumerate(kernels):
        lines.append(f"void minikv_entry_{i}(void** args) {{ minikv_sim::invoke(&{k.name}, args); }}")
        lines.append(f"int minikv_describe_{i}(minikv_sim::ParamInfo* out, int capacity) {{ "
                     f"return minikv_sim::describe_params(&{k.name}, out, capacity); }}")
    lines.append("struct KernelEntry { const char* name; void (*entry)(void**); "
                 "int (*describe)(minikv_sim::ParamInfo*, int); };")
    lines.append("const KernelEntry minikv_kernels[] = {")
    for i, k in enumerate(kernels):
        lines.append(f'    {{"{k.name}", minikv_entry_{i}, minikv_describe_{i}}},')
    lines += ["};", "}  // namespace", "",
              '#define MINIKV_EXPORT extern "C" __attribute__((visibility("default")))',
              f"MINIKV_EXPORT int minikv_sim_kernel_count() {{ return {len(kernels)}; }}",
              "MINIKV_EXPORT const char* minikv_sim_kernel_name(int i) { return minikv_kernels[i].name; }",
              "MINIKV_EXPORT int minikv_sim_kernel_params(int i, minikv_sim::ParamInfo* out, int capacity) {",
              "    return minikv_kernels[i].describe(out, capacity);",
              "}",
              "MINIKV_EXPORT unsigned long minikv_sim_static_shared_bytes() {",
              "    return minikv_sim::static_shared_bytes();",
              "}",
              "MINIKV_EXPORT int minikv_sim_launch(int i, void** args, const unsigned* grid, const unsigned* block,",
              "                                    unsigned long shared_mem, const minikv_sim::Schedule* sched,",
              "                                    char* err, unsigned long err_len) {",
              "    return minikv_sim::launch(minikv_kernels[i].entry, args, grid, block, minikv_dyn_buffers,",
              f"                              {len(buffers)}, shared_mem, {cap}, sched, err, err_len);",
              "}", ""]
    return "\n".join(lines)


@dataclass(frozen=True)
class BuiltModule:
    path: Path                       # the .so
    kernels: tuple[KernelDecl, ...]  # as parsed from the preprocessed source (names, param names)
    asan: bool


def scan_source(source: str, filename: str, defines: dict | None, include_dirs: list[Path],
                cxx: str | None = None) -> str:
    """The source after the preprocessor, with the kernel and extern-shared markers left in."""
    cxx = cxx or compiler()
    cmd = [cxx, "-E", "-P", "-x", "c++", "-std=c++17", "-DMINIKV_SIM_SCAN", f"-I{INCLUDE_DIR}",
           *(f"-I{d}" for d in include_dirs), "-include", "cuda_sim.h", *define_flags(defines), "-"]
    return _run(cmd, f"preprocessing {filename}", stdin=f'#line 1 "{filename}"\n' + rewrite_extern_shared(source))


@contextlib.contextmanager
def _building(key: str):
    """Hold ``<key>.lock`` (an flock: the system drops it when the process ends, however it ends) while
    one entry is looked up and, if missing, compiled: a process (or thread) that wants the same entry
    meanwhile waits and then loads it instead of compiling it a second time (two test processes, or two
    notebooks, that build kernels at the same time)."""
    with open(cache_dir() / f"{key}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build(source: str, filename: str, defines: dict | None = None, source_dir: Path | None = None,
          opts: BuildOptions | None = None) -> BuiltModule:
    """Compile ``source`` (shown as ``filename`` in messages) unless the cache already holds it."""
    opts = opts or BuildOptions.from_env()
    cxx = compiler()
    include_dirs = [source_dir] if source_dir else []
    flags = _base_flags(opts) + [f"-I{d}" for d in include_dirs] + define_flags(defines)
    runtime_objs = _runtime_objects(cxx, opts)
    key = _digest(_FORMAT_VERSION, _compiler_id(cxx), " ".join(flags), _headers_digest(), filename, source,
                  includes_digest(source, include_dirs), *(o.name for o in runtime_objs))
    so_path, meta_path = cache_dir() / f"{key}.so", cache_dir() / f"{key}.json"
    with _building(key):
        if intact(so_path) and intact(meta_path):  # a corrupt entry is reported, removed and rebuilt below
            try:
                meta = json.loads(meta_path.read_text())
                kernels = tuple(KernelDecl(k["name"], tuple(Param(**p) for p in k["params"])) for k in meta["kernels"])
                return BuiltModule(so_path, kernels, opts.asan)
            except (ValueError, KeyError, TypeError) as e:
                report_unreadable(meta_path, e)

        scanned = scan_source(source, filename, defines, include_dirs, cxx)
        kernels = find_kernels(scanned, marker=KERNEL_MARK)
        if not kernels:
            raise KernelCompileError(f"{filename} defines no __global__ kernel")
        wrapper = f'#line 1 "{filename}"\n' + rewrite_extern_shared(source) + "\n"
        wrapper += _generate_wrapper(kernels, find_extern_shared(scanned), opts.asan)
        cpp_path = cache_dir() / f"{key}.cpp"  # kept next to the .so, for the curious
        _atomic_write(cpp_path, lambda tmp: tmp.write_text(wrapper))
        # -fno-weak: one TU, no COMDAT, so static __shared__ in inline functions can share a section
        cmd = [cxx, *flags, "-fno-weak",
               "-fno-exceptions", "-include", "cuda_sim.h", "-x", "c++", str(cpp_path), "-x", "none",
               *map(str, runtime_objs), "-shared"]
        _atomic_write(so_path, lambda tmp: _run(cmd + ["-o", str(tmp)], f"compiling {filename} for the CPU simulator"))
        record(so_path, _atomic_write)
        meta = {"kernels": [{"name": k.name, "params": [p.__dict__ for p in k.params]} for k in kernels]}
        _atomic_write(meta_path, lambda tmp: tmp.write_text(json.dumps(meta)))
        record(meta_path, _atomic_write)
        return BuiltModule(so_path, tuple(kernels), opts.asan)
