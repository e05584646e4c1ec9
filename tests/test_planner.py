"""The KV capacity planner (minikv.costs.planner) and ``minikv memory --model``.

Published numbers it must reproduce:
* vLLM RFC #11382 (https://github.com/vllm-project/vllm/issues/11382), for BLOCK_SIZE=1: "The memory
  waste can be 79.6% in mllama, 25% in Gemma-2, and 56.25% in Ministral" when every layer is sized
  as a full one. Gemma-2 (half the layers slide over 4096, context 8192) and Ministral-8B (one full
  layer per three sliding over 32k, context 128k) are reproduced here.
* DeepSeek-V2's paper (arXiv:2405.04434, section 2.1 and Table 1): MLA caches (d_c + d_h^R) elements
  per token and layer, 4.5 d_h with d_c = 4 d_h and d_h^R = d_h / 2; DeepSeek-V3 keeps d_c = 512,
  d_h^R = 64 (d_h = 128): 576 per layer.
* SmolLM2-135M's GGUF metadata: 30 layers x 2 x 3 KV heads x 64 = 11,520 values per token.
* Hugging Face's Llama 3.1 blog (https://huggingface.co/blog/llama31#inference-memory-requirements), its
  table of FP16 KV cache sizes at 1k, 16k and 128k tokens (quoted in https://github.com/huggingface/blog/issues/2345):
  8B and 70B reproduced; 405B's row is exactly twice what its config.json gives (the issue's finding).
* NVIDIA's "Mastering LLM Techniques: Inference Optimization"
  (https://developer.nvidia.com/blog/mastering-llm-techniques-inference-optimization/): "with a Llama 2 7B model
  in 16-bit precision and a batch size of 1, the size of the KV cache will be 1 * 4096 * 2 * 32 * 4096 * 2
  bytes, which is ~2 GB".
* Mistral 7B's paper (arXiv:2310.06825, section 2, Rolling Buffer Cache): "On a sequence length of 32k
  tokens, this reduces the cache memory usage by 8x".

No other preset's model card or paper states a KV size per token that we could find and verify: Qwen2.5-7B,
Qwen3-8B, Gemma-2-9B, Gemma-3-27B (its report's KV-overhead figure is for a 2B ablation model), gpt-oss-20b
and -120b (their model card gives none), Ministral-8B; their tests check the sizes against the config formula.
"""

from __future__ import annotations

import json

import pytest

from minikv.costs import PRESETS, kv_bytes_per_token
from minikv.costs.planner import PLANS, plan_from_config, plan_from_path
from minikv.errors import ModelFileNotFoundError, ModelFormatError


def test_rfc_11382_waste_of_all_full_sizing():
    assert PLANS["gemma-2-9b"].waste_of_all_full(8192) == pytest.approx(0.25, abs=1e-12)
    assert PLANS["ministral-8b"].waste_of_all_full(131072) == pytest.approx(0.5625, abs=1e-12)
    assert PLANS["llama-3.1-8b"].waste_of_all_full(131072) == 0  # no sliding layer, nothing wasted


def test_bytes_per_token_of_the_presets():
    per_token = {name: sum(v for _, v in p.layers) * 2 for name, p in PLANS.items()}  # bf16, every layer full
    assert per_token["llama-3.1-8b"] == 32 * 2 * 8 * 128 * 2 == 131072
    assert per_token["qwen2.5-7b"] == 28 * 2 * 4 * 128 * 2
    assert per_token["qwen3-8b"] == 36 * 2 * 8 * 128 * 2
    assert per_token["gemma-2-9b"] == 42 * 2 * 8 * 256 * 2
    assert per_token["gpt-oss-20b"] == 24 * 2 * 8 * 64 * 2
    assert {v for _, v in PLANS["deepseek-v3"].layers} == {int(4.5 * 128)}  # the paper's 4.5 d_h per layer
    assert [w for w, _ in PLANS["gemma-3-27b"].layers].count(None) == 62 // 6  # every 6th layer full
    assert {w for w, _ in PLANS["gpt-oss-120b"].layers} == {128, None}
    assert all(p.source for p in PLANS.values())


# https://huggingface.co/blog/llama31#inference-memory-requirements (FP16 KV cache, "GB" = 2^30 bytes; "1k" is 1024
# tokens, "16k" and "128k" are 16,000 and 128,000), as quoted in https://github.com/huggingface/blog/issues/2345
LLAMA31_BLOG = {"8B": {1024: "0.125", 16000: "1.95", 128000: "15.62"},
                "70B": {1024: "0.313", 16000: "4.88", 128000: "39.06"},
                "405B": {1024: "0.984", 16000: "15.38", 128000: "123.05"}}


