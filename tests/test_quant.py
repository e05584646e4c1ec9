"""Step 5, the codecs: llama.cpp's bytes exactly, round-trip errors within their analytic bounds, exact packing."""

import ml_dtypes
import numpy as np
import pytest
from gguf.quants import GGMLQuantizationType, dequantize, quantize

from minikv.errors import ConfigError, ShapeError
from minikv.quant import CODECS, codec, kv_format
from minikv.quant.codecs import (
    decode_asym,
    decode_fp8,
    encode_asym,
    encode_fp8,
    pack_bits,
    round_half_away,
    to_fp8,
    unpack_bits,
)

EPS = float(np.finfo(np.float32).eps)
GGUF = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0, "q4_1": GGMLQuantizationType.Q4_1}


def f16(a):
    return np.asarray(a, np.float32).astype(np.float16).astype(np.float32)


def groups(x, g=32):
    return np.asarray(x, np.float32).reshape(-1, g)


# --- inputs that stress the rounding -------------------------------------------------------------

def ties(name):
    """Groups whose x/d lands exactly on k + 1/2 for the codec's own d (d = 1 by construction)."""
    k = np.arange(32, dtype=np.float32)
    if name == "q8_0":  # amax 127 -> d = 1; x = +-(j + 0.5) rounds away from zero
        g = np.concatenate([[127.0], (k[:31] % 100) + 0.5]) * np.where(k % 2, -1, 1)
    elif name == "q4_0":  # the largest |x| is -8 -> d = 1; x + 8.5 hits integers + 0.5 -> exact, no tie to break
        g = np.concatenate([[-8.0], (k[:31] % 15) - 7.5])
    else:  # q4_1: min 0, max 15 -> d = 1; (x - 0) + 0.5 with x = j + 0.5 -> exact integer
        g = np.concatenate([[0.0, 15.0], (k[:30] % 14) + 0.5])
    return np.stack([g, -g, g * 0.25, g * 3.0]).astype(np.float32)


def cases(name):
    rng = np.random.default_rng(len(name))
    odd = rng.standard_normal((5, 96)).astype(np.float32)
    odd[odd > 1.5] = 1 / 3
    odd[:, 7] = np.float32(1e-30)  # subnormal-ish scale in fp16
    return {
        "random": rng.standard_normal((6, 3, 64)).astype(np.float32) * 2.5,
        "odd": odd,
        "ties": ties(name),
        "zeros": np.zeros((2, 32), np.float32),
        "negative_zero": -np.zeros((1, 32), np.float32),
        "constant": np.full((3, 64), 0.7, np.float32),
        "constant_negative": np.full((1, 32), -3.25, np.float32),
        "large": (rng.standard_normal((4, 32)) * 3e4).astype(np.float32),
        "huge": (rng.standard_normal((2, 32)) * 1e6).astype(np.float32),  # d overflows fp16 for q4_1: both inf
        "one_spike": np.where(np.arange(64) == 5, 1e3, 1e-3).astype(np.float32)[None],
    }


CASES = [(n, c) for n in GGUF for c in cases(n)]


@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning", "ignore:invalid value:RuntimeWarning")  # "huge"
@pytest.mark.parametrize("name, case", CASES, ids=[f"{n}-{c}" for n, c in CASES])
def test_bytes_identical_to_gguf(name, case):
    """Byte for byte llama.cpp's records, except where llama.cpp stores an fp16 scale or min that overflowed
    to inf ("huge" for q4_0/q4_1): that record saturates here (minikv.quant.codecs' docstring), finite."""
    x = cases(name)[case]
    c = codec(name)
    got = c.encode(x)
    want = quantize(x, GGUF[name])
    assert got.dtype == np.uint8 and got.shape == want.shape == (*x.shape[:-1], c.bytes_for(x.shape[-1]))
    rec = want.reshape(-1, c.group_bytes)
    header = 4 if name == "q4_1" else 2
    overflowed = ~np.isfinite(rec[:, :header].copy().view("<f2")).all(axis=1)  # inf scale (or min) in gguf's record
    assert overflowed.any() == (case == "huge" and name != "q8_0")
    ours = got.reshape(-1, c.group_bytes)
    assert np.array_equal(ours[~overflowed], rec[~overflowed]), f"{name}/{case}: records differ"
    assert (ours[overflowed, :header].copy().view("<f2").astype(np.float32) == 65504).any(axis=1).all()
    back = c.decode(got)
    assert back.dtype == np.float32 and np.isfinite(back).all()
    keep = np.repeat(~overflowed, 32).reshape(back.shape)
    assert np.array_equal(back[keep], dequantize(want, GGUF[name])[keep], equal_nan=True)


