"""GPU check, step 4: absorbed MLA decode (``minikv_gpu.mla``, ``kernels/mla.cu``) at DeepSeek-V3's shapes.

Per case: a float16 latent cache ([L, B, 1, S+1, 576]) filled through ``latent_write_v1``, one decode
step open, ``mla_decode_attention_v3`` (+ the reduce when split) checked against ``minikv.mla``'s absorbed
form on sequence 0, then timed alone (its latent-space output, before W_UV), rotating over layers so the
latent rows do not sit in L2. Reported: bytes read per token (the latent rows, the minimum an absorbed
decode must read), achieved GB/s and its fraction of the measured copy, and the kernel's multiply-add
rate: at 128 heads each 1152-byte row feeds 128 x (576 + 512) multiply-adds, so on CUDA cores it is
compute-bound and its fraction of the copy is expected to be small (see mla.cu's header).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gpu_check_common import ATTN_RTOL, Timer, l2_bytes, randn, rel_err


@dataclass(frozen=True)
class MLACase:
    name: str
    batch: int
    context: int
    num_heads: int = 128
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128

    @property
    def width(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


FULL_MLA_CASES = [MLACase("deepseek-v3 B1 S4096", 1, 4096), MLACase("deepseek-v3 B16 S1024", 16, 1024),
                  MLACase("deepseek-v3 B16 S4096", 16, 4096), MLACase("deepseek-v3 B64 S2048", 64, 2048)]
SMOKE_MLA_CASES = [MLACase("toy mla B2 S40", 2, 40, num_heads=17, kv_lora_rank=32, qk_rope_head_dim=8,
                           qk_nope_head_dim=8, v_head_dim=8)]


def _cache(rt, case: MLACase, layers: int, rng):
    """A float16 latent cache of ``layers`` layers holding B histories of S random latents, decode step open."""
    from minikv.mla import LatentUp, MLAConfig
    from minikv_gpu.mla import LatentContiguousKVCache

    m = MLAConfig(kv_lora_rank=case.kv_lora_rank, qk_nope_head_dim=case.qk_nope_head_dim,
                  qk_rope_head_dim=case.qk_rope_head_dim, v_head_dim=case.v_head_dim)
    h, r = case.num_heads, case.kv_lora_rank
    up = [LatentUp((rng.standard_normal((h, r, case.qk_nope_head_dim)) * r ** -0.5).astype(np.float32),
                   (rng.standard_normal((h, r, case.v_head_dim)) * r ** -0.5).astype(np.float32))] * layers
    cache = LatentContiguousKVCache(layers, h, m, up, case.batch, case.context + 1, dtype=np.float16, runtime=rt)
    b, s = case.batch, case.context
    for i in range(b):
        cache.add_sequence(i)
    with cache.step(range(b), [s] * b):
        for li in range(layers):
            cache.write(li, randn(rt, rng, (b * s, 1, case.width)), None)
    cache.begin_step(range(b), [1] * b)
    for li in range(layers):
        cache.write(li, randn(rt, rng, (b, 1, case.width)), None)
    return cache, m


def time_mla_case(rt, case: MLACase, timer: Timer, copy_gbs: float, rng) -> dict:
    from minikv import mla as ref
    from minikv_gpu.mla import absorbed_attention, absorbed_query

    row_bytes = case.width * 2
    per_layer = case.batch * (case.context + 1) * row_bytes
    layers = int(min(8, max(1, -(-2 * l2_bytes(rt) // per_layer))))
    cache, m = _cache(rt, case, layers, rng)
    q = rng.standard_normal((case.batch, case.num_heads, m.qk_head_dim), dtype=np.float32)
    d = cache._dev
    q_abs = absorbed_query(rt.asarray(q), cache._w_uk_t[0], m.qk_nope_head_dim, runtime=rt)

    def launch(li):
        return absorbed_attention(cache.defines, q_abs, cache._layer_rows(li), (cache.max_len, d["table"]),
                                  d["seq"], d["pos"], d["max_keys"], m.softmax_scale, runtime=rt)

    got = rt.asnumpy(cache.attend(0, rt.asarray(q)))[0]  # the whole path: query absorb, kernel, W_UV
    lat0 = rt.asnumpy(cache.latent[0, 0, 0, :case.context + 1]).astype(np.float32)
    want = ref.latent_attention(q[:1], lambda k0, k1: lat0[k0:k1], case.context, cache.up[0], m, form="absorbed")[0]
    err = rel_err(got, want)
    if not err <= ATTN_RTOL[np.float16]:
        raise AssertionError(f"{case.name}: relative error {err:.2e} against minikv.mla (absorbed)")
    t = timer.median_ms([lambda li=li: launch(li) for li in range(layers)])
    keys = case.batch * (case.context + 1)
    read = keys * row_bytes + 4 * case.batch * case.num_heads * case.width
    gbs = read / (t["median_ms"] * 1e-3) / 1e9
    fmas = keys * case.num_heads * (case.width + case.kv_lora_rank)
    cache.abort_step()
    return {"case": case.name, "batch": case.batch, "context": case.context, "num_heads": case.num_heads,
            "latent_width": case.width, "cache_dtype": "float16", "rel_err": err, "layers_rotated": layers,
            "bytes_read_per_token": (case.context + 1) * row_bytes, "bytes_read": read, **t,
            "gb_per_s": gbs, "of_copy": gbs / copy_gbs, "tflop_per_s": 2 * fmas / (t["median_ms"] * 1e-3) / 1e12}


def run_mla(rt, timer: Timer, copy_gbs: float, smoke: bool) -> list[dict]:
    """Every MLA case (the smoke run: one toy case on the simulator); a failing case is recorded, not raised."""
    rng = np.random.default_rng(4)
    out = []
    for case in SMOKE_MLA_CASES if smoke else FULL_MLA_CASES:
        try:
            out.append(time_mla_case(rt, case, timer, copy_gbs, rng))
        except Exception as e:
            out.append({"case": case.name, "error": f"{type(e).__name__}: {e}"})
        print("mla:", {k: out[-1].get(k) for k in ("case", "median_ms", "gb_per_s", "of_copy", "tflop_per_s",
                                                   "error")}, flush=True)
    return out
