"""Where training runs: ``--device auto`` picks the GPU when there is one; CUDA runs skip without one."""

from __future__ import annotations

import pytest
import torch

from retexo_fl.config import TrainConfig
from retexo_fl.data.partitioners import partition_graph
from retexo_fl.seeding import resolve_device
from retexo_fl.training.centralized import run_centralized, whole_graph_partition
from retexo_fl.training.lazy import run_lazy
from retexo_fl.training.lazy_client import LazyClient

HAVE_CUDA = torch.cuda.is_available()


def test_auto_is_the_gpu_when_there_is_one_and_bad_names_are_refused():
    assert resolve_device("auto").type == ("cuda" if HAVE_CUDA else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="'gpu0': not a device name"):
        resolve_device("gpu0")
    with pytest.raises(ValueError, match="'cuda:99'"):
        resolve_device("cuda:99")
    if not HAVE_CUDA:
        with pytest.raises(ValueError, match="sees no CUDA device on this machine"):
            resolve_device("cuda")


@pytest.mark.skipif(not HAVE_CUDA, reason="needs a GPU")
def test_a_client_keeps_its_partition_and_stage_model_on_the_gpu(sbm):
    part = partition_graph(sbm, 3, "metis", seed=0)[0]
    client = LazyClient(part, TrainConfig(stages=2, hidden=16, device="auto"))
    assert client.device.type == "cuda"
    assert client.owned.is_cuda and all(m.is_cuda for m in client.masks.values())
    assert all(p.is_cuda for p in client.make_model().parameters())


@pytest.mark.skipif(not HAVE_CUDA, reason="needs a GPU")
def test_gpu_runs_learn_as_cpu_runs_do(sbm):
    # Kernels differ between devices (summation order), so the runs are close, not equal.
    cfg = {"stages": 2, "hidden": 16, "rounds": 20, "seed": 0, "self_training": 0}
    parts = partition_graph(sbm, 3, "metis", seed=0)
    on = {d: run_lazy(parts, TrainConfig(**cfg, device=d)) for d in ("cpu", "cuda")}
    assert abs(on["cuda"]["test_accuracy"] - on["cpu"]["test_accuracy"]) <= 0.03
    assert on["cuda"]["bytes_boundary"] == on["cpu"]["bytes_boundary"]
    whole = whole_graph_partition(sbm)
    central = {d: run_centralized(whole, TrainConfig(**cfg, device=d)) for d in ("cpu", "cuda")}
    assert abs(central["cuda"]["test_accuracy"] - central["cpu"]["test_accuracy"]) <= 0.03