def _as_printed(got_bytes: int, printed: str) -> bool:
    """``printed`` is ``got_bytes`` in GiB to its printed digits (within half a unit of the last one)."""
    digits = len(printed.split(".")[1])
    return abs(got_bytes / 2**30 - float(printed)) <= 0.5 * 10 ** -digits + 1e-12


def test_llama31_blog_kv_sizes():
    per_token = {"8B": sum(v for _, v in PLANS["llama-3.1-8b"].layers) * 2,  # the planner's preset, bf16
                 "70B": kv_bytes_per_token(PRESETS["llama3-70b"], "fp16"),
                 "405B": kv_bytes_per_token(PRESETS["llama3-405b"], "fp16")}
    assert per_token["8B"] == kv_bytes_per_token(PRESETS["llama3-8b"], "fp16") == 131072
    for model in ("8B", "70B"):
        for tokens, printed in LLAMA31_BLOG[model].items():
            assert _as_printed(tokens * per_token[model], printed), (model, tokens)
    # 405B: config.json's 8 KV heads give half the blog's row; 16 KV heads would give it (issue #2345)
    for tokens, printed in LLAMA31_BLOG["405B"].items():
        assert _as_printed(2 * tokens * per_token["405B"], printed) and not _as_printed(tokens * per_token["405B"],
                                                                                           printed)


def test_nvidia_blog_llama2_7b_two_gb_at_4096_tokens():
    """https://developer.nvidia.com/blog/mastering-llm-techniques-inference-optimization/ : Llama 2 7B, 16-bit,
    batch 1: "1 * 4096 * 2 * 32 * 4096 * 2 bytes, which is ~2 GB" (exactly 2 GiB)."""
    assert 4096 * kv_bytes_per_token(PRESETS["llama2-7b"], "fp16") == 1 * 4096 * 2 * 32 * 4096 * 2 == 2 * 2**30


def test_mistral_paper_rolling_buffer_saves_8x_at_32k():
    """arXiv:2310.06825 section 2: "On a sequence length of 32k tokens, this reduces the cache memory usage by 8x"."""
    plan = PLANS["mistral-7b-v0.1"]
    full, rolling = (plan.bytes_per_sequence(32768, 2, all_full=a) for a in (True, False))
    assert full == 8 * rolling


def test_block_rounding_and_the_two_capacity_answers():
    plan = PLANS["mistral-7b-v0.1"]  # every layer slides over 4096
    one = 32 * 2 * 8 * 128 * 2
    assert plan.bytes_per_sequence(10, 2, block_size=16) == 16 * one  # 10 tokens pay for a block of 16
    assert plan.bytes_per_sequence(8000, 2, block_size=16) == 4096 * one  # the window caps what is kept
    budget = 10 * plan.bytes_per_sequence(1000, 2, 16) + 5
    assert plan.max_sequences(budget, 1000, 2, 16) == 10
    gemma = PLANS["gemma-2-9b"]
    budget = 24 * 2**30
    c = gemma.max_context(budget, 3, 2, 16)
    assert 3 * gemma.bytes_per_sequence(c, 2, 16) <= budget < 3 * gemma.bytes_per_sequence(c + 1, 2, 16) \
        or c == gemma.max_position


def test_config_json_of_each_family(tmp_path):
    base = dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=3)
    assert [w for w, _ in plan_from_config({**base, "model_type": "gemma2"}).layers] == [3, None, 3, None]
    assert [w for w, _ in plan_from_config({**base, "use_sliding_window": False}).layers] == [None] * 4
    assert [w for w, _ in plan_from_config({**base, "model_type": "mistral"}).layers] == [3] * 4
    (tmp_path / "config.json").write_text(json.dumps({**base, "layer_types": ["full_attention"] * 4}))
    assert plan_from_path(tmp_path).layers == ((None, 32),) * 4
    with pytest.raises(ModelFormatError, match="num_hidden_layers"):
        plan_from_config({"num_attention_heads": 2})
    with pytest.raises(ModelFileNotFoundError, match="preset"):
        plan_from_path(tmp_path / "nowhere")


