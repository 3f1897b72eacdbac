"""``first-stage local``: stage 0 is one GNN layer over a client's own edges, and reads nothing else.

Checked from first principles: a client's stage-0 output equals a dense GCN layer over the
subgraph its nodes induce (degrees counted inside it), over ``local-hops`` hops of it; and no
other client's features change it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from retexo_fl.config import TrainConfig
from retexo_fl.data.datasets import apply_split, synthetic_sbm
from retexo_fl.data.partitioners import partition_graph
from retexo_fl.metrics import RunRecorder
from retexo_fl.party.lazy_client import LazyClient
from retexo_fl.training.lazy import run_lazy


def _graph():
    data = synthetic_sbm(240, 3, avg_degree=6, homophily=0.8, num_features=6, seed=3)
    apply_split(data, "random:0.3,0.2,0.5", seed=3)
    return data


def _local_gcn(
    data, owner: np.ndarray, pid: int, weight: torch.Tensor, bias: torch.Tensor, hops: int = 1
) -> torch.Tensor:
    """ReLU(Â_p^hops X W^T + b) for partition ``pid``'s nodes, in float64: Â is GCN's normalized
    adjacency of the subgraph ``pid``'s nodes induce (self loops, the edges whose two ends it
    owns, 1 / sqrt((d_i + 1)(d_j + 1)) with degrees counted inside that subgraph)."""
    own = torch.from_numpy(owner == pid)
    idx = own.nonzero().squeeze(1)
    local = torch.full((data.num_nodes,), -1, dtype=torch.long)
    local[idx] = torch.arange(idx.numel())
    src, dst = data.edge_index
    keep = own[src] & own[dst]
    s, d = local[src[keep]], local[dst[keep]]
    n = idx.numel()
    deg = torch.bincount(d, minlength=n).double() + 1.0
    adj = torch.zeros(n, n, dtype=torch.float64)
    adj[d, s] = 1.0 / torch.sqrt(deg[d] * deg[s])
    adj += torch.diag(1.0 / deg)
    x = data.x[idx].double()
    for _ in range(hops):
        x = adj @ x
    return torch.relu(x @ weight.double().T + bias.double()).float()


def _owner(parts, n: int) -> np.ndarray:
    owner = np.full(n, -1)
    for p in parts:
        owner[p.node_ids] = p.partition_id
    return owner


@pytest.mark.parametrize("hops", [1, 2, 3])
def test_a_local_first_stage_is_a_gcn_layer_over_the_clients_induced_subgraph(hops):
    # local-hops k: the layer reads its input propagated k - 1 times first, so it is Â^k X W.
    data = _graph()
    parts = partition_graph(data, 3, "random", seed=0)
    owner = _owner(parts, data.num_nodes)
    cfg = TrainConfig(
        first_stage="local", local_hops=hops, hidden=8, dropout=0.0, input_dropout=0.0
    ).validate()
    cut = 0
    for part in parts:
        client = LazyClient(part, cfg)
        assert client.graph.num_halo > 0  # random partitions: every client has cross edges
        cut += int(client.graph.num_halo)
        model = client.make_model().eval()
        hidden, _ = client.outputs(model)
        body = model.body
        weight, bias = body.lin.weight.detach(), body.bias.detach()
        expected = _local_gcn(data, owner, part.partition_id, weight, bias, hops)
        torch.testing.assert_close(hidden, expected, rtol=1e-5, atol=1e-5)
        if hops > 1:  # ...and not the one-hop layer: the comparison can fail
            assert not torch.allclose(hidden, _local_gcn(data, owner, part.partition_id, weight, bias))
    assert cut > 0


@pytest.mark.parametrize("hops", [1, 2])
@pytest.mark.parametrize("model", ["gcn", "sage", "sage-max", "gat"])
def test_a_local_first_stage_reads_no_other_clients_features(model, hops):
    data = _graph()
    parts = partition_graph(data, 3, "random", seed=0)
    cfg = TrainConfig(
        model=model, first_stage="local", local_hops=hops, hidden=8, dropout=0.0, input_dropout=0.0
    ).validate()
    before = LazyClient(parts[0], cfg)
    h0, _ = before.outputs(before.make_model().eval())
    # Every other client's features replaced: client 0's stage 0 cannot tell.
    for p in parts[1:]:
        p.x = np.random.default_rng(0).normal(size=p.x.shape).astype(np.float32)
    after = LazyClient(parts[0], cfg)
    h1, _ = after.outputs(after.make_model().eval())
    torch.testing.assert_close(h0, h1, rtol=0, atol=0)
    # ...while its own features do change it: the comparison can fail.
    parts[0].x = parts[0].x * 2.0
    mine = LazyClient(parts[0], cfg)
    h2, _ = mine.outputs(mine.make_model().eval())
    assert not torch.allclose(h0, h2)


def test_a_local_first_stage_trains_and_its_stage_0_beats_the_mlp_on_a_structural_graph():
    # Features weak on their own, structure strong, 2 METIS clients (most edges inside a client):
    # stage 0 over own edges validates above the MLP stage 0. Seed 0: measured 0.89 against
    # 0.41 when written; the bar is a 5-point gain, far below that, so it holds across platforms.
    data = synthetic_sbm(400, 3, avg_degree=8, homophily=0.9, num_features=16, feature_signal=0.2, seed=1)
    apply_split(data, "random:0.3,0.2,0.5", seed=1)
    parts = partition_graph(data, 2, "metis", seed=0)
    vals = {}
    for first in ("mlp", "local"):
        cfg = TrainConfig(stages=1, self_training=0, first_stage=first, seed=0).validate()
        summary = run_lazy(parts, cfg, RunRecorder(None, stream=None))
        vals[first] = summary["stages"][0]["val_accuracy"]
    assert vals["local"] > vals["mlp"] + 0.05, vals


def test_local_hops_leave_an_mlp_stage_0_as_it_was():
    # Only a local stage 0 reads the propagated input: the MLP (also the MLP lane of auto) reads
    # each node's own raw row, whatever local-hops says.
    data = _graph()
    part = partition_graph(data, 3, "random", seed=0)[0]
    outputs = {}
    for hops in (1, 3):
        cfg = TrainConfig(
            first_stage="auto", local_hops=hops, hidden=8, dropout=0.0, input_dropout=0.0
        ).validate()
        client = LazyClient(part, cfg)
        client.set_first_stage("mlp")
        torch.manual_seed(0)
        outputs["mlp", hops] = client.outputs(client.make_model().eval())[0]
        client.set_first_stage("local")
        torch.manual_seed(0)
        outputs["local", hops] = client.outputs(client.make_model().eval())[0]
        assert client.stage_input() is client.stage_input()  # propagated once, then kept
    torch.testing.assert_close(outputs["mlp", 1], outputs["mlp", 3], rtol=0, atol=0)
    assert not torch.allclose(outputs["local", 1], outputs["local", 3])


@pytest.mark.parametrize("model", ["gcn", "sage"])
def test_a_two_hop_local_first_stage_is_the_same_aggregated_once_or_in_chunks(model):
    # precompute aggregates the propagated input once, chunk-rows computes it a slice of rows at
    # a time: both are the message-passing layer's output (no dropout, so exactly comparable).
    data = _graph()
    part = partition_graph(data, 3, "random", seed=0)[0]
    outputs = {}
    for name, extra in (("plain", {}), ("precompute", {"precompute": True}), ("chunks", {"chunk_rows": 7})):
        cfg = TrainConfig(
            model=model, first_stage="local", local_hops=2, hidden=8, dropout=0.0, input_dropout=0.0, **extra
        ).validate()
        client = LazyClient(part, cfg)
        torch.manual_seed(0)
        model_ = client.make_model().eval()
        with torch.no_grad():
            outputs[name] = client.outputs(model_)[0]
    torch.testing.assert_close(outputs["precompute"], outputs["plain"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outputs["chunks"], outputs["plain"], rtol=1e-5, atol=1e-5)


def test_local_hops_below_one_are_refused():
    with pytest.raises(ValueError, match="local-hops must be in"):
        TrainConfig(local_hops=0).validate()


def test_an_unknown_first_stage_or_one_outside_lazy_mode_is_refused():
    with pytest.raises(ValueError, match="first-stage must be one of"):
        TrainConfig(first_stage="gcn").validate()
    with pytest.raises(ValueError, match="first-stage local applies to lazy mode, not eager"):
        TrainConfig.resolve(mode="eager", first_stage="local").validate()


def test_identity_features_are_recognized_and_said_once(monkeypatch, caplog):
    """One-hot node identities (a featureless graph's stand-in, as in the Airports graphs): an
    MLP stage 0 learns nothing from them for unlabelled nodes; the run says so once, naming a
    client and the remedy, and not for ordinary features or with a local stage 0."""
    from retexo_fl.party import lazy_client

    assert lazy_client.identity_like(torch.eye(10))
    assert lazy_client.identity_like(torch.eye(12)[torch.randperm(12)][:9])  # a client's rows
    assert not lazy_client.identity_like(torch.eye(5))  # too few rows to tell
    assert not lazy_client.identity_like(torch.eye(10) * 2)  # not one-hot
    shared = torch.eye(10)
    shared[3] = shared[4]  # two nodes in one category
    assert not lazy_client.identity_like(shared)
    assert not lazy_client.identity_like(torch.rand(20, 30))

    data = _graph()
    data.x = torch.eye(data.num_nodes)
    for first_stage, said in (("local", False), ("mlp", True)):
        cfg = TrainConfig(
            stages=2, rounds=2, min_rounds=0, self_training=0, hidden=8, first_stage=first_stage
        ).validate()
        monkeypatch.setattr(lazy_client, "_identity_warned", False)
        caplog.clear()
        with caplog.at_level("WARNING", logger="retexo_fl.party.lazy_client"):
            run_lazy(partition_graph(data, 3, "random", seed=0), cfg, RunRecorder(None, stream=None))
        messages = [r.getMessage() for r in caplog.records if "node identities" in r.getMessage()]
        assert len(messages) == (1 if said else 0), first_stage  # once, though 3 clients read them
        if said:
            assert messages[0].startswith("client ") and "--first-stage local" in messages[0]
