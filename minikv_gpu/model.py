"""The Llama-style decoder on the GPU (mirrors ``minikv.model`` name for name).

Same config, same weights, same ``forward`` contract as the NumPy model; the
building blocks run as kernels of ``kernels/model.cu`` and the matrix products
as ``xp.matmul`` (cuBLAS on a GPU, NumPy's BLAS on the simulator). The model
never knows which cache it runs on: it calls ``cache.write`` / ``cache.attend``
of a ``minikv_gpu.kv_cache`` cache, or, with ``fused=True`` on a decode step,
the fused ``rope_write_attend`` (RoPE + cache write + attention in one kernel).
A DeepSeek-V2/V3 model (``config.mla``) runs ``mla_attention_block`` instead, over a
``minikv_gpu.mla`` latent cache (absorbed attention, ``kernels/mla.cu``).

Arrays returned are on the device (``runtime.xp``); ``runtime.asnumpy`` brings
them back. Compute is float32 only; the cache may store float16.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from minikv import model as _cpu
from minikv.errors import ConfigError, DTypeError, ShapeError
from minikv.mla.block import MLALayer
from minikv.mla.latent import LatentUp
from minikv.model import ROPE_LAYOUTS, LayerWeights, ModelConfig, ModelWeights, check_weights, rope_tables
from minikv.weights import random_models
from minikv_gpu.hybrid import HybridKVCache
from minikv_gpu.kv_cache import ContiguousKVCache, NoCache
from minikv_gpu.mla import LatentContiguousKVCache, LatentNoCache, LatentPagedKVCache, mla_defines
from minikv_gpu.paged import PagedKVCache
from minikv_gpu.runtime import device_f32, get_runtime, head_dim_defines

__all__ = ["ModelConfig", "LayerWeights", "ModelWeights", "Model", "rms_norm", "silu", "swiglu", "geglu", "rope_tables",
           "apply_rope", "random_model", "from_cpu"]

THREADS = 256
GPU_CACHES = (ContiguousKVCache, NoCache, PagedKVCache, LatentNoCache, LatentContiguousKVCache, LatentPagedKVCache,
              HybridKVCache)


def _blocks(n: int) -> int:
    return (n + THREADS - 1) // THREADS


def rms_norm(x, weight, eps: float, *, runtime=None):
    """x: [N, H] -> x / sqrt(mean(x^2) + eps) * weight (kernel ``rms_norm_v1``)."""
    rt = get_runtime(runtime)
    x, weight = device_f32(rt, x, "x"), device_f32(rt, weight, "weight")
    if x.ndim != 2 or weight.shape != (x.shape[1],):
        raise ShapeError(f"x.shape={x.shape}, weight.shape={weight.shape}; expected x [N, H] and weight [H]")
    out = rt.xp.empty_like(x)
    if x.size:
        rt.kernel("model", "rms_norm_v1")((x.shape[0],), (THREADS,),
                                          (x, weight, out, np.int32(x.shape[0]), np.int32(x.shape[1]),
                                           np.float32(eps)))
    return out


def silu(x, *, runtime=None):
    """x * sigmoid(x), element-wise (kernel ``silu_v1``; sigmoid through tanh, as in minikv)."""
    rt = get_runtime(runtime)
    x = device_f32(rt, x, "x")
    out = rt.xp.empty_like(x)
    if x.size:
        rt.kernel("model", "silu_v1")((_blocks(x.size),), (THREADS,), (x, out, np.int64(x.size)))
    return out


def _gated(gate_up, kernel: str, runtime):
    rt = get_runtime(runtime)
    gate_up = device_f32(rt, gate_up, "gate_up")
    if gate_up.ndim != 2 or gate_up.shape[1] % 2:
        raise ShapeError(f"gate_up.shape={gate_up.shape}; expected [N, 2I] (gate and up side by side)")
    n, i = gate_up.shape[0], gate_up.shape[1] // 2
    out = rt.xp.empty((n, i), dtype=np.float32)
    if out.size:
        rt.kernel("model", kernel)((_blocks(n * i),), (THREADS,), (gate_up, out, np.int32(n), np.int32(i)))
    return out


def swiglu(gate_up, *, runtime=None):
    """The MLP's activation, fused: gate_up [N, 2I] -> silu(gate_up[:, :I]) * gate_up[:, I:]: [N, I]."""
    return _gated(gate_up, "swiglu_v1", runtime)


