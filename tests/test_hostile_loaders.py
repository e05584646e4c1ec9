"""Hostile model files (issue 25): every refusal is a ``MinikvError`` that names the file and what is wrong.

Deterministic cases for each cause the audit found (broken safetensors, JSON that is no object,
lenient parsing, zero heads, non-finite weights, shard paths outside the folder, counts that size
giant allocations), then property tests that generate corrupt GGUF and safetensors files and
hostile config.json fields: whatever they hold, loading ends in a model or in a ``MinikvError``,
never another exception, and never after a giant allocation (each example runs under a memory limit).
"""

from __future__ import annotations

import json
import math
import resource
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minikv.errors import ConfigError, MinikvError
from minikv.weights.checkpoints import load_checkpoint
from minikv.weights.gguf import read_gguf
from minikv.weights.random_models import random_model
from tests.parallel_worker import save_checkpoint
from tests.test_gguf import write_tiny_gguf


def tiny():
    return random_model(num_layers=2, hidden_size=16, num_heads=4, num_kv_heads=2, head_dim=4, intermediate_size=12,
                        vocab_size=37, max_position=64, seed=1)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A valid tiny LlamaForCausalLM checkpoint directory."""
    return save_checkpoint(tiny(), tmp_path_factory.mktemp("ckpt") / "llama")


@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path, tiny())
    return path.read_bytes()


def copy_ckpt(src: Path, dst: Path, config: dict | None = None, raw_config: str | None = None,
              shard: bytes | None = None) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(raw_config if raw_config is not None else json.dumps({**cfg, **(config or {})}))
    (dst / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes() if shard is None else shard)
    return dst


def refused(load, *names: str) -> str:
    """``load()`` must raise a MinikvError whose message holds every one of ``names``."""
    with pytest.raises(MinikvError) as info:
        load()
    for name in names:
        assert name in str(info.value), f"{name!r} not in: {info.value}"
    return str(info.value)


# --- safetensors and JSON -------------------------------------------------------------------------------

def _header(shard: bytes) -> tuple[int, dict]:
    (n,) = struct.unpack("<Q", shard[:8])
    return n, json.loads(shard[8:8 + n])


def broken_shards(good: bytes) -> dict:
    n, header = _header(good)
    name = next(k for k in header if k != "__metadata__")
    past = dict(header, **{name: {**header[name], "data_offsets": [0, 10**9]}})
    past_bytes = json.dumps(past).encode()
    return {"empty": b"", "random": bytes(range(256)) * 3, "header 2^62": struct.pack("<Q", 2**62) + b"{}",
            "truncated": good[:len(good) // 2], "header only": good[:8 + n],
            "offsets past EOF": struct.pack("<Q", len(past_bytes)) + past_bytes + good[8 + n:],
            "header not JSON": struct.pack("<Q", 4) + b"{{{{" + good[8 + n:]}


@pytest.mark.parametrize("kind", ["empty", "random", "header 2^62", "truncated", "header only", "offsets past EOF",
                                  "header not JSON"])
def test_a_broken_safetensors_file_is_a_format_error_naming_it(ckpt, tmp_path, kind):
    shard = broken_shards((ckpt / "model.safetensors").read_bytes())[kind]
    path = copy_ckpt(ckpt, tmp_path / "c", shard=shard)
    refused(lambda: load_checkpoint(path), "model.safetensors")


@pytest.mark.parametrize("raw, names", [("[1, 2]", "JSON list"), ("null", "null"), ("7", "JSON int"),
                                        ("{not json", "not valid JSON"), ('"text"', "JSON str")])
def test_a_config_json_that_is_no_object_is_named(ckpt, tmp_path, raw, names):
    path = copy_ckpt(ckpt, tmp_path / "c", raw_config=raw)
    refused(lambda: load_checkpoint(path), "config.json", names)


@pytest.mark.parametrize("field, value, names", [
    ("rope_parameters", [1, 2], "rope_parameters"),
    ("rope_scaling", "yarn", "rope_scaling"),
    ("num_hidden_layers", 2.7, "num_hidden_layers=2.7"),
    ("num_hidden_layers", "2", "num_hidden_layers='2'"),
    ("num_hidden_layers", True, "num_hidden_layers=True"),
    ("num_attention_heads", 0, "num_attention_heads=0"),
    ("num_key_value_heads", 3, "num_heads=4 is not a multiple of num_kv_heads=3"),
    ("tie_word_embeddings", "false", "tie_word_embeddings='false'"),
    ("rms_norm_eps", float("nan"), "rms_norm_eps=nan"),
    ("rms_norm_eps", -1e-6, "rms_norm_eps=-1e-06"),
    ("rope_theta", 0, "rope_theta=0"),
    ("rope_theta", "1e4", "rope_theta='1e4'"),
    ("vocab_size", None, "vocab_size=None"),
    ("hidden_size", 2**70, "hidden_size"),
    ("eos_token_id", -3, "eos_token_id=-3"),
    ("max_position_embeddings", 2**31 - 1, "max_position_embeddings=2,147,483,647 needs"),
    ("num_hidden_layers", 2**31, "num_hidden_layers=2,147,483,648 needs"),
    ("num_hidden_layers", 40, "num_hidden_layers=40 layers, but the file holds only"),
])
def test_lenient_or_hostile_config_fields_are_refused_naming_them(ckpt, tmp_path, field, value, names):
    path = copy_ckpt(ckpt, tmp_path / "c", config={field: value})
    refused(lambda: load_checkpoint(path), names)


def _deepseek_dir(tmp_path) -> Path:
    from minikv.weights.random_models import random_mla_model

    return save_checkpoint(random_mla_model(vocab_size=37, max_position=64), tmp_path / "ds")


@pytest.mark.parametrize("rope, names", [
    (dict(rope_type="yarn", factor=0.0), "factor=0.0"),
    (dict(rope_type="yarn", factor=float("nan")), "factor=nan"),
    (dict(rope_type="yarn", factor=4.0, beta_fast=0), "beta_fast=0"),
    (dict(rope_type="yarn", factor=4.0, truncate="no"), "truncate='no'"),
    (dict(rope_type="yarn", factor=4.0, attention_factor=float("inf")), "attention_factor=inf"),
])
def test_a_yarn_factor_of_zero_is_refused_not_replaced_by_the_fallback(tmp_path, rope, names):
    path = _deepseek_dir(tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "rope_parameters": rope, "max_position_embeddings": 256,
                                                  "original_max_position_embeddings": 64}))
    refused(lambda: load_checkpoint(path), "rope_parameters", names)


@pytest.mark.parametrize("entry", ["../outside.safetensors", "/etc/passwd", "", 7, "sub/../../x.safetensors"])
def test_shard_index_entries_outside_the_folder_are_refused(ckpt, tmp_path, entry):
    path = copy_ckpt(ckpt, tmp_path / "c")
    (tmp_path / "outside.safetensors").write_bytes((ckpt / "model.safetensors").read_bytes())
    names = list(_header((ckpt / "model.safetensors").read_bytes())[1])
    weight_map = {n: "model.safetensors" for n in names if n != "__metadata__"}
    weight_map[next(iter(weight_map))] = entry
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    refused(lambda: load_checkpoint(path), "weight_map", "inside the checkpoint folder")


@pytest.mark.parametrize("index", ["{broken", "[]", '{"weight_map": [1]}'])
def test_a_broken_shard_index_is_named(ckpt, tmp_path, index):
    path = copy_ckpt(ckpt, tmp_path / "c")
    (path / "model.safetensors.index.json").write_text(index)
    refused(lambda: load_checkpoint(path), "model.safetensors.index.json")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path, bad):
    model = tiny()
    model.weights.layers[1].w_up[3, 2] = bad
    path = save_checkpoint(model, tmp_path / "c")
    refused(lambda: load_checkpoint(path), "model.layers.1.mlp.up_proj.weight", "NaN or inf")
    gguf = tmp_path / "t.gguf"
    write_tiny_gguf(gguf, model)
    refused(lambda: read_gguf(gguf), "blk.1.ffn_up.weight", "NaN or inf")


# --- GGUF headers -------------------------------------------------------------------------------------------

def _gguf_with(tmp_path, keys: dict, name="t.gguf") -> Path:
    """The tiny GGUF with some llama.* keys written with other values (and types)."""
    import gguf

    path = tmp_path / name
    original = gguf.GGUFWriter.add_uint32

    def add_uint32(self, key, val):
        short = key.split(".", 1)[1]
        if short in keys:
            v = keys[short]
            (self.add_float32 if isinstance(v, float) else self.add_string if isinstance(v, str)
             else self.add_bool if isinstance(v, bool) else self.add_uint64)(key, v)
        else:
            original(self, key, val)

    gguf.GGUFWriter.add_uint32 = add_uint32
    try:
        write_tiny_gguf(path, tiny())
    finally:
        gguf.GGUFWriter.add_uint32 = original
    return path


@pytest.mark.parametrize("keys, names", [
    ({"attention.head_count": 0}, "llama.attention.head_count=0"),
    ({"embedding_length": 2.5}, "llama.embedding_length=2.5"),
    ({"block_count": "2"}, "llama.block_count='2'"),
    ({"attention.head_count_kv": True}, "llama.attention.head_count_kv=True"),
    ({"block_count": 2**31}, "llama.block_count=2,147,483,648 layers, but the file holds only"),
    ({"block_count": 2**63 - 1}, "llama.block_count"),
    ({"context_length": 2**31 - 1}, "llama.context_length=2,147,483,647 needs"),
])
def test_gguf_counts_that_are_no_integers_or_size_giant_allocations_are_refused(tmp_path, keys, names):
    path = _gguf_with(tmp_path, keys)
    refused(lambda: read_gguf(path), names)


def test_a_context_past_memory_is_a_config_error_with_the_largest_that_fits(tmp_path):
    path = _gguf_with(tmp_path, {"context_length": 2**40})
    with pytest.raises(ConfigError, match=r"the largest llama.context_length that fits is [\d,]+"):
        read_gguf(path)


# --- property tests: generated corrupt files and configs ---------------------------------------------------

LIMIT = 2 * 2**30  # bytes of address space each example may add: a giant allocation fails the test instead


def load_bounded(load):
    """``load()`` under an address-space limit; returns "ok" or the MinikvError's class name."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    usage = _vm_bytes()
    resource.setrlimit(resource.RLIMIT_AS, (usage + LIMIT, hard))
    try:
        load()
        return "ok"
    except MinikvError as e:
        return type(e).__name__
    except MemoryError:
        pytest.fail("a giant allocation was tried before any check")
    except Exception as e:  # noqa: BLE001  (the point: nothing but a MinikvError)
        pytest.fail(f"{type(e).__name__}: {e} is not a MinikvError")
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _vm_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


