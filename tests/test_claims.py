"""Seed claims about code rather than arithmetic (docs/claims.md points here).

"Paged attention" code that attends only within the current page is a
different model from PagedAttention: PagedAttention stores K/V in scattered
fixed-size blocks but still attends over *every* cached token, reading the
blocks through a block table. These tests show the difference with step 1's
``causal_attention`` as the reference.
"""

import numpy as np
import pytest

from minikv.attention import causal_attention, softmax

HQ, HKV, D, BLOCK = 4, 2, 8, 8


def _data(seq_len: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((HQ, 1, D))  # the newest token's query: [Hq, 1, D]
    k = rng.standard_normal((HKV, seq_len, D))  # every cached key: [Hkv, S, D]
    v = rng.standard_normal((HKV, seq_len, D))
    return q, k, v


def _paged(k: np.ndarray, v: np.ndarray, rng: np.random.Generator):
    """Scatter the sequence's blocks into a shuffled pool; return (pool_k, pool_v, block_table)."""
    s = k.shape[1]
    n_blocks = -(-s // BLOCK)
    pool_k = np.full((3 * n_blocks, HKV, BLOCK, D), np.nan)  # unused slots hold garbage (NaN)
    pool_v = np.full_like(pool_k, np.nan)
    table = rng.permutation(3 * n_blocks)[:n_blocks]  # logical block i lives in physical block table[i]
    for i, phys in enumerate(table):
        rows = slice(i * BLOCK, min((i + 1) * BLOCK, s))
        n = rows.stop - rows.start
        pool_k[phys, :, :n] = k[:, rows]
        pool_v[phys, :, :n] = v[:, rows]
    return pool_k, pool_v, table


def test_page_local_attention_is_not_paged_attention():
    s = 2 * BLOCK + 5  # two full pages and 5 tokens in the third
    q, k, v = _data(s)
    full = causal_attention(q, k, v)  # the model's attention: all 21 keys
    page_start = (s - 1) // BLOCK * BLOCK
    local = causal_attention(q, k[:, page_start:], v[:, page_start:])  # the seed's "paged attention"
    assert np.max(np.abs(local - full)) > 0.1  # a different function, not a rounding difference
    # it is a window whose size jumps with the position: the first token of a new page sees only itself,
    # so its attention output is just its own value vector (for each query head, its KV head's)
    s1 = 2 * BLOCK + 1
    q1, k1, v1 = _data(s1, seed=1)
    first_of_page = causal_attention(q1, k1[:, 2 * BLOCK:], v1[:, 2 * BLOCK:])  # [Hq, 1, D]
    kv_head = np.arange(HQ) // (HQ // HKV)
    np.testing.assert_allclose(first_of_page[:, 0], v1[kv_head, -1], rtol=1e-12)


def test_paged_attention_reads_every_block_through_the_table():
    """Gather the blocks in block-table order: exactly the contiguous result, whatever the physical order."""
    s = 2 * BLOCK + 5
    q, k, v = _data(s)
    pool_k, pool_v, table = _paged(k, v, np.random.default_rng(2))
    gk = np.concatenate([pool_k[p] for p in table], axis=1)[:, :s]  # drop the unwritten tail of the last block
    gv = np.concatenate([pool_v[p] for p in table], axis=1)[:, :s]
    np.testing.assert_array_equal(causal_attention(q, gk, gv), causal_attention(q, k, v))


def test_block_by_block_softmax_merge_equals_full_attention():
    """Attending one block at a time is fine if the per-block softmaxes are merged (running max + rescale).

    Each block yields its max score m_b, its sum l_b = sum exp(s - m_b) and its
    unnormalized output o_b = sum exp(s - m_b) v. With m = max_b m_b the result
    is sum_b exp(m_b - m) o_b / sum_b exp(m_b - m) l_b. Normalizing inside each
    block and stopping there (the seed's code) drops the other blocks.
    """
    s = 3 * BLOCK + 1
    q, k, v = _data(s, seed=3)
    group = HQ // HKV
    kq, vq = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)  # [Hq, S, D]: query head h reads KV h // G
    ms, ls, os_ = [], [], []
    for start in range(0, s, BLOCK):
        sc = q @ kq[:, start:start + BLOCK].transpose(0, 2, 1) / np.sqrt(D)  # [Hq, 1, block]
        m = sc.max(-1, keepdims=True)
        e = np.exp(sc - m)
        ms.append(m)
        ls.append(e.sum(-1, keepdims=True))
        os_.append(e @ vq[:, start:start + BLOCK])
    m = np.max(ms, axis=0)
    num = sum(np.exp(mb - m) * ob for mb, ob in zip(ms, os_, strict=True))
    den = sum(np.exp(mb - m) * lb for mb, lb in zip(ms, ls, strict=True))
    np.testing.assert_allclose(num / den, causal_attention(q, k, v), rtol=1e-12, atol=1e-12)
    # the seed's version: softmax over the last block only
    last = softmax(q @ kq[:, 3 * BLOCK:].transpose(0, 2, 1) / np.sqrt(D)) @ vq[:, 3 * BLOCK:]
    assert np.max(np.abs(last - causal_attention(q, k, v))) > 0.1


# --- seed claims 22-39 (docs/claims.md): each test decides one claim with minikv ----------------

def test_seed_deepseek_7b_weights_are_about_14_gb():
    from minikv.costs import get_preset, param_count, weights_bytes

    shape = get_preset("deepseek-7b")
    assert param_count(shape)["total"] == 6_910_365_696
    assert weights_bytes(shape, "fp16") == 13_820_731_392  # 13.8 GB, 12.9 GiB: "about 14 GB" in GB


def test_seed_llama_7b_cannot_fit_in_9_gb_in_fp16():
    from minikv.costs import get_preset, kv_bytes_per_token, weights_bytes

    llama = get_preset("llama2-7b")
    assert weights_bytes(llama, "fp16") == 13_476_831_232 > 9e9  # the weights alone exceed the claimed 9 GB
    assert kv_bytes_per_token(llama) == 524_288  # and the cache adds, never subtracts


def test_seed_deepseek_7b_fits_32k_in_memory_but_was_trained_for_4k():
    from minikv.costs import get_preset, kv_cache_bytes, weights_bytes

    ds = get_preset("deepseek-7b")
    w = weights_bytes(ds, "fp16")
    assert w + kv_cache_bytes(ds, prompt_len=32768) == 29_926_858_752  # < 64 GB: one card
    assert w + kv_cache_bytes(ds, prompt_len=131072) == 78_245_240_832  # > 64 GB, < 128 GB: two cards
    assert ds.max_context == 4096  # but the model was trained for 4k tokens


def test_seed_deepseek_v3_caches_576_values_not_128_wide_heads():
    from minikv.costs import expanded_kv_values_per_token, get_preset, kv_values_per_token

    v3 = get_preset("deepseek-v3")
    assert (v3.head_dim, v3.rope_dim, v3.v_dim, v3.kv_lora_rank) == (128, 64, 128, 512)
    assert kv_values_per_token(v3) == 61 * 576 == 35_136
    assert expanded_kv_values_per_token(v3) == 61 * 128 * (192 + 128) == 2_498_560


def test_seed_mla_cache_holds_the_latent_not_decompressed_kv():
    from minikv.mla import LatentContiguousKVCache
    from minikv.weights.random_models import random_mla_model

    model = random_mla_model(dtype=np.float64)
    args = model.new_cache_args()
    mla = args["mla"]
    cache = LatentContiguousKVCache(**args, max_seqs=1, max_len=16, dtype=np.float64)
    cache.add_sequence(0)
    model.forward([np.arange(10) % model.config.vocab_size], cache)
    assert cache.bytes_per_token() == args["num_layers"] * mla.latent_dim * 8  # one latent per layer
    assert args["num_heads"] * (mla.qk_head_dim + mla.v_head_dim) > mla.latent_dim  # the diagram's K and V
    assert cache.bytes_used() == 10 * cache.bytes_per_token()


def test_seed_use_mla_cannot_turn_a_mha_checkpoint_into_mla():
    from minikv.costs import get_preset

    ds7, v3 = get_preset("deepseek-7b"), get_preset("deepseek-v3")
    assert not ds7.is_mla and ds7.kv_lora_rank == 0 and ds7.attention_kind == "MHA"
    assert v3.is_mla and v3.attention_kind == "MLA"


def test_seed_pseudocode_transpose_breaks_multi_head_shapes():
    rng = np.random.default_rng(0)
    s, h, d = 5, 4, 8
    k_cache, v_cache, q = rng.standard_normal((s, h, d)), rng.standard_normal((s, h, d)), rng.standard_normal((h, d))
    assert k_cache.T.shape == (d, h, s)
    with pytest.raises(ValueError):
        q @ k_cache.T  # d != H: the seed's expression does not run
    square = rng.standard_normal((s, d, d))  # H == d: it runs, and returns a [d, H, S] tensor, not [H, S] scores
    assert (rng.standard_normal((d, d)) @ square.T).shape == (d, d, s)
    scores = np.einsum("hd,shd->hs", q, k_cache) / np.sqrt(d)
    p = softmax(scores)
    out = np.einsum("hs,shd->hd", p, v_cache)
    want = causal_attention(q[:, None], k_cache.transpose(1, 0, 2), v_cache.transpose(1, 0, 2))[:, 0]
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)


