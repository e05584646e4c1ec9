"""minikv.costs pinned to hand-computed numbers, one test per seed claim that is pure arithmetic.

Every expected value is written as the arithmetic a person would do on paper,
with a comment, never as a number copied from the code's output. docs/claims.md
points at these tests.
"""

import json
import math
from fractions import Fraction

import numpy as np
import pytest

from minikv.cli import main
from minikv.costs import (
    PRESETS,
    ModelShape,
    arithmetic_intensity,
    cache_speedup,
    decode_flops,
    dtype_bytes,
    expanded_kv_values_per_token,
    forward_flops,
    generation_flops,
    get_preset,
    kv_bytes_per_token,
    kv_cache_bytes,
    kv_values_per_token,
    layer_flops,
    param_count,
    recompute_flops,
    shape_from_config,
    weights_bytes,
)
from minikv.errors import ConfigError, InvalidInputError
from minikv.kv_cache import ContiguousKVCache
from minikv.weights.random_models import random_model

GB, GiB, MiB = 10**9, 2**30, 2**20


def run_cli(capsys, *argv) -> tuple[int, str, dict | None]:
    """Run `minikv ...` in-process; return (exit code, stdout + stderr, the JSON of its last line if any)."""
    rc = main(list(argv))
    captured = capsys.readouterr()
    last = captured.out.strip().splitlines()[-1] if captured.out.strip() else ""
    return rc, captured.out + captured.err, (json.loads(last) if last.startswith("{") else None)


# --- dtypes -----------------------------------------------------------------------------------

def test_dtype_bytes():
    assert [dtype_bytes(d) for d in ("fp32", "fp16", "bf16", "fp8", "int8", "int4")] == [4, 2, 2, 1, 1, 0.5]
    with pytest.raises(ConfigError, match="fp64"):
        dtype_bytes("fp64")


# --- GPT-3: 4blh(s+t) = 164,282,499,072 bytes ---------------------------------------------------

def test_gpt3_kv_cache_is_164_gb_and_half_the_weights():
    gpt3 = get_preset("gpt3-175b")
    # seed: 4 b l h (s + t) bytes in fp16 = 2 (K,V) x 2 bytes x batch x layers x hidden x tokens
    b, l, h, s, t = 64, 96, 12288, 512, 32
    assert kv_cache_bytes(gpt3, b, s, t, "fp16") == 4 * b * l * h * (s + t) == 164_282_499_072
    # parameters from the shapes: per layer 4h^2 (q,k,v,o) + 8h^2 (MLP h->4h->h), biases 3h+h+4h+h
    # and two LayerNorms 4h; plus token (50257 x h) and position (2048 x h) tables, final LayerNorm 2h
    params = l * (12 * h * h + 13 * h) + 50257 * h + 2048 * h + 2 * h
    assert param_count(gpt3)["total"] == params
    assert abs(params / 175e9 - 1) < 0.005  # the published "175B"
    assert weights_bytes(gpt3, "fp16") == 2 * params  # ~349 GB, the seed's "350 GB"
    ratio = (4 * b * l * h * (s + t)) / (2 * params)
    assert 0.46 < ratio < 0.48  # "about 0.5x the weights"


def test_cli_gpt3_json_gives_exact_kv_bytes(capsys):
    rc, out, rep = run_cli(capsys, "memory", "--preset", "gpt3-175b", "--batch", "64", "--prompt-len", "512",
                           "--output-len", "32", "--dtype", "fp16", "--json")
    assert rc == 0
    assert rep["kv_cache_bytes"] == 4 * 64 * 96 * 12288 * (512 + 32)
    assert rep["weights_bytes"] == 2 * (96 * (12 * 12288**2 + 13 * 12288) + (50257 + 2048 + 2) * 12288)
    assert "GB" in out and "GiB" in out  # both unit systems, labelled


# --- the formula 2 x B x L x H x d x max_seq_len x dtype_size -------------------------------------

def test_formula_needs_kv_heads_not_query_heads():
    llama3 = get_preset("llama3-8b")  # 32 query heads share 8 KV heads
    assert kv_bytes_per_token(llama3, "fp16") == 2 * 32 * 8 * 128 * 2  # 128 KiB
    with_query_heads = 2 * 32 * 32 * 128 * 2
    assert with_query_heads == 4 * kv_bytes_per_token(llama3, "fp16")  # using H = query heads overcounts 4x


@pytest.mark.parametrize("dtype, name", [(np.float32, "fp32"), (np.float16, "fp16")])
def test_formula_matches_contiguous_cache(dtype, name):
    """Preallocation follows the formula with max_seq_len; what is really used follows the true length."""
    model = random_model(num_layers=3, num_heads=6, num_kv_heads=2, head_dim=8, hidden_size=48)
    shape = shape_from_config(model.config)
    cache = ContiguousKVCache(**model.new_cache_args(), max_seqs=2, max_len=40, dtype=dtype)
    itemsize = np.dtype(dtype).itemsize
    assert cache.bytes_per_token() == kv_bytes_per_token(shape, name) == 2 * 3 * 2 * 8 * itemsize
    # 2 sequences x 40 slots reserved, whatever they hold
    assert cache.bytes_allocated() == kv_cache_bytes(shape, 2, 40, 0, name) == 2 * 2 * 3 * 2 * 8 * 40 * itemsize
    cache.add_sequence("a")
    model.forward([[1, 2, 3, 4, 5]], cache, ["a"])
    assert cache.bytes_used() == kv_cache_bytes(shape, 1, 5, 0, name)  # 5 real tokens


