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
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from minikv import kv_cache as ref_cache  # noqa: E402
from minikv.errors import BackendUnavailableError  # noqa: E402

ATTN_RTOL = {np.float32: 1e-5, np.float16: 1e-5}  # against NumPy with the same cache dtype


@dataclass(frozen=True)
class AttnCase:
    """One decode-attention timing case: B sequences of S cached tokens each, one new token each."""

    name: str
    batch: int
    context: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # cache dtype: "float16" or "float32"

    def kv_bytes(self) -> int:
        """K and V read once: 2 * B * Hkv * (S + 1) * D * itemsize."""
        return 2 * self.batch * self.num_kv_heads * (self.context + 1) * self.head_dim * np.dtype(self.dtype).itemsize

    def min_bytes(self) -> int:
        """The floor: K/V once, plus q read and out written once (float32)."""
        return self.kv_bytes() + 2 * 4 * self.batch * self.num_heads * self.head_dim


FULL_CASES = [
    AttnCase("smollm2 B64 S4096", 64, 4096, 9, 3, 64, "float16"),
    AttnCase("smollm2 B64 S4096", 64, 4096, 9, 3, 64, "float32"),
    AttnCase("llama8b B32 S4096", 32, 4096, 32, 8, 128, "float16"),
    AttnCase("llama8b B1 S32768", 1, 32768, 32, 8, 128, "float16"),
    AttnCase("mqa8 B16 S8192", 16, 8192, 8, 1, 128, "float16"),
]
SPLIT_SWEEP = (1, 2, 4, 8, 16, 32)
SMOKE_CASES = [
    AttnCase("smoke gqa3", 2, 70, 6, 2, 64, "float16"),
    AttnCase("smoke gqa8", 1, 40, 8, 1, 128, "float32"),
]


# --- timing ----------------------------------------------------------------------------------------

