"""The model families of minikv.weights.families against transformers: tiny random checkpoints, one dims set.

Each family's checkpoint is built by transformers from a config with a fixed seed (odd sizes: hidden 30,
6 query heads over 2 KV heads, head_dim 8, vocabulary 61), its weights drawn at O(1) effect, and saved
with ``save_pretrained``; minikv loads the directory and must give transformers' teacher-forced logits
(eager attention, float32, 1e-4 relative) uncached, through a contiguous and a paged cache (the hybrid
caches, contiguous and paged, for the families with sliding layers; blocks of 3 tokens, which divide
neither window), and the same greedy tokens. Sliding windows sit one below and one above the prompt
length, so a window both cuts and not.
Bad checkpoints (a missing tensor, a wrong shape, an expert count that does not match, an unsupported
option) are each a ModelFormatError naming the problem.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from minikv.bench.equivalence import assert_close, rel_err
from minikv.errors import ModelFormatError
from minikv.generate import generate, make_cache
from minikv.weights.checkpoints import load_checkpoint

VOCAB, PROMPT, NEW = 61, 9, 3
DIMS = dict(vocab_size=VOCAB, hidden_size=30, intermediate_size=22, num_hidden_layers=2, num_attention_heads=6,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=False,
            eos_token_id=None, bos_token_id=None, pad_token_id=None)
LLAMA3 = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=16)
FAMILIES = {  # name: (config class, model class, overrides)
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=10)),  # head_dim != hidden / heads
    # use_sliding_window: layers max_window_layers .. L - 1 slide (here layer 1 of 2)
    "qwen2-sw": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=PROMPT - 1,
                                                         max_window_layers=1)),
    "qwen3-sw": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=10, use_sliding_window=True,
                                                         sliding_window=PROMPT + 1, max_window_layers=1)),
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters=LLAMA3)),
    "mistral-w8": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=PROMPT - 1)),
    "mistral-w10": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=PROMPT + 1)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(sliding_window=PROMPT - 1, query_pre_attn_scalar=12,
                                                          attn_logit_softcapping=3.0, final_logit_softcapping=4.0,
                                                          tie_word_embeddings=True)),
    "gemma2-w10": ("Gemma2Config", "Gemma2ForCausalLM", dict(sliding_window=PROMPT + 1, query_pre_attn_scalar=12,
                                                              attn_logit_softcapping=3.0, final_logit_softcapping=4.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        sliding_window=PROMPT - 1, query_pre_attn_scalar=12, layer_types=["sliding_attention", "full_attention"],
        final_logit_softcapping=4.0, rope_parameters=dict(
            sliding_attention=dict(rope_type="default", rope_theta=100.0),
            full_attention=dict(rope_type="default", rope_theta=5000.0)))),
    "gemma3-w10": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(sliding_window=PROMPT + 1, sliding_window_pattern=2)),
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM", dict(sliding_window=PROMPT - 1, num_local_experts=4,
                                                           num_experts_per_tok=2)),
    "gpt-oss-w10": ("GptOssConfig", "GptOssForCausalLM", dict(sliding_window=PROMPT + 1, num_local_experts=4,
                                                               num_experts_per_tok=2)),
    "deepseek-moe": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        kv_lora_rank=11, q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=5, v_head_dim=7, head_dim=4,
        num_key_value_heads=6, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
        moe_intermediate_size=6, first_k_dense_replace=1, num_hidden_layers=3)),
}


def _randomize(model, torch) -> None:
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, p.shape[-2 if "experts" in name and p.dim() == 3 else -1] ** -0.5)
            else:  # norms near 1, biases, sinks and router corrections O(1)
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.1 * torch.randn_like(b))


@pytest.fixture(scope="module")
def saved(require, tmp_path_factory):
    """{family: (transformers model, checkpoint dir)}, built once for the module."""
    torch, transformers = require("torch"), require("transformers")
    out = {}

    def get(name):
        if name not in out:
            cfg_cls, model_cls, over = FAMILIES[name]
            torch.manual_seed(0)
            cfg = getattr(transformers, cfg_cls)(**{**DIMS, **over})
            model = getattr(transformers, model_cls)(cfg)
            _randomize(model, torch)
            path = tmp_path_factory.mktemp(name)
            model.save_pretrained(path)
            model.config._attn_implementation = "eager"
            model.config._experts_implementation = "eager"  # torch's grouped GEMM wants 16-byte strides
            out[name] = (model.eval(), path)
        return out[name]
    return get


def _hf_logits(torch, model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


@pytest.mark.reference
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_matches_transformers(require, saved, family):
    torch = require("torch")
    hf, path = saved(family)
    model = load_checkpoint(path)
    ids = np.random.default_rng(5).integers(0, VOCAB, PROMPT).tolist()
    want = _hf_logits(torch, hf, ids)
    assert_close(model.logits(ids), want, np.float32, what="uncached logits")
    kinds = ("contiguous", "paged")
    for kind in kinds:
        cache = make_cache(kind, model, max_len=PROMPT + NEW, block_size=3)
        cache.add_sequence(0)
        got = [model.forward([ids[:4]], cache, all_logits=True)]  # a prefill, then teacher-forced decode steps
        got += [model.forward([[t]], cache) for t in ids[4:]]
        assert_close(np.concatenate(got), want, np.float32, what=f"{kind} logits")
    greedy = list(ids)
    for _ in range(NEW):
        greedy.append(int(np.argmax(_hf_logits(torch, hf, greedy)[-1])))
    for kind in kinds:
        assert generate(model, ids, NEW, cache=kind, block_size=3).token_ids == greedy[PROMPT:], kind


@pytest.mark.reference
@pytest.mark.parametrize("family", ["gemma2", "gpt-oss", "gemma2-w10", "gemma3", "qwen2-sw"])
def test_float64_cached_equals_uncached(require, saved, family):
    _, path = saved(family)
    model = load_checkpoint(path, dtype=np.float64)
    ids = np.random.default_rng(6).integers(0, VOCAB, PROMPT + 2).tolist()
    for kind in ("contiguous", "paged"):
        cache = make_cache(kind, model, max_len=PROMPT + 2, block_size=3)
        cache.add_sequence(0)
        got = np.concatenate([model.forward([ids[:3]], cache, all_logits=True)] + [model.forward([[t]], cache)
                                                                                    for t in ids[3:]])
        assert_close(got, model.logits(ids), np.float64, what=f"{kind} hybrid cache")


@pytest.mark.reference
def test_each_option_shows_in_the_logits(require, saved):
    """A test must be able to fail: dropping a family's option moves the logits past the bar."""
    torch = require("torch")
    ids = np.random.default_rng(5).integers(0, VOCAB, PROMPT).tolist()
    for family, key, value in [("gemma2", "attn_logit_softcapping", None), ("gemma2", "final_logit_softcapping", None),
                               ("mistral-w8", "sliding_window", None), ("llama3", "rope_parameters",
                                                                        dict(rope_type="default", rope_theta=1e4))]:
        hf, path = saved(family)
        want = _hf_logits(torch, hf, ids)
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**cfg, key: value}))
        arch_ok = family != "llama3"  # a llama3-less Llama is read by checkpoints' plain Llama path
        try:
            assert rel_err(load_checkpoint(path).logits(ids), want) > 1e-3, (family, key)
        finally:
            (path / "config.json").write_text(json.dumps(cfg))
        assert arch_ok or load_checkpoint(path).config.rope_scaling is not None