def test_seed_every_layer_keeps_its_own_cache():
    from minikv.kv_cache import ContiguousKVCache

    geo = dict(num_kv_heads=2, head_dim=8, max_seqs=1, max_len=64)
    one = ContiguousKVCache(num_layers=1, **geo).bytes_allocated()
    assert ContiguousKVCache(num_layers=30, **geo).bytes_allocated() == 30 * one


def test_seed_past_queries_are_not_needed_for_the_next_token():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 12, 8)) for _ in range(3))
    np.testing.assert_allclose(causal_attention(q, k, v)[:, -1:], causal_attention(q[:, -1:], k, v),
                               rtol=1e-12, atol=1e-12)


def test_seed_cached_equals_uncached_up_to_rounding():
    from minikv.kv_cache import ContiguousKVCache, NoCache
    from minikv.weights.random_models import random_model

    m = random_model(dtype=np.float64)
    ids = np.arange(20) % m.config.vocab_size
    full = m.forward([ids], NoCache(**m.new_cache_args(), dtype=np.float64), all_logits=True)
    cache = ContiguousKVCache(**m.new_cache_args(), max_seqs=1, max_len=32, dtype=np.float64)
    cache.add_sequence(0)
    steps = [m.forward([ids[:8]], cache)] + [m.forward([[t]], cache) for t in ids[8:]]
    assert np.abs(np.concatenate(steps) - full[7:]).max() < 1e-12


