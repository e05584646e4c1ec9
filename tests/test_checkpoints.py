"""Hugging Face checkpoints (minikv.weights.checkpoints): tiny random models saved by transformers load and match it.

The reference tests build a ``DeepseekV3ForCausalLM`` (dense) or a ``LlamaForCausalLM`` from a
config with a fixed seed, save it with ``save_pretrained`` into a temporary directory, load it
in minikv and compare teacher-forced logits at every position (float32, 1e-4 relative, eager
attention in transformers) through the uncached model and both caches, then 8 greedy tokens.
The bad-checkpoint tests write their directories with NumPy and need neither torch nor transformers.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from minikv.bench.equivalence import assert_close, rel_err
from minikv.errors import ModelFileNotFoundError, ModelFormatError
from minikv.generate import generate, make_cache
from minikv.weights.checkpoints import load_checkpoint

VOCAB, PROMPT, NEW = 97, 11, 8
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64, mscale=1.0,
            mscale_all_dim=0.8, beta_fast=32, beta_slow=1)
DEEPSEEK = {"plain": {}, "q-lora": dict(q_lora_rank=6), "half-rope": dict(rope_interleave=False),
            "yarn": dict(rope_parameters=YARN), "bias": dict(attention_bias=True, q_lora_rank=6),
            "tied": dict(tie_word_embeddings=True)}
LLAMA = {"gqa": {}, "tied": dict(tie_word_embeddings=True), "mha-sharded": dict(num_key_value_heads=4),
         "bf16": {}}


def _randomize(model, torch) -> None:
    """Weights of O(1) effect (transformers' 0.02 init makes attention nearly uniform): seeded."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, p.shape[1] ** -0.5)
            else:  # norms near 1, biases O(1)
                p.copy_(1.0 + 0.1 * torch.randn_like(p))


def _deepseek(transformers, torch, **overrides):
    base = dict(vocab_size=VOCAB, hidden_size=40, intermediate_size=52, moe_intermediate_size=8,
                num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=3, kv_lora_rank=11, q_lora_rank=None,
                qk_rope_head_dim=4, qk_nope_head_dim=5, v_head_dim=7, n_routed_experts=4, n_group=1, topk_group=1,
                num_experts_per_tok=2, first_k_dense_replace=2,  # >= num_hidden_layers: every layer is dense
                max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=None, bos_token_id=None)
    cfg = transformers.DeepseekV3Config(**{**base, **overrides})
    return transformers.DeepseekV3ForCausalLM(cfg)


def _llama(transformers, torch, **overrides):
    base = dict(vocab_size=VOCAB, hidden_size=36, intermediate_size=50, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=6, max_position_embeddings=256, tie_word_embeddings=False,
                rope_parameters=dict(rope_type="default", rope_theta=5000.0), eos_token_id=None, bos_token_id=None)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**base, **overrides}))


def _saved(require, tmp_path, build, name, overrides):
    """(transformers model in float32 eager mode, checkpoint dir) for one variant."""
    torch, transformers = require("torch"), require("transformers")
    torch.manual_seed(0)
    model = build(transformers, torch, **overrides)
    _randomize(model, torch)
    path = tmp_path / name
    if name == "bf16":
        model.to(torch.bfloat16).save_pretrained(path)
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # bf16-rounded weights
    else:
        model.save_pretrained(path, **({"max_shard_size": "20KB"} if "sharded" in name else {}))
    model.config._attn_implementation = "eager"
    return model.eval(), path