def test_round_half_away_is_exact_where_floor_plus_half_is_not():
    x = np.array([0.5, 1.5, 2.5, -0.5, -2.5, 0.49999997, -0.49999997, 126.5, 3.4999998], np.float32)
    assert round_half_away(x).tolist() == [1, 2, 3, -1, -3, 0, 0, 127, 3]
    assert np.floor(np.float32(0.49999997) + np.float32(0.5)) == 1  # the trap avoided


# --- round-trip error bounds --------------------------------------------------------------------------

def bound_q8_0(x):
    """|x - x^| <= d/2 + 127 |d - fp16(d)| (+ float32 rounding of x/d): d = amax/127 per group."""
    g = groups(x)
    d = np.abs(g).max(axis=1, keepdims=True) / np.float32(127)
    return d / 2 + 127 * np.abs(d - f16(d)) + 4 * EPS * np.abs(g).max(axis=1, keepdims=True)


def bound_q4_0(x):
    """d = max/-8 (the signed largest |x|): codes q - 8 in [-8, 7], so |err| <= |d|/2 where x/d <= 7.5,
    and <= |d| on the clipped side (x/d in (7.5, 8], the sign opposite to the max)."""
    g = groups(x)
    big = np.take_along_axis(g, np.abs(g).argmax(axis=1)[:, None], axis=1)
    d = big / np.float32(-8)
    with np.errstate(divide="ignore", invalid="ignore"):
        clipped = np.where(d == 0, False, g / d > 7.5)
    return np.where(clipped, np.abs(d), np.abs(d) / 2) + 8 * np.abs(d - f16(d)) + 4 * EPS * np.abs(big)


def bound_affine(x, levels, stored_scale):
    """Scale s, zero m = min: |err| <= s/2 + |m - fp16(m)| + levels |s - fp16(s)| (+ rounding)."""
    g = groups(x)
    lo, hi = g.min(axis=1, keepdims=True), g.max(axis=1, keepdims=True)
    s = (hi - lo) / np.float32(levels)
    s16 = f16(s) if stored_scale else s
    return (np.maximum(s, s16) / 2 + np.abs(lo - f16(lo)) + levels * np.abs(s - f16(s))
            + 4 * EPS * np.maximum(np.abs(lo), np.abs(hi)))


BOUNDS = {
    "q8_0": bound_q8_0,
    "q4_0": bound_q4_0,
    "q4_1": lambda x: bound_affine(x, 15, stored_scale=False),
    "asym2": lambda x: bound_affine(x, 3, stored_scale=True),
    "asym4": lambda x: bound_affine(x, 15, stored_scale=True),
}


@pytest.mark.parametrize("name", list(BOUNDS))
@pytest.mark.parametrize("case", ["random", "odd", "zeros", "constant", "large", "one_spike"])
def test_round_trip_error_within_the_analytic_bound(name, case):
    x = cases("q8_0")[case]
    c = codec(name, 32)
    err = np.abs(groups(c.decode(c.encode(x))) - groups(x))
    bound = BOUNDS[name](x)
    assert np.all(np.isfinite(err)), f"{name}/{case}: NaN or inf"
    assert np.all(err <= bound), f"{name}/{case}: worst excess {float((err - bound).max())}"
    if case == "zeros":
        assert not err.any()  # an all-zero group comes back exactly


def test_the_q4_0_bound_is_tight_on_the_clipped_side():
    """The value opposite in sign to the group's max cannot reach +8 d: it costs a whole |d|."""
    x = np.zeros(32, np.float32)
    x[0], x[1] = -8.0, 8.0  # d = 1; 8 -> code 16, clipped to 15 -> 7
    assert codec("q4_0").decode(codec("q4_0").encode(x))[1] == 7.0