# --- Llama-2 13B at 2048 tokens --------------------------------------------------------------------

def test_llama2_13b_cache_adds_memory_it_does_not_save_it():
    m = get_preset("llama2-13b")
    per_token = 2 * 40 * 40 * 128 * 2  # K and V, 40 layers, 40 KV heads, head_dim 128, fp16
    assert kv_bytes_per_token(m, "fp16") == per_token == 819_200  # ~0.8 MB per token
    kv = kv_cache_bytes(m, 1, 2048, 0, "fp16")
    assert kv == 2048 * per_token == 1_677_721_600  # 1.68 GB at batch 1
    params = 40 * (4 * 5120**2 + 3 * 5120 * 13824 + 2 * 5120) + 2 * 32000 * 5120 + 5120
    assert param_count(m)["total"] == params == 13_015_864_320
    weights = weights_bytes(m, "fp16")
    assert weights == 2 * params  # 26.0 GB
    # the cache only adds: weights alone (no cache) < weights + cache; neither is 48 GB or 12 GB
    assert weights < weights + kv < 28 * GB
    assert kv < 2 * GB
    # what the two numbers do match: the weights in fp32 (4 bytes) and int8 (1 byte), in GiB
    assert round(weights_bytes(m, "fp32") / GiB, 1) == round(4 * params / 2**30, 1) == 48.5
    assert round(weights_bytes(m, "int8") / GiB, 1) == round(1 * params / 2**30, 1) == 12.1


# --- DeepSeek-7B: 0.5 GB at 1k, 16 GB at 32k, 64 GB at 128k -----------------------------------------

def test_deepseek_7b_seed_arithmetic_holds_in_gib_for_its_premise():
    premise = ModelShape("seed premise", num_layers=32, num_kv_heads=32, head_dim=128)  # 32 layers, 4096 hidden
    per_token = 2 * 32 * 4096 * 2  # K,V x layers x hidden x fp16 = 512 KiB
    assert kv_bytes_per_token(premise, "fp16") == per_token
    assert kv_cache_bytes(premise, 1, 1024) == 2**29 == GiB // 2  # "0.5 GB" is 0.5 GiB
    assert kv_cache_bytes(premise, 1, 32 * 1024) == 16 * GiB
    assert kv_cache_bytes(premise, 1, 128 * 1024) == 64 * GiB


def test_deepseek_7b_real_config_has_30_layers_and_4k_context():
    m = get_preset("deepseek-7b")
    assert m.num_layers == 30 and m.max_context == 4096
    per_token = 2 * 30 * 4096 * 2  # 480 KiB
    assert kv_bytes_per_token(m, "fp16") == per_token
    assert kv_cache_bytes(m, 1, 1024) == 1024 * per_token == 15 * GiB // 32  # 0.47 GiB
    assert kv_cache_bytes(m, 1, 32 * 1024) == 15 * GiB
    assert kv_cache_bytes(m, 1, 128 * 1024) == 60 * GiB
    params = 30 * (4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096) + 2 * 102400 * 4096 + 4096
    assert param_count(m)["total"] == params  # 6.91B, DeepSeek LLM "7B"


# --- DeepSeek-V3 and MLA ---------------------------------------------------------------------------------

def test_deepseek_v3_seed_product_is_a_gqa_cache_not_mla():
    seed = 61 * 8 * 512 * (32 * 1024) * 2  # "61 layers x 8 KV heads x 512 blocks x 32 KB x 2"
    assert seed == 16_374_562_816
    assert abs(seed / GiB - 15.25) < 1e-9  # the seed's "15.2 GB" is 15.25 GiB (16.4 decimal GB)
    # 32 KB per block and head = 128 tokens x 128 dims x 2 bytes: 512 blocks are 65,536 tokens of a
    # cache with 8 KV heads of 128 dims in fp16 -- a GQA model, not DeepSeek-V3
    v3 = get_preset("deepseek-v3")
    gqa8 = v3.replace(kv_lora_rank=0, rope_dim=0, num_kv_heads=8, head_dim=128)
    assert 32 * 1024 == 128 * 128 * 2
    assert kv_cache_bytes(gqa8, 1, 512 * 128, 0, "fp16") == seed
    # what V3 really caches: one 512-value latent + one 64-value RoPE key per token and layer
    assert kv_values_per_token(v3) == 61 * (512 + 64)
    assert kv_bytes_per_token(v3, "bf16") == 61 * 576 * 2  # 70,272 B = 68.6 KiB per token
    real = kv_cache_bytes(v3, 1, 512 * 128, 0, "bf16")
    assert real == 65536 * 61 * 576 * 2  # 4.6 GB (4.29 GiB) for the same 65,536 tokens
    assert Fraction(seed, real) == Fraction(2 * 8 * 128, 576)  # the seed's premise is 3.6x too big


