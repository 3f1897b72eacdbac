"""Boundary plans and local graphs: a partitioned conv layer computes exactly the whole-graph layer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from retexo_fl.data.partitioners import partition_graph
from retexo_fl.models.stage import make_conv
from retexo_fl.plan import BoundaryPlan, LocalGraph, PlanMismatchError, check_plans
from retexo_fl.training.centralized import whole_graph_partition


def exchange(outgoing: dict[int, dict[int, torch.Tensor]]) -> tuple[dict[int, dict[int, torch.Tensor]], None]:
    """Route ``{src: {dst: rows}}`` to ``{dst: {src: rows}}``: what the server's relay does, minus frames."""
    incoming: dict[int, dict[int, torch.Tensor]] = {}
    for src, per_dst in outgoing.items():
        for dst, rows in per_dst.items():
            incoming.setdefault(dst, {})[src] = rows
    return incoming, None


def _partitioned_outputs(data, parts, conv, feats):
    plans = [BoundaryPlan.from_partition(p) for p in parts]
    check_plans({p.partition_id: pl.digests() for p, pl in zip(parts, plans, strict=True)})
    graphs = [LocalGraph.build(p, pl) for p, pl in zip(parts, plans, strict=True)]
    owned = [feats[torch.from_numpy(p.node_ids)] for p in parts]
    halo_in, _ = exchange(
        {p.partition_id: pl.rows_for(h) for p, pl, h in zip(parts, plans, owned, strict=True)}
    )
    deg_in, _ = exchange(
        {
            p.partition_id: pl.rows_for(g.in_degree.view(-1, 1))
            for p, pl, g in zip(parts, plans, graphs, strict=True)
        }
    )
    out = torch.zeros(data.num_nodes, conv.out_channels)
    for p, pl, g, h in zip(parts, plans, graphs, owned, strict=True):
        x = torch.cat([h, pl.assemble_halo(halo_in.get(p.partition_id, {}), h.shape[1])])
        if isinstance(conv, torch.nn.Module) and conv.__class__.__name__ == "GCNConv":
            hdeg = pl.assemble_halo(deg_in.get(p.partition_id, {}), 1).view(-1)
            ei, w = g.gcn_weights(hdeg)
            y = conv(x, ei, w)
        else:
            y = conv(x, g.edge_index)
        out[torch.from_numpy(p.node_ids)] = y[: g.num_owned]
    return out


