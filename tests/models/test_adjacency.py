"""The sparse (CSR) path of GCN and SAGE layers gives what edge-list message passing gives:
outputs and gradients, on a client's local graph with halo rows, in every model that uses it."""

from __future__ import annotations

import pytest
import torch

from retexo_fl.data.partitioners import partition_graph
from retexo_fl.models.adjacency import (
    SPARE_VALUES_PER_EDGE,
    adjacency_select,
    aggregates_first,
    is_sparse,
    run_conv,
    sparse_adjacency,
)
from retexo_fl.models.gnn import GNN
from retexo_fl.models.layered import LayeredGNN
from retexo_fl.models.stage import StageModel, make_conv
from retexo_fl.plan import BoundaryPlan, LocalGraph

# Float32 sums in another order: outputs agree to rounding, not bit for bit.
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def local(sbm):
    """Client 1's local graph (owned rows, then halo rows) and GCN's global-degree weights."""
    part = partition_graph(sbm, 3, "random", seed=0)[1]
    graph = LocalGraph.build(part, BoundaryPlan.from_partition(part))
    assert graph.num_halo > 0
    halo_degree = torch.randint(1, 9, (graph.num_halo,), generator=torch.Generator().manual_seed(0)).float()
    ei, w = graph.gcn_weights(halo_degree)  # owned self loops, symmetric weights
    return graph, ei, w


