"""Which attention kernel a launch runs, and into how many key ranges it splits: the choices every GPU step
shares (``kv_cache``, ``paged``, ``quant``, ``window``, ``mla``).

Version numbers mean the same idea in every kernel file (``kernels/*.cu``, each with its version log):

* 1: one thread block per unit of work (a token and KV head) over its whole key range, K/V tiles staged in
  shared memory as fp32 (``attend_tiles.cuh``);
* 2: split-K: the same blocks over key ranges, partials merged by the shared ``attention_reduce_v2``;
* 3: the register-resident decode loop (``decode_v3.cuh``): K/V straight into registers with 16-byte
  loads, the GQA group's queries in registers, no barrier in the key loop;
* 4: v3 with the next iteration's loads in flight during this one's math (``decode_v4.cuh``).

(0 is step 1's textbook path in ``minikv_gpu.attention``: the scores materialized, then a softmax kernel.)
``choose_version`` is the one picker; ``split_plan`` the one split rule of the register-resident versions.
"""

from __future__ import annotations

from minikv.errors import ConfigError, InvalidInputError
from minikv_gpu.runtime import get_runtime, multiprocessors

__all__ = ["VERSIONS", "DECODE_VERSIONS", "MAX_DECODE_GROUP", "DECODE_THREADS", "check_version", "choose_version",
           "split_plan", "decode_refusal", "row_dims", "blocks_per_sm", "decode_defines", "decode_splits",
           "block_defines"]

VERSIONS = (1, 2, 3, 4)  # attention kernel versions of the GPU caches; the same N is the same idea in every file:
#   1 one block per unit of work over its whole key range (K/V tiles in shared memory), 2 split-K + the shared
#   reduce, 3 the register-resident decode loop (kernels/decode_v3.cuh), 4 that loop with the next iteration's
#   loads in flight (kernels/decode_v4.cuh). 3 and 4 serve decode steps only.
DECODE_VERSIONS = (3, 4)


def check_version(version, versions=VERSIONS, what: str = "attention"):
    """A ``version=`` argument: None (choose) or one of ``versions``; ConfigError naming them otherwise."""
    if version is not None and (isinstance(version, bool) or version not in versions):
        names = {1: "1 (one block per token and KV head)", 2: "2 (split-K + reduce)",
                 3: "3 (register-resident decode)", 4: "4 (register-resident, loads in flight)"}
        listed = ", ".join(names.get(v, str(v)) for v in versions)
        raise ConfigError(f"version={version!r}; {what} has versions {listed}, or None to choose per step")
    return version


def choose_version(requested, default=None, refusal=None, automatic=None, versions=VERSIONS):
    """The version picker of every GPU attention entry point.

    ``requested`` (a call's ``version=``) wins over ``default`` (a cache's). A register-resident decode
    version (3 or 4), or None, runs where ``refusal`` is None (None picks the newest of ``versions``);
    ``refusal`` is (error type, message) when the launch cannot take them: an explicit request then raises
    it, and a cache's default falls back, because one cache serves prefill steps too. The fallback, like
    an explicit 1 or 2, is ``automatic()`` when given, else None (the caller decides by its split count).
    """
    explicit = requested is not None
    version = check_version(requested if explicit else default, versions)
    if version is not None and version not in DECODE_VERSIONS:
        return version
    decode = [v for v in versions if v in DECODE_VERSIONS]
    if refusal is None and decode:
        return version or max(decode)
    if explicit and refusal is not None:
        raise refusal[0](refusal[1])
    return automatic() if automatic is not None else None


