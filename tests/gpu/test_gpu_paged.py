"""Step 3 kernels (kernels/paged.cu) and ``minikv_gpu.paged`` against ``minikv.paged``, on every backend.

Kernels: ``reshape_and_cache`` stores exactly what NumPy stores (float16 rounding included)
and skips slot -1; paged attention v1 and v2 equal the NumPy ``paged_attention`` and plain
contiguous attention over the gathered history to 1e-5 (relative to the largest value), for
block sizes 1, 5, 16, contexts of whole blocks and +-1, GQA ratios 1, 3, 8, head_dim 64 and
128, with every slot that holds no token of the context poisoned with NaN; v2 with any
number of partitions equals v1; ``copy_blocks`` copies bit for bit.

The cache: the GPU ``PagedKVCache`` drives the NumPy bookkeeping unchanged, so a model run
on it (prefill, decode, fork + copy-on-write, swap out and in, prefix hits) gives the NumPy
model's logits to 1e-4 (DESIGN.md section 3) with the same block tables.
"""

import json

import numpy as np
import pytest

from minikv import cli
from minikv import paged as ref
from minikv.attention import causal_attention
from minikv.bench.equivalence import EXACT_RTOL, KERNEL_RTOL, rel_err
from minikv.errors import ConfigError, DTypeError, InvalidInputError, OutOfBlocksError, ShapeError
from minikv.weights.random_models import random_model
from minikv_gpu import compare as cmp
from minikv_gpu import model as gpu_model
from minikv_gpu import paged as gpu

RTOL = KERNEL_RTOL
LOGIT_RTOL = EXACT_RTOL[np.float32]



# --- reshape_and_cache --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_reshape_and_cache_writes_through_the_slot_mapping(rt, block_size, dtype):
    rng = np.random.default_rng(block_size)
    num_blocks, hkv, d, n = 11, 3, 64, 9
    pool_k = rng.standard_normal((num_blocks, block_size, hkv, d)).astype(dtype)
    pool_v = rng.standard_normal(pool_k.shape).astype(dtype)
    k, v = (rng.standard_normal((n, hkv, d)).astype(np.float32) for _ in range(2))
    slots = rng.choice(num_blocks * block_size, n, replace=False).astype(np.int64)
    slots[[2, 7]] = -1  # padding tokens: nothing is stored
    want_k, want_v = pool_k.copy(), pool_v.copy()
    keep = slots >= 0
    want_k.reshape(-1, hkv, d)[slots[keep]] = k[keep]  # NumPy's float16 cast rounds to nearest even too
    want_v.reshape(-1, hkv, d)[slots[keep]] = v[keep]
    dk, dv = rt.asarray(pool_k), rt.asarray(pool_v)
    gpu.reshape_and_cache(rt.asarray(k), rt.asarray(v), dk, dv, slots, runtime=rt)
    assert np.array_equal(rt.asnumpy(dk), want_k) and np.array_equal(rt.asnumpy(dv), want_v)


def test_reshape_and_cache_rejects_bad_slots(rt):
    pool = rt.asarray(np.zeros((2, 4, 1, 64), np.float32))
    kv = rt.asarray(np.ones((2, 1, 64), np.float32))
    with pytest.raises(InvalidInputError, match="slot 8"):
        gpu.reshape_and_cache(kv, kv, pool, pool, np.array([0, 8]), runtime=rt)
    with pytest.raises(InvalidInputError, match="slot -2"):
        gpu.reshape_and_cache(kv, kv, pool, pool, np.array([-2, 1]), runtime=rt)
    with pytest.raises(InvalidInputError, match="repeats"):
        gpu.reshape_and_cache(kv, kv, pool, pool, np.array([3, 3]), runtime=rt)
    with pytest.raises(ShapeError, match="slot_mapping"):
        gpu.reshape_and_cache(kv, kv, pool, pool, np.array([1]), runtime=rt)
    with pytest.raises(ShapeError, match="Hkv=1"):
        gpu.reshape_and_cache(rt.asarray(np.ones((2, 2, 64), np.float32)), kv, pool, pool, [0, 1], runtime=rt)


# --- paged attention ------------------------------------------------------------------------------