def test_mla_reduction_depends_on_the_baseline():
    v3 = get_preset("deepseek-v3")
    mla = 512 + 64  # values per token and layer
    # V3's own 128 heads, if each cached K (128 + 64 RoPE dims) and V (128): 128 x 320 values
    assert expanded_kv_values_per_token(v3) == 61 * 128 * (128 + 64 + 128)
    assert Fraction(kv_values_per_token(v3), expanded_kv_values_per_token(v3)) == Fraction(576, 128 * 320)  # 1/71
    assert Fraction(mla, 2 * 128 * 128) < Fraction(1, 50)  # vs plain MHA 128 x 128: 1/57
    assert Fraction(mla, 2 * 8 * 128) > Fraction(1, 4)  # vs GQA with 8 KV heads: only 1/3.6
    # DeepSeek-V2 reports -93.3% vs DeepSeek 67B (95 layers, GQA 8 x 128); that figure matches V2's
    # 60 layers x 576 values at ~6 bits (its KV quantization) against 67B in 16 bits
    ds67b = ModelShape("deepseek-67b", num_layers=95, num_kv_heads=8, head_dim=128)
    dsv2 = ModelShape("deepseek-v2", num_layers=60, kv_lora_rank=512, rope_dim=64)
    bits = Fraction(kv_values_per_token(dsv2) * 6, kv_values_per_token(ds67b) * 16)
    assert bits == Fraction(60 * 576 * 6, 95 * 2 * 8 * 128 * 16)
    assert round(float(1 - bits), 3) == 0.933
    # without the 6-bit quantization the same element ratio is a 5.6x reduction, not 15x
    assert round(kv_values_per_token(ds67b) / kv_values_per_token(dsv2), 1) == 5.6


def test_cli_deepseek_v3_bf16_caches_70272_bytes_per_token_and_its_mha_equivalents(capsys):
    """MLA's 61 x (512 + 64) x 2 bytes against caches with V3's 128 heads and per-head K and V.

    The MHA equivalent of V3 caches what its attention really uses per head: a key of
    qk_nope + qk_rope = 128 + 64 = 192 dims (the RoPE part is per head once expanded) and a
    value of v_head_dim = 128 dims. A "plain" MHA of 128 x 128 (K and V both 128) is shown too.
    """
    rc, _, rep = run_cli(capsys, "memory", "--preset", "deepseek-v3", "--dtype", "bf16", "--prompt-len", "1",
                         "--output-len", "0", "--json")
    assert rc == 0 and rep["attention"] == "MLA"
    assert rep["kv_bytes_per_token"] == rep["kv_cache_bytes"] == 61 * 576 * 2 == 70_272
    v3 = get_preset("deepseek-v3")
    expanded = 61 * 128 * ((128 + 64) + 128) * 2  # K 192 + V 128 per head, bf16: 4,997,120 B
    assert rep["expanded_kv_values_per_token"] * 2 == expanded == 4_997_120
    plain_mha = v3.replace(kv_lora_rank=0, rope_dim=0, v_head_dim=None)  # 128 KV heads x 128 dims
    assert kv_bytes_per_token(plain_mha, "bf16") == 2 * 61 * 128 * 128 * 2 == 3_997_696
    gqa8 = plain_mha.replace(num_kv_heads=8)  # the seed's "8 KV heads"
    assert kv_bytes_per_token(gqa8, "bf16") == 2 * 61 * 8 * 128 * 2 == 249_856
    assert round(expanded / 70_272, 1) == 71.1 and round(3_997_696 / 70_272, 1) == 56.9
    assert round(249_856 / 70_272, 2) == 3.56


def test_deepseek_v2_presets_cache_576_values_per_layer():
    v2, lite = get_preset("deepseek-v2"), get_preset("deepseek-v2-lite")
    assert (v2.attention_kind, lite.attention_kind) == ("MLA", "MLA")
    assert kv_bytes_per_token(v2, "bf16") == 60 * (512 + 64) * 2  # 69,120 B
    assert kv_bytes_per_token(lite, "bf16") == 27 * (512 + 64) * 2  # 31,104 B
    # Lite has no query compression: each of its 16 heads projects 2048 -> 192 directly
    h = 2048
    attn = (h * 16 * 192                              # queries (no q_lora_rank)
            + h * 576 + 512 + 512 * 16 * 256          # latent + RoPE key down, latent norm, up to K and V
            + 16 * 128 * h)                           # output
    expert = 3 * h * 1408
    total = 27 * attn + 3 * h * 10944 + 26 * (66 * expert + 64 * h) + (2 * 27 + 1) * h + 2 * 102400 * h
    assert param_count(lite)["total"] == total  # 15.71B: the model card's 15.7B
    assert abs(param_count(v2)["total"] / 236e9 - 1) < 0.002  # 235.7B
    assert abs(param_count(v2, active=True)["total"] / 21e9 - 1) < 0.02  # 21.4B active


# --- "0.5 MB per token" -------------------------------------------------------------------------------------

