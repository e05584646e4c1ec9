"""Step 9: hybrid models, whose layers differ (sliding-window and full attention), get a cache per kind of layer.

``cache``      the layer types (``LAYER_TYPES``, ``check_layer_types``, ``layer_windows``), ``hybrid_cache``
               (the cache of a kind for a model's per-layer windows), ``layer_groups``
``groups``     ``HybridKVCache``: groups of layers, each its own cache behind one seam
``ring``       the sliding group's ring of W + K slots (``SlidingWindow``, ``SlidingRingKVCache``): truncate
               by up to K tokens stays exact after the ring wrapped
``pool``       one pool of block ids for every group (``SharedPool``, ``GroupAllocator``), ``group_layers``
``paged``      one group's paged cache over the pool; sliding groups give blocks back and share by anchor
``blocks``     ``HybridPagedKVCache`` and ``HybridBlocks``: the scheduler's questions over every group,
               the prefix hit over every group (``HybridHit``)
``reference``  ``SlidingNoCache``: the uncached forward with each sliding layer masked to its window
"""

from minikv.hybrid.blocks import HybridBlocks, HybridHit, HybridPagedKVCache
from minikv.hybrid.cache import HYBRID_KINDS, LAYER_TYPES, check_layer_types, hybrid_cache, layer_groups, layer_windows
from minikv.hybrid.groups import HybridKVCache
from minikv.hybrid.pool import group_layers
from minikv.hybrid.reference import SlidingNoCache
from minikv.hybrid.ring import SlidingRingKVCache, SlidingWindow

__all__ = ["HYBRID_KINDS", "LAYER_TYPES", "HybridBlocks", "HybridHit", "HybridKVCache", "HybridPagedKVCache",
           "SlidingNoCache", "SlidingRingKVCache", "SlidingWindow", "check_layer_types", "group_layers",
           "hybrid_cache", "layer_groups", "layer_windows"]
