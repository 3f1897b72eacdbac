"""GNN, the centralized end-to-end reference: conv layers only, the last producing the logits."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from retexo_fl.models.gnn import GNN
from retexo_fl.models.stage import CONV_KINDS

sys.path.insert(0, str(Path(__file__).parent))
from dense import N, Recorder
from dense import adjacency as _adjacency
from dense import edges as _edges
from dense import gcn_edges as _gcn_edges
from dense import layer_norm as _layer_norm


def _a_hat(edge_index: torch.Tensor, n: int) -> torch.Tensor:
    a = _adjacency(edge_index, n) + torch.eye(n)
    d = a.sum(1).rsqrt()
    return d[:, None] * a * d[None, :]


# ---- construction ----


@pytest.mark.parametrize("kind", CONV_KINDS)
@pytest.mark.parametrize("layers", [1, 2, 4])
def test_layer_widths(kind, layers):
    """Widths ``in -> hidden -> ... -> hidden -> classes``; a norm after each hidden layer only."""
    model = GNN(kind, 7, 8, 3, layers=layers, heads=2)
    want = [7] + [8] * (layers - 1) + [3]
    assert [(c.in_channels, c.out_channels) for c in model.convs] == list(itertools.pairwise(want))
    assert len(model.norms) == layers - 1
    assert all(isinstance(n, nn.Identity) for n in model.norms)  # norm "none" by default
    out = model.eval()(torch.randn(N, 7), _edges())
    assert out.shape == (N, 3)


def test_layer_norm_option_and_dropout_rate():
    model = GNN("gcn", 7, 8, 3, layers=3, norm="layer", dropout=0.3)
    assert all(isinstance(n, nn.LayerNorm) and n.normalized_shape == (8,) for n in model.norms)
    assert len(model.norms) == 2
    assert model.dropout.p == 0.3


def test_gat_heads_are_averaged():
    model = GNN("gat", 4, 6, 3, layers=2, heads=3)
    assert all(c.heads == 3 and c.concat is False for c in model.convs)


def test_unknown_kind_and_norm_are_refused():
    with pytest.raises(ValueError, match="unknown model 'gin'"):
        GNN("gin", 4, 8, 3)
    with pytest.raises(ValueError, match="unknown norm 'batch'"):
        GNN("gcn", 4, 8, 3, norm="batch")


# ---- forward, by hand ----


def test_two_layer_gcn_is_the_kipf_welling_model():
    """``Â ReLU(Â X W1 + b1) W2 + b2`` with ``Â = D^-1/2 (A + I) D^-1/2``: no ReLU on the logits."""
    torch.manual_seed(0)
    model = GNN("gcn", 4, 6, 3, layers=2).eval()
    x = torch.randn(N, 4)
    ei = _edges()
    a_hat = _a_hat(ei, N)
    c1, c2 = model.convs
    h = torch.relu(a_hat @ x @ c1.lin.weight.T + c1.bias)
    want = a_hat @ h @ c2.lin.weight.T + c2.bias
    out = model(x, *_gcn_edges(ei, N))
    torch.testing.assert_close(out, want)
    assert (out < 0).any()  # the logits are not passed through ReLU


def test_gcn_without_edge_weights_sums_in_neighbours():
    """No weights: no self loops, no normalization (the caller passes both); node 4 gets biases only."""
    torch.manual_seed(0)
    model = GNN("gcn", 4, 6, 3, layers=2).eval()
    x = torch.randn(N, 4)
    ei = _edges()
    a = _adjacency(ei, N)
    c1, c2 = model.convs
    want = a @ torch.relu(a @ x @ c1.lin.weight.T + c1.bias) @ c2.lin.weight.T + c2.bias
    out = model(x, ei)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(out[4], c2.bias)


def test_three_layer_gcn_with_layer_norm():
    torch.manual_seed(2)
    model = GNN("gcn", 4, 6, 2, layers=3, norm="layer").eval()
    with torch.no_grad():
        for norm in model.norms:
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.5, 0.5)
    x = torch.randn(N, 4)
    ei = _edges()
    a_hat = _a_hat(ei, N)
    h = x
    for conv, norm in zip(model.convs[:-1], model.norms, strict=True):
        h = torch.relu(_layer_norm(a_hat @ h @ conv.lin.weight.T + conv.bias, norm))
    last = model.convs[-1]
    torch.testing.assert_close(model(x, *_gcn_edges(ei, N)), a_hat @ h @ last.lin.weight.T + last.bias)


def test_two_layer_sage_by_hand():
    torch.manual_seed(0)
    model = GNN("sage", 4, 6, 3, layers=2).eval()
    x = torch.randn(N, 4)
    ei = _edges()
    a = _adjacency(ei, N)
    mean = a / a.sum(1, keepdim=True).clamp(min=1)  # isolated node: mean of nothing is 0

    def sage(conv, h):
        return mean @ h @ conv.lin_l.weight.T + conv.lin_l.bias + h @ conv.lin_r.weight.T

    want = sage(model.convs[1], torch.relu(sage(model.convs[0], x)))
    torch.testing.assert_close(model(x, ei), want)


@pytest.mark.parametrize("kind", CONV_KINDS)
def test_permuting_nodes_permutes_the_output(kind):
    torch.manual_seed(0)
    model = GNN(kind, 4, 6, 3, layers=3, heads=2, norm="layer").eval()
    x = torch.randn(N, 4)
    ei = _edges()
    w = None
    if kind == "gcn":
        ei, w = _gcn_edges(ei, N)
    out = model(x, ei, w)
    perm = torch.tensor([3, 0, 4, 1, 2])  # new node i is old node perm[i]
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(N)
    torch.testing.assert_close(model(x[perm], inv[ei], w), out[perm], msg=kind)


def test_isolated_node_depends_only_on_itself():
    """Messages travel along edges only: changing the triangle's features leaves node 4 alone."""
    torch.manual_seed(0)
    for kind in CONV_KINDS:
        model = GNN(kind, 4, 6, 3, layers=2, heads=2).eval()
        x = torch.randn(N, 4)
        ei = _edges()
        w = None
        if kind == "gcn":
            ei, w = _gcn_edges(ei, N)
        out = model(x, ei, w)
        x2 = x.clone()
        x2[:4] += 5.0
        out2 = model(x2, ei, w)
        torch.testing.assert_close(out2[4], out[4], msg=kind)
        assert not torch.allclose(out2[:4], out[:4]), kind


