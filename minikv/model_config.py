"""The decoder's data: ``ModelConfig`` (the architecture, families' options as fields) and the weights.

Split from ``minikv.model`` (which re-exports every name here) so that the decoder file holds the
forward pass; a fact still lives once: the config, the weight layouts and their shape checks are here.
Shapes: H = hidden size, Hq/Hkv = query/KV heads, D = head_dim, I = MLP width, V = vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minikv.errors import ConfigError, ShapeError, check_choice, check_float, check_int
from minikv.hybrid.cache import check_layer_types, layer_windows
from minikv.layers import ACTIVATIONS, ROPE_LAYOUTS
from minikv.mla.block import MLALayerWeights, mla_weight_shapes
from minikv.mla.latent import MLAConfig
from minikv.moe import MoEConfig, MoEWeights


@dataclass(frozen=True)
class ModelConfig:
    """Everything that defines the architecture (one dataclass, nanoGPT style).

    rope_layout says how the two halves of each rotated pair sit in a head:
      * "interleaved": pairs are adjacent dims (0,1), (2,3), ... — GGUF/llama.cpp;
      * "half": pairs are (i, i + D/2) — transformers' ``rotate_half``.
    The two are the same model up to a permutation of the Q/K weight rows
    (``minikv.weights.gguf.permute_qk`` converts); mixing them up gives plausible but wrong text.

    mla: the MLA geometry of a DeepSeek-V2/V3 model (None: Llama GQA). Then num_kv_heads and
    head_dim describe what is cached, the absorbed form's geometry: MQA over one latent "head"
    of width r + dr, so num_kv_heads = 1 and head_dim = ``mla.latent_dim`` (the per-head
    query/key width Dn + dr is ``mla.qk_head_dim``). Caches and the scheduler check it unchanged.

    The per-layer and Gemma options (see the module docstring) default to a Llama:
    layer_types:           None (all "full_attention") or one of ``minikv.hybrid.LAYER_TYPES`` per layer
    sliding_window:        W, needed when a layer slides: its query t sees keys t - W + 1 .. t
    sliding_rope_theta:    RoPE base of the sliding layers (None: ``rope_theta``, which the full ones use)
    hidden_act:            the gated MLP's activation, a key of ``minikv.layers.ACTIVATIONS``
    qk_norm, sandwich_norms: the extra RMSNorms (their weights are then required, see ``LayerWeights``)
    embed_scale:           the embedding is multiplied by it (Gemma: sqrt(hidden_size))
    query_pre_attn_scalar: scores are q . k / sqrt(this) (None: head_dim)

    The options of the other families (issue 23; ``minikv.weights.families`` maps each config.json here):
    qkv_bias, o_bias:      biases on the Q/K/V projections (Qwen2, gpt-oss: added before RoPE, so the
                           cached key carries its bias) and on the output projection (gpt-oss)
    attn_softcap:          tanh soft-capping of the attention scores, per tile (Gemma 2; ``minikv.online_softmax``)
    final_softcap:         tanh soft-capping of the final logits (Gemma 2)
    sinks:                 a learned sink logit per query head in every layer (gpt-oss; ``LayerWeights.sinks``)
    rope_scaling:          scaled RoPE frequencies for every layer: ``minikv.layers.YarnConfig`` (gpt-oss) or
                           ``minikv.weights.families.Llama3Scaling`` (Llama 3.1+); anything with
                           ``inv_freq(head_dim, theta)`` and ``cos_sin_factor``
    moe, first_dense:      a mixture-of-experts MLP (``minikv.moe``) in layers ``first_dense`` .. L-1
                           (DeepSeek-V3's ``first_k_dense_replace``; gpt-oss: 0); None: every MLP dense
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_layout: str = "half"
    rms_eps: float = 1e-5
    max_position: int = 8192
    tie_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    mla: MLAConfig | None = None
    layer_types: tuple | None = None
    sliding_window: int | None = None
    sliding_rope_theta: float | None = None
    hidden_act: str = "silu"
    qk_norm: bool = False
    sandwich_norms: bool = False
    embed_scale: float = 1.0
    query_pre_attn_scalar: float | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    attn_softcap: float | None = None
    final_softcap: float | None = None
    sinks: bool = False
    rope_scaling: object | None = None
    moe: MoEConfig | None = None
    first_dense: int = 0

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position"):
            check_int(name, getattr(self, name))
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.mla is not None:
            if (self.num_kv_heads, self.head_dim) != (1, self.mla.latent_dim):
                raise ConfigError(f"an MLA model caches one latent head: num_kv_heads = 1, head_dim = kv_lora_rank + "
                                  f"qk_rope_head_dim = {self.mla.latent_dim}; got {(self.num_kv_heads, self.head_dim)}")
        elif self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even: RoPE rotates pairs of dimensions")
        check_choice("rope_layout", self.rope_layout, ROPE_LAYOUTS)
        check_choice("hidden_act", self.hidden_act, tuple(ACTIVATIONS))
        for name in ("rope_theta", "rms_eps", "embed_scale", "sliding_rope_theta", "query_pre_attn_scalar",
                     "attn_softcap", "final_softcap"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, check_float(name, getattr(self, name)))

        object.__setattr__(self, "layer_types", check_layer_types(self.layer_types, self.num_layers,
                                                                  self.sliding_window))
        if self.mla is not None and ("sliding_attention" in self.layer_types or self.qk_norm or self.sandwich_norms):
            raise ConfigError("an MLA model with sliding_attention layers, qk_norm or sandwich_norms: minikv's MLA "
                              "block has none of them (use full_attention layers and leave the two flags False)")
        if self.mla is not None and (self.qkv_bias or self.o_bias or self.attn_softcap or self.sinks):
            raise ConfigError("an MLA model with qkv_bias, o_bias, attn_softcap or sinks: minikv's MLA block has "
                              "none of them (its own biases come with the checkpoint, minikv.mla.block)")
        check_int("first_dense", self.first_dense, minimum=0, maximum=self.num_layers)

    def is_moe(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is the mixture of experts (``moe``) rather than the dense one."""
        return self.moe is not None and layer >= self.first_dense

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def layer_windows(self) -> tuple:
        """[L] each layer's window W, or None for a full-attention layer (what ``minikv.hybrid`` groups by)."""
        return layer_windows(self.layer_types, self.sliding_window)

    @property
    def rope_thetas(self) -> dict:
        """{layer type: RoPE base} for the layer types this model has."""
        sliding = self.rope_theta if self.sliding_rope_theta is None else self.sliding_rope_theta
        return {t: sliding if t == "sliding_attention" else self.rope_theta for t in dict.fromkeys(self.layer_types)}


@dataclass
class LayerWeights:
    """One decoder layer. Matrices are stored [in, out] so a layer computes ``x @ W``."""

    attn_norm: np.ndarray  # [H]
    wq: np.ndarray         # [H, Hq*D]
    wk: np.ndarray         # [H, Hkv*D]
    wv: np.ndarray         # [H, Hkv*D]
    wo: np.ndarray         # [Hq*D, H]
    mlp_norm: np.ndarray   # [H]
    w_gate: np.ndarray | None = None  # [H, I]  (None in a mixture-of-experts layer: ``ModelWeights.moe``)
    w_up: np.ndarray | None = None    # [H, I]
    w_down: np.ndarray | None = None  # [I, H]
    q_norm: np.ndarray | None = None          # [D] QK-norm (config.qk_norm), shared by every query head
    k_norm: np.ndarray | None = None          # [D] and by every key head
    post_attn_norm: np.ndarray | None = None  # [H] sandwich norms (config.sandwich_norms): on the attention
    post_mlp_norm: np.ndarray | None = None   # [H] and the MLP branch's output, before the residual add
    bq: np.ndarray | None = None              # [Hq*D]  config.qkv_bias
    bk: np.ndarray | None = None              # [Hkv*D]
    bv: np.ndarray | None = None              # [Hkv*D]
    bo: np.ndarray | None = None              # [H]     config.o_bias
    sinks: np.ndarray | None = None           # [Hq]    config.sinks: one learned sink logit per query head


@dataclass
class ModelWeights:
    embed: np.ndarray                   # [V, H]
    layers: list[LayerWeights]
    final_norm: np.ndarray              # [H]
    lm_head: np.ndarray | None = None   # [V, H]; None means tied to ``embed``
    moe: list | None = None             # [L] a ``minikv.moe.MoEWeights`` per mixture-of-experts layer, else None

    def astype(self, dtype) -> "ModelWeights":
        cast = lambda a: None if a is None else np.ascontiguousarray(a, dtype=dtype)  # noqa: E731
        return ModelWeights(
            embed=cast(self.embed),
            layers=[type(lw)(**{k: cast(v) for k, v in vars(lw).items()}) for lw in self.layers],
            final_norm=cast(self.final_norm),
            lm_head=cast(self.lm_head),
            moe=None if self.moe is None else [None if m is None else MoEWeights(
                **{k: cast(v) for k, v in vars(m).items()}) for m in self.moe],
        )


def expected_shapes(cfg: ModelConfig) -> dict:
    """The shape every layer weight must have under ``cfg`` (used to validate loaded files);
    optional weights absent under ``cfg`` map to None and must be None."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    if cfg.mla is not None:
        return mla_weight_shapes(h, i, cfg.num_heads, cfg.mla)[0]
    return {
        "attn_norm": (h,), "wq": (h, cfg.num_heads * d), "wk": (h, cfg.num_kv_heads * d),
        "wv": (h, cfg.num_kv_heads * d), "wo": (cfg.num_heads * d, h), "mlp_norm": (h,),
        "w_gate": (h, i), "w_up": (h, i), "w_down": (i, h),
        "q_norm": (d,) if cfg.qk_norm else None, "k_norm": (d,) if cfg.qk_norm else None,
        "post_attn_norm": (h,) if cfg.sandwich_norms else None, "post_mlp_norm": (h,) if cfg.sandwich_norms else None,
        "bq": (cfg.num_heads * d,) if cfg.qkv_bias else None, "bk": (cfg.num_kv_heads * d,) if cfg.qkv_bias else None,
        "bv": (cfg.num_kv_heads * d,) if cfg.qkv_bias else None, "bo": (h,) if cfg.o_bias else None,
        "sinks": (cfg.num_heads,) if cfg.sinks else None,
    }


def check_weights(cfg: ModelConfig, w: ModelWeights) -> None:
    """Raise ShapeError naming the first weight whose shape does not match ``cfg``."""
    v, h = cfg.vocab_size, cfg.hidden_size
    if w.embed.shape != (v, h):
        raise ShapeError(f"embed.shape={w.embed.shape}, expected [vocab, hidden] = {(v, h)}")
    if len(w.layers) != cfg.num_layers:
        raise ShapeError(f"{len(w.layers)} layers of weights for num_layers={cfg.num_layers}")
    want = expected_shapes(cfg)
    kind = LayerWeights if cfg.mla is None else MLALayerWeights
    biases = mla_weight_shapes(h, cfg.intermediate_size, cfg.num_heads, cfg.mla)[1] if cfg.mla else {}
    _check_moe(cfg, w)
    dense = ("w_gate", "w_up", "w_down")
    for li, lw in enumerate(w.layers):
        if not isinstance(lw, kind):
            raise ShapeError(f"layers[{li}] is a {type(lw).__name__}; this config needs {kind.__name__}")
        for name, shape in {**want, **biases}.items():
            shape = None if name in dense and cfg.is_moe(li) else shape  # an MoE layer's MLP is w.moe[li]
            got = getattr(lw, name)
            got = None if got is None else got.shape
            if got != shape and not (name in biases and got is None):
                raise ShapeError(f"layers[{li}].{name}.shape={got}, expected {shape}")
    if w.final_norm.shape != (h,):
        raise ShapeError(f"final_norm.shape={w.final_norm.shape}, expected {(h,)}")
    if w.lm_head is not None and w.lm_head.shape != (v, h):
        raise ShapeError(f"lm_head.shape={w.lm_head.shape}, expected {(v, h)}")


def _check_moe(cfg: ModelConfig, w: ModelWeights) -> None:
    """``w.moe`` holds an ``MoEWeights`` of ``cfg.moe``'s shapes exactly for the MoE layers."""
    got = w.moe or [None] * cfg.num_layers
    if len(got) != cfg.num_layers:
        raise ShapeError(f"{len(got)} entries of moe weights for num_layers={cfg.num_layers}; "
                         "one per layer (None: dense)")
    for li, m in enumerate(got):
        if (m is not None) != cfg.is_moe(li):
            raise ShapeError(f"layers[{li}] {'has' if m is not None else 'lacks'} mixture-of-experts weights; "
                             f"the config makes it {'an MoE' if cfg.is_moe(li) else 'a dense'} layer")
        if m is not None:
            m.check(cfg.hidden_size, cfg.moe, where=f"layers[{li}].moe")