@pytest.mark.reference
@pytest.mark.parametrize("family", ["gpt-oss", "gemma2"])
def test_cli_generates_with_the_paged_hybrid_cache(require, saved, capsys, family):
    """``minikv generate --cache paged`` on a model with sinks or soft-capping and sliding layers (it used to be
    refused: the paged sliding group took neither option) gives transformers' greedy tokens."""
    from minikv.cli import main

    torch = require("torch")
    hf, path = saved(family)
    ids = np.random.default_rng(8).integers(0, VOCAB, PROMPT).tolist()
    greedy = list(ids)
    for _ in range(NEW):
        greedy.append(int(np.argmax(_hf_logits(torch, hf, greedy)[-1])))
    assert main(["generate", "--model", str(path), "--prompt-ids", ",".join(map(str, ids)), "--greedy",
                 "--max-new-tokens", str(NEW), "--cache", "paged", "--block-size", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"] == greedy[PROMPT:]


@pytest.mark.reference
def test_qwen2_sliding_layers_from_max_window_layers(require, saved):
    """Older Qwen2 config.json files name no ``layer_types``: the sliding layers are those from
    ``max_window_layers`` on (transformers' ``Qwen2Config.__post_init__``), and they show in the logits."""
    torch = require("torch")
    hf, path = saved("qwen2-sw")
    ids = np.random.default_rng(5).integers(0, VOCAB, PROMPT).tolist()
    want = _hf_logits(torch, hf, ids)
    cfg = json.loads((path / "config.json").read_text())
    try:
        for over, windows in [(dict(layer_types=None), (None, PROMPT - 1)),
                              (dict(max_window_layers=0), (PROMPT - 1,) * 2),
                              (dict(use_sliding_window=False), (None, None))]:
            (path / "config.json").write_text(json.dumps({**cfg, **over, "layer_types": None}))
            model = load_checkpoint(path)
            assert model.config.layer_windows == windows, over
            if "layer_types" in over:
                assert_close(model.logits(ids), want, np.float32, what="layer types derived")
            else:
                assert rel_err(model.logits(ids), want) > 1e-3, over
    finally:
        (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.reference
def test_gemma2_softcaps_absent_take_the_class_defaults(require, saved):
    """Gemma2Config's defaults (50, 30) where config.json leaves the keys out; a JSON null turns a cap off."""
    transformers = require("transformers")
    _, path = saved("gemma2")
    cfg = json.loads((path / "config.json").read_text())
    want = transformers.Gemma2Config()
    try:
        absent = {k: v for k, v in cfg.items() if not k.endswith("_logit_softcapping")}
        for written, caps in [(absent, (want.attn_logit_softcapping, want.final_logit_softcapping)),
                              ({**cfg, "final_logit_softcapping": None}, (3.0, None))]:
            (path / "config.json").write_text(json.dumps(written))
            c = load_checkpoint(path).config
            assert (c.attn_softcap, c.final_softcap) == caps
    finally:
        (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.reference
@pytest.mark.parametrize("family, how", [("gpt-oss", "sharded"), ("gemma3", "bf16"), ("qwen2-sw", "bf16")])
def test_sharded_and_bf16_checkpoints(require, saved, tmp_path, family, how):
    """A family saved in shards of at most 20 KB (an index and several files; gpt-oss's fused experts span
    them), or in bfloat16 (read through the file's header), loads and gives transformers' logits; the bf16
    reference is transformers' own reload of the bf16 file in float32, so both sides see the rounded weights."""
    torch, transformers = require("torch"), require("transformers")
    hf, _ = saved(family)
    path = tmp_path / how
    if how == "bf16":
        copy.deepcopy(hf).to(torch.bfloat16).save_pretrained(path)
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                               attn_implementation="eager").eval()
        hf.config._experts_implementation = "eager"
        assert "BF16" in (path / "model.safetensors").read_bytes()[:4096].decode("latin-1")
    else:
        hf.save_pretrained(path, max_shard_size="20KB")
        assert len(list(path.glob("*.safetensors"))) > 2 and (path / "model.safetensors.index.json").is_file()
    ids = np.random.default_rng(7).integers(0, VOCAB, PROMPT).tolist()
    want = _hf_logits(torch, hf, ids)
    model = load_checkpoint(path)
    assert_close(model.logits(ids), want, np.float32, what=f"{how} {family}")
    cache = make_cache("paged", model, max_len=PROMPT, block_size=3)
    cache.add_sequence(0)
    assert_close(np.concatenate([model.forward([ids[:5]], cache, all_logits=True)] + [
        model.forward([[t]], cache) for t in ids[5:]]), want, np.float32, what=f"{how} {family}, paged")


# --- bad checkpoints ------------------------------------------------------------------------------


def _broken(path, tmp_path, name, drop=None, reshape=None, config=None):
    """A copy of a saved checkpoint with one tensor dropped or reshaped, or config.json changed."""
    from safetensors.numpy import load_file, save_file

    out = tmp_path / name
    out.mkdir()
    cfg = {**json.loads((path / "config.json").read_text()), **(config or {})}
    (out / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(path / "model.safetensors"))
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = np.concatenate([tensors[reshape]] * 2)  # one more row block (experts: twice as many)
    save_file(tensors, str(out / "model.safetensors"))
    return out


@pytest.mark.reference
@pytest.mark.parametrize("family, bad, message", [
    ("qwen2", dict(drop="model.layers.1.self_attn.k_proj.bias"), "model.layers.1.self_attn.k_proj.bias"),
    ("qwen3", dict(reshape="model.layers.0.self_attn.q_norm.weight"), "q_norm.weight' has shape"),
    ("gpt-oss", dict(drop="model.layers.0.self_attn.sinks"), "self_attn.sinks"),
    ("gpt-oss", dict(reshape="model.layers.1.mlp.experts.gate_up_proj"), "holds 8 experts; config.json says 4"),
    ("gpt-oss", dict(config=dict(num_local_experts=3)), "holds 4 experts; config.json says 3"),
    ("deepseek-moe", dict(config=dict(n_routed_experts=3, n_group=1)),
     "more experts than config.json's n_routed_experts=3"),
    ("qwen2", dict(config=dict(layer_types=["sliding_attention", "full_attention"])), "sliding_window"),
    ("gemma2", dict(config=dict(rope_parameters=dict(rope_type="linear", factor=2.0))), "rope_type 'linear'"),
    ("gemma3", dict(config=dict(attn_logit_softcapping=3.0)), "does not apply it"),
    ("gemma3", dict(config=dict(rope_parameters=dict(full_attention=dict(rope_type="linear", factor=8.0)))),
     "rope_type 'default' only"),
    ("qwen2", dict(config=dict(architectures=["Qwen2MoeForCausalLM"])), "Qwen2MoeForCausalLM"),
])
def test_bad_checkpoints_name_the_problem(require, saved, tmp_path, family, bad, message):
    _, path = saved(family)
    with pytest.raises(ModelFormatError, match=message):
        load_checkpoint(_broken(path, tmp_path, "bad", **bad))