def test_seed_saved_flops_grow_with_t_and_l():
    from minikv.costs import decode_flops, get_preset, recompute_flops

    def saved(shape, t):
        return recompute_flops(shape, t)["total"] - decode_flops(shape, t)["total"]

    llama = get_preset("llama2-7b")
    assert saved(llama, 100) == 2 * saved(llama.replace(num_layers=16), 100)
    assert saved(llama, 100) < saved(llama, 200) < saved(llama, 300)
    assert saved(llama, 100) // 32 == 40_151_384_064
    assert saved(llama, 100) // 32 > 6 * (99 * 2 * (2 * 4096 * 4096))  # more than the past tokens' K and V


def test_seed_no_cache_recomputes_every_past_k_and_v():
    from minikv.costs import generation_flops, get_preset

    llama = get_preset("llama2-7b")
    ratio = generation_flops(llama, 1, 1000, cache=False) / generation_flops(llama, 1, 1000, cache=True)
    assert 487 < ratio < 488


def test_seed_paged_memory_grows_with_the_sequence():
    from minikv.paged import PagedKVCache
    from minikv.weights.random_models import random_model

    m = random_model()
    cache = PagedKVCache(**m.new_cache_args(), num_blocks=64, block_size=16)
    cache.add_sequence(0)
    held, n = [], 0
    for chunk in (1, 15, 1, 83, 200):
        m.forward([np.arange(chunk) % m.config.vocab_size], cache)
        n += chunk
        held.append((n, cache.blocks.held(0)))
    assert held == [(1, 1), (16, 1), (17, 2), (100, 7), (300, 19)]


def test_seed_paged_pool_has_no_external_fragmentation():
    from minikv.paged import BlockAllocator

    pool = BlockAllocator(8, 16, enable_prefix_caching=False)
    blocks = pool.allocate_many(8)
    for b in blocks[::2]:
        pool.decref(b)
    assert pool.free_block_ids() == [0, 2, 4, 6]
    assert pool.allocate_many(4) == [0, 2, 4, 6] and pool.num_free == 0


