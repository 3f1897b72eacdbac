"""LayeredGNN, the eager / local baselines' end-to-end model, checked against hand computations.

The model is the lazy stage stack trained end to end: an MLP encoder, ``layers - 1`` convs and a
head. Halo rows (the layer inputs a peer computed) are appended after the owned rows, so a
partitioned forward must reproduce the full-graph forward on the owned rows.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from retexo_fl.models.layered import LayeredGNN
from retexo_fl.models.stage import CONV_KINDS, StageModel

sys.path.insert(0, str(Path(__file__).parent))
from dense import N, Recorder
from dense import adjacency as _adjacency
from dense import edges as _edges
from dense import gcn_edges as _gcn_edges
from dense import layer_norm as _layer_norm

# A graph to partition: client A owns 0, 1, 2; 3 and 4 are its halo (one hop away) and 5 is two
# hops away, so with two conv layers A's logits depend on node 5 only through the halo rows.
PART_EDGES = [(0, 1), (1, 2), (2, 0), (2, 3), (3, 4), (1, 4), (4, 5)]
PART_N, OWNED, HALO = 6, 3, 2


def _conv_edges(kind: str, edge_index: torch.Tensor, n: int):
    return _gcn_edges(edge_index, n) if kind == "gcn" else (edge_index, None)


def _no_halo(model: LayeredGNN, hidden: int) -> list[torch.Tensor]:
    return [torch.zeros(0, hidden)] * model.num_convs


# ---- construction ----


@pytest.mark.parametrize("layers", [0, -2])
def test_rejects_fewer_than_one_layer(layers):
    with pytest.raises(ValueError, match=f"layers must be >= 1, got {layers}"):
        LayeredGNN("gcn", 4, 8, 3, layers=layers)


@pytest.mark.parametrize("layers", [1, 2, 4])
def test_layer_stack_widths(layers):
    model = LayeredGNN("sage", 7, 8, 3, layers=layers, dropout=0.25)
    assert model.num_convs == layers - 1 == len(model.convs)
    assert len(model.norms) == layers  # one norm after the encoder and after every conv
    assert (model.encoder.in_features, model.encoder.out_features) == (7, 8)
    assert (model.head.in_features, model.head.out_features) == (8, 3)
    for conv in model.convs:  # every conv maps hidden -> hidden
        assert (conv.in_channels, conv.out_channels) == (8, 8)
    assert all(isinstance(n, nn.LayerNorm) and n.normalized_shape == (8,) for n in model.norms)
    assert model.dropout.p == 0.25
    plain = LayeredGNN("sage", 7, 8, 3, layers=layers, norm="none")
    assert all(isinstance(n, nn.Identity) for n in plain.norms)


def test_unknown_kind_and_norm_are_refused():
    with pytest.raises(ValueError, match="unknown model 'gin'"):
        LayeredGNN("gin", 4, 8, 3, layers=2)
    with pytest.raises(ValueError, match="unknown norm 'batch'"):
        LayeredGNN("gcn", 4, 8, 3, layers=2, norm="batch")


def test_gat_convs_use_the_given_heads():
    model = LayeredGNN("gat", 4, 6, 3, layers=3, heads=3)
    assert [c.heads for c in model.convs] == [3, 3]
    assert all(c.concat is False for c in model.convs)  # heads averaged: convs stay hidden wide


# ---- forward, by hand ----


def test_one_layer_is_a_row_wise_mlp_without_edges():
    torch.manual_seed(0)
    model = LayeredGNN("gcn", 6, 8, 3, layers=1).eval()
    x = torch.randn(N, 6)
    logits, inputs = model(x, None, None, [])
    assert inputs == []  # no conv layer, nothing a peer needs
    h = torch.relu(_layer_norm(x @ model.encoder.weight.T + model.encoder.bias, model.norms[0]))
    torch.testing.assert_close(logits, h @ model.head.weight.T + model.head.bias)
    perm = torch.tensor([3, 0, 4, 1, 2])
    torch.testing.assert_close(model(x[perm], None, None, [])[0], logits[perm])


def test_gcn_forward_is_the_normalized_aggregation():
    """Encoder, then ``D^-1/2 (A + I) D^-1/2 H W + b`` twice, with ReLU and no norm, then the head."""
    torch.manual_seed(0)
    model = LayeredGNN("gcn", 4, 6, 3, layers=3, norm="none").eval()
    x = torch.randn(N, 4)
    ei = _edges()
    a_hat = _adjacency(ei, N) + torch.eye(N)
    d = a_hat.sum(1).rsqrt()
    a_hat = d[:, None] * a_hat * d[None, :]
    h0 = torch.relu(x @ model.encoder.weight.T + model.encoder.bias)
    c1, c2 = model.convs
    h1 = torch.relu(a_hat @ h0 @ c1.lin.weight.T + c1.bias)
    h2 = torch.relu(a_hat @ h1 @ c2.lin.weight.T + c2.bias)
    logits, inputs = model(x, *_gcn_edges(ei, N), _no_halo(model, 6))
    assert logits.shape == (N, 3) and len(inputs) == 2
    torch.testing.assert_close(inputs[0], h0)  # what conv 1 read
    torch.testing.assert_close(inputs[1], h1)  # what conv 2 read
    torch.testing.assert_close(logits, h2 @ model.head.weight.T + model.head.bias)


def test_gcn_without_weights_sums_neighbours_with_layer_norm():
    """No edge weights: a plain in-neighbour sum (no self loop); LayerNorm after every layer."""
    torch.manual_seed(1)
    model = LayeredGNN("gcn", 4, 6, 2, layers=2).eval()
    with torch.no_grad():  # non-trivial affine norms, so the norm is really applied
        for norm in model.norms:
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.5, 0.5)
    x = torch.randn(N, 4)
    ei = _edges()
    h0 = torch.relu(_layer_norm(x @ model.encoder.weight.T + model.encoder.bias, model.norms[0]))
    conv = model.convs[0]
    pre = _adjacency(ei, N) @ h0 @ conv.lin.weight.T + conv.bias
    h1 = torch.relu(_layer_norm(pre, model.norms[1]))
    logits, _ = model(x, ei, None, _no_halo(model, 6))
    torch.testing.assert_close(logits, h1 @ model.head.weight.T + model.head.bias)


@pytest.mark.parametrize("kind", CONV_KINDS)
def test_equals_its_stages_run_one_by_one(kind):
    """Layer ``l`` is lazy stage ``l``: the same weights in StageModels chained by hand agree."""
    torch.manual_seed(0)
    layers, hidden = 3, 6
    model = LayeredGNN(kind, 4, hidden, 3, layers=layers, heads=2).eval()
    x = torch.randn(N, 4)
    ei, w = _conv_edges(kind, _edges(), N)
    logits, inputs = model(x, ei, w, _no_halo(model, hidden))

    head = {f"head.{k}": v for k, v in model.head.state_dict().items()}
    stages = [StageModel("mlp", 4, hidden, 3)]
    stages[0].load_state_dict(
        {
            **{f"body.{k}": v for k, v in model.encoder.state_dict().items()},
            **{f"norm.{k}": v for k, v in model.norms[0].state_dict().items()},
            **head,
        }
    )
    for layer in range(1, layers):
        stage = StageModel(kind, hidden, hidden, 3, heads=2)
        stage.load_state_dict(
            {
                **{f"body.{k}": v for k, v in model.convs[layer - 1].state_dict().items()},
                **{f"norm.{k}": v for k, v in model.norms[layer].state_dict().items()},
                **head,
            }
        )
        stages.append(stage)

    h, z = stages[0].eval()(x)
    for layer in range(1, layers):
        torch.testing.assert_close(inputs[layer - 1], h, msg=f"{kind} input of layer {layer}")
        h, z = stages[layer].eval()(h, ei, w)
    torch.testing.assert_close(logits, z, msg=kind)


# ---- halo rows ----


@pytest.mark.parametrize("kind", CONV_KINDS)
def test_owned_rows_with_halo_equal_the_full_graph(kind):
    """Owned rows, plus the halo rows' layer inputs from a full-graph run, give the full logits."""
    torch.manual_seed(0)
    hidden = 5
    model = LayeredGNN(kind, 4, hidden, 3, layers=3, heads=2).eval()
    x = torch.randn(PART_N, 4)
    full_ei = _edges(PART_EDGES)
    full_logits, full_inputs = model(x, *_conv_edges(kind, full_ei, PART_N), _no_halo(model, hidden))

    # The client's local graph: its rows first, then its halo rows; only edges into its rows.
    local = full_ei[:, full_ei[1] < OWNED]
    assert int(local.max()) == OWNED + HALO - 1  # node 5 is not in it
    if kind == "gcn":  # global degrees, self loops on the owned rows only
        deg = torch.bincount(full_ei[1], minlength=PART_N).float() + 1.0
        local = torch.cat([local, torch.arange(OWNED).repeat(2, 1)], dim=1)
        w = deg[local[0]].rsqrt() * deg[local[1]].rsqrt()
    else:
        w = None
    halo = [inp[OWNED : OWNED + HALO] for inp in full_inputs]
    logits, inputs = model(x[:OWNED], local, w, halo)
    assert logits.shape == (OWNED, 3)
    assert [tuple(i.shape) for i in inputs] == [(OWNED, hidden)] * 2  # owned rows only
    torch.testing.assert_close(logits, full_logits[:OWNED], msg=kind)
    for got, want in zip(inputs, full_inputs, strict=True):
        torch.testing.assert_close(got, want[:OWNED], msg=kind)

    # The halo is really read: zero halo rows give other logits.
    zero_halo = [torch.zeros_like(h) for h in halo]
    assert not torch.allclose(model(x[:OWNED], local, w, zero_halo)[0], logits)


