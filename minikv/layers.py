"""The small math the model and the steps share: the linear map, RMSNorm, SiLU and GELU, RoPE (plain and YaRN).

It sits below the steps (``minikv.mla`` needs YaRN's softmax factor) and below the model,
which re-exports every name here (``from minikv.model import apply_rope`` keeps working).
YaRN follows transformers 5.24's ``modeling_rope_utils._compute_yarn_parameters``, with the
angles computed in float64 (transformers: float32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from minikv.errors import check_choice, check_float, check_int

ROPE_LAYOUTS = ("interleaved", "half")


# A pass over a few tokens (2 .. THIN_TOKENS: a speculative verify, a short chunk) multiplies the weights
# ROW_BLOCK output rows at a time. One [T, in] x [in, out] product hands OpenBLAS a thin GEMM whose packing
# of the whole weight costs 2-3x a one-token pass (a matrix-vector product) that reads the same bytes; a
# 64-row block stays in the core's cache while it is packed and used, and the pass costs about what it reads
# (benchmarks/results/decode_profile.json). One token keeps the matrix-vector product; past THIN_TOKENS
# the plain GEMM is as fast.
ROW_BLOCK = 64
THIN_TOKENS = 32


def linear(x: np.ndarray, w_t: np.ndarray) -> np.ndarray:
    """x: [N, in], w_t: [out, in] (a weight stored transposed, torch's Linear layout) -> x @ w_t.T: [N, out].

    Every matrix product of the decoder goes through here: one place decides how a product runs.
    """
    n, out = x.shape[0], w_t.shape[0]
    if not 2 <= n <= THIN_TOKENS or out < ROW_BLOCK or not w_t.flags.c_contiguous:
        return x @ w_t.T
    body = out - out % ROW_BLOCK
    y = np.empty((n, out), dtype=np.result_type(x, w_t))
    blocks = np.matmul(w_t[:body].reshape(body // ROW_BLOCK, ROW_BLOCK, w_t.shape[1]), x.T)  # [out/B, B, N]
    y[:, :body] = blocks.transpose(2, 0, 1).reshape(n, body)
    if body < out:
        y[:, body:] = x @ w_t[body:].T
    return y


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x: [N, H] -> x / sqrt(mean(x^2) + eps) * weight."""
    mean_sq = (x * x).sum(axis=-1, keepdims=True) * x.dtype.type(1 / x.shape[-1])  # [N, 1]
    return x * (weight / np.sqrt(mean_sq + x.dtype.type(eps)))  # scale the weight first: one [N, H] pass fewer


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x), with sigmoid written via tanh so large |x| never overflows exp.

    Returns a new array. The formula x * (1/2 + tanh(x/2) / 2) is evaluated in one scratch array, in place:
    a 1,024-token pass's gate is 6 MB, and each fresh array of that size is memory the system must map.
    """
    half = x.dtype.type(0.5)
    s = np.multiply(x, half)
    np.tanh(s, out=s)
    s *= half
    s += half
    s *= x
    return s


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).

    Gemma's MLP activation (transformers' ``gelu_pytorch_tanh``: ``activations.GELUTanh``,
    i.e. ``torch.nn.functional.gelu(x, approximate="tanh")``). Constants in x's dtype.
    """
    t = x.dtype.type
    s = x * x  # one scratch array, in place, as in ``silu``; the same operations, the halving last
    s *= x
    s *= t(0.044715)
    s += x
    s *= t(math.sqrt(2 / math.pi))
    np.tanh(s, out=s)
    s += t(1)
    s *= x
    s *= t(0.5)
    return s


# The gated MLP's activation, by transformers' name (``hidden_act`` / ``hidden_activation``):
# SwiGLU (Llama, SmolLM2, DeepSeek) or GeGLU with the tanh GELU (Gemma).
ACTIVATIONS = {"silu": silu, "gelu_pytorch_tanh": gelu_tanh}  # each returns a new array