@pytest.mark.parametrize("use, first", [(True, 2), (True, 0), (False, 1), (None, 1)])
def test_qwen_sliding_layers_as_transformers_derives_them(require, use, first):
    """Qwen2/Qwen3 without layer_types: the planner and the loader slide layers max_window_layers .. L - 1 only
    when use_sliding_window is true (its default is false), as transformers' Qwen2Config derives them."""
    transformers = require("transformers")
    base = dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=3,
                max_window_layers=first, **({} if use is None else dict(use_sliding_window=use)))
    want = [3 if t == "sliding_attention" else None for t in transformers.Qwen2Config(**base).layer_types]
    for kind in ("qwen2", "qwen3"):
        assert [w for w, _ in plan_from_config({**base, "model_type": kind}).layers] == want, kind
    assert use is not True or want.count(None) == first
    with pytest.raises(ModelFormatError, match="max_window_layers"):
        plan_from_config({**base, "model_type": "qwen2", "use_sliding_window": True, "max_window_layers": "x"})


def test_gguf_metadata(require, tmp_path):
    """A metadata-only GGUF written with gguf's writer (SmolLM2-135M's attention numbers; reading the real
    file's 49k-token vocabulary would cost seconds for nothing)."""
    gguf = require("gguf")
    path = tmp_path / "smol.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("block_count", 30), ("attention.head_count", 9), ("attention.head_count_kv", 3),
                       ("embedding_length", 576), ("context_length", 8192)):
        w.add_uint32(f"llama.{key}", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    plan = plan_from_path(path)
    assert plan.layers == ((None, 2 * 3 * 64),) * 30 and plan.max_position == 8192


def test_cli_prints_and_json(capsys):
    from minikv.cli import main

    assert main(["memory", "--model", "gemma-2-9b", "--context", "8192", "--block-size", "1", "--json"]) == 0
    out = capsys.readouterr().out
    rep = json.loads(out.strip().splitlines()[-1])
    assert rep["waste_of_all_full"] == 0.25 and rep["layers"]["full"] == {"count": 21, "bytes_per_token": 8192}
    assert rep["max_sequences"] == 80 * 10**9 // rep["bytes_per_sequence"]
    assert main(["memory", "--model", "no/such/dir"]) == 2
    assert "ModelFileNotFoundError" in capsys.readouterr().err


# --- one table of names: the planner plans every minikv.costs preset, and a model's shapes live once ----------

def test_every_costs_preset_is_a_planner_preset_with_the_same_kv_bytes():
    from minikv.costs.hybrid import HYBRID_PRESETS, hybrid_kv_bytes
    from minikv.costs.planner import preset_names

    for name, shape in PRESETS.items():
        plan = plan_from_path(name)
        assert sum(v for _, v in plan.layers) * 2 == kv_bytes_per_token(shape, "fp16"), name
        assert plan.max_position == shape.max_context and plan.source  # (deepseek-v3: the planner cites MLA's paper)
    gemma, windows = HYBRID_PRESETS["gemma3-270m"]
    plan = plan_from_path("gemma3-270m")
    assert [w for w, _ in plan.layers] == list(windows) and plan.by_type(2) == {"sliding 512": (15, 1024),
                                                                                "full": (3, 1024)}
    assert plan.bytes_per_sequence(2048, 2, all_full=True) == hybrid_kv_bytes(gemma, windows, 2048, "bf16")[
        "all_full_bytes"]
    names = preset_names()
    assert len(names) == len(set(names)) and set(names) == {*PLANS, *PRESETS, *HYBRID_PRESETS}


def test_llama_31_8b_is_llama3_8b_shapes_with_its_own_context():
    # one model's shapes in one place: the planner's Llama 3.1 8B is minikv.costs' llama3-8b (Llama 3 8B) at 128k
    llama3, llama31 = plan_from_path("llama3-8b"), PLANS["llama-3.1-8b"]
    assert llama31.layers == llama3.layers and (llama3.max_position, llama31.max_position) == (8192, 131072)
    assert PLANS["deepseek-v3"].layers == plan_from_path("deepseek-v3").layers == ((None, 576),) * 61


def test_cli_lists_and_plans_every_preset(capsys):
    from minikv.cli import main
    from minikv.costs.planner import preset_names

    assert main(["memory", "--list-presets"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert sorted(listed) == sorted(preset_names())
    assert main(["memory", "--model", "llama3-70b", "--json"]) == 0  # a --preset name, planned
    rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rep["layers"] == {"full": {"count": 80, "bytes_per_token": 2 * 8 * 128 * 2}} and rep["context"] == 131072
