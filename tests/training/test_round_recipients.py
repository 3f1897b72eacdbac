"""A lazy stage's rounds go to the clients that have something to train or validate.

At one node per client most clients hold neither a training nor a validation node: they are sent
no train message, get the stage's relayed rows and state with its test, and still embed. Clients
with validation nodes only validate and send no update. The run must end exactly as when every
client takes part in every round (zero-weight clients add nothing to FedAvg)."""

from __future__ import annotations

import math

import pytest

from retexo_fl import protocol as P
from retexo_fl.config import TrainConfig
from retexo_fl.coordinator.round_aggregation import FedAvgRound
from retexo_fl.coordinator.stages import LazyStageMachine
from retexo_fl.coordinator.transport import Batch
from retexo_fl.data.datasets import apply_split, synthetic_sbm
from retexo_fl.data.partitioners import partition_graph
from retexo_fl.metrics import RunRecorder
from retexo_fl.party.lazy_client import LazyClient
from retexo_fl.training.inprocess import InProcessTransport

CFG = dict(model="gcn", stages=3, hidden=16, rounds=3, seed=0, patience=0, self_training=0)


class Recording(InProcessTransport):
    """Records every request: (message type, stage, address, whether it asked to validate only)."""

    def __init__(self, clients) -> None:
        super().__init__(clients)
        self.sent: list[tuple[str, int, int, bool]] = []

    def send(self, kind: str, requests: dict, phase: str, stage: int) -> Batch:
        for a, r in requests.items():
            self.sent.append((kind, stage, a, bool(r[P.CONFIG].get(P.VALIDATE_ONLY))))
        return super().send(kind, requests, phase, stage)


@pytest.fixture(scope="module")
def node_level():
    """60 nodes, one client each: 18 with a training node, 12 with a validation node."""
    data = synthetic_sbm(60, 3, avg_degree=6, homophily=0.85, num_features=8, feature_signal=0.4, seed=2)
    apply_split(data, "random:0.3,0.2,0.5", seed=2)
    return partition_graph(data, 60, "node", seed=0)


def _run(parts, **over):
    cfg = TrainConfig.resolve(**{**CFG, "clients": len(parts), **over})
    transport = Recording([LazyClient(p, cfg) for p in parts])
    summary = LazyStageMachine(transport, cfg, RunRecorder(None, stream=None)).run().to_dict()
    return summary, transport


def _val_curve(summary: dict) -> list[float]:
    return [h["val_accuracy"] for s in summary["stages"] for h in s["history"]]


@pytest.mark.parametrize("broadcast_bits", [4, 32])
def test_rounds_skip_clients_with_nothing_to_train_and_end_as_with_every_client(
    node_level, monkeypatch, broadcast_bits
):
    parts = node_level
    train = {p.partition_id for p in parts if int(p.train_mask.sum())}
    val_only = {p.partition_id for p in parts if int(p.val_mask.sum()) and p.partition_id not in train}
    assert len(train) == 18 and len(val_only) == 12  # the fixture's split, one node a client
    summary, transport = _run(parts, broadcast_bits=broadcast_bits)

    trained = {(a, v) for kind, _, a, v in transport.sent if kind == P.TRAIN}
    assert {a for a, _ in trained} == train | val_only, "train messages reach exactly who trains or validates"
    assert {a for a, v in trained if v} == val_only, "clients with validation nodes only just validate"
    for stage in range(3):  # every client is still tested and (but the last stage) embeds
        tested = {a for kind, s, a, _ in transport.sent if kind == P.EVALUATE and s == stage}
        assert tested == set(range(60))
        # The test to all 60, the stage's last validation only to the 30 that took part.
        assert sum(kind == P.EVALUATE and s == stage for kind, s, *_ in transport.sent) == 90
    assert {a for kind, _, a, _ in transport.sent if kind == P.EMBED} == set(range(60))
    rounds = sum(s["rounds_sent"] for s in summary["stages"])
    assert summary["messages"]["train"] == rounds * 30
    assert summary["messages_per_stage"]["0"]["train"] == summary["stages"][0]["rounds_sent"] * 30
    assert all(math.isfinite(h["train_loss"]) for s in summary["stages"] for h in s["history"])

    # Every client in every round, as before: zero-weight updates change no aggregate.
    monkeypatch.setattr(FedAvgRound, "select", lambda self: (self.fed.pids, []))
    everyone, t_all = _run(parts, broadcast_bits=broadcast_bits)
    assert sum(kind == P.TRAIN for kind, *_ in t_all.sent) == rounds * 60
    assert _val_curve(summary) == _val_curve(everyone)
    assert summary["test_accuracy"] == everyone["test_accuracy"]
    assert summary["bytes_boundary"] == everyone["bytes_boundary"]
    assert summary["bytes_model"] < everyone["bytes_model"]  # no broadcast to who does not train