def gated_activation(gate_up: np.ndarray, hidden_act: str) -> np.ndarray:
    """gate_up: [N, 2 I] (the gate's I columns, then the up projection's) -> act(gate) * up: [N, I].

    The middle of a gated MLP (SwiGLU, GeGLU), between its two matrix products; the product goes into
    the activation's new array.
    """
    i = gate_up.shape[-1] // 2
    out = ACTIVATIONS[hidden_act](gate_up[:, :i])
    out *= gate_up[:, i:]
    return out


def rope_tables(head_dim: int, max_position: int, theta: float, dtype=np.float32,
                yarn: YarnConfig | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin: [max_position, D/2]. Pair i rotates by angle ``pos * theta^(-2i/D)``.

    With ``yarn`` the frequencies are YaRN's (``YarnConfig.inv_freq``) and cos, sin are both
    multiplied by its ``cos_sin_factor``, as transformers does (so q . k gains its square).

    Angles are computed in float64 and rounded once, so a float32 run and a
    float64 run differ only by that rounding. (transformers computes them in
    float32; on SmolLM2 the two agree to ~5e-5 in the logits, see
    tests/test_reference.py, but float32 angles lose precision at large positions.)
    """
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor = 1.0
    if yarn is not None:
        inv_freq, factor = yarn.inv_freq(head_dim, theta), yarn.cos_sin_factor
    angles = np.arange(max_position, dtype=np.float64)[:, None] * inv_freq[None, :]
    return (np.cos(angles) * factor).astype(dtype), (np.sin(angles) * factor).astype(dtype)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, layout: str) -> np.ndarray:
    """Rotate pairs of dims of x: [N, heads, D] by per-token angles; cos/sin: [N, D/2].

    For a pair (a, b) at angle t: (a, b) -> (a cos t - b sin t, b cos t + a sin t).
    """
    check_choice("rope layout", layout, ROPE_LAYOUTS)
    c, s = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    if layout == "half":
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)
    # "interleaved": adjacent pairs (a, b) are the real and imaginary parts of z = a + ib, and the
    # rotation is one complex multiplication: z * (cos t + i sin t). Viewing the floats as complex
    # numbers does it in one pass instead of strided even/odd slices (~4x faster here).
    z = np.ascontiguousarray(x).view(np.result_type(x.dtype, np.complex64))  # [N, heads, D/2]
    return (z * (c + 1j * s)).view(x.dtype)


# --- YaRN: longer contexts by interpolating the slow RoPE frequencies ---------------------------

def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class YarnConfig:
    """YaRN RoPE scaling, read as transformers 5.24 does (``rope_parameters`` with rope_type "yarn";
    ``original_max_position`` is ``original_max_position_embeddings``; ``attention_factor`` None: derived)."""

    factor: float
    original_max_position: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self):
        # every float the tables use: finite (inf or NaN would fill cos/sin with NaN), positive where it
        # divides or scales; mscale and mscale_all_dim only need to be finite
        for name in ("factor", "beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"):
            val = getattr(self, name)
            if val is not None:
                object.__setattr__(self, name, check_float(f"yarn {name}", val, positive=not name.startswith("m")))
        check_int("yarn original_max_position", self.original_max_position)

    @property
    def cos_sin_factor(self) -> float:
        """What cos and sin are multiplied by (so q_pe . k_pe gains its square)."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    @property
    def softmax_factor(self) -> float:
        """DeepSeek's extra softmax scale ``mscale(factor, mscale_all_dim)^2`` (1 without mscale_all_dim)."""
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0

    def inv_freq(self, dim: int, theta: float) -> np.ndarray:
        """YaRN's inverse frequencies [dim/2], float64: interpolated (/factor) for slow pairs,
        kept for fast ones, with a linear ramp between the correction range's bounds."""
        def correction_dim(rotations):  # the pair index that turns ``rotations`` times over the context
            return dim * math.log(self.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        extrapolation = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
        keep = 1 - ramp  # 1: the pair keeps its frequency; 0: it is interpolated
        return extrapolation / self.factor * (1 - keep) + extrapolation * keep
