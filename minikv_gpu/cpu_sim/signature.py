"""Kernel signatures: find the kernels of a .cu source and check launch arguments against them.

Both backends use this. The simulator takes the exact parameter types from the compiled
module (C++ type traits, see ``cuda_sim.h``) and only the kernel and parameter *names* from
the text. On CuPy the types come from the text itself, preprocessed by g++ where one exists
(so that macros, ``#if`` and typedefs such as ``cache_t`` resolve); a type the parser does
not know is left unchecked there.

CuPy's ``RawKernel`` checks none of this: a Python ``int`` for an ``int`` parameter is sent
as 8 bytes, and a float64 array for a ``float*`` is read as garbage. Hence the checks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from minikv.errors import KernelLaunchError

# Marker words: the scan preprocessing (MINIKV_SIM_SCAN) turns __global__ into KERNEL_MARK;
# the simulator rewrites `extern __shared__` into `extern EXTERN_SHARED_MARK` before compiling.
KERNEL_MARK = "__minikv_kernel__"
EXTERN_SHARED_MARK = "__minikv_extern_shared__"


@dataclass(frozen=True)
class Param:
    """One kernel parameter, as the launch checks see it.

    ``dtype`` is a NumPy dtype name ("float32", ...), "void" (a ``void*``: any array), "char"
    (plain ``char``: int8 or uint8) or None (unknown: unchecked on CuPy, refused by the sim).
    ``lanes`` is the vector width of the element type: 4 for ``float4``, 2 for ``__half2``.
    """

    name: str
    pointer: bool
    const: bool
    dtype: str | None
    lanes: int = 1
    ctype: str = ""  # the type as written in the source, for messages

    def describe(self) -> str:
        return f"'{self.name}' ({self.ctype or self._spelled()})"

    def _spelled(self) -> str:
        elem = self.dtype or "?"
        if self.lanes > 1:
            elem = f"{elem}x{self.lanes}"
        return ("const " if self.const else "") + elem + ("*" if self.pointer else "")


@dataclass(frozen=True)
class KernelDecl:
    name: str
    params: tuple[Param, ...]


# ---- parsing ------------------------------------------------------------------------------

_INT_WORDS = {"signed", "unsigned", "short", "long", "int", "char"}
_NAMED_TYPES = {
    "float": ("float32", 1), "double": ("float64", 1), "bool": ("bool", 1), "void": ("void", 1),
    "__half": ("float16", 1), "half": ("float16", 1), "__half2": ("float16", 2), "half2": ("float16", 2),
    "int8_t": ("int8", 1), "uint8_t": ("uint8", 1), "int16_t": ("int16", 1), "uint16_t": ("uint16", 1),
    "int32_t": ("int32", 1), "uint32_t": ("uint32", 1), "int64_t": ("int64", 1), "uint64_t": ("uint64", 1),
    "size_t": ("uint64", 1), "ptrdiff_t": ("int64", 1),
    "float2": ("float32", 2), "float3": ("float32", 3), "float4": ("float32", 4), "double2": ("float64", 2),
    "int2": ("int32", 2), "int3": ("int32", 3), "int4": ("int32", 4),
    "uint2": ("uint32", 2), "uint3": ("uint32", 3), "uint4": ("uint32", 4),
    "short2": ("int16", 2), "short4": ("int16", 4), "ushort2": ("uint16", 2), "ushort4": ("uint16", 4),
    "char2": ("int8", 2), "char4": ("int8", 4), "uchar2": ("uint8", 2), "uchar4": ("uint8", 4),
    "longlong2": ("int64", 2), "ulonglong2": ("uint64", 2),
}
_QUALIFIERS = {"const", "volatile", "__restrict__", "__restrict", "restrict", "struct", "__grid_constant__"}


def strip_comments(text: str) -> str:
    """Remove // and /* */ comments, keeping string literals (a comment may hold "extern __shared__")."""
    pattern = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\])*"', re.S)
    return pattern.sub(lambda m: m.group(0) if m.group(0).startswith('"') else " ", text)


def _strip_attributes(text: str) -> str:
    text = re.sub(r"__attribute__\s*\(\((?:[^()]|\([^()]*\))*\)\)", " ", text)
    return re.sub(r"\b(?:alignas|__align__)\s*\([^()]*\)", " ", text)


