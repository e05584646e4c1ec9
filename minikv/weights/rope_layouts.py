"""The two RoPE layouts, and converting a model's weights between them.

RoPE rotates pairs of dimensions of every query/key head. Which dimensions
form a pair is a convention:

* "half" (transformers' ``rotate_half``): dim ``i`` pairs with ``i + D/2``;
* "interleaved" (llama.cpp): dim ``2i`` pairs with ``2i + 1``.

The model is the same either way, as long as the Q/K projection columns are
ordered to match. llama.cpp's converter permutes the Q and K weights of Llama
models from the Hugging Face order into the interleaved order, so the file's
weights are *interleaved*; transformers un-permutes them when it loads a GGUF.
``permute_qk`` converts between the two (column ``2i + j`` of a head in the
interleaved order is column ``j * D/2 + i`` in the half order), and
``read_gguf(rope_layout=...)`` returns either. Using one layout's weights with
the other layout's rotation still gives fluent text, so only logit tests catch
it.

A model with QK-norm (Gemma-3) normalizes each head over D with a weight per dimension before
RoPE, so those weights follow the permutation too.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from minikv.errors import ShapeError, check_choice, check_int
from minikv.model import ROPE_LAYOUTS, ModelConfig, ModelWeights


def permute_qk(w: np.ndarray, n_heads: int, to_layout: str) -> np.ndarray:
    """Reorder the Q or K projection columns of every head between the two RoPE layouts.

    w:         [..., n_heads * D], the output axis last (our ``wq: [H, Hq*D]``,
               ``wk: [H, Hkv*D]``; pass ``n_heads=Hkv`` for keys)
    to_layout: "interleaved": the input is in "half" order; column ``j*D/2 + i`` of
               each head (half ``j`` in {0, 1}, pair ``i``) moves to column ``2i + j``.
               "half": the inverse, ``2i + j`` -> ``j*D/2 + i``.
    returns:   a new C-contiguous array of the same shape and dtype.

    ``permute_qk(permute_qk(w, n, "interleaved"), n, "half")`` gives back ``w``.
    Only Q and K need this: V and the output projection never see RoPE.
    """
    check_choice("to_layout", to_layout, ROPE_LAYOUTS)
    w = np.asarray(w)
    n_heads = check_int("n_heads", n_heads)
    if w.ndim < 1 or w.shape[-1] % (2 * n_heads):
        raise ShapeError(f"w.shape={w.shape}: the last axis must be n_heads * head_dim with an even head_dim "
                         f"(n_heads={n_heads}); pass the output axis last, as in wq: [H, Hq*D]")
    lead, half = w.shape[:-1], w.shape[-1] // n_heads // 2
    if to_layout == "interleaved":
        out = w.reshape(*lead, n_heads, 2, half).swapaxes(-1, -2)   # [..., heads, D/2, 2]
    else:
        out = w.reshape(*lead, n_heads, half, 2).swapaxes(-1, -2)   # [..., heads, 2, D/2]
    return np.ascontiguousarray(out.reshape(w.shape))


def convert_rope_layout(config: ModelConfig, weights: ModelWeights,
                        to_layout: str) -> tuple[ModelConfig, ModelWeights]:
    """The same model with Q/K columns permuted for ``to_layout`` (config updated to match).

    Other weights are shared with the input, not copied.
    """
    check_choice("rope_layout", to_layout, ROPE_LAYOUTS)
    if config.rope_layout == to_layout:
        return config, weights
    norm = lambda a: None if a is None else permute_qk(a, 1, to_layout)  # noqa: E731  QK-norm: [D], over one head
    layers = [replace(lw, wq=permute_qk(lw.wq, config.num_heads, to_layout),
                      wk=permute_qk(lw.wk, config.num_kv_heads, to_layout), q_norm=norm(lw.q_norm),
                      k_norm=norm(lw.k_norm)) for lw in weights.layers]
    return replace(config, rope_layout=to_layout), replace(weights, layers=layers)