def fp8_bound(x, fmt, group=32):
    """fp16 s = amax/max_fp8 per group; |err| <= rel |x| + s sub + (|x| - max_fp8 s)+  (saturation),
    rel = half a mantissa step (2^-4 e4m3fn, 2^-3 e5m2), sub = half the smallest subnormal."""
    rel, sub, big = {"e4m3fn": (2.0 ** -4, 2.0 ** -10, 448.0), "e5m2": (2.0 ** -3, 2.0 ** -17, 57344.0)}[fmt]
    g = groups(x, group)
    s = f16(np.abs(g).max(axis=1, keepdims=True) / np.float32(big))
    return rel * np.abs(g) * (1 + 4 * EPS) + s * sub + np.maximum(0, np.abs(g) - big * s) * (1 + 4 * EPS)


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
@pytest.mark.parametrize("case", ["random", "odd", "zeros", "constant", "large", "one_spike"])
def test_fp8_round_trip_within_its_bound(fmt, case):
    x = cases("q8_0")[case]
    got = decode_fp8(encode_fp8(x, 32, fmt), 32, fmt)
    err, bound = np.abs(groups(got) - groups(x)), fp8_bound(x, fmt)
    assert np.all(np.isfinite(got)) and np.all(err <= bound), float((err - bound).max())


@pytest.mark.parametrize("name, rel", [("fp16", 2.0 ** -11), ("bf16", 2.0 ** -8), ("fp32", 0.0)])
def test_casts_round_within_half_an_ulp(name, rel):
    x = cases("q8_0")["random"]
    c = codec(name)
    assert c.encode(x).shape[-1] == c.bytes_for(x.shape[-1]) == x.shape[-1] * {"fp16": 2, "bf16": 2, "fp32": 4}[name]
    assert np.all(np.abs(c.decode(c.encode(x)) - x) <= rel * np.abs(x))


# --- fp8 saturates ------------------------------------------------------------------------------------------