def test_seed_paged_cache_shares_full_prefix_blocks():
    from minikv.paged import PagedKVCache
    from minikv.weights.random_models import random_model

    m = random_model()
    cache = PagedKVCache(**m.new_cache_args(), num_blocks=16, block_size=16)
    a = [i % m.config.vocab_size for i in range(40)]
    b = a[:32] + [7, 8, 9]
    cache.add_sequence("a", a)
    m.forward([a], cache, ["a"])
    hit = cache.add_sequence("b", b)
    m.forward([b[hit:]], cache, ["b"])
    assert hit == 32
    assert list(cache.blocks.table("a")) == [0, 1, 2] and list(cache.blocks.table("b")) == [0, 1, 3]
    short = cache.add_sequence("c", a[:10] + [5])  # a shared prefix shorter than one block shares nothing
    assert short == 0


def test_seed_block_size_sets_the_internal_waste():
    from minikv.paged import num_blocks_for

    lengths = [40, 90, 15, 120, 700, 33]
    assert sum(num_blocks_for(n, 16) * 16 for n in lengths) == 1040
    assert sum(num_blocks_for(n, 256) * 256 for n in lengths) == 2048


def test_seed_contiguous_waste_and_the_paged_gain_at_32k():
    from minikv.kv_cache import ContiguousKVCache
    from minikv.paged import PagedKVCache

    lengths, geo = [2000, 9000, 500, 12000], dict(num_layers=1, num_kv_heads=1, head_dim=1)
    contiguous = ContiguousKVCache(**geo, max_seqs=4, max_len=32768)
    paged = PagedKVCache(**geo, num_blocks=2048, block_size=16)
    for i, n in enumerate(lengths):
        for cache in (contiguous, paged):
            cache.add_sequence(i)
            with cache.step([i], [n]):
                cache.write(0, np.zeros((n, 1, 1), np.float32), np.zeros((n, 1, 1), np.float32))
    u_c = contiguous.bytes_used() / contiguous.bytes_allocated()
    u_p = paged.memory_stats()["utilization"]
    assert u_c == sum(lengths) / (4 * 32768) and 1 - u_c > 0.5  # claim 38: over 50% wasted
    assert u_p == 23500 / 23520 and round(u_p / u_c, 1) == 5.6  # claim 39: the gain is 1 / U, here 5.6x


def test_seed_attention_needs_no_full_score_matrix():
    from minikv.attention import causal_attention
    from minikv.online_softmax import attend_contiguous

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((4, 256, 16)) for _ in range(3))    # 4 heads, 256 tokens
    tiled = attend_contiguous(q, k, v, key_tile=16)                       # scores held: one 64 x 16 tile
    assert np.allclose(tiled, causal_attention(q, k, v))                  # the same attention, no 256 x 256
    square = 40 * 2048 * 2048 * 2                                         # Llama-2 13B, one layer, fp16
    assert square == 335_544_320


def test_seed_kernel_fusion_bounds_a_decode_step():
    from minikv.costs import get_preset, kv_bytes_per_token, weights_bytes

    llama = get_preset("llama2-7b")
    weights, per_token = weights_bytes(llama, "fp16"), kv_bytes_per_token(llama, "fp16")
    kv = 2048 * per_token                                  # every cached K and V, read once per step
    step = weights + kv                                    # bytes a batch-1 decode step must move
    fused_write = 2 * per_token                            # the new token's K/V: written, read back
    score_rows = 2 * 32 * 32 * 2048 * 2                    # decode scores, written and read, 32 layers
    assert fused_write / step < 1e-4 and score_rows / step < 1e-3 and step / weights < 1.09


def test_seed_packed_batch_needs_no_length_grouping():
    from minikv.paged import PagedKVCache
    from minikv.weights.random_models import random_model

    m = random_model(dtype=np.float64)
    a, b = np.arange(5) % 101, (7 * np.arange(40)) % 101
    def cache():
        return PagedKVCache(**m.new_cache_args(), num_blocks=16, block_size=16, dtype=np.float64)
    both = cache()
    both.add_sequence("a"), both.add_sequence("b")
    packed = m.forward([a, b], both, ["a", "b"])             # one forward, 5 + 40 = 45 token rows, no padding
    alone = []
    for ids in (a, b):
        c = cache()
        c.add_sequence(0)
        alone.append(m.forward([ids], c)[0])
    assert np.allclose(packed, np.stack(alone))