def test_a_fraction_of_the_trainers_trains_each_round_sampled_from_the_seed(node_level):
    """``fraction-train 0.5``: 9 of the 18 clients with a training node train each round, a sample
    drawn again by a resumed server (a function of seed, stage and round); the others validate."""
    summary, transport = _run(node_level, fraction_train=0.5)
    train = [(s, a, v) for kind, s, a, v in transport.sent if kind == P.TRAIN]
    trainers = {p.partition_id for p in node_level if int(p.train_mask.sum())}
    per_stage_round = []
    i = 0
    for stage, figures in enumerate(summary["stages"]):
        for _ in range(figures["rounds_sent"]):
            batch = train[i : i + 30]  # every round still goes to the 30 that train or validate
            i += 30
            assert {s for s, _, _ in batch} == {stage}
            sampled = {a for _, a, v in batch if not v}
            assert len(sampled) == 9 and sampled <= trainers
            per_stage_round.append(sampled)
    assert i == len(train)
    assert len({frozenset(s) for s in per_stage_round}) > 1, "a new sample each round"
    again, t_again = _run(node_level, fraction_train=0.5)
    assert [x for x in t_again.sent if x[0] == P.TRAIN] == [x for x in transport.sent if x[0] == P.TRAIN]
    assert again["test_accuracy"] == summary["test_accuracy"]
    assert math.isfinite(summary["test_accuracy"])


def test_clients_per_round_caps_the_sample(node_level):
    """``clients-per-round 4``: 4 of the 18 clients with a training node train each round (after
    ``fraction-train``, whose sample it caps), a sample of the seed; a cap above the candidates
    changes nothing."""
    summary, transport = _run(node_level, clients_per_round=4)
    trainers = {p.partition_id for p in node_level if int(p.train_mask.sum())}
    train = [(s, a, v) for kind, s, a, v in transport.sent if kind == P.TRAIN]
    rounds = [train[i : i + 30] for i in range(0, len(train), 30)]
    assert rounds and all(len(batch) == 30 for batch in rounds)
    samples = [{a for _, a, v in batch if not v} for batch in rounds]
    assert all(len(s) == 4 and s <= trainers for s in samples)
    assert len({frozenset(s) for s in samples}) > 1, "a new sample each round"
    capped, t_capped = _run(node_level, fraction_train=0.5, clients_per_round=4)
    assert all(len({a for kind, _, a, v in batch if not v}) == 4 for batch in _rounds(t_capped))
    uncapped, t_uncapped = _run(node_level, clients_per_round=100)
    everyone, t_everyone = _run(node_level)
    assert [x for x in t_uncapped.sent if x[0] == P.TRAIN] == [x for x in t_everyone.sent if x[0] == P.TRAIN]
    assert uncapped["test_accuracy"] == everyone["test_accuracy"]
    assert math.isfinite(summary["test_accuracy"]) and math.isfinite(capped["test_accuracy"])


def _rounds(transport) -> list[list[tuple]]:
    train = [x for x in transport.sent if x[0] == P.TRAIN]
    return [train[i : i + 30] for i in range(0, len(train), 30)]
