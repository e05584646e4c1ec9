"""GPU check, step 5: quantized decode attention (``minikv_gpu.quant``) against the fp16 v3 kernel.

    python benchmarks/gpu_check_quant.py OUT.json               # on the GPU (part of gpu_check.py too)
    python benchmarks/gpu_check_quant.py OUT.json --sim-smoke   # here: toy sizes on the simulator

One decode step of B sequences at context S (the goal case: llama-8B heads, Hq 32, Hkv 8, D 128,
B 16, S 8192; block 16): the same history in a fp16 ``PagedKVCache`` and in ``int8`` / ``fp8``
quantized caches (fp16 residual), each timed with v3 and v4. Per kv_dtype and version: median time,
the bytes attention reads per token (codes + scales of one token, K and V, all KV heads), achieved GB/s
on those bytes, the speed-up over fp16 with the same version (issue 11's goal on an H200: >= 1.6x, about
half the bytes) and the relative error of
the output against the fp16 kernel's (quantization error, recorded, not a kernel check: the kernels
are checked against NumPy by tests/gpu/test_gpu_quant.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from gpu_check_common import Timer, rel_err, stage_main  # noqa: E402

GOAL = dict(batch=16, context=8192, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16)
SMOKE = dict(batch=2, context=40, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16)
KV_DTYPES = ("int8", "fp8")
VERSIONS = (3, 4)
GOAL_SPEEDUP = 1.6  # over the fp16 v3 kernel, on an H200


def _randn(rt, shape, seed: int):
    if rt.name == "cupy":
        return rt.xp.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _filled(rt, cls, case: dict, **kw):
    """A one-layer cache of class ``cls`` with B histories of S tokens and the decode step open, written."""
    from minikv_gpu.paged import num_blocks_for

    b, s, hkv, d, bs = (case[k] for k in ("batch", "context", "num_kv_heads", "head_dim", "block_size"))
    cache = cls(1, hkv, d, b * num_blocks_for(s + 1, bs), bs, dtype=np.float16, runtime=rt,
                enable_prefix_caching=False, **kw)
    for i in range(b):
        cache.add_sequence(i)
    with cache.step(range(b), [s] * b):
        cache.write(0, _randn(rt, (b * s, hkv, d), 1), _randn(rt, (b * s, hkv, d), 2))
    cache.begin_step(range(b), [1] * b)
    cache.write(0, _randn(rt, (b, hkv, d), 3), _randn(rt, (b, hkv, d), 4))
    return cache


def run_quant(rt, smoke: bool, timer: Timer, copy_gbs: float = float("nan")) -> dict:
    """Time fp16 and each quantized kv_dtype on one decode step, v3 and v4; see the module docstring. Entries
    are named "<kv_dtype>_v<N>" (fp16: the plain paged cache); speed-ups compare the same version."""
    from minikv_gpu.paged import PagedKVCache
    from minikv_gpu.quant import QuantizedPagedKVCache

    case = SMOKE if smoke else GOAL
    b, s, hkv, d = (case[k] for k in ("batch", "context", "num_kv_heads", "head_dim"))
    q = _randn(rt, (b, case["num_heads"], d), 5)
    res: dict = {"case": dict(case), "goal_speedup": GOAL_SPEEDUP, "copy_gb_per_s": copy_gbs}
    fp16_bytes = 2 * hkv * d * 2  # K and V of one token, all KV heads
    ref = _filled(rt, PagedKVCache, case)
    want = {}
    for v in VERSIONS:
        launch = ref.prepare_attend(0, q, version=v)
        want[v] = rt.asnumpy(launch())
        t = timer.median_ms([launch])
        res[f"fp16_v{v}"] = {**t, "bytes_per_token": fp16_bytes, "partitions": launch.partitions,
                             **_rates(b * (s + 1) * fp16_bytes, t, copy_gbs)}
    ref.abort_step()
    del ref
    for kv in KV_DTYPES:
        cache = _filled(rt, QuantizedPagedKVCache, case, kv_dtype=kv)
        per_token = cache.bytes_per_token()  # one layer: exactly what attention reads per coded token
        for v in VERSIONS:
            fn = cache.prepare_attend(0, q, version=v)
            got = rt.asnumpy(fn())
            t = timer.median_ms([fn])
            entry = {**t, "bytes_per_token": per_token, "partitions": fn.partitions,
                     "bytes_ratio_vs_fp16": per_token / fp16_bytes, **_rates(b * (s + 1) * per_token, t, copy_gbs),
                     "speedup_vs_fp16": res[f"fp16_v{v}"]["median_ms"] / t["median_ms"],
                     "rel_err_vs_fp16": rel_err(got, want[v]), "finite": bool(np.all(np.isfinite(got)))}
            entry["meets_goal"] = entry["speedup_vs_fp16"] >= GOAL_SPEEDUP
            if not entry["finite"]:
                raise AssertionError(f"quant {kv} v{v}: the output has non-finite values")
            res[f"{kv}_v{v}"] = entry
        cache.abort_step()
        del cache
    return res


def _rates(nbytes: int, t: dict, copy_gbs: float) -> dict:
    gbs = nbytes / (t["median_ms"] * 1e-3) / 1e9
    return {"gb_per_s": gbs, "of_copy": gbs / copy_gbs}


def main(argv: list[str] | None = None) -> int:
    return stage_main(argv, __doc__, run_quant, summary=lambda res: {
        k: {m: v[m] for m in ("median_ms", "speedup_vs_fp16", "bytes_per_token") if m in v}
        for k, v in res.items() if isinstance(v, dict) and "median_ms" in v})


if __name__ == "__main__":
    sys.exit(main())
