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
from retexo_fl.party.handlers import handle
from retexo_fl.party.lazy_client import LazyClient
from retexo_fl.party.persistence import journal_file_name
from retexo_fl.party.state import STATE_FILE, read_state_file
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


class SavesEachMessage(ResendsOneRound):
    """Each client saves its state after every message that changed it and is restored from its
    folder before the next, as a Flower node whose messages another process may answer: the
    round sent again reads what the round found from the work folder."""

    folder = None  # set per test

    def send(self, kind: str, requests: dict, phase: str, stage: int) -> Batch:
        replies = {}
        for a, request in requests.items():
            client, work = self.clients[a], self.folder / f"node-{a}"
            client.restore(work)
            reply = handle(client, kind, request)
            if reply.changed:
                client.save(work)
            replies[a] = reply
        self.last = replies
        return Batch({a: r.records for a, r in replies.items()})


class SavesAndResends(SavesEachMessage):
    def send(self, kind: str, requests: dict, phase: str, stage: int) -> Batch:
        if kind == P.TRAIN and stage == 1 and any(int(r[P.CONFIG][P.ROUND]) == 3 for r in requests.values()):
            SavesEachMessage.send(self, kind, requests, phase, stage)  # answered, then lost
        return SavesEachMessage.send(self, kind, requests, phase, stage)


def test_a_saved_round_journal_is_the_state_file_the_round_found_and_a_resent_round_reads_it(
    sbm, tmp_path, monkeypatch
):
    parts = partition_graph(sbm, 3, "random", seed=0)
    whole = _run(parts, InProcessTransport)
    SavesEachMessage.folder = tmp_path / "once"
    saved = _run(parts, SavesEachMessage)
    assert _curve(saved) == _curve(whole)
    SavesEachMessage.folder = tmp_path / "again"
    again = _run(parts, SavesAndResends)
    assert again["test_accuracy"] == whole["test_accuracy"]
    assert _curve(again) == _curve(whole)

    # What a trainer's saved state holds: the journal names the state file the round found
    # (the one saved after the message before), kept under its name, and no other journal file.
    work = tmp_path / "once" / "node-0"
    values = read_state_file(work / STATE_FILE)
    key, found = values["journal"][0], values["journal"][1]
    assert found == journal_file_name(key) and isinstance(found, str)
    assert sorted(p.name for p in work.glob("journal-*")) == [found]
    before = read_state_file(work / found)
    assert before["view"] is not None and before["residual"] is not None

    # The test can fail: a journal file that is not what the round found (here: the state the
    # round left) sends the resent round on from the wrong place, and the run drifts.
    real = Client.save

    def links_the_new_state(self: Client, folder) -> None:
        real(self, folder)
        if self.journal_file is not None:
            (folder / self.journal_file).unlink()
            (folder / self.journal_file).hardlink_to(folder / STATE_FILE)

    monkeypatch.setattr(Client, "save", links_the_new_state)
    SavesEachMessage.folder = tmp_path / "wrong"
    drifted = _run(parts, SavesAndResends)
    assert _curve(drifted) != pytest.approx(_curve(whole), rel=1e-9)
