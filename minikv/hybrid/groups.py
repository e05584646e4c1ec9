"""Step 9, the container: ``HybridKVCache``, groups of layers each with its own cache behind one seam.

The model calls ``cache.write(layer, k, v)`` and ``cache.attend(layer, q)`` for every layer; the
hybrid cache sends each layer to the cache of its group (layer ``layers[j]`` of the model is layer
``j`` of its group's cache) and opens, commits, rolls back and truncates every group together.
What could refuse is asked of every group before any of them changes (``minikv.hybrid.cache``
explains the kinds built on it; ``minikv.hybrid.blocks`` the paged one).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from minikv.errors import ConfigError, InvalidInputError, RollbackError
from minikv.hybrid.ring import SlidingWindow
from minikv.kv_cache import ContiguousKVCache, KVCacheBase, Step
from minikv.window.paged import PagedEvictingKVCache


class HybridKVCache(KVCacheBase):
    """Groups of layers, each its own cache behind the same ``step``/``write``/``attend`` seam.

    groups: [(layers, cache)]: the model layers of a group (ascending) and a cache built for
            ``len(layers)`` layers of this geometry; together the groups hold every layer once.
            Steps commit the groups in this order (the paged form puts the full groups first).
    Layer ``layers[j]`` of the model is layer ``j`` of its group's cache.
    """

    def __init__(self, groups: Sequence[tuple[Sequence[int], KVCacheBase]], num_kv_heads: int, head_dim: int,
                 dtype=np.float32):
        layers = sorted(layer for group, _ in groups for layer in group)
        if not layers or layers != list(range(len(layers))):
            raise ConfigError(f"the groups hold layers {layers}; together they must hold 0..L-1 once each")
        # the base directly: the paged form is also a PagedKVCache (the scheduler's type) and builds no pool of its own
        KVCacheBase.__init__(self, len(layers), num_kv_heads, head_dim, dtype)
        self.groups = [(tuple(group), cache) for group, cache in groups]
        self._where: list = [None] * self.num_layers  # model layer -> (its group's cache, index there)
        for group, cache in self.groups:
            geometry = (cache.num_layers, cache.num_kv_heads, cache.head_dim, cache.dtype)
            if geometry != (len(group), self.num_kv_heads, self.head_dim, self.dtype):
                raise ConfigError(f"the cache of layers {list(group)} has (layers, kv_heads, head_dim, dtype)="
                                  f"{geometry}; expected {(len(group), self.num_kv_heads, self.head_dim, self.dtype)}")
            if getattr(cache, "rotates_in_cache", False):
                raise ConfigError("a group with in-cache positions (positions='in-cache') needs pre-RoPE keys, and the "
                                  "model rotates the other groups' layers; use positions='original' in a hybrid cache")
            for j, layer in enumerate(group):
                self._where[layer] = (cache, j)
        # [L] each layer's window (None: full attention), which the model checks against its config
        self.layer_windows = tuple(_window(cache, j) for cache, j in self._where)
        # PagedEvictingKVCache commits only after every layer attended (its masses): the hybrid checks that first
        self._needs_attend = {layer for group, cache in self.groups if isinstance(cache, PagedEvictingKVCache)
                              for layer in group}
        self._attended: set = set()

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
        self._attended = set()

    def _commit(self, step: Step) -> None:
        missing = sorted(set(range(self.num_layers)) - self._written)
        if missing:  # checked before any group commits: a group's own commit then has nothing left to refuse
            raise InvalidInputError(f"the step wrote no K/V for layers {missing}; every layer must write and attend "
                                    "before the step ends")
        silent = sorted(self._needs_attend - self._attended)
        if silent:
            raise InvalidInputError(f"the step attended no queries at layers {silent}; every layer must write and "
                                    "attend before the step ends")
        for _, cache in self.groups:
            cache.end_step()

    def _rollback(self, step: Step) -> None:
        for _, cache in self.groups:
            cache.abort_step()

    def _truncate(self, seq_id, new_len: int) -> None:
        """Every group is asked first (``refusal``); then they truncate, the one without a precise check first."""
        for _, cache in self.groups:
            error = refusal(cache, seq_id, new_len)
            if error is not None:
                raise error
        for cache in self._truncation_order(seq_id, new_len):
            cache.truncate(seq_id, new_len)

    def _truncation_order(self, seq_id, new_len: int) -> list:
        """The groups in the order they truncate: a cache whose refusal the probe cannot foresee (a quantized
        one re-opening a block) first, so that its refusal still leaves every group unchanged."""
        caches = [cache for _, cache in self.groups]
        return sorted(caches, key=lambda c: hasattr(c, "refusal") or isinstance(c, ContiguousKVCache))

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        self._check_layer(layer)
        cache, j = self._where[layer]
        cache.write(j, k, v)

    def attend(self, layer: int, q: np.ndarray, sinks: np.ndarray | None = None,
               softcap: float | None = None) -> np.ndarray:
        self._check_layer(layer)
        cache, j = self._where[layer]
        out = cache.attend(j, q, sinks=sinks, softcap=softcap)
        self._attended.add(layer)
        return out

    # -- memory -------------------------------------------------------------------------------------
    def bytes_allocated(self) -> int:
        return sum(cache.bytes_allocated() for _, cache in self.groups)

    def bytes_used(self) -> int:
        """The groups' bytes: a full group's grow with the text, a sliding group's stop at W - 1 + K tokens."""
        return sum(cache.bytes_used() for _, cache in self.groups)


def _window(cache: KVCacheBase, j: int) -> int | None:
    """The window of layer j of a group's cache: its own ``layer_windows`` (a reference), its ``SlidingWindow``
    policy's (a sliding group), else None: a full group evicting by a policy of its own is still a full layer."""
    if hasattr(cache, "layer_windows"):
        return cache.layer_windows[j]
    policy = getattr(cache, "policy", None)
    return policy.window if isinstance(policy, SlidingWindow) else None


def refusal(cache: KVCacheBase, seq_id, new_len: int):
    """Why ``cache.truncate(seq_id, new_len)`` would refuse (the exception), or None, changing nothing.

    The hybrid groups answer precisely (``refusal``); a contiguous slab never refuses; any other cache
    is probed with a truncate to its own length, which asks it without changing it (``truncate``).
    """
    if hasattr(cache, "refusal"):
        return cache.refusal(seq_id, new_len)
    if isinstance(cache, ContiguousKVCache):
        return None
    try:
        cache.truncate(seq_id, cache.length(seq_id))
    except RollbackError as e:
        return e
    return None