def _grads(out: torch.Tensor, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(torch.autograd.grad(out.square().sum() + out.sum(), inputs, retain_graph=True))


@pytest.mark.parametrize("kind", ["gcn", "sage"])
def test_a_conv_layer_on_the_adjacency_equals_message_passing_with_halo_rows(local, kind):
    graph, ei, w = local
    n, total = graph.num_owned, graph.num_owned + graph.num_halo
    edges, weights = (ei, w) if kind == "gcn" else (graph.edge_index, None)
    adj = sparse_adjacency(edges, weights, n, total)
    assert is_sparse(adj) and tuple(adj.shape) == (n, total) and adj.values().numel() == edges.shape[1]
    torch.manual_seed(0)
    conv = make_conv(kind, 12, 7)
    x = torch.randn(total, 12, requires_grad=True)
    params = list(conv.parameters())
    scatter = run_conv(conv, kind, x, edges, weights)[:n]
    sparse = run_conv(conv, kind, x, adj, None)
    assert sparse.shape == (n, 7)
    torch.testing.assert_close(sparse, scatter, **TOL)
    for a, b in zip(_grads(sparse, [x, *params]), _grads(scatter, [x, *params]), strict=True):
        torch.testing.assert_close(a, b, **TOL)
    # Halo rows get gradient through the edges they send (they are inputs, never targets).
    assert float(_grads(sparse, [x])[0][n:].abs().sum()) > 0


def test_a_narrowing_layer_over_a_few_rows_edges_aggregates_first_and_computes_the_same(local, monkeypatch):
    """A narrowing GCN layer (raw features to the hidden width) whose adjacency reads a few target
    rows' edges, as a local stage 0's step does, is computed as (A x) W: the same outputs and
    weight gradients as GCNConv's A (x W), in fewer operations. Over every owned row (no source
    row to skip), over an input that takes a gradient, or over a dense adjacency it maps first."""
    graph, ei, w = local
    n, total = graph.num_owned, graph.num_owned + graph.num_halo
    adj = sparse_adjacency(ei, w, n, total)
    rows = torch.arange(0, n, 9)
    few = adjacency_select(adj, rows)  # a few training rows' in-edges over every source row
    torch.manual_seed(2)
    conv = make_conv("gcn", 40, 6)
    x = torch.randn(total, 40)
    assert few.values().numel() * SPARE_VALUES_PER_EDGE <= (total - rows.numel()) * 6
    assert aggregates_first(conv, few, x)
    assert not aggregates_first(conv, few, x.clone().requires_grad_())
    square = sparse_adjacency(ei[:, ei[0] < n], w[ei[0] < n], n, n)  # no source row to skip
    assert not aggregates_first(conv, square, x[:n])
    assert not aggregates_first(conv, adj, x)  # every owned row: 10x the few rows' edges
    assert aggregates_first(make_conv("gcn", 6, 40), adj, x[:, :6])  # no narrower: always
    params = list(conv.parameters())
    first = run_conv(conv, "gcn", x, few, None, rows)
    spmm = torch.sparse.mm
    calls = []
    monkeypatch.setattr(torch.sparse, "mm", lambda a, b: calls.append(b.shape[1]) or spmm(a, b))
    run_conv(conv, "gcn", x, few, None, rows)
    assert calls == [40]  # the raw rows aggregated, not the mapped ones
    monkeypatch.undo()
    mapped = conv(x, few)  # GCNConv's own order
    torch.testing.assert_close(first, mapped, **TOL)
    for a, b in zip(_grads(first, params), _grads(mapped, params), strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_the_adjacency_holds_the_weights_and_can_fail(local):
    graph, ei, w = local
    n, total = graph.num_owned, graph.num_owned + graph.num_halo
    adj = sparse_adjacency(ei, w, n, total).to_dense()
    dense = torch.zeros(n, total).index_put_((ei[1], ei[0]), w, accumulate=True)
    torch.testing.assert_close(adj, dense)
    # A wrong weight (here: the transposed matrix's) is caught by the comparison above.
    assert not torch.allclose(sparse_adjacency(ei.flip(0), w, total, total).to_dense()[:n], dense)
    with pytest.raises(ValueError, match="outside the 3 sources"):
        sparse_adjacency(torch.tensor([[5], [0]]), None, 1, 3)


def test_row_chunks_of_the_adjacency_give_the_same_rows(local):
    graph, ei, w = local
    n, total = graph.num_owned, graph.num_owned + graph.num_halo
    adj = sparse_adjacency(ei, w, n, total)
    x = torch.randn(total, 5)
    whole = torch.sparse.mm(adj, x)
    rows = torch.arange(n)
    chunks = [torch.sparse.mm(adjacency_select(adj, rows[s : s + 17]), x) for s in range(0, n, 17)]
    torch.testing.assert_close(torch.cat(chunks), whole)


@pytest.mark.parametrize("kind", ["gcn", "sage"])
def test_every_model_runs_on_the_adjacency_as_on_edges(local, kind):
    graph, ei, w = local
    n, total = graph.num_owned, graph.num_owned + graph.num_halo
    edges, weights = (ei, w) if kind == "gcn" else (graph.edge_index, None)
    adj = sparse_adjacency(edges, weights, n, total)
    torch.manual_seed(1)
    x = torch.randn(total, 10)
    stage = StageModel(kind, 10, 8, 3, dropout=0.0).eval()
    for a, b in zip(stage(x, adj), stage(x, edges, weights, num_targets=n), strict=True):
        torch.testing.assert_close(a, b, **TOL)
    layered = LayeredGNN(kind, 10, 8, 3, layers=3, dropout=0.0).eval()
    halo = [torch.randn(graph.num_halo, 8) for _ in range(2)]
    logits_a, inputs_a = layered(x[:n], adj, None, halo)
    logits_b, inputs_b = layered(x[:n], edges, weights, halo)
    torch.testing.assert_close(logits_a, logits_b, **TOL)
    for a, b in zip(inputs_a, inputs_b, strict=True):
        torch.testing.assert_close(a, b, **TOL)
    # The centralized model: one square adjacency of the owned graph.
    own = edges[:, edges[0] < n]
    own_w = None if weights is None else weights[edges[0] < n]
    gnn = GNN(kind, 10, 8, 3, dropout=0.0).eval()
    square = sparse_adjacency(own, own_w, n, n)
    torch.testing.assert_close(gnn(x[:n], square), gnn(x[:n], own, own_w), **TOL)


def test_a_graph_without_edges(local):
    adj = sparse_adjacency(torch.zeros(2, 0, dtype=torch.long), None, 4, 6)
    out = run_conv(make_conv("sage", 3, 2), "sage", torch.randn(6, 3), adj, None)
    assert out.shape == (4, 2) and torch.isfinite(out).all()
