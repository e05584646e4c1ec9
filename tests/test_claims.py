"""Seed claims about code rather than arithmetic (docs/claims.md points here).

"Paged attention" code that attends only within the current page is a
different model from PagedAttention: PagedAttention stores K/V in scattered
fixed-size blocks but still attends over *every* cached token, reading the
blocks through a block table. These tests show the difference with step 1's
``causal_attention`` as the reference.
"""

import numpy as np

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