@pytest.mark.parametrize("kind", ["gcn", "sage", "sage-max", "gat"])
@pytest.mark.parametrize("method", ["metis", "random"])
def test_partitioned_layer_equals_whole_graph(sbm, kind, method):
    from torch_geometric.nn.conv.gcn_conv import gcn_norm

    torch.manual_seed(0)
    conv = make_conv(kind, 16, 8, heads=2).eval()
    feats = torch.randn(sbm.num_nodes, 16)
    whole = whole_graph_partition(sbm)
    parts = partition_graph(sbm, 4, method, seed=0)
    got = _partitioned_outputs(sbm, parts, conv, feats)
    if kind == "gcn":
        ei, w = gcn_norm(sbm.edge_index, num_nodes=sbm.num_nodes, add_self_loops=True)
        want = conv(feats, ei, w)  # PyG's own normalization on the whole graph
    else:
        want = _partitioned_outputs(sbm, [whole], conv, feats)
        torch.testing.assert_close(want, conv(feats, sbm.edge_index), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_plan_mismatch_names_both_clients(sbm):
    parts = partition_graph(sbm, 3, "metis", seed=0)
    digests = {p.partition_id: BoundaryPlan.from_partition(p).digests() for p in parts}
    check_plans(digests)
    peer = next(iter(digests[0]["send"]))
    digests[0]["send"][peer] = "0" * 32
    with pytest.raises(PlanMismatchError, match=rf"client 0 .*client {peer}.*not parts of one cut"):
        check_plans(digests)


def test_assemble_halo_rejects_wrong_shapes(sbm):
    part = partition_graph(sbm, 2, "random", seed=0)[0]
    plan = BoundaryPlan.from_partition(part)
    peer = next(iter(plan.recv))
    with pytest.raises(PlanMismatchError, match="no rows received"):
        plan.assemble_halo({}, 4)
    with pytest.raises(PlanMismatchError, match=f"client {peer} sent rows of shape"):
        plan.assemble_halo({peer: torch.zeros(plan.recv[peer].size + 1, 4)}, 4)


def test_halo_order_is_sorted_per_peer(sbm):
    for part in partition_graph(sbm, 4, "random", seed=0):
        plan = BoundaryPlan.from_partition(part)
        for q, (a, b) in plan.halo_offsets.items():
            block = plan.halo_ids[a:b]
            assert np.all(block[1:] > block[:-1])
            assert np.array_equal(block, plan.recv[q])


@pytest.mark.parametrize("encrypt", [True, False])
def test_setup_digests_are_keyed_to_each_pair_so_the_server_cannot_test_guesses(sbm, encrypt):
    """An attack review hashed every list of one or two ids (the id space is the sum of the setup
    counts) and matched them against the unkeyed digests clients reported at setup: 108 of 456
    lists with 16 METIS clients, and 14 private cross edges exactly. Encrypted, a client keys
    each digest to its pair's channel: the two ends still agree (the run's plan check passes),
    and a guess hashed by the server matches nothing. Without encryption the server relays the
    rows themselves, and the digests stay plain."""
    import dataclasses
    import json

    from retexo_fl import protocol as P
    from retexo_fl.config import TrainConfig
    from retexo_fl.coordinator.stages import LazyStageMachine
    from retexo_fl.metrics import RunRecorder
    from retexo_fl.party.lazy_client import LazyClient
    from retexo_fl.plan import ids_digest
    from retexo_fl.training.inprocess import InProcessTransport

    reported: dict[int, dict] = {}

    class Recording(InProcessTransport):
        def send(self, kind, requests, phase, stage):
            batch = super().send(kind, requests, phase, stage)
            if kind == P.SETUP:
                for reply in batch.replies.values():
                    info = reply[P.CONFIG]
                    reported[int(info[P.PARTITION_ID])] = json.loads(str(info[P.DIGESTS]))
            return batch

    parts = partition_graph(sbm, 16, "metis", seed=0)
    cfg = TrainConfig.resolve(profile="exact", clients=16, stages=1, rounds=1, hidden=8, seed=0)
    cfg = dataclasses.replace(cfg, encrypt=encrypt)
    LazyStageMachine(
        Recording([LazyClient(p, cfg) for p in parts]), cfg, RunRecorder(None, stream=None)
    ).run()
    short = 0
    for part in parts:
        plan = BoundaryPlan.from_partition(part)
        for side, lists in (("send", plan.send_ids), ("recv", plan.recv)):
            for q, ids in lists.items():
                plain = ids_digest(ids)
                short += len(ids) <= 2
                assert (reported[part.partition_id][side][str(q)] == plain) is not encrypt
    assert short > 50  # the lists the attack read: 108 of them on this partitioning


def _directed(data):
    """``data`` with a third of its edges kept one way only: cross edges of every direction."""
    from torch_geometric.data import Data

    ei = data.edge_index
    keep = (ei[0] < ei[1]) | (torch.arange(ei.shape[1]) % 3 != 0)
    out = Data(x=data.x, y=data.y, edge_index=ei[:, keep])
    for split in ("train_mask", "val_mask", "test_mask"):
        out[split] = data[split]
    return out


@pytest.mark.parametrize(
    "graph,clients,method",
    [("sbm", 4, "metis"), ("sbm", 7, "random"), ("directed", 5, "random"), ("sbm", 600, "node")],
)
def test_set_up_tables_and_sorts_give_the_same_plan_and_graph(sbm, monkeypatch, graph, clients, method):
    """The id tables of a large client's set-up (``dense_lookups``, the (peer, row) marks) give
    the plan and the local graph the sorts and binary searches give, array for array."""
    import retexo_fl.plan as plan_module

    data = _directed(sbm) if graph == "directed" else sbm
    parts = partition_graph(data, clients, method, seed=0)
    assert any(p.cross_edges.size for p in parts)
    if graph == "directed":
        assert {1, 2} <= {int(d) for p in parts for d in p.cross_edges[:, 3]}

    def built(records_per_id: float, marks_per_record: int) -> list[tuple[BoundaryPlan, LocalGraph]]:
        monkeypatch.setattr(plan_module, "DENSE_RECORDS_PER_ID", records_per_id)
        monkeypatch.setattr(plan_module, "MARKS_PER_RECORD", marks_per_record)
        plans = [BoundaryPlan.from_partition(p) for p in parts]
        return [(pl, LocalGraph.build(p, pl)) for p, pl in zip(parts, plans, strict=True)]

    sorted_ = built(float("inf"), 16)  # never a table: the sorts and searches
    for variant in (built(0.0, 16), built(0.0, 0)):  # tables, with the marks, then sorting the pairs
        for (a, ga), (b, gb) in zip(sorted_, variant, strict=True):
            assert a.halo_offsets == b.halo_offsets
            np.testing.assert_array_equal(a.halo_ids, b.halo_ids)
            for name in ("send", "send_ids", "recv"):
                mine, theirs = getattr(a, name), getattr(b, name)
                assert list(mine) == list(theirs), name  # the same peers, in the same order
                for q in mine:
                    assert mine[q].dtype == theirs[q].dtype
                    np.testing.assert_array_equal(mine[q], theirs[q])
            assert torch.equal(ga.edge_index, gb.edge_index) and torch.equal(ga.in_degree, gb.in_degree)
