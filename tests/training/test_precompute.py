"""Aggregating a stage's frozen inputs once: equal to message passing where it is exact (no
input dropout), in the forward pass, the gradients and a whole run."""

from __future__ import annotations

import pytest
import torch

from retexo_fl.config import TrainConfig
from retexo_fl.data.partitioners import partition_graph
from retexo_fl.metrics import RunRecorder
from retexo_fl.runner import train
from retexo_fl.training.lazy import run_lazy


def _config(model: str, precompute: bool) -> TrainConfig:
    return TrainConfig.resolve(
        profile="exact", clients=3, stages=2, hidden=8, model=model, input_dropout=0.0, precompute=precompute
    )


@pytest.mark.parametrize("model", ["gcn", "sage"])
def test_aggregated_forward_and_gradients_equal_message_passing(stage_one_client, stage_outputs, model):
    plain, fast = stage_one_client(_config(model, False)), stage_one_client(_config(model, True))
    assert plain.graph.num_halo > 0  # the halo rows must take part, or this proves less
    state = plain.make_model().state_dict()
    (h1, l1, g1), (h2, l2, g2) = (stage_outputs(client, state) for client in (plain, fast))
    assert torch.allclose(h1, h2, atol=1e-5) and torch.allclose(l1, l2, atol=1e-5)
    assert g1.keys() == g2.keys() and all(torch.allclose(g1[k], g2[k], atol=1e-4) for k in g1)
    # A changed halo row changes the aggregated input: the cache follows the stage input.
    before = fast.aggregated_input()
    fast.halo = fast.halo + 1.0
    assert not torch.allclose(fast.aggregated_input(), before)


@pytest.mark.parametrize(("model", "root_weight"), [("sage", False), ("gcn", True)])
def test_scaled_small_inputs_aggregate_as_message_passing_does_root_term_included(
    stage_one_client, stage_outputs, model, root_weight
):
    """Rows under the input floor are scaled up before a stage reads them; the aggregated path's
    root term (SAGE's, or GCN's with a root weight) must read them scaled too."""

    def config(precompute: bool) -> TrainConfig:
        return TrainConfig.resolve(
            clients=3, stages=2, hidden=8, model=model, root_weight=root_weight, precompute=precompute,
            input_dropout=0.0, dropout=0.0, gnn_input_rms_floor=0.25, first_stage="mlp",
        )  # fmt: skip

    plain, fast = (
        stage_one_client(config(False), row_scale=0.01),
        stage_one_client(config(True), row_scale=0.01),
    )
    assert plain.input_scale() > 10  # the floor is what this is about
    state = plain.make_model().state_dict()
    (h1, l1, g1), (h2, l2, g2) = (stage_outputs(client, state) for client in (plain, fast))
    assert torch.allclose(h1, h2, atol=1e-5) and torch.allclose(l1, l2, atol=1e-5)
    assert all(torch.allclose(g1[k], g2[k], atol=1e-4) for k in g1)


def test_gat_and_sage_max_keep_message_passing(stage_one_client):
    client = stage_one_client(_config("gat", True))
    model = client.make_model()
    assert not model.aggregates_linearly
    with pytest.raises(ValueError, match="gat stage cannot run on aggregated inputs"):
        model.forward_aggregated(torch.zeros(2, 8), torch.zeros(2, 8))
    assert client.outputs(model)[1].shape == (client.graph.num_owned, client.part.num_classes)


@pytest.mark.parametrize("model", ["gcn", "sage"])
def test_a_whole_run_is_the_same_without_input_dropout(sbm, model):
    parts = partition_graph(sbm, 3, "metis", seed=0)
    # 32-bit updates and broadcasts: precomputing sums in another order, so the two runs differ
    # in the last float bits, and a stochastic 4-bit code (the default) turns such a difference
    # into a whole step wherever a value sits at a code boundary; then the runs part.
    base = dict(
        clients=3, stages=3, hidden=8, rounds=6, model=model, input_dropout=0.0, seed=0,
        update_bits=32, broadcast_bits=32,
    )  # fmt: skip
    plain = run_lazy(parts, TrainConfig.resolve(**base))
    fast = run_lazy(parts, TrainConfig.resolve(**base, precompute=True))
    assert fast["bytes_total"] == plain["bytes_total"]
    for a, b in zip(plain["stages"], fast["stages"], strict=True):
        assert [r["val_accuracy"] for r in a["history"]] == [r["val_accuracy"] for r in b["history"]]
        assert [r["train_loss"] for r in a["history"]] == pytest.approx(
            [r["train_loss"] for r in b["history"]], rel=1e-4
        )
    assert fast["test_accuracy"] == plain["test_accuracy"]


def test_the_cli_key_reaches_the_clients():
    cfg = TrainConfig.from_mapping({"precompute": True, "model": "sage"})
    assert cfg.precompute and cfg.training.precompute
    quiet = RunRecorder(None, stream=None)
    cfg = TrainConfig.resolve(
        profile="exact", dataset="sbm:300,3", clients=2, stages=2, hidden=8, rounds=3, precompute=True
    )
    summary = train(cfg, quiet)
    assert summary["config"]["precompute"] is True and 0 <= summary["test_accuracy"] <= 1
