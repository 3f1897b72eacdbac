"""The centralized reference: what it does with inputs that make its training diverge."""

from __future__ import annotations

import pytest
import torch


def test_a_centralized_run_that_diverges_stops_naming_the_epoch():
    from torch_geometric.data import Data

    from retexo_fl.config import TrainConfig
    from retexo_fl.metrics import RunRecorder
    from retexo_fl.party.client import TrainingDiverged
    from retexo_fl.training.centralized import run_centralized, whole_graph_partition

    n = 20
    x = torch.full((n, 3), 3e38)  # finite, but every product overflows: the loss is NaN at once
    ring = torch.tensor([[i, (i + 1) % n] for i in range(n)]).t()
    data = Data(x=x, y=torch.arange(n) % 2, edge_index=torch.cat([ring, ring.flip(0)], 1))
    for split in ("train", "val", "test"):
        data[f"{split}_mask"] = torch.ones(n, dtype=torch.bool)
    cfg = TrainConfig.resolve(mode="centralized", device="cpu", rounds=5, local_epochs=1)
    with pytest.raises(TrainingDiverged, match="centralized training diverged: loss nan at epoch 1"):
        run_centralized(whole_graph_partition(data), cfg, RunRecorder(None, stream=None))