class PagedBatch:
    """Sequences scattered over a NaN-poisoned pool through shuffled block tables, and their queries.

    Every slot that is not a token of some context holds NaN, both in unused blocks and in the
    stale tail of each last block, so a kernel that reads one returns NaN.
    """

    def __init__(self, rng, context_lens, query_lens, block_size, hq, hkv, d, dtype=np.float32, spare=3):
        self.ctx, self.qlens = np.asarray(context_lens), np.asarray(query_lens)
        self.bs, self.hq, self.hkv, self.d = block_size, hq, hkv, d
        need = [ref.num_blocks_for(c, block_size) for c in self.ctx]
        self.num_blocks = sum(need) + spare
        ids = rng.permutation(self.num_blocks)  # block j of a sequence lands anywhere in the pool
        width = max(need) + 1
        self.tables = np.full((len(need), width), -1, dtype=np.int32)  # padding entries: -1, never read
        shape = (self.num_blocks, block_size, hkv, d)
        self.k_pool = np.full(shape, np.nan, dtype=dtype)
        self.v_pool = np.full(shape, np.nan, dtype=dtype)
        self.history = []
        start = 0
        for b, (c, nb) in enumerate(zip(self.ctx, need)):
            self.tables[b, :nb] = ids[start:start + nb]
            start += nb
            k = rng.standard_normal((c, hkv, d)).astype(dtype)
            v = rng.standard_normal((c, hkv, d)).astype(dtype)
            slots = ref.slot_mapping(self.tables[b, :nb], np.arange(c), block_size)
            self.k_pool.reshape(-1, hkv, d)[slots] = k
            self.v_pool.reshape(-1, hkv, d)[slots] = v
            self.history.append((k.astype(np.float32), v.astype(np.float32)))
        self.q = rng.standard_normal((int(self.qlens.sum()), hq, d)).astype(np.float32)

    def reference(self):
        return ref.paged_attention(self.q, self.k_pool, self.v_pool, self.tables, self.ctx, self.qlens)

    def contiguous(self):
        """Plain attention (minikv.attention) of each sequence's queries over its gathered history."""
        out, row = [], 0
        for (k, v), t in zip(self.history, self.qlens):
            q = self.q[row:row + t].transpose(1, 0, 2)  # [Hq, T, D]; bottom-right causal mask
            out.append(causal_attention(q, k.transpose(1, 0, 2), v.transpose(1, 0, 2)).transpose(1, 0, 2))
            row += t
        return np.concatenate(out)

    def run(self, rt, **kwargs):
        got = gpu.paged_attention(rt.asarray(self.q), rt.asarray(self.k_pool), rt.asarray(self.v_pool), self.tables,
                                  self.ctx, self.qlens, runtime=rt, **kwargs)
        got = rt.asnumpy(got)
        assert got.dtype == np.float32 and got.shape == self.q.shape
        return got


# (Hq, Hkv, D): GQA ratios 1, 3, 8; head_dim 64 and 128
HEADS = [(2, 2, 64), (9, 3, 64), (8, 1, 128), (3, 1, 128)]


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "hq{}_hkv{}_d{}".format(*h))
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_paged_attention_equals_reference_and_contiguous(rt, block_size, heads, version):
    """Decode rows of contexts 1, 2*bs - 1, 2*bs, 2*bs + 1 and 3*bs + 2, plus a 4-token prefill row block."""
    hq, hkv, d = heads
    rng = np.random.default_rng(block_size * 100 + hq)
    bs = block_size
    ctx = [1, 2 * bs - 1 if bs > 1 else 3, 2 * bs, 2 * bs + 1, 3 * bs + 2]
    batch = PagedBatch(rng, ctx, [1, 1, 1, 1, 4], bs, hq, hkv, d)
    got = batch.run(rt, version=version, partition_size=32)
    assert np.all(np.isfinite(got))
    assert rel_err(got, batch.reference()) <= RTOL
    assert rel_err(got, batch.contiguous()) <= RTOL


@pytest.mark.parametrize("version", [1, 2])
def test_float16_pools_equal_the_reference_on_the_same_pools(rt, version):
    """Both sides read the same rounded float16 values and compute in float32."""
    batch = PagedBatch(np.random.default_rng(1), [7, 40, 33], [1, 1, 2], 5, 9, 3, 64, dtype=np.float16)
    got = batch.run(rt, version=version, partition_size=32)
    assert rel_err(got, batch.reference()) <= RTOL


