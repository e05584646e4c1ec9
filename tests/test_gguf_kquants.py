"""GGUF block formats dequantized by ``minikv.weights.quants``, bit for bit equal to the ``gguf`` package's
``gguf.quants.dequantize`` (ggml's reference): on random blocks, and on every tensor of Gemma-3's file
(Q4_K, Q6_K, Q5_0, Q8_0, F32)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize

from minikv.errors import ModelFormatError
from minikv.weights.quants import BLOCKS, dequantize

# where each format keeps its float16 fields (d, and m / dmin), by byte offset in a block
F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}
# finite float16 values with edge cases among them: zeros of both signs, subnormals, the largest
SPECIAL = np.array([0.0, -0.0, 6e-8, -6e-8, 6.1e-5, 65504.0, -65504.0, 1.0, -1.0, 0.1], dtype=np.float16)


def random_blocks(fmt: str, n_blocks: int, rng) -> np.ndarray:
    """[n_blocks, bytes per block] random bytes whose float16 fields are finite: the ``SPECIAL`` values in the
    first blocks, random normal ones after."""
    nbytes = BLOCKS[fmt][1]
    raw = rng.integers(0, 256, size=(n_blocks, nbytes), dtype=np.uint8)
    for off in F16_FIELDS[fmt]:
        vals = rng.standard_normal(n_blocks).astype(np.float16)
        vals[: SPECIAL.size] = SPECIAL[:n_blocks]
        raw[:, off:off + 2] = vals.view(np.uint8).reshape(n_blocks, 2)
    return raw


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype == np.float32 and np.array_equal(a.view(np.uint32),
                                                                                      b.view(np.uint32))


@pytest.mark.parametrize("fmt", sorted(F16_FIELDS))
def test_random_blocks_dequantize_bit_exactly(fmt):
    raw = random_blocks(fmt, 64, np.random.default_rng(len(fmt)))
    want = gguf_dequantize(raw, gguf.GGMLQuantizationType[fmt])
    got = dequantize(raw, fmt, want.shape)
    assert same_bits(got, want), f"{fmt}: max |diff| {np.nanmax(np.abs(got - want))}"


@pytest.mark.parametrize("fmt", ["F32", "F16"])
def test_float_tensors_pass_through(fmt):
    want = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32 if fmt == "F32" else np.float16)
    assert same_bits(dequantize(want.view(np.uint8), fmt, (3, 8)), want.astype(np.float32))


def test_a_flipped_bit_changes_the_values():
    """The comparison can fail: one bit of one Q6_K block's high bits moves exactly one value."""
    raw = random_blocks("Q6_K", 16, np.random.default_rng(1))
    raw[12, 192:208] = 3  # the sub-block scales of block 12 (whose d is random, not a special value)
    flipped = raw.copy()
    flipped[12, 128 + 2] ^= 0x04  # qh byte 2: bits 2-3 are the high bits of value 32 + 2
    diff = dequantize(raw, "Q6_K", (16, 256)) != dequantize(flipped, "Q6_K", (16, 256))
    assert np.argwhere(diff).tolist() == [[12, 34]]


def test_bad_formats_and_sizes_are_refused():
    with pytest.raises(ModelFormatError, match="IQ2_XXS"):
        dequantize(np.zeros(66, np.uint8), "IQ2_XXS", (256,))
    with pytest.raises(ModelFormatError, match="144"):
        dequantize(np.zeros(143, np.uint8), "Q4_K", (256,))  # a truncated block
    with pytest.raises(ModelFormatError, match="Q5_0"):
        dequantize(np.zeros(22, np.uint8), "Q5_0", (31,))  # not whole blocks


@pytest.mark.gemma
def test_every_tensor_of_the_gemma_file_dequantizes_bit_exactly(gemma3_path):
    reader = gguf.GGUFReader(gemma3_path)
    formats = set()
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))
        want = gguf_dequantize(t.data, t.tensor_type).reshape(shape)
        assert same_bits(dequantize(t.data, t.tensor_type.name, shape), want), t.name
        formats.add(t.tensor_type.name)
    assert {"Q4_K", "Q6_K", "Q5_0", "Q8_0", "F32"} <= formats