def test_fp8_saturates_instead_of_nan():
    raw = np.array([1000.0], np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    assert np.isnan(raw[0])  # the trap: ml_dtypes' cast of an out-of-range value to E4M3FN
    got = to_fp8(np.array([1000.0, -1e9, np.inf, -np.inf, 448.0, 300.0], np.float32)).astype(np.float32)
    assert got.tolist() == [448.0, -448.0, 448.0, -448.0, 448.0, 288.0]  # 300 rounds to the nearest: 288
    assert to_fp8(np.array([1e9], np.float32), "e5m2").astype(np.float32)[0] == 57344.0  # not inf


def test_fp8_saturates_when_the_fp16_scale_rounds_down():
    """amax / fp16(amax/448) > 448 whenever the scale rounds down: the cast must clip, not NaN."""
    rng = np.random.default_rng(3)
    for _ in range(200):
        amax = np.float32(rng.uniform(1, 100))
        if f16(amax / np.float32(448)) < amax / np.float32(448):
            break
    x = np.full(32, 0.5, np.float32)
    x[3] = amax
    got = decode_fp8(encode_fp8(x, 32), 32)
    s = f16(amax / np.float32(448))
    assert amax / s > 448 and got[3] == np.float32(448) * s and np.all(np.isfinite(got))


# --- packing ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_is_the_identity(bits):
    q = np.random.default_rng(bits).integers(0, 1 << bits, (3, 5, 64)).astype(np.uint8)
    packed = pack_bits(q, bits)
    assert packed.shape == (3, 5, 64 * bits // 8) and packed.dtype == np.uint8
    assert np.array_equal(unpack_bits(packed, bits), q)


def test_pack_order_is_low_bits_first():
    assert pack_bits(np.array([1, 2, 3, 0], np.uint8), 2).tolist() == [1 | 2 << 2 | 3 << 4]
    assert pack_bits(np.array([0xA, 0x5], np.uint8), 4).tolist() == [0x5A]


@pytest.mark.parametrize("bits", [2, 4])
def test_asym_hits_every_code_and_comes_back_exactly_on_the_grid(bits):
    """Values that sit on the codec's own grid (s and z exact in fp16) decode exactly."""
    levels = (1 << bits) - 1
    x = (np.arange(32) % (levels + 1)).astype(np.float32) * 0.25 - 1.0
    b = encode_asym(x, bits, 32)
    assert b.shape == (4 + 32 * bits // 8,)
    assert np.array_equal(decode_asym(b, bits, 32), x)


# --- sizes, bytes and refusals ------------------------------------------------------------------------------

def test_bytes_per_value_of_every_codec():
    want = {"q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32, "asym2": 12 / 32, "asym4": 20 / 32,
            "fp8_e4m3fn": 34 / 32, "fp8_e5m2": 34 / 32, "fp32": 4, "fp16": 2, "bf16": 2}
    assert set(want) == set(CODECS)
    x = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
    for name, per in want.items():
        c = codec(name, 32)
        assert c.bytes_per_value == per and c.bytes_for(64) == 64 * per
        assert c.encode(x).shape == (2, c.bytes_for(64))


@pytest.mark.parametrize("name", list(CODECS))
def test_all_zero_and_constant_groups_give_no_nan(name):
    c = codec(name, 32)
    for v in (0.0, -0.0, 1.0, -7.5, 1e-8, 3e4):
        x = np.full((2, 32), v, np.float32)
        back = c.decode(c.encode(x))
        assert np.all(np.isfinite(back)), (name, v)
        assert np.all(np.abs(back - x) <= 2.0 ** -7 * abs(v) + 1e-7), (name, v)  # fp16 scale/zero rounding


def test_sizes_that_do_not_divide_the_group_are_refused_naming_it():
    with pytest.raises(ShapeError, match="group of 32"):
        codec("q8_0").encode(np.zeros((2, 40), np.float32))
    with pytest.raises(ShapeError, match="group of 16"):
        codec("asym4", 16).encode(np.zeros(24, np.float32))
    with pytest.raises(ShapeError, match="34-byte"):
        codec("q8_0").decode(np.zeros(35, np.uint8))
    with pytest.raises(ConfigError, match="group=16"):
        codec("q4_0", 16)
    with pytest.raises(ConfigError, match="group=3"):
        codec("asym2", 3)
    with pytest.raises(ConfigError, match="'int3'"):
        kv_format("int3", 32, 16, 2, 64)
    with pytest.raises(ConfigError, match="head_dim=48 .* group of 32"):
        kv_format("int8", 32, 16, 2, 48)
    with pytest.raises(ConfigError, match="block_size .*=24 .* group of 16"):
        kv_format("kivi2", 16, 24, 2, 64)
    assert kv_format("fp16", 32, 3, 1, 5).block_bytes() == (3 * 5 * 2, 3 * 5 * 2)  # casts have no group


# --- values a record cannot store (issue 25): large ones saturate, NaN and inf are refused ---------------------

# codec -> the largest magnitude it stores without saturating (minikv.quant.codecs' docstring table)
LIMITS = {"q8_0": 127 * 65504, "q4_0": 8 * 65504, "q4_1": 65504, "asym2": 65504, "asym4": 65504,
          "fp8_e4m3fn": 448 * 65504, "fp8_e5m2": 57344 * 65504, "fp16": 65504}


@pytest.mark.parametrize("name", sorted(LIMITS))
@pytest.mark.parametrize("factor", [1.5, 10.0, 1e30])
def test_a_value_past_what_a_scale_stores_saturates_and_spares_its_group(name, factor):
    """Before: the fp16 scale overflowed to inf and the whole group decoded to NaN/inf (the issue's 2e5 for
    kivi2, 6e5 int4, 9e6 int8, 3e7 fp8). Now the spike saturates and its 31 neighbours stay as they were."""
    c = codec(name, 32)
    rng = np.random.default_rng(3)
    x = rng.uniform(-1, 1, (4, 32)).astype(np.float32)
    spike = np.float32(min(LIMITS[name] * factor, 3e38))
    x[0, 5], x[1, 7] = spike, -spike
    back = c.decode(c.encode(x))
    assert np.isfinite(back).all(), f"{name}: {np.sum(~np.isfinite(back))} values decoded to NaN/inf"
    assert back[0, 5] > 0 and back[1, 7] < 0  # the spikes keep their sign
    assert abs(back[0, 5]) <= np.float32(max(LIMITS[name], 15 * 65504)) * 1.001  # cut to what the record holds
    assert np.allclose(back[2:], c.decode(c.encode(x[2:])))  # other groups untouched
    ok = np.abs(x) <= 1
    if name.startswith(("q8", "q4_0", "fp8", "fp16")):  # symmetric codecs: neighbours decode as finite numbers
        assert np.isfinite(back[ok]).all()


@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_are_refused_naming_the_codec(name, bad):
    from minikv.errors import InvalidInputError

    x = np.ones((2, 32), np.float32)
    x[1, 9] = bad
    with pytest.raises(InvalidInputError, match=f"{name}: 1 of the 64 values to encode are NaN or inf"):
        codec(name, 32).encode(x)


def test_values_inside_the_limits_are_unchanged_by_saturation():
    """The limits are tight: a group whose scale just fits is stored as llama.cpp stores it."""
    x = np.zeros((1, 32), np.float32)
    x[0, 0] = np.float32(127 * 65504)
    assert np.array_equal(codec("q8_0").encode(x), quantize(x, GGUF["q8_0"]))
