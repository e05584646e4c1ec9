"""A Llama-style decoder (RMSNorm, RoPE, GQA, SwiGLU) assembled from the steps, with Gemma-3's options as data.

The model never knows which KV cache it runs on: it asks the cache for the
positions of the new tokens, hands each layer's rotated keys and values to
``cache.write`` and gets attention back from ``cache.attend``
(see ``minikv.kv_cache``).

Each decoder layer is two residual lines (pre-norm, as in nanoGPT)::

    x = x + attention_block(x, ...)   # RMSNorm -> Q/K/V -> RoPE -> cache -> attention -> Wo
    x = x + mlp_block(x, ...)         # RMSNorm -> SwiGLU -> W_down

A DeepSeek-V2/V3 model (``ModelConfig.mla`` set) swaps the first line's block for
``minikv.mla.block.mla_attention_block``: low-rank Q, a cached latent, decoupled RoPE.

Model families are data, not subclasses. Gemma-3 (step 9) is a Llama whose config turns on:
``layer_types`` (full or sliding attention: the *cache* honours a layer's window, ``minikv.hybrid``;
the model calls ``cache.write``/``cache.attend`` for every layer as before) with a RoPE table per
layer type (looked up in ``forward``), ``qk_norm`` and ``query_pre_attn_scalar`` (in
``attention_block``), ``sandwich_norms`` (both blocks), GeGLU (``hidden_act``, in ``mlp_block``)
and ``embed_scale`` (in ``forward``).

Shapes: tokens of all sequences in a forward pass are packed along one axis N
(no padding). H = hidden size, Hq/Hkv = query/KV heads, D = head_dim,
I = MLP width, V = vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from minikv.errors import ConfigError, DTypeError, InvalidInputError, ShapeError, check_choice, check_float, check_int
from minikv.hybrid.cache import LAYER_TYPES, check_layer_types, hybrid_cache, layer_windows  # noqa: F401
from minikv.layers import ACTIVATIONS, ROPE_LAYOUTS, apply_rope, linear, rms_norm, rope_tables, silu  # noqa: F401
from minikv.mla.block import MLALayer, MLALayerWeights, mla_attention_block, mla_weight_shapes
from minikv.mla.latent import LatentUp, MLAConfig


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
        for name in ("rope_theta", "rms_eps", "embed_scale", "sliding_rope_theta", "query_pre_attn_scalar"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, check_float(name, getattr(self, name)))

        object.__setattr__(self, "layer_types", check_layer_types(self.layer_types, self.num_layers,
                                                                  self.sliding_window))
        if self.mla is not None and ("sliding_attention" in self.layer_types or self.qk_norm or self.sandwich_norms):
            raise ConfigError("an MLA model with sliding_attention layers, qk_norm or sandwich_norms: minikv's MLA "
                              "block has none of them (use full_attention layers and leave the two flags False)")

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
    w_gate: np.ndarray     # [H, I]
    w_up: np.ndarray       # [H, I]
    w_down: np.ndarray     # [I, H]
    q_norm: np.ndarray | None = None          # [D] QK-norm (config.qk_norm), shared by every query head
    k_norm: np.ndarray | None = None          # [D] and by every key head
    post_attn_norm: np.ndarray | None = None  # [H] sandwich norms (config.sandwich_norms): on the attention
    post_mlp_norm: np.ndarray | None = None   # [H] and the MLP branch's output, before the residual add


@dataclass
class ModelWeights:
    embed: np.ndarray                   # [V, H]
    layers: list[LayerWeights]
    final_norm: np.ndarray              # [H]
    lm_head: np.ndarray | None = None   # [V, H]; None means tied to ``embed``

    def astype(self, dtype) -> "ModelWeights":
        cast = lambda a: None if a is None else np.ascontiguousarray(a, dtype=dtype)  # noqa: E731
        return ModelWeights(
            embed=cast(self.embed),
            layers=[type(lw)(**{k: cast(v) for k, v in vars(lw).items()}) for lw in self.layers],
            final_norm=cast(self.final_norm),
            lm_head=cast(self.lm_head),
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
    for li, lw in enumerate(w.layers):
        if not isinstance(lw, kind):
            raise ShapeError(f"layers[{li}] is a {type(lw).__name__}; this config needs {kind.__name__}")
        for name, shape in {**want, **biases}.items():
            got = getattr(lw, name)
            got = None if got is None else got.shape
            if got != shape and not (name in biases and got is None):
                raise ShapeError(f"layers[{li}].{name}.shape={got}, expected {shape}")
    if w.final_norm.shape != (h,):
        raise ShapeError(f"final_norm.shape={w.final_norm.shape}, expected {(h,)}")
    if w.lm_head is not None and w.lm_head.shape != (v, h):
        raise ShapeError(f"lm_head.shape={w.lm_head.shape}, expected {(v, h)}")


# --- the model -----------------------------------------------------------------------------

@dataclass
class _FusedLayer:
    """A layer prepared for speed: Q/K/V fused into one matrix and gate/up into
    another, so each is one matmul per step; every matrix transposed to
    [out, in] (torch's Linear layout) and used as ``x @ w.T``.

    Why [out, in]: decoding one token is a matrix-vector product whose speed is
    set by how fast the weights stream from memory. With [out, in] each output
    reads one contiguous row; on the benchmark machine that is ~15% faster than
    ``x @ W`` with W stored [in, out] (see benchmarks/decode_cpu.py).
    """

    attn_norm: np.ndarray
    wqkv_t: np.ndarray       # [(Hq + 2 Hkv) * D, H]
    wo_t: np.ndarray         # [H, Hq * D]
    mlp_norm: np.ndarray
    w_gate_up_t: np.ndarray  # [2 I, H]
    w_down_t: np.ndarray     # [H, I]
    qk_norm: np.ndarray | None = None         # [Hq + Hkv, D]: q_norm for each query head, then k_norm per key head
    q_scale: np.floating | None = None        # sqrt(D / query_pre_attn_scalar), when that is not 1
    post_attn_norm: np.ndarray | None = None  # [H]
    post_mlp_norm: np.ndarray | None = None   # [H]

    @classmethod
    def prepare(cls, lw: LayerWeights, cfg: ModelConfig) -> "_FusedLayer":
        """Fuse and transpose one layer's weights (already in the compute dtype)."""
        t, dtype = np.ascontiguousarray, lw.wq.dtype.type
        qk_norm = None if lw.q_norm is None else t(np.concatenate([np.tile(lw.q_norm, (cfg.num_heads, 1)),
                                                                     np.tile(lw.k_norm, (cfg.num_kv_heads, 1))]))
        s = cfg.query_pre_attn_scalar
        q_scale = None if s is None or s == cfg.head_dim else dtype(np.sqrt(cfg.head_dim / s))
        return cls(lw.attn_norm, t(np.concatenate([lw.wq, lw.wk, lw.wv], axis=1).T), t(lw.wo.T), lw.mlp_norm,
                   t(np.concatenate([lw.w_gate, lw.w_up], axis=1).T), t(lw.w_down.T), qk_norm, q_scale,
                   lw.post_attn_norm, lw.post_mlp_norm)


def attention_block(x: np.ndarray, lw: _FusedLayer, cfg: ModelConfig, cache, li: int,
                    cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Layer ``li``'s attention branch: what it adds to the residual stream.

    x:        [N, H] the residual stream of the N packed tokens
    lw:       the layer's weights, as ``Model`` prepares them
    cache:    receives the N tokens' rotated K and V (layer ``li``), then attends for their Q
    cos, sin: [N, D/2] RoPE angles of the tokens' positions, from the table of the layer's type
              (None: the cache rotates, ``rotates_in_cache``)
    returns:  [N, H] = attention(RoPE(q), RoPE(k), v) @ Wo, over RMSNorm(x)
    """
    n, hq, hkv, d = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    h = rms_norm(x, lw.attn_norm, cfg.rms_eps)
    qkv = linear(h, lw.wqkv_t).reshape(n, hq + 2 * hkv, d)  # [N, Hq + 2 Hkv, D]
    qk = qkv[:, : hq + hkv]
    if cfg.qk_norm:  # Gemma-3: RMSNorm over D in every q and k head, before RoPE
        qk = rms_norm(qk, lw.qk_norm, cfg.rms_eps)
    if cos is not None:  # (None: the cache rotates by in-cache position, minikv.window: hand over pre-RoPE q, k)
        qk = apply_rope(qk, cos, sin, cfg.rope_layout)  # rotate Q and K in one go
    q, k, v = qk[:, :hq], qk[:, hq:], qkv[:, hq + hkv:]
    if lw.q_scale is not None:  # every cache scales scores by 1/sqrt(D); the model wants 1/sqrt(query_pre_attn_scalar)
        q = q * lw.q_scale
    cache.write(li, k, v)
    attn = cache.attend(li, q)  # [N, Hq, D]
    out = linear(attn.reshape(n, hq * d), lw.wo_t)
    return rms_norm(out, lw.post_attn_norm, cfg.rms_eps) if cfg.sandwich_norms else out


def mlp_block(x: np.ndarray, lw: _FusedLayer, cfg: ModelConfig) -> np.ndarray:
    """A layer's gated MLP branch: x [N, H] -> [N, H] = (act(h Wg) * h Wu) Wd, h = RMSNorm(x).

    act is SiLU (SwiGLU) or the tanh GELU (GeGLU, Gemma): ``cfg.hidden_act``.
    """
    h = rms_norm(x, lw.mlp_norm, cfg.rms_eps)
    gate_up = linear(h, lw.w_gate_up_t)  # [N, 2 I]
    i = cfg.intermediate_size
    out = linear(ACTIVATIONS[cfg.hidden_act](gate_up[:, :i]) * gate_up[:, i:], lw.w_down_t)
    return rms_norm(out, lw.post_mlp_norm, cfg.rms_eps) if cfg.sandwich_norms else out


@dataclass
class Model:
    """A Llama-style (GQA) or DeepSeek-style (MLA, ``config.mla``) decoder that runs on any KV cache.

    ``dtype`` is the compute dtype: float32 (default) or float64 for exactness
    proofs. Weights are cast once at construction.
    """

    config: ModelConfig
    weights: ModelWeights
    dtype: type = np.float32
    _layers: list = field(init=False, repr=False)

    def __post_init__(self):
        check_choice("model dtype", np.dtype(self.dtype).name, ("float32", "float64"), error=DTypeError)
        self.dtype = np.dtype(self.dtype).type
        check_weights(self.config, self.weights)
        w = self.weights.astype(self.dtype)
        self.weights = w
        self.embed = w.embed
        self.lm_head = w.embed if w.lm_head is None else w.lm_head
        self.final_norm = w.final_norm
        c = self.config
        if c.mla is not None:
            self._layers = [MLALayer.prepare(lw) for lw in w.layers]
            self._up = [LatentUp.from_kv_b(lw.wkv_b, c.num_heads, c.mla) for lw in w.layers]
            self._attention = mla_attention_block
            self.cos, self.sin = rope_tables(c.mla.qk_rope_head_dim, c.max_position, c.rope_theta, self.dtype,
                                             yarn=c.mla.yarn)
            self.rope = {"full_attention": (self.cos, self.sin)}
            return
        self._attention = attention_block
        self._layers = [_FusedLayer.prepare(lw, c) for lw in w.layers]
        # one RoPE table per layer type; ``cos``/``sin`` name the full layers' (else the only one)
        self.rope = {kind: rope_tables(c.head_dim, c.max_position, theta, self.dtype)
                     for kind, theta in c.rope_thetas.items()}
        self.cos, self.sin = self.rope.get("full_attention", self.rope[c.layer_types[0]])

    @property
    def prepared_layers(self) -> list:
        """The layers as ``forward`` runs them (``_FusedLayer`` or ``minikv.mla.block.MLALayer``), for loops
        that call the branches themselves (``minikv.parallel`` puts an all-reduce after each)."""
        return self._layers

    def new_cache_args(self) -> dict:
        """The cache geometry this model needs: ``Cache(**model.new_cache_args(), ...)``.

        An MLA model's caches are latent caches (``minikv.mla``): they get the heads, the
        ``MLAConfig`` and each layer's ``LatentUp`` (W_UK, W_UV) instead of Hkv and D.
        """
        c = self.config
        if c.mla is not None:
            return {"num_layers": c.num_layers, "num_heads": c.num_heads, "mla": c.mla, "up": self._up}
        return {"num_layers": c.num_layers, "num_kv_heads": c.num_kv_heads, "head_dim": c.head_dim}

    def check_tokens(self, tokens: Sequence) -> list[np.ndarray]:
        """Validate a list of per-sequence token id lists; return them as int64 arrays."""
        if isinstance(tokens, np.ndarray) and tokens.ndim == 1:
            raise ShapeError("tokens must be a list of per-sequence id arrays, e.g. [ids]; got one flat array")
        out = []
        for i, t in enumerate(tokens):
            a = np.asarray(t)
            if a.ndim != 1:
                raise ShapeError(f"tokens[{i}].shape={a.shape}; each sequence is a 1-D list of token ids")
            if a.size == 0:
                raise InvalidInputError(f"tokens[{i}] is empty; every sequence needs at least one token "
                                        "(an empty prompt cannot be decoded: add BOS or some text)")
            if a.dtype.kind not in "iu":
                raise DTypeError(f"tokens[{i}].dtype={a.dtype}; token ids must be integers")
            lo, hi = int(a.min()), int(a.max())
            if lo < 0 or hi >= self.config.vocab_size:
                bad = lo if lo < 0 else hi
                raise InvalidInputError(f"token id {bad} in tokens[{i}] is outside [0, {self.config.vocab_size}); "
                                        "was the text encoded with this model's tokenizer?")
            out.append(a.astype(np.int64))
        if not out:
            raise InvalidInputError("tokens is empty; pass at least one sequence")
        return out

    def check_call(self, tokens: Sequence, cache, seq_ids: Sequence | None) -> tuple[list[np.ndarray], list]:
        """Validate a forward call: the token lists, one seq id each (default 0..B-1), and a
        cache of this model's geometry and per-layer windows. Returns the tokens as int64 arrays and the seq ids."""
        c = self.config
        toks = self.check_tokens(tokens)
        seq_ids = list(range(len(toks))) if seq_ids is None else list(seq_ids)
        if len(seq_ids) != len(toks):
            raise ShapeError(f"{len(seq_ids)} seq_ids for {len(toks)} token lists; give one id per sequence")
        got, want = (cache.num_layers, cache.num_kv_heads, cache.head_dim), (c.num_layers, c.num_kv_heads, c.head_dim)
        if got != want or getattr(cache, "mla", None) != c.mla:
            kind = "a latent cache (minikv.mla) of its MLAConfig" if c.mla else "a K/V cache"
            raise ConfigError(f"cache geometry (layers, kv_heads, head_dim)={got} does not match the model's {want} "
                              f"(it needs {kind}); build it with model.new_cache_args() or minikv.generate.make_cache")
        windows = tuple(getattr(cache, "layer_windows", (None,) * c.num_layers))  # a cache without: every layer full
        if windows != c.layer_windows:  # a cache that ignores a sliding layer's window gives wrong logits, silently
            raise ConfigError(f"the cache's per-layer windows {windows} are not the model's {c.layer_windows} (None: "
                              "full attention); build it with minikv.hybrid.hybrid_cache(kind, layer_windows, ...)")
        return toks, seq_ids

    def check_positions(self, positions: np.ndarray) -> None:
        """Refuse positions the model has no RoPE angles for (raised inside the step: it rolls back)."""
        if positions.size and positions.max() >= self.config.max_position:
            raise InvalidInputError(f"position {int(positions.max())} >= max_position={self.config.max_position}; "
                                    "the model was not trained this long")

    def _angles(self, positions: np.ndarray, cache) -> dict:
        """{layer type: (cos, sin)}, each [N, D/2] at ``positions``; (None, None) for a cache that rotates
        keys by in-cache position (``rotates_in_cache``, minikv.window): it needs no absolute angles."""
        if getattr(cache, "rotates_in_cache", False):
            return dict.fromkeys(self.rope, (None, None))
        self.check_positions(positions)
        return {kind: (cos[positions], sin[positions]) for kind, (cos, sin) in self.rope.items()}

    def forward(self, tokens: Sequence, cache, seq_ids: Sequence | None = None,
                all_logits: bool = False, then: Callable[[np.ndarray], None] | None = None) -> np.ndarray:
        """Run the new tokens of several sequences through the model.

        tokens:  B lists of new token ids (sequence i brings T_i tokens)
        cache:   any ``KVCacheBase``; the sequences must already be added to it
        seq_ids: B cache ids (default 0..B-1)
        then:    ``then(logits)`` runs before the step commits; if it raises, the step rolls back
                 (the scheduler samples there, so that a sampler that fails loses no request)
        returns: logits [B, V] of each sequence's last token, or [N, V] for every
                 packed token if ``all_logits`` (N = sum T_i)
        """
        c = self.config
        toks, seq_ids = self.check_call(tokens, cache, seq_ids)
        ids = np.concatenate(toks)
        with cache.step(seq_ids, [t.size for t in toks]) as positions:
            angles = self._angles(positions, cache)
            x = self.embed[ids]  # [N, H]: the residual stream; each layer adds its two branches to it
            if c.embed_scale != 1.0:  # Gemma: sqrt(H), in the compute dtype as transformers rounds it
                x = x * self.dtype(c.embed_scale)
            for li, lw in enumerate(self._layers):
                cos, sin = angles[c.layer_types[li]]  # the RoPE table of this layer's type
                x = x + self._attention(x, lw, c, cache, li, cos, sin)  # GQA or MLA: fixed per model
                x = x + mlp_block(x, lw, c)
            if not all_logits:
                last = np.cumsum([t.size for t in toks]) - 1
                x = x[last]
            logits = linear(rms_norm(x, self.final_norm, c.rms_eps), self.lm_head)
            if then is not None:
                then(logits)
        assert logits.dtype == self.dtype, logits.dtype  # no silent float64 promotion
        return logits

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Uncached logits of every position of one sequence: [T, V]. The reference for all caches
        (with sliding layers: ``minikv.hybrid.SlidingNoCache``, each masked to its window)."""
        from minikv.mla.caches import LatentNoCache

        c = self.config
        if c.mla is not None:
            cache = LatentNoCache(**self.new_cache_args(), dtype=self.dtype)
        else:
            cache = hybrid_cache("none", c.layer_windows, c.num_kv_heads, c.head_dim, dtype=self.dtype)
        return self.forward([ids], cache, all_logits=True)
