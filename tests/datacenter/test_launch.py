"""Where a data-center run's processes compute: NCCL only with a GPU for each process on the host."""

from __future__ import annotations

import pytest
import torch

from retexo_fl.datacenter.launch import host_backend


@pytest.fixture()
def gpus(monkeypatch):
    """Pretend this host has ``n`` GPUs."""

    def set_count(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return set_count


def test_auto_takes_the_gpus_only_when_each_process_has_one(gpus):
    gpus(1)  # a one-GPU host (the lent GPU machines): NCCL refuses two ranks on one GPU
    assert host_backend("auto", 4) == ("cpu", "gloo")
    assert host_backend("auto", 1) == ("cuda", "nccl")
    gpus(8)
    assert host_backend("auto", 4) == ("cuda", "nccl")
    gpus(0)
    assert host_backend("auto", 4) == ("cpu", "gloo")
    assert host_backend("cpu", 1) == ("cpu", "gloo")


def test_cuda_with_too_few_gpus_is_refused_naming_the_remedy(gpus):
    gpus(1)
    with pytest.raises(RuntimeError, match="4 processes on this host and 1 GPU"):
        host_backend("cuda", 4)
    assert host_backend("cuda:0", 1) == ("cuda", "nccl")
    gpus(0)
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        host_backend("cuda", 1)
