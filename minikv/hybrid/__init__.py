"""Step 9: hybrid models, whose layers differ (sliding-window and full attention), get a cache per kind of layer.

``cache``      the layer types (``LAYER_TYPES``, ``check_layer_types``, ``layer_windows``), ``HybridKVCache``
               (groups of layers, each its own cache behind one seam), ``hybrid_cache`` (the cache of a kind
               for a model's per-layer windows), ``layer_groups``
``reference``  ``SlidingNoCache``: the uncached forward with each sliding layer masked to its window
"""

from minikv.hybrid.cache import (
    HYBRID_KINDS,
    LAYER_TYPES,
    HybridKVCache,
    check_layer_types,
    hybrid_cache,
    layer_groups,
    layer_windows,
)
from minikv.hybrid.reference import SlidingNoCache

__all__ = ["HYBRID_KINDS", "LAYER_TYPES", "HybridKVCache", "SlidingNoCache", "check_layer_types", "hybrid_cache",
           "layer_groups", "layer_windows"]
