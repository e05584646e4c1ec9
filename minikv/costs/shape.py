"""A decoder's shape (``ModelShape``) and the storage dtypes its memory is counted in.

Every other module of ``minikv.costs`` reads sizes from a ``ModelShape``; this
one only validates them. Field names are the library's vocabulary: the
``minikv memory`` command owns the mapping from its flags to these fields.

Dtypes are counted in bits per stored value (``DTYPE_BITS``), so that int4's
half byte stays exact; totals are rounded up to whole bytes at the end.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from minikv.errors import ConfigError, check_int

# --- dtypes ------------------------------------------------------------------------------------

DTYPE_BITS = {"fp32": 32, "fp16": 16, "bf16": 16, "fp8": 8, "int8": 8, "int4": 4, "int2": 2}
QUANTIZED_DTYPES = ("fp8", "int8", "int4", "int2")  # the ones that may carry per-group scales


def check_dtype(dtype: str) -> str:
    """``dtype`` if it is a key of ``DTYPE_BITS``, else ConfigError listing them."""
    if dtype not in DTYPE_BITS:
        raise ConfigError(f"dtype={dtype!r} is not known; use one of {sorted(DTYPE_BITS)}")
    return dtype


def dtype_bytes(dtype: str) -> float:
    """Bytes per stored value: fp32 4, fp16/bf16 2, fp8/int8 1, int4 0.5 (no scale overhead)."""
    return DTYPE_BITS[check_dtype(dtype)] / 8


# --- model shapes ------------------------------------------------------------------------------

MLP_KINDS = ("swiglu", "geglu", "gelu")  # gated (3 matrices: gate, up, down) or not (2)
NORM_KINDS = ("rms", "layer")
# sizes that may be unknown (None) and are >= 1 when given
_OPTIONAL_SIZES = ("num_kv_heads", "head_dim", "hidden_size", "num_heads", "intermediate_size", "vocab_size",
                   "v_head_dim", "published_params", "max_context")
# sizes where 0 means "the feature is absent" (no MLA, no MoE, no learned positions, ...)
_ZERO_MEANS_NONE = ("learned_positions", "kv_lora_rank", "rope_dim", "q_lora_rank", "num_experts",
                    "experts_per_token", "shared_experts", "moe_intermediate_size", "first_dense_layers")


@dataclass(frozen=True)
class ModelShape:
    """The numbers that decide a decoder's memory and FLOPs (one dataclass, nanoGPT style).

    Only ``num_layers`` plus either ``num_kv_heads`` and ``head_dim`` (MHA/GQA/MQA)
    or ``kv_lora_rank`` (MLA) are needed for the KV cache. Weights and FLOPs also
    need ``hidden_size``, ``num_heads``, ``intermediate_size`` and ``vocab_size``;
    a function that needs a missing one raises ``ConfigError`` naming it.

    Attention:
      * MHA: ``num_kv_heads == num_heads``; GQA: fewer KV heads, each shared by
        ``num_heads // num_kv_heads`` query heads; MQA: ``num_kv_heads == 1``.
      * MLA (``kv_lora_rank > 0``): ``head_dim`` is the per-head query/key dim
        without RoPE (DeepSeek's qk_nope_head_dim), ``rope_dim`` the decoupled
        RoPE dim, ``v_head_dim`` the value dim, ``q_lora_rank`` the query
        compression (0 = none). ``num_kv_heads`` plays no part in MLA's cache.
    MLP: ``mlp`` is "swiglu" or "geglu" (gated: 3 matrices) or "gelu" (2 matrices). Mixture of
    experts: ``num_experts`` routed experts of width ``moe_intermediate_size``,
    ``experts_per_token`` of them active, plus ``shared_experts`` always active;
    the first ``first_dense_layers`` layers keep a dense MLP of width
    ``intermediate_size``.
    Bookkeeping: ``bias`` (linear biases, GPT-style), ``norm`` ("rms" or
    "layer"), ``learned_positions`` (rows of a learned position table, 0 for
    RoPE), ``tie_embeddings`` (the output head reuses the embedding matrix).
    Provenance: ``source`` says where the numbers come from,
    ``published_params`` is the parameter count the source states, and
    ``max_context`` the longest context the model was built for.
    """

    name: str
    num_layers: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    hidden_size: int | None = None
    num_heads: int | None = None
    intermediate_size: int | None = None
    vocab_size: int | None = None
    mlp: str = "swiglu"
    tie_embeddings: bool = False
    bias: bool = False
    norm: str = "rms"
    learned_positions: int = 0
    kv_lora_rank: int = 0
    rope_dim: int = 0
    q_lora_rank: int = 0
    v_head_dim: int | None = None
    num_experts: int = 0
    experts_per_token: int = 0
    shared_experts: int = 0
    moe_intermediate_size: int = 0
    first_dense_layers: int = 0
    source: str = ""
    published_params: int | None = None
    max_context: int | None = None

    def __post_init__(self):
        # NumPy integers become Python ints: products of sizes overflow int64 (uncached FLOPs reach 1e19)
        def count(name: str, minimum: int, allow_none: bool) -> None:
            val = getattr(self, name)
            if val is None and allow_none:
                return
            object.__setattr__(self, name, check_int(f"{self.name}: {name}", val, minimum=minimum))

        count("num_layers", 1, allow_none=False)
        for name in _OPTIONAL_SIZES:
            count(name, 1, allow_none=True)
        for name in _ZERO_MEANS_NONE:
            count(name, 0, allow_none=False)
        if self.mlp not in MLP_KINDS:
            raise ConfigError(f"{self.name}: mlp={self.mlp!r}; use one of {MLP_KINDS}")
        if self.norm not in NORM_KINDS:
            raise ConfigError(f"{self.name}: norm={self.norm!r}; use one of {NORM_KINDS}")
        if not self.is_mla:
            missing = [n for n in ("num_kv_heads", "head_dim") if getattr(self, n) is None]
            if missing:
                raise ConfigError(f"{self.name}: the KV cache needs {missing} (or kv_lora_rank for MLA)")
            if self.num_heads is not None and self.num_heads % self.num_kv_heads:
                raise ConfigError(f"{self.name}: num_heads={self.num_heads} is not a multiple of "
                                  f"num_kv_heads={self.num_kv_heads}; each KV head serves a whole group")
        if self.num_experts:
            if not 1 <= self.experts_per_token <= self.num_experts:
                raise ConfigError(f"{self.name}: experts_per_token={self.experts_per_token} must be in "
                                  f"[1, num_experts={self.num_experts}]")
            if self.moe_intermediate_size < 1:
                raise ConfigError(f"{self.name}: a mixture of experts needs moe_intermediate_size > 0")
        if self.first_dense_layers > self.num_layers:
            raise ConfigError(f"{self.name}: first_dense_layers={self.first_dense_layers} > "
                              f"num_layers={self.num_layers}")

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices of one MLP (one expert): 3 when gated (gate, up, down: SwiGLU, GeGLU), else 2."""
        return 2 if self.mlp == "gelu" else 3

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def attention_kind(self) -> str:
        """"MLA", "MHA", "MQA" or "GQA" (the last two need ``num_heads``)."""
        if self.is_mla:
            return "MLA"
        if self.num_heads is None or self.num_kv_heads == self.num_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"

    def need(self, *names: str, what: str = "this") -> None:
        """Raise ConfigError naming the fields of ``names`` that are None."""
        missing = [n for n in names if getattr(self, n) is None]
        if missing:
            raise ConfigError(f"{self.name}: {what} needs {missing}; pick a preset or set those fields")

    def replace(self, **changes) -> "ModelShape":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    # derived dimensions
    @property
    def v_dim(self) -> int:
        """Values per V head: ``v_head_dim`` where it differs (MLA), else ``head_dim``."""
        return self.v_head_dim if self.v_head_dim is not None else self.head_dim

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) routes to experts rather than a dense MLP."""
        return self.is_moe and layer >= self.first_dense_layers

    def layer_runs(self) -> tuple[tuple[int, int], ...]:
        """``(first layer, count)`` of each run of layers with one MLP kind (dense, then MoE), so that a
        per-layer sum is a few products, never a loop over ``num_layers`` (a flag may give 2^31 - 1)."""
        dense = self.first_dense_layers if self.is_moe else self.num_layers
        return tuple((first, count) for first, count in ((0, dense), (dense, self.num_layers - dense)) if count)




def shape_from_config(config, name: str = "model") -> ModelShape:
    """The ``ModelShape`` of a ``minikv.model.ModelConfig`` (a Llama-style SwiGLU decoder with RMSNorm)."""
    c = config
    common = dict(name=name, num_layers=c.num_layers, hidden_size=c.hidden_size, num_heads=c.num_heads,
                  intermediate_size=c.intermediate_size, vocab_size=c.vocab_size, tie_embeddings=c.tie_embeddings,
                  max_context=c.max_position)
    mla = getattr(c, "mla", None)
    if mla is None:
        return ModelShape(**common, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim)
    # an MLA model's ModelConfig carries the absorbed geometry (one latent head); the shape wants the heads
    return ModelShape(**common, num_kv_heads=c.num_heads, head_dim=mla.qk_nope_head_dim, rope_dim=mla.qk_rope_head_dim,
                      v_head_dim=mla.v_head_dim, kv_lora_rank=mla.kv_lora_rank, q_lora_rank=mla.q_lora_rank or 0)
