"""A GNN stage's input scaled up to ``gnn-input-rms-floor``: one factor per client, read off its
own rows, for its own and halo rows alike, and what the stage trains on and embeds from."""

from __future__ import annotations

import torch

from retexo_fl.config import TrainConfig
from retexo_fl.data.partitioners import partition_graph
from retexo_fl.party.lazy_client import LazyClient

FLOOR = 0.25


def _stage_one_client(sbm, floor: float, row_scale: float) -> LazyClient:
    """Client 0 of 3 random partitions at stage 1, its owned and halo rows random, fixed, and
    ``row_scale`` times a standard normal's size."""
    cfg = TrainConfig.resolve(profile="exact", clients=3, stages=2, hidden=8, gnn_input_rms_floor=floor)
    client = LazyClient(partition_graph(sbm, 3, "random", seed=0)[0], cfg)
    client.stage = 1
    gen = torch.Generator().manual_seed(0)
    client.owned = torch.randn(client.graph.num_owned, 8, generator=gen) * row_scale
    client.halo = torch.randn(client.graph.num_halo, 8, generator=gen) * row_scale
    client.halo_degree = torch.randint(1, 9, (client.graph.num_halo,), generator=gen).float()
    return client


def _rms(x: torch.Tensor) -> float:
    return float(x.pow(2).mean().sqrt())


def test_small_inputs_reach_the_floor_by_one_factor_for_own_and_halo_rows(sbm):
    client = _stage_one_client(sbm, FLOOR, 0.01)
    n = client.graph.num_owned
    assert client.graph.num_halo > 0  # the halo rows must take part, or this proves less
    x = client.stage_input()
    assert abs(_rms(x[:n]) - FLOOR) < 1e-6  # the own rows' RMS is the floor
    factor = FLOOR / _rms(client.owned)
    assert 20 < factor < 30  # rows of RMS ~0.01 scaled up ~25x
    assert torch.allclose(x[:n], client.owned * factor)
    assert torch.allclose(x[n:], client.halo * factor)  # the same factor, not the halo's own RMS
    assert client.input_scale() == factor


def test_inputs_at_the_floor_or_above_stage_0_and_a_zero_floor_are_left_as_they_are(sbm):
    above = _stage_one_client(sbm, FLOOR, 1.0)
    assert torch.equal(above.stage_input(), torch.cat([above.owned, above.halo]))
    off = _stage_one_client(sbm, 0.0, 0.01)
    assert torch.equal(off.stage_input(), torch.cat([off.owned, off.halo]))
    dead = _stage_one_client(sbm, FLOOR, 0.0)  # every row zero (dead ReLUs): no division by ~0
    assert dead.input_scale() == 1.0 and not dead.stage_input().any()
    first = _stage_one_client(sbm, FLOOR, 0.01)
    first.stage = 0  # stage 0 reads raw features, never scaled
    assert first.input_scale() == 1.0 and first.stage_input() is first.owned


def test_the_stage_trains_and_embeds_from_the_scaled_input(sbm):
    scaled = _stage_one_client(sbm, FLOOR, 0.01)
    by_hand = _stage_one_client(sbm, 0.0, 0.01)
    factor = scaled.input_scale()
    by_hand.owned, by_hand.halo = by_hand.owned * factor, by_hand.halo * factor
    state = scaled.make_model().state_dict()
    outputs = []
    for client in (scaled, by_hand):
        model = client.loaded_model(state)
        model.eval()
        model.zero_grad()
        hidden, logits = client.outputs(model)
        logits.square().sum().backward()
        outputs.append((hidden, logits, {k: p.grad.clone() for k, p in model.named_parameters()}))
    (h1, l1, g1), (h2, l2, g2) = outputs
    assert torch.allclose(h1, h2, atol=1e-6) and torch.allclose(l1, l2, atol=1e-6)
    assert all(torch.allclose(g1[k], g2[k], atol=1e-5) for k in g1)
    # The factor follows a new stage input (the next stage's own rows), not the cached one.
    scaled.owned = scaled.owned * 4
    assert abs(scaled.input_scale() - factor / 4) < 1e-4 * factor
    assert abs(_rms(scaled.stage_input()[: scaled.graph.num_owned]) - FLOOR) < 1e-6