@pytest.mark.parametrize("partition_size", [32, 64, 96, 160])
def test_v2_partitions_merge_to_v1(rt, partition_size):
    """Contexts of 150, 97, 40 and 1 keys in 5, 4, 2 or 1 partitions: the reduce kernel's exp(m_i - m)
    rescaling gives v1's answer, and partitions past a short context are never read."""
    batch = PagedBatch(np.random.default_rng(2), [150, 97, 40, 1], [1, 1, 1, 1], 16, 6, 2, 64)
    v1 = batch.run(rt, version=1)
    v2 = batch.run(rt, version=2, partition_size=partition_size)
    assert rel_err(v2, v1) <= RTOL
    assert rel_err(v1, batch.reference()) <= RTOL


def test_version_choice(sim_rt):
    """The documented rule (the simulator counts as one multiprocessor: 4 blocks fill it)."""
    sim = sim_rt
    assert gpu.v1_or_v2(512, 1, 1, runtime=sim) == 1          # one partition: v1
    assert gpu.v1_or_v2(513, 1, 3, runtime=sim) == 2          # 3 blocks < 4: v2 fills the device
    assert gpu.v1_or_v2(513, 2, 2, runtime=sim) == 1          # 4 blocks: v1
    assert gpu.v1_or_v2(8193, 64, 8, runtime=sim) == 2        # very long context: always v2
    assert gpu.v1_or_v2(100, 1, 1, partition_size=64, runtime=sim) == 2


def test_paged_attention_rejects_what_the_reference_rejects(rt):
    batch = PagedBatch(np.random.default_rng(3), [5, 9], [1, 1], 4, 4, 2, 64)
    kp, vp = rt.asarray(batch.k_pool), rt.asarray(batch.v_pool)
    q = rt.asarray(batch.q)
    with pytest.raises(ShapeError, match="columns"):
        gpu.paged_attention(q, kp, vp, batch.tables[:, :2], batch.ctx, runtime=rt)
    bad = batch.tables.copy()
    bad[0, 0] = batch.num_blocks
    with pytest.raises(InvalidInputError, match="outside the pool"):
        gpu.paged_attention(q, kp, vp, bad, batch.ctx, runtime=rt)
    with pytest.raises(InvalidInputError, match="query_lens"):
        gpu.paged_attention(q, kp, vp, batch.tables, batch.ctx, [2, 1], runtime=rt)
    with pytest.raises(ConfigError, match="version"):
        gpu.paged_attention(q, kp, vp, batch.tables, batch.ctx, version=5, runtime=rt)
    with pytest.raises(ConfigError, match="partition_size"):
        gpu.paged_attention(q, kp, vp, batch.tables, batch.ctx, partition_size=48, runtime=rt)
    with pytest.raises(ConfigError, match="blocks_per_tile"):
        gpu.paged_attention(q, kp, vp, batch.tables, batch.ctx, blocks_per_tile=0, runtime=rt)
    with pytest.raises(DTypeError, match="float32 or float16"):
        gpu.paged_attention(q, kp.astype(np.float64), vp.astype(np.float64), batch.tables, batch.ctx, runtime=rt)
    with pytest.raises(DTypeError, match="float32"):
        gpu.paged_attention(q.astype(np.float64), kp, vp, batch.tables, batch.ctx, runtime=rt)
    wide = rt.asarray(np.zeros((2, 33, 64), np.float32))
    one_head = rt.xp.ascontiguousarray(kp[:, :, :1])
    with pytest.raises(ShapeError, match="C-contiguous"):
        gpu.paged_attention(wide, kp[:, :, :1], kp[:, :, :1], batch.tables, batch.ctx, runtime=rt)
    with pytest.raises(ConfigError, match="33 query heads"):
        gpu.paged_attention(wide, one_head, one_head, batch.tables, batch.ctx, runtime=rt)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("heads", [(9, 3, 64), (32, 8, 128), (8, 1, 128)], ids=lambda h: "hq{}_hkv{}_d{}".format(*h))
def test_full_size_paged_decode(cupy_rt, heads, dtype):
    """GPU only: 8 sequences of 1..4097 tokens in blocks of 16; v1, v2 and the automatic choice."""
    hq, hkv, d = heads
    batch = PagedBatch(np.random.default_rng(4), [4097, 1, 31, 33, 1000, 2048, 4000, 257], [1] * 8, 16, hq, hkv, d,
                       dtype=dtype)
    want = batch.reference()
    for version in (1, 2, 3, None):
        assert rel_err(batch.run(cupy_rt, version=version), want) <= RTOL


