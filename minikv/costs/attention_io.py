"""FlashAttention's I/O argument: the bytes one attention head moves through HBM, against the tile size.

Attention over N queries and N keys of width d, one head, no mask. What costs time on a GPU is
often not the 4 N^2 d FLOPs but the bytes moved between HBM (large, slow) and on-chip SRAM
(small, fast). Counted in elements of ``itemsize`` bytes, reads and writes alike:

    standard   4 N d + 4 N^2
               Q, K read; S = Q K^T written; S read, P = softmax(S) written; P, V read; O written
               (Algorithm 0 of FlashAttention, arXiv 2205.14135: Theta(N d + N^2))
    flash1     N d + 2 N  +  2 N d  +  Tc N (3 d + 4),          Tc = ceil(N / block_k)
               FlashAttention's Algorithm 1: O, l, m initialised in HBM; the outer loop loads each
               K/V block once; for each of them the inner loop loads every query block with its
               O, l, m and writes O, l, m back (per row: two scalars and a d-vector)
    flash2     N d  +  Tr 2 N d  +  N d + N,                    Tr = ceil(N / block_q)
               FlashAttention-2's order (arXiv 2307.08691): the outer loop keeps one query tile
               resident and streams every K/V block past it; O and the row's logsumexp are
               written once, at the end

The tiled forms replace the N^2 terms with N^2 d / block: the larger the tile, the fewer passes
over Q/O (flash1) or K/V (flash2). SRAM bounds the tile: FlashAttention's Algorithm 1 takes
block_k = ceil(M / 4d) for an SRAM of M elements, hence Theorem 2's Theta(N^2 d^2 / M) accesses.
A decode step (one query, ``seq_q = 1``) reads K and V once whatever the tiling: that read is the
KV cache itself.
"""

from __future__ import annotations

from minikv.errors import InvalidInputError, check_choice, check_int

ATTENTION_ORDERS = ("standard", "flash1", "flash2")


def attention_hbm_bytes(seq_len: int, head_dim: int, block_q: int, block_k: int, order: str = "flash1",
                        itemsize: int = 2, seq_q: int | None = None) -> int:
    """HBM bytes one head's attention reads plus writes, for ``seq_q`` queries (default ``seq_len``) over
    ``seq_len`` keys of width ``head_dim``, in query tiles of ``block_q`` and key tiles of ``block_k`` rows.

    ``order``: "standard" (S and P go through HBM; the tiles do not matter), "flash1" (K/V blocks
    outside, query blocks inside: FlashAttention's Algorithm 1) or "flash2" (a query tile resident,
    K/V blocks inside: FlashAttention-2). The formulas are in the module docstring.
    """
    n = check_int("seq_len", seq_len, minimum=1, error=InvalidInputError)
    t = n if seq_q is None else check_int("seq_q", seq_q, minimum=1, error=InvalidInputError)
    d = check_int("head_dim", head_dim, minimum=1, error=InvalidInputError)
    bq = check_int("block_q", block_q, minimum=1, error=InvalidInputError)
    bk = check_int("block_k", block_k, minimum=1, error=InvalidInputError)
    size = check_int("itemsize", itemsize, minimum=1, error=InvalidInputError)
    check_choice("order", order, ATTENTION_ORDERS, error=InvalidInputError)
    if order == "standard":
        elements = 2 * t * d + 2 * n * d + 4 * t * n  # Q, O; K, V; S written, read; P written, read
    elif order == "flash1":
        passes = -(-n // bk)  # Tc: one pass over every query row (Q, O, l, m in; O, l, m out) per K/V block
        elements = (t * d + 2 * t) + 2 * n * d + passes * t * (3 * d + 4)
    else:  # flash2
        passes = -(-t // bq)  # Tr: one pass over K and V per query tile
        elements = t * d + passes * 2 * n * d + t * d + t
    return elements * size
