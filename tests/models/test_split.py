"""SplitGNN: the centralized reference's GNN, split at its linear maps, computes what it computes."""

from __future__ import annotations

import pytest
import torch

from retexo_fl.models.adjacency import sparse_adjacency
from retexo_fl.models.gnn import GNN
from retexo_fl.models.split import SplitGNN


@pytest.mark.parametrize("kind", ["gcn", "sage"])
@pytest.mark.parametrize("layers", [2, 3])
def test_whole_graph_split_gnn_equals_the_reference_from_its_state_dict(kind: str, layers: int):
    torch.manual_seed(0)
    n, d = 40, 12
    x = torch.randn(n, d)
    ei = torch.randint(0, n, (2, 160))
    adj = sparse_adjacency(ei, torch.rand(160) if kind == "gcn" else None, n, n)
    reference = GNN(kind, d, 8, 3, layers=layers, dropout=0.0).eval()
    split = SplitGNN(kind, d, 8, 3, layers=layers, dropout=0.0).eval()
    split.load_state_dict(reference.state_dict())  # same names and shapes
    with torch.no_grad():
        logits, inputs = split(x, adj, None, [torch.zeros(0, 8)] * layers)
        want = reference(x, adj)
    assert torch.allclose(logits, want, atol=1e-5)
    # What peers would get of the first layer is X W, a linear map of the features, not X.
    first = reference.convs[0]
    w = first.lin.weight if kind == "gcn" else first.lin_l.weight
    assert torch.allclose(inputs[0], x @ w.T, atol=1e-6) and inputs[0].shape == (n, 8)


def test_halo_rows_stand_in_for_the_peers_own_rows():
    """Owned rows 0..29 with rows 30..39 held by a peer: with the peer's X W and hidden rows as
    halo, the owned logits are the whole graph's."""
    torch.manual_seed(1)
    n, own, d = 40, 30, 10
    x = torch.randn(n, d)
    ei = torch.randint(0, n, (2, 200))
    model = SplitGNN("gcn", d, 8, 4, layers=2, dropout=0.0).eval()
    whole_adj = sparse_adjacency(ei, None, n, n)
    with torch.no_grad():
        whole, inputs = model(x, whole_adj, None, [torch.zeros(0, 8)] * 2)
        halo = [inputs[0][own:], inputs[1][own:]]
        local_adj = sparse_adjacency(ei, None, own, n)  # the owned rows over owned then halo
        mine, _ = model(x[:own], local_adj, None, halo)
    assert torch.allclose(mine, whole[:own], atol=1e-5)


def test_what_cannot_be_split_is_refused():
    with pytest.raises(ValueError, match="linear aggregation"):
        SplitGNN("gat", 4, 8, 2)
    with pytest.raises(ValueError, match="at least 2 layers"):
        SplitGNN("gcn", 4, 8, 2, layers=1)
    model = SplitGNN("gcn", 4, 8, 2)
    with pytest.raises(ValueError, match="CSR adjacency"):
        model(torch.randn(3, 4), torch.tensor([[0, 1], [1, 2]]), None, [torch.zeros(0, 8)] * 2)
