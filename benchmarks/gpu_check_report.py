"""GPU check, the report: ``gpu_check.json`` as it is, and ``gpu_check.md``, its human-readable summary."""

from __future__ import annotations

import json
from pathlib import Path

from gpu_check_common import GOAL_CASE, GOAL_TARGETS, SPLIT_SWEEP
from gpu_check_paged import PAGED_BLOCK_SIZE


def _fmt(x, spec=".3g"):
    return "-" if x is None else format(x, spec)


def _ms(entry) -> float | None:
    return entry.get("median_ms") if isinstance(entry, dict) else None


def _sdpa_best_ms(sdpa) -> float | None:
    return (sdpa or {}).get("best", {}).get("median_ms")


def row_ratios(row: dict) -> dict:
    """What a case is judged by: v3's and v4's fraction of the copy (contiguous and paged), their speed-up over
    v1, v2 (and v4 over v3) and over the best SDPA backend (time ratios: > 1 means the register-resident
    kernel is faster). Partial rows (a stage still running) give what they have."""
    out: dict = {}
    for where, base, sdpa in (("", row, row.get("torch_sdpa")),
                              ("paged_", row.get("paged", {}), row.get("paged", {}).get("torch_sdpa_gathered"))):
        for ver in ("v3", "v4"):
            ms = _ms(base.get(ver))
            if ms is None:
                continue
            out[f"{where}{ver}_of_copy"] = base[ver].get("of_copy")
            for other in ("v1", "v2") + (("v3",) if ver == "v4" else ()):
                if _ms(base.get(other)):
                    out[f"{where}{ver}_vs_{other}"] = base[other]["median_ms"] / ms
            if _sdpa_best_ms(sdpa):
                out[f"{where}{ver}_vs_best_sdpa"] = _sdpa_best_ms(sdpa) / ms
                out[f"{where}best_sdpa_backend"] = sdpa["best"]["backend"]
    return out


def goal_summary(report: dict) -> dict:
    """The goal (issue 9) read off the goal case's row: the register-resident decode kernel (the better of v3
    and v4) >= 85% of the measured copy and >= 1.0x the best SDPA backend, for the contiguous and the paged
    cache. ``met`` is None until it was measured on a GPU."""
    summary = {"case": GOAL_CASE.name, "targets": GOAL_TARGETS, "met": None}
    rows = [r for r in report.get("attention", []) if r.get("case", "").startswith("goal")]
    if not rows:
        return summary
    ratios = row_ratios(rows[0])
    keys = [f"{w}{v}_{k}" for w in ("", "paged_") for v in ("v3", "v4") for k in ("of_copy", "vs_best_sdpa")]
    summary.update({k: ratios.get(k) for k in keys + ["best_sdpa_backend", "v4_vs_v3", "paged_v4_vs_v3"]})
    if report.get("device", {}).get("backend") == "cupy":
        def met(where: str) -> bool:
            return any(all((ratios.get(f"{where}{v}_{k[3:]}") or 0) >= t for k, t in GOAL_TARGETS.items())
                       for v in ("v3", "v4"))
        summary["met"] = met("") and met("paged_")
    return summary


MODEL_JSON = Path(__file__).resolve().parent / "results" / "gpu_model.json"


def _measured(report: dict, name: str) -> dict | None:
    """The measured entry that gpu_model.py's case ``name`` predicts (None if not measured)."""
    goal = next((r for r in report.get("attention", []) if r.get("case", "").startswith("goal")), {})
    kind, rest = name.split(" ", 1)
    ver = "v4" if "v4" in rest else "v3"
    if kind == "kv_cache":
        return goal.get(ver)
    if kind == "paged":
        return goal.get("paged", {}).get(ver)
    if kind == "quant":
        return (report.get("quant") or {}).get(f"{rest.split()[0]}_{ver}")
    if kind == "window":
        return (report.get("window") or {}).get(ver)
    return None


