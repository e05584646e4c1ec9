"""A model of the decode kernels on an H200, from their SASS: predicted time and fraction of the copy.

    python benchmarks/gpu_model.py          # prints the table, writes benchmarks/results/gpu_model.json

No GPU is needed: each kernel is compiled for sm_90 with nvcc (``-cubin``), its machine code listed with
cuobjdump (``-sass``: the CUDA toolkit's, or the ``nvidia-cuda-cuobjdump`` pip package's), and its key loop
found as the longest backward branch. Per warp and iteration of that loop the model knows the instructions
(by the unit that runs them), the bytes loaded, and how many warps an SM holds (ptxas's registers). Then:

* issue: an SM issues 4 warp-instructions a clock, but shuffles at 1 (32 lanes/clock), MUFU (exp2) and
  conversions (I2F, F2F) at 1/2, loads and stores at 1: an iteration costs the largest of those, per SM;
* latency: a warp waits one memory latency per iteration for its loads. v3 issues them and then waits
  (iteration = latency + its own instructions); v4 has the next iteration's loads in flight while it
  computes (iteration = max(latency, instructions)). W resident warps overlap their waits;
* memory: no faster than the measured device-to-device copy (COPY_GBS, an H200's ~4.1 TB/s).

Each grid runs in waves of (blocks per SM x SMs) blocks; a partial last wave has fewer warps per SM. The
loop's static instructions are an upper bound of what runs (``insts_max``): a v4 rescale that is skipped
where no max moved, and the quantized kernel's residual path (the open block only), are counted too; the
lower bound (``insts_min``) leaves out every region a forward branch inside the loop can skip. The headline
uses the common path (the lower count: no rescale, the coded path, no rotation in these cases); the JSON
has both. The cases are gpu_check's goal cases; gpu_check prints each prediction beside what it
measures, so the first GPU run judges the model.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
from nvcc_report import find_nvcc, nvcc_version, parse_ptxas  # noqa: E402

from minikv_gpu.versions import split_plan  # noqa: E402

KERNELS = ROOT / "minikv_gpu" / "kernels"
RESULT = ROOT / "benchmarks" / "results" / "gpu_model.json"
H200 = dict(sms=132, clock_ghz=1.755, copy_gbs=4100.0, latency_ns=650.0, regs_per_sm=65536, max_warps=64,
            launch_us=4.0)
RATES = {"issue": 4.0, "shfl": 1.0, "mufu": 0.5, "conv": 0.5, "lsu": 1.0}  # warp-instructions per clock per SM
_UNIT = [("shfl", ("SHFL",)), ("mufu", ("MUFU",)), ("conv", ("I2F", "F2I", "F2F", "I2I", "F2FP")),
         ("lsu", ("LDG", "STG", "LDS", "STS", "LD", "ST", "LDL", "STL", "ATOM", "RED"))]


@dataclass
class Case:
    """One kernel at one shape: ``keys`` keys per (token, KV head); ``key_bytes`` bytes of K and V per key and
    KV head; ``warp_keys`` keys a warp takes per loop iteration (the header's constants, mirrored here)."""

    name: str
    source: str
    kernel: str
    defines: dict
    batch: int
    kv_heads: int
    q_heads: int
    head_dim: int
    keys: int
    key_bytes: int
    warp_keys: int
    version: int
    least_keys: int  # a split's fewest keys (partition_size, MIN_KEYS_PER_SPLIT); 0: the kernel never splits
    splits: int = 1
    notes: str = ""
    sass: dict = field(default_factory=dict)

    def min_bytes(self) -> int:
        """K/V once, plus the queries read and outputs written (float32)."""
        return self.batch * self.kv_heads * self.keys * self.key_bytes + 8 * self.batch * self.q_heads * self.head_dim


def goal_cases() -> list[Case]:
    """The goal cases of gpu_check (B 64, context 4096, 32/8 heads, D 128, fp16; the quant stage's B 16,
    context 8192; the window stage's ring of 4096 slots), for each kernel version. ``warp_keys`` mirrors the
    headers at G = 4, D = 128, fp16: v3 spreads 8 dims per lane (16 lanes a key, 2 keys side by side) and
    takes 4 keys each (ROW_KEYS), quant v3 2; v4 spreads 16 (8 lanes, 4 side by side) and takes 2 keys each
    (keys_for at 2 blocks per SM; quant's V4_KEYS), window v4 8 dims and 1 key (V4_KEYS at G = 4)."""
    base = dict(HEAD_DIM=128, CACHE_HALF=1, GQA_GROUP=4)
    ctx, b, q8 = 4097, 64, 2 * 4 * 34  # q8_0 / fp8: 4 records of 34 bytes per row, K and V
    cases = []
    for src, kern, extra, least in (("paged", "paged_decode_attention", {"KV_BLOCK": 16}, 512),
                                    ("kv_cache", "decode_attention", {}, 256)):
        for v, wk in ((3, 2 * 4), (4, 4 * 2)):
            cases.append(Case(f"{src} v{v} fp16", src, f"{kern}_v{v}", {**base, **extra}, b, 8, 32, 128, ctx,
                              512, wk, v, least))
    for kv, code in (("int8", 0), ("fp8", 1)):
        for v, wk in ((3, 2 * 2), (4, 4 * 2)):
            cases.append(Case(f"quant {kv} v{v}", "quant", f"quant_decode_attention_v{v}",
                              {**base, "QCODEC": code, "KV_BLOCK": 16}, 16, 8, 32, 128, 8193, q8, wk, v, 512,
                              notes="coded blocks; the residual (open block) path is in the loop's static count"))
    for v, wk in ((3, 2 * 4), (4, 4 * 2)):
        cases.append(Case(f"quant fp16 ref v{v}", "paged", f"paged_decode_attention_v{v}", {**base, "KV_BLOCK": 16},
                          16, 8, 32, 128, 8193, 512, wk, v, 512))
    for v, wk in ((3, 2 * 4), (4, 2 * 1)):
        cases.append(Case(f"window v{v} fp16", "window", f"window_decode_v{v}", base, 64, 8, 32, 128, 4097, 512, wk, v,
                          0, notes="window 4096 + 4 sinks, original positions (no rotation); never split"))
    return cases


def find_cuobjdump() -> str | None:
    """cuobjdump on PATH, in the CUDA toolkit, or in the nvidia-cuda-cuobjdump wheel (sys.path, $MINIKV_NVTOOLS)."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    roots = [Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin"]
    for p in [os.environ.get("MINIKV_NVTOOLS", "")] + sys.path:
        if p:
            roots += sorted(Path(p).glob("nvidia/cu*/bin"))
    return next((str(r / "cuobjdump") for r in roots if (r / "cuobjdump").is_file()), None)


def compile_sass(nvcc: str, cuobjdump: str, case: Case, arch: str = "sm_90") -> tuple[list[tuple[int, str]], int]:
    """[(address, instruction text)] of the case's kernel, and its registers (ptxas)."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        flags = [f"-D{k}={v}" for k, v in case.defines.items()]
        res = subprocess.run([nvcc, "-cubin", f"-arch={arch}", "-Xptxas", "-v", f"-I{KERNELS}", *flags, "-o",
                              str(cubin), str(KERNELS / f"{case.source}.cu")], capture_output=True, text=True)
        if res.returncode:
            raise RuntimeError(f"nvcc failed for {case.name}:\n{res.stderr[-2000:]}")
        regs = next(r["registers"] for r in parse_ptxas(res.stderr) if r["kernel"] == case.kernel)
        text = subprocess.run([cuobjdump, "-sass", "-fun", case.kernel, str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    insts = [(int(m.group(1), 16), m.group(2).strip()) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", text)]
    return insts, regs


def _opcode(inst: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", inst).split()[0].split(".")[0]


def key_loop(insts: list[tuple[int, str]]) -> dict:
    """The longest backward branch's body: instruction counts by unit, all of them and without the regions a
    forward branch inside the body may skip."""
    loops = []
    for addr, inst in insts:
        m = re.match(r"(?:@!?P\w+\s+)?BRA\s+(?:!?P\w+,\s*)?0x([0-9a-f]+)", inst)
        if m and int(m.group(1), 16) < addr:
            loops.append((addr - int(m.group(1), 16), int(m.group(1), 16), addr))
    _, start, end = max(loops)
    body = [(a, i) for a, i in insts if start <= a <= end]
    skippable = set()
    for a, i in body:
        m = re.match(r"@!?P\w+\s+BRA\s+(?:!?P\w+,\s*)?0x([0-9a-f]+)", i)
        if m and a < int(m.group(1), 16) <= end:
            skippable.update(x for x, _ in body if a < x < int(m.group(1), 16))

    def count(rows) -> dict:
        out = {u: 0 for u in RATES}
        for _, inst in rows:
            op = _opcode(inst)
            out["issue"] += 1
            for unit, ops in _UNIT:
                if op in ops:
                    out[unit] += 1
        return out
    return {"max": count(body), "min": count([r for r in body if r[0] not in skippable]),
            "loop_bytes": end - start + 16}


def predict(case: Case, regs: int, counts: dict, m: dict = H200) -> dict:
    """Predicted time (us), achieved GB/s and fraction of the copy of the case's grid, and what limits it."""
    regs_per_warp = math.ceil(regs * 32 / 256) * 256
    bps = max(1, min(m["regs_per_sm"] // (regs_per_warp * 4), m["max_warps"] // 4))  # resident blocks per SM
    if case.least_keys:  # the launcher's split: versions.split_plan with this occupancy
        case.splits = split_plan(case.keys, case.batch * case.kv_heads, bps, m["sms"], min_keys=case.least_keys)[0]
    blocks = case.batch * case.kv_heads * case.splits
    clock = m["clock_ghz"] * 1e9
    cycles_issue = max(counts[u] / RATES[u] for u in RATES)          # SM cycles per warp-iteration
    latency = m["latency_ns"] * 1e-9 * clock
    per_warp = latency + counts["issue"] if case.version == 3 else max(latency, counts["issue"])
    bytes_it = case.warp_keys * case.key_bytes
    iters = math.ceil(case.keys / case.splits / (4 * case.warp_keys))   # per block (4 warps)
    t, waves, left, limits = 0.0, 0, blocks, {}
    while left > 0:  # one wave at a time: a partial last wave has fewer warps per SM
        in_wave = min(left, bps * m["sms"])
        warp_iters = 4 * iters * in_wave / m["sms"]                     # per SM
        times = {"copy": in_wave * 4 * iters * bytes_it / (m["copy_gbs"] * 1e9),
                 "issue": warp_iters * cycles_issue / clock,
                 "latency": warp_iters * per_warp / (4 * in_wave / m["sms"]) / clock}
        limits[max(times, key=times.get)] = limits.get(max(times, key=times.get), 0.0) + max(times.values())
        t += max(times.values())
        left -= in_wave
        waves += 1
    t += m["launch_us"] * 1e-6
    limit = max(limits, key=limits.get)
    gbs = case.min_bytes() / t / 1e9
    return {"us": round(t * 1e6, 1), "gb_per_s": round(gbs), "of_copy": round(gbs / m["copy_gbs"], 3),
            "blocks_per_sm": bps, "splits": case.splits, "waves": waves, "limited_by": limit,
            "cycles_per_warp_iter": {"issue": round(cycles_issue, 1), "latency_bound": round(per_warp, 1)}}


def run(cases: list[Case] | None = None, m: dict = H200) -> dict:
    """Compile, count and predict every case (RuntimeError when nvcc or cuobjdump is missing)."""
    nvcc, cuobjdump = find_nvcc(), find_cuobjdump()
    if nvcc is None or cuobjdump is None:
        raise RuntimeError(f"needs nvcc ({nvcc}) and cuobjdump ({cuobjdump}): pip install nvidia-cuda-cuobjdump")
    rows = []
    for case in cases or goal_cases():
        insts, regs = compile_sass(nvcc, cuobjdump, case)
        loop = key_loop(insts)
        case.sass = {"registers": regs, "loop_bytes": loop["loop_bytes"], "insts_max": loop["max"],
                     "insts_min": loop["min"]}
        rows.append({**asdict(case), "predicted": predict(case, regs, loop["min"], m),
                     "predicted_all_insts": predict(case, regs, loop["max"], m)})
    by = {r["name"]: r for r in rows}
    ratios = {f"quant {kv} v{v} vs fp16 v{v}": round(by[f"quant fp16 ref v{v}"]["predicted"]["us"]
                                                     / by[f"quant {kv} v{v}"]["predicted"]["us"], 2)
              for kv in ("int8", "fp8") for v in (3, 4)}
    return {"machine": m, "rates_per_sm_clock": RATES, "nvcc": nvcc_version(nvcc), "arch": "sm_90", "cases": rows,
            "speedups": ratios}


def table(report: dict) -> str:
    lines = [f"{'case':20} {'regs':>4} {'insts/iter':>10} {'shfl':>4} {'bytes/iter':>10} {'splits':>6} {'us':>7} "
             f"{'of copy':>7} {'(all insts)':>11} {'limited by':>10}"]
    for r in report["cases"]:
        s, p, a = r["sass"], r["predicted"], r["predicted_all_insts"]
        lines.append(f"{r['name']:20} {s['registers']:>4} {s['insts_min']['issue']:>4}-{s['insts_max']['issue']:<5} "
                     f"{s['insts_min']['shfl']:>4} {r['warp_keys'] * r['key_bytes']:>10} {p['splits']:>6} {p['us']:>7} "
                     f"{p['of_copy']:>7.0%} {a['of_copy']:>11.0%} {p['limited_by']:>10}")
    lines += [f"{k}: {v}x" for k, v in report["speedups"].items()]
    return "\n".join(lines)


def main() -> int:
    try:
        report = run()
    except RuntimeError as e:
        print(f"gpu_model: {e}", file=sys.stderr)
        return 2
    print(table(report))
    RESULT.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {RESULT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