def test_seed_rope_keys_are_cached_once_rotated():
    from minikv.layers import apply_rope, rope_tables

    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((1, 1, 64)), rng.standard_normal((1, 1, 64))
    cos, sin = rope_tables(64, 4096, 10000.0, dtype=np.float64)
    def score(m, n):     # query at position m, key rotated at position n when it was cached
        qm = apply_rope(q, cos[m:m + 1], sin[m:m + 1], "half")
        kn = apply_rope(k, cos[n:n + 1], sin[n:n + 1], "half")
        return float((qm * kn).sum())
    assert np.isclose(score(10, 3), score(1010, 1003)) and np.isclose(score(10, 3), score(4000, 3993))
    assert not np.isclose(score(10, 3), score(10, 4))   # only the distance matters, and it does matter


def test_seed_prefix_cache_keys_the_whole_prefix():
    from minikv.paged import PagedKVCache, chain_hash
    from minikv.weights.random_models import random_model

    block = list(range(16, 32))
    assert chain_hash(chain_hash(None, range(16)), block) != chain_hash(chain_hash(None, [0] * 16), block)

    m = random_model()
    cache = PagedKVCache(**m.new_cache_args(), num_blocks=16, block_size=16)
    a = [i % 101 for i in range(40)]
    cache.add_sequence("a", a)
    m.forward([a], cache, ["a"])
    b = [5] + a[1:]                                  # one different token in the first block
    assert cache.add_sequence("b", b) == 0           # so its second block, the same tokens, is not reused
    assert cache.add_sequence("c", a[:32] + [9]) == 32