def test_halo_row_reaches_only_its_neighbours_at_the_last_layer():
    """``halo[l]`` feeds conv ``l``: at the last conv a halo row moves only its direct neighbours."""
    torch.manual_seed(0)
    model = LayeredGNN("sage", 4, 5, 3, layers=3).eval()
    x = torch.randn(OWNED, 4)
    full_ei = _edges(PART_EDGES)
    local = full_ei[:, full_ei[1] < OWNED]  # node 4 (local row 4) -> owned node 1 only
    halo = [torch.randn(HALO, 5), torch.randn(HALO, 5)]
    base, base_inputs = model(x, local, None, halo)
    moved = [halo[0], halo[1].clone()]
    moved[1][1] += 3.0  # halo row of node 4, last conv's input
    logits, inputs = model(x, local, None, moved)
    for a, b in zip(inputs, base_inputs, strict=True):  # earlier layers are untouched
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(logits[[0, 2]], base[[0, 2]])
    assert not torch.allclose(logits[1], base[1])


def test_halo_is_cast_to_the_model_dtype_and_gets_no_gradient():
    torch.manual_seed(0)
    model = LayeredGNN("sage", 4, 5, 3, layers=2).eval()
    x = torch.randn(OWNED, 4)
    full_ei = _edges(PART_EDGES)
    local = full_ei[:, full_ei[1] < OWNED]
    halo = torch.randn(HALO, 5, dtype=torch.float64)
    logits, _ = model(x, local, None, [halo])
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, model(x, local, None, [halo.float()])[0])
    logits.sum().backward()  # gradients flow to the model, never into a peer's rows
    assert halo.grad is None
    assert all(p.grad is not None for p in model.parameters())


