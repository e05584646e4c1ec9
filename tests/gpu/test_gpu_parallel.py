"""minikv_gpu.parallel's device choice on a node with several GPUs: rank r of a node takes device
r % device_count, checked with the simulator's runtime standing in for several devices (the ranks of
tests/test_parallel.py's device run share the one simulator)."""

import numpy as np
import pytest

from minikv.errors import InvalidInputError
from minikv.weights.random_models import random_model
from minikv_gpu import parallel
from minikv_gpu.runtime import SimRuntime


@pytest.mark.parametrize("devices", [1, 3, 8])
def test_each_local_rank_takes_device_rank_mod_count(devices):
    rt = SimRuntime(devices=devices)
    for rank in range(12):
        assert parallel.select_device(rt, rank) == rank % devices
        assert rt.device_id == rank % devices  # the runtime's current device: what NCCL and CuPy then use
    with pytest.raises(InvalidInputError, match="does not exist"):
        rt.use_device(devices)


def test_the_local_rank_comes_from_the_launcher_without_a_communicator(monkeypatch):
    for var in parallel.LOCAL_RANK_VARS:
        monkeypatch.delenv(var, raising=False)
    assert parallel.local_rank(None) == 0
    monkeypatch.setenv("MPI_LOCALRANKID", "5")  # MPICH's Hydra (the mpich wheel's mpiexec)
    assert parallel.local_rank(None) == 5


class _Comm:
    """A one-rank stand-in for an mpi4py communicator (rank 0 of 1): what ParallelModel asks of it."""

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 1

    def Split(self, color, key=0):
        return self

    def Split_type(self, kind):
        return _Local()


class _Local:
    def Get_rank(self):
        return 2  # this process is the third on its node


def test_a_rank_selects_its_device_before_it_uploads_its_share():
    pytest.importorskip("mpi4py")
    rt = SimRuntime(devices=3)
    model = random_model(num_layers=1, hidden_size=16, num_heads=2, num_kv_heads=1, head_dim=8,
                         intermediate_size=24, vocab_size=40, seed=0)
    pm = parallel.DeviceParallelModel(model, tp=1, comm=_Comm(), runtime=rt)
    assert pm.device_index == 2 and rt.device_id == 2  # local rank 2 of a 3-device node: device 2
    assert pm.device.rt is rt and np.all(np.isfinite(rt.asnumpy(pm.device.embed)))