def split_plan(max_keys: int, blocks: int, blocks_per_sm: int, sms: int, *, tile: int = 32, min_keys: int = 256,
               requested: int | None = None) -> tuple[int, int]:
    """(n_splits, keys_per_split) of a register-resident decode launch of ``blocks`` (token, KV head) blocks
    whose longest key range is ``max_keys``.

    The keys are cut evenly into tile-aligned pieces (``ceil(max_keys / z)`` rounded up to ``tile``). The
    count z minimises the launch's time in waves x keys per split (``blocks_per_sm * sms`` blocks a wave, one
    split's fixed cost counted as one more tile), which is what the last wave's idle share costs. A z that
    leaves more blocks than one wave holds but fewer than two waves' worth is never taken (z = 1 excepted):
    its second wave would run almost empty. ``requested`` (a caller's num_splits) is only clamped to at least
    one tile per split; ties go to fewer splits (fewer partials to merge).
    """
    max_keys, blocks = max(int(max_keys), 1), max(int(blocks), 1)
    most = -(-max_keys // tile)
    if requested is not None:
        z = max(1, min(int(requested), most))
    else:
        wave = max(1, blocks_per_sm * sms)
        best = None
        for cand in range(1, max(1, min(most, -(-max_keys // max(min_keys, tile)))) + 1):
            total = blocks * cand
            if cand > 1 and wave < total < 2 * wave:
                continue
            cost = -(-total // wave) * (_even_cut(max_keys, cand, tile) + tile)
            if best is None or cost < best[0]:
                best = (cost, cand)
        z = best[1]
    per = _even_cut(max_keys, z, tile)
    return -(-max_keys // per), per


def _even_cut(max_keys: int, z: int, tile: int) -> int:
    """Keys per split when ``max_keys`` are cut into ``z`` even pieces, rounded up to whole tiles."""
    per = -(-max_keys // z)
    return -(-per // tile) * tile


# --- the register-resident decode versions (3 and 4): what they serve and how they are launched ----------

MAX_DECODE_GROUP = 8  # query heads per KV head that v3 and v4 keep in registers
KEY_TILE = 32         # split boundaries fall on whole tiles of 32 keys
DECODE_THREADS = 128  # 4 warps per block (kernels/decode_core.cuh)


def decode_refusal(group: int, head_dim: int, decode: bool, fused: bool = False) -> tuple[type, str] | None:
    """Why versions 3 and 4 cannot serve a launch, as (error type, message); None when they can."""
    if fused:
        return ConfigError, "the fused rope_write_attend has versions 1 and 2 only (3 and 4 are decode attention)"
    if not decode:
        return InvalidInputError, ("versions 3 and 4 are decode kernels (one new token per sequence) and this step "
                                   "has a sequence with more; use version 1, 2 or None (which falls back)")
    if group > MAX_DECODE_GROUP:
        return ConfigError, (f"versions 3 and 4 keep at most {MAX_DECODE_GROUP} query heads per KV head in "
                             f"registers, got {group}")
    if head_dim & (head_dim - 1):
        return ConfigError, f"versions 3 and 4 need head_dim a power of two (D/8 lanes per key), got {head_dim}"
    return None


def row_dims(version: int, head_dim: int, group: int) -> int:
    """Dims per lane of a plain K/V row (decode_v4.cuh's ROW_DIMS; v3 always spreads 8)."""
    return 16 if version == 4 and head_dim == 128 and group <= 4 else 8


def blocks_per_sm(version: int, group: int, dims: int = 8) -> int:
    """Resident blocks per multiprocessor of a v3/v4 kernel (their __launch_bounds__): the wave's size."""
    if version == 4:
        return 2 if group * dims > 32 else 4
    return 2 if group > 4 else 4


def decode_defines(defines: dict, group: int) -> dict:
    """A cache's compile-time defines plus the group size v3/v4 are specialised to."""
    return {**defines, "GQA_GROUP": int(group)}


def decode_splits(max_context: int, blocks: int, version: int, group: int, head_dim: int, partition_size: int,
                  runtime=None, dims: int | None = None) -> tuple[int, int]:
    """(n_splits, keys_per_split) of a v3/v4 launch of ``blocks`` (token, KV head) pairs: ``split_plan``
    with at least ``partition_size`` keys per split, cut evenly in whole tiles. ``dims``: the kernel's
    dims per lane, when not a plain row's (the quantized kernel's)."""
    dims = row_dims(version, head_dim, group) if dims is None else dims
    return split_plan(max_context, blocks, blocks_per_sm(version, group, dims), multiprocessors(get_runtime(runtime)),
                      tile=KEY_TILE, min_keys=partition_size)


def block_defines(block_size: int) -> dict:
    """v4's compile-time block size: the fast path (a shift and a mask per key) for a power of two,
    else 0 (the kernel divides by its block_size argument)."""
    return {"KV_BLOCK": int(block_size) if block_size & (block_size - 1) == 0 else 0}
