"""Step 4, the layer: DeepSeek-V2/V3's attention block over a latent cache, and its weights.

``minikv.model`` runs this block in place of the GQA one when ``ModelConfig.mla`` is set: one
residual line of the decoder, the same contract as ``attention_block`` (x [N, H] in, what it adds
to the residual stream out). What differs is what reaches the cache::

    h = RMSNorm(x)
    a = h @ [W_q | W_kv_a]            (W_q: plain q_proj, or q_a_proj -> RMSNorm -> q_b_proj)
    c_kv = RMSNorm(a_kv[:r]);  k_pe = RoPE(a_kv[r:])           (one latent per token, all heads)
    cache.write(li, [c_kv ; k_pe], None)                        ([N, 1, Dl])
    out = cache.attend(li, [q_nope ; RoPE(q_pe)]) @ W_o          ([N, Hq, Dv] -> [N, H])

The weights (transformers' DeepseekV3 names beside them) are stored [in, out], as ``minikv.model``
stores the GQA ones, and prepared once (``MLALayer.prepare``) the same way: the first query
projection and ``kv_a_proj_with_mqa`` fused into one matrix, everything transposed to [out, in].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minikv.layers import apply_rope, rms_norm
from minikv.mla.latent import MLAConfig


@dataclass
class MLALayerWeights:
    """One MLA decoder layer (transformers' DeepseekV3 names on the right), matrices [in, out].

    The query comes from ``wq`` (q_lora_rank None) or from ``wq_a`` -> RMSNorm ``q_a_norm`` -> ``wq_b``.
    Biases (``attention_bias``) exist only where DeepSeek has them: q_a, kv_a and o.
    """

    attn_norm: np.ndarray               # [H]                 input_layernorm
    wkv_a: np.ndarray                   # [H, r + dr]          kv_a_proj_with_mqa
    kv_a_norm: np.ndarray               # [r]                 kv_a_layernorm
    wkv_b: np.ndarray                   # [r, Hq*(Dn + Dv)]   kv_b_proj
    wo: np.ndarray                      # [Hq*Dv, H]          o_proj
    mlp_norm: np.ndarray                # [H]                 post_attention_layernorm
    w_gate: np.ndarray                  # [H, I]
    w_up: np.ndarray                    # [H, I]
    w_down: np.ndarray                  # [I, H]
    wq: np.ndarray | None = None        # [H, Hq*(Dn + dr)]    q_proj
    wq_a: np.ndarray | None = None      # [H, Rq]             q_a_proj
    q_a_norm: np.ndarray | None = None  # [Rq]                q_a_layernorm
    wq_b: np.ndarray | None = None      # [Rq, Hq*(Dn + dr)]   q_b_proj
    bq_a: np.ndarray | None = None      # [Rq]
    bkv_a: np.ndarray | None = None     # [r + dr]
    bo: np.ndarray | None = None        # [H]


def mla_weight_shapes(hidden: int, intermediate: int, num_heads: int, m: MLAConfig) -> tuple[dict, dict]:
    """(required, bias) shapes of an ``MLALayerWeights`` under this geometry.

    In ``required`` a weight absent under ``m`` (the low-rank query path or the plain one) maps to
    None and must be None; the biases are optional (None or that shape).
    """
    h, i, hq = hidden, intermediate, num_heads
    rq, q_out = m.q_lora_rank, hq * m.qk_head_dim
    low_rank = rq is not None
    required = {"attn_norm": (h,), "wkv_a": (h, m.latent_dim), "kv_a_norm": (m.kv_lora_rank,),
                "wkv_b": (m.kv_lora_rank, hq * (m.qk_nope_head_dim + m.v_head_dim)), "wo": (hq * m.v_head_dim, h),
                "mlp_norm": (h,), "w_gate": (h, i), "w_up": (h, i), "w_down": (i, h),
                "wq": None if low_rank else (h, q_out), "wq_a": (h, rq) if low_rank else None,
                "q_a_norm": (rq,) if low_rank else None, "wq_b": (rq, q_out) if low_rank else None}
    return required, {"bq_a": (rq,), "bkv_a": (m.latent_dim,), "bo": (h,)}


@dataclass
class MLALayer:
    """An MLA layer prepared for speed, like ``minikv.model``'s GQA layer: the query's first projection
    (``q_proj`` or ``q_a_proj``) and ``kv_a_proj_with_mqa`` fused into ``wa_t``, everything [out, in]."""

    attn_norm: np.ndarray
    wa_t: np.ndarray                 # [Hq*(Dn+dr) + Dl, H] (plain q) or [Rq + Dl, H] (low-rank q)
    ba: np.ndarray | None            # its bias (zeros where DeepSeek has none), or None
    q_a_norm: np.ndarray | None      # [Rq]
    wq_b_t: np.ndarray | None        # [Hq*(Dn+dr), Rq]
    kv_a_norm: np.ndarray            # [r]
    wo_t: np.ndarray                 # [H, Hq*Dv]
    bo: np.ndarray | None            # [H]
    mlp_norm: np.ndarray
    w_gate_up_t: np.ndarray | None   # None: a mixture-of-experts layer (``moe``, see minikv.model.mlp_block)
    w_down_t: np.ndarray | None
    moe: object | None = None        # its ``minikv.moe.MoEWeights``

    @classmethod
    def prepare(cls, lw: MLALayerWeights, moe=None) -> "MLALayer":
        t = np.ascontiguousarray
        first = lw.wq if lw.wq is not None else lw.wq_a
        ba = None
        if lw.bq_a is not None or lw.bkv_a is not None:
            zeros = np.zeros_like
            ba = np.concatenate([zeros(first[0]) if lw.bq_a is None else lw.bq_a,
                                 zeros(lw.wkv_a[0]) if lw.bkv_a is None else lw.bkv_a])
        return cls(lw.attn_norm, t(np.concatenate([first, lw.wkv_a], axis=1).T), ba, lw.q_a_norm,
                   None if lw.wq_b is None else t(lw.wq_b.T), lw.kv_a_norm, t(lw.wo.T), lw.bo, lw.mlp_norm,
                   None if moe else t(np.concatenate([lw.w_gate, lw.w_up], axis=1).T),
                   None if moe else t(lw.w_down.T), moe)


def mla_attention_block(x: np.ndarray, lw: MLALayer, cfg, cache, li: int,
                        cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Layer ``li``'s MLA attention branch (DeepSeek-V2/V3), the same contract as ``attention_block``.

    x: [N, H]; cos, sin: [N, dr/2]; cfg: the model's ``ModelConfig`` (``cfg.mla`` set). The cache
    receives each token's latent ``[c_kv ; RoPE(k_pe)]`` ([N, 1, Dl]: normalised c_kv, rotated k_pe)
    and attends for the queries ``[q_nope ; RoPE(q_pe)]`` ([N, Hq, Dn + dr]), returning [N, Hq, Dv];
    returns [N, H] = that @ Wo (+ bias).
    """
    m, n, hq = cfg.mla, x.shape[0], cfg.num_heads
    dn, r, w = m.qk_nope_head_dim, m.kv_lora_rank, m.latent_dim
    h = rms_norm(x, lw.attn_norm, cfg.rms_eps)
    a = h @ lw.wa_t.T
    if lw.ba is not None:
        a = a + lw.ba
    q, kv_a = a[:, :-w], a[:, -w:]
    if lw.wq_b_t is not None:  # the low-rank query path: q_a -> RMSNorm -> q_b
        q = rms_norm(q, lw.q_a_norm, m.latent_eps) @ lw.wq_b_t.T
    q = q.reshape(n, hq, m.qk_head_dim)
    c_kv = rms_norm(kv_a[:, :r], lw.kv_a_norm, m.latent_eps)
    # decoupled RoPE: only the queries' last dr dims and the one shared k_pe rotate (in one go)
    rot = apply_rope(np.concatenate([q[:, :, dn:], kv_a[:, None, r:]], axis=1), cos, sin, m.rope_layout)
    cache.write(li, np.concatenate([c_kv, rot[:, hq]], axis=-1)[:, None], None)
    attn = cache.attend(li, np.concatenate([q[:, :, :dn], rot[:, :hq]], axis=-1))  # [N, Hq, Dv]
    out = attn.reshape(n, hq * m.v_head_dim) @ lw.wo_t.T
    return out if lw.bo is None else out + lw.bo
