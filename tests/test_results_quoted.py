"""Numbers quoted in the README and docs match the benchmark results they cite.

A benchmark re-run rewrites ``benchmarks/results/*.json``; these tests fail until the prose
that quotes the old numbers is updated, so no page keeps a stale measurement.
"""

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _json(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def paged_numbers() -> list[str]:
    d = _json("paged_memory.json")
    return [_pct(d["paged"]["utilization"]), _pct(d["contiguous"]["utilization"]), f"{d['concurrency_ratio']:.2f}x"]


def decode_numbers() -> list[str]:
    d = _json("decode_cpu.json")
    row = {r["ctx"]: r for r in d["results"]}[256]
    return [f"{row['minikv_over_transformers_cached']:.2f}x", f"{row['minikv']['cached_tokens_per_s']:.1f}",
            f"{row['transformers']['cached_tokens_per_s']:.1f}"]


@pytest.mark.parametrize("page", ["docs/03_paged.md", "docs/claims.md", "docs/interview.md", "README.md"])
def test_paged_memory_numbers_are_current(page):
    text = (ROOT / page).read_text()
    for number in paged_numbers():
        assert number in text, f"{page} should quote {number} from benchmarks/results/paged_memory.json"


def test_decode_numbers_in_readme_are_current():
    text = (ROOT / "README.md").read_text()
    for number in decode_numbers():
        assert number in text, f"README.md should quote {number} from benchmarks/results/decode_cpu.json"


def test_uncached_decode_numbers_are_current():
    """docs/01_naive_attention.md: a decode step with no cache against step 2's cache, from decode_cpu.json."""
    text = " ".join((ROOT / "docs/01_naive_attention.md").read_text().split())
    rows = {r["ctx"]: r["minikv"] for r in _json("decode_cpu.json")["results"]}
    for ctx, r in rows.items():
        row = (f"| {ctx} | {r['uncached_ms_per_token']:.1f} | {r['cached_ms_per_token']:.1f} | "
               f"{r['cache_speedup']:.1f}x |")
        assert row in text, f"docs/01_naive_attention.md should have the row {row!r}"
    growth = rows[1024]["uncached_ms_per_token"] / rows[256]["uncached_ms_per_token"]
    extra = rows[1024]["cached_ms_per_token"] - rows[256]["cached_ms_per_token"]
    assert f"{growth:.1f}x the time" in text and f"grows by only {extra:.1f} ms" in text



@pytest.mark.parametrize("page", ["docs/02_kv_cache.md", "docs/zh/02_kv_cache.md"])
def test_step2_speed_numbers_are_current(page):
    """Step 2's decode table and paragraph: decode_cpu.json's step times and ratios, uncached_ops.json's parts."""
    text = " ".join((ROOT / page).read_text().split())
    d = _json("decode_cpu.json")
    numbers = [f"{d['read_bandwidth_gbs']:.1f} GB/s", f"{d['bandwidth_floor_ms_per_token']:.1f} ms/token"]
    for r in d["results"]:
        numbers += [f"{r[e]['cached_ms_per_token']:.1f} ms/token" for e in ("minikv", "transformers")]
        numbers += [f"{r['minikv_over_transformers_cached']:.2f}x", f"{r['minikv_over_transformers_uncached']:.2f}x",
                    f"{r['minikv']['share_of_bandwidth_floor']:.0%}"]
    for row in _json("uncached_ops.json")["rows"]:
        m, t = row["minikv"], row["transformers"]
        numbers += [f"{m[p] / t[p]:.2f}x" for p in ("projections", "attention")]
        numbers += [f"{m['activation'] / t['activation']:.1f}x", f"{m['forward'] / t['forward_unhooked']:.2f}x"]
    for number in numbers:
        assert number in text, f"{page} should quote {number} (benchmarks/results/decode_cpu.json, uncached_ops.json)"

def mla_numbers(contexts: tuple[int, ...]) -> list[str]:
    d = _json("mla_decode.json")
    rows = {r["ctx"]: r for r in d["results"]}
    out = []
    for ctx in contexts:
        r = rows[ctx]
        out += [f"{r['absorbed_ms_per_token']:.2f}", f"{r['expanded_ms_per_token']:.2f}",
                f"{r['absorbed_over_expanded_time']:.3f}x"]
    v3 = d["per_key_costs"]["deepseek_v3_bf16"]
    built = v3["expanded"]["bytes"] + v3["expanded"]["built_bytes"]
    return out + [f"{v3['absorbed']['bytes']:,}", f"{built:,}", f"{v3['absorbed']['flops_per_byte']:.1f}"]


@pytest.mark.parametrize("page, contexts", [("README.md", (128, 2048)), ("docs/04_mla.md", (128, 512, 2048))])
def test_mla_decode_numbers_are_current(page, contexts):
    text = (ROOT / page).read_text()
    for number in mla_numbers(contexts):
        assert number in text, f"{page} should quote {number} from benchmarks/results/mla_decode.json"


def test_mla_decode_slowdown_in_interview_is_current():
    row = {r["ctx"]: r for r in _json("mla_decode.json")["results"]}[2048]
    number = f"{row['expanded_over_absorbed_time']:.1f}x slower"
    assert number in (ROOT / "docs/interview.md").read_text(), f"docs/interview.md should quote {number!r}"


def quant_numbers(runs: tuple[str, ...]) -> list[str]:
    """KLD, top-1 and delta ppl of the named kv_quant_quality runs, as the pages print them."""
    d = _json("kv_quant_quality.json")["minikv"]
    out = []
    for name in runs:
        r = d[name]
        out += [f"{r['kld_vs_exact']:.2e}", f"{r['top1_vs_exact']:.4f}", f"{r['delta_ppl']:+.2%}"]
    return out


def quant_peer_numbers(full: bool) -> list[str]:
    """Each transformers QuantizedCache peer's KLD and minikv/peer ratio (and, if full, top-1 and delta ppl)."""
    out = []
    for r in _json("kv_quant_quality.json")["peer"].values():
        out += [f"{r['kld_vs_exact']:.2e}", f"{r['kld_ratio_minikv_over_peer']:.3g}"]
        if full:
            out += [f"{r['top1_vs_exact']:.4f}", f"{r['delta_ppl']:+.2%}"]
    return out


QUANT_PAGES = ["README.md", "docs/05_quant.md", "docs/claims.md"]


@pytest.mark.parametrize("page, runs", [
    ("README.md", ("int8", "fp8", "int4", "kivi4", "kivi2", "k16v8")),
    ("docs/05_quant.md", ("int8", "int4", "q4_1", "kivi4", "kivi2", "fp8", "fp8 prefill 64", "fp8_e5m2", "k16v8",
                          "fp16", "bf16")),
    ("docs/claims.md", ("int8", "fp8", "k16v8")),
])
def test_kv_quant_quality_numbers_are_current(page, runs):
    text = (ROOT / page).read_text()
    for number in quant_numbers(runs):
        assert number in text, f"{page} should quote {number} from benchmarks/results/kv_quant_quality.json"


@pytest.mark.parametrize("page, full", [("README.md", False), ("docs/05_quant.md", True)])
def test_kv_quant_quality_peer_numbers_are_current(page, full):
    text = (ROOT / page).read_text()
    for number in quant_peer_numbers(full):
        assert number in text, f"{page} should quote {number} (a peer) from benchmarks/results/kv_quant_quality.json"


@pytest.mark.parametrize("page, template", [
    ("README.md", "through the cache over {n} tokens"),
    ("docs/05_quant.md", "{n} tokens of `reference_tokens(tokenizer, {n})`"),
    ("docs/claims.md", "SmolLM2-135M, {n} tokens"),
])
def test_kv_quant_quality_text_length_is_current(page, template):
    words = template.format(n=_json("kv_quant_quality.json")["tokens"])
    assert words in " ".join((ROOT / page).read_text().split()), f"{page} should say {words!r}"


def test_kv_quant_quality_goals_in_the_table_are_current():
    """Each run's row in docs/05_quant.md says met / NOT met for exactly the goals the JSON met / missed."""
    lines = (ROOT / "docs/05_quant.md").read_text().splitlines()
    for name, r in _json("kv_quant_quality.json")["minikv"].items():
        rows = [line for line in lines if line.startswith(f"| {name} |")]
        assert len(rows) == 1, f"docs/05_quant.md should have one table row for {name!r}, has {len(rows)}"
        cell = rows[0].rstrip(" |").rsplit("|", 1)[-1]
        met = sum(g["met"] for g in r["goals"].values())
        assert (cell.count("**met**"), cell.count("**NOT met**")) == (met, len(r["goals"]) - met), (
            f"docs/05_quant.md's {name} row says {cell.strip()!r}; the JSON's goals: {r['goals']}")


def test_no_page_calls_the_kivi_rows_vacuous_once_the_text_fills_the_residual():
    d = _json("kv_quant_quality.json")
    if any(r["residual"] and d["tokens"] - 1 < r["residual"] for r in d["minikv"].values()):
        pytest.skip("a KIVI run of this JSON is shorter than its residual: the caveat belongs")
    for page in QUANT_PAGES:
        text = (ROOT / page).read_text()
        for stale in ("measured nothing", "quantized nothing", "only vacuously"):
            assert stale not in text, f"{page} still says {stale!r}, but every KIVI run filled its residual"


# --- step 6: eviction_quality.json and kvpress_compare.json -----------------------------------------

EVICTION_ROWS = {"README.md": ("window", "sinks", "h2o", "h2o normalized"),
                 "docs/06_window.md": ("window", "sinks", "sinks in-cache", "h2o", "h2o normalized", "snapkv")}


def eviction_numbers(page: str) -> list[str]:
    """The ratios to the full perplexity (both pages) and, on the doc page, each ppl and KLD."""
    d = _json("eviction_quality.json")
    full, out = d["full"]["ppl"], [f"{d['full']['ppl']:.3f}"]
    for name in EVICTION_ROWS[page]:
        for b in (64, 128, 256):
            r = d["runs"][f"{name} B={b}"]
            out.append(f"{r['ppl'] / full:.2f}x")
            if page == "docs/06_window.md":
                out += [f"{r['ppl']:.2f}", f"{r['kld_vs_exact']:.3f}"]
    return out


@pytest.mark.parametrize("page", sorted(EVICTION_ROWS))
def test_eviction_quality_numbers_are_current(page):
    text = (ROOT / page).read_text()
    for number in eviction_numbers(page):
        assert number in text, f"{page} should quote {number} from benchmarks/results/eviction_quality.json"


def test_eviction_goals_quoted_are_the_measured_ones():
    g = _json("eviction_quality.json")["goals"]
    assert g["window_only_ppl_over_full"]["met"] and g["sinks_ppl_over_full"]["met"], g  # else the pages must say so
    for page in ("README.md", "docs/06_window.md"):
        text = (ROOT / page).read_text()
        for k in ("window_only_ppl_over_full", "sinks_ppl_over_full"):
            assert f"{g[k]['measured']:.2f}x" in text, f"{page} should quote the measured {k}"


def test_kvpress_comparison_quoted_is_the_measured_one():
    d = _json("kvpress_compare.json")
    doc = (ROOT / "docs/06_window.md").read_text()
    for press in ("SnapKVPress", "StreamingLLMPress", "ObservedAttentionPress"):
        r = d["pairs"][press]
        assert f"{r['identical_sets']} of {r['sets']}" in doc
        assert f"{r['kvpress_ppl']:.4f} / {r['minikv_ppl']:.4f}" in doc
    if all(d["pairs"][p]["identical_sets"] == d["pairs"][p]["sets"] for p in ("SnapKVPress", "StreamingLLMPress",
                                                                                "ObservedAttentionPress")):
        assert "all 90" in (ROOT / "README.md").read_text()


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs a git checkout of minikv (CI clones one)")
def test_a_result_records_the_commit_it_measured(monkeypatch):
    import subprocess

    from minikv.bench import machine

    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    commit = machine.machine_info()["commit"]
    assert commit is not None and commit.split("+")[0] == head.stdout.strip()

    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(machine.subprocess, "run", no_git)
    assert machine.source_commit() is None  # an installed wheel: no checkout to name