def _stats(samples) -> dict:
    s = np.sort(np.asarray(samples, dtype=np.float64))
    return {"median_ms": float(np.median(s)), "p10_ms": float(s[len(s) // 10]),
            "p90_ms": float(s[(9 * len(s)) // 10]), "samples": int(len(s))}


class Timer:
    """Median time of one launch: CUDA events on CuPy, the host clock on the simulator.

    On a GPU one sample is ``batch`` back-to-back launches between two events, rotating over the
    given functions (one per input copy, so a launch does not find its inputs in L2). Two ways:

    * "graph": the batch captured once as a CUDA graph and replayed, so Python's launch cost
      (argument checks, ~10-50 us) never leaves the GPU idle between kernels;
    * "events": plain launches queued behind one untimed launch; kept as a cross-check and as
      the fallback when capture fails. The two should agree for kernels much longer than a launch.
    """

    def __init__(self, rt, warmup: int = 3, repeats: int = 15, batch: int = 10):
        self.rt, self.warmup, self.repeats, self.batch = rt, warmup, repeats, batch

    def median_ms(self, fns: list) -> dict:
        for i in range(self.warmup):
            fns[i % len(fns)]()
        self.rt.synchronize()
        if self.rt.name != "cupy":
            samples = []
            for r in range(self.repeats):
                t0 = time.perf_counter()
                for i in range(self.batch):
                    fns[(r + i) % len(fns)]()
                samples.append((time.perf_counter() - t0) * 1e3 / self.batch)
            return {**_stats(samples), "method": "host clock"}
        eager = self._events(fns)
        try:
            graph = self._graph(fns)
        except Exception as e:  # capture unsupported for some launch: report the plain events
            return {**eager, "method": "events", "graph_error": f"{type(e).__name__}: {e}"}
        return {**graph, "method": "graph", "events_median_ms": eager["median_ms"]}

    def _events(self, fns) -> dict:
        cp = self.rt.xp
        samples = []
        for r in range(self.repeats):
            start, end = cp.cuda.Event(), cp.cuda.Event()
            fns[r % len(fns)]()  # untimed: keeps the GPU busy while the timed launches are queued
            start.record()
            for i in range(self.batch):
                fns[(r + i + 1) % len(fns)]()
            end.record()
            end.synchronize()
            samples.append(cp.cuda.get_elapsed_time(start, end) / self.batch)
        return _stats(samples)

    def _graph(self, fns) -> dict:
        cp = self.rt.xp
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:  # kernels launch on the current stream; capture needs a non-default one
            stream.begin_capture()
            try:
                for i in range(self.batch):
                    fns[i % len(fns)]()
            finally:
                graph = stream.end_capture()
            for _ in range(self.warmup):
                graph.launch(stream)
            samples = []
            for _ in range(self.repeats):
                start, end = cp.cuda.Event(), cp.cuda.Event()
                start.record(stream)
                graph.launch(stream)
                end.record(stream)
                end.synchronize()
                samples.append(cp.cuda.get_elapsed_time(start, end) / self.batch)
        return _stats(samples)


def copy_bandwidth(rt, nbytes: int, timer: Timer) -> dict:
    """A large device-to-device copy: (bytes read + bytes written) / time."""
    xp = rt.xp
    src = xp.ones(nbytes // 4, dtype=np.float32)
    dst = xp.empty_like(src)
    if rt.name == "cupy":
        run = xp.cuda.runtime

        def fn():
            run.memcpyAsync(dst.data.ptr, src.data.ptr, src.nbytes, run.memcpyDeviceToDevice,
                            xp.cuda.get_current_stream().ptr)
    else:
        def fn():
            np.copyto(dst, src)
    t = timer.median_ms([fn])
    if not np.array_equal(rt.asnumpy(dst[:1024]), rt.asnumpy(src[:1024])):
        raise AssertionError("device copy did not copy")
    return {"bytes": 2 * src.nbytes, **t, "gb_per_s": 2 * src.nbytes / (t["median_ms"] * 1e-3) / 1e9}


def _l2_bytes(rt) -> int:
    if rt.name != "cupy":
        return 1 << 20
    return int(rt.xp.cuda.Device().attributes["L2CacheSize"])


def _filled_cache(rt, case: AttnCase, rng):
    """A one-layer device cache holding ``case.context`` random tokens per sequence, and the same
    history as host float32 arrays [B, Hkv, S, D] (rounded to the cache dtype) for the reference."""
    from minikv_gpu.kv_cache import ContiguousKVCache

    b, hkv, d, s = case.batch, case.num_kv_heads, case.head_dim, case.context
    cache = ContiguousKVCache(1, hkv, d, b, s + 1, dtype=np.dtype(case.dtype), runtime=rt)
    for i in range(b):
        cache.add_sequence(i)
    k, v = _randn(rt, rng, (b * s, hkv, d)), _randn(rt, rng, (b * s, hkv, d))
    with cache.step(range(b), [s] * b):
        cache.write(0, k, v)
    return cache


def _randn(rt, rng, shape):
    """Standard-normal float32 on the device, drawn there on a GPU (host RNG of GBs would take seconds)."""
    if rt.name == "cupy":
        return rt.xp.random.standard_normal(shape, dtype=np.float32)
    return rng.standard_normal(shape, dtype=np.float32)


def _reference_out(rt, cache, q, k_new, v_new, case: AttnCase, sample: int) -> np.ndarray:
    """NumPy attention (minikv.kv_cache) for the first ``sample`` sequences after the decode step."""
    d, hkv = case.head_dim, case.num_kv_heads
    n = min(sample, case.batch)
    host = ref_cache.ContiguousKVCache(1, hkv, d, n, case.context + 1, dtype=np.dtype(case.dtype))
    kk = rt.asnumpy(cache.k[0, :n, :, :case.context]).astype(np.float32)  # [n, Hkv, S, D]
    vv = rt.asnumpy(cache.v[0, :n, :, :case.context]).astype(np.float32)
    for i in range(n):
        host.add_sequence(i)
    with host.step(range(n), [case.context] * n):
        host.write(0, kk.transpose(0, 2, 1, 3).reshape(-1, hkv, d), vv.transpose(0, 2, 1, 3).reshape(-1, hkv, d))
    with host.step(range(n), [1] * n):
        host.write(0, k_new[:n], v_new[:n])
        return host.attend(0, q[:n])


def time_decode_attention(rt, case: AttnCase, timer: Timer, copy_gbs: float, rng) -> dict:
    """Check then time the contiguous cache's decode attention and torch SDPA. Keys: "v1" the automatic
    choice (decode_attention_v1, or decode_attention_v2 + attention_reduce_v2 when it splits), "v1 unsplit"
    decode_attention_v1, "v2 fused" rope_write_attend_v1/v2 (the fused kernel, automatic split)."""
    xp = rt.xp
    d, hq, hkv, b = case.head_dim, case.num_heads, case.num_kv_heads, case.batch
    n_sets = max(2, -(-3 * _l2_bytes(rt) // case.kv_bytes()))
    caches = [_filled_cache(rt, case, rng) for _ in range(n_sets)]
    q = rng.standard_normal((b, hq, d), dtype=np.float32)
    k_new = rng.standard_normal((b, hkv, d), dtype=np.float32)
    v_new = rng.standard_normal((b, hkv, d), dtype=np.float32)
    qd, kd, vd = rt.asarray(q), rt.asarray(k_new), rt.asarray(v_new)
    zeros = xp.zeros((b, d // 2), dtype=np.float32)  # cos/sin of angle 0: RoPE is the identity
    ones = xp.ones((b, d // 2), dtype=np.float32)
    for c in caches:  # open the decode step: every sequence brings one token at position S
        c.begin_step(range(b), [1] * b)
        c.write(0, kd, vd)
    row = {"case": case.name, "batch": b, "context": case.context, "heads": f"{hq}/{hkv}", "head_dim": d,
           "cache_dtype": case.dtype, "min_bytes": case.min_bytes(), "input_sets": n_sets}
    want = _reference_out(rt, caches[0], q, k_new, v_new, case, sample=4)
    variants = {
        "v1": [c.prepare_attend(0, qd) for c in caches],
        "v1 unsplit": [c.prepare_attend(0, qd, num_splits=1) for c in caches],
        "v2 fused": [c.prepare_rope_write_attend(0, qd, kd, vd, ones, zeros, "half") for c in caches],
    }
    row["splits"] = variants["v1"][0].splits
    for name, fns in variants.items():
        got = rt.asnumpy(fns[0]())[: want.shape[0]]
        err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
        if not err <= ATTN_RTOL[np.dtype(case.dtype).type]:
            raise AssertionError(f"{case.name} {name}: relative error {err:.2e} against NumPy")
        t = timer.median_ms(fns)
        gbs = case.min_bytes() / (t["median_ms"] * 1e-3) / 1e9
        row[name] = {**t, "rel_err": err, "gb_per_s": gbs, "of_copy": gbs / copy_gbs}
    # the split count's effect, to tune minikv_gpu.kv_cache.BLOCKS_PER_SM (automatic choice above)
    row["split_sweep_ms"] = {}
    for n in SPLIT_SWEEP:
        fns = [c.prepare_attend(0, qd, num_splits=n) for c in caches]
        if fns[0].splits == n:  # requests beyond one split per tile are clamped: skip duplicates
            row["split_sweep_ms"][n] = timer.median_ms(fns)["median_ms"]
    row["torch_sdpa"] = _time_torch_sdpa(rt, caches, q, case, timer, copy_gbs)
    try:
        row["paged"] = time_paged_decode_attention(rt, case, caches, qd, kd, vd, timer, copy_gbs)
    except Exception as e:  # recorded in the row; main() turns it into a failure
        row["paged"] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=3)}
    for c in caches:
        c.abort_step()
    return row


# --- paged decode attention (step 3) ----------------------------------------------------------------

PAGED_BLOCK_SIZE = 16


class _GatheredCache:
    """What ``_time_torch_sdpa`` reads from a cache: ``k, v: [1, B, Hkv, S, D]`` and ``prepare_attend``
    (here: the history gathered out of a paged cache, and the paged kernel's launch to compare with)."""

    def __init__(self, k, v, launch):
        self.k, self.v, self._launch = k[None], v[None], launch

    def prepare_attend(self, layer, q):
        return self._launch


def _paged_copy(rt, case: AttnCase, contiguous, kd, vd):
    """A one-layer paged cache holding ``contiguous``'s history (blocks handed out in order), with the
    decode step open and the new token written; and the history gathered back as [B, Hkv, S+1, D]."""
    from minikv_gpu.paged import PagedKVCache, num_blocks_for, slot_mapping

    b, hkv, d, s = case.batch, case.num_kv_heads, case.head_dim, case.context
    bs = PAGED_BLOCK_SIZE
    cache = PagedKVCache(1, hkv, d, b * num_blocks_for(s + 1, bs), bs, dtype=np.dtype(case.dtype), runtime=rt,
                         enable_prefix_caching=False)
    for i in range(b):
        cache.add_sequence(i)

    def rows(a):  # the contiguous layer [B, Hkv, S, D] -> packed float32 rows [B*S, Hkv, D] (exact from float16)
        packed = rt.xp.ascontiguousarray(a[0, :, :, :s].transpose(0, 2, 1, 3)).reshape(b * s, hkv, d)
        return packed.astype(np.float32)

    with cache.step(range(b), [s] * b):
        cache.write(0, rows(contiguous.k), rows(contiguous.v))
    cache.begin_step(range(b), [1] * b)
    cache.write(0, kd, vd)
    slots = rt.asarray(np.concatenate([slot_mapping(cache.block_table(i), np.arange(s + 1), bs) for i in range(b)]))

    def gather(pool):  # back out of the blocks: [B, Hkv, S+1, D]
        flat = pool[0].reshape(-1, hkv, d)[slots]
        return rt.xp.ascontiguousarray(flat.reshape(b, s + 1, hkv, d).transpose(0, 2, 1, 3))

    return cache, gather(cache.k_pool), gather(cache.v_pool)


def time_paged_decode_attention(rt, case: AttnCase, caches, qd, kd, vd, timer: Timer, copy_gbs: float) -> dict:
    """Time paged_decode_attention v1, v2 and the automatic choice on ``caches``' histories copied into
    paged caches; each must equal the contiguous decode kernel's output (<= ATTN_RTOL relative)."""
    want = rt.asnumpy(caches[0].prepare_attend(0, qd, num_splits=1)())
    copies = [_paged_copy(rt, case, c, kd, vd) for c in caches]
    paged = [c for c, _, _ in copies]
    res = {"block_size": PAGED_BLOCK_SIZE}
    for name, version in (("v1", 1), ("v2", 2), ("auto", None)):
        fns = [c.prepare_attend(0, qd, version=version) for c in paged]
        got = rt.asnumpy(fns[0]())
        err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
        if not err <= ATTN_RTOL[np.dtype(case.dtype).type]:
            raise AssertionError(f"{case.name} paged {name}: relative error {err:.2e} against the contiguous kernel")
        entry = {"version": fns[0].version, "partitions": fns[0].partitions, "rel_err": err}
        if name == "auto":  # the same launch as v1 or v2: reuse its timing
            entry["median_ms"] = res[f"v{fns[0].version}"]["median_ms"]
        else:
            t = timer.median_ms(fns)
            gbs = case.min_bytes() / (t["median_ms"] * 1e-3) / 1e9
            entry.update(t, gb_per_s=gbs, of_copy=gbs / copy_gbs)
        res[name] = entry
    gathered = [_GatheredCache(k, v, c.prepare_attend(0, qd, version=1)) for c, k, v in copies]
    res["torch_sdpa_gathered"] = _time_torch_sdpa(rt, gathered, rt.asnumpy(qd), case, timer, copy_gbs)
    for c in paged:
        c.abort_step()
    return res


def _time_torch_sdpa(rt, caches, q, case: AttnCase, timer: Timer, copy_gbs: float) -> dict:
    """torch's scaled_dot_product_attention over the same cache arrays (zero-copy through DLPack)."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError as e:
        return {"error": f"torch not importable: {e}"}
    try:
        dt = torch.float16 if case.dtype == "float16" else torch.float32
        s = case.context + 1
        qs = torch.from_dlpack(rt.asarray(q)).to(dt).unsqueeze(2)  # [B, Hq, 1, D]
        kvs = [(torch.from_dlpack(c.k[0]), torch.from_dlpack(c.v[0])) for c in caches]  # [B, Hkv, S, D] each
        assert kvs[0][0].shape[2] == s

        def make(k, v):
            return lambda: F.scaled_dot_product_attention(qs, k, v, enable_gqa=True)
        fns = [make(k, v) for k, v in kvs]
        out = fns[0]().squeeze(2).float()
        ours = caches[0].prepare_attend(0, rt.asarray(q))()
        err = float((out - torch.from_dlpack(ours)).abs().max() / torch.from_dlpack(ours).abs().max())
        if rt.name == "cupy":
            t = _torch_timer(torch, fns, timer)
        else:
            t = timer.median_ms(fns)
        gbs = case.min_bytes() / (t["median_ms"] * 1e-3) / 1e9
        return {**t, "rel_err_vs_ours": err, "gb_per_s": gbs, "of_copy": gbs / copy_gbs, "torch": torch.__version__}
    except Exception as e:  # a peer that cannot run is reported, not fatal
        return {"error": f"{type(e).__name__}: {e}"}


def _torch_timer(torch, fns, timer: Timer) -> dict:
    """Timer.median_ms for torch launches: torch's events, and a torch CUDA graph of one batch."""
    for i in range(timer.warmup):
        fns[i % len(fns)]()
    torch.cuda.synchronize()
    samples = []
    for r in range(timer.repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fns[r % len(fns)]()
        start.record()
        for i in range(timer.batch):
            fns[(r + i + 1) % len(fns)]()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / timer.batch)
    eager = _stats(samples)
    try:
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on a side stream, as torch's graph docs ask
            fns[0]()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            keep = [fns[i % len(fns)]() for i in range(timer.batch)]  # noqa: F841 (outputs live in the graph pool)
        for _ in range(timer.warmup):
            graph.replay()
        samples = []
        for _ in range(timer.repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / timer.batch)
    except Exception as e:
        return {**eager, "method": "events", "graph_error": f"{type(e).__name__}: {e}"}
    return {**_stats(samples), "method": "graph", "events_median_ms": eager["median_ms"]}


# --- stages --------------------------------------------------------------------------------------

def device_info(rt) -> dict:
    info = {"backend": rt.name, "host": platform.node(), "python": platform.python_version(),
            "numpy": np.__version__, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if rt.name == "cupy":
        cp = rt.xp
        dev = cp.cuda.Device()
        props = cp.cuda.runtime.getDeviceProperties(dev.id)
        info.update(gpu=props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"]),
                    multiprocessors=int(dev.attributes["MultiProcessorCount"]),
                    l2_bytes=int(dev.attributes["L2CacheSize"]), memory_bytes=int(dev.mem_info[1]),
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


# --- report --------------------------------------------------------------------------------------

def _fmt(x, spec=".3g"):
    return "-" if x is None else format(x, spec)


def format_markdown(report: dict) -> str:
    """The human-readable summary (also written to gpu_check.md)."""
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
    copy = report.get("copy", {})
    lines += ["", f"device-to-device copy: {_fmt(copy.get('gb_per_s'), '.0f')} GB/s "
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
    sweeps = [r for r in report.get("attention", []) if r.get("split_sweep_ms")]
    if sweeps:
        lines += ["", "split sweep (decode_attention_v2 + reduce median us by number of key ranges; 1: v1):", "",
                  "| case | cache | " + " | ".join(str(n) for n in SPLIT_SWEEP) + " |",
                  "|---|---|" + "---|" * len(SPLIT_SWEEP)]
        for r in sweeps:
            ms = {int(k): v for k, v in r["split_sweep_ms"].items()}  # JSON turns the keys into strings
            cells = ["-" if n not in ms else f"{ms[n] * 1e3:.1f}" for n in SPLIT_SWEEP]
            lines.append(f"| {r['case']} | {r['cache_dtype']} | " + " | ".join(cells) + " |")
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--model", default=None, help="a SmolLM2 GGUF file for compare (default: random weights)")
    ap.add_argument("--sim-smoke", action="store_true",
                    help="run every stage at toy sizes on the CPU simulator (checks the script, measures nothing)")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--test-timeout", type=int, default=150)
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    args.outdir.mkdir(parents=True, exist_ok=True)

    from minikv_gpu import runtime

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

    timer = Timer(rt, warmup=1, repeats=3, batch=2) if args.sim_smoke else Timer(rt)
    try:
        report["copy"] = copy_bandwidth(rt, (1 << 20) if args.sim_smoke else (2 << 30), timer)
    except Exception as e:
        report["copy"] = {"error": str(e)}
        report["errors"].append("copy: " + traceback.format_exc(limit=3))
    rng = np.random.default_rng(0)
    report["attention"] = []
    for case in SMOKE_CASES if args.sim_smoke else FULL_CASES:
        try:
            row = time_decode_attention(rt, case, timer, report["copy"].get("gb_per_s", float("nan")), rng)
        except Exception as e:
            row = {"case": f"{case.name} {case.dtype}", "error": f"{type(e).__name__}: {e}"}
            report["errors"].append(f"attention {case.name}: " + traceback.format_exc(limit=3))
        report["attention"].append(row)
        if "error" in row.get("paged", {}):
            report["errors"].append(f"paged attention {case.name}: {row['paged']['traceback']}")
        print("attention:", row.get("case"), {k: row[k]["median_ms"] for k in ("v1", "v2 fused") if k in row},
              flush=True)

    report["ok"] = (report["tests"].get("status") in ("passed", "not run") and not report["errors"]
                    and all(c.get("ok") for c in report["compare"]))
    report["seconds"] = time.perf_counter() - t_start
    js, md = write_report(args.outdir, report)
    print(format_markdown(report))
    print(f"wrote {js} and {md}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
