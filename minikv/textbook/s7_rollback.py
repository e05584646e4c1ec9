"""Step 7: speculative decoding, and the rollback it needs: ``truncate(seq_id, new_len)``.

A decode pass runs one token through the model and reads every weight to do it. At batch 1 the
pass is bound by reading weights, not by arithmetic, so a pass over k + 1 tokens costs little
more than a pass over one. If the next k tokens can be *guessed* cheaply, one pass checks them
all, and every right guess is a token that cost no pass of its own.

Drafts by prompt lookup (no second model): text that copies its context repeats its n-grams.
Take the last n tokens (n = 3, then 2, then 1), find their latest earlier occurrence in prompt
+ generated text, and propose the (up to) k tokens that followed it there.

Verification, greedy: the newest token t0 has no K/V yet. One pass feeds ``[t0, d1, .., dk]``
with ``all_logits``: logits row i is the model's next-token distribution after d_i (row 0: after
t0), each computed from the true prefix plus the drafts before it. Draft d1 is accepted iff it
is the argmax of row 0, d2 iff it is the argmax of row 1, and so on; after the n accepted ones,
the argmax of row n comes free (the *bonus*). A pass yields n + 1 >= 1 tokens, each exactly the
token plain greedy decoding would produce (in float64; in float32 a k + 1 row pass sums in
another order than k + 1 one-row passes, so a near tie could flip).

The rollback: the pass wrote K/V for t0 and all k drafts, and the k - n rejected ones were
computed from wrong tokens. ``truncate`` takes them back: the cache must be what it would be
had they never been written. For step 3's paged cache that is short: the length moves back,
blocks wholly past it return to the pool, and the kept last block's rows past the new length
are stale, hidden by the causal mask until the next step overwrites them (as in step 3). The
engine also rolls back shared blocks (copy-on-write at truncate time), the prefix cache's
hashes and a quantized block the step had closed; an evicting cache (step 6) cannot roll back
at all: what the window dropped is gone.

Run it: ``python -m minikv.textbook.s7_rollback`` (against ``minikv.generate.generate(...,
speculative="ngram")``, which equals plain greedy decoding).
"""

from __future__ import annotations

import numpy as np

from minikv.textbook.s3_paged import PagedCache

# --- NEW in step 7 ---


class RollbackCache(PagedCache):
    """Step 3's paged cache that can take tokens back."""

    def truncate(self, seq_id, new_len: int) -> None:
        """Keep the first ``new_len`` tokens of ``seq_id``: the next step writes at position new_len."""
        table = self.tables[seq_id]
        keep = -(-new_len // self.block_size)  # blocks that still hold a kept token
        for block in reversed(table[keep:]):
            self.allocator.free(block)
        del table[keep:]
        self.lens[seq_id] = new_len


def ngram_draft(ids: list, k: int, max_ngram: int = 3) -> list:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix of ``ids``.

    ids: prompt + generated so far. The suffix length n goes from ``max_ngram`` down to 1; the
    first n with a match wins, and its latest match (the closest context). [] without a match.
    """
    for n in range(min(max_ngram, len(ids) - 1), 0, -1):
        for start in range(len(ids) - n - 1, -1, -1):  # a match needs a token after it
            if ids[start:start + n] == ids[-n:]:
                return ids[start + n:start + n + k]
    return []


def speculative_greedy(model, cache: RollbackCache, prompt_ids: list, max_new_tokens: int,
                       draft_len: int = 4) -> list:
    """Greedy decoding with drafts verified in one pass each: the tokens of ``s1_attention.greedy``."""
    cache.add_sequence(0)
    ids, eos = list(prompt_ids), model.config.eos_token_id
    new = [int(np.argmax(model.forward([ids], cache)[0]))]
    while len(new) < max_new_tokens and new[-1] != eos:
        drafts = ngram_draft(ids + new, min(draft_len, max_new_tokens - len(new) - 1))
        logits = model.forward([[new[-1], *drafts]], cache, all_logits=True)  # [k + 1, V]: one pass checks all
        greedy = [int(t) for t in np.argmax(logits, axis=-1)]  # plain greedy's pick after each fed token
        n = 0
        while n < len(drafts) and drafts[n] == greedy[n]:
            n += 1
        cache.truncate(0, cache.length(0) - (len(drafts) - n))  # the rejected drafts' K/V go
        new += drafts[:n] + [greedy[n]]
    return new[:new.index(eos) + 1] if eos in new else new

# --- end NEW ---


def main(max_new_tokens: int = 16):
    from minikv.textbook.demo import demo, engine, one_by_one

    return demo("step 7, speculative decoding with rollback", one_by_one(lambda model, ids, n: speculative_greedy(
        model, RollbackCache(**model.new_cache_args(), num_blocks=-(-(len(ids) + n) // 16), dtype=model.dtype),
        ids, n)), engine(cache="paged", speculative="ngram"), max_new_tokens,
        questions=("Repeat this sentence twice: the quick brown fox jumps over the lazy dog.",))


if __name__ == "__main__":
    main()