def _matching_paren(text: str, open_index: int) -> int:
    depth = 0
    for i in range(open_index, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return i
    raise ValueError("unbalanced parentheses")


def _split_top_level(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "(<[":
            depth += 1
        elif ch in ")>]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def find_typedefs(text: str) -> dict[str, str | None]:
    """``typedef float T;`` and ``using T = float;``; a name defined twice differently maps to None."""
    found: dict[str, str | None] = {}
    pairs = [(m.group(2), m.group(1)) for m in re.finditer(r"\btypedef\s+([^;{}()]+?)\s*\b(\w+)\s*;", text)]
    pairs += [(m.group(1), m.group(2)) for m in re.finditer(r"\busing\s+(\w+)\s*=\s*([^;{}()]+);", text)]
    for name, target in pairs:
        target = " ".join(target.split())
        found[name] = target if found.get(name, target) == target else None
    return found


def _resolve_base(words: list[str], typedefs: dict[str, str | None]) -> tuple[str | None, int]:
    for _ in range(8):  # follow typedef chains
        if len(words) == 1 and words[0] in typedefs:
            target = typedefs[words[0]]
            if target is None:
                return None, 0
            words = [w for w in target.replace("*", " * ").split() if w not in _QUALIFIERS]
            if "*" in words:
                return None, 0  # a typedef'd pointer: not worth the trouble
            continue
        break
    if words and set(words) <= _INT_WORDS:
        unsigned = "unsigned" in words
        if "char" in words:
            return ("uint8" if unsigned else "int8" if "signed" in words else "char"), 1
        bits = 16 if "short" in words else 64 if "long" in words else 32
        return f"{'u' if unsigned else ''}int{bits}", 1
    if len(words) == 1 and words[0] in _NAMED_TYPES:
        return _NAMED_TYPES[words[0]]
    return None, 0


def parse_param(text: str, index: int, typedefs: dict[str, str | None]) -> Param:
    """Parse one parameter declaration such as ``const float* __restrict__ q``."""
    text = _strip_attributes(text).split("=")[0].strip()
    array = text.endswith("]")
    if array:  # `float x[]` is a pointer
        text = text[: text.index("[")].strip()
    tokens = re.findall(r"\w+|\*|&", text)
    name = f"arg{index}"
    if len(tokens) >= 2 and re.fullmatch(r"\w+", tokens[-1]) and tokens[-1] not in _QUALIFIERS | _INT_WORDS:
        name = tokens.pop()
    stars = tokens.count("*") + (1 if array else 0)
    before_star = tokens[: tokens.index("*")] if "*" in tokens else tokens
    const = stars > 0 and "const" in before_star
    words = [t for t in before_star if t not in _QUALIFIERS]
    dtype, lanes = _resolve_base(words, typedefs)
    if stars > 1 or "&" in tokens:
        dtype, lanes = None, 0
    ctype = text[: text.rfind(name)] if text.endswith(name) else text
    ctype = " ".join(w for w in ctype.split() if w not in ("__restrict__", "__restrict", "restrict"))
    ctype = ctype.replace(" *", "*") + ("*" if array else "")
    return Param(name=name, pointer=stars > 0, const=const, dtype=dtype, lanes=max(lanes, 1), ctype=ctype)


def find_kernels(text: str, marker: str = "__global__") -> list[KernelDecl]:
    """Every function declared with ``marker`` (``__global__``, or the scan marker), in order."""
    text = strip_comments(text)
    typedefs = find_typedefs(text)
    kernels: dict[str, KernelDecl] = {}
    for m in re.finditer(rf"\b{re.escape(marker)}\b", text):
        pos = m.end()
        # Skip `void`, `__launch_bounds__(...)`, attributes, up to `name (`.
        while True:
            call = re.compile(r"\s*(\w+)\s*\(").match(text, pos)
            word = re.compile(r"\s*(\w+)").match(text, pos)
            if call and call.group(1) in ("__launch_bounds__", "__attribute__", "alignas"):
                pos = _matching_paren(text, call.end() - 1) + 1
            elif call:
                break
            elif word:
                pos = word.end()
            else:
                call = None
                break
        if call is None:
            continue
        close = _matching_paren(text, call.end() - 1)
        body_start = text[close + 1:close + 200].lstrip()
        params_text = text[call.end():close].strip()
        raw = [] if params_text in ("", "void") else _split_top_level(params_text)
        decl = KernelDecl(call.group(1), tuple(parse_param(p, i, typedefs) for i, p in enumerate(raw)))
        if body_start.startswith("{") or decl.name not in kernels:  # the definition wins over a declaration
            kernels[decl.name] = decl
    return list(kernels.values())


def find_extern_shared(text: str) -> list[tuple[str, str]]:
    """``extern EXTERN_SHARED_MARK float smem[];`` -> [("float", "smem")] (type, name)."""
    pattern = rf"\bextern\s+{EXTERN_SHARED_MARK}\s+([^;{{}}]*?)\s*\b(\w+)\s*\[\s*\]\s*;"
    found: dict[str, str] = {}
    for m in re.finditer(pattern, strip_comments(text)):
        ctype = " ".join(_strip_attributes(m.group(1)).replace(EXTERN_SHARED_MARK, " ").split())
        found.setdefault(m.group(2), ctype)
    return [(t, n) for n, t in found.items()]


# ---- checking -------------------------------------------------------------------------------

def _vector_alignment(itemsize: int, lanes: int) -> int:
    """CUDA's alignment of a vector type: float2 8, float4 16, __half2 4, float3 4."""
    if lanes & (lanes - 1):
        return itemsize
    return min(16, itemsize * lanes)


def check_args(kernel: str, params: tuple[Param, ...], args, *, array_type: type, data_ptr,
               strict: bool, writable=None) -> None:
    """Raise KernelLaunchError unless ``args`` fit ``params`` exactly.

    array_type: the backend's device array class (numpy.ndarray on the sim, cupy.ndarray).
    data_ptr:   array -> its address, for alignment checks of vector pointers.
    strict:     refuse parameters of unknown type (the sim cannot pass what it cannot size).
    writable:   array -> whether a kernel may write to it; None: every array is (CuPy, whose
                ``flags`` has only ``c_contiguous``, ``f_contiguous`` and ``owndata``). Only
                the attributes a CuPy ndarray has are read here: ``dtype``, ``size``, ``flags``.
    """
    if not isinstance(args, (tuple, list)):
        raise KernelLaunchError(f"{kernel}: args must be a tuple of arguments, got {type(args).__name__}")
    if len(args) != len(params):
        names = ", ".join(p.name for p in params)
        raise KernelLaunchError(f"{kernel} takes {len(params)} arguments ({names}), got {len(args)}")
    kind = array_type.__module__.split(".")[0] + "." + array_type.__name__
    for i, (p, a) in enumerate(zip(params, args)):
        where = f"{kernel}: argument {i} {p.describe()}"
        if p.dtype is None and strict:
            raise KernelLaunchError(f"{where}: the simulator does not support this parameter type; use a "
                                    "pointer or scalar of a built-in type (float, int, __half, float4, ...)")
        if p.pointer:
            if not isinstance(a, array_type):
                raise KernelLaunchError(f"{where} is a pointer: pass a {kind}, got {type(a).__name__}")
            if p.dtype not in (None, "void"):
                ok = ("int8", "uint8") if p.dtype == "char" else (p.dtype,)
                if a.dtype.name not in ok:
                    raise KernelLaunchError(f"{where} needs a {' or '.join(ok)} array, got {a.dtype.name}; "
                                            f"convert it with .astype(np.{ok[0]})")
            if not a.flags.c_contiguous:
                raise KernelLaunchError(f"{where}: the array is not C-contiguous (a transposed or sliced view?); "
                                        "pass xp.ascontiguousarray(a)")
            if p.lanes > 1:
                if a.size % p.lanes:
                    raise KernelLaunchError(f"{where} reads {p.lanes}-element vectors, but the array has "
                                            f"{a.size} elements, not a multiple of {p.lanes}")
                align = _vector_alignment(a.dtype.itemsize, p.lanes)
                if data_ptr(a) % align:
                    raise KernelLaunchError(f"{where}: vector loads need {align}-byte aligned data, the array "
                                            f"starts at {data_ptr(a):#x} (an offset view?)")
            if not p.const and writable is not None and not writable(a):
                raise KernelLaunchError(f"{where}: the kernel may write through this pointer, but the array "
                                        "is read-only")
        else:
            if not isinstance(a, np.generic):
                raise KernelLaunchError(
                    f"{where} is a scalar: pass an exact NumPy scalar such as np.{p.dtype or 'int32'}(x), got "
                    f"{type(a).__name__} {a!r} (a Python int or float has no fixed C size)")
            if p.lanes > 1:
                raise KernelLaunchError(f"{where}: vector-typed scalar parameters are not supported")
            want = "int8" if p.dtype == "char" else p.dtype
            if want is not None and a.dtype.name != want:
                raise KernelLaunchError(f"{where} needs np.{want}, got np.{a.dtype.name}; wrap it as np.{want}(x)")
