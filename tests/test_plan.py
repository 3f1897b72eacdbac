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
    with pytest.raises(PlanMismatchError, match=rf"client 0 .*client {peer}"):
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
