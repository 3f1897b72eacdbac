"""A train round sent again (a server resumed after its clients answered, before its checkpoint)
starts from what the round first found: compressed broadcasts, update residuals and control
variates are not applied twice, and the run ends bit for bit as an uninterrupted one."""

from __future__ import annotations

import pytest

from retexo_fl import protocol as P
from retexo_fl.config import TrainConfig
from retexo_fl.coordinator.stages import LazyStageMachine
from retexo_fl.coordinator.transport import Batch
from retexo_fl.data.partitioners import partition_graph
from retexo_fl.metrics import RunRecorder
from retexo_fl.party.client import Client
from retexo_fl.party.lazy_client import LazyClient
from retexo_fl.training.inprocess import InProcessTransport

CFG = dict(
    clients=3, model="gcn", stages=2, hidden=16, rounds=6, seed=0, patience=0, min_rounds=0,
    broadcast_bits=8, update_bits=8, drift_correction="scaffold", local_epochs=2,
)  # fmt: skip


class ResendsOneRound(InProcessTransport):
    """Delivers stage 1's round 3 twice to every client and keeps only the second reply, as a
    server that crashed after its clients answered and resumed from the round before does."""

    def send(self, kind: str, requests: dict, phase: str, stage: int) -> Batch:
        if kind == P.TRAIN and stage == 1 and any(int(r[P.CONFIG][P.ROUND]) == 3 for r in requests.values()):
            super().send(kind, requests, phase, stage)  # answered, then lost with the server
        return super().send(kind, requests, phase, stage)


def _run(parts, transport_cls) -> dict:
    cfg = TrainConfig.resolve(**CFG)
    clients = [LazyClient(p, cfg) for p in parts]
    return LazyStageMachine(transport_cls(clients), cfg, RunRecorder(None, stream=None)).run()


def _curve(summary: dict) -> list[float]:
    return [h[k] for s in summary["stages"] for h in s["history"] for k in ("val_accuracy", "train_loss")]


def test_a_round_sent_again_ends_the_run_as_if_it_was_sent_once(sbm, monkeypatch):
    parts = partition_graph(sbm, 3, "random", seed=0)
    whole = _run(parts, InProcessTransport)
    again = _run(parts, ResendsOneRound)
    assert again["test_accuracy"] == whole["test_accuracy"]
    assert _curve(again) == _curve(whole)
    # The test can fail: without going back, the second delivery applies the round's broadcast
    # delta, residual and control variate a second time, and the run drifts.
    record_only = Client.begin_round

    def forgetful(self: Client, round_: int) -> bool:
        self.journal = None
        return record_only(self, round_)

    monkeypatch.setattr(Client, "begin_round", forgetful)
    drifted = _run(parts, ResendsOneRound)
    assert _curve(drifted) != pytest.approx(_curve(whole), rel=1e-9)
