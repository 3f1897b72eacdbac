"""The server's side of a federation: updates are checked before they touch the model, relaying
counts bytes and names bad routes, setup claims partitions through the transport."""

from __future__ import annotations

import pytest
import torch

from retexo_fl import protocol as P
from retexo_fl.compress.updates import UpdateCodec
from retexo_fl.config import TrainConfig
from retexo_fl.coordinator.federation import FederationView
from retexo_fl.coordinator.selection import StageTracker
from retexo_fl.coordinator.transport import ClientFailure
from retexo_fl.data.partitioners import partition_graph
from retexo_fl.metrics import RunRecorder
from retexo_fl.party.lazy_client import LazyClient
from retexo_fl.training.inprocess import InProcessTransport

STATE = {"lin.weight": torch.zeros(4, 3), "lin.bias": torch.zeros(4)}


def _federation(cfg: TrainConfig | None = None, clients=()) -> FederationView:
    return FederationView(
        InProcessTransport(list(clients)),
        cfg or TrainConfig.resolve(profile="exact"),
        RunRecorder(None, stream=None),
    )


def _one_client() -> FederationView:
    fed = _federation()
    fed.members.claim(2, 7)
    return fed


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
    with pytest.raises(ClientFailure, match=match):
        _one_client().updates([2], [{P.ARRAYS: state}], STATE, UpdateCodec(32), StageTracker(0, 0), 0)


def test_bad_compressed_updates():
    codec = UpdateCodec(8, "fp16")
    good, _ = codec.encode({k: v + 1 for k, v in STATE.items()}, STATE, None)
    fed = _one_client()
    tracker = StageTracker(0, 0)
    states, raw = fed.updates([2], [{P.UPDATE: good}], STATE, codec, tracker, 10)
    assert torch.allclose(states[0]["lin.bias"], torch.ones(4), atol=0.02)
    assert tracker.model_bytes == 10 + codec.nbytes(good) and raw == 2 * (12 + 4) * 4
    cut = {**good, "lin.bias": good["lin.bias"][:-3]}
    with pytest.raises(ClientFailure, match=r"client 2 \(lin.bias\).*bytes"):
        fed.updates([2], [{P.UPDATE: cut}], STATE, codec, StageTracker(0, 0), 0)
    with pytest.raises(ClientFailure, match="client 2: the reply carries no model"):
        fed.updates([2], [{}], STATE, codec, StageTracker(0, 0), 0)


@pytest.mark.parametrize(
    ("metrics", "match"),
    [
        (None, r"client 2: its train reply carries no metrics"),
        (
            {P.NUM_EXAMPLES: 3, P.TRAIN_LOSS: 0.5},
            r"client 2: its train reply's val-correct is 'None', not a number",
        ),
        (
            {P.NUM_EXAMPLES: "3", P.TRAIN_LOSS: 0.5, P.VAL_CORRECT: 1, P.VAL_COUNT: 2, P.VAL_LOSS: 0.1},
            r"client 2: its train reply's num-examples is '3', not a number",
        ),
    ],
)
def test_a_train_reply_without_its_figures_names_its_sender(metrics, match):
    from retexo_fl.coordinator.round_aggregation import check_train_metrics

    reply = {P.ARRAYS: STATE} if metrics is None else {P.ARRAYS: STATE, P.METRICS: metrics}
    with pytest.raises(ClientFailure, match=match):
        check_train_metrics(2, reply)
    good = {P.NUM_EXAMPLES: 3, P.TRAIN_LOSS: 0.5, P.VAL_CORRECT: 1, P.VAL_COUNT: 2, P.VAL_LOSS: 0.1}
    check_train_metrics(2, {P.METRICS: good})  # a reply with its figures passes


def test_route_relays_to_live_clients_and_counts_every_byte():
    fed = _federation(TrainConfig.resolve(profile="exact", clients=3))
    for pid in range(3):
        fed.members.claim(pid, pid)
    out = fed.route({0: {"to-1": b"abc", "to-2": b"de"}, 1: {"to-0": b"f"}, 2: {"to-9": b"lost"}}, P.HALO)
    assert out == {0: {"halo-from-1": b"f"}, 1: {"halo-from-0": b"abc"}, 2: {"halo-from-0": b"de"}}
    assert fed.bytes_boundary == 6  # client 9 is nobody: nothing relayed, nothing counted
    with pytest.raises(ClientFailure, match=r"client 1: payload key 'from-0'"):
        fed.route({1: {"from-0": b"x"}}, P.HALO)


def test_setup_claims_every_partition_and_relays_sealed_degrees(sbm):
    cfg = TrainConfig.resolve(profile="exact", clients=3, stages=2, hidden=8)
    clients = [LazyClient(p, cfg) for p in partition_graph(sbm, 3, "random", seed=0)]
    fed = _federation(cfg, clients)
    degrees = fed.setup()
    assert fed.pids == [0, 1, 2] and sorted(fed.keys) == ["0", "1", "2"]
    assert fed.reference.num_classes == 3 and fed.counts[1].counts == clients[1].part.counts()
    # Every peer's degrees arrive sealed: 4 bytes a row plus the frame header and the envelope.
    for c in clients:
        got = degrees[c.id]
        assert sorted(got) == sorted(P.delivery_key(P.DEGREES, q) for q in c.plan.recv)
        assert all(blob[:4] == b"RXE2" for blob in got.values())
    assert fed.bytes_boundary == sum(len(b) for d in degrees.values() for b in d.values())


@pytest.mark.parametrize("secure", [False, True])
def test_the_summary_counts_every_message_by_type(sbm, secure):
    from retexo_fl.training.eager import run_eager
    from retexo_fl.training.lazy import run_lazy

    parts = partition_graph(sbm, 3, "metis", seed=0)
    cfg = TrainConfig(stages=2, hidden=16, rounds=3, seed=0, self_training=0, secure_aggregation=secure)
    lazy = run_lazy(parts, cfg)
    sent = sum(s["rounds_sent"] for s in lazy.stages)  # rounds whose train messages went out
    messages = lazy.federation["messages"]
    assert messages["hello"] == messages["setup"] == 3
    assert messages["train"] == 3 * sent
    assert messages.get("unmask", 0) == (3 * sent if secure else 0)  # one per survivor and round
    assert messages["embed"] == 3  # one stage boundary, one embed message per client
    assert messages["evaluate"] > 0
    if not secure:
        eager = run_eager(parts, TrainConfig.resolve(mode="eager", stages=2, hidden=16, rounds=4, seed=0))
        assert eager.federation["messages"]["train"] == 3 * eager.stages[0]["rounds_sent"]