def test_half_a_mebibyte_per_token(capsys):
    shape = ModelShape("32x32x128", num_layers=32, num_kv_heads=32, head_dim=128)
    assert kv_bytes_per_token(shape, "fp16") == 2 * 32 * 32 * 128 * 2 == MiB // 2  # exactly 0.5 MiB
    assert kv_bytes_per_token(get_preset("llama2-7b"), "fp16") == MiB // 2  # which is Llama-2 7B
    rc, _, rep = run_cli(capsys, "memory", "--layers", "32", "--kv-heads", "32", "--head-dim", "128",
                         "--prompt-len", "1", "--output-len", "0", "--json")
    assert rc == 0 and rep["kv_cache_bytes"] == MiB // 2 and rep["weights_bytes"] is None


# --- FLOPs: the per-layer formulas --------------------------------------------------------------------------

# a tiny shape so every number below can be checked with a pencil
TINY = ModelShape("tiny", num_layers=2, hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4,
                  intermediate_size=16, vocab_size=10)
TINY_PROJ = 2 * 8 * (2 + 2 * 1) * 4 + 2 * 2 * 4 * 8  # q,k,v: 2 H (Hq + 2 Hkv) D; o: 2 Hq D H  -> 384
TINY_MLP = 2 * 3 * 8 * 16  # SwiGLU: gate, up, down -> 768
TINY_KEY = 2 * 2 * 4  # per attended key: 2 Hq D for scores, the same for weighted V -> 16
TINY_HEAD = 2 * 8 * 10  # lm_head: 2 H V -> 160


def test_layer_flops_by_hand():
    # 3 new tokens after 5 cached: token i sees 5 + i + 1 keys -> 6 + 7 + 8 = 21 keys
    f = layer_flops(TINY, 0, num_tokens=3, past=5)
    assert f == {"projections": 3 * TINY_PROJ, "scores": 21 * TINY_KEY, "weighted_v": 21 * TINY_KEY,
                 "mlp": 3 * TINY_MLP, "total": 3 * (TINY_PROJ + TINY_MLP) + 2 * 21 * TINY_KEY}
    # a dense masked implementation (step 1's causal_attention) scores the whole 3 x 8 block
    assert layer_flops(TINY, 0, 3, 5, dense_mask=True)["scores"] == 3 * 8 * TINY_KEY


def test_generation_flops_by_hand():
    # prompt 3, 4 new tokens, 2 layers. With the cache: prefill 3 tokens (keys 1+2+3 = 6), then decode
    # at contexts 4, 5, 6 (keys 4+5+6 = 15); every pass makes one row of logits.
    layer_token = TINY_PROJ + TINY_MLP
    cached = 2 * ((3 + 3) * layer_token + (6 + 15) * 2 * TINY_KEY) + 4 * TINY_HEAD
    assert generation_flops(TINY, 3, 4, cache=True) == cached == 15808
    # Without: passes over 3, 4, 5, 6 tokens; keys 6 + 10 + 15 + 21 = 52
    uncached = 2 * ((3 + 4 + 5 + 6) * layer_token + 52 * 2 * TINY_KEY) + 4 * TINY_HEAD
    assert generation_flops(TINY, 3, 4, cache=False) == uncached == 45440
    assert cache_speedup(TINY, 3, 4) == uncached / cached


def test_matmul_flops_are_twice_the_weights():
    """Two independent formulas agree: a token's projections + MLP do 2 FLOPs per weight it touches."""
    for name in ("llama2-7b", "llama3-8b", "smollm2-135m", "deepseek-7b", "deepseek-v3", "deepseek-v2-lite"):
        shape = get_preset(name)
        p = param_count(shape, active=True)
        # MLA's attention parameters include two RMSNorm scales per layer (q_a, kv_a), which do no matmul
        norms = shape.num_layers * (shape.q_lora_rank + shape.kv_lora_rank)
        # MLA: W_UK and W_UV run once per token in both forms (absorbed into the query and applied to the
        # output at decode, or expanding the token's K and V at prefill), so both touch every weight once
        for f in (decode_flops(shape, 1), recompute_flops(shape, 1)):
            assert f["projections"] + f["mlp"] == 2 * (p["attention"] - norms + p["mlp"]), name
            assert f["lm_head"] == 2 * shape.vocab_size * shape.hidden_size


def test_deepseek_v3_flops_by_hand():
    v3 = get_preset("deepseek-v3")
    h, hq, r, dr, dn, dv, qr = 7168, 128, 512, 64, 128, 128, 1536
    proj = (2 * h * qr + 2 * qr * hq * (dn + dr)  # query: down to 1536, up to 128 heads x 192
            + 2 * h * (r + dr)                    # down to the cached latent and the RoPE key
            + 2 * hq * dn * r                     # absorb W_UK: query into latent space
            + 2 * hq * r * dv                     # absorb W_UV: latent result up to V
            + 2 * hq * dv * h)                    # output projection
    moe = (8 + 1) * 2 * 3 * h * 2048 + 2 * h * 256  # 8 routed + 1 shared SwiGLU expert, router
    dense = 2 * 3 * h * 18432
    f = decode_flops(v3, 1000)
    assert f["projections"] == 61 * proj
    assert f["scores"] == 61 * 2 * hq * (r + dr) * 1000
    assert f["weighted_v"] == 61 * 2 * hq * r * 1000
    assert f["mlp"] == 3 * dense + 58 * moe


