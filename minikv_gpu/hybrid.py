"""Step 9 on the GPU: per-layer caches of a hybrid model (mirrors ``minikv.hybrid``).

A model whose layers differ gets one cache per group of layers of one kind, behind the same seam
(``minikv.hybrid.groups.HybridKVCache`` does the routing, the all-or-nothing steps and the truncates);
what the GPU changes is which kernels each group runs:

* a **sliding group** is step 6's ring on the GPU (``SlidingRingKVCache``: ``minikv.hybrid.ring``'s
  ring of W + K slots whose single-token decode steps run ``kernels/window.cu``'s ``window_decode``
  with the window rule, ``minikv_gpu.window.EvictingKVCache``);
* a **full group** is step 3's paged cache on the GPU (``minikv_gpu.paged.PagedKVCache``: the
  ``reshape_and_cache`` and ``paged_attention`` kernels), or the contiguous one
  (``minikv_gpu.kv_cache.ContiguousKVCache``).

The groups do not share one pool here, as ``minikv.hybrid.HybridPagedKVCache``'s do: the full group's
blocks are its own pool, the sliding groups' rings their fixed W + K slots. The logits are the same
(both equal the masked recompute); what the shared pool adds, blocks moving between groups, is
bookkeeping that does not run on the device.

The window kernels keep their storage in host arrays (``minikv_gpu.window``), the paged ones on the
device: ``HybridKVCache`` moves a sliding layer's K/V and queries across, so the model sees device
arrays from every layer.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from minikv.errors import check_choice, check_int
from minikv.hybrid import groups as _cpu_groups
from minikv.hybrid import ring as _cpu_ring
from minikv.hybrid.cache import layer_groups
from minikv.paged.allocator import num_blocks_for
from minikv_gpu import window as _gpu_window
from minikv_gpu.kv_cache import ContiguousKVCache
from minikv_gpu.paged import PagedKVCache
from minikv_gpu.runtime import get_runtime

__all__ = ["HYBRID_KINDS", "HybridKVCache", "SlidingRingKVCache", "hybrid_cache"]

HYBRID_KINDS = ("contiguous", "paged")  # the full group's layout; the sliding groups are rings either way


class SlidingRingKVCache(_cpu_ring.SlidingRingKVCache, _gpu_window.EvictingKVCache):
    """``minikv.hybrid.ring.SlidingRingKVCache`` (W + K slots, exact truncate by up to K) whose single-token
    decode steps run the window kernel (``minikv_gpu.window.EvictingKVCache.attend``). Arguments as the
    NumPy class, plus ``runtime``."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, window: int, rollback: int = 0,
                 max_seqs: int = 1, dtype=np.float32, *, runtime=None):
        super().__init__(num_layers, num_kv_heads, head_dim, window, rollback, max_seqs, dtype)
        self.rt = get_runtime(runtime)


class HybridKVCache(_cpu_groups.HybridKVCache):
    """``minikv.hybrid.HybridKVCache`` over GPU groups: a sliding group's K/V and queries go to the host
    (where the window kernels' storage lives) and its output comes back to the device."""

    def __init__(self, groups, num_kv_heads: int, head_dim: int, dtype=np.float32, *, runtime=None):
        super().__init__(groups, num_kv_heads, head_dim, dtype)
        self.rt = get_runtime(runtime)
        self._host = {layer for layers, cache in self.groups if isinstance(cache, SlidingRingKVCache)
                      for layer in layers}

    def write(self, layer: int, k, v) -> None:
        if layer in self._host:
            k, v = self.rt.asnumpy(k), self.rt.asnumpy(v)
        super().write(layer, k, v)

    def attend(self, layer: int, q, sinks=None, softcap: float | None = None):
        """q: [N, Hq, D] -> [N, Hq, D] on the device; sinks ([Hq] learned sink logits) and softcap reach the
        layer's group cache (``minikv.online_softmax``'s options), on the host for a sliding group."""
        if layer in self._host:
            host = None if sinks is None else self.rt.asnumpy(sinks)
            return self.rt.asarray(super().attend(layer, self.rt.asnumpy(q), sinks=host, softcap=softcap))
        return super().attend(layer, q, sinks=sinks, softcap=softcap)


def hybrid_cache(kind: str, windows: Sequence[int | None], num_kv_heads: int, head_dim: int, max_len: int = 1,
                 max_seqs: int = 1, dtype=np.float32, *, block_size: int = 16, num_blocks: int | None = None,
                 rollback: int = 0, runtime=None) -> HybridKVCache:
    """The GPU twin of ``minikv.hybrid.hybrid_cache``: per window W a ``SlidingRingKVCache`` of W + K slots,
    and for the full layers a ``minikv_gpu.paged.PagedKVCache`` (kind "paged": ``num_blocks`` blocks of
    ``block_size``, default ``max_len`` for every sequence) or a ``ContiguousKVCache`` (kind "contiguous")."""
    check_choice("cache kind of the GPU hybrid cache", kind, HYBRID_KINDS)
    rt = get_runtime(runtime)
    groups = []
    for w, layers in layer_groups([None if w is None else check_int("window", w) for w in windows]).items():
        if w is not None:
            cache = SlidingRingKVCache(len(layers), num_kv_heads, head_dim, w, rollback, max_seqs, dtype, runtime=rt)
        elif kind == "paged":
            blocks = max_seqs * num_blocks_for(max_len, block_size) if num_blocks is None else num_blocks
            cache = PagedKVCache(len(layers), num_kv_heads, head_dim, blocks, block_size, dtype=dtype, runtime=rt)
        else:
            cache = ContiguousKVCache(len(layers), num_kv_heads, head_dim, max_seqs, max_len, dtype=dtype, runtime=rt)
        groups.append((layers, cache))
    return HybridKVCache(groups, num_kv_heads, head_dim, dtype, runtime=rt)
