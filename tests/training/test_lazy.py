"""Lazy and centralized training on a generated graph where structure carries the label."""

from __future__ import annotations

import pytest
import torch

from retexo_fl.compress.payload import HEADER_BYTES
from retexo_fl.config import TrainConfig
from retexo_fl.data.partitioners import partition_graph
from retexo_fl.secure.envelope import ENVELOPE_BYTES
from retexo_fl.training.centralized import run_centralized, whole_graph_partition
from retexo_fl.training.lazy import run_lazy


@pytest.mark.parametrize("model", ["gcn", "sage", "sage-max", "gat"])
def test_lazy_learns_from_cross_client_structure(sbm, model):
    cfg = TrainConfig.resolve(profile="exact", model=model, stages=3, hidden=32, rounds=60, seed=0)
    summary = run_lazy(partition_graph(sbm, 4, "metis", seed=0), cfg)
    features_only = summary["stages"][0]["val_accuracy"]  # stage 0: an MLP on own features
    assert summary["test_accuracy"] >= 0.88
    assert summary["test_accuracy"] >= features_only + 0.2
    # One exchange per stage boundary plus the GCN degree exchange; nothing after the last stage.
    assert summary["stages"][-1]["bytes_boundary"] == 0
    per_stage = sum(s["bytes_boundary"] for s in summary["stages"])
    assert summary["bytes_boundary"] >= per_stage > 0
    assert summary["bytes_total"] == summary["bytes_boundary"] + summary["bytes_model"]


@pytest.mark.parametrize("bits", [32, 4, 1])
def test_boundary_bytes_are_exact_row_counts(sbm, bits):
    cfg = TrainConfig.resolve(profile="exact", model="sage", hidden=8, stages=2, rounds=1, seed=0, bits=bits)
    parts = partition_graph(sbm, 3, "random", seed=0)
    summary = run_lazy(parts, cfg)
    # One frame per (receiver, sender) pair: header, then per-row ranges and packed codes.
    blocks = [
        len({r[1] for r in p.cross_edges.tolist() if r[2] == q})
        for p in parts
        for q in sorted({r[2] for r in p.cross_edges.tolist()})
    ]
    if bits == 32:
        want = sum(HEADER_BYTES + k * cfg.hidden * 4 for k in blocks)
    else:
        want = sum(HEADER_BYTES + 4 * k + (k * cfg.hidden * bits + 7) // 8 for k in blocks)
    # Encryption is on by default: every frame travels in one envelope.
    assert summary["bytes_boundary"] == want + len(blocks) * ENVELOPE_BYTES
    assert summary["bytes_boundary_raw"] == sum(HEADER_BYTES + k * cfg.hidden * 4 for k in blocks)
    assert summary["bit_histogram"] == {str(bits): sum(blocks)}


def test_centralized_reference(sbm):
    summary = run_centralized(
        whole_graph_partition(sbm), TrainConfig.resolve(profile="exact", hidden=32, rounds=60)
    )
    assert summary["test_accuracy"] >= 0.9
    assert summary["bytes_total"] == 0


def test_a_client_whose_training_diverges_is_named_with_the_likely_cause():
    # Raw features in the hundreds (a user's unscaled columns), the default local SGD at lr 1
    # and FedAvg in every stage: the weights blow up to NaN. The run ends naming the client,
    # stage and round and what to change, not with a codec refusing NaN rows.
    from retexo_fl.data.datasets import apply_split, synthetic_sbm
    from retexo_fl.metrics import RunRecorder
    from retexo_fl.party.client import TrainingDiverged

    data = synthetic_sbm(300, 3, avg_degree=6.0, homophily=0.8, num_features=16, seed=0)
    apply_split(data, "random:0.6,0.2,0.2", seed=0)
    data.x = data.x * 300
    settings = {"clients": 3, "method": "random", "seed": 0, "stages": 2, "rounds": 3, "min_rounds": 3}
    cfg = TrainConfig(**settings, self_training=0, server_optimizer="avg")
    parts = partition_graph(data, 3, "random", seed=0)
    # Its own steps, or the average of its peers' that the server sends back (a state beyond any
    # training's values, refused before use), whichever comes first.
    diverged = r"client \d, stage 0, round \d: (the received state's .* )?local training diverged .* scale"
    with pytest.raises(TrainingDiverged, match=diverged):
        run_lazy(parts, cfg, RunRecorder(None, stream=None))
    # The default's stage 0 (FedAdam: the server moves each weight by about its learning rate a
    # round, whatever the clients' steps) does not diverge on the same graph, and learns a little
    # in its 3 rounds: validation 0.433-0.600 over seeds 0-5 (chance about 0.33), test 0.333-0.600
    # on 60 nodes (measured 2026-11-29; this seed 0.517 and 0.333), so validation is what is held.
    unscaled = run_lazy(parts, TrainConfig(**settings, self_training=0), RunRecorder(None, stream=None))
    assert unscaled.val_accuracy > 0.45
    data.x = data.x / 300  # the same graph, scaled: trains
    scaled = run_lazy(partition_graph(data, 3, "random", seed=0), cfg, RunRecorder(None, stream=None))
    assert scaled.test_accuracy > 0.5  # measured 0.967; 3 classes, chance 0.33


def test_each_stage_takes_its_own_server_optimizer(sbm):
    """``server-optimizer adam,avg``: stage 0 is stage 0 of an all-adam run, round for round, and
    stage 1 averages (FedAvg) instead."""
    parts = partition_graph(sbm, 3, "random", seed=0)
    base = {"stages": 2, "hidden": 8, "rounds": 3, "seed": 0, "self_training": 0, "patience": 0}
    mixed, adam, avg = (
        run_lazy(parts, TrainConfig.resolve(**base, server_optimizer=opt, server_lr=0.05))
        for opt in (["adam", "avg"], "adam", "avg")
    )

    def curve(summary: dict, stage: int) -> list[float]:
        return [h["val_loss"] for h in summary["stages"][stage]["history"]]

    assert curve(mixed, 0) == curve(adam, 0) != curve(avg, 0)
    assert curve(mixed, 1) != curve(adam, 1)


def test_clients_built_on_threads_train_as_those_built_in_turn(sbm, monkeypatch):
    """A large graph's clients are built on threads in process (``map_partitions``): the same
    run, stage for stage, as clients built one after another; lazy and eager."""
    import retexo_fl.data.partition as partition_module
    from retexo_fl.training.eager import run_eager

    parts = partition_graph(sbm, 4, "random", seed=0)
    runs = {}
    for threads in (False, True):
        monkeypatch.setattr(partition_module, "PARALLEL_NODES", 0 if threads else 1 << 62)
        monkeypatch.setattr(partition_module, "PARALLEL_PART_NODES", 0)
        lazy = run_lazy(parts, TrainConfig(stages=2, rounds=3, min_rounds=0, self_training=0, seed=0))
        eager = run_eager(parts, TrainConfig.resolve(mode="eager", rounds=3, seed=0))
        keys = ("val_accuracy", "val_loss", "bytes_model", "bytes_boundary")
        runs[threads] = [[s[k] for k in keys] for s in lazy["stages"]] + [
            [lazy["test_accuracy"], eager["test_accuracy"], eager["bytes_total"]]
        ]
    assert runs[True] == runs[False]
    # --threads holds for the run's own thread, where training runs, not only for the pool's.
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        run_lazy(parts, TrainConfig(stages=1, rounds=1, min_rounds=0, self_training=0, threads=1))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