def model_vs_measured(report: dict, path: Path = MODEL_JSON) -> list[dict]:
    """benchmarks/gpu_model.py's predictions (results/gpu_model.json) beside this run's measurements of the
    same cases: time, fraction of the copy, and measured / predicted time (1.0: the model was right)."""
    if not path.is_file():
        return [{"error": f"{path} not found: run python benchmarks/gpu_model.py"}]
    model = json.loads(path.read_text())
    rows = []
    for case in model["cases"]:
        got, pred = _measured(report, case["name"]) or {}, case["predicted"]
        ms = got.get("median_ms")
        rows.append({"case": case["name"], "predicted_us": pred["us"], "predicted_of_copy": pred["of_copy"],
                     "limited_by": pred["limited_by"], "measured_us": None if ms is None else round(ms * 1e3, 1),
                     "measured_of_copy": got.get("of_copy"),
                     "measured_over_predicted": None if ms is None else round(ms * 1e3 / pred["us"], 2)})
    return rows


def _md_model(report: dict) -> list[str]:
    rows = report.get("model") or []
    lines = ["", "## the model (benchmarks/gpu_model.py) beside the measurement", "",
             "| case | predicted us | measured us | measured / predicted | predicted of copy | measured of copy | "
             "model's limit |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            return lines + [f"| {r['error']} ||||||"]
        lines.append(f"| {r['case']} | {r['predicted_us']} | {_fmt(r['measured_us'])} | "
                     f"{_fmt(r['measured_over_predicted'])} | {_fmt(r['predicted_of_copy'], '.0%')} | "
                     f"{_fmt(r['measured_of_copy'], '.0%')} | {r['limited_by']} |")
    return lines if rows else []


def _md_head(report: dict) -> list[str]:
    """Status, tests and the compare table."""
    dev = report.get("device", {})
    lines = [f"# GPU check ({dev.get('gpu', dev.get('backend', '?'))}, {dev.get('date', '')})", ""]
    lines.append(f"status: **{'PASS' if report.get('ok') else 'FAIL'}**; wall time {report.get('seconds', 0):.0f} s")
    tests = report.get("tests", {})
    lines += ["", f"tests (pytest -m gpu): {tests.get('status', '-')} {tests.get('summary', tests.get('reason', ''))}"
                  f" {tests.get('counts', '')}"]
    lines += [f"- failed: {t}" for t in tests.get("failed", [])]
    san = report.get("sanitizer", {})
    lines += [f"compute-sanitizer: {san.get('status', '-')} " + (san.get("reason", "") or ", ".join(
        f"{c} {san[c].get('status')} ({san[c].get('summary', '')})" for c in ("memcheck", "racecheck") if c in san))]
    lines += ["", "## compare (NumPy vs GPU, greedy tokens of the NumPy path fed to both)", "",
              "| model | cache | dtype | fused | steps | max abs dlogit | tokens agree | near ties | numpy s | gpu s |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for c in report.get("compare", []):
        if "error" in c:
            lines.append(f"| error | {c['error']} ||||||||")
            continue
        lines.append(f"| {c['model']} | {c['cache']} | {c['cache_dtype']} | {c['fused']} | {c['steps']} | "
                     f"{c['max_abs_logit_diff']:.2e} | {c['tokens_agree']} | {c.get('ties') or '-'} | "
                     f"{c['numpy_s']:.2f} | {c['gpu_s']:.2f} |")
    return lines


def _md_attention(report: dict) -> list[str]:
    """The copy bar, the goal and the contiguous decode-attention table."""
    copy, goal = report.get("copy", {}), report.get("goal", {})
    lines = ["", f"device-to-device copy: {_fmt(copy.get('gb_per_s'), '.0f')} GB/s "
                  f"(bytes read + written, {copy.get('bytes', 0) / 1e9:.2f} GB per copy)", "",
             f"goal ({goal.get('case')}): v3 {_fmt(goal.get('v3_of_copy'), '.2f')} of the copy (paged "
             f"{_fmt(goal.get('paged_v3_of_copy'), '.2f')}; target {GOAL_TARGETS['v3_of_copy']}), "
             f"{_fmt(goal.get('v3_vs_best_sdpa'), '.2f')}x the best SDPA backend {goal.get('best_sdpa_backend')} "
             f"(paged {_fmt(goal.get('paged_v3_vs_best_sdpa'), '.2f')}x; target {GOAL_TARGETS['v3_vs_best_sdpa']}): "
             f"met = {goal.get('met')}", "",
             "## decode attention (one new token per sequence; GB/s = min bytes / median time)", "",
             "| case | cache | v1 us | v2 us | v3 us | v4 us | v4 GB/s | v3 % copy | v4 % copy | auto | fused us | "
             "SDPA best us | v4 vs SDPA |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report.get("attention", []):
        if "error" in r or "auto" not in r:
            lines.append(f"| {r.get('case', '?')} | {r.get('cache_dtype', '?')} | "
                         f"{r.get('error', 'incomplete (the stage was cut short)')} |||||||||||")
            continue
        best = r.get("torch_sdpa", {}).get("best", {})
        us = {k: _fmt(_ms(r.get(k)) * 1e3, ".1f") if _ms(r.get(k)) else "-" for k in ("v1", "v2", "v3", "v4", "fused")}
        pct = {k: f"{100 * r[k].get('of_copy', float('nan')):.0f}" if k in r else "-" for k in ("v3", "v4")}
        lines.append(f"| {r['case']} | {r['cache_dtype']} | {us['v1']} | {us['v2']} | {us['v3']} | {us['v4']} | "
                     f"{_fmt(r.get('v4', {}).get('gb_per_s'), '.0f')} | {pct['v3']} | {pct['v4']} | "
                     f"v{r['auto']['version']} x{r['auto']['splits']} | {us['fused']} | "
                     f"{_fmt(best['median_ms'] * 1e3, '.1f') if best else 'n/a'} {best.get('backend', '')} | "
                     f"{_fmt(r.get('ratios', {}).get('v4_vs_best_sdpa'), '.2f')} |")
    for r in report.get("attention", []):
        for miss in r.get("misses", []) + r.get("paged", {}).get("misses", []):
            lines.append(f"- tolerance miss, {r['case']} {r['cache_dtype']}: {miss} (timed all the same)")
    return lines


def _md_sweep(report: dict) -> list[str]:
    """The split sweeps of v2 and v3 (empty when no row has one)."""
    lines: list[str] = []
    for key, what in (("split_sweep_ms", "v2"), ("v3_split_sweep_ms", "v3"), ("v4_split_sweep_ms", "v4")):
        sweeps = [r for r in report.get("attention", []) if r.get(key)]
        if not sweeps:
            continue
        lines += ["", f"split sweep ({what} (+ reduce) median us by number of key ranges):", "",
                  "| case | cache | " + " | ".join(str(n) for n in SPLIT_SWEEP) + " |",
                  "|---|---|" + "---|" * len(SPLIT_SWEEP)]
        for r in sweeps:
            ms = {int(k): v for k, v in r[key].items()}  # JSON turns the keys into strings
            cells = ["-" if n not in ms else f"{ms[n] * 1e3:.1f}" for n in SPLIT_SWEEP]
            lines.append(f"| {r['case']} | {r['cache_dtype']} | " + " | ".join(cells) + " |")
    return lines


def _md_paged(report: dict) -> list[str]:
    """The paged decode-attention table (empty when no row has one)."""
    lines: list[str] = []
    paged = [r for r in report.get("attention", []) if r.get("paged")]
    if paged:
        lines += ["", f"## paged decode attention (blocks of {PAGED_BLOCK_SIZE} tokens; same data, same GB/s floor)",
                  "", "| case | cache | v1 us | v2 us (parts) | v3 us (parts) | v4 us (parts) | v4 GB/s | v3 % copy | "
                  "v4 % copy | auto | SDPA gathered best us | v4 vs SDPA |", "|---" * 12 + "|"]
        for r in paged:
            p = r["paged"]
            if "error" in p or "auto" not in p:
                lines.append(f"| {r['case']} | {r['cache_dtype']} | error: {p.get('error', 'incomplete')} ||||||||||")
                continue
            best = p.get("torch_sdpa_gathered", {}).get("best", {})
            cells = [f"{p[v]['median_ms'] * 1e3:.1f}" + (f" ({p[v]['partitions']})" if v != "v1" else "")
                     for v in ("v1", "v2", "v3", "v4")]
            lines.append(f"| {r['case']} | {r['cache_dtype']} | " + " | ".join(cells) +
                         f" | {p['v4']['gb_per_s']:.0f} | "
                         f"{100 * p['v3']['of_copy']:.0f} | {100 * p['v4']['of_copy']:.0f} | v{p['auto']['version']} | "
                         f"{_fmt(best['median_ms'] * 1e3, '.1f') if best else 'n/a'} {best.get('backend', '')} | "
                         f"{_fmt(r.get('ratios', {}).get('paged_v4_vs_best_sdpa'), '.2f')} |")
    return lines


def _md_sdpa(report: dict) -> list[str]:
    """Every SDPA backend of every case: its time or why it did not run."""
    lines = ["", "## torch SDPA backends (float16 inputs; contiguous data)", "",
             "| case | cache | backend | us | note |", "|---|---|---|---|---|"]
    for r in report.get("attention", []):
        sd = r.get("torch_sdpa", {})
        if "error" in sd:
            lines.append(f"| {r.get('case')} | {r.get('cache_dtype')} | - | - | {sd['error']} |")
        for name, e in sd.get("backends", {}).items():
            note = e.get("error", "") if "median_ms" not in e else (
                ("ran " + e["ran"] + "; " if "ran" in e else "") + ("K/V expanded (no GQA)" if e.get("kv_expanded")
                                                                     else ""))
            us = _fmt(e["median_ms"] * 1e3, ".1f") if "median_ms" in e else "n/a"
            lines.append(f"| {r['case']} | {r['cache_dtype']} | {name} | {us} | {note[:120]} |")
    return lines


def _md_mla(report: dict) -> list[str]:
    """The MLA absorbed-decode cases (gpu_check_mla.py): time, bytes per token, GB/s, fraction of the copy."""
    lines = ["", "## MLA absorbed decode (float16 latent, kernel alone)", "",
             "| case | us | bytes/token | GB/s | of copy | Tflop/s | note |", "|---|---|---|---|---|---|---|"]
    for r in report.get("mla", []):
        if "error" in r:
            lines.append(f"| {r.get('case')} | - | - | - | - | - | {r['error'][:120]} |")
            continue
        lines.append(f"| {r['case']} | {_fmt(r['median_ms'] * 1e3, '.1f')} | {r['bytes_read_per_token']} | "
                     f"{_fmt(r['gb_per_s'], '.1f')} | {_fmt(r['of_copy'], '.1%')} | {_fmt(r['tflop_per_s'], '.2f')} | "
                     f"{r['layers_rotated']} layers rotated |")
    return lines


def _md_window(report: dict) -> list[str]:
    """The window-decode variants (gpu_check_window.py): time, GB/s, fraction of the copy, error against NumPy."""
    res = report.get("window") or {}
    if "case" not in res:
        return []
    c = res["case"]
    lines = ["", f"## window decode ({c['name']}, S={c['sinks']} sinks, {c['num_heads']}/{c['num_kv_heads']} heads, "
                 f"D={c['head_dim']}, {c['dtype']} slots; kernel alone)", "",
             "| variant | us | GB/s | of copy | rel err | note |", "|---|---|---|---|---|---|"]
    for name in ("v1", "v3", "v4", "v1_mass", "v3_rope", "v4_rope"):
        e = res.get(name, {})
        if "median_ms" not in e:
            lines.append(f"| {name} | - | - | - | - | {e.get('error', 'not run')[:120]} |")
            continue
        lines.append(f"| {name} | {_fmt(e['median_ms'] * 1e3, '.1f')} | {_fmt(e['gb_per_s'], '.0f')} | "
                     f"{_fmt(e['of_copy'], '.1%')} | {_fmt(e['rel_err'], '.1e')} | {e['method']} |")
    return lines


def format_markdown(report: dict) -> str:
    """The human-readable summary (also written to gpu_check.md)."""
    lines = _md_head(report) + _md_attention(report) + _md_sweep(report) + _md_paged(report) + _md_sdpa(report)
    lines += _md_mla(report) + _md_window(report) + _md_model(report)
    lines += ["", "stages: " + ", ".join(f"{k} {v.get('status')} {v.get('seconds', '')}"
                                         for k, v in report.get("stages", {}).items())]
    if report.get("errors"):
        lines += ["", "## errors", "", *[f"- {e}" for e in report["errors"]]]
    return "\n".join(lines) + "\n"


def write_report(outdir: Path, report: dict) -> tuple[Path, Path]:
    outdir.mkdir(parents=True, exist_ok=True)
    js, md = outdir / "gpu_check.json", outdir / "gpu_check.md"
    js.write_text(json.dumps(report, indent=2, default=str) + "\n")
    md.write_text(format_markdown(report))
    return js, md
