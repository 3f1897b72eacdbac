"""The server refuses malformed model updates, naming the client, before they touch the model."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from retexo_fl import protocol as P
from retexo_fl.compress.updates import UpdateCodec
from retexo_fl.config import TrainConfig
from retexo_fl.metrics import RunRecorder
from retexo_fl.training.selection import StageTracker
from server.app import ClientFailure, StageMachine

STATE = {"lin.weight": torch.zeros(4, 3), "lin.bias": torch.zeros(4)}


@dataclass
class _Reply:
    """What ``_updates`` reads of a reply (a real ``Message`` needs a running Flower context)."""

    content: RecordDict


def _reply(records: dict) -> _Reply:
    return _Reply(RecordDict(records))


def _machine() -> StageMachine:
    m = StageMachine(None, TrainConfig(), RunRecorder(None, stream=None))
    m.nodes = {2: 7}
    return m


@pytest.mark.parametrize(
    ("state", "match"),
    [
        ({"lin.weight": torch.zeros(4, 3)}, r"client 2: missing tensors \['lin.bias'\]"),
        (
            {**STATE, "extra": torch.zeros(1)},
            r"client 2: missing tensors \[\], unexpected tensors \['extra'\]",
        ),
        (
            {**STATE, "lin.weight": torch.zeros(3, 4)},
            r"client 2: lin.weight has shape \[3, 4\], expected \[4, 3\]",
        ),
        (
            {**STATE, "lin.bias": torch.zeros(4, dtype=torch.int64)},
            "client 2: lin.bias has dtype torch.int64",
        ),
        (
            {**STATE, "lin.bias": torch.tensor([0.0, float("nan"), 0, 0])},
            "client 2: lin.bias holds NaN or Inf",
        ),
    ],
)
def test_bad_whole_state_updates(state, match):
    reply = _reply({P.ARRAYS: ArrayRecord(state)})
    with pytest.raises(ClientFailure, match=match):
        _machine()._updates([reply], STATE, None, StageTracker(0, 0), 0)


def test_bad_compressed_updates():
    codec = UpdateCodec(8, "fp16")
    good, _ = codec.encode({k: v + 1 for k, v in STATE.items()}, STATE, None)
    machine = _machine()
    states, _ = machine._updates(
        [_reply({P.UPDATE: ConfigRecord(good)})], STATE, codec, StageTracker(0, 0), 0
    )
    assert torch.allclose(states[0]["lin.bias"], torch.ones(4), atol=0.02)
    cut = {**good, "lin.bias": good["lin.bias"][:-3]}
    with pytest.raises(ClientFailure, match=r"client 2 \(lin.bias\).*bytes"):
        machine._updates([_reply({P.UPDATE: ConfigRecord(cut)})], STATE, codec, StageTracker(0, 0), 0)
    with pytest.raises(ClientFailure, match="client 2: the reply carries no model"):
        machine._updates([_reply({})], STATE, codec, StageTracker(0, 0), 0)
