"""``minikv compare``: the NumPy path and the GPU path token by token (here on the simulator)."""

import json

import numpy as np
import pytest

from minikv import cli
from minikv.weights.random_models import random_model
from minikv_gpu import compare as cmp


def tiny():
    return random_model(num_layers=2, hidden_size=40, num_heads=6, num_kv_heads=2, head_dim=16,
                        intermediate_size=48, vocab_size=300, rope_layout="interleaved", seed=2)


def run_cli(capsys, *argv):
    code = cli.main(["compare", *argv])
    out = capsys.readouterr().out.strip().splitlines()
    return code, out


@pytest.mark.model
def test_compare_smollm2_on_the_simulator(capsys, smollm2_path):
    """The issue's check: SmolLM2 on the simulator agrees with NumPy to <= 1e-3, same greedy tokens."""
    code, out = run_cli(capsys, "--model", str(smollm2_path), "--prompt", "The capital of France is",
                        "--max-new-tokens", "4", "--backend", "sim", "--json")
    summary = json.loads(out[-1])
    assert code == 0, out
    assert summary["backend"] == "sim" and summary["steps"] == 4
    assert summary["tokens_agree"] is True
    assert 0 < summary["max_abs_logit_diff"] <= 1e-3  # > 0: the two paths really are different code
    assert [s["kind"] for s in summary["per_step"]] == ["prefill", "decode", "decode", "decode"]
    assert any("max|Δlogit|" in line for line in out)  # the per-step table is printed


@pytest.mark.parametrize("cache,dtype,fused", [("contiguous", np.float32, False), ("contiguous", np.float16, True),
                                               ("none", np.float32, False)])
def test_compare_tiny_model(cache, dtype, fused):
    res = cmp.compare(tiny(), [5, 7, 11, 13], 4, backend="sim", cache=cache, cache_dtype=dtype, fused=fused)
    s = res.summary()
    assert s["steps"] == 4 and s["tokens_agree"]
    assert s["max_abs_logit_diff"] <= cmp.DEFAULT_TOL[np.dtype(dtype).name]
    assert [p["tokens"] for p in s["per_step"]] == ([4, 1, 1, 1] if cache == "contiguous" else [4, 5, 6, 7])


def test_compare_random_flag_uses_smollm2_shapes(capsys, monkeypatch):
    """--random builds SmolLM2's shapes (replaced here by a tiny model to keep CI fast) and feeds prompt bytes."""
    seen = {}

    def fake(seed):
        seen["seed"] = seed
        return tiny()
    monkeypatch.setattr(cmp, "smollm2_random", fake)
    code, out = run_cli(capsys, "--random", "--seed", "3", "--prompt", "Hi", "--max-new-tokens", "2",
                        "--backend", "sim", "--json")
    summary = json.loads(out[-1])
    assert code == 0 and seen == {"seed": 3}
    assert summary["prompt_tokens"] == 2 and summary["steps"] == 2


def test_smollm2_shapes_match_the_real_model():
    s = cmp.SMOLLM2_SHAPES
    assert (s["num_layers"], s["num_heads"], s["num_kv_heads"], s["head_dim"], s["hidden_size"],
            s["vocab_size"]) == (30, 9, 3, 64, 576, 49152)


def test_compare_errors(capsys):
    assert cli.main(["compare", "--random", "--model", "x.gguf", "--prompt", "Hi", "--backend", "sim"]) == 2
    assert "either --model" in capsys.readouterr().err
    from minikv.errors import ConfigError, InvalidInputError

    with pytest.raises(InvalidInputError, match="max_new_tokens"):
        cmp.compare(tiny(), [1], 0, backend="sim")
    with pytest.raises(InvalidInputError, match="no tokens"):
        cmp.compare(tiny(), [], 2, backend="sim")
    with pytest.raises(ConfigError, match="window"):
        cmp.compare(tiny(), [1], 2, backend="sim", cache="window")
