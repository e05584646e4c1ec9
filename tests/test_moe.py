"""The mixture-of-experts MLP (minikv.moe) against transformers' own MoE blocks, and its routing rules by hand."""

import numpy as np
import pytest

from minikv.errors import ConfigError, ShapeError
from minikv.moe import MoEConfig, MoEWeights, moe_mlp, route

RTOL = 1e-10  # float64 on both sides


def torch_module(require, kind: str):
    """A tiny transformers MoE block with random weights (biases too), in float64."""
    torch = require("torch")
    require("transformers")
    from transformers import DeepseekV3Config, GptOssConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    torch.manual_seed(0)
    if kind == "gpt_oss":
        m = GptOssMLP(GptOssConfig(hidden_size=12, intermediate_size=6, num_local_experts=5, num_experts_per_tok=2))
    else:
        m = DeepseekV3MoE(DeepseekV3Config(hidden_size=12, moe_intermediate_size=6, n_routed_experts=8,
                                           num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1))
    m = m.double()
    with torch.no_grad():
        for p in list(m.parameters()) + list(m.buffers()):
            p.copy_(torch.randn_like(p) * (0.6 if p.ndim > 1 else 0.3))
    return torch, m


def from_gpt_oss(m) -> tuple[MoEConfig, MoEWeights]:
    """GptOssMLP's weights: gate and up are the even and odd columns of gate_up_proj [E, H, 2I]."""
    t = lambda p: p.detach().numpy()  # noqa: E731
    gu, gub = t(m.experts.gate_up_proj), t(m.experts.gate_up_proj_bias)
    cfg = MoEConfig(num_experts=gu.shape[0], top_k=m.router.top_k, intermediate_size=gu.shape[2] // 2,
                    router="topk_softmax", norm_topk_prob=False, activation="gpt_oss",
                    swiglu_alpha=m.experts.alpha, swiglu_limit=m.experts.limit)
    w = MoEWeights(router=t(m.router.weight).T, router_bias=t(m.router.bias), gate=gu[..., ::2], up=gu[..., 1::2],
                   down=t(m.experts.down_proj), gate_bias=gub[:, ::2], up_bias=gub[:, 1::2],
                   down_bias=t(m.experts.down_proj_bias))
    return cfg, w


def from_deepseek(m) -> tuple[MoEConfig, MoEWeights]:
    """DeepseekV3MoE's weights: gate_up_proj [E, 2I, H] (gate first), down_proj [E, H, I], one shared expert."""
    t = lambda p: p.detach().numpy()  # noqa: E731
    gu, g = t(m.experts.gate_up_proj), m.gate
    i = gu.shape[1] // 2
    cfg = MoEConfig(num_experts=gu.shape[0], top_k=g.top_k, intermediate_size=i, router="sigmoid_group",
                    norm_topk_prob=g.norm_topk_prob, routed_scaling_factor=g.routed_scaling_factor,
                    n_group=g.num_group, topk_group=g.topk_group, router_dtype="float32",
                    shared_intermediate_size=m.shared_experts.gate_proj.weight.shape[0])
    w = MoEWeights(router=t(g.weight).T, router_bias=t(g.e_score_correction_bias),
                   gate=gu[:, :i].transpose(0, 2, 1), up=gu[:, i:].transpose(0, 2, 1),
                   down=t(m.experts.down_proj).transpose(0, 2, 1),
                   shared_gate=t(m.shared_experts.gate_proj.weight).T, shared_up=t(m.shared_experts.up_proj.weight).T,
                   shared_down=t(m.shared_experts.down_proj.weight).T)
    return cfg, w


@pytest.mark.reference
@pytest.mark.parametrize("kind", ["gpt_oss", "deepseek"])
def test_moe_mlp_equals_transformers(require, kind):
    torch, m = torch_module(require, kind)
    cfg, w = (from_gpt_oss if kind == "gpt_oss" else from_deepseek)(m)
    w.check(12, cfg)
    x = np.random.default_rng(1).standard_normal((1, 17, 12))
    with torch.no_grad():
        want = m(torch.from_numpy(x))
    want = (want[0] if isinstance(want, tuple) else want).numpy()[0]
    got = moe_mlp(x[0], w, cfg)
    # DeepSeek routes in float32 on both sides (router_dtype); NumPy's float32 sigmoid and torch's can round an
    # ulp apart, so the routing weights agree to float32 precision and the rest to float64's
    rtol = 8 * np.finfo(np.float32).eps if cfg.router_dtype == "float32" else RTOL
    assert np.abs(got - want).max() <= rtol * np.abs(want).max()
    # a test must be able to fail: another routing rule gives another answer
    wrong = MoEConfig(**{**cfg.__dict__, "router": "softmax_topk", "n_group": 1, "topk_group": 1})
    assert np.abs(moe_mlp(x[0], w, wrong) - want).max() > 1e-3


def test_routing_rules_by_hand():
    logits = np.log(np.array([[0.1, 0.4, 0.2, 0.3]]))
    experts, w = route(logits, MoEConfig(4, 2, 3, router="softmax_topk"))
    assert experts.tolist() == [[1, 3]] and np.allclose(w, [[0.4 / 0.7, 0.3 / 0.7]])
    experts, w = route(logits, MoEConfig(4, 2, 3, router="softmax_topk", norm_topk_prob=False))
    assert np.allclose(w, [[0.4, 0.3]])
    experts, w = route(np.array([[1.0, 3.0, 2.0, 0.0]]), MoEConfig(4, 2, 3, router="topk_softmax"))
    assert experts.tolist() == [[1, 2]] and np.allclose(w, [[1 / (1 + np.exp(-1)), np.exp(-1) / (1 + np.exp(-1))]])


def test_group_limited_routing_never_leaves_its_groups():
    """DeepSeek: experts only come from the topk_group best groups, even when a higher score sits elsewhere."""
    cfg = MoEConfig(8, 2, 3, router="sigmoid_group", n_group=4, topk_group=1)
    # group 0 = experts 0, 1 (sum of its best two is highest), expert 7 alone scores highest
    logits = np.array([[2.0, 2.0, -5, -5, -5, -5, -5, 3.0]])
    experts, w = route(logits, cfg)
    assert sorted(experts[0].tolist()) == [0, 1] and np.isclose(w.sum(), 1.0)


def test_bad_configs_and_weights_are_typed_errors():
    with pytest.raises(ConfigError, match="top_k"):
        MoEConfig(4, 5, 3)
    with pytest.raises(ConfigError, match="n_group"):
        MoEConfig(6, 2, 3, router="sigmoid_group", n_group=4)
    with pytest.raises(ConfigError, match="router"):
        MoEConfig(4, 2, 3, router="hash")
    cfg = MoEConfig(4, 2, 3)
    rng = np.random.default_rng(0)
    w = MoEWeights(router=rng.standard_normal((5, 4)), gate=rng.standard_normal((4, 5, 3)),
                   up=rng.standard_normal((4, 5, 3)), down=rng.standard_normal((4, 3, 5)))
    w.check(5, cfg)
    with pytest.raises(ShapeError, match="layers.0.moe.down"):
        MoEWeights(w.router, w.gate, w.up, w.down[:3]).check(5, cfg, "layers.0.moe")
