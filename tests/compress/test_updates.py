"""Compressed model updates: error feedback keeps the running sum of what was sent on track."""

from __future__ import annotations

import pytest
import torch

from retexo_fl.compress.payload import PayloadError
from retexo_fl.compress.updates import UpdateCodec


def _state(gen, scale=1.0):
    return {"w": torch.randn(6, 5, generator=gen) * scale, "b": torch.randn(6, generator=gen) * scale}


@pytest.mark.parametrize("bits", [2, 8])
def test_error_feedback_tracks_the_true_sum(bits):
    gen = torch.Generator().manual_seed(0)
    codec = UpdateCodec(bits)
    base = _state(gen)
    residual, sent, true = None, {k: torch.zeros_like(v) for k, v in base.items()}, dict.fromkeys(base, 0)
    for _ in range(50):
        new = {k: v + d for (k, v), d in zip(base.items(), _state(gen, 0.1).values(), strict=True)}
        frames, residual = codec.encode(new, base, residual, gen)
        decoded = codec.decode(frames, base, "client 0")
        for k in base:
            sent[k] += decoded[k] - base[k]
            true[k] = true[k] + (new[k] - base[k])
    # sum(sent) = sum(true) - residual, and the residual stays within one quantization step.
    for k in base:
        assert torch.allclose(sent[k] + residual[k], true[k], atol=1e-5)
        assert residual[k].abs().max() < 0.5 if bits == 2 else residual[k].abs().max() < 0.01


def test_sizes_shrink_and_bad_frames_fail():
    gen = torch.Generator().manual_seed(1)
    base, new = _state(gen), _state(gen)
    frames, _ = UpdateCodec(8).encode(new, base, None, gen)
    assert UpdateCodec.nbytes(frames) < 0.6 * sum(v.numel() * 4 for v in new.values()) + 60
    with pytest.raises(ValueError, match="client 2: missing tensors"):
        UpdateCodec(8).decode({"w": frames["w"]}, base, "client 2")
    with pytest.raises(PayloadError, match=r"client 2 \(w\)"):
        UpdateCodec(8).decode({**frames, "w": frames["b"]}, base, "client 2")


def test_broadcast_view_tracks_the_state():
    from retexo_fl.compress.updates import ModelBroadcast
    from retexo_fl.coordinator.aggregate import apply_updates, weighted_average

    gen = torch.Generator().manual_seed(2)
    state = {"w": torch.randn(64, 32, generator=gen), "b": torch.randn(64, generator=gen)}
    full = ModelBroadcast(32)
    assert full.prepare(state, 5) is state and full.nbytes() == sum(v.numel() * 4 for v in state.values())
    cast = ModelBroadcast(8, seed=1)
    assert cast.prepare(state, 1) is state and cast.frames is None  # the first round goes whole
    for r in range(2, 30):
        state = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in state.items()}
        view = cast.prepare(state, r)
        assert cast.frames is not None and cast.nbytes() < 0.3 * sum(v.numel() * 4 for v in state.values())
        for k in state:  # what is left out is carried to the next round, so it never piles up
            assert (view[k] - state[k]).abs().max() < 0.01
    clients = [{k: torch.randn(v.shape, generator=gen) for k, v in state.items()} for _ in range(2)]
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            apply_updates(state, state, clients, [1, 3]).values(),
            weighted_average(clients, [1, 3]).values(),
            strict=True,
        )
    )
    moved = apply_updates(state, view, clients, [1, 1])
    for k in state:
        assert torch.allclose(moved[k], state[k] + (clients[0][k] + clients[1][k]) / 2 - view[k], atol=1e-5)