@st.composite
def mutations(draw, size: int):
    """Byte edits of a file of ``size`` bytes: overwrite runs, truncate, or append garbage."""
    edits = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["overwrite", "overwrite", "truncate", "append"]))
        at = draw(st.integers(0, max(size - 1, 0)))
        edits.append((kind, at, draw(st.binary(min_size=1, max_size=9))))
    return edits


def mutate(data: bytes, edits) -> bytes:
    b = bytearray(data)
    for kind, at, chunk in edits:
        at = min(at, len(b))
        if kind == "truncate":
            del b[at:]
        elif kind == "append":
            b += chunk
        else:
            b[at:at + len(chunk)] = chunk
    return bytes(b)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(data=st.data())
def test_corrupt_gguf_files_load_or_are_refused(gguf_bytes, tmp_path, data):
    edits = data.draw(mutations(len(gguf_bytes)))
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(mutate(gguf_bytes, edits))
    load_bounded(lambda: read_gguf(path))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(data=st.data())
def test_corrupt_safetensors_files_load_or_are_refused(ckpt, tmp_path, data):
    good = (ckpt / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", good[:8])[0]
    # edits aimed at the 8-byte length and the JSON header as often as at the data
    size = data.draw(st.sampled_from([8, 8 + n, len(good)]))
    path = copy_ckpt(ckpt, tmp_path / f"c{data.draw(st.integers(0, 9))}",
                     shard=mutate(good, data.draw(mutations(size))))
    load_bounded(lambda: load_checkpoint(path))


HOSTILE_JSON = st.one_of(
    st.none(), st.booleans(), st.integers(-2, 3), st.sampled_from([2**31, 2**63, 2**70, -2**31]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=5), st.lists(st.integers(0, 3), max_size=2),
    st.dictionaries(st.sampled_from(["rope_type", "factor", "rope_theta"]),
                    st.one_of(st.sampled_from(["yarn", "default", "linear"]), st.floats(-1, 10), st.none()),
                    max_size=3),
)
FIELDS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
          "rope_theta", "rope_parameters", "rope_scaling", "bos_token_id", "eos_token_id", "architectures",
          "hidden_act", "attention_bias", "mlp_bias"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(fields=st.dictionaries(st.sampled_from(FIELDS), HOSTILE_JSON, min_size=1, max_size=3),
       arch=st.sampled_from(["llama", "deepseek", "gemma"]))
def test_hostile_config_fields_load_or_are_refused(ckpt, tmp_path, fields, arch):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = [{"llama": "LlamaForCausalLM", "deepseek": "DeepseekV3ForCausalLM",
                             "gemma": "Gemma3ForCausalLM"}[arch]]
    cfg.update(fields)
    path = copy_ckpt(ckpt, tmp_path / "c", raw_config=json.dumps(cfg))  # NaN and inf as JSON's NaN/Infinity
    got = load_bounded(lambda: load_checkpoint(path))
    if got == "ok":  # what loaded is what the file says, and it is finite
        model = load_checkpoint(path)
        assert math.isfinite(model.config.rope_theta) and model.config.rope_theta > 0
        assert isinstance(model.config.num_layers, int) and model.config.num_layers == cfg["num_hidden_layers"]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(keys=st.dictionaries(st.sampled_from(["block_count", "context_length", "embedding_length",
                                             "feed_forward_length", "attention.head_count",
                                             "attention.head_count_kv", "rope.dimension_count", "vocab_size"]),
                            st.one_of(st.integers(0, 2**64 - 1), st.floats(width=32), st.text(max_size=3),
                                      st.booleans()), min_size=1, max_size=3))
def test_hostile_gguf_metadata_loads_or_is_refused(tmp_path, keys):
    load_bounded(lambda: read_gguf(_gguf_with(tmp_path, keys)))


# --- what --model names -------------------------------------------------------------------------------------

def test_a_fifo_or_a_device_as_the_model_is_named_as_such_not_as_missing(tmp_path):
    import os

    from minikv.errors import ModelFileNotFoundError, ModelFormatError
    from minikv.weights.gguf import find_model_file

    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)  # opening it to read would block forever: the check must come before
    for path, kind in ((fifo, "a FIFO"), ("/dev/zero", "a character device")):
        with pytest.raises(ModelFormatError, match=kind):
            find_model_file(path)
        with pytest.raises(ModelFileNotFoundError, match="is not a directory"):
            load_checkpoint(path)
    with pytest.raises(ModelFileNotFoundError, match="does not exist"):
        find_model_file(tmp_path / "absent.gguf")


@pytest.mark.parametrize("field, value", [("factor", float("inf")), ("beta_fast", float("nan")), ("beta_slow", 0.0),
                                          ("attention_factor", -1.0), ("mscale", float("inf"))])
def test_yarn_config_checks_every_float_it_builds_tables_from(field, value):
    from minikv.layers import YarnConfig

    with pytest.raises(ConfigError, match=f"yarn {field}="):
        YarnConfig(**{"factor": 4.0, "original_max_position": 64, field: value})
