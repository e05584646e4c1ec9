"""Step 4: multi-head latent attention (DeepSeek-V2/V3) and its latent cache (lesson: ``minikv.textbook.s4_mla``).

``latent``  the geometry (``MLAConfig``), the decompression (``LatentUp``), the absorbed and expanded forms
``caches``  the latent caches: no cache, contiguous, paged
``block``   the MLA attention block of a decoder layer, and its weights
"""

from minikv.mla.block import MLALayer, MLALayerWeights, mla_attention_block, mla_weight_shapes
from minikv.mla.caches import LatentContiguousKVCache, LatentNoCache, LatentPagedKVCache
from minikv.mla.latent import (
                               FORMS,
                               LatentUp,
                               MLAConfig,
                               Reader,
                               absorbed_state,
                               expand,
                               expanded_state,
                               latent_attention,
                               latent_bytes_per_token,
                               reference_attention,
)

__all__ = ["FORMS", "LatentContiguousKVCache", "LatentNoCache", "LatentPagedKVCache", "LatentUp", "MLAConfig",
           "MLALayer", "MLALayerWeights", "Reader", "absorbed_state", "expand", "expanded_state", "latent_attention",
           "latent_bytes_per_token", "mla_attention_block", "mla_weight_shapes", "reference_attention"]
