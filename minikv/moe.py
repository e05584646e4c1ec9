"""A mixture-of-experts MLP in plain NumPy: a router picks k experts per token, their outputs are summed.

The MLP half of a decoder layer, and nothing more: it never sees the KV cache (the cache stores
attention's K and V; an MoE layer changes only what each token's hidden state becomes). Per token::

    logits = x @ W_router^T (+ b)              [E]        one score per expert
    chosen, weights = route(logits)            [k], [k]   the family's routing rule (below)
    y = sum_j weights[j] * expert[chosen[j]](x)  (+ shared expert(x))

An expert is a gated MLP like the dense one: ``down(act(x @ gate) * (x @ up))``.

The routing rules, each as the family defines it (transformers 5.24):

* ``"softmax_topk"`` (Mixtral, Qwen2-MoE, Qwen3-MoE): softmax over all E logits, keep the k largest
  probabilities, and (``norm_topk_prob``) divide them by their sum.
* ``"topk_softmax"`` (gpt-oss, ``GptOssTopKRouter``): keep the k largest logits (a router bias added
  first), softmax over those k only.
* ``"sigmoid_group"`` (DeepSeek-V3, ``DeepseekV3TopkRouter``): sigmoid scores; the choice adds a
  learned correction bias (a load-balancing term that never enters the weights); the E experts form
  ``n_group`` groups, each group scored by the sum of its two best corrected scores, only the
  ``topk_group`` best groups may be chosen; the weights are the uncorrected sigmoid scores of the k
  chosen, divided by their sum (``norm_topk_prob``), times ``routed_scaling_factor``. The router runs
  in float32 whatever the model's dtype (``router_dtype="float32"``: transformers' router casts both
  the hidden states and its weight to float32), so a float64 run routes as the reference does.

gpt-oss's experts differ from SwiGLU in three ways (``GptOssExperts._apply_gate``): gate and up are
interleaved columns of one matrix (``gate_up[..., ::2]``, ``gate_up[..., 1::2]``), both carry a bias,
and ``act = gate * sigmoid(alpha * gate)`` with gate clamped from above and up to [-limit, limit],
then ``(up + 1) * act``. That is ``activation="gpt_oss"``.

Shapes: N tokens, H hidden, E experts, I the expert width, k experts per token. Matrices are stored
[in, out] like the dense model's (``x @ W``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minikv.errors import ConfigError, ShapeError, check_choice, check_float, check_int
from minikv.layers import silu

ROUTERS = ("softmax_topk", "topk_softmax", "sigmoid_group")
EXPERT_ACTIVATIONS = ("silu", "gpt_oss")


@dataclass(frozen=True)
class MoEConfig:
    """How a family routes and what its experts compute (``ModelConfig.moe``; None: a dense MLP).

    num_experts (E), top_k (k), intermediate_size (I, one expert's width), router (a key of
    ``ROUTERS``), norm_topk_prob, routed_scaling_factor; n_group / topk_group (``sigmoid_group``
    only); shared_intermediate_size: the width of an always-on shared expert (0: none);
    activation "silu" (SwiGLU) or "gpt_oss" with ``swiglu_alpha`` and ``swiglu_limit``;
    router_dtype: the dtype the router computes in (None: the model's; DeepSeek-V3: "float32").
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    router: str = "softmax_topk"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    shared_intermediate_size: int = 0
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    router_dtype: str | None = None

    def __post_init__(self):
        check_int("num_experts", self.num_experts)
        check_int("intermediate_size", self.intermediate_size)
        check_int("top_k", self.top_k, maximum=self.num_experts, hint="experts per token, at most num_experts")
        check_choice("router", self.router, ROUTERS)
        check_choice("expert activation", self.activation, EXPERT_ACTIVATIONS)
        check_float("routed_scaling_factor", self.routed_scaling_factor)
        check_float("swiglu_alpha", self.swiglu_alpha)
        check_float("swiglu_limit", self.swiglu_limit)
        check_int("shared_intermediate_size", self.shared_intermediate_size, minimum=0)
        if self.router_dtype is not None:
            check_choice("router_dtype", self.router_dtype, ("float32", "float64"))
        check_int("n_group", self.n_group)
        check_int("topk_group", self.topk_group, maximum=self.n_group, hint="groups kept, at most n_group")
        if self.num_experts % self.n_group:
            raise ConfigError(f"num_experts={self.num_experts} is not a multiple of n_group={self.n_group}")
        if self.router == "sigmoid_group" and self.top_k > self.topk_group * (self.num_experts // self.n_group):
            raise ConfigError(f"top_k={self.top_k} experts cannot be chosen from topk_group={self.topk_group} "
                              f"groups of {self.num_experts // self.n_group}")


@dataclass
class MoEWeights:
    """One MoE layer's weights, [in, out] (transformers' names beside them).

    router:      [H, E]      gate.weight / router.weight (transposed)
    router_bias: [E] or None router.bias (gpt-oss) or e_score_correction_bias (DeepSeek-V3: the choice only)
    gate, up:    [E, H, I]   each expert's gate and up projections
    down:        [E, I, H]
    gate_bias, up_bias: [E, I] or None; down_bias: [E, H] or None (gpt-oss)
    shared_gate, shared_up: [H, Is], shared_down: [Is, H], or None (DeepSeek's shared experts)
    """

    router: np.ndarray
    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray
    router_bias: np.ndarray | None = None
    gate_bias: np.ndarray | None = None
    up_bias: np.ndarray | None = None
    down_bias: np.ndarray | None = None
    shared_gate: np.ndarray | None = None
    shared_up: np.ndarray | None = None
    shared_down: np.ndarray | None = None

    def check(self, hidden: int, moe: MoEConfig, where: str = "moe") -> None:
        """ShapeError naming the first weight whose shape does not fit ``moe`` and ``hidden``."""
        e, i, s = moe.num_experts, moe.intermediate_size, moe.shared_intermediate_size
        want = {"router": (hidden, e), "gate": (e, hidden, i), "up": (e, hidden, i), "down": (e, i, hidden),
                "router_bias": (e,), "gate_bias": (e, i), "up_bias": (e, i), "down_bias": (e, hidden),
                "shared_gate": (hidden, s), "shared_up": (hidden, s), "shared_down": (s, hidden)}
        required = {"router", "gate", "up", "down"} | ({"shared_gate", "shared_up", "shared_down"} if s else set())
        for name, shape in want.items():
            got = getattr(self, name)
            if got is None and name not in required:
                continue
            if got is None or got.shape != shape:
                raise ShapeError(f"{where}.{name}.shape={None if got is None else got.shape}, expected {shape} "
                                 f"({e} experts of width {i}, hidden {hidden})")


def route(logits: np.ndarray, moe: MoEConfig, bias: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The family's routing rule (module docstring): logits [N, E] -> (experts [N, k] int, weights [N, k])."""
    k = moe.top_k
    if moe.router == "topk_softmax":
        z = logits if bias is None else logits + bias
        chosen = np.argsort(-z, axis=-1, kind="stable")[:, :k]
        top = np.take_along_axis(z, chosen, axis=-1)
        w = np.exp(top - top.max(axis=-1, keepdims=True))
        return chosen, w / w.sum(axis=-1, keepdims=True)
    if moe.router == "softmax_topk":
        p = np.exp(logits - logits.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        chosen = np.argsort(-p, axis=-1, kind="stable")[:, :k]
        w = np.take_along_axis(p, chosen, axis=-1)
    else:  # sigmoid_group
        scores = 1 / (1 + np.exp(-logits))
        choice = scores if bias is None else scores + bias
        n, per = logits.shape[0], moe.num_experts // moe.n_group
        grouped = np.sort(choice.reshape(n, moe.n_group, per), axis=-1)
        group_score = grouped[..., -2:].sum(axis=-1) if per > 1 else grouped[..., -1]   # [N, n_group]
        keep = np.argsort(-group_score, axis=-1, kind="stable")[:, :moe.topk_group]
        allowed = np.zeros((n, moe.n_group), dtype=bool)
        np.put_along_axis(allowed, keep, True, axis=-1)
        choice = np.where(np.repeat(allowed, per, axis=-1), choice, -np.inf)
        chosen = np.argsort(-choice, axis=-1, kind="stable")[:, :k]
        w = np.take_along_axis(scores, chosen, axis=-1)
    if moe.norm_topk_prob:
        w = w / (w.sum(axis=-1, keepdims=True) + (1e-20 if moe.router == "sigmoid_group" else 0.0))
    return chosen, w * moe.routed_scaling_factor


def expert(x: np.ndarray, w: MoEWeights, e: int, moe: MoEConfig) -> np.ndarray:
    """Expert ``e`` on the rows x [M, H] -> [M, H]."""
    gate, up = x @ w.gate[e], x @ w.up[e]
    if w.gate_bias is not None:
        gate, up = gate + w.gate_bias[e], up + w.up_bias[e]
    if moe.activation == "gpt_oss":
        limit = x.dtype.type(moe.swiglu_limit)
        gate, up = np.minimum(gate, limit), np.clip(up, -limit, limit)
        h = (up + 1) * (gate / (1 + np.exp(-x.dtype.type(moe.swiglu_alpha) * gate)))
    else:
        h = silu(gate) * up
    out = h @ w.down[e]
    return out if w.down_bias is None else out + w.down_bias[e]


def moe_mlp(x: np.ndarray, w: MoEWeights, moe: MoEConfig) -> np.ndarray:
    """The MoE MLP of N tokens: x [N, H] -> [N, H] (module docstring). Each expert runs once, on the
    tokens that chose it; a token's outputs are summed with its routing weights."""
    xr, wr, br = x, w.router, w.router_bias
    if moe.router_dtype is not None:  # the family's routing precision (module docstring)
        dt = np.dtype(moe.router_dtype)
        xr, wr, br = x.astype(dt), wr.astype(dt), None if br is None else br.astype(dt)
    experts, weights = route(xr @ wr, moe, br)                          # [N, k], [N, k]
    out = np.zeros_like(x)
    for e in np.unique(experts):
        rows, slot = np.nonzero(experts == e)                              # the tokens that chose e
        out[rows] += weights[rows, slot, None].astype(x.dtype) * expert(x[rows], w, int(e), moe)
    if w.shared_gate is not None:
        out += (silu(x @ w.shared_gate) * (x @ w.shared_up)) @ w.shared_down
    return out
