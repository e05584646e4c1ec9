"""The GPU check: one prepared run on a lent GPU (an H200), under 7 minutes by its own estimate, installing nothing.

    bash benchmarks/gpu_check.sh OUTDIR [--model PATH]        # on the GPU machine (under `timeout 560`)
    python benchmarks/gpu_check.py OUTDIR --sim-smoke          # here: every stage at toy sizes on the simulator

Stages, in this order (each one's failure is recorded and the next still runs; ``OUTDIR/gpu_check.json``
and ``gpu_check.md`` are rewritten after every stage, and the goal case's numbers the moment each variant
is timed, so a run cut short keeps what it measured). Each stage prints its estimate on an H200 when it
starts (``ESTIMATE_S``, all together within ``PLAN_S`` = 420 s) and the time spent so far:

1. device: name, multiprocessors, L2, memory, CUDA, CuPy and torch versions;
2. copy: a large device-to-device copy, the bandwidth bar (bytes read + written / time);
3. decode attention, the goal case first (B=64, context 4096, 32/8 heads, D=128, float16 cache):
   contiguous (``gpu_check_kv_cache.py``) and paged (``gpu_check_paged.py``), every version (v4, v3, the
   automatic choice, v1, v2, the fused kernel) checked against NumPy (a miss is recorded with its error and
   the variant still timed), then timed with CUDA events (warm-up, median of repeats, inputs rotated past L2;
   a CUDA graph of each batch), with achieved bandwidth, its fraction of the copy, and every torch SDPA
   backend on the same data (``gpu_check_attention.py``); each case's ``ratios`` and the report's ``goal``
   carry the ratios the goal is judged by (``GOAL_TARGETS``: >= 85% of the copy, >= 1.0x the best SDPA);
3b. quant (``gpu_check_quant.py``): int8 and fp8 quantized decode attention, v3 and v4, against the fp16
   kernels at context 8192 (B=16, 32/8 heads, D=128): time, bytes per token, speed-up (goal >= 1.6x);
3c. tiers (``gpu_check_tiers.py``): the host tier's copies on the copy stream against the synchronous hooks;
4. compare: ``minikv compare`` logic on SmolLM2-135M's shapes (random weights unless ``--model``; a near tie
   is reported as such); MLA (``gpu_check_mla.py``) at DeepSeek-V3's shapes; window (``gpu_check_window.py``):
   step 6's ``window_decode`` v1, v3, v4 (+ the mass, + in-cache rotation) over a wrapped ring;
5. sanitizer: ``compute-sanitizer`` memcheck and racecheck over a few GPU tests with CuPy's memory pool off
   (``gpu_check_tests.py``; a timeout kills the whole process group);
6. tests, last: ``pytest -m gpu`` over tests/gpu, the files in the order of their value, verbose, with a
   per-test timeout and several workers where pytest-timeout and pytest-xdist are installed, every finished
   test appended to ``OUTDIR/tests.jsonl`` at once (``gpu_check_tests.py``).

After the timing stages, ``model`` sets ``benchmarks/gpu_model.py``'s predictions (``results/gpu_model.json``)
beside what was measured. ``--budget`` (seconds, default 530) is what the stages may spend; a stage that no
longer fits is recorded as skipped. ``--sim-smoke`` runs every stage at toy sizes (the goal case scaled down,
every kernel version, a few simulator tests) and records its wall time in ``seconds``.

Exit status: 0 when every check passed, 1 when one failed, 2 when no GPU is usable.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the stage files next to this one

from gpu_check_common import (  # noqa: E402
    FULL_CASES,
    GOAL_CASE,
    SMOKE_CASES,
    AttnCase,
    Timer,
    copy_bandwidth,
)
from gpu_check_kv_cache import time_decode_attention  # noqa: E402
from gpu_check_mla import run_mla  # noqa: E402
from gpu_check_paged import time_paged_decode_attention  # noqa: E402
from gpu_check_quant import run_quant  # noqa: E402
from gpu_check_report import format_markdown, goal_summary, model_vs_measured, row_ratios, write_report  # noqa: E402
from gpu_check_tests import run_sanitizer, run_tests  # noqa: E402
from gpu_check_tiers import run_tiers  # noqa: E402
from gpu_check_window import errors as window_errors  # noqa: E402
from gpu_check_window import run_window  # noqa: E402

from minikv.errors import BackendUnavailableError  # noqa: E402
from minikv_gpu import runtime  # noqa: E402

__all__ = ["AttnCase", "ESTIMATE_S", "PLAN_S", "format_markdown", "main", "stage_estimate"]

PLAN_S = 420  # the whole run on an H200, by the estimates below: 7 minutes, inside the device tool's 10
ESTIMATE_S = {"device": 3, "copy": 4, "attention goal": 50, "attention": 20, "quant": 25, "tiers": 8,
              "compare": 45, "mla": 20, "window": 20, "model": 1, "sanitizer": 60, "tests": 100}


def stage_estimate(name: str) -> float:
    """The estimate of stage ``name`` on an H200 (an attention case: its own, or the goal's)."""
    if name.startswith("attention"):
        return ESTIMATE_S["attention goal" if " goal " in f" {name} " else "attention"]
    return ESTIMATE_S[name]


def planned_total() -> float:
    """Every stage's estimate added up, for FULL_CASES: what a run plans to take on an H200."""
    fixed = sum(v for k, v in ESTIMATE_S.items() if not k.startswith("attention"))
    return fixed + ESTIMATE_S["attention goal"] + ESTIMATE_S["attention"] * (len(FULL_CASES) - 1)

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
        info["torch_cuda"] = bool(torch.cuda.is_available())
    except ImportError:
        info["torch"] = None
    return info


def run_compares(rt, model_path: str | None, smoke: bool) -> list[dict]:
    """Stage 4: ``minikv compare`` on every cache kind (SmolLM2's shapes, or a tiny model for the smoke run)."""
    from minikv_gpu.compare import DEFAULT_TOL, compare, smollm2_random

    if model_path:
        from minikv.weights.gguf import load_model

        model, tok = load_model(model_path)
        ids = tok.encode("The capital of France is")
        label = "SmolLM2-135M GGUF"
    elif smoke:
        from minikv.weights.random_models import random_model

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


def run_case(run, rt, case: AttnCase, timer: Timer, rng) -> None:
    """Stage 3, one case: contiguous and paged decode attention. Its row is in the report from the start and
    saved after every variant is timed (with its ratios), so the goal numbers survive a cut-short run."""
    report = run.report
    row: dict = {"case": case.name, "cache_dtype": case.dtype}
    report["attention"].append(row)

    def measured():
        row["ratios"] = row_ratios(row)
        run.save()
    try:
        time_decode_attention(rt, case, timer, report["copy"].get("gb_per_s", float("nan")), rng,
                              extra={"paged": time_paged_decode_attention}, row=row, on_measured=measured)
        row["ratios"] = row_ratios(row)
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"
        report["errors"].append(f"attention {case.name}: " + traceback.format_exc(limit=3))
    if "error" in row.get("paged", {}):
        report["errors"].append(f"paged attention {case.name}: {row['paged']['traceback']}")
    report["errors"] += [f"attention {case.name} {case.dtype}: {m}" for m in
                         row.get("misses", []) + row.get("paged", {}).get("misses", [])]
    print("attention:", row.get("case"), row.get("cache_dtype"),
          {k: round(row[k]["median_ms"] * 1e3, 1) for k in ("v1", "v2", "v3", "v4", "auto") if k in row}, "us",
          row.get("ratios", row.get("error")), flush=True)


class Run:
    """The report, its time budget and its files: ``save()`` after every stage."""

    def __init__(self, outdir: Path, budget_s: float):
        self.outdir, self.budget_s, self.t0, self.planned = outdir, budget_s, time.perf_counter(), 0.0
        self.report: dict = {"errors": [], "stages": {}, "budget_s": budget_s, "plan_s": planned_total()}

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def stage(self, name: str, fn, need_s: float = 0.0):
        """Run fn() as stage ``name`` unless less than ``need_s`` seconds remain; record its time; save.
        Prints the stage's estimate on an H200 first, and the time spent so far against the plan."""
        est = stage_estimate(name)
        self.planned += est
        print(f"[stage] {name}: estimate {est:.0f} s on an H200 (plan {self.planned:.0f} of {planned_total():.0f} s, "
              f"within {PLAN_S} s); {time.perf_counter() - self.t0:.0f} s spent", flush=True)
        self.report["stages"][name] = {"status": "running", "estimate_s": est}
        if self.left() < need_s:
            self.report["stages"][name] = {"status": "skipped", "reason": f"{self.left():.0f} s of budget left",
                                           "estimate_s": est}
            self.save()
            return None
        t = time.perf_counter()
        try:
            result = fn()
            status = "done"
        except Exception as e:
            result, status = None, f"error: {type(e).__name__}: {e}"
            self.report["errors"].append(f"{name}: " + traceback.format_exc(limit=3))
        self.report["stages"][name] = {"status": status, "seconds": round(time.perf_counter() - t, 2),
                                       "estimate_s": est}
        self.save()
        return result

    def save(self) -> tuple[Path, Path]:
        r = self.report
        r["goal"] = goal_summary(r)
        r["ok"] = (r.get("complete", False) and r.get("tests", {}).get("status") in ("passed", "not run")
                   and not r["errors"]
                   and r.get("sanitizer", {}).get("status") != "failed"
                   and all(c.get("ok") for c in r.get("compare", [])))
        r["seconds"] = round(time.perf_counter() - self.t0, 2)
        return write_report(self.outdir, r)


def _timing_stages(run: Run, rt, timer: Timer, smoke: bool) -> None:
    """Stages 1-3c: the device, the copy bar, decode attention case by case, quant, tiers."""
    rep = run.report
    rep["device"] = run.stage("device", lambda: device_info(rt)) or {"backend": rt.name}
    print(json.dumps(rep["device"]), flush=True)
    rep["copy"] = run.stage("copy", lambda: copy_bandwidth(rt, (1 << 20) if smoke else (2 << 30), timer)) or {}
    print("copy:", rep["copy"].get("gb_per_s"), "GB/s", flush=True)
    rep["attention"] = []
    rng = np.random.default_rng(0)
    for case in SMOKE_CASES if smoke else FULL_CASES:
        run.stage(f"attention {case.name} {case.dtype}", lambda c=case: run_case(run, rt, c, timer, rng),
                  need_s=0 if smoke or case is GOAL_CASE else 200)
    rep["quant"] = run.stage("quant", lambda: run_quant(rt, smoke, timer, rep["copy"].get("gb_per_s", float("nan"))),
                             need_s=0 if smoke else 150) or {"status": "not run"}
    rep["tiers"] = run.stage("tiers", lambda: run_tiers(rt, smoke), need_s=0 if smoke else 40) or {"status": "not run"}
    if rep["tiers"].get("ok") is False:
        rep["errors"].append(f"tiers: a round trip was not bit-identical or the host pool not pinned: {rep['tiers']}")
    print("tiers:", {k: rep["tiers"].get(k) for k in ("blocks", "speedup", "ok")}, flush=True)


def _check_stages(run: Run, rt, timer: Timer, args) -> None:
    """Stages 4-6: compare, MLA, window, the model beside the measurements, the sanitizer, the tests."""
    rep, smoke = run.report, args.sim_smoke
    rep["compare"] = run.stage("compare", lambda: run_compares(rt, args.model, smoke), need_s=0 if smoke else 120)
    rep["compare"] = rep["compare"] or [{"error": "compare did not run (see stages)", "ok": False}]
    print("compare:", [{k: c.get(k) for k in ("cache", "cache_dtype", "fused", "max_abs_logit_diff", "tokens_agree",
                                              "ties")} for c in rep["compare"]], flush=True)
    rep["mla"] = run.stage("mla", lambda: run_mla(rt, timer, rep["copy"].get("gb_per_s", float("nan")), smoke),
                           need_s=0 if smoke else 90) or []
    rep["errors"] += [f"mla {c['case']}: {c['error']}" for c in rep["mla"] if "error" in c]
    rep["window"] = run.stage("window", lambda: run_window(rt, smoke, timer, rep["copy"].get("gb_per_s", float("nan"))),
                              need_s=0 if smoke else 40) or {"status": "not run"}
    rep["errors"] += window_errors(rep["window"])
    rep["model"] = run.stage("model", lambda: model_vs_measured(rep)) or []
    for m in rep["model"]:
        print("model:", m, flush=True)
    # the sanitizer only where it leaves the tests at least 150 s; it gets at most 100 s itself
    rep["sanitizer"] = run.stage("sanitizer", lambda: run_sanitizer(args.outdir, min(100.0, run.left() - 150), smoke),
                                 need_s=0 if smoke else 200) or {"status": "not run", "reason": "budget"}
    print("sanitizer:", rep["sanitizer"], flush=True)
    if args.skip_tests:
        rep["tests"] = {"status": "not run", "reason": "--skip-tests"}
    else:  # last: the long stage gets what remains
        rep["tests"] = run.stage("tests", lambda: run_tests(args.outdir, run.left() - 10, smoke),
                                 need_s=0 if smoke else 30) or {"status": "not run", "reason": "budget"}
    print("tests:", {k: rep["tests"].get(k) for k in ("status", "summary", "counts", "failed")}, flush=True)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--model", default=None, help="a SmolLM2 GGUF file for compare (default: random weights)")
    ap.add_argument("--sim-smoke", action="store_true",
                    help="run every stage at toy sizes on the CPU simulator (checks the script, measures nothing)")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--budget", type=float, default=530.0, help="seconds the stages may spend in all")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    args.outdir.mkdir(parents=True, exist_ok=True)
    try:
        rt = runtime.get_runtime("sim" if args.sim_smoke else "cupy")
    except BackendUnavailableError as e:
        print(f"gpu_check: no usable GPU: {e}\n(run it on the lent GPU machine: bash benchmarks/gpu_check.sh OUTDIR; "
              "or try the script here with --sim-smoke)", file=sys.stderr)
        return 2
    run = Run(args.outdir, args.budget)
    timer = Timer(rt, warmup=1, repeats=3, batch=2) if args.sim_smoke else Timer(rt)
    _timing_stages(run, rt, timer, args.sim_smoke)
    _check_stages(run, rt, timer, args)
    rep = run.report
    rep["complete"] = True  # every stage ran or was skipped; a run cut short by `timeout 560` lacks this
    js, md = run.save()
    print(format_markdown(rep))
    print(f"wrote {js} and {md} in {rep['seconds']:.1f} s")
    return 0 if rep["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
