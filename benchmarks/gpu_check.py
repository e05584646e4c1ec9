"""The GPU check: one prepared run on a lent GPU (an H200), in under 5 minutes, installing nothing.

    bash benchmarks/gpu_check.sh OUTDIR [--model PATH]        # on the GPU machine
    python benchmarks/gpu_check.py OUTDIR --sim-smoke          # here: every stage at toy sizes on the simulator

Stages (each one's failure is recorded and the next still runs):

1. device: name, multiprocessors, L2, memory, CUDA, CuPy and torch versions;
2. tests: ``pytest -m gpu tests/gpu``: the simulator's kernel tests on CuPy, plus full sizes
   (if pytest is missing, the stage says so; stages 3 and 4 still check every kernel against NumPy);
3. compare: ``minikv compare`` logic on SmolLM2-135M's shapes (random weights unless ``--model``;
   the 98 MB GGUF does not travel): float32 cache, float16 cache + fused kernel, no cache,
   float32 paged cache (blocks of 16);
4. decode attention timing (METHOD.md): CUDA events around batches of launches, warm-up, median
   of repeats, inputs rotated over enough copies that each launch reads beyond the L2 cache.
   Achieved GB/s (K and V read once, q read and out written once) against a measured
   device-to-device copy (bytes read + written) and against torch SDPA on the same cache arrays;
5. paged decode attention (step 3), same method and cases: the same history copied into a
   ``minikv_gpu.paged.PagedKVCache`` (blocks of ``PAGED_BLOCK_SIZE``), v1 and v2 (split-K) and
   the automatic choice, checked against the contiguous kernel's output, side by side with it
   and with torch SDPA on the history gathered back out of the blocks.

This file is the driver; the stages live next to it, one file per step: ``gpu_check_common.py``
(cases, timer, copy), ``gpu_check_attention.py`` (torch SDPA), ``gpu_check_kv_cache.py`` (step 2),
``gpu_check_paged.py`` (step 3) and ``gpu_check_report.py`` (JSON and Markdown).

Writes ``OUTDIR/gpu_check.json`` and ``OUTDIR/gpu_check.md`` and prints the Markdown last.
Exit status: 0 when every check passed, 1 when one failed, 2 when no GPU is usable.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the stage files next to this one

from gpu_check_common import FULL_CASES, ROOT, SMOKE_CASES, AttnCase, Timer, copy_bandwidth  # noqa: E402
from gpu_check_kv_cache import time_decode_attention  # noqa: E402
from gpu_check_paged import time_paged_decode_attention  # noqa: E402
from gpu_check_report import format_markdown, write_report  # noqa: E402

from minikv.errors import BackendUnavailableError  # noqa: E402
from minikv_gpu import runtime  # noqa: E402

__all__ = ["AttnCase", "format_markdown", "main"]


# --- stages --------------------------------------------------------------------------------------

def device_info(rt) -> dict:
    """Stage 1: what the machine is."""
    info = {"backend": rt.name, "host": platform.node(), "python": platform.python_version(),
            "numpy": np.__version__, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if rt.name == "cupy":
        cp = rt.xp
        dev = cp.cuda.Device()
        props = cp.cuda.runtime.getDeviceProperties(dev.id)
        attrs = runtime.device_attributes(rt)
        info.update(gpu=props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"]),
                    multiprocessors=int(attrs["MultiProcessorCount"]),
                    l2_bytes=int(attrs["L2CacheSize"]), memory_bytes=int(dev.mem_info[1]),
                    cuda_runtime=cp.cuda.runtime.runtimeGetVersion(), driver=cp.cuda.runtime.driverGetVersion(),
                    cupy=cp.__version__)
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:
        info["torch"] = None
    return info


def run_tests(outdir: Path, timeout_s: int) -> dict:
    """pytest -m gpu over tests/gpu, in a child process; its log goes to OUTDIR/pytest.log."""
    try:
        import pytest  # noqa: F401
    except ImportError:
        return {"status": "not run", "reason": "pytest is not installed; the compare and timing stages still "
                                               "check every kernel against NumPy"}
    log = outdir / "pytest.log"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "tests/gpu", "-q", "-p", "no:cacheprovider"]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    t0 = time.perf_counter()
    try:
        res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        log.write_text((e.stdout or "") if isinstance(e.stdout, str) else "")
        return {"status": "failed", "reason": f"timed out after {timeout_s} s"}
    log.write_text(res.stdout + res.stderr)
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    summary = lines[-1] if lines else ""
    return {"status": "passed" if res.returncode == 0 else "failed", "returncode": res.returncode,
            "summary": summary.strip("= "), "seconds": round(time.perf_counter() - t0, 1)}


def run_compares(rt, model_path: str | None, smoke: bool) -> list[dict]:
    """Stage 3: ``minikv compare`` on every cache kind (SmolLM2's shapes, or a tiny model for the smoke run)."""
    from minikv_gpu.compare import DEFAULT_TOL, compare, smollm2_random

    if model_path:
        from minikv.gguf import load_model

        model, tok = load_model(model_path)
        ids = tok.encode("The capital of France is")
        label = "SmolLM2-135M GGUF"
    elif smoke:
        from minikv.model import random_model

        model = random_model(num_layers=2, hidden_size=40, num_heads=6, num_kv_heads=2, head_dim=16,
                             intermediate_size=48, vocab_size=300, rope_layout="interleaved", seed=1)
        ids = list(b"The capital")
        label = "tiny random model"
    else:
        model = smollm2_random(0)
        ids = list(b"The capital of France is")
        label = "SmolLM2-135M shapes, random weights"
    steps = 3 if smoke else 16
    runs = [dict(cache="contiguous", cache_dtype=np.float32, fused=False),
            dict(cache="contiguous", cache_dtype=np.float16, fused=True),
            dict(cache="none", cache_dtype=np.float32, fused=False, max_new_tokens=min(steps, 4)),
            dict(cache="paged", cache_dtype=np.float32, fused=False)]
    out = []
    for r in runs:
        n = r.pop("max_new_tokens", steps)
        res = compare(model, ids, n, backend=rt.name, **r)
        summary = res.summary()
        tol = DEFAULT_TOL[np.dtype(r["cache_dtype"]).name]
        summary.update(model=label, tol=tol, ok=bool(res.tokens_agree and res.max_abs_logit_diff <= tol))
        out.append(summary)
    return out


def run_timings(report: dict, rt, smoke: bool) -> None:
    """Stages 4 and 5: the copy bar, then every case's contiguous and paged decode attention."""
    timer = Timer(rt, warmup=1, repeats=3, batch=2) if smoke else Timer(rt)
    try:
        report["copy"] = copy_bandwidth(rt, (1 << 20) if smoke else (2 << 30), timer)
    except Exception as e:
        report["copy"] = {"error": str(e)}
        report["errors"].append("copy: " + traceback.format_exc(limit=3))
    rng = np.random.default_rng(0)
    report["attention"] = []
    for case in SMOKE_CASES if smoke else FULL_CASES:
        try:
            row = time_decode_attention(rt, case, timer, report["copy"].get("gb_per_s", float("nan")), rng,
                                        extra={"paged": time_paged_decode_attention})
        except Exception as e:
            row = {"case": f"{case.name} {case.dtype}", "error": f"{type(e).__name__}: {e}"}
            report["errors"].append(f"attention {case.name}: " + traceback.format_exc(limit=3))
        report["attention"].append(row)
        if "error" in row.get("paged", {}):
            report["errors"].append(f"paged attention {case.name}: {row['paged']['traceback']}")
        print("attention:", row.get("case"), {k: row[k]["median_ms"] for k in ("v1", "v2 fused") if k in row},
              flush=True)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--model", default=None, help="a SmolLM2 GGUF file for compare (default: random weights)")
    ap.add_argument("--sim-smoke", action="store_true",
                    help="run every stage at toy sizes on the CPU simulator (checks the script, measures nothing)")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--test-timeout", type=int, default=150)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    t_start = time.perf_counter()
    args.outdir.mkdir(parents=True, exist_ok=True)
    try:
        rt = runtime.get_runtime("sim" if args.sim_smoke else "cupy")
    except BackendUnavailableError as e:
        print(f"gpu_check: no usable GPU: {e}\n(run it on the lent GPU machine: bash benchmarks/gpu_check.sh OUTDIR; "
              "or try the script here with --sim-smoke)", file=sys.stderr)
        return 2
    report: dict = {"device": device_info(rt), "errors": []}
    print(json.dumps(report["device"]), flush=True)

    if args.skip_tests or args.sim_smoke:
        report["tests"] = {"status": "not run", "reason": "--sim-smoke/--skip-tests (CI runs them on the simulator)"}
    else:
        report["tests"] = run_tests(args.outdir, args.test_timeout)
    print("tests:", report["tests"], flush=True)

    try:
        report["compare"] = run_compares(rt, args.model, args.sim_smoke)
    except Exception as e:
        report["compare"] = [{"error": f"{type(e).__name__}: {e}"}]
        report["errors"].append("compare: " + traceback.format_exc(limit=3))
    print("compare:", [{k: c.get(k) for k in ("cache", "cache_dtype", "fused", "max_abs_logit_diff", "tokens_agree")}
                       for c in report["compare"]], flush=True)

    run_timings(report, rt, args.sim_smoke)
    report["ok"] = (report["tests"].get("status") in ("passed", "not run") and not report["errors"]
                    and all(c.get("ok") for c in report["compare"]))
    report["seconds"] = time.perf_counter() - t_start
    js, md = write_report(args.outdir, report)
    print(format_markdown(report))
    print(f"wrote {js} and {md}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