# ---- dropout ----


def test_dropout_only_in_training():
    torch.manual_seed(0)
    model = GNN("gcn", 6, 16, 3, layers=2, dropout=0.5)
    x = torch.randn(N, 6)
    ei, w = _gcn_edges(_edges(), N)
    model.train()
    assert not torch.allclose(model(x, ei, w), model(x, ei, w))
    torch.manual_seed(3)
    a = model(x, ei, w)
    torch.manual_seed(3)  # masks come from torch's global generator: a seed repeats them
    torch.testing.assert_close(model(x, ei, w), a)
    model.eval()
    plain = GNN("gcn", 6, 16, 3, layers=2, dropout=0.0)
    plain.load_state_dict(model.state_dict())
    torch.testing.assert_close(model(x, ei, w), plain.train()(x, ei, w))


@pytest.mark.parametrize("kind", CONV_KINDS)
def test_dropout_one_zeroes_the_last_layer_input(kind):
    """Dropout comes before every layer, the last included: with ``p = 1`` each row is a bias."""
    torch.manual_seed(0)
    model = GNN(kind, 6, 8, 3, layers=2, dropout=1.0, heads=2).train()
    ei = _edges()
    out = model(torch.randn(N, 6), ei)
    last = model.convs[-1]
    bias = last.lin_l.bias if kind.startswith("sage") else last.bias
    want = bias.expand(N, 3).clone()
    if kind == "sage-max":  # neighbours are projected first: zeros become ReLU(projection bias)
        want[:4] += torch.relu(last.lin.bias) @ last.lin_l.weight.T
    torch.testing.assert_close(out, want)


def test_dropout_before_every_conv():
    torch.manual_seed(0)
    model = GNN("sage", 4, 6, 3, layers=3).eval()
    x = torch.randn(N, 4)
    want = model(x, _edges())
    model.dropout = Recorder()
    torch.testing.assert_close(model(x, _edges()), want)
    seen = model.dropout.seen
    assert [tuple(t.shape) for t in seen] == [(N, 4), (N, 6), (N, 6)]
    torch.testing.assert_close(seen[0], x)
    # Each later one is the previous layer's ReLU output (norm "none"): what the next conv reads.
    for conv, before, after in zip(model.convs, seen, seen[1:], strict=False):
        torch.testing.assert_close(after, torch.relu(conv(before, _edges())))