def geglu(gate_up, *, runtime=None):
    """Gemma's MLP activation, fused: gate_up [N, 2I] -> gelu_tanh(gate_up[:, :I]) * gate_up[:, I:]: [N, I]."""
    return _gated(gate_up, "geglu_v1", runtime)


GATES = {"silu": swiglu, "gelu_pytorch_tanh": geglu}  # config.hidden_act -> the fused gate (minikv.layers)


def apply_rope(x, cos, sin, layout: str, *, runtime=None):
    """Rotate pairs of dims of x: [N, heads, D] by per-token angles; cos/sin: [N, D/2] (kernel ``rope_v1``).

    layout "interleaved" rotates pairs (2i, 2i+1) (GGUF), "half" pairs (i, i + D/2) (transformers).
    """
    rt = get_runtime(runtime)
    if layout not in ROPE_LAYOUTS:
        raise ConfigError(f"rope layout {layout!r}; use one of {ROPE_LAYOUTS}")
    x, cos, sin = device_f32(rt, x, "x"), device_f32(rt, cos, "cos"), device_f32(rt, sin, "sin")
    if x.ndim != 3 or x.shape[2] % 2:
        raise ShapeError(f"x.shape={x.shape}; expected [N, heads, D] with D even")
    n, heads, d = x.shape
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (n, d // 2):
            raise ShapeError(f"{name}.shape={t.shape}, expected [N, D/2] = {(n, d // 2)}")
    out = rt.xp.empty_like(x)
    if x.size:
        rt.kernel("model", "rope_v1")((_blocks(x.size // 2),), (THREADS,),
                                      (x, out, cos, sin, np.int32(n), np.int32(heads), np.int32(d // 2),
                                       np.int32(layout == "half")))
    return out


# What the GPU decoder does not run yet: the config fields of issue 23's families beyond Gemma-3's and the
# score options (sinks, attn_softcap). A model that needs one is refused by name: without it the logits would be
# plausible and wrong.
_NOT_ON_GPU = {"qkv_bias": "Q/K/V biases", "o_bias": "an output bias", "final_softcap": "final-logit soft-capping",
               "rope_scaling": "scaled RoPE", "moe": "a mixture-of-experts MLP"}


def _check_supported(c: ModelConfig) -> None:
    for name, what in _NOT_ON_GPU.items():
        used = any(map(c.is_moe, range(c.num_layers))) if name == "moe" else getattr(c, name) not in (None, False)
        if used:
            raise ConfigError(f"config.{name}={getattr(c, name)!r}: the GPU model does not run {what} yet; use "
                              "minikv.model.Model (NumPy) for this model")


@dataclass
class _FusedLayer:
    """A layer's weights on the device, Q/K/V and gate/up concatenated (one matmul each)."""

    attn_norm: object
    wqkv: object       # [H, (Hq + 2 Hkv) * D]
    wo: object
    mlp_norm: object
    w_gate_up: object  # [H, 2 I]
    w_down: object
    # Gemma-3 (None elsewhere): QK-norm weights [D], the sandwich norms [H], sqrt(D / query_pre_attn_scalar)
    q_norm: object = None
    k_norm: object = None
    post_attn_norm: object = None
    post_mlp_norm: object = None
    q_scale: object = None
    sinks: object = None  # gpt-oss: [Hq] learned sink logits (the caches' kernels take them)

    @classmethod
    def upload(cls, lw: LayerWeights, c: ModelConfig, up) -> "_FusedLayer":
        opt = lambda a: None if a is None else up(a)  # noqa: E731
        s = c.query_pre_attn_scalar
        return cls(up(lw.attn_norm), up(np.concatenate([lw.wq, lw.wk, lw.wv], axis=1)), up(lw.wo), up(lw.mlp_norm),
                   up(np.concatenate([lw.w_gate, lw.w_up], axis=1)), up(lw.w_down), opt(lw.q_norm), opt(lw.k_norm),
                   opt(lw.post_attn_norm), opt(lw.post_mlp_norm),
                   None if s is None or s == c.head_dim else np.float32(np.sqrt(c.head_dim / s)), opt(lw.sinks))


@dataclass
class _MLADeviceLayer:
    """``minikv.mla.block.MLALayer`` on the device, matrices back to [in, out] (x @ W)."""

    attn_norm: object
    wa: object             # [H, Hq*(Dn+P) + W] or [H, Rq + W]: the query's first projection and kv_a, fused
    ba: object             # its bias, or None
    q_a_norm: object       # [Rq] or None
    wq_b: object           # [Rq, Hq*(Dn+P)] or None
    kv_a_norm: object      # [R]
    wo: object             # [Hq*Dv, H]
    bo: object             # [H] or None
    mlp_norm: object
    w_gate_up: object      # [H, 2 I]
    w_down: object

    @classmethod
    def upload(cls, lw: MLALayer, up) -> "_MLADeviceLayer":
        opt = lambda a, t=False: None if a is None else up(a.T if t else a)  # noqa: E731
        return cls(up(lw.attn_norm), up(lw.wa_t.T), opt(lw.ba), opt(lw.q_a_norm), opt(lw.wq_b_t, True),
                   up(lw.kv_a_norm), up(lw.wo_t.T), opt(lw.bo), up(lw.mlp_norm), up(lw.w_gate_up_t.T),
                   up(lw.w_down_t.T))


def mla_attention_block(x, lw: _MLADeviceLayer, cfg: ModelConfig, cache, li: int, cos, sin, *, runtime=None):
    """``minikv.mla.block.mla_attention_block`` on the device: x [N, H] -> [N, H].

    The cache receives each token's latent ``[c_kv ; RoPE(k_pe)]`` [N, 1, W] and attends for
    ``[q_nope ; RoPE(q_pe)]`` [N, Hq, Dn + P] (a ``minikv_gpu.mla`` latent cache)."""
    rt = get_runtime(runtime)
    m, xp, n, hq = cfg.mla, rt.xp, x.shape[0], cfg.num_heads
    dn, r, w = m.qk_nope_head_dim, m.kv_lora_rank, m.latent_dim
    a = xp.matmul(rms_norm(x, lw.attn_norm, cfg.rms_eps, runtime=rt), lw.wa)
    if lw.ba is not None:
        a = a + lw.ba
    q, kv_a = xp.ascontiguousarray(a[:, :-w]), a[:, -w:]
    if lw.wq_b is not None:  # the low-rank query path: q_a -> RMSNorm -> q_b
        q = xp.matmul(rms_norm(q, lw.q_a_norm, m.latent_eps, runtime=rt), lw.wq_b)
    q = q.reshape(n, hq, m.qk_head_dim)
    c_kv = rms_norm(xp.ascontiguousarray(kv_a[:, :r]), lw.kv_a_norm, m.latent_eps, runtime=rt)
    # decoupled RoPE: the queries' last P dims and the one shared k_pe rotate in one launch
    rot = apply_rope(xp.ascontiguousarray(xp.concatenate([q[:, :, dn:], kv_a[:, None, r:]], axis=1)), cos, sin,
                     m.rope_layout, runtime=rt)
    cache.write(li, xp.ascontiguousarray(xp.concatenate([c_kv, rot[:, hq]], axis=-1)[:, None]), None)
    attn = cache.attend(li, xp.ascontiguousarray(xp.concatenate([q[:, :, :dn], rot[:, :hq]], axis=-1)))
    out = xp.matmul(attn.reshape(n, hq * m.v_head_dim), lw.wo)
    return out if lw.bo is None else out + lw.bo


@dataclass
class Model(_cpu.Model):
    """``minikv.model.Model`` on the GPU kernels.

    config, weights: as for the NumPy model (host arrays, uploaded once as float32)
    runtime:     the kernel runtime (default: CuPy on a GPU, else the simulator)
    cache_dtype: the dtype of caches built by ``new_cache`` (float32 or float16)
    fused:       on decode steps over a ``ContiguousKVCache``, use the fused
                 RoPE + cache-write + attention kernel instead of three launches

    Validation (``check_tokens``), ``new_cache_args`` and the step protocol are
    the NumPy model's; compute is float32.
    """

    dtype: type = np.float32
    runtime: object = None
    cache_dtype: type = np.float32
    fused: bool = False
    _layers: list = field(init=False, repr=False)

    def __post_init__(self):
        if np.dtype(self.dtype) != np.float32:
            raise DTypeError(f"model dtype {np.dtype(self.dtype)}; the GPU model computes in float32 "
                             "(use minikv.model.Model for float64 proofs)")
        if np.dtype(self.cache_dtype) not in (np.dtype(np.float32), np.dtype(np.float16)):
            raise DTypeError(f"cache_dtype={np.dtype(self.cache_dtype)}; use np.float32 or np.float16")
        self.dtype = np.float32
        c = self.config
        _check_supported(c)
        self.rt = get_runtime(self.runtime)
        if c.mla is None:
            head_dim_defines(c.head_dim)  # fail now, not at the first launch
        else:
            mla_defines(c.mla, self.cache_dtype)  # the latent kernels' sizes (ConfigError names them)
            if self.fused:
                raise ConfigError("fused=True is the GQA rope_write_attend kernel; an MLA model writes latents "
                                  "(use fused=False)")
        check_weights(c, self.weights)
        up = lambda a: self.rt.asarray(np.ascontiguousarray(a, dtype=np.float32))  # noqa: E731
        w = self.weights
        self.embed = up(w.embed)
        self.lm_head = self.embed if w.lm_head is None else up(w.lm_head)
        self.final_norm = up(w.final_norm)
        if c.mla is not None:
            w32 = w.astype(np.float32)
            self._layers = [_MLADeviceLayer.upload(MLALayer.prepare(lw), up) for lw in w32.layers]
            self._up = [LatentUp.from_kv_b(lw.wkv_b, c.num_heads, c.mla) for lw in w32.layers]
            cos, sin = rope_tables(c.mla.qk_rope_head_dim, c.max_position, c.rope_theta, np.float32, yarn=c.mla.yarn)
            self.cos, self.sin = up(cos), up(sin)
            self.rope = {"full_attention": (self.cos, self.sin)}
            return
        self._layers = [_FusedLayer.upload(lw, c, up) for lw in w.layers]
        # one table per layer type (Gemma-3: base 10,000 on sliding layers, 1,000,000 on full ones)
        self.rope = {kind: tuple(up(t) for t in rope_tables(c.head_dim, c.max_position, theta, np.float32))
                     for kind, theta in c.rope_thetas.items()}
        self.cos, self.sin = self.rope.get("full_attention", self.rope[c.layer_types[0]])

    def new_cache(self, max_seqs: int, max_len: int, **kwargs) -> ContiguousKVCache:
        """A device ``ContiguousKVCache`` of this model's geometry (an MLA model: a
        ``minikv_gpu.mla.LatentContiguousKVCache``), storing ``cache_dtype``."""
        kind = ContiguousKVCache if self.config.mla is None else LatentContiguousKVCache
        return kind(**self.new_cache_args(), max_seqs=max_seqs, max_len=max_len,
                                 dtype=self.cache_dtype, runtime=self.rt, **kwargs)

    def forward(self, tokens: Sequence, cache, seq_ids: Sequence | None = None, all_logits: bool = False,
                then=None):
        """Run the new tokens of several sequences through the model (see ``minikv.model.Model.forward``).

        tokens:  B lists of new token ids (sequence i brings T_i tokens)
        cache:   a ``minikv_gpu.kv_cache`` or ``minikv_gpu.paged`` cache; the sequences must already be added
        seq_ids: B cache ids (default 0..B-1)
        then:    ``then(logits)`` runs before the step commits; if it raises, the step rolls back
        returns: float32 logits on the device, [B, V] (each sequence's last token) or [N, V]
        """
        c, rt, xp = self.config, self.rt, self.rt.xp
        if not isinstance(cache, GPU_CACHES):
            raise ConfigError(f"cache is a {type(cache).__module__}.{type(cache).__name__}; the GPU model needs a "
                              "minikv_gpu.kv_cache, minikv_gpu.paged, minikv_gpu.mla or minikv_gpu.hybrid cache "
                              "(e.g. model.new_cache(max_seqs, max_len))")
        toks, seq_ids = self.check_call(tokens, cache, seq_ids)
        ids = rt.asarray(np.concatenate(toks))
        with cache.step(seq_ids, [t.size for t in toks]) as positions:
            self.check_positions(positions)
            pos = rt.asarray(positions)
            angles = {kind: (xp.ascontiguousarray(cos[pos]), xp.ascontiguousarray(sin[pos]))
                      for kind, (cos, sin) in self.rope.items()}
            fused = self.fused and isinstance(cache, ContiguousKVCache) and all(t.size == 1 for t in toks)
            x = self.embed[ids]  # [N, H]
            if c.embed_scale != 1.0:  # Gemma: sqrt(H), in float32 as the NumPy model
                x = x * np.float32(c.embed_scale)
            for li, lw in enumerate(self._layers):
                if c.mla is not None:
                    x = x + mla_attention_block(x, lw, c, cache, li, *angles["full_attention"], runtime=rt)
                    x = x + self._mlp(x, lw)
                    continue
                x = x + self._attention(x, lw, cache, li, *angles[c.layer_types[li]], fused)
                x = x + self._mlp(x, lw)
            if not all_logits:
                last = rt.asarray(np.cumsum([t.size for t in toks]) - 1)
                x = x[last]
            logits = xp.matmul(rms_norm(x, self.final_norm, c.rms_eps, runtime=rt), self.lm_head.T)
            if then is not None:
                then(logits)
        assert logits.dtype == np.float32, logits.dtype  # no silent float64 promotion
        return logits

    def _attention(self, x, lw: _FusedLayer, cache, li: int, cos, sin, fused: bool):
        """Layer ``li``'s attention branch, as ``minikv.model.attention_block``: [N, H] -> [N, H]."""
        c, rt, xp = self.config, self.rt, self.rt.xp
        n, hq, hkv, d = x.shape[0], c.num_heads, c.num_kv_heads, c.head_dim
        qkv = xp.matmul(rms_norm(x, lw.attn_norm, c.rms_eps, runtime=rt), lw.wqkv)  # [N, (Hq + 2 Hkv) D]
        q = xp.ascontiguousarray(qkv[:, : hq * d]).reshape(n, hq, d)
        k = xp.ascontiguousarray(qkv[:, hq * d: (hq + hkv) * d]).reshape(n, hkv, d)
        v = xp.ascontiguousarray(qkv[:, (hq + hkv) * d:]).reshape(n, hkv, d)
        if lw.q_norm is not None:  # Gemma-3's QK-norm: RMSNorm over D in every head, before RoPE
            q = rms_norm(q.reshape(n * hq, d), lw.q_norm, c.rms_eps, runtime=rt).reshape(n, hq, d)
            k = rms_norm(k.reshape(n * hkv, d), lw.k_norm, c.rms_eps, runtime=rt).reshape(n, hkv, d)
        options = {}  # gpt-oss's sinks, Gemma 2's cap: inside the kernels' online softmax (minikv.model's rule)
        if lw.sinks is not None:
            options["sinks"] = lw.sinks
        if c.attn_softcap is not None:
            options["softcap"] = c.attn_softcap
        if fused and lw.q_scale is None:
            attn = cache.rope_write_attend(li, q, k, v, cos, sin, c.rope_layout, **options)
        else:
            q = apply_rope(q, cos, sin, c.rope_layout, runtime=rt)
            k = apply_rope(k, cos, sin, c.rope_layout, runtime=rt)
            if lw.q_scale is not None:  # the kernels scale by 1/sqrt(D); Gemma wants 1/sqrt(query_pre_attn_scalar)
                q = q * lw.q_scale
            cache.write(li, k, v)
            attn = cache.attend(li, q, **options)  # [N, Hq, D]
        out = xp.matmul(attn.reshape(n, hq * d), lw.wo)
        return out if lw.post_attn_norm is None else rms_norm(out, lw.post_attn_norm, c.rms_eps, runtime=rt)

    def _mlp(self, x, lw):
        """The gated MLP branch (SwiGLU, or Gemma's GeGLU with its sandwich norm): x [N, H] -> [N, H]."""
        c, rt = self.config, self.rt
        h = rms_norm(x, lw.mlp_norm, c.rms_eps, runtime=rt)
        out = rt.xp.matmul(GATES[c.hidden_act](rt.xp.matmul(h, lw.w_gate_up), runtime=rt), lw.w_down)
        post = getattr(lw, "post_mlp_norm", None)  # (an MLA layer has none)
        return out if post is None else rms_norm(out, post, c.rms_eps, runtime=rt)

    def logits(self, ids: Sequence[int]):
        """Uncached logits of every position of one sequence: [T, V] (GPU ``NoCache``, ``LatentNoCache``)."""
        cache = (NoCache if self.config.mla is None else LatentNoCache)(**self.new_cache_args(), runtime=self.rt)
        return self.forward([ids], cache, all_logits=True)


def from_cpu(model: _cpu.Model, *, runtime=None, cache_dtype=np.float32, fused: bool = False) -> Model:
    """The GPU twin of a NumPy ``minikv.model.Model`` (same config and weights)."""
    if not isinstance(model, _cpu.Model):
        raise ConfigError(f"from_cpu takes a minikv.model.Model, got {type(model).__name__}")
    return Model(model.config, model.weights, runtime=runtime, cache_dtype=cache_dtype, fused=fused)


def random_model(*args, runtime=None, cache_dtype=np.float32, fused: bool = False, **kwargs) -> Model:
    """``minikv.weights.random_models.random_model`` (same arguments, same weights for the same seed) on the GPU."""
    kwargs.setdefault("dtype", np.float32)
    return from_cpu(random_models.random_model(*args, **kwargs), runtime=runtime, cache_dtype=cache_dtype, fused=fused)
