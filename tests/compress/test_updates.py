"""Compressed model updates: error feedback keeps the running sum of what was sent on track."""

from __future__ import annotations

import pytest
import torch

from retexo_fl.compress.payload import PayloadError, decode_rows
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


@pytest.mark.parametrize("bits", [1, 2, 4, 8, 16, 32])
def test_the_residual_kept_is_what_the_frames_sent_left_out_bit_for_bit(bits):
    # The residual is taken from the codes as quantized; the server reads the frames: the two
    # must agree to the bit, or error feedback adds what was already sent (odd sizes: codes
    # that end inside a byte).
    gen = torch.Generator().manual_seed(bits)
    base = {"w": torch.randn(7, 5, generator=gen), "b": torch.randn(3, generator=gen), "s": torch.randn(1, 1)}
    new = {k: v + 0.1 * torch.randn(v.shape, generator=gen) for k, v in base.items()}
    carried = {k: 0.01 * torch.randn(v.shape, generator=gen) for k, v in base.items()}
    frames, residual = UpdateCodec(bits).encode(new, base, carried, gen)
    for k in base:
        delta = new[k] - base[k] + carried[k]
        assert torch.equal(residual[k], delta - decode_rows(frames[k], "client 0").view_as(delta))


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


def _clients(n, gen, bias_len=7):
    """``n`` clients' trained states from one base (a matrix and an odd-length vector, whose
    1-bit codes end inside a byte), and residuals for all but every third."""
    base = {"w": torch.randn(9, 40, generator=gen), "b": torch.randn(bias_len, generator=gen)}
    news = [{k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in base.items()} for _ in range(n)]
    residuals = [
        None if i % 3 == 0 else {k: 0.01 * torch.randn(v.shape, generator=gen) for k, v in base.items()}
        for i in range(n)
    ]
    return base, news, residuals


@pytest.mark.parametrize("bits", [1, 2, 4, 8, 16, 32])
def test_many_clients_encode_and_decode_in_one_pass_as_each_alone(bits):
    gen = torch.Generator().manual_seed(3)
    base, news, residuals = _clients(12, gen)
    codec = UpdateCodec(bits)
    names = [f"client {i}" for i in range(12)]

    def sources():
        return [torch.Generator().manual_seed(50 + i) for i in range(12)]

    alone = [codec.encode(news[i], base, residuals[i], g, names[i]) for i, g in enumerate(sources())]
    together = codec.encode_many(news, base, residuals, sources(), names)
    for (frames, kept), (frames2, kept2) in zip(alone, together, strict=True):
        assert frames == frames2  # byte for byte, so the dither came from each client's own draws
        assert kept.keys() == kept2.keys()
        assert all(torch.equal(kept[k], kept2[k]) for k in kept)
    decoded = codec.decode_many([f for f, _ in alone], base, names)
    for (frames, _), state in zip(alone, decoded, strict=True):
        one = codec.decode(frames, base, "x")
        assert all(torch.equal(one[k], state[k]) for k in base)


def test_one_pass_codecs_name_the_client_they_refuse():
    gen = torch.Generator().manual_seed(4)
    base, news, residuals = _clients(10, gen)
    codec = UpdateCodec(8)
    names = [f"client {i}" for i in range(10)]
    bad = [dict(s) for s in news]
    bad[6]["w"] = bad[6]["w"].clone()
    bad[6]["w"][2, 3] = float("nan")
    with pytest.raises(ValueError, match="client 6, w: 1 row"):
        codec.encode_many(bad, base, residuals, [None] * 10, names)
    frames = [f for f, _ in codec.encode_many(news, base, residuals, [None] * 10, names)]
    # A frame of another shape, and one whose ranges are not ordered: each named by its sender.
    wrong = [dict(f) for f in frames]
    wrong[4]["w"] = frames[4]["b"]
    with pytest.raises(PayloadError, match=r"client 4 \(w\)"):
        codec.decode_many(wrong, base, names)
    swapped = [dict(f) for f in frames]
    head = 15  # the header; then 9 lo and 9 hi fp16 values
    raw = bytearray(frames[7]["w"])
    raw[head : head + 18], raw[head + 18 : head + 36] = raw[head + 18 : head + 36], raw[head : head + 18]
    swapped[7]["w"] = bytes(raw)
    with pytest.raises(PayloadError, match=r"client 7 \(w\): row ranges"):
        codec.decode_many(swapped, base, names)
    with pytest.raises(ValueError, match="client 2: missing tensors"):
        codec.decode_many([f if i != 2 else {"w": f["w"]} for i, f in enumerate(frames)], base, names)


def test_a_client_that_missed_rounds_catches_up_with_the_deltas_to_the_same_bits():
    """The deltas a client missed, decoded in turn from the view it holds, give the view every
    other client holds; the broadcast keeps only as many as cost less than the state whole."""
    from retexo_fl.compress.updates import ModelBroadcast
    from retexo_fl.records import same_bits

    gen = torch.Generator().manual_seed(3)
    state = {"w": torch.randn(64, 32, generator=gen), "b": torch.randn(64, generator=gen)}
    cast, codec = ModelBroadcast(4, seed=1), UpdateCodec(4)
    views = {1: cast.prepare(state, 1)}
    assert cast.chain(1) is None and cast.past == []  # round 1 goes whole: nothing to chain
    for r in range(2, 40):
        state = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in state.items()}
        views[r] = cast.prepare(state, r)
        kept = sum(UpdateCodec.nbytes(f) for _, f in cast.past)
        assert kept < cast.whole_nbytes()
        assert [q for q, _ in cast.past] == list(range(r - len(cast.past) + 1, r + 1))  # the last ones
    assert len(cast.past) < 38, "old deltas are dropped once they would cost more than the state"
    oldest = cast.past[0][0] - 1
    for held in (38, oldest + 1, oldest):
        steps = cast.chain(held)
        assert steps is not None and len(steps) == 39 - held and steps[-1] is cast.frames
        view = views[held]
        for frames in steps:
            view = codec.decode(frames, view, "catch-up")
        assert same_bits(view, views[39]), held
    assert cast.chain(oldest - 1) is None  # the deltas it needs are gone: it is sent the state whole
    assert cast.chain(39) is None  # holds the current view: nothing to catch up
    whole = ModelBroadcast(32)
    whole.prepare(state, 1)
    whole.prepare(state, 2)
    assert whole.chain(1) is None and whole.past == []
