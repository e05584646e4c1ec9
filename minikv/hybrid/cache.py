"""Step 9: per-layer KV caches for models whose layers differ (sliding-window and full attention).

Gemma-3 slides 5 of every 6 layers over a window of W keys (W = 512 for 270m) and gives the 6th
full attention. A sliding layer's query t sees keys t - W + 1 .. t (transformers 5.24,
``masking_utils.sliding_window_overlay``: ``kv_idx > q_idx - sliding_window``), so the layer needs
only its last W keys, while a full layer needs all of them. Sizing every layer as full wastes
most of the cache; a window policy for the whole model would cut the full layers' history.

The window is a property of the cache built for a layer, not of the model: the model calls
``cache.write(layer, k, v)`` and ``cache.attend(layer, q)`` for every layer, as for any cache, and
the hybrid cache sends each layer to the cache of its group::

    layer types  S S S S S F S S S S S F S S S S S F          (Gemma-3-270m, 18 layers)
    groups       window 512: layers 0-4, 6-10, 12-16  ->  a ring of W + K slots (step 6's ``EvictingKVCache``
                                                          with a ``SlidingWindow(W, K)``, ``minikv.hybrid.ring``)
                 full:       layers 5, 11, 17         ->  a contiguous slab (step 2's ``ContiguousKVCache``)

One ``step`` opens a step on every group (they see the same sequences and tokens, so they agree on
the positions) and commits them together (``minikv.hybrid.groups.HybridKVCache``); a step that fails
in any group changes none of them. ``truncate`` works when every group can take the tokens back: a
ring of W + K slots can, for up to K tokens (``minikv.hybrid.ring``).

The ring keeps keys at their original positions (``positions="original"``): exactly what the
model does, so a hybrid cache run equals the uncached forward with each sliding layer masked to
its window (``minikv.hybrid.reference.SlidingNoCache``), and equals transformers' Gemma-3.

``hybrid_cache`` builds the kinds: "none" (the reference), "contiguous" (rings and a slab), "paged"
(one pool of blocks, a block table per group: ``minikv.hybrid.blocks``), and the combinations with
other steps where they make sense: a quantized or evicting cache for the full layers (``full_group``),
beside the sliding rings. A combination that does not make sense is a ``ConfigError``.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from minikv.errors import ConfigError, check_choice, check_int
from minikv.hybrid.blocks import HybridPagedKVCache
from minikv.hybrid.groups import HybridKVCache
from minikv.hybrid.pool import group_layers
from minikv.hybrid.reference import SlidingNoCache
from minikv.hybrid.ring import SlidingRingKVCache
from minikv.kv_cache import ContiguousKVCache, KVCacheBase, NoCache
from minikv.paged.allocator import num_blocks_for

HYBRID_KINDS = ("none", "contiguous", "paged")  # the cache kinds built for a model with sliding layers
LAYER_TYPES = ("full_attention", "sliding_attention")  # transformers' names (``config.layer_types``)


def check_layer_types(layer_types: Sequence[str] | None, num_layers: int, sliding_window: int | None) -> tuple:
    """``layer_types`` as a tuple of ``num_layers`` names from ``LAYER_TYPES`` (None: all full), or a
    ConfigError naming the bad entry; a sliding layer needs a positive int ``sliding_window``."""
    types = ("full_attention",) * num_layers if layer_types is None else layer_types
    if not isinstance(types, (list, tuple)) or len(types) != num_layers:
        raise ConfigError(f"layer_types={types!r} must name one of {LAYER_TYPES} for each of the "
                          f"num_layers={num_layers} layers")
    for i, kind in enumerate(types):
        check_choice(f"layer_types[{i}]", kind, LAYER_TYPES)
    if sliding_window is not None or "sliding_attention" in types:
        check_int("sliding_window", sliding_window, hint="the keys a sliding layer's query sees, itself included "
                  "(Gemma-3: 512 for 270m, 1024 for the larger ones)")
    return tuple(types)


def layer_windows(layer_types: Sequence[str], sliding_window: int | None) -> tuple:
    """[L] each layer's window W (``sliding_window`` for a sliding layer), None for a full one."""
    return tuple(sliding_window if t == "sliding_attention" else None for t in layer_types)


def layer_groups(windows: Sequence[int | None]) -> dict:
    """{window W (None: full attention): [the layers with it]}, in order of each group's first layer.

    windows: [L] per layer, as ``ModelConfig.layer_windows`` gives them.
    """
    groups: dict = {}
    for layer, w in enumerate(windows):
        groups.setdefault(w, []).append(layer)
    return groups


def hybrid_cache(kind: str, windows: Sequence[int | None], num_kv_heads: int, head_dim: int, max_len: int = 1,
                 max_seqs: int = 1, dtype=np.float32, *, block_size: int = 16, num_blocks: int | None = None,
                 rollback: int = 0, full_group=None, **paged_options) -> KVCacheBase:
    """The cache of ``kind`` for a model whose layer l slides over ``windows[l]`` keys (None: full attention).

    kind "none":       ``SlidingNoCache``, the uncached reference (each sliding layer masked to its window)
    kind "contiguous": a ``HybridKVCache``: per window W a ring of W + K slots per sequence
                       (``SlidingRingKVCache``, K = ``rollback``), and one ``ContiguousKVCache`` of
                       ``max_seqs`` x ``max_len`` for the full layers
    kind "paged":      a ``HybridPagedKVCache``: one pool of ``num_blocks`` blocks of ``block_size`` tokens
                       (default: ``max_len`` for every sequence in every group), a block table per group;
                       ``paged_options``: enable_prefix_caching, sliding_rule, blocks_per_tile
    full_group:        ``full_group(num_layers) -> cache`` for the full layers (a quantized or evicting cache,
                       built by ``minikv.generate.make_cache``), beside the sliding rings; any kind but "none"
    A model without sliding layers gets the plain cache of ``kind``. Other kinds raise ConfigError.
    """

    check_choice("cache kind for a model with sliding-window layers", kind, HYBRID_KINDS)
    windows = [None if w is None else check_int("window", w) for w in windows]
    if kind == "none":
        if full_group is not None:
            raise ConfigError("cache kind 'none' keeps nothing, so it has no full group to quantize or evict")
        sliding = any(w is not None for w in windows)
        return (SlidingNoCache(windows, num_kv_heads, head_dim, dtype=dtype) if sliding else
                NoCache(len(windows), num_kv_heads, head_dim, dtype=dtype))
    if kind == "paged" and full_group is None:
        if num_blocks is None:
            num_blocks = max_seqs * len(group_layers(windows)) * num_blocks_for(max_len, block_size)
        return HybridPagedKVCache(windows, num_kv_heads, head_dim, num_blocks, block_size, dtype, rollback=rollback,
                                  **paged_options)
    if all(w is None for w in windows):
        if full_group is not None:
            return full_group(len(windows))
        return ContiguousKVCache(len(windows), num_kv_heads, head_dim, max_seqs, max_len, dtype=dtype)
    groups = []
    for w, layers in layer_groups(windows).items():
        if w is None:
            cache = (ContiguousKVCache(len(layers), num_kv_heads, head_dim, max_seqs, max_len, dtype=dtype)
                     if full_group is None else full_group(len(layers)))
        else:
            cache = SlidingRingKVCache(len(layers), num_kv_heads, head_dim, w, rollback, max_seqs, dtype)
        groups.append((layers, cache))
    return HybridKVCache(groups, num_kv_heads, head_dim, dtype=dtype)