def _hf_logits(torch, model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def _check_against_transformers(require, hf, path) -> float:
    torch = require("torch")
    model = load_checkpoint(path)
    ids = np.random.default_rng(5).integers(0, VOCAB, PROMPT).tolist()
    want = _hf_logits(torch, hf, ids)
    worst = assert_close(model.logits(ids), want, np.float32, what="uncached logits")
    for kind in ("contiguous", "paged"):
        cache = make_cache(kind, model, max_len=PROMPT + NEW, block_size=3)
        cache.add_sequence(0)
        got = [model.forward([ids[:4]], cache, all_logits=True)]  # a prefill, then teacher-forced decode steps
        got += [model.forward([[t]], cache) for t in ids[4:]]
        worst = max(worst, assert_close(np.concatenate(got), want, np.float32, what=f"{kind} logits"))
    greedy = list(ids)
    for _ in range(NEW):
        greedy.append(int(np.argmax(_hf_logits(torch, hf, greedy)[-1])))
    for kind in ("contiguous", "paged"):
        assert generate(model, ids, NEW, cache=kind, block_size=3).token_ids == greedy[PROMPT:], kind
    return worst


@pytest.mark.reference
@pytest.mark.parametrize("variant", sorted(DEEPSEEK))
def test_deepseek_v3_checkpoint_matches_transformers(require, tmp_path, variant):
    hf, path = _saved(require, tmp_path, _deepseek, variant, DEEPSEEK[variant])
    _check_against_transformers(require, hf, path)
    assert load_checkpoint(path).config.mla is not None


@pytest.mark.reference
@pytest.mark.parametrize("variant", sorted(LLAMA))
def test_llama_checkpoint_matches_transformers(require, tmp_path, variant):
    hf, path = _saved(require, tmp_path, _llama, variant, LLAMA[variant])
    if "sharded" in variant:
        assert (path / "model.safetensors.index.json").is_file()
    _check_against_transformers(require, hf, path)


@pytest.mark.reference
def test_the_logit_comparison_can_fail(require, tmp_path):
    """A wrong RoPE layout or a dropped YaRN scale must show in the logits (only logit tests catch them)."""
    hf, path = _saved(require, tmp_path, _deepseek, "yarn", DEEPSEEK["yarn"])
    ids = np.random.default_rng(5).integers(0, VOCAB, PROMPT).tolist()
    want = _hf_logits(require("torch"), hf, ids)
    cfg = json.loads((path / "config.json").read_text())
    for broken in (dict(rope_interleave=False), dict(rope_parameters=dict(rope_type="default", rope_theta=1e4))):
        (path / "config.json").write_text(json.dumps({**cfg, **broken}))
        assert rel_err(load_checkpoint(path).logits(ids), want) > 1e-3, broken


# --- bad checkpoints: each its typed error, naming what is wrong ---------------------------------------

def _numpy_llama(path, drop: str | None = None, reshape: str | None = None, **config):
    """A valid tiny LlamaForCausalLM directory written with NumPy (then broken on request)."""
    from safetensors.numpy import save_file

    h, i, heads, kv, d, v = 8, 12, 2, 1, 4, 10
    cfg = {**dict(architectures=["LlamaForCausalLM"], vocab_size=v, hidden_size=h, intermediate_size=i,
                  num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv, head_dim=d,
                  tie_word_embeddings=True), **config}
    p = "model.layers.0"
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), f"{p}.input_layernorm.weight": (h,),
              f"{p}.post_attention_layernorm.weight": (h,), f"{p}.self_attn.q_proj.weight": (heads * d, h),
              f"{p}.self_attn.k_proj.weight": (kv * d, h), f"{p}.self_attn.v_proj.weight": (kv * d, h),
              f"{p}.self_attn.o_proj.weight": (h, heads * d), f"{p}.mlp.gate_proj.weight": (i, h),
              f"{p}.mlp.up_proj.weight": (i, h), f"{p}.mlp.down_proj.weight": (h, i)}
    if reshape:
        shapes[reshape] = (shapes[reshape][0] + 1,) + shapes[reshape][1:]
    tensors = {k: np.ones(s, dtype=np.float32) for k, s in shapes.items() if k != drop}
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def test_a_valid_numpy_checkpoint_loads(tmp_path):
    model = load_checkpoint(_numpy_llama(tmp_path / "ok"), dtype=np.float64)
    assert model.config.rope_layout == "half" and model.logits([1, 2, 3]).dtype == np.float64


@pytest.mark.parametrize("bad, message", [
    (dict(drop="model.layers.0.self_attn.k_proj.weight"), "model.layers.0.self_attn.k_proj.weight"),
    (dict(reshape="model.layers.0.mlp.up_proj.weight"), "model.layers.0.mlp.up_proj.weight"),
    (dict(architectures=["MixtralForCausalLM"]), "MixtralForCausalLM"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(rope_parameters=dict(rope_type="longrope", rope_theta=5e5, factor=8.0)), "longrope"),
    (dict(rope_parameters=dict(rope_type="llama3", rope_theta=5e5, factor=8.0)), "low_freq_factor"),
])
def test_bad_checkpoints_raise_model_format_error_naming_the_problem(tmp_path, bad, message):
    with pytest.raises(ModelFormatError, match=message):
        load_checkpoint(_numpy_llama(tmp_path / "bad", **bad))


def test_a_moe_deepseek_config_with_another_routing_is_refused_naming_it(tmp_path):
    """MoE layers load (tests/test_families.py); a routing rule minikv does not implement is refused."""
    cfg = dict(architectures=["DeepseekV3ForCausalLM"], vocab_size=10, hidden_size=8, intermediate_size=12,
               num_hidden_layers=4, num_attention_heads=2, kv_lora_rank=4, q_lora_rank=None, qk_rope_head_dim=2,
               qk_nope_head_dim=2, v_head_dim=2, n_routed_experts=8, first_k_dense_replace=1,
               moe_intermediate_size=4, num_experts_per_tok=2, topk_method="greedy")
    tmp_path.joinpath("config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFormatError, match=r"topk_method='greedy'"):
        load_checkpoint(tmp_path)


def test_missing_directories_and_config_json_raise_model_file_not_found(tmp_path):
    with pytest.raises(ModelFileNotFoundError, match="does not exist"):
        load_checkpoint(tmp_path / "nowhere")
    with pytest.raises(ModelFileNotFoundError, match="config.json"):
        load_checkpoint(tmp_path)
    tmp_path.joinpath("config.json").write_text(json.dumps(dict(architectures=["LlamaForCausalLM"], vocab_size=4,
                                                                hidden_size=4, intermediate_size=4,
                                                                num_hidden_layers=1, num_attention_heads=1)))
    with pytest.raises(ModelFileNotFoundError, match="safetensors"):
        load_checkpoint(tmp_path)
