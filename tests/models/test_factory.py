"""Model factories: per-stage widths and settings from the config, and seeded initial weights."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch_geometric.nn import GATConv, GCNConv, SAGEConv

from retexo_fl.config import TrainConfig
from retexo_fl.models.factory import build_layered_model, build_stage_model, stage_input_dim
from retexo_fl.models.layered import LayeredGNN
from retexo_fl.models.stage import StageModel

FEATURES, CLASSES = 11, 4

sys.path.insert(0, str(Path(__file__).parent))
from dense import N  # noqa: E402
from dense import edges as _edges  # noqa: E402


def _cfg(**values) -> TrainConfig:
    # Stage 0 as the MLP: a lazy run's default (auto) names its layer-0 variant per message.
    base = {"model": "gcn", "stages": 3, "hidden": 16, "first-stage": "mlp"}
    return TrainConfig.from_mapping({**base, **values})


def _same(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ---- stage_input_dim ----


def test_stage_input_dim_hidden_embedding():
    cfg = _cfg(**{"pass-embedding": "hidden"})
    assert stage_input_dim(cfg, 0, FEATURES, CLASSES) == FEATURES  # stage 0 reads raw features
    assert [stage_input_dim(cfg, s, FEATURES, CLASSES) for s in (1, 2)] == [16, 16]


def test_stage_input_dim_logits_embedding():
    cfg = _cfg(**{"pass-embedding": "logits"})
    assert stage_input_dim(cfg, 0, FEATURES, CLASSES) == FEATURES
    assert [stage_input_dim(cfg, s, FEATURES, CLASSES) for s in (1, 2)] == [CLASSES, CLASSES]


def test_stage_input_dim_restarts_with_every_self_training_pass():
    cfg = _cfg(**{"self-training": 2})
    assert cfg.total_stages == 9
    dims = [stage_input_dim(cfg, s, FEATURES, CLASSES) for s in range(cfg.total_stages)]
    assert dims == [FEATURES, 16, 16] * 3


# ---- build_stage_model ----


@pytest.mark.parametrize(
    ("kind", "conv"), [("gcn", GCNConv), ("sage", SAGEConv), ("sage-max", SAGEConv), ("gat", GATConv)]
)
def test_stage_zero_is_an_mlp_later_stages_the_configured_conv(kind, conv):
    cfg = _cfg(model=kind, heads=2)
    first = build_stage_model(cfg, 0, FEATURES, CLASSES)
    assert isinstance(first, StageModel) and first.kind == "mlp"
    assert isinstance(first.body, nn.Linear)
    assert (first.body.in_features, first.body.out_features) == (FEATURES, 16)
    for stage in (1, 2):
        model = build_stage_model(cfg, stage, 16, CLASSES)
        assert model.kind == kind and isinstance(model.body, conv)
        assert (model.body.in_channels, model.body.out_channels) == (16, 16)
        assert (model.head.in_features, model.head.out_features) == (16, CLASSES)
    if kind == "gat":
        assert build_stage_model(cfg, 1, 16, CLASSES).body.heads == 2


def test_stage_settings_come_from_the_config_per_stage():
    cfg = _cfg(dropout="0.1,0.2", **{"input-dropout": "0,0.25,0.4"}, norm="none")
    got = [build_stage_model(cfg, s, 16, CLASSES) for s in range(3)]
    assert [m.dropout.p for m in got] == [0.1, 0.2, 0.2]  # the last list entry repeats
    assert [m.input_dropout.p for m in got] == [0.0, 0.25, 0.4]
    assert all(isinstance(m.norm, nn.Identity) for m in got)
    layer_norm = build_stage_model(_cfg(norm="layer"), 1, 16, CLASSES)
    assert isinstance(layer_norm.norm, nn.LayerNorm) and layer_norm.norm.normalized_shape == (16,)


def test_self_training_pass_uses_the_layer_settings_with_fresh_weights():
    """Stage ``stages + l`` trains layer ``l`` again: its kind and settings, not its weights."""
    cfg = _cfg(dropout="0.1,0.2,0.3", **{"self-training": 1})
    for layer in range(3):
        in_dim = stage_input_dim(cfg, layer, FEATURES, CLASSES)
        assert stage_input_dim(cfg, layer + 3, FEATURES, CLASSES) == in_dim
        first = build_stage_model(cfg, layer, in_dim, CLASSES)
        again = build_stage_model(cfg, layer + 3, in_dim, CLASSES)
        assert again.kind == first.kind and again.dropout.p == first.dropout.p
        assert [v.shape for v in again.state_dict().values()] == [
            v.shape for v in first.state_dict().values()
        ]
        assert not _same(again, first)


def test_stage_weights_are_a_pure_function_of_seed_and_stage():
    cfg = _cfg(seed=5)
    a = build_stage_model(cfg, 1, 16, CLASSES)
    torch.manual_seed(123)  # whatever the global generator held before
    torch.rand(1000)
    b = build_stage_model(cfg, 1, 16, CLASSES)
    assert _same(a, b)
    assert not _same(a, build_stage_model(_cfg(seed=6), 1, 16, CLASSES))
    assert not _same(a, build_stage_model(cfg, 2, 16, CLASSES))


def test_build_stage_model_seeds_the_global_generator():
    """Every engine draws what follows (dropout masks, ...) from the same stream."""
    cfg = _cfg(seed=5)
    build_stage_model(cfg, 1, 16, CLASSES)
    after_a = torch.rand(4)
    torch.rand(1000)
    build_stage_model(cfg, 1, 16, CLASSES)
    torch.testing.assert_close(torch.rand(4), after_a)


def test_unknown_conv_is_refused_only_where_a_conv_is_built():
    # A validated config refuses the kind by name; one built without validation meets the
    # factory's own check, where a conv is built.
    with pytest.raises(ValueError, match="model must be one of"):
        _cfg(model="gin")
    cfg = dataclasses.replace(_cfg(), model="gin")
    assert build_stage_model(cfg, 0, FEATURES, CLASSES).kind == "mlp"
    with pytest.raises(ValueError, match="unknown model 'gin'"):
        build_stage_model(cfg, 1, 16, CLASSES)
    with pytest.raises(ValueError, match="unknown norm 'batch'"):
        build_stage_model(dataclasses.replace(_cfg(), norm="batch"), 0, FEATURES, CLASSES)


@pytest.mark.parametrize("embedding", ["hidden", "logits"])
def test_factory_stages_chain(embedding):
    """Each stage reads what the previous one passes on, at the width stage_input_dim says."""
    cfg = _cfg(model="sage", **{"pass-embedding": embedding})
    x = torch.randn(N, FEATURES)
    for stage in range(cfg.stages):
        model = build_stage_model(cfg, stage, stage_input_dim(cfg, stage, FEATURES, CLASSES), CLASSES)
        h, z = model.eval()(x, _edges())
        assert h.shape == (N, 16) and z.shape == (N, CLASSES)
        x = h if embedding == "hidden" else z


# ---- build_layered_model ----


@pytest.mark.parametrize("kind", ["gcn", "sage", "sage-max", "gat"])
def test_layered_model_follows_the_config(kind):
    cfg = _cfg(
        model=kind, stages=4, hidden=8, heads=3, dropout="0.1,0.35,0.2", norm="none", eager_model="layered"
    )
    model = build_layered_model(cfg, FEATURES, CLASSES)
    assert isinstance(model, LayeredGNN) and model.kind == kind
    assert model.num_convs == cfg.stages - 1
    assert (model.encoder.in_features, model.encoder.out_features) == (FEATURES, 8)
    assert (model.head.in_features, model.head.out_features) == (8, CLASSES)
    assert all((c.in_channels, c.out_channels) == (8, 8) for c in model.convs)
    assert all(isinstance(n, nn.Identity) for n in model.norms)
    assert model.dropout.p == 0.35  # the conv layers' (stage 1's) dropout
    if kind == "gat":
        assert all(c.heads == 3 for c in model.convs)


def test_eager_model_auto_splits_the_reference_gnn_where_it_can():
    from retexo_fl.models.gnn import GNN
    from retexo_fl.models.split import SplitGNN

    split = build_layered_model(_cfg(model="gcn", stages=3, hidden=8), FEATURES, CLASSES)
    assert isinstance(split, SplitGNN) and split.num_convs == 2
    reference = GNN("gcn", FEATURES, 8, CLASSES, layers=2)
    assert {k: v.shape for k, v in split.state_dict().items()} == {
        k: v.shape for k, v in reference.state_dict().items()
    }
    assert isinstance(build_layered_model(_cfg(model="gat", stages=3), FEATURES, CLASSES), LayeredGNN)
    assert isinstance(build_layered_model(_cfg(model="gcn", stages=2), FEATURES, CLASSES), LayeredGNN)
    with pytest.raises(ValueError, match="eager-model standard splits 2 or more gcn or sage layers"):
        _cfg(model="gat", stages=3, eager_model="standard").validate()


def test_single_stage_layered_model_has_no_conv():
    # A config built without validation (a validated one refuses "gin" by name).
    model = build_layered_model(dataclasses.replace(_cfg(stages=1), model="gin"), FEATURES, CLASSES)
    assert model.num_convs == 0  # no conv is built
    logits, inputs = model.eval()(torch.randn(N, FEATURES), None, None, [])
    assert logits.shape == (N, CLASSES) and inputs == []
    with pytest.raises(ValueError, match="unknown model 'gin'"):
        build_layered_model(dataclasses.replace(_cfg(stages=2), model="gin"), FEATURES, CLASSES)


def test_layered_weights_are_the_same_everywhere_and_follow_the_seed():
    """The server and every client build the same initial weights from the run seed."""
    cfg = _cfg(seed=3, eager_model="layered")
    server = build_layered_model(cfg, FEATURES, CLASSES)
    torch.rand(1000)
    client = build_layered_model(cfg, FEATURES, CLASSES)
    assert _same(server, client)
    assert not _same(server, build_layered_model(_cfg(seed=4, eager_model="layered"), FEATURES, CLASSES))
    # Independent of the lazy stages' seeds: the eager encoder is not stage 0's body.
    stage0 = build_stage_model(cfg, 0, FEATURES, CLASSES)
    assert not torch.equal(server.encoder.weight, stage0.body.weight)


def test_building_a_stage_model_formats_no_stack_trace(monkeypatch):
    """Every client builds its stage's model (thousands at one node per client). Seeding with
    torch.manual_seed queues the seed for every accelerator not initialised, formatting a stack
    trace for each: 0.13 ms a call measured alone (1.4 us for the CPU generator), once per client
    and stage."""
    import traceback

    cfg = _cfg()
    first = build_stage_model(cfg, 1, FEATURES, CLASSES).state_dict()
    calls = []
    monkeypatch.setattr(traceback, "format_stack", lambda *a, **k: calls.append(1) or [])
    again = build_stage_model(cfg, 1, FEATURES, CLASSES).state_dict()
    assert calls == []
    assert all(torch.equal(first[k], again[k]) for k in first)  # still a function of the seed