# --- copy_blocks -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
def test_copy_blocks_is_exact(rt, dtype):
    rng = np.random.default_rng(5)
    shape = (3, 6, 5, 2, 64)  # [L, blocks, block_size, Hkv, D]
    k, v = (rng.standard_normal(shape).astype(dtype) for _ in range(2))
    dk, dv = rt.asarray(k), rt.asarray(v)
    pairs = [(0, 4), (2, 5), (0, 1)]  # one source copied twice; copy-on-write within one pool
    gpu.copy_blocks(dk, dv, dk, dv, pairs, runtime=rt)
    for s, t in pairs:
        k[:, t], v[:, t] = k[:, s], v[:, s]
    assert np.array_equal(rt.asnumpy(dk), k) and np.array_equal(rt.asnumpy(dv), v)
    stage_k, stage_v = (rt.asarray(np.zeros((3, 2, 5, 2, 64), dtype)) for _ in range(2))
    gpu.copy_blocks(dk, dv, stage_k, stage_v, [(3, 1), (5, 0)], runtime=rt)  # gather into a staging buffer
    assert np.array_equal(rt.asnumpy(stage_k), k[:, [5, 3]]) and np.array_equal(rt.asnumpy(stage_v), v[:, [5, 3]])
    gpu.copy_blocks(dk, dv, dk, dv, [], runtime=rt)  # nothing to do
    with pytest.raises(InvalidInputError, match="both a source and a destination"):
        gpu.copy_blocks(dk, dv, dk, dv, [(1, 2), (2, 3)], runtime=rt)
    with pytest.raises(InvalidInputError, match="destination block 6"):
        gpu.copy_blocks(dk, dv, dk, dv, [(1, 6)], runtime=rt)
    with pytest.raises(InvalidInputError, match="repeat a destination"):
        gpu.copy_blocks(dk, dv, stage_k, stage_v, [(1, 0), (2, 0)], runtime=rt)
    with pytest.raises(ShapeError, match="block counts"):
        gpu.copy_blocks(dk, dv, dk[:, :, :4], dv[:, :, :4], [(1, 0)], runtime=rt)


# --- the cache under the model -------------------------------------------------------------------------

TINY = dict(num_layers=2, num_heads=6, num_kv_heads=2, head_dim=16, hidden_size=42, intermediate_size=70)


class ModelTwin:
    """The NumPy model on a NumPy PagedKVCache and the GPU model on a GPU one, fed identically."""

    def __init__(self, rt, block_size=4, num_blocks=24, dtype=np.float32, layout="half", gpu_kw=None, **cache_kw):
        self.rt = rt
        self.cpu = random_model(rope_layout=layout, seed=11, **TINY)
        self.gpu = gpu_model.from_cpu(self.cpu, runtime=rt, cache_dtype=dtype)
        args = dict(**self.cpu.new_cache_args(), num_blocks=num_blocks, block_size=block_size, dtype=dtype,
                    **cache_kw)
        self.c_cpu = ref.PagedKVCache(**args)
        self.c_gpu = gpu.PagedKVCache(**args, runtime=rt, **(gpu_kw or {}))
        self.c_cpu.k_pool[:] = np.nan  # never-written slots hold NaN on both sides
        self.c_cpu.v_pool[:] = np.nan
        self.c_gpu.k_pool[...] = np.nan
        self.c_gpu.v_pool[...] = np.nan

    def both(self, method, *args, **kwargs):
        outs = [getattr(c, method)(*args, **kwargs) for c in (self.c_cpu, self.c_gpu)]
        assert outs[0] == outs[1], (method, outs)
        return outs[0]

    def forward(self, tokens, seq_ids, all_logits=False):
        want = self.cpu.forward(tokens, self.c_cpu, seq_ids, all_logits=all_logits)
        got = self.rt.asnumpy(self.gpu.forward(tokens, self.c_gpu, seq_ids, all_logits=all_logits))
        assert got.dtype == np.float32 and got.shape == want.shape
        assert rel_err(got, want) <= LOGIT_RTOL
        assert np.array_equal(got.argmax(-1), want.argmax(-1))
        for sid in seq_ids:  # same bookkeeping
            assert self.c_gpu.blocks.table(sid).tolist() == self.c_cpu.blocks.table(sid).tolist()
        return got, want

    def assert_storage_equal(self, tol=0.0):
        for sid in self.c_cpu.seq_ids():
            for layer in range(self.c_cpu.num_layers):
                for a, b in zip(self.c_cpu.read_kv(sid, layer), self.c_gpu.read_kv(sid, layer)):
                    assert a.shape == b.shape and np.allclose(a, b, rtol=tol, atol=tol), (sid, layer)


