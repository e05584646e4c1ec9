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

from minikv.errors import ConfigError, DTypeError, InvalidInputError, ShapeError, check_choice
from minikv.hybrid.cache import LAYER_TYPES, check_layer_types, hybrid_cache, layer_windows  # noqa: F401
from minikv.layers import ACTIVATIONS, ROPE_LAYOUTS, apply_rope, gated_activation, linear, rms_norm, rope_tables, silu  # noqa: F401  (re-exported)
from minikv.mla.block import MLALayer, mla_attention_block
from minikv.mla.latent import LatentUp
from minikv.model_config import LayerWeights, ModelConfig, ModelWeights, check_weights, expected_shapes  # noqa: F401  (re-exported: the config and weights live there)
from minikv.moe import MoEConfig, MoEWeights, moe_mlp  # noqa: F401
from minikv.online_softmax import soft_cap

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
    w_gate_up_t: np.ndarray | None  # [2 I, H]  (None: the layer's MLP is ``moe``)
    w_down_t: np.ndarray | None     # [H, I]
    qk_norm: np.ndarray | None = None         # [Hq + Hkv, D]: q_norm for each query head, then k_norm per key head
    q_scale: np.floating | None = None        # sqrt(D / query_pre_attn_scalar), when that is not 1
    post_attn_norm: np.ndarray | None = None  # [H]
    post_mlp_norm: np.ndarray | None = None   # [H]
    bqkv: np.ndarray | None = None            # [(Hq + 2 Hkv) * D]  the Q/K/V biases, fused as the matrix is
    bo: np.ndarray | None = None              # [H]
    sinks: np.ndarray | None = None           # [Hq]
    moe: MoEWeights | None = None             # the mixture-of-experts MLP (then w_gate_up_t is None)

    @classmethod
    def prepare(cls, lw: LayerWeights, cfg: ModelConfig, moe: MoEWeights | None = None) -> "_FusedLayer":
        """Fuse and transpose one layer's weights (already in the compute dtype)."""
        t, dtype = np.ascontiguousarray, lw.wq.dtype.type
        qk_norm = None if lw.q_norm is None else t(np.concatenate([np.tile(lw.q_norm, (cfg.num_heads, 1)),
                                                                     np.tile(lw.k_norm, (cfg.num_kv_heads, 1))]))
        s = cfg.query_pre_attn_scalar
        q_scale = None if s is None or s == cfg.head_dim else dtype(np.sqrt(cfg.head_dim / s))
        dense = lw.w_gate is not None
        return cls(lw.attn_norm, t(np.concatenate([lw.wq, lw.wk, lw.wv], axis=1).T), t(lw.wo.T), lw.mlp_norm,
                   t(np.concatenate([lw.w_gate, lw.w_up], axis=1).T) if dense else None,
                   t(lw.w_down.T) if dense else None, qk_norm, q_scale, lw.post_attn_norm, lw.post_mlp_norm,
                   None if lw.bq is None else np.concatenate([lw.bq, lw.bk, lw.bv]), lw.bo, lw.sinks, moe)


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
    qkv = linear(h, lw.wqkv_t)
    if lw.bqkv is not None:  # Qwen2, gpt-oss: the bias lands before RoPE, so the cached key carries it
        qkv = qkv + lw.bqkv
    qkv = qkv.reshape(n, hq + 2 * hkv, d)  # [N, Hq + 2 Hkv, D]
    qk = qkv[:, : hq + hkv]
    if cfg.qk_norm:  # Gemma-3: RMSNorm over D in every q and k head, before RoPE
        qk = rms_norm(qk, lw.qk_norm, cfg.rms_eps)
    if cos is not None:  # (None: the cache rotates by in-cache position, minikv.window: hand over pre-RoPE q, k)
        qk = apply_rope(qk, cos, sin, cfg.rope_layout)  # rotate Q and K in one go
    q, k, v = qk[:, :hq], qk[:, hq:], qkv[:, hq + hkv:]
    if lw.q_scale is not None:  # every cache scales scores by 1/sqrt(D); the model wants 1/sqrt(query_pre_attn_scalar)
        q = q * lw.q_scale
    cache.write(li, k, v)
    options = {}  # gpt-oss's sinks, Gemma 2's cap: inside the cache's online softmax (only a cache that takes them)
    if lw.sinks is not None:
        options["sinks"] = lw.sinks
    if cfg.attn_softcap is not None:
        options["softcap"] = cfg.attn_softcap
    attn = cache.attend(li, q, **options)  # [N, Hq, D]
    out = linear(attn.reshape(n, hq * d), lw.wo_t)
    if lw.bo is not None:
        out = out + lw.bo
    return rms_norm(out, lw.post_attn_norm, cfg.rms_eps) if cfg.sandwich_norms else out


def mlp_block(x: np.ndarray, lw: _FusedLayer, cfg: ModelConfig) -> np.ndarray:
    """A layer's gated MLP branch: x [N, H] -> [N, H] = (act(h Wg) * h Wu) Wd, h = RMSNorm(x).

    act is SiLU (SwiGLU) or the tanh GELU (GeGLU, Gemma): ``cfg.hidden_act``. A mixture-of-experts
    layer (``lw.moe``) runs ``minikv.moe.moe_mlp`` on h instead.
    """
    h = rms_norm(x, lw.mlp_norm, cfg.rms_eps)
    if getattr(lw, "moe", None) is not None:
        return moe_mlp(h, lw.moe, cfg.moe)
    gate_up = linear(h, lw.w_gate_up_t)  # [N, 2 I]
    out = linear(gated_activation(gate_up, cfg.hidden_act), lw.w_down_t)
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
        moes = w.moe or [None] * c.num_layers
        if c.mla is not None:
            self._layers = [MLALayer.prepare(lw, m) for lw, m in zip(w.layers, moes)]
            self._up = [LatentUp.from_kv_b(lw.wkv_b, c.num_heads, c.mla) for lw in w.layers]
            self._attention = mla_attention_block
            self.cos, self.sin = rope_tables(c.mla.qk_rope_head_dim, c.max_position, c.rope_theta, self.dtype,
                                             yarn=c.mla.yarn)
            self.rope = {"full_attention": (self.cos, self.sin)}
            return
        self._attention = attention_block
        self._layers = [_FusedLayer.prepare(lw, c, m) for lw, m in zip(w.layers, moes)]
        # one RoPE table per layer type; ``cos``/``sin`` name the full layers' (else the only one)
        self.rope = {kind: rope_tables(c.head_dim, c.max_position, theta, self.dtype, yarn=c.rope_scaling)
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
            if c.final_softcap is not None:  # Gemma 2: cap * tanh(logits / cap)
                logits = soft_cap(logits, c.final_softcap)
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
