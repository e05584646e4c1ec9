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
    """What a case is judged by: v3's fraction of the copy (contiguous and paged), its speed-up over
    v1, v2 and the best SDPA backend (time ratios: > 1 means v3 is faster)."""
    out: dict = {}
    for where, base, sdpa in (("", row, row.get("torch_sdpa")),
                              ("paged_", row.get("paged", {}), row.get("paged", {}).get("torch_sdpa_gathered"))):
        v3 = _ms(base.get("v3"))
        if v3 is None:
            continue
        out[f"{where}v3_of_copy"] = base["v3"].get("of_copy")
        for other in ("v1", "v2"):
            if _ms(base.get(other)):
                out[f"{where}v3_vs_{other}"] = base[other]["median_ms"] / v3
        if _sdpa_best_ms(sdpa):
            out[f"{where}v3_vs_best_sdpa"] = _sdpa_best_ms(sdpa) / v3
            out[f"{where}best_sdpa_backend"] = sdpa["best"]["backend"]
    return out


def goal_summary(report: dict) -> dict:
    """The goal (issue 9) read off the goal case's row: v3 >= 85% of the measured copy and >= 1.0x the
    best SDPA backend, for the contiguous and the paged cache. ``met`` is None until it was measured."""
    summary = {"case": GOAL_CASE.name, "targets": GOAL_TARGETS, "met": None}
    rows = [r for r in report.get("attention", []) if r.get("case", "").startswith("goal")]
    if not rows or "ratios" not in rows[0]:
        return summary
    ratios = rows[0]["ratios"]
    summary.update({k: ratios.get(k) for k in ("v3_of_copy", "v3_vs_best_sdpa", "best_sdpa_backend",
                                                "paged_v3_of_copy", "paged_v3_vs_best_sdpa")})
    if report.get("device", {}).get("backend") == "cupy":
        checks = [ratios.get(f"{w}{k}") for w in ("", "paged_") for k in GOAL_TARGETS]
        summary["met"] = all(c is not None and c >= GOAL_TARGETS[k] for c, k in zip(checks, list(GOAL_TARGETS) * 2))
    return summary


def _md_head(report: dict) -> list[str]:
    """Status, tests and the compare table."""
    dev = report.get("device", {})
    lines = [f"# GPU check ({dev.get('gpu', dev.get('backend', '?'))}, {dev.get('date', '')})", ""]
    lines.append(f"status: **{'PASS' if report.get('ok') else 'FAIL'}**; wall time {report.get('seconds', 0):.0f} s")
    tests = report.get("tests", {})
    lines += ["", f"tests (pytest -m gpu): {tests.get('status', '-')} {tests.get('summary', tests.get('reason', ''))}"]
    san = report.get("sanitizer", {})
    lines += [f"compute-sanitizer: {san.get('status', '-')} " + (san.get("reason", "") or ", ".join(
        f"{c} {san[c].get('status')} ({san[c].get('summary', '')})" for c in ("memcheck", "racecheck") if c in san))]
    lines += ["", "## compare (NumPy vs GPU, greedy tokens of the NumPy path fed to both)", "",
              "| model | cache | dtype | fused | steps | max abs dlogit | tokens agree | numpy s | gpu s |",
              "|---|---|---|---|---|---|---|---|---|"]
    for c in report.get("compare", []):
        if "error" in c:
            lines.append(f"| error | {c['error']} |||||||")
            continue
        lines.append(f"| {c['model']} | {c['cache']} | {c['cache_dtype']} | {c['fused']} | {c['steps']} | "
                     f"{c['max_abs_logit_diff']:.2e} | {c['tokens_agree']} | {c['numpy_s']:.2f} | {c['gpu_s']:.2f} |")
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
             "| case | cache | v1 us | v2 us | v3 us | v3 GB/s | v3 % copy | auto | fused us | SDPA best us | "
             "v3 vs SDPA |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report.get("attention", []):
        if "error" in r:
            lines.append(f"| {r.get('case', '?')} | {r.get('cache_dtype', '?')} | error: {r['error']} |||||||||")
            continue
        best = r.get("torch_sdpa", {}).get("best", {})
        us = {k: _fmt(_ms(r.get(k)) * 1e3, ".1f") if _ms(r.get(k)) else "-" for k in ("v1", "v2", "v3", "fused")}
        lines.append(f"| {r['case']} | {r['cache_dtype']} | {us['v1']} | {us['v2']} | {us['v3']} | "
                     f"{_fmt(r['v3'].get('gb_per_s'), '.0f')} | {100 * r['v3'].get('of_copy', float('nan')):.0f} | "
                     f"v{r['auto']['version']} x{r['auto']['splits']} | {us['fused']} | "
                     f"{_fmt(best['median_ms'] * 1e3, '.1f') if best else 'n/a'} {best.get('backend', '')} | "
                     f"{_fmt(r.get('ratios', {}).get('v3_vs_best_sdpa'), '.2f')} |")
    return lines


def _md_sweep(report: dict) -> list[str]:
    """The split sweeps of v2 and v3 (empty when no row has one)."""
    lines: list[str] = []
    for key, what in (("split_sweep_ms", "v2"), ("v3_split_sweep_ms", "v3")):
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
                  "", "| case | cache | v1 us | v2 us (parts) | v3 us (parts) | v3 GB/s | v3 % copy | auto | "
                  "SDPA gathered best us | v3 vs SDPA |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in paged:
            p = r["paged"]
            if "error" in p:
                lines.append(f"| {r['case']} | {r['cache_dtype']} | error: {p['error']} ||||||||")
                continue
            best = p.get("torch_sdpa_gathered", {}).get("best", {})
            lines.append(f"| {r['case']} | {r['cache_dtype']} | {p['v1']['median_ms'] * 1e3:.1f} | "
                         f"{p['v2']['median_ms'] * 1e3:.1f} ({p['v2']['partitions']}) | "
                         f"{p['v3']['median_ms'] * 1e3:.1f} ({p['v3']['partitions']}) | {p['v3']['gb_per_s']:.0f} | "
                         f"{100 * p['v3']['of_copy']:.0f} | v{p['auto']['version']} | "
                         f"{_fmt(best['median_ms'] * 1e3, '.1f') if best else 'n/a'} {best.get('backend', '')} | "
                         f"{_fmt(r.get('ratios', {}).get('paged_v3_vs_best_sdpa'), '.2f')} |")
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
    for name in ("v1", "v3", "v1_mass", "v3_rope"):
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
    lines += _md_mla(report) + _md_window(report)
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