@pytest.mark.parametrize("layout", ["interleaved", "half"])
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_model_on_gpu_paged_cache_equals_numpy_with_fork_and_copy_on_write(rt, block_size, layout):
    tw = ModelTwin(rt, block_size=block_size, num_blocks=40, layout=layout)
    rng = np.random.default_rng(block_size)
    tw.both("add_sequence", "a")
    tw.both("add_sequence", "b")
    tw.forward([rng.integers(0, 101, 2 * block_size + 1), rng.integers(0, 101, 3)], ["a", "b"], all_logits=True)
    tw.forward([[7], [8]], ["a", "b"])
    tw.both("fork", "a", "c")  # "a" holds 2*bs + 2 tokens: its last block is shared and partly filled
    free = tw.c_gpu.blocks.num_free
    tw.forward([[9], [10], [11]], ["a", "b", "c"])
    expect_copy = 1 if (2 * block_size + 2) % block_size else 0  # bs 1 (and 2): the fork sits on a boundary
    assert tw.c_cpu.blocks.cow_copies == tw.c_gpu.blocks.cow_copies == expect_copy
    assert tw.c_gpu.blocks.table("a")[:-1].tolist() == tw.c_gpu.blocks.table("c")[:-1].tolist()
    assert tw.c_gpu.blocks.num_free == tw.c_cpu.blocks.num_free <= free - expect_copy
    for t in range(3):
        tw.forward([[12 + t], [20 + t], [30 + t]], ["a", "b", "c"])
    tw.assert_storage_equal(tol=1e-5)


def test_model_with_mixed_prefill_and_decode_and_long_context_v2(rt):
    """A long prompt (v2 over 3 partitions of 32 keys) joins a decoding sequence in one step."""
    tw = ModelTwin(rt, block_size=5, num_blocks=40, gpu_kw=dict(partition_size=32))
    rng = np.random.default_rng(0)
    tw.both("add_sequence", 0)
    tw.forward([rng.integers(0, 101, 4)], [0])
    tw.both("add_sequence", 1)
    tw.forward([[3], rng.integers(0, 101, 70)], [0, 1])
    for version in (1, 2):
        tw.c_gpu.version = version
        tw.forward([[4 + version], [9 + version]], [0, 1])


def test_prefix_hit_gives_the_same_logits(rt):
    """A hit reuses the first prompt's blocks; the second prompt's logits equal those of a cache that
    computed everything itself (no prefix caching) and the NumPy model's."""
    tw = ModelTwin(rt, block_size=4, num_blocks=30)
    rng = np.random.default_rng(6)
    system = rng.integers(0, 101, 13).tolist()  # 3 full blocks and one token
    a, b = system + [5, 6, 7], system + [8, 9]
    for sid, prompt in (("a", a), ("b", b)):
        cached = tw.both("add_sequence", sid, prompt_ids=prompt)
        got, _ = tw.forward([prompt[cached:]], [sid], all_logits=True)
    assert cached == 12 and tw.c_gpu.blocks.prefix_hit_tokens == 12
    assert set(tw.c_gpu.blocks.table("b")[:3].tolist()) == set(tw.c_gpu.blocks.table("a")[:3].tolist())
    plain = gpu.PagedKVCache(**tw.cpu.new_cache_args(), num_blocks=10, block_size=4, runtime=rt,
                             enable_prefix_caching=False)
    plain.add_sequence("b")
    full = rt.asnumpy(tw.gpu.forward([b], plain, ["b"], all_logits=True))[12:]
    assert rel_err(got, full) <= RTOL
    assert np.array_equal(got.argmax(-1), full.argmax(-1))


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
def test_swap_out_and_in_through_copy_blocks(rt, dtype):
    tw = ModelTwin(rt, block_size=4, num_blocks=8, dtype=dtype, num_host_blocks=4)
    rng = np.random.default_rng(7)
    tw.both("add_sequence", "s")
    tw.forward([rng.integers(0, 101, 11)], ["s"])
    before = [tw.c_gpu.read_kv("s", layer) for layer in range(2)]
    tw.both("swap_out", "s")
    assert tw.c_gpu.blocks.is_swapped("s") and tw.c_gpu.blocks.num_free == 8
    tw.both("add_sequence", "x")  # scribble over the device pool meanwhile
    tw.forward([rng.integers(0, 101, 30)], ["x"])
    tw.both("free_sequence", "x")
    tw.both("swap_in", "s")
    for layer, (k, v) in enumerate(before):
        k2, v2 = tw.c_gpu.read_kv("s", layer)
        assert np.array_equal(k, k2) and np.array_equal(v, v2)
    for t in range(3):
        tw.forward([[40 + t]], ["s"])
    tw.assert_storage_equal(tol=1e-5 if dtype == np.float32 else 2.0 ** -10)


