"""Step 8: the cache across MPI ranks (lesson: ``minikv.textbook.s8_heads``).

``collectives``  all-reduce, all-gather and agreement over mpi4py, with a wire-byte trace
``watchdog``     how long a rank waits in a collective, and which rank it names when it gives up
``tensor``       tensor parallelism: each rank holds some heads (and their KV cache) and a slice of every matrix
``context``      context parallelism for MLA: the latent cache striped over ranks, partial softmax states merged
"""

from minikv.parallel.collectives import Collective, Collectives, abort_on_error, agree, mpi_world
from minikv.parallel.context import STRIPED_KINDS, StripedLatentCache, striped_cache, striped_positions, striped_state
from minikv.parallel.tensor import (
                                    ParallelModel,
                                    RankHeads,
                                    from_flags,
                                    generate,
                                    head_plan,
                                    imbalance,
                                    quiet_output,
                                    shard_model,
                                    split_even,
)

__all__ = ["Collective", "Collectives", "ParallelModel", "RankHeads", "STRIPED_KINDS", "StripedLatentCache",
           "abort_on_error", "agree", "from_flags", "generate", "head_plan", "imbalance", "mpi_world", "quiet_output",
           "shard_model", "split_even", "striped_cache", "striped_positions", "striped_state"]