def test_seed_kv_sharding_by_layer_and_by_head():
    from minikv.costs import get_preset, kv_bytes_per_token

    llama = get_preset("llama3-70b")                       # 80 layers, 8 KV heads of 128
    per_gpu = {}
    for tp in (1, 2, 4, 8, 16):
        heads = max(1, llama.num_kv_heads // tp)           # past 8, a head is replicated, not split
        per_gpu[tp] = kv_bytes_per_token(llama.replace(num_kv_heads=heads), "fp16")
    assert per_gpu[1] == 327_680 and per_gpu[8] == per_gpu[16] == 40_960
    stage = kv_bytes_per_token(llama.replace(num_layers=20), "fp16")   # 4 pipeline stages of 20 layers
    assert 4 * stage == per_gpu[1]                         # disjoint layers: nothing held twice, nothing gathered



def test_seed_kv_sharding_with_minikv_parallel():
    """Claim 45 on minikv.parallel's own plan: heads stay local, KV heads replicate past Hkv, tp = 2 splits
    unevenly, MLA striping gives each rank 1/cp; the decode trace formula matches the benchmark's trace."""
    import json
    from pathlib import Path

    from minikv.costs import get_preset, kv_cache_bytes
    from minikv.parallel import Collective, head_plan, imbalance, striped_positions

    smol = get_preset("smollm2-135m")                      # 30 layers, H 576, 9 query / 3 KV heads, V 49152
    bench = json.loads((Path(__file__).resolve().parents[1] / "benchmarks/results/parallel.json").read_text())
    for tp in (1, 2, 3, 9):                                # every query head once, next to the KV head it reads
        plan = head_plan(smol.num_heads, smol.num_kv_heads, tp)
        assert sorted(q for h in plan for q in h.q) == list(range(9)) and all(q // 3 in h.kv for h in plan for q in h.q)

    def cache_per_rank(tp):
        return [kv_cache_bytes(smol.replace(num_heads=len(h.q), num_kv_heads=len(h.kv)), prompt_len=19,
                               output_len=32, dtype="fp32") for h in head_plan(9, 3, tp)]

    assert cache_per_rank(1) == bench["results"]["tp1"]["cache_bytes_per_rank"] == [2_350_080]
    assert cache_per_rank(3) == bench["results"]["tp3"]["cache_bytes_per_rank"] == [783_360] * 3
    assert cache_per_rank(9) == [783_360] * 9 and sum(cache_per_rank(9)) == 3 * sum(cache_per_rank(3))  # replicated
    assert cache_per_rank(2) == [2 * 783_360, 783_360]     # uneven
    assert imbalance(head_plan(9, 3, 2))["attention"] == pytest.approx(1.33, abs=0.005)
    L, H, V = smol.num_layers, smol.hidden_size, smol.vocab_size
    decode = ([Collective("flag", "world", (1,), "int32", 4, 3)]
              + [Collective("allreduce", "tp", (1, H), "float32", 4 * H, 3)] * (1 + 2 * L)
              + [Collective("allgather", "tp", (1, V), "float32", 4 * V, 3)])
    assert sum(c.kind == "allreduce" for c in decode) == 61   # 2 per layer + the embedding; no KV gathered
    assert (len(decode), sum(c.bytes for c in decode)) == (63, 337_156)
    assert (len(decode), sum(c.bytes for c in decode)) == (bench["results"]["tp3"]["collectives_per_token"],
                                                          bench["results"]["tp3"]["payload_bytes_per_token"])
    assert sum(c.wire_bytes for c in decode) == pytest.approx(bench["results"]["tp3"]["ring_bytes_per_rank_per_token"])
    for cp in (1, 2, 3):                                   # MLA striping: position p on rank p mod cp
        held = [int((striped_positions(r, cp, 12) < 12).sum()) for r in range(cp)]
        assert held == [12 // cp] * cp

def test_seed_paged_pool_is_allocated_once():
    from minikv.paged import PagedKVCache
    from minikv.weights.random_models import random_model

    m = random_model()
    cache = PagedKVCache(**m.new_cache_args(), num_blocks=32, block_size=16)
    pools, size = (cache.k_pool, cache.v_pool), cache.bytes_allocated()
    for sid in range(3):
        cache.add_sequence(sid)
        m.forward([np.arange(30 + sid) % 101], cache, [sid])
    for _ in range(20):
        m.forward([[1], [2], [3]], cache, [0, 1, 2])
    cache.free_sequence(1)
    cache.add_sequence(3)
    m.forward([np.arange(40) % 101], cache, [3])
    assert cache.k_pool is pools[0] and cache.v_pool is pools[1]   # no step allocated cache memory
    assert cache.bytes_allocated() == size                 # the same memory, allocated once


def test_seed_paging_is_not_offloading():
    from minikv.errors import InvalidInputError
    from minikv.paged import PagedKVCache
    from minikv.weights.random_models import random_model

    m = random_model()
    cache = PagedKVCache(**m.new_cache_args(), num_blocks=8, block_size=16, num_host_blocks=8)
    cache.add_sequence(0)
    m.forward([np.arange(20)], cache)                        # 20 tokens: 2 device blocks
    cache.swap_out(0)                                        # offloading: all its blocks go to the host
    assert cache.blocks.is_swapped(0) and cache.blocks.num_free == 8
    with pytest.raises(InvalidInputError, match="swapped out"):
        m.forward([[3]], cache)                              # no page fault brings one block back
    cache.swap_in(0)                                         # the whole sequence comes back first
    m.forward([[3]], cache)
    assert cache.length(0) == 21 and cache.blocks.held(0) == 2


def test_seed_smaller_cache_means_larger_batch():
    from minikv.costs import get_preset, kv_bytes_per_token, kv_dtype_bytes_per_token, weights_bytes

    llama = get_preset("llama3-8b")
    free = 80 * 10**9 - weights_bytes(llama, "fp16")              # assumption: an 80 GB GPU, no activations
    fp16, int8 = kv_bytes_per_token(llama, "fp16"), kv_dtype_bytes_per_token(llama, "int8")
    batch = {"fp16 reserve 8k": free // (8192 * fp16), "int8 reserve 8k": free // (8192 * int8),
             "fp16 paged, 2k used": free // (2048 * fp16)}
    assert (fp16, int8) == (131_072, 69_632)
    assert batch == {"fp16 reserve 8k": 59, "int8 reserve 8k": 112, "fp16 paged, 2k used": 238}


def test_seed_offloading_is_bound_by_pcie():
    from minikv.costs import get_preset, kv_bytes_per_token

    pcie, hbm = 25e9, 3.35e12                                  # assumptions: PCIe 4.0 x16, H100 SXM HBM3
    seq = 32768 * kv_bytes_per_token(get_preset("llama3-8b"), "fp16")
    assert round(seq / pcie * 1e3, 1) == 171.8 and round(hbm / pcie) == 134


def test_seed_mla_cache_has_no_head_axis_and_block_size_is_a_trade():
    from minikv.costs import get_preset, kv_values_per_token
    from minikv.paged import num_blocks_for

    v3 = get_preset("deepseek-v3")
    per_layer = kv_values_per_token(v3) // v3.num_layers          # values per token per layer: no head axis
    assert per_layer == v3.kv_lora_rank + v3.rope_dim == 576
    assert 128 * per_layer * 2 == 147_456                          # one 128-token block, one layer, fp16
    lengths = [300, 1000, 70, 4100]
    waste = {bs: sum(num_blocks_for(n, bs) * bs - n for n in lengths) for bs in (64, 128)}
    assert waste == {64: 162, 128: 290}


def test_seed_layers_depend_on_the_layer_below():
    from minikv.kv_cache import ContiguousKVCache
    from minikv.weights.random_models import random_model

    m = random_model(dtype=np.float64)
    ids = np.arange(12) % 101
    caches = []
    for bump in (0.0, 1.0):
        c = ContiguousKVCache(**m.new_cache_args(), max_seqs=1, max_len=16, dtype=np.float64)
        c.add_sequence(0)
        m.forward([ids], c)
        c.k[0, 0, :, 0] += bump                        # perturb layer 0's cached key of token 0
        m.forward([[5]], c)                            # one decode step: token 12
        caches.append(c)
    clean, bumped = caches
    assert np.allclose(clean.k[0, 0, :, 12], bumped.k[0, 0, :, 12])      # layer 0's new key: unchanged
    assert not np.allclose(clean.k[1, 0, :, 12], bumped.k[1, 0, :, 12])  # layer 1's: waits on layer 0


def test_seed_attention_reads_the_token_it_writes():
    from minikv.attention import causal_attention

    rng = np.random.default_rng(0)
    q = rng.standard_normal((4, 1, 16))                     # the new token's query, 4 heads
    k, v = rng.standard_normal((2, 4, 9, 16))               # 8 cached tokens plus the new one
    stale_k, stale_v = k.copy(), v.copy()
    stale_k[:, -1] = stale_v[:, -1] = 0                     # the new slot read before the write landed
    assert not np.allclose(causal_attention(q, k, v), causal_attention(q, stale_k, stale_v))

    write = 2 * 8 * 128 * 2                                 # Llama-3 8B, one layer, one token: K and V, fp16
    read = 4096 * write                                     # that layer's attention at 4,096 tokens
    assert (write, read) == (4096, 16 * 2**20)


def test_seed_split_k_partials_merge_exactly():
    from minikv import online_softmax as osm
    from minikv.attention import causal_attention

    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((4, 1, 16)), rng.standard_normal((4, 64, 16)), rng.standard_normal((4, 64, 16))
    def part(lo, hi):                                       # one split: keys lo..hi-1
        s = osm.start((4, 1), 16, dtype=np.float64)
        return osm.update(s, q @ k[:, lo:hi].transpose(0, 2, 1) / 4.0, v[:, lo:hi])
    split_k = osm.finish(osm.merge(part(0, 40), part(40, 64)))
    assert np.allclose(split_k, causal_attention(q, k, v))  # the decode query sees all 64 keys


def test_seed_three_kinds_of_waste_mapped():
    from minikv.kv_cache import ContiguousKVCache
    from minikv.paged import PagedKVCache

    written, final, geo = 5, 8, dict(num_layers=1, num_kv_heads=1, head_dim=1)
    slab = ContiguousKVCache(**geo, max_seqs=1, max_len=2048)
    paged = PagedKVCache(**geo, num_blocks=4, block_size=16)
    for cache in (slab, paged):
        cache.add_sequence(0)
        with cache.step([0], [written]):
            cache.write(0, np.zeros((written, 1, 1), np.float32), np.zeros((written, 1, 1), np.float32))
    slots = slab.bytes_allocated() // (2 * 4)                           # K and V, one float32 each: 2048 slots
    assert slab.bytes_used() == written * 2 * 4
    reserved, never_used = final - written, slots - final
    assert (slots, reserved, never_used) == (2048, 3, 2040)
    assert paged.blocks.held(0) * 16 - final == 8                   # paged: only the last block's tail
