"""GPU check, step 2: the contiguous cache's decode attention (``minikv_gpu.kv_cache``), checked against
NumPy, then timed: the automatic choice, v1, v2, v3 and v4 explicitly, the fused kernel, split sweeps of
v2, v3 and v4, and every torch SDPA backend."""

from __future__ import annotations

import traceback

import numpy as np
from gpu_check_attention import time_torch_sdpa
from gpu_check_common import ATTN_RTOL, SPLIT_SWEEP, AttnCase, Timer, bandwidth, l2_bytes, randn, rel_err

from minikv import kv_cache as ref_cache


def filled_cache(rt, case: AttnCase, rng):
    """A one-layer device cache holding ``case.context`` random tokens per sequence, and the same
    history as host float32 arrays [B, Hkv, S, D] (rounded to the cache dtype) for the reference."""
    from minikv_gpu.kv_cache import ContiguousKVCache

    b, hkv, d, s = case.batch, case.num_kv_heads, case.head_dim, case.context
    cache = ContiguousKVCache(1, hkv, d, b, s + 1, dtype=np.dtype(case.dtype), runtime=rt)
    for i in range(b):
        cache.add_sequence(i)
    k, v = randn(rt, rng, (b * s, hkv, d)), randn(rt, rng, (b * s, hkv, d))
    with cache.step(range(b), [s] * b):
        cache.write(0, k, v)
    return cache


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


def check_variant(row: dict, name: str, err: float, tol: float) -> dict:
    """A variant's error against the reference: recorded with the verdict; a miss goes to row["misses"] and the
    variant is still timed (the row keeps every other variant's numbers)."""
    ok = bool(err <= tol)
    if not ok:
        row.setdefault("misses", []).append(f"{name}: relative error {err:.2e} > {tol:g}")
    return {"rel_err": err, "within_tol": ok}


def time_decode_attention(rt, case: AttnCase, timer: Timer, copy_gbs: float, rng, extra: dict | None = None,
                          row: dict | None = None, on_measured=lambda: None) -> dict:
    """Check then time the contiguous cache's decode attention and torch SDPA. Variants: "auto" (the
    cache's choice: v4 for decode), "v1" (decode_attention_v1, one range), "v2" (decode_attention_v2 +
    attention_reduce_v2, automatic splits), "v3" and "v4" (the register-resident kernels, split by
    versions.split_plan), "fused" (rope_write_attend_v1/v2, automatic). Each entry: median time, bandwidth,
    fraction of the copy, and its error against NumPy (a miss is recorded in row["misses"], not raised).

    ``row``: the dict to fill (the driver's, already in its report); ``on_measured()`` is called after each
    variant is timed, so the goal numbers are saved the moment they exist.
    ``extra``: name -> stage(rt, case, caches, qd, kd, vd, timer, copy_gbs), run on the same filled caches
    while the decode step is open (the driver passes the paged stage as "paged"); a stage's exception is
    recorded in the row as {"error", "traceback"}."""
    xp = rt.xp
    d, hq, hkv, b = case.head_dim, case.num_heads, case.num_kv_heads, case.batch
    n_sets = max(2, -(-3 * l2_bytes(rt) // case.kv_bytes()))
    caches = [filled_cache(rt, case, rng) for _ in range(n_sets)]
    q = rng.standard_normal((b, hq, d), dtype=np.float32)
    k_new = rng.standard_normal((b, hkv, d), dtype=np.float32)
    v_new = rng.standard_normal((b, hkv, d), dtype=np.float32)
    qd, kd, vd = rt.asarray(q), rt.asarray(k_new), rt.asarray(v_new)
    zeros = xp.zeros((b, d // 2), dtype=np.float32)  # cos/sin of angle 0: RoPE is the identity
    ones = xp.ones((b, d // 2), dtype=np.float32)
    for c in caches:  # open the decode step: every sequence brings one token at position S
        c.begin_step(range(b), [1] * b)
        c.write(0, kd, vd)
    row = {} if row is None else row
    row.update({"case": case.name, "batch": b, "context": case.context, "heads": f"{hq}/{hkv}", "head_dim": d,
                "cache_dtype": case.dtype, "min_bytes": case.min_bytes(), "input_sets": n_sets})
    want = _reference_out(rt, caches[0], q, k_new, v_new, case, sample=4)
    tol = ATTN_RTOL[np.dtype(case.dtype).type]
    variants = {name: (lambda c, v=version: c.prepare_attend(0, qd, version=v))
                for name, version in (("v4", 4), ("v3", 3), ("auto", None), ("v1", 1), ("v2", 2))}
    variants["fused"] = lambda c: c.prepare_rope_write_attend(0, qd, kd, vd, ones, zeros, "half")
    for name, make in variants.items():  # v4 and v3 first: the goal's numbers
        fns = [make(c) for c in caches]
        got = rt.asnumpy(fns[0]())[: want.shape[0]]
        verdict = check_variant(row, name, rel_err(got, want), tol)
        t = timer.median_ms(fns)
        row[name] = {**t, **verdict, "version": fns[0].version, "splits": fns[0].splits,
                     "keys_per_split": fns[0].keys_per_split, **bandwidth(case, t, copy_gbs)}
        on_measured()
    row["splits"] = row["auto"]["splits"]
    _sweeps(row, caches, qd, timer)
    row["torch_sdpa"] = time_torch_sdpa(rt, caches, q, case, timer, copy_gbs, ours=variants["v1"](caches[0])())
    on_measured()
    for name, stage in (extra or {}).items():
        try:
            row[name] = stage(rt, case, caches, qd, kd, vd, timer, copy_gbs)
        except Exception as e:  # recorded in the row; main() turns it into a failure
            row[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=3)}
        on_measured()
    for c in caches:
        c.abort_step()
    return row


def _sweeps(row: dict, caches, qd, timer: Timer) -> None:
    """The split count's effect on v2, v3 and v4 (to tune versions.split_plan against the automatic choice)."""
    for key, version in (("split_sweep_ms", 2), ("v3_split_sweep_ms", 3), ("v4_split_sweep_ms", 4)):
        row[key] = {}
        for n in SPLIT_SWEEP:
            fns = [c.prepare_attend(0, qd, version=version, num_splits=n) for c in caches]
            if fns[0].splits == n:  # requests beyond one split per tile are clamped: skip duplicates
                row[key][n] = timer.median_ms(fns)["median_ms"]