# ---- dropout ----


def test_dropout_only_in_training():
    torch.manual_seed(0)
    model = LayeredGNN("gcn", 6, 16, 3, layers=3, dropout=0.5)
    x = torch.randn(N, 6)
    ei, w = _gcn_edges(_edges(), N)
    halo = _no_halo(model, 16)
    model.train()
    assert not torch.allclose(model(x, ei, w, halo)[0], model(x, ei, w, halo)[0])
    torch.manual_seed(7)
    a = model(x, ei, w, halo)[0]
    torch.manual_seed(7)  # masks come from torch's global generator: a seed repeats them
    torch.testing.assert_close(model(x, ei, w, halo)[0], a)
    model.eval()
    plain = LayeredGNN("gcn", 6, 16, 3, layers=3, dropout=0.0)
    plain.load_state_dict(model.state_dict())
    torch.testing.assert_close(model(x, ei, w, halo)[0], plain.train()(x, ei, w, halo)[0])


def test_dropout_one_leaves_only_the_head_bias_in_training():
    """Dropout hits the head input too: with ``p = 1`` every training logit row is the head bias."""
    torch.manual_seed(0)
    model = LayeredGNN("sage", 6, 8, 3, layers=2, dropout=1.0).train()
    x = torch.randn(N, 6)
    logits, _ = model(x, _edges(), None, _no_halo(model, 8))
    torch.testing.assert_close(logits, model.head.bias.expand(N, 3))
    model.eval()
    assert not torch.allclose(model(x, _edges(), None, _no_halo(model, 8))[0], logits)


def test_dropout_before_every_layer_and_the_head_halo_rows_included():
    """Dropout sees the raw features, each conv's whole input (owned then halo rows), the head input."""
    torch.manual_seed(0)
    model = LayeredGNN("sage", 4, 5, 3, layers=3).eval()
    x = torch.randn(OWNED, 4)
    full_ei = _edges(PART_EDGES)
    local = full_ei[:, full_ei[1] < OWNED]
    halo = [torch.randn(HALO, 5), torch.randn(HALO, 5)]
    want_logits, inputs = model(x, local, None, halo)
    model.dropout = Recorder()
    logits, _ = model(x, local, None, halo)
    torch.testing.assert_close(logits, want_logits)
    seen = model.dropout.seen
    assert [tuple(t.shape) for t in seen] == [(OWNED, 4), (OWNED + HALO, 5), (OWNED + HALO, 5), (OWNED, 5)]
    torch.testing.assert_close(seen[0], x)
    for layer in range(2):
        torch.testing.assert_close(seen[1 + layer], torch.cat([inputs[layer], halo[layer]]))
    last = torch.relu(model.norms[2](model.convs[1](seen[2], local)[:OWNED]))
    torch.testing.assert_close(seen[3], last)  # the last hidden rows, owned only
    torch.testing.assert_close(seen[3] @ model.head.weight.T + model.head.bias, logits)
