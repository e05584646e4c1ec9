"""``minikv.parallel`` on the GPU: one rank per device, the same split, the collectives on device arrays.

    mpiexec -n 3 python -c "..."          # each rank: DeviceParallelModel(model, tp=3)

Each rank's share is ``minikv.parallel.tensor.shard_model``'s slice uploaded as a ``minikv_gpu.model.Model``
(its kernels, its device caches); the loop is ``ParallelModel``'s (the step check by ``agree``,
then per layer attention -> all-reduce, MLP -> all-reduce, the logits gathered by vocabulary),
with the branches computed on the device. The collectives take device arrays:

* ``"host"``: copy to the host, MPI, copy back. Runs everywhere, including the CPU simulator as
  each rank's device (what the tests run) and GPUs without CUDA-aware MPI; it costs two PCIe
  copies per collective.
* ``"nccl"``: ``cupy.cuda.nccl`` on device pointers, on the current stream (one GPU per rank: NCCL
  refuses two ranks on one device). Each rank first makes device ``local_rank % device_count`` current
  (``select_device``; the local rank is the rank among the processes of its node), so the ranks of one
  node with several GPUs spread over them instead of all taking device 0. The unique id travels
  over MPI once. The vocabulary shards of the logits differ in width by one at most; NCCL's
  all-gather takes equal counts, so each rank pads its shard to the widest and the padding is cut
  after the gather.
  (CUDA-aware MPI would take CuPy arrays in ``Collectives`` unchanged: mpi4py reads
  ``__cuda_array_interface__``.)

Left for a multi-GPU machine: NCCL itself with more than one rank, overlapping the all-reduces
with the next GEMM, and timings. Context parallelism (cp) needs the latent attention kernels to
return their (m, l, acc) state instead of the finished output; until then it is host-only
(``minikv.parallel.context``). Logits come back on the device, as from ``minikv_gpu.model.Model``.
"""

from __future__ import annotations

import os

import numpy as np

from minikv.errors import ConfigError, check_choice
from minikv.parallel.collectives import Collectives
from minikv.parallel.tensor import ParallelModel
from minikv_gpu import model as gpu_model
from minikv_gpu.runtime import get_runtime

BACKENDS = ("host", "nccl")


LOCAL_RANK_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK", "SLURM_LOCALID", "LOCAL_RANK")


def local_rank(comm) -> int:
    """This process's rank among the processes of its node: MPI's shared-memory split when there is a
    communicator, else the launcher's variable (Open MPI, MPICH/Hydra, Slurm, torchrun), else 0."""
    if comm is not None:
        try:
            from mpi4py import MPI

            return comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
        except (ImportError, AttributeError):
            pass
    for var in LOCAL_RANK_VARS:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def select_device(rt, rank: int) -> int:
    """Make device ``rank % rt.device_count()`` current on runtime ``rt`` and return its index."""
    index = int(rank) % rt.device_count()
    rt.use_device(index)
    return index


class DeviceCollectives:
    """``Collectives.allreduce`` / ``allgather`` for device arrays of runtime ``rt``, recorded in the same trace."""

    def __init__(self, host: Collectives, runtime=None, backend: str = "host"):
        rt = get_runtime(runtime)
        self.host, self.rt, self.backend = host, rt, check_choice("backend", backend, BACKENDS)
        self._nccl = _nccl_communicator(host, rt) if backend == "nccl" and host.size > 1 else None

    def allreduce(self, a):
        if self.host.size == 1:
            return a
        if self._nccl is None:
            return self.rt.asarray(self.host.allreduce(self.rt.asnumpy(a)))
        from cupy.cuda import nccl

        xp = self.rt.xp
        a = xp.ascontiguousarray(a)
        out = xp.empty_like(a)
        self._nccl.allReduce(a.data.ptr, out.data.ptr, a.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                             xp.cuda.get_current_stream().ptr)
        self.host._record("allreduce", a, a.nbytes)
        return out

    def allgather(self, a, widths):
        """[rows, w_r] on every rank -> [rows, sum(widths)] (the logits' vocabulary shards)."""
        if self.host.size == 1:
            return a
        if self._nccl is None:
            return self.rt.asarray(self.host.allgather(self.rt.asnumpy(a), widths))
        from cupy.cuda import nccl

        xp, wide = self.rt.xp, max(widths)
        send = xp.zeros((a.shape[0], wide), dtype=a.dtype)
        send[:, : a.shape[1]] = a
        out = xp.empty((self.host.size, a.shape[0], wide), dtype=a.dtype)
        self._nccl.allGather(send.data.ptr, out.data.ptr, send.size, nccl.NCCL_FLOAT32,
                             xp.cuda.get_current_stream().ptr)
        joined = xp.concatenate([out[r, :, :w] for r, w in enumerate(widths)], axis=1)
        self.host._record("allgather", joined, joined.nbytes)
        return joined