# --- MLA: decode absorbed, prefill and no-cache recompute expanded ------------------------------------

# a pencil-sized MLA shape: R = 6, P = 2, Dn = 3, Dv = 4, 2 heads, hidden 8, no query compression
TINY_MLA = ModelShape("tiny-mla", num_layers=2, hidden_size=8, num_heads=2, head_dim=3, rope_dim=2, v_head_dim=4,
                      kv_lora_rank=6, intermediate_size=16, vocab_size=10)
MLA_BASE = 2 * 8 * 2 * (3 + 2) + 2 * 8 * (6 + 2) + 2 * 2 * 4 * 8  # q 160, down to latent + RoPE key 128, o 128
MLA_UP = 2 * 2 * 6 * (3 + 4)  # one pass through W_UK and W_UV for both heads: 2 Hq R (Dn + Dv) = 168
MLA_EXP_SCORE, MLA_EXP_V = 2 * 2 * (3 + 2), 2 * 2 * 4  # per key, expanded: 2 Hq (Dn + dr), 2 Hq Dv
MLA_ABS_SCORE, MLA_ABS_V = 2 * 2 * (6 + 2), 2 * 2 * 6  # per key, absorbed: 2 Hq (r + dr), 2 Hq R


def test_mla_decode_is_absorbed_by_hand():
    # one token after 5 cached sees 6 latent rows; W_UK folds into its query and W_UV maps its result
    f = layer_flops(TINY_MLA, 0, num_tokens=1, past=5)
    assert f == {"projections": MLA_BASE + MLA_UP, "scores": 6 * MLA_ABS_SCORE, "weighted_v": 6 * MLA_ABS_V,
                 "mlp": 2 * 3 * 8 * 16, "total": MLA_BASE + MLA_UP + 6 * (32 + 24) + 768}


def test_mla_prefill_is_expanded_by_hand():
    # 4 tokens, nothing cached: each token's K and V are built once, keys 1 + 2 + 3 + 4 = 10 at per-head dims
    f = layer_flops(TINY_MLA, 0, num_tokens=4, past=0)
    assert f["projections"] == 4 * (MLA_BASE + MLA_UP)
    assert (f["scores"], f["weighted_v"]) == (10 * MLA_EXP_SCORE, 10 * MLA_EXP_V) == (200, 160)
    # a prefill chunk of 3 after 5 cached: its own 1 + 2 + 3 = 6 keys expanded, the 3 x 5 = 15 cached ones
    # absorbed (as minikv.mla.latent.latent_attention runs it); the 3 queries also pay W_UK / W_UV for the absorbed part
    f = layer_flops(TINY_MLA, 0, num_tokens=3, past=5)
    assert f["projections"] == 3 * MLA_BASE + 3 * MLA_UP + 3 * MLA_UP
    assert f["scores"] == 6 * MLA_EXP_SCORE + 15 * MLA_ABS_SCORE
    assert f["weighted_v"] == 6 * MLA_EXP_V + 15 * MLA_ABS_V
    # forced forms: expanded rebuilds all 6 rows for one decode token; absorbed scores a prefill's 10 keys as latents
    f = layer_flops(TINY_MLA, 0, 1, 5, mla_form="expanded")
    assert (f["projections"], f["scores"]) == (MLA_BASE + 6 * MLA_UP, 6 * MLA_EXP_SCORE)
    f = layer_flops(TINY_MLA, 0, 4, 0, mla_form="absorbed")
    assert (f["projections"], f["scores"], f["weighted_v"]) == (4 * (MLA_BASE + MLA_UP), 10 * 32, 10 * 24)
    with pytest.raises(InvalidInputError, match="mla_form"):
        forward_flops(TINY_MLA, 4, mla_form="latent")


def test_mla_recompute_and_generation_by_hand():
    # without a cache every pass is a prefill, expanded even for one token; with it, a 1-token pass is absorbed
    assert recompute_flops(TINY_MLA, 1)["scores"] == 2 * MLA_EXP_SCORE  # 2 layers x 1 key
    assert decode_flops(TINY_MLA, 1)["scores"] == 2 * MLA_ABS_SCORE
    layer_token = MLA_BASE + MLA_UP + 2 * 3 * 8 * 16
    exp_key, abs_key = MLA_EXP_SCORE + MLA_EXP_V, MLA_ABS_SCORE + MLA_ABS_V  # 36, 56
    # prompt 3, 4 new tokens: prefill 3 (keys 6, expanded), decode at contexts 4, 5, 6 (keys 15, absorbed)
    cached = 2 * ((3 + 3) * layer_token + 6 * exp_key + 15 * abs_key) + 4 * 2 * 8 * 10
    assert generation_flops(TINY_MLA, 3, 4, cache=True) == cached == 18976
    # no cache: passes over 3, 4, 5, 6 tokens, keys 6 + 10 + 15 + 21 = 52, all expanded
    uncached = 2 * ((3 + 4 + 5 + 6) * layer_token + 52 * exp_key) + 4 * 2 * 8 * 10
    assert generation_flops(TINY_MLA, 3, 4, cache=False) == uncached == 53056


