"""GPU check, the host tier's copies (``minikv_gpu.tiers``): a demote + promote round of N blocks on the copy
stream against the same copies through the cache's synchronous swap hooks.

    python benchmarks/gpu_check_tiers.py OUT.json               # on the GPU (part of gpu_check.py too)
    python benchmarks/gpu_check_tiers.py OUT.json --sim-smoke   # here: toy sizes on the simulator

A round: device blocks 0..N-1 to host blocks 0..N-1, then back into device blocks N..2N-1. Async:
``AsyncCacheStorage`` (pinned host pools, one 2D copy per block and pool, one event per batch). Sync:
``PagedKVCache._swap_out_blocks`` / ``_swap_in_blocks`` (a gather kernel, a device-to-host copy into
pageable NumPy, an upload, a scatter kernel). Per path: the median time of a round on its stream (CUDA
events; the host clock on the simulator), the host time the caller spends issuing it (the async caller
is free after that), GB/s of the bytes moved (both directions) and whether the round trip is bit-identical.
Blocks are SmolLM2-135M's (30 layers, 3 KV heads, D 64, 16 tokens, float16: 360 KiB a block, K and V).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from gpu_check_common import stats  # noqa: E402

from minikv_gpu.paged import PagedKVCache  # noqa: E402
from minikv_gpu.tiers import AsyncCacheStorage  # noqa: E402

GEOMETRY = dict(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16)
SMOKE = dict(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)


def _cache(rt, geometry: dict, n: int) -> PagedKVCache:
    cache = PagedKVCache(**geometry, num_blocks=2 * n, dtype=np.float16, num_host_blocks=n, runtime=rt)
    xp = rt.xp
    for pool in (cache.k_pool, cache.v_pool):  # distinct values, so a misplaced block shows
        pool[...] = (xp.arange(pool.size, dtype=np.float32).reshape(pool.shape) % 2039).astype(np.float16)
    return cache


def _time(rt, round_fn, stream, repeats: int) -> dict:
    """Median ms of ``round_fn`` between two events on ``stream``, and the host ms spent issuing it."""
    gpu, host = [], []
    for _ in range(repeats + 1):  # the first round warms up
        rt.synchronize()
        stream.synchronize()
        start, end = rt.event(timing=True), rt.event(timing=True)
        t0 = time.perf_counter()
        start.record(stream)
        round_fn()
        end.record(stream)
        host.append((time.perf_counter() - t0) * 1e3)
        end.synchronize()
        gpu.append(rt.xp.cuda.get_elapsed_time(start, end) if rt.name == "cupy"
                   else (time.perf_counter() - t0) * 1e3)
    return {**stats(gpu[1:]), "host_issue_ms": float(np.median(host[1:]))}


def run_tiers(rt, smoke: bool, blocks: int | None = None) -> dict:
    n = blocks or (4 if smoke else 256)
    geometry = SMOKE if smoke else GEOMETRY
    ids, back = list(range(n)), list(range(n, 2 * n))
    sync_cache, async_cache = _cache(rt, geometry, n), _cache(rt, geometry, n)
    storage = AsyncCacheStorage(async_cache)

    def sync_round():
        sync_cache._swap_out_blocks(ids, ids)
        sync_cache._swap_in_blocks(ids, back)

    def async_round():
        storage.demote(ids, ids)
        storage.promote(ids, back, prefetch=False)

    repeats = 3 if smoke else 10
    nbytes = 2 * n * (sync_cache.bytes_allocated() // sync_cache.num_blocks)
    out = {"blocks": n, "geometry": geometry, "dtype": "float16", "bytes_per_round": nbytes}
    for name, fn, stream, cache in (("sync", sync_round, rt.current_stream(), sync_cache),
                                    ("async", async_round, storage.stream, async_cache)):
        t = _time(rt, fn, stream, repeats)
        exact = all(bool(rt.xp.array_equal(p[:, :n], p[:, n:])) for p in (cache.k_pool, cache.v_pool))
        out[name] = {**t, "gb_per_s": nbytes / (t["median_ms"] * 1e-3) / 1e9, "bit_identical": exact}
    out["host_pinned"] = bool(rt.is_pinned(async_cache.host_k_pool))
    out["speedup"] = out["sync"]["median_ms"] / out["async"]["median_ms"]
    out["ok"] = out["sync"]["bit_identical"] and out["async"]["bit_identical"] and out["host_pinned"]
    return out


def main(argv=None) -> int:
    from minikv_gpu import runtime

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--sim-smoke", action="store_true")
    ap.add_argument("--blocks", type=int, default=None)
    args = ap.parse_args(argv)
    rt = runtime.get_runtime("sim" if args.sim_smoke else "cupy")
    res = run_tiers(rt, args.sim_smoke, args.blocks)
    args.out.write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
