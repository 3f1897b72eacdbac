"""Stage models: ``make_conv`` / ``make_norm`` and one RETEXO stage, checked against hand computations."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch_geometric.nn import GATConv, GCNConv, SAGEConv

from retexo_fl.models.stage import CONV_KINDS, StageModel, make_conv, make_norm

sys.path.insert(0, str(Path(__file__).parent))
from dense import N
from dense import adjacency as _adjacency
from dense import edges as _edges
from dense import gcn_edges as _gcn_edges

# ---- make_conv / make_norm ----


def test_make_conv_builds_the_documented_layers():
    gcn = make_conv("gcn", 6, 3)
    assert isinstance(gcn, GCNConv)
    assert gcn.normalize is False and gcn.add_self_loops is False  # weights come precomputed
    sage = make_conv("sage", 6, 3)
    assert isinstance(sage, SAGEConv) and str(sage.aggr_module) == "MeanAggregation()"
    assert not sage.project
    sage_max = make_conv("sage-max", 6, 3)
    assert isinstance(sage_max, SAGEConv) and str(sage_max.aggr_module) == "MaxAggregation()"
    assert sage_max.project
    gat = make_conv("gat", 6, 3, heads=5)
    assert isinstance(gat, GATConv) and gat.heads == 5 and gat.concat is False
    x = torch.randn(N, 6)
    for kind in CONV_KINDS:  # heads are averaged, so every kind is out_dim wide
        assert make_conv(kind, 6, 3, heads=2)(x, _edges()).shape == (N, 3)


def test_make_conv_rejects_unknown_kinds():
    with pytest.raises(ValueError, match=r"unknown model 'gin'.*gcn, sage, sage-max, gat"):
        make_conv("gin", 4, 4)
    with pytest.raises(ValueError, match="unknown model 'mlp'"):  # mlp is a stage kind, not a conv
        make_conv("mlp", 4, 4)


def test_make_norm():
    layer = make_norm("layer", 7)
    assert isinstance(layer, nn.LayerNorm) and layer.normalized_shape == (7,)
    assert isinstance(make_norm("none", 7), nn.Identity)
    with pytest.raises(ValueError, match="unknown norm 'batch'"):
        make_norm("batch", 7)


def test_gcn_conv_adds_no_self_loops_and_does_not_normalize():
    """With no weights a GCN layer is a plain sum over in-neighbours: the caller owns normalization."""
    torch.manual_seed(0)
    conv = make_conv("gcn", 4, 3)
    x = torch.randn(N, 4)
    ei = _edges()
    want = _adjacency(ei, N) @ x @ conv.lin.weight.T + conv.bias
    torch.testing.assert_close(conv(x, ei), want)
    torch.testing.assert_close(conv(x, ei)[4], conv.bias)  # isolated: no self loop, bias only


# ---- StageModel ----


def test_mlp_stage_ignores_edges_and_rows_are_independent():
    torch.manual_seed(0)
    model = StageModel("mlp", 6, 8, 3, dropout=0.0).eval()
    x = torch.randn(N, 6)
    h, z = model(x)
    assert h.shape == (N, 8) and z.shape == (N, 3)
    h2, z2 = model(x, _edges(), torch.rand(_edges().shape[1]))
    torch.testing.assert_close(h2, h)
    torch.testing.assert_close(z2, z)
    perm = torch.tensor([3, 0, 4, 1, 2])  # LayerNorm is per row: a stage is row-wise at stage 0
    hp, zp = model(x[perm])
    torch.testing.assert_close(hp, h[perm])
    torch.testing.assert_close(zp, z[perm])
    want = torch.relu(model.norm(x @ model.body.weight.T + model.body.bias))
    torch.testing.assert_close(h, want)
    torch.testing.assert_close(z, want @ model.head.weight.T + model.head.bias)


def test_mlp_stage_num_targets_reads_only_the_first_rows():
    torch.manual_seed(0)
    model = StageModel("mlp", 6, 8, 3).eval()
    x = torch.randn(N, 6)
    h, z = model(x, num_targets=2)
    assert h.shape == (2, 8) and z.shape == (2, 3)
    full_h, full_z = model(x)
    torch.testing.assert_close(h, full_h[:2])
    torch.testing.assert_close(z, full_z[:2])
    x[2:] = float("nan")  # rows past the targets are never read
    h_nan, _ = model(x, num_targets=2)
    assert torch.isfinite(h_nan).all()


def test_gcn_stage_is_the_normalized_aggregation():
    """``D^-1/2 (A + I) D^-1/2 X W + b`` by hand, from the weights the lazy engine passes."""
    torch.manual_seed(0)
    model = StageModel("gcn", 4, 6, 3, dropout=0.0, norm="none").eval()
    x = torch.randn(N, 4)
    ei = _edges()
    a_hat = _adjacency(ei, N) + torch.eye(N)
    d = a_hat.sum(1).rsqrt()
    a_hat = d[:, None] * a_hat * d[None, :]
    assert a_hat[4, 4] == 1.0  # isolated node: its own row, weight 1 / (0 + 1)
    want = torch.relu(a_hat @ x @ model.body.lin.weight.T + model.body.bias)
    h, z = model(x, *_gcn_edges(ei, N))
    torch.testing.assert_close(h, want)
    torch.testing.assert_close(z, want @ model.head.weight.T + model.head.bias)


def test_conv_stage_targets_need_only_their_in_edges():
    """The lazy layout: targets first, then halo rows; edges into targets only, outputs sliced."""
    torch.manual_seed(0)
    x = torch.randn(N, 4)
    ei = _edges()
    for kind in CONV_KINDS:
        model = StageModel(kind, 4, 6, 3, heads=2).eval()
        full = _gcn_edges(ei, N) if kind == "gcn" else (ei, None)
        want_h, want_z = model(x, *full)
        into_targets = full[0][1] < 2
        w = None if full[1] is None else full[1][into_targets]
        h, z = model(x, full[0][:, into_targets], w, num_targets=2)
        assert h.shape == (2, 6) and z.shape == (2, 3), kind
        torch.testing.assert_close(h, want_h[:2], msg=kind)
        torch.testing.assert_close(z, want_z[:2], msg=kind)


@pytest.mark.parametrize("layout", ["edges", "csr"])
def test_selected_rows_equal_their_rows_of_the_whole_stage_dropout_included(layout):
    """``rows=``: messages along the rows' in-edges only, and the dropout masks of the whole
    computation (training mode, input and hidden dropout), so every row is its row of all targets
    computed and sliced. Equal to float rounding, not bit for bit: a dense layer over 5 rows and
    over 40 may take different GEMM kernels, and on some CPUs (CI's, not ours) their last bits
    differ. A mask drawn for the selected rows alone would differ by whole activations."""
    from retexo_fl.models.adjacency import sparse_adjacency

    gen = torch.Generator().manual_seed(0)
    n, halo = 40, 10
    ei = torch.randint(n + halo, (2, 300), generator=gen)
    ei[1] = ei[1] % n  # every edge ends at a target, as in a client's local graph
    x = torch.randn(n + halo, 4, generator=gen)
    rows = torch.tensor([3, 17, 0, 39, 22])
    kinds = ["gcn", "sage"] if layout == "csr" else list(CONV_KINDS)
    for kind in kinds:
        torch.manual_seed(1)
        model = StageModel(kind, 4, 6, 3, heads=2, dropout=0.5, input_dropout=0.3).train()
        w = torch.rand(ei.shape[1], generator=gen) if kind == "gcn" else None
        graph, weight = (sparse_adjacency(ei, w, n, n + halo), None) if layout == "csr" else (ei, w)
        torch.manual_seed(5)
        whole_h, whole_z = model(x, graph, weight, num_targets=n)
        torch.manual_seed(5)
        h, z = model(x, graph, weight, num_targets=n, rows=rows)
        torch.testing.assert_close(h, whole_h[rows], rtol=1e-5, atol=1e-6, msg=kind)
        torch.testing.assert_close(z, whole_z[rows], rtol=1e-5, atol=1e-6, msg=kind)
        # Dropout drew a mask: a differently seeded whole computation gives other logits.
        torch.manual_seed(6)
        assert not torch.equal(model(x, graph, weight, num_targets=n)[1][rows], z), kind
    with pytest.raises(ValueError, match="rows needs num_targets"):
        model(x, ei, None, rows=rows)


def test_adjacency_select_keeps_rows_and_their_entry_order():
    from retexo_fl.models.adjacency import adjacency_select, sparse_adjacency

    gen = torch.Generator().manual_seed(2)
    ei = torch.randint(30, (2, 200), generator=gen)
    ei[1] = ei[1] % 20
    adj = sparse_adjacency(ei, torch.rand(200, generator=gen), 20, 30)
    x = torch.randn(30, 5, generator=gen)
    rows = torch.tensor([19, 0, 7, 7, 12])
    picked = adjacency_select(adj, rows)
    assert picked.shape == (5, 30)
    assert torch.equal(torch.sparse.mm(picked, x), torch.sparse.mm(adj, x)[rows])
    assert adjacency_select(adj, torch.tensor([], dtype=torch.long)).shape == (0, 30)


def test_sage_stages_by_hand():
    torch.manual_seed(0)
    x = torch.randn(N, 4)
    ei = _edges()
    a = _adjacency(ei, N)
    mean = StageModel("sage", 4, 6, 3, norm="none").eval()
    neigh = (a @ x) / a.sum(1, keepdim=True).clamp(min=1)  # isolated node: mean of nothing is 0
    b = mean.body
    want = torch.relu(neigh @ b.lin_l.weight.T + b.lin_l.bias + x @ b.lin_r.weight.T)
    torch.testing.assert_close(mean(x, ei)[0], want)

    mx = StageModel("sage-max", 4, 6, 3, norm="none").eval()
    b = mx.body
    proj = torch.relu(x @ b.lin.weight.T + b.lin.bias)  # neighbours are projected, then max-pooled
    pooled = torch.stack([proj[a[i] > 0].max(0).values if a[i].any() else torch.zeros(4) for i in range(N)])
    want = torch.relu(pooled @ b.lin_l.weight.T + b.lin_l.bias + x @ b.lin_r.weight.T)
    torch.testing.assert_close(mx(x, ei)[0], want)


@pytest.mark.parametrize("heads", [1, 3])
def test_gat_stage_averages_heads(heads):
    torch.manual_seed(0)
    hidden = 5
    model = StageModel("gat", 4, hidden, 3, norm="none", heads=heads).eval()
    conv = model.body
    assert conv.att_src.shape == (1, heads, hidden)
    x = torch.randn(N, 4)
    ei = _edges()
    xs = (x @ conv.lin.weight.T).view(N, heads, hidden)
    a_src = (xs * conv.att_src).sum(-1)  # [N, heads]
    a_dst = (xs * conv.att_dst).sum(-1)
    adj = _adjacency(ei, N) + torch.eye(N)  # GAT adds self loops itself
    out = torch.zeros(N, heads, hidden)
    for i in range(N):
        js = adj[i].nonzero().view(-1)
        e = torch.nn.functional.leaky_relu(a_src[js] + a_dst[i], conv.negative_slope)  # [deg, heads]
        alpha = torch.softmax(e, dim=0)
        out[i] = (alpha[:, :, None] * xs[js]).sum(0)
    want = torch.relu(out.mean(1) + conv.bias)
    h, z = model(x, ei)
    assert h.shape == (N, hidden) and z.shape == (N, 3)
    torch.testing.assert_close(h, want)


def test_conv_stage_needs_edges():
    model = StageModel("sage", 4, 6, 3)
    with pytest.raises(ValueError, match="a sage stage needs edge_index"):
        model(torch.randn(N, 4))


def test_dropout_hits_the_head_input_not_the_returned_hidden():
    torch.manual_seed(0)
    model = StageModel("mlp", 6, 32, 3, dropout=0.5)
    x = torch.randn(N, 6)
    model.train()
    h1, z1 = model(x)
    h2, z2 = model(x)
    torch.testing.assert_close(h1, h2)  # hidden is returned before dropout
    assert not torch.allclose(z1, z2)
    model.eval()
    h3, z3 = model(x)
    torch.testing.assert_close(h3, h1)
    torch.testing.assert_close(model(x)[1], z3)
    torch.testing.assert_close(z3, h3 @ model.head.weight.T + model.head.bias)


def test_input_dropout_only_in_training():
    torch.manual_seed(0)
    model = StageModel("gcn", 6, 8, 3, dropout=0.0, input_dropout=0.5)
    x = torch.randn(N, 6)
    ei, w = _gcn_edges(_edges(), N)
    model.train()
    assert not torch.allclose(model(x, ei, w)[0], model(x, ei, w)[0])
    model.eval()
    torch.testing.assert_close(model(x, ei, w)[0], model(x, ei, w)[0])
    plain = StageModel("gcn", 6, 8, 3, dropout=0.0, input_dropout=0.0)
    plain.load_state_dict(model.state_dict())  # dropout holds no parameters
    torch.testing.assert_close(model(x, ei, w)[0], plain.train()(x, ei, w)[0])


def test_layer_norm_hidden_rows_are_normalized():
    torch.manual_seed(0)
    model = StageModel("sage", 4, 16, 3).eval()
    with torch.no_grad():
        model.norm.weight.fill_(1.0)
        model.norm.bias.fill_(0.0)
        h, _ = model(torch.randn(N, 4), _edges())
        pre = model.body(torch.randn(N, 4), _edges())
    assert (h >= 0).all()  # ReLU after the norm
    assert isinstance(model.norm, nn.LayerNorm) and pre.shape == (N, 16)
