"""The fused rope_write_attend kernel (kernels/kv_cache.cu) is for decode steps only: given two
new tokens of one sequence, the block of the second token reads the key the block of the first
writes in the same launch. The default block order happens to honour that; reversed and random
orders need not, which is why ContiguousKVCache.rope_write_attend refuses such steps. This test goes
past that guard (its private ``_dev["decode"]`` flag) to show the new schedules catch it.
"""

from __future__ import annotations

import numpy as np
import pytest

from minikv.model import rope_tables
from minikv_gpu import kv_cache as gpu
from minikv_gpu.model import apply_rope as gpu_rope


def _two_new_tokens(sim_rt, fused: bool) -> np.ndarray:
    hkv, d = 1, 64
    rng = np.random.default_rng(3)
    cos_t, sin_t = rope_tables(d, 64, 10000.0)
    c = gpu.ContiguousKVCache(1, hkv, d, 1, 48, runtime=sim_rt)
    c.add_sequence(0)
    for num_new in (5, 2):
        q, k, v = (rng.standard_normal((num_new, h, d)).astype(np.float32) for h in (2, hkv, hkv))
        with c.step([0], [num_new]) as pos:
            args = [sim_rt.asarray(a) for a in (q, k, v, cos_t[pos], sin_t[pos])]
            if num_new == 2 and fused:
                c._dev["decode"] = True  # past the guard: two tokens of one sequence in one launch
                return sim_rt.asnumpy(c.rope_write_attend(0, *args, "half", version=1))
            qd, kd, vd, cd, sd = args
            c.write(0, gpu_rope(kd, cd, sd, "half", runtime=sim_rt), vd)
            out = c.attend(0, gpu_rope(qd, cd, sd, "half", runtime=sim_rt), version=1)
    return sim_rt.asnumpy(out)


@pytest.mark.parametrize("blocks,honoured", [("order", True), ("reverse", False)])  # 2 blocks: random may keep order
def test_fused_kernel_with_two_tokens_of_one_sequence_depends_on_block_order(sim_rt, monkeypatch, blocks,
                                                                             honoured):
    monkeypatch.delenv("MINIKV_SIM_SCHEDULE", raising=False)
    monkeypatch.delenv("MINIKV_SIM_BLOCKS", raising=False)
    want = _two_new_tokens(sim_rt, fused=False)
    monkeypatch.setenv("MINIKV_SIM_BLOCKS", blocks)
    got = _two_new_tokens(sim_rt, fused=True)
    assert np.allclose(got, want, rtol=1e-4, atol=1e-5) == honoured