def test_deepseek_v3_prefill_attention_is_expanded():
    v3 = get_preset("deepseek-v3")
    hq, r, dr, dn, dv, n = 128, 512, 64, 128, 128, 4096
    keys = n * (n + 1) // 2
    f = recompute_flops(v3, n)
    assert f["scores"] == 61 * 2 * hq * (dn + dr) * keys
    assert f["weighted_v"] == 61 * 2 * hq * dv * keys
    # the absorbed count, which the no-cache column used before: (576 + 512) / (192 + 128) = 3.4x the attention
    a = forward_flops(v3, n, mla_form="absorbed")
    assert a["scores"] == 61 * 2 * hq * (r + dr) * keys
    ratio = Fraction(a["scores"] + a["weighted_v"], f["scores"] + f["weighted_v"])
    assert ratio == Fraction(1088, 320) == Fraction(17, 5)  # 3.4x
    assert a["projections"] == f["projections"]  # W_UK / W_UV once per token either way


def test_deepseek_v3_params_match_the_published_671b():
    v3 = get_preset("deepseek-v3")
    h, hq = 7168, 128
    attn = (h * 1536 + 1536 + 1536 * hq * 192      # query down, its norm, up
            + h * 576 + 512 + 512 * hq * 256       # latent + RoPE key down, latent norm, up to K and V
            + hq * 128 * h)                        # output
    expert = 3 * h * 2048
    total = (61 * attn + 3 * 3 * h * 18432 + 58 * (257 * expert + 256 * h)
             + (2 * 61 + 1) * h + 2 * 129280 * h)
    active = total - 58 * (256 - 8) * expert
    assert param_count(v3)["total"] == total
    assert param_count(v3, active=True)["total"] == active
    assert abs(total / 671e9 - 1) < 0.001 and abs(active / 37e9 - 1) < 0.02  # 671B total, 37B active


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_match_their_published_size_and_cite_a_source(name):
    shape = get_preset(name)
    assert shape.source and shape.published_params
    assert abs(param_count(shape)["total"] / shape.published_params - 1) < 0.05  # nominal sizes ("7B")


def test_exact_param_counts_of_llama_shapes():
    def llama(layers, h, kv, inter, vocab, tied):  # q, o: h^2; k, v: h x kv x 128; MLP 3 h I; 2 norms
        return layers * (2 * h * h + 2 * h * kv * 128 + 3 * h * inter + 2 * h) + (1 if tied else 2) * vocab * h + h
    assert param_count(get_preset("llama2-7b"))["total"] == llama(32, 4096, 32, 11008, 32000, False)
    assert param_count(get_preset("llama3-8b"))["total"] == llama(32, 4096, 8, 14336, 128256, False)
    smol = 30 * (2 * 576 * 576 + 2 * 576 * 3 * 64 + 3 * 576 * 1536 + 2 * 576) + 49152 * 576 + 576
    assert param_count(get_preset("smollm2-135m"))["total"] == smol == 134_515_008


def test_param_count_matches_a_real_model():
    model = random_model(num_layers=3, hidden_size=20, num_heads=4, num_kv_heads=2, head_dim=6,
                         intermediate_size=30, vocab_size=37)
    w = model.weights
    arrays = [w.embed, w.final_norm] + [a for lw in w.layers for a in vars(lw).values() if a is not None]
    assert param_count(shape_from_config(model.config))["total"] == sum(a.size for a in arrays)


# --- "without a cache, 1000 tokens cost 1000x a step" and O(N^2) -> O(N) ---------------------------------------

