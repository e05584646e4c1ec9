"""Step 3: the paged KV cache (read ``minikv.textbook.s3_paged`` first, then these files in order).

``allocator``  block ids, ref counts, chained hashes, the prefix cache and its LRU list
``manager``    per-sequence block tables, admission, fork with copy-on-write, swap plans, step bookkeeping
``attention``  the layout, the slot mapping, attention that reads blocks through a block table
``cache``      ``PagedKVCache``: the pools, ``write`` through the slot mapping, ``attend``
``truncate``   step 7's rollback of a block table (speculative decoding)
"""

from minikv.paged.allocator import Block, BlockAllocator, HashFn, ceil_div, chain_hash, num_blocks_for
from minikv.paged.attention import (
                                    TileLoader,
                                    check_paged_attention_args,
                                    default_blocks_per_tile,
                                    gather_blocks,
                                    paged_attention,
                                    query_positions,
                                    slot_mapping,
)
from minikv.paged.cache import PagedKVCache
from minikv.paged.manager import BlockManager, SeqState, StepPlan
from minikv.paged.truncate import truncate_table

__all__ = ["Block", "BlockAllocator", "BlockManager", "HashFn", "PagedKVCache", "SeqState", "StepPlan", "TileLoader",
           "ceil_div", "chain_hash", "check_paged_attention_args", "default_blocks_per_tile", "gather_blocks",
           "num_blocks_for", "paged_attention", "query_positions", "slot_mapping", "truncate_table"]
