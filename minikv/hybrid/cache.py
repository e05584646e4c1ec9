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
    groups       window 512: layers 0-4, 6-10, 12-16  ->  a ring of W slots (step 6's ``EvictingKVCache``
                                                          with ``WindowPolicy(W)``, layer indices remapped)
                 full:       layers 5, 11, 17         ->  a contiguous slab (step 2's ``ContiguousKVCache``)

One ``step`` opens a step on every group (they see the same sequences and tokens, so they agree on
the positions) and commits them together; a step that fails in any group changes none of them.

The ring keeps keys at their original positions (``positions="original"``): exactly what the
model does, so a hybrid cache run equals the uncached forward with each sliding layer masked to
its window (``minikv.hybrid.reference.SlidingNoCache``), and equals transformers' Gemma-3.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from minikv.errors import ConfigError, InvalidInputError, check_choice, check_int
from minikv.kv_cache import ContiguousKVCache, KVCacheBase, NoCache, Step
from minikv.window.ring import EvictingKVCache, WindowPolicy

HYBRID_KINDS = ("none", "contiguous")  # the cache kinds built for a model with sliding layers so far
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


class HybridKVCache(KVCacheBase):
    """Groups of layers, each its own cache behind the same ``step``/``write``/``attend`` seam.

    groups: [(layers, cache)]: the model layers of a group (ascending) and a cache built for
            ``len(layers)`` layers of this geometry; together the groups hold every layer once.
    Layer ``layers[j]`` of the model is layer ``j`` of its group's cache.
    """

    def __init__(self, groups: Sequence[tuple[Sequence[int], KVCacheBase]], num_kv_heads: int, head_dim: int,
                 dtype=np.float32):
        layers = sorted(layer for group, _ in groups for layer in group)
        if not layers or layers != list(range(len(layers))):
            raise ConfigError(f"the groups hold layers {layers}; together they must hold 0..L-1 once each")
        super().__init__(len(layers), num_kv_heads, head_dim, dtype)
        self.groups = [(tuple(group), cache) for group, cache in groups]
        self._where: list = [None] * self.num_layers  # model layer -> (its group's cache, index there)
        for group, cache in self.groups:
            geometry = (cache.num_layers, cache.num_kv_heads, cache.head_dim, cache.dtype)
            if geometry != (len(group), self.num_kv_heads, self.head_dim, self.dtype):
                raise ConfigError(f"the cache of layers {list(group)} has (layers, kv_heads, head_dim, dtype)="
                                  f"{geometry}; expected {(len(group), self.num_kv_heads, self.head_dim, self.dtype)}")
            for j, layer in enumerate(group):
                self._where[layer] = (cache, j)
        # [L] the window each layer's cache keeps (None: all of it), which the model checks against its config
        self.layer_windows = tuple(getattr(getattr(cache, "policy", None), "window", None) for cache, _ in self._where)
        self._written: set = set()

    # -- sequences: every group holds every sequence ----------------------------------------------
    def add_sequence(self, seq_id) -> None:
        added = []
        try:
            for _, cache in self.groups:
                cache.add_sequence(seq_id)
                added.append(cache)
        except BaseException:
            for cache in added:  # all or nothing
                cache.free_sequence(seq_id)
            raise

    def free_sequence(self, seq_id) -> None:
        self.length(seq_id)  # UnknownSequenceError before any group changes
        for _, cache in self.groups:
            cache.free_sequence(seq_id)

    def length(self, seq_id) -> int:
        return self.groups[0][1].length(seq_id)  # every group saw the same tokens

    def __contains__(self, seq_id) -> bool:
        return seq_id in self.groups[0][1]

    # -- steps: one step opens, commits or rolls back all groups ------------------------------------
    def _reserve(self, step: Step) -> None:
        opened = []
        try:
            for _, cache in self.groups:
                cache.begin_step(step.seq_ids, step.num_new)  # may refuse (CacheFullError): then none is open
                opened.append(cache)
        except BaseException:
            for cache in opened:
                cache.abort_step()
            raise
        self._written = set()

    def _commit(self, step: Step) -> None:
        missing = sorted(set(range(self.num_layers)) - self._written)
        if missing:  # checked before any group commits: a group's own commit then has nothing left to refuse
            raise InvalidInputError(f"the step wrote no K/V for layers {missing}; every layer must write and attend "
                                    "before the step ends")
        for _, cache in self.groups:
            cache.end_step()

    def _rollback(self, step: Step) -> None:
        for _, cache in self.groups:
            cache.abort_step()

    def _truncate(self, seq_id, new_len: int) -> None:
        for _, cache in self.groups:  # ask every group first (a no-op truncate is the probe), so a refusal
            cache.truncate(seq_id, cache.length(seq_id))  # leaves all of them unchanged
        for _, cache in self.groups:
            cache.truncate(seq_id, new_len)

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        self._check_layer(layer)
        cache, j = self._where[layer]
        cache.write(j, k, v)
        self._written.add(layer)

    def attend(self, layer: int, q: np.ndarray, sinks: np.ndarray | None = None,
               softcap: float | None = None) -> np.ndarray:
        self._check_layer(layer)
        cache, j = self._where[layer]
        return cache.attend(j, q, sinks=sinks, softcap=softcap)

    # -- memory -------------------------------------------------------------------------------------
    def bytes_allocated(self) -> int:
        return sum(cache.bytes_allocated() for _, cache in self.groups)

    def bytes_used(self) -> int:
        """The groups' bytes: a full group's grow with the text, a sliding group's stop at W tokens."""
        return sum(cache.bytes_used() for _, cache in self.groups)


def hybrid_cache(kind: str, windows: Sequence[int | None], num_kv_heads: int, head_dim: int, max_len: int = 1,
                 max_seqs: int = 1, dtype=np.float32) -> KVCacheBase:
    """The cache of ``kind`` for a model whose layer l slides over ``windows[l]`` keys (None: full attention).

    kind "none":       ``SlidingNoCache``, the uncached reference (each sliding layer masked to its window)
    kind "contiguous": a ``HybridKVCache``: per window W a ring of W slots per sequence, and one
                       ``ContiguousKVCache`` of ``max_seqs`` x ``max_len`` for the full layers
    A model without sliding layers gets the plain cache of ``kind``. Other kinds raise ConfigError.
    """
    from minikv.hybrid.reference import SlidingNoCache

    if kind not in HYBRID_KINDS:
        raise ConfigError(f"cache kind {kind!r} for a model with sliding-window layers is not built yet; "
                          f"minikv.hybrid builds {HYBRID_KINDS}")
    windows = [None if w is None else check_int("window", w) for w in windows]
    if all(w is None for w in windows):
        if kind == "none":
            return NoCache(len(windows), num_kv_heads, head_dim, dtype=dtype)
        return ContiguousKVCache(len(windows), num_kv_heads, head_dim, max_seqs, max_len, dtype=dtype)
    if kind == "none":
        return SlidingNoCache(windows, num_kv_heads, head_dim, dtype=dtype)
    groups = []
    for w, layers in layer_groups(windows).items():
        if w is None:
            cache = ContiguousKVCache(len(layers), num_kv_heads, head_dim, max_seqs, max_len, dtype=dtype)
        else:  # log=False: the eviction log grows with the text, and a window's rule needs none
            cache = EvictingKVCache(len(layers), num_kv_heads, head_dim, WindowPolicy(w), max_seqs, dtype, log=False)
        groups.append((layers, cache))
    return HybridKVCache(groups, num_kv_heads, head_dim, dtype=dtype)