def test_cache_errors(rt):
    tw = ModelTwin(rt, block_size=4, num_blocks=3)
    c = tw.c_gpu
    c.add_sequence(0)
    ones = lambda *s: rt.asarray(np.ones(s, np.float32))  # noqa: E731
    with pytest.raises(OutOfBlocksError, match="needs 4 new blocks"):
        with c.step([0], [13]):
            pass
    assert c.length(0) == 0 and c.blocks.num_free == 3
    with pytest.raises(RuntimeError, match="abort"), c.step([0], [2]):
        with pytest.raises(ShapeError, match="expected"):
            c.write(0, ones(2, 3, 16), ones(2, 3, 16))
        with pytest.raises(DTypeError, match="float32"):
            c.write(0, rt.asarray(np.ones((2, 2, 16))), ones(2, 2, 16))
        with pytest.raises(InvalidInputError, match="before write"):
            c.attend(0, ones(2, 2, 16))
        c.write(0, ones(2, 2, 16), ones(2, 2, 16))
        with pytest.raises(ShapeError, match="Hq a multiple of the 2 KV heads"):
            c.attend(0, ones(2, 3, 16))
        with pytest.raises(ConfigError, match="version"):
            c.attend(0, ones(2, 6, 16), version=0)
        raise RuntimeError("abort")
    assert c.length(0) == 0 and c.blocks.num_free == 3
    args = dict(num_layers=1, num_kv_heads=1, num_blocks=2, runtime=rt)
    with pytest.raises(DTypeError, match="float64"):
        gpu.PagedKVCache(head_dim=64, dtype=np.float64, **args)
    with pytest.raises(ConfigError, match="head_dim=60"):
        gpu.PagedKVCache(head_dim=60, **args)
    with pytest.raises(ConfigError, match="partition_size"):
        gpu.PagedKVCache(head_dim=64, partition_size=0, **args)
    with pytest.raises(ConfigError, match="block_size"):
        gpu.PagedKVCache(head_dim=64, block_size=0, **args)


# --- minikv compare --cache paged -------------------------------------------------------------------------

def tiny():
    return random_model(num_layers=2, hidden_size=40, num_heads=6, num_kv_heads=2, head_dim=16,
                        intermediate_size=48, vocab_size=300, rope_layout="interleaved", seed=2)


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("block_size", [1, 5])
def test_compare_paged(block_size, dtype):
    res = cmp.compare(tiny(), [5, 7, 11, 13, 17, 19], 5, backend="sim", cache="paged", cache_dtype=dtype,
                      block_size=block_size)
    s = res.summary()
    assert s["tokens_agree"] and s["cache"] == "paged" and s["block_size"] == block_size
    assert s["max_abs_logit_diff"] <= cmp.DEFAULT_TOL[np.dtype(dtype).name]
    assert [p["tokens"] for p in s["per_step"]] == [6, 1, 1, 1, 1]
    with pytest.raises(ConfigError, match="block_size"):
        cmp.compare(tiny(), [1], 2, backend="sim", cache="paged", block_size=0)


def test_compare_cli_paged(capsys, monkeypatch):
    monkeypatch.setattr(cmp, "smollm2_random", lambda seed: tiny())
    code = cli.main(["compare", "--random", "--prompt", "Hello", "--max-new-tokens", "3", "--backend", "sim",
                     "--cache", "paged", "--block-size", "3", "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(out[-1])
    assert code == 0, out
    assert summary["cache"] == "paged" and summary["block_size"] == 3 and summary["tokens_agree"]
    assert "block size 3" in out[0]
