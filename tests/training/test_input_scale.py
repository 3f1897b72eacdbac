"""A GNN stage's input scaled up to ``gnn-input-rms-floor``: one factor per client, read off its
own rows, for its own and halo rows alike, and what the stage trains on and embeds from."""

from __future__ import annotations

import torch

from retexo_fl.config import TrainConfig

FLOOR = 0.25


def _config(floor: float) -> TrainConfig:
    return TrainConfig.resolve(profile="exact", clients=3, stages=2, hidden=8, gnn_input_rms_floor=floor)


def _rms(x: torch.Tensor) -> float:
    return float(x.pow(2).mean().sqrt())


def test_small_inputs_reach_the_floor_by_one_factor_for_own_and_halo_rows(stage_one_client):
    client = stage_one_client(_config(FLOOR), 0.01)
    n = client.graph.num_owned
    assert client.graph.num_halo > 0  # the halo rows must take part, or this proves less
    x = client.stage_input()
    assert abs(_rms(x[:n]) - FLOOR) < 1e-6  # the own rows' RMS is the floor
    factor = FLOOR / _rms(client.owned)
    assert 20 < factor < 30  # rows of RMS ~0.01 scaled up ~25x
    assert torch.allclose(x[:n], client.owned * factor)
    assert torch.allclose(x[n:], client.halo * factor)  # the same factor, not the halo's own RMS
    assert client.input_scale() == factor


def test_inputs_at_the_floor_or_above_stage_0_and_a_zero_floor_are_left_as_they_are(stage_one_client):
    above = stage_one_client(_config(FLOOR), 1.0)
    assert torch.equal(above.stage_input(), torch.cat([above.owned, above.halo]))
    off = stage_one_client(_config(0.0), 0.01)
    assert torch.equal(off.stage_input(), torch.cat([off.owned, off.halo]))
    dead = stage_one_client(_config(FLOOR), 0.0)  # every row zero (dead ReLUs): no division by ~0
    assert dead.input_scale() == 1.0 and not dead.stage_input().any()
    first = stage_one_client(_config(FLOOR), 0.01)
    first.stage = 0  # stage 0 reads raw features, never scaled
    assert first.input_scale() == 1.0 and first.stage_input() is first.owned


def test_the_stage_trains_and_embeds_from_the_scaled_input(stage_one_client, stage_outputs):
    scaled = stage_one_client(_config(FLOOR), 0.01)
    by_hand = stage_one_client(_config(0.0), 0.01)
    factor = scaled.input_scale()
    by_hand.owned, by_hand.halo = by_hand.owned * factor, by_hand.halo * factor
    state = scaled.make_model().state_dict()
    (h1, l1, g1), (h2, l2, g2) = (stage_outputs(client, state) for client in (scaled, by_hand))
    assert torch.allclose(h1, h2, atol=1e-6) and torch.allclose(l1, l2, atol=1e-6)
    assert all(torch.allclose(g1[k], g2[k], atol=1e-5) for k in g1)
    # The factor follows a new stage input (the next stage's own rows), not the cached one.
    scaled.owned = scaled.owned * 4
    assert abs(scaled.input_scale() - factor / 4) < 1e-4 * factor
    assert abs(_rms(scaled.stage_input()[: scaled.graph.num_owned]) - FLOOR) < 1e-6


def test_the_factor_is_capped_whatever_the_rows_scale(stage_one_client):
    """A stage-0 state can make a client's own rows as small as it likes (an attack review made
    them 1.6e-11, a factor of 6e11 on every row and gradient): the factor stops at
    ``MAX_INPUT_SCALE``, so the server does not set it."""
    from retexo_fl.party.lazy_client import MAX_INPUT_SCALE

    tiny = stage_one_client(_config(FLOOR), 1e-6)
    assert FLOOR / _rms(tiny.owned) > 1000 * MAX_INPUT_SCALE  # what the floor alone would ask
    assert tiny.input_scale() == MAX_INPUT_SCALE == 100.0
    assert torch.allclose(tiny.stage_input()[: tiny.graph.num_owned], tiny.owned * MAX_INPUT_SCALE)
