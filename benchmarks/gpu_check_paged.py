"""GPU check, step 3: paged decode attention (``minikv_gpu.paged``) on the contiguous stage's histories
copied into paged caches: v1, v2 (split-K), v3 and v4 (register-resident) and the automatic choice, each checked
against the contiguous kernel's output, and every torch SDPA backend on the history gathered back out of
the blocks."""

from __future__ import annotations

import numpy as np
from gpu_check_attention import time_torch_sdpa
from gpu_check_common import ATTN_RTOL, AttnCase, Timer, bandwidth, rel_err

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
    slots = rt.asarray(np.concatenate([slot_mapping(cache.blocks.table(i), np.arange(s + 1), bs) for i in range(b)]))

    def gather(pool):  # back out of the blocks: [B, Hkv, S+1, D]
        flat = pool[0].reshape(-1, hkv, d)[slots]
        return rt.xp.ascontiguousarray(flat.reshape(b, s + 1, hkv, d).transpose(0, 2, 1, 3))

    return cache, gather(cache.k_pool), gather(cache.v_pool)


def time_paged_decode_attention(rt, case: AttnCase, caches, qd, kd, vd, timer: Timer, copy_gbs: float) -> dict:
    """Time paged_decode_attention v1, v2, v3, v4 and the automatic choice on ``caches``' histories copied into
    paged caches; each is checked against the contiguous decode kernel's output (a miss beyond ATTN_RTOL is
    recorded in ``misses`` and the variant still timed)."""
    from gpu_check_kv_cache import check_variant

    want = rt.asnumpy(caches[0].prepare_attend(0, qd, version=1)())
    copies = [_paged_copy(rt, case, c, kd, vd) for c in caches]
    paged = [c for c, _, _ in copies]
    res = {"block_size": PAGED_BLOCK_SIZE}
    tol = ATTN_RTOL[np.dtype(case.dtype).type]
    for name, version in (("v4", 4), ("v3", 3), ("v1", 1), ("v2", 2), ("auto", None)):
        fns = [c.prepare_attend(0, qd, version=version) for c in paged]
        got = rt.asnumpy(fns[0]())
        entry = {"version": fns[0].version, "partitions": fns[0].partitions,
                 **check_variant(res, f"paged {name}", rel_err(got, want), tol)}
        if name == "auto":  # the same launch as one of the others: reuse its timing
            entry["median_ms"] = res[f"v{fns[0].version}"]["median_ms"]
        else:
            t = timer.median_ms(fns)
            entry.update(t, **bandwidth(case, t, copy_gbs))
        res[name] = entry
    gathered = [_GatheredCache(k, v, c.prepare_attend(0, qd, version=1)) for c, k, v in copies]
    res["torch_sdpa_gathered"] = time_torch_sdpa(rt, gathered, rt.asnumpy(qd), case, timer, copy_gbs)
    for c in paged:
        c.abort_step()
    return res