def _nccl_communicator(host: Collectives, rt):
    """A NCCL communicator over the ranks of ``host`` (its unique id broadcast by MPI)."""
    if rt.name != "cupy":
        raise ConfigError(f"backend='nccl' needs CuPy on a GPU; this runtime is {rt.name!r} (use backend='host')")
    from cupy.cuda import nccl

    uid = host.comm.bcast(nccl.get_unique_id() if host.rank == 0 else None, root=0)
    return nccl.NcclCommunicator(host.size, uid, host.rank)


class DeviceParallelModel(ParallelModel):
    """``ParallelModel`` whose share runs on this rank's device (``runtime``: CuPy on a GPU, else the simulator).

    Caches: ``new_cache(max_seqs, max_len)`` (a device ``ContiguousKVCache``, or the latent one for MLA).
    ``forward`` returns float32 logits on the device. cp must be 1 (see the module docstring).
    """

    def __init__(self, model, tp: int = 1, comm=None, runtime=None, backend: str = "host"):
        super().__init__(model, tp=tp, cp=1, comm=comm)
        self.rt = get_runtime(runtime)
        self.device_index = select_device(self.rt, local_rank(comm))  # before any allocation on the device
        self.device = gpu_model.from_cpu(self.local, runtime=self.rt)
        self.collectives = DeviceCollectives(self.tp_group, self.rt, backend)
        self.dtype = np.float32

    def new_cache(self, max_seqs: int, max_len: int):
        """This rank's device cache: its KV heads (or the whole latent) for ``max_seqs`` x ``max_len`` tokens."""
        return self.device.new_cache(max_seqs, max_len)

    def _run(self, toks, cache, positions, all_logits: bool):
        """``ParallelModel._run`` with the branches on the device and ``DeviceCollectives`` between them."""
        d, rt, xp, coll = self.device, self.rt, self.rt.xp, self.collectives
        c, lc = self.config, d.config
        ids = np.concatenate(toks)
        pos = rt.asarray(positions)
        cos, sin = xp.ascontiguousarray(d.cos[pos]), xp.ascontiguousarray(d.sin[pos])
        vocab = self.vocab[self.tp_rank]
        mine = (ids >= vocab.start) & (ids < vocab.stop)
        rows = d.embed[rt.asarray(np.where(mine, ids - vocab.start, 0))]
        x = coll.allreduce(xp.where(rt.asarray(mine[:, None]), rows, xp.float32(0)))
        for li, lw in enumerate(d.prepared_layers):
            if c.mla is None:
                x = x + coll.allreduce(_attention(x, lw, lc, cache, li, cos, sin, rt))
            else:
                x = x + coll.allreduce(gpu_model.mla_attention_block(x, lw, lc, cache, li, cos, sin, runtime=rt))
            x = x + coll.allreduce(d._mlp(x, lw))
        if not all_logits:
            x = x[rt.asarray(np.cumsum([t.size for t in toks]) - 1)]
        local = xp.matmul(gpu_model.rms_norm(x, d.final_norm, c.rms_eps, runtime=rt), d.lm_head.T)
        return coll.allgather(local, [len(v) for v in self.vocab])


def _attention(x, lw, cfg, cache, li: int, cos, sin, rt):
    """The GQA branch on the device, as ``minikv_gpu.model.Model.forward`` runs it: x [N, H] -> [N, H]."""
    xp, n, hq, hkv, d = rt.xp, x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = xp.matmul(gpu_model.rms_norm(x, lw.attn_norm, cfg.rms_eps, runtime=rt), lw.wqkv)
    q = xp.ascontiguousarray(qkv[:, : hq * d]).reshape(n, hq, d)
    k = xp.ascontiguousarray(qkv[:, hq * d: (hq + hkv) * d]).reshape(n, hkv, d)
    v = xp.ascontiguousarray(qkv[:, (hq + hkv) * d:]).reshape(n, hkv, d)
    cache.write(li, gpu_model.apply_rope(k, cos, sin, cfg.rope_layout, runtime=rt), v)
    attn = cache.attend(li, gpu_model.apply_rope(q, cos, sin, cfg.rope_layout, runtime=rt))
    return xp.matmul(attn.reshape(n, hq * d), lw.wo)
