"""GPU check, the report: ``gpu_check.json`` as it is, and ``gpu_check.md``, its human-readable summary."""

from __future__ import annotations

import json
from pathlib import Path

from gpu_check_common import SPLIT_SWEEP
from gpu_check_paged import PAGED_BLOCK_SIZE


def _fmt(x, spec=".3g"):
    return "-" if x is None else format(x, spec)


def _md_head(report: dict) -> list[str]:
    """Status, tests and the compare table."""
    dev = report.get("device", {})
    lines = [f"# GPU check ({dev.get('gpu', dev.get('backend', '?'))}, {dev.get('date', '')})", ""]
    lines.append(f"status: **{'PASS' if report.get('ok') else 'FAIL'}**; wall time {report.get('seconds', 0):.0f} s")
    tests = report.get("tests", {})
    lines += ["", f"tests (pytest -m gpu): {tests.get('status', '-')} {tests.get('summary', tests.get('reason', ''))}"]
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
    """The copy bar and the contiguous decode-attention table."""
    copy = report.get("copy", {})
    lines = ["", f"device-to-device copy: {_fmt(copy.get('gb_per_s'), '.0f')} GB/s "
                  f"(bytes read + written, {copy.get('bytes', 0) / 1e9:.2f} GB per copy)", "",
              "## decode attention (one new token per sequence; GB/s = min bytes / median time)", "",
              "| case | cache | splits | v1 us | v1 GB/s | % copy | v1 unsplit us | v2 fused us | v2 GB/s | "
              "SDPA us | SDPA GB/s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report.get("attention", []):
        if "error" in r:
            lines.append(f"| {r.get('case', '?')} | error: {r['error']} ||||||||||")
            continue
        sd = r.get("torch_sdpa", {})
        sdpa_us = _fmt(sd["median_ms"] * 1e3, ".1f") if "median_ms" in sd else "n/a"
        sdpa_gbs = _fmt(sd.get("gb_per_s"), ".0f") if "median_ms" in sd else "n/a"
        lines.append(f"| {r['case']} | {r['cache_dtype']} | {r['splits']} | {r['v1']['median_ms'] * 1e3:.1f} | "
                     f"{r['v1']['gb_per_s']:.0f} | {100 * r['v1']['of_copy']:.0f} | "
                     f"{r['v1 unsplit']['median_ms'] * 1e3:.1f} | {r['v2 fused']['median_ms'] * 1e3:.1f} | "
                     f"{r['v2 fused']['gb_per_s']:.0f} | {sdpa_us} | {sdpa_gbs} |")
    return lines


def _md_sweep(report: dict) -> list[str]:
    """The split sweep (empty when no row has one)."""
    lines: list[str] = []
    sweeps = [r for r in report.get("attention", []) if r.get("split_sweep_ms")]
    if sweeps:
        lines += ["", "split sweep (decode_attention_v2 + reduce median us by number of key ranges; 1: v1):", "",
                  "| case | cache | " + " | ".join(str(n) for n in SPLIT_SWEEP) + " |",
                  "|---|---|" + "---|" * len(SPLIT_SWEEP)]
        for r in sweeps:
            ms = {int(k): v for k, v in r["split_sweep_ms"].items()}  # JSON turns the keys into strings
            cells = ["-" if n not in ms else f"{ms[n] * 1e3:.1f}" for n in SPLIT_SWEEP]
            lines.append(f"| {r['case']} | {r['cache_dtype']} | " + " | ".join(cells) + " |")
    return lines


def _md_paged(report: dict) -> list[str]:
    """The paged decode-attention table (empty when no row has one)."""
    lines: list[str] = []
    paged = [r for r in report.get("attention", []) if r.get("paged")]
    if paged:
        lines += ["", f"## paged decode attention (blocks of {PAGED_BLOCK_SIZE} tokens; same data, same GB/s floor)",
                  "", "| case | cache | paged v1 us | v1 GB/s | % copy | paged v2 us | partitions | v2 GB/s | auto | "
                  "contiguous v1 us | SDPA gathered us |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in paged:
            p = r["paged"]
            if "error" in p:
                lines.append(f"| {r['case']} | {r['cache_dtype']} | error: {p['error']} |||||||||")
                continue
            sd = p.get("torch_sdpa_gathered", {})
            sdpa_us = _fmt(sd["median_ms"] * 1e3, ".1f") if "median_ms" in sd else "n/a"
            lines.append(f"| {r['case']} | {r['cache_dtype']} | {p['v1']['median_ms'] * 1e3:.1f} | "
                         f"{p['v1']['gb_per_s']:.0f} | {100 * p['v1']['of_copy']:.0f} | "
                         f"{p['v2']['median_ms'] * 1e3:.1f} | {p['v2']['partitions']} | {p['v2']['gb_per_s']:.0f} | "
                         f"v{p['auto']['version']} | {r['v1']['median_ms'] * 1e3:.1f} | {sdpa_us} |")
    return lines


def format_markdown(report: dict) -> str:
    """The human-readable summary (also written to gpu_check.md)."""
    lines = _md_head(report) + _md_attention(report) + _md_sweep(report) + _md_paged(report)
    errs = [f"- {r['case']}: SDPA {r['torch_sdpa']['error']}" for r in report.get("attention", [])
            if "error" in r.get("torch_sdpa", {})]
    if errs:
        lines += ["", *errs]
    if report.get("errors"):
        lines += ["", "## errors", "", *[f"- {e}" for e in report["errors"]]]
    return "\n".join(lines) + "\n"


def write_report(outdir: Path, report: dict) -> tuple[Path, Path]:
    outdir.mkdir(parents=True, exist_ok=True)
    js, md = outdir / "gpu_check.json", outdir / "gpu_check.md"
    js.write_text(json.dumps(report, indent=2, default=str) + "\n")
    md.write_text(format_markdown(report))
    return js, md
