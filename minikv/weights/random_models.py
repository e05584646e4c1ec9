"""Tiny models with random weights, for fast tests (odd sizes welcome): Llama-style GQA, DeepSeek MLA, Gemma-3.

Weights are drawn with std 1/sqrt(fan_in) so activations stay O(1) through the layers; the
(tied) embedding too, so the logits come out O(1) and the next-token distribution is spread
out rather than one-hot. The same seed gives the same weights.
"""

from __future__ import annotations

import numpy as np

from minikv.mla.block import MLALayerWeights
from minikv.mla.latent import MLAConfig
from minikv.model import LayerWeights, Model, ModelConfig, ModelWeights
from minikv.weights.gemma import gemma3_layer_types


class _Draw:
    """The random source: ``mat(fan_in, fan_out)`` and ``norm(n)`` (RMSNorm weights near 1)."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def mat(self, fan_in: int, fan_out: int) -> np.ndarray:
        return self.rng.standard_normal((fan_in, fan_out)) / np.sqrt(fan_in)

    def norm(self, n: int) -> np.ndarray:
        return 1.0 + 0.1 * self.rng.standard_normal(n)


def random_model(num_layers: int = 2, hidden_size: int = 48, num_heads: int = 6, num_kv_heads: int = 2,
                 head_dim: int = 8, intermediate_size: int = 80, vocab_size: int = 101,
                 rope_layout: str = "half", rope_theta: float = 10000.0, max_position: int = 512,
                 seed: int = 0, dtype=np.float32) -> Model:
    """A tiny Llama-style model (GQA, RoPE of ``rope_layout``, SwiGLU) with random weights."""
    cfg = ModelConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                      num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                      rope_theta=rope_theta, rope_layout=rope_layout, max_position=max_position,
                      eos_token_id=vocab_size - 1)
    return Model(cfg, _gqa_weights(cfg, _Draw(seed)), dtype=dtype)


def _gqa_weights(c: ModelConfig, r: _Draw) -> ModelWeights:
    """Random weights for a GQA ``ModelConfig``, with the QK-norm and sandwich norms it asks for."""
    h, i, d = c.hidden_size, c.intermediate_size, c.head_dim

    def layer() -> LayerWeights:
        extra = dict(q_norm=r.norm(d), k_norm=r.norm(d)) if c.qk_norm else {}
        if c.sandwich_norms:
            extra.update(post_attn_norm=r.norm(h), post_mlp_norm=r.norm(h))
        return LayerWeights(attn_norm=r.norm(h), wq=r.mat(h, c.num_heads * d), wk=r.mat(h, c.num_kv_heads * d),
                            wv=r.mat(h, c.num_kv_heads * d), wo=r.mat(c.num_heads * d, h), mlp_norm=r.norm(h),
                            w_gate=r.mat(h, i), w_up=r.mat(h, i), w_down=r.mat(i, h), **extra)

    layers = [layer() for _ in range(c.num_layers)]
    return ModelWeights(embed=r.rng.standard_normal((c.vocab_size, h)) / np.sqrt(h), layers=layers,
                        final_norm=r.norm(h))


def random_gemma_model(num_layers: int = 5, hidden_size: int = 45, num_heads: int = 3, num_kv_heads: int = 1,
                       head_dim: int = 10, intermediate_size: int = 58, vocab_size: int = 97, sliding_window: int = 5,
                       pattern: int = 3, query_pre_attn_scalar: float = 13.0, max_position: int = 512, seed: int = 0,
                       dtype=np.float32) -> Model:
    """A tiny Gemma-3-style hybrid with random weights: layer i is full iff (i + 1) % ``pattern`` == 0, the others
    slide over ``sliding_window`` keys; QK-norm, sandwich norms, GeGLU, the sqrt(H) embedding scale, RoPE bases
    10,000 (sliding) and 1,000,000 (full), and an attention scale 1/sqrt(``query_pre_attn_scalar``) != 1/sqrt(D)."""
    cfg = ModelConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                      num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                      rope_theta=1_000_000.0, max_position=max_position, eos_token_id=vocab_size - 1,
                      layer_types=gemma3_layer_types(num_layers, pattern), sliding_window=sliding_window,
                      sliding_rope_theta=10_000.0, hidden_act="gelu_pytorch_tanh", qk_norm=True, sandwich_norms=True,
                      embed_scale=hidden_size ** 0.5, query_pre_attn_scalar=query_pre_attn_scalar, rms_eps=1e-6)
    return Model(cfg, _gqa_weights(cfg, _Draw(seed)), dtype=dtype)


def default_mla(**overrides) -> MLAConfig:
    """An odd-sized MLA geometry: R=11, Dn=5, P=4, Dv=7 (v_head_dim differs from qk_nope on purpose)."""
    return MLAConfig(**{**dict(kv_lora_rank=11, qk_nope_head_dim=5, qk_rope_head_dim=4, v_head_dim=7), **overrides})


def random_mla_model(mla: MLAConfig | None = None, num_layers: int = 2, hidden_size: int = 36, num_heads: int = 3,
                     intermediate_size: int = 50, vocab_size: int = 97, rope_theta: float = 10000.0,
                     max_position: int = 512, seed: int = 0, dtype=np.float32) -> Model:
    """A tiny DeepSeek-style MLA model (dense SwiGLU MLP) with random weights; ``mla`` default ``default_mla()``."""
    m = default_mla() if mla is None else mla
    cfg = ModelConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                      num_layers=num_layers, num_heads=num_heads, num_kv_heads=1, head_dim=m.latent_dim,
                      rope_theta=rope_theta, max_position=max_position, eos_token_id=vocab_size - 1, mla=m)
    r = _Draw(seed)
    h, i, hq, qk = hidden_size, intermediate_size, num_heads, m.qk_head_dim

    def layer() -> MLALayerWeights:
        q = (dict(wq=r.mat(h, hq * qk)) if m.q_lora_rank is None else
             dict(wq_a=r.mat(h, m.q_lora_rank), q_a_norm=r.norm(m.q_lora_rank), wq_b=r.mat(m.q_lora_rank, hq * qk)))
        return MLALayerWeights(attn_norm=r.norm(h), wkv_a=r.mat(h, m.latent_dim), kv_a_norm=r.norm(m.kv_lora_rank),
                               wkv_b=r.mat(m.kv_lora_rank, hq * (m.qk_nope_head_dim + m.v_head_dim)),
                               wo=r.mat(hq * m.v_head_dim, h), mlp_norm=r.norm(h), w_gate=r.mat(h, i),
                               w_up=r.mat(h, i), w_down=r.mat(i, h), **q)

    layers = [layer() for _ in range(num_layers)]
    weights = ModelWeights(embed=r.rng.standard_normal((vocab_size, h)) / np.sqrt(h), layers=layers,
                           final_norm=r.norm(h))
    return Model(cfg, weights, dtype=dtype)