def test_thousand_tokens_cost_about_500x_not_1000x():
    smol = get_preset("smollm2-135m")
    token = 30 * (2 * 576 * (9 + 2 * 3) * 64 + 2 * 9 * 64 * 576 + 2 * 3 * 576 * 1536)  # per token, all layers
    key = 30 * 2 * (2 * 9 * 64)  # per attended key, all layers
    head = 2 * 576 * 49152
    n = 1000  # prompt of 1 token, 1000 new tokens
    # with the cache: the prompt pass, then 999 one-token steps at contexts 2..1000: 1000 tokens, 1+2+..+1000 keys
    cached = n * token + (n * (n + 1) // 2) * key + n * head
    # without: passes over 1, 2, ..., 1000 tokens, each re-attending causally: sum of m(m+1)/2
    uncached = (n * (n + 1) // 2) * token + (n * (n + 1) * (n + 2) // 6) * key + n * head
    assert generation_flops(smol, 1, n, cache=True) == cached
    assert generation_flops(smol, 1, n, cache=False) == uncached
    # the matmul part alone would be exactly 500.5x; the lm_head, paid once per new token either way,
    # pulls the whole down to ~390x for this small-hidden, big-vocabulary model
    assert 300 < uncached / cached < (n + 1) / 2
    # the *last* step is what costs ~1000x: 1000 tokens rerun vs 1; attention 500,500 keys vs 1000
    last = recompute_flops(smol, n)["total"] / decode_flops(smol, n)["total"]
    assert 700 < last < n


def test_what_is_quadratic_and_what_is_linear():
    """Per step, the cache removes the O(t) matmul work; attention stays O(t) per step, O(n^2) in total."""
    smol = get_preset("smollm2-135m")
    key = 30 * 2 * (2 * 9 * 64)
    step = [decode_flops(smol, c)["total"] for c in range(1, 50)]
    # with a cache a step is affine in the context: each extra key adds the same `key` FLOPs
    assert set(np.diff(step)) == {key}
    rerun = [recompute_flops(smol, c)["total"] for c in range(1, 50)]
    # without it, step t reruns t tokens and t(t+1)/2 attention pairs: quadratic, constant 2nd difference
    assert set(np.diff(rerun, 2)) == {key}
    token = 30 * (2 * 576 * 15 * 64 + 2 * 9 * 64 * 576 + 2 * 3 * 576 * 1536)
    assert set(np.diff(rerun)) == {token + key * c for c in range(2, 50)}


def test_decode_is_memory_bound_and_prefill_is_not():
    smol = get_preset("smollm2-135m")
    token = 30 * (2 * 576 * 15 * 64 + 2 * 9 * 64 * 576 + 2 * 3 * 576 * 1536)
    key, head = 30 * 2 * 2 * 9 * 64, 2 * 576 * 49152
    weights = 2 * 134_515_008  # fp16
    # one decode step at context 1: FLOPs over bytes of weights + that one token's K/V
    assert arithmetic_intensity(smol, 1, 0) == (token + key + head) / (weights + 2 * 30 * 3 * 64 * 2)
    assert arithmetic_intensity(smol, 1, 0) < 1.01  # ~1 FLOP per byte
    # a 1024-token prefill reuses every weight 1024 times
    flops = 1024 * token + (1024 * 1025 // 2) * key + head
    assert arithmetic_intensity(smol, 1024, 0) == flops / (weights + 1024 * 2 * 30 * 3 * 64 * 2)
    assert arithmetic_intensity(smol, 1024, 0) > 300
    # batching decode raises intensity: 64 sequences share one read of the weights ...
    kv_token = 2 * 30 * 3 * 64 * 2
    assert arithmetic_intensity(smol, 1, 0, batch=64) == 64 * (token + key + head) / (weights + 64 * kv_token)
    assert arithmetic_intensity(smol, 1, 0, batch=64) > 60
    # ... but each sequence still reads its own K/V: at 512 tokens of context, 64 caches outweigh the weights
    assert 64 * 512 * kv_token > weights
    assert arithmetic_intensity(smol, 1, 511, batch=64) < 20


# --- quantized caches ----------------------------------------------------------------------------------------

def test_int8_halves_the_cache_only_without_scales():
    smol = get_preset("smollm2-135m")
    fp16 = kv_bytes_per_token(smol, "fp16")
    assert kv_bytes_per_token(smol, "int8") * 2 == fp16 == 2 * 30 * 3 * 64 * 2
    # one fp16 scale per 64 values: 1 + 2/64 bytes per value, 51.6% of fp16
    values = 2 * 30 * 3 * 64
    assert kv_bytes_per_token(smol, "int8", group_size=64) == values + (values // 64) * 2
    assert Fraction(kv_bytes_per_token(smol, "int8", group_size=64), fp16) == Fraction(33, 64)
    # int4 with an fp16 scale and zero point (4 bytes) per 32 values: 0.5 + 4/32 bytes per value
    assert kv_bytes_per_token(smol, "int4", group_size=32, scale_bytes=4) == values // 2 + (values // 32) * 4
    # a group size that does not divide head_dim still needs a scale for the partial group
    assert kv_bytes_per_token(smol, "int8", group_size=48) == values + (2 * 30 * 3) * math.ceil(64 / 48) * 2


def test_mla_groups_are_counted_per_cached_vector():
    dsv3 = get_preset("deepseek-v3")
    # the 512-value latent has 8 groups of 64, the 64-value RoPE key 1
    assert kv_bytes_per_token(dsv3, "fp8", group_size=64) == 61 * (576 + (8 + 1) * 2)


# --- errors --------------------------------------------------------------------------------------------------

def test_bad_inputs_raise_typed_errors(capsys):
    smol = get_preset("smollm2-135m")
    with pytest.raises(ConfigError, match="unknown preset 'gpt5'"):
        get_preset("gpt5")
    with pytest.raises(ConfigError, match="quantized"):
        kv_cache_bytes(smol, 1, 10, 0, "fp16", group_size=64)
    with pytest.raises(InvalidInputError, match="batch=0"):
        kv_cache_bytes(smol, 0, 10)
    with pytest.raises(InvalidInputError, match="prompt_len=-1"):
        kv_cache_bytes(smol, 1, -1)
    with pytest.raises(ConfigError, match="multiple of num_kv_heads=4"):
        ModelShape("bad", num_layers=2, num_heads=6, num_kv_heads=4, head_dim=8)
    with pytest.raises(ConfigError, match="hidden_size"):  # the library names fields; the CLI names flags
        param_count(ModelShape("kv only", num_layers=2, num_kv_heads=2, head_dim=8))
    with pytest.raises(InvalidInputError, match="layer=2"):
        layer_flops(TINY, 2)
    with pytest.raises(InvalidInputError, match="logits"):
        forward_flops(TINY, 2, logits="some")
    rc, out, _ = run_cli(capsys, "memory")  # neither a preset nor a shape
    assert rc == 2 and "ConfigError" in out and "--preset" in out
    rc, out, _ = run_cli(capsys, "memory", "--preset", "smollm2-135m", "--batch", "0")
    assert rc == 2 and "batch=0" in out


def test_cli_custom_shape_overrides_a_preset(capsys):
    rc, out, rep = run_cli(capsys, "memory", "--preset", "deepseek-v3", "--kv-lora-rank", "0", "--rope-dim", "0",
                           "--kv-heads", "8", "--prompt-len", "65536", "--output-len", "0", "--json")
    assert rc == 0 and "modified" in rep["model"]
    assert rep["kv_cache_bytes"] == 61 * 8 * 512 * (32 * 1024) * 2  # the seed's product, now a GQA-8 model
    rc, out, rep = run_cli(capsys, "memory", "--preset", "llama2-7b", "--list-presets")
    assert rc == 0 and all(name in out for name in PRESETS) and rep is None


def test_cli_custom_mla_shape(capsys):
    rc, out, rep = run_cli(capsys, "memory", "--layers", "61", "--kv-lora-rank", "512", "--rope-dim", "64",
                           "--prompt-len", "1000", "--output-len", "24", "--dtype", "bf16", "--json")
    assert rc == 0 and rep["attention"] == "MLA"
    assert rep["kv_cache_bytes"] == 61 * (512 + 64) * 2 * (1000 + 24)


def test_numpy_integers_become_python_ints():
    """Sizes from NumPy arrays are accepted, and the arithmetic stays in exact Python ints."""
    shape = ModelShape("np", num_layers=np.int32(2), num_kv_heads=np.int64(2), head_dim=np.int16(8),
                       hidden_size=32, num_heads=4, intermediate_size=40, vocab_size=50)
    assert type(shape.num_layers) is int and type(shape.head_dim) is int
    flops = generation_flops(shape, np.int64(7), np.int64(5), cache=False)
    assert type(flops) is int and flops == generation_flops(shape, 7, 5, cache=False)
    assert type(kv_cache_bytes(shape, np.int64(3), np.int64(9))) is int


@pytest.mark.model
def test_smollm2_preset_matches_the_real_model(smollm2):
    model, _ = smollm2
    smol = get_preset("smollm2-135m")
    loaded = shape_from_config(model.config, name=smol.name)
    for field in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size", "intermediate_size",
                  "vocab_size", "tie_embeddings"):
        assert getattr(loaded, field) == getattr(smol, field), field
    w = model.weights
    arrays = [w.embed, w.final_norm] + [a for lw in w.layers for a in vars(lw).values() if a is not None]
    arrays += [] if w.lm_head is None else [w.lm_head]
    assert sum(a.size for a in arrays) == param_count(smol)["total"]


# --- minikv memory --kv-dtype: the formula with scales equals minikv.quant's bytes ---------------


@pytest.mark.parametrize("preset", ["smollm2-135m", "llama3-8b"])
@pytest.mark.parametrize("group", [32, 64])
def test_kv_dtype_bytes_equal_the_quantized_cache(preset, group):
    from minikv.costs import KV_DTYPE_COSTS, get_preset, kv_dtype_bytes_per_token
    from minikv.quant import KV_DTYPES, is_kivi, kv_bytes_per_token

    assert set(KV_DTYPE_COSTS) == set(KV_DTYPES)
    s = get_preset(preset)
    for kv_dtype in KV_DTYPES:
        block = 128 if is_kivi(kv_dtype) else 16  # kivi's block is the residual R
        want = kv_bytes_per_token(kv_dtype, s.num_layers, s.num_kv_heads, s.head_dim, block, group)
        assert kv_dtype_bytes_per_token(s, kv_dtype, group) == want, kv_dtype


def test_kv_dtype_on_the_command_line(capsys):
    assert main(["memory", "--preset", "smollm2-135m", "--prompt-len", "100", "--output-len", "28",
                 "--kv-dtype", "kivi2", "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    r = json.loads(out[-1])
    assert r["kv_dtype"] == "kivi2" and r["kv_dtype_bytes_per_token"] == 30 * 3 * 2 * (16 + 2 * 4)
    assert r["kv_dtype_cache_bytes"] == 128 * r["kv_dtype_bytes_per_token"]
    assert "int2 + a 4-byte scale per 32 values" in out[-2]
    assert main(["memory", "--preset", "deepseek-v2-lite", "--kv-dtype", "int8"]) == 2
    assert "MLA latent cache is not quantized" in capsys.readouterr().err
