"""The `minikv` command on Hugging Face checkpoint directories (no tokenizer): --model DIR with --prompt-ids.

Checkpoints are tiny random LlamaForCausalLM / DeepseekV3ForCausalLM models saved with transformers'
``save_pretrained`` (the builders of tests/test_checkpoints.py), so these are ``reference`` tests.
"""

import json

import numpy as np
import pytest

from minikv.cli import main
from minikv.generate import generate
from minikv.perplexity import perplexity
from minikv.weights.checkpoints import load_checkpoint

pytestmark = pytest.mark.reference


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from tests.conftest import require_module
    from tests.test_checkpoints import _deepseek, _llama, _randomize

    torch, transformers = require_module("torch"), require_module("transformers")
    out = {}
    for name, build in (("deepseek", _deepseek), ("llama", _llama)):
        torch.manual_seed(0)
        model = build(transformers, torch)
        _randomize(model, torch)
        out[name] = tmp_path_factory.mktemp("ckpt") / name
        model.save_pretrained(out[name])
    return out


def last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("arch", ["deepseek", "llama"])
def test_generate_on_a_checkpoint_agrees_across_caches_and_with_the_library(capsys, checkpoints, arch):
    path, ids = checkpoints[arch], [1, 2, 3, 4, 5]
    want = generate(load_checkpoint(path), ids, 6, cache="contiguous").token_ids
    runs = {}
    for cache in ("none", "contiguous", "paged"):
        assert main(["generate", "--model", str(path), "--prompt-ids", "1,2,3,4,5", "--greedy",
                     "--max-new-tokens", "6", "--cache", cache, "--block-size", "3", "--json"]) == 0
        runs[cache] = last_json(capsys)
    assert all(r["token_ids"] == want for r in runs.values()), runs
    assert runs["contiguous"]["text"] is None  # a checkpoint has no tokenizer
    m = load_checkpoint(path).config
    if arch == "deepseek":  # the latent: (kv_lora_rank + qk_rope_head_dim) x layers x 4 bytes
        assert runs["paged"]["cache_bytes_per_token"] == (m.mla.kv_lora_rank + m.mla.qk_rope_head_dim) * 2 * 4
    else:
        assert runs["paged"]["cache_bytes_per_token"] == 2 * m.num_layers * m.num_kv_heads * m.head_dim * 4


def test_perplexity_on_a_checkpoint_equals_the_library_and_is_the_same_through_every_cache(capsys, checkpoints,
                                                                                          tmp_path):
    ids = np.random.default_rng(3).integers(0, 64, 24).tolist()
    f = tmp_path / "ids.txt"
    f.write_text(" ".join(map(str, ids[:12])) + ",\n" + ",".join(map(str, ids[12:])))
    want = perplexity(load_checkpoint(checkpoints["deepseek"]), ids, cache="contiguous")["mean_nll"]
    for cache in ("none", "contiguous", "paged"):
        assert main(["perplexity", "--model", str(checkpoints["deepseek"]), "--ids-file", str(f),
                     "--cache", cache, "--prefill", "5", "--json"]) == 0
        r = last_json(capsys)
        assert r["tokens"] == 24 and r["cache"] == cache
        assert abs(r["mean_nll"] - want) <= 1e-4 * abs(want), (cache, r["mean_nll"], want)


def test_text_flags_and_the_gpu_path_are_refused_on_a_checkpoint_with_one_line(capsys, checkpoints):
    cases = [(["generate", "--prompt", "hi"], "--prompt-ids"),
             (["compare", "--prompt-ids", "1,2,3", "--backend", "sim"], "kv_lora_rank=11"),  # R, P not x8
             (["generate", "--prompt-ids", "1,99999"], "99999")]
    for argv, says in cases:
        argv = argv[:1] + ["--model", str(checkpoints["deepseek"])] + argv[1:]
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and says in err and "Traceback" not in err, (argv, err)


@pytest.mark.parametrize("cache", ["contiguous", "paged", "none"])
def test_compare_on_an_mla_checkpoint_agrees_with_numpy(capsys, tmp_path, cache):
    """minikv compare on a DeepSeek-V3 checkpoint whose latent sizes the GPU kernel serves (R=16, P=8):
    the simulator's GPU path gives the NumPy greedy tokens, max |dlogit| <= 1e-3."""
    from tests.conftest import require_module
    from tests.test_checkpoints import _deepseek, _randomize

    torch, transformers = require_module("torch"), require_module("transformers")
    torch.manual_seed(0)
    model = _deepseek(transformers, torch, kv_lora_rank=16, qk_rope_head_dim=8)
    _randomize(model, torch)
    model.save_pretrained(tmp_path / "deepseek16")
    assert main(["compare", "--model", str(tmp_path / "deepseek16"), "--prompt-ids", "1,2,3,4,5", "--backend", "sim",
                 "--max-new-tokens", "4", "--cache", cache, "--block-size", "3", "--json"]) == 0
    r = last_json(capsys)
    assert r["tokens_agree"] and r["steps"] == 4 and r["cache"] == cache, r
    assert r["max_abs_logit_diff"] <= 1e-3, r
