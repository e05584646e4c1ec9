"""The host offload tier (minikv.tiers) on the GPU wing's paged cache: the same bookkeeping, the device's copies.

Today the tier copies through ``minikv_gpu.paged.PagedKVCache``'s synchronous swap hooks (staged
gathers and scatters by the copy kernel); an asynchronous ``CacheStorage`` would plug in the same way.
Runs on the simulator everywhere and on CuPy where a GPU is present (``rt``).
"""

import numpy as np

from minikv.bench.equivalence import KERNEL_RTOL, rel_err
from minikv.tiers import OffloadTier
from minikv.weights.random_models import random_model
from minikv_gpu import model as gpu_model
from minikv_gpu import paged as gpu

TINY = dict(num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48,
            vocab_size=101)


def test_demoted_blocks_come_back_bit_identical_and_give_the_same_logits(rt):
    cpu = random_model(seed=11, **TINY)
    model = gpu_model.from_cpu(cpu, runtime=rt)
    cache = gpu.PagedKVCache(**cpu.new_cache_args(), num_blocks=6, block_size=4, num_host_blocks=12, runtime=rt)
    tier = OffloadTier(cache, "lru")
    rng = np.random.default_rng(3)
    p = rng.integers(0, 100, 17).tolist()  # 4 full blocks and one token
    cache.add_sequence("a", p)
    model.forward([p], cache, ["a"])
    before = [cache.read_kv("a", layer) for layer in range(2)]
    cache.free_sequence("a")
    filler = rng.integers(0, 100, 24).tolist()  # 6 blocks: every block of "a" is evicted
    cache.add_sequence("f", filler)
    model.forward([filler], cache, ["f"])
    cache.free_sequence("f")
    assert tier.stats.demoted == 4
    assert cache.add_sequence("c", p) == 16 and tier.stats.promoted == 4
    for layer, (k, v) in enumerate(before):
        k2, v2 = cache.read_kv("c", layer)
        assert np.array_equal(k[:16], k2) and np.array_equal(v[:16], v2)
    got = rt.asnumpy(model.forward([p[16:]], cache, ["c"]))
    fresh = gpu.PagedKVCache(**cpu.new_cache_args(), num_blocks=6, block_size=4, runtime=rt)
    fresh.add_sequence("c")
    want = rt.asnumpy(model.forward([p], fresh, ["c"]))
    assert rel_err(got, want) <= KERNEL_RTOL and np.array_equal(got.argmax(-1), want.argmax(-1))
    tier.check()
