"""Where training runs: ``--device auto`` picks the GPU when there is one and the partition is
large enough for it to be the faster device; CUDA runs skip without one."""

from __future__ import annotations

import pytest
import torch

from retexo_fl.config import TrainConfig
from retexo_fl.data.partitioners import partition_graph
from retexo_fl.runner import device_line
from retexo_fl.seeding import AUTO_GPU_MIN_NODES, device_choice, resolve_device
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


def test_auto_keeps_a_small_partition_on_the_cpu_and_says_why(sbm, monkeypatch):
    # A machine with a GPU, as far as the choice can tell: nothing here touches the GPU.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "Test GPU")
    small, reason = device_choice("auto", 270)
    assert small == torch.device("cpu")
    assert reason == (
        f"auto: cpu, as 270 nodes are under the {AUTO_GPU_MIN_NODES} from which the GPU is "
        "faster (--device cuda to use it)"
    )
    assert device_choice("auto", AUTO_GPU_MIN_NODES) == (torch.device("cuda"), "auto: cuda (Test GPU)")
    assert device_choice("auto") == (torch.device("cuda"), "auto: cuda (Test GPU)")  # size unknown
    parts = partition_graph(sbm, 3, "metis", seed=0)
    assert LazyClient(parts[0], TrainConfig(stages=2, hidden=16, device="auto")).device.type == "cpu"
    # The run's first lines say where its parties compute: per partition, by its own size.
    assert device_line("auto", [270, 5000, 300]) == (
        "device cpu for 2 of 3 partitions, cuda for 1 of 3 partitions (auto: cpu, as 270 nodes are "
        f"under the {AUTO_GPU_MIN_NODES} from which the GPU is faster (--device cuda to use it))"
    )
    assert device_line("cpu", [2708]) == "device cpu: as set"


def test_auto_without_a_gpu_is_the_cpu_whatever_the_size(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_choice("auto", 10**7) == (torch.device("cpu"), "auto: cpu, as torch sees no CUDA device")


@pytest.mark.skipif(not HAVE_CUDA, reason="needs a GPU")
def test_a_client_keeps_its_partition_and_stage_model_on_the_gpu(sbm):
    part = partition_graph(sbm, 3, "metis", seed=0)[0]
    client = LazyClient(part, TrainConfig(stages=2, hidden=16, device="cuda"))
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
