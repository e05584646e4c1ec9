"""Shared fixtures.

The SmolLM2 GGUF file and the reference libraries (torch, transformers) are
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


@pytest.fixture(scope="session")
def smollm2_path():
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf (``minikv.weights.gguf.find_model_file``)."""
    from minikv.errors import ModelFileNotFoundError
    from minikv.weights.gguf import find_model_file

    try:
        return find_model_file()
    except ModelFileNotFoundError as e:
        missing(str(e), "MINIKV_REQUIRE_MODEL")


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
