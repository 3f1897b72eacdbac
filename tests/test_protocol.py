"""The run config travels once per node, and train messages name it by digest."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from clients.app import _run_config
from retexo_fl import protocol as P
from retexo_fl.config import TrainConfig
from retexo_fl.metrics import RunRecorder
from server.app import StageMachine


@dataclass
class _Metadata:
    message_type: str
    run_id: int = 1


@dataclass
class _Message:
    """What ``_run_config`` reads of a message (a real ``Message`` needs a running Flower context)."""

    content: dict
    metadata: _Metadata


@dataclass
class _Context:
    node_config: dict = field(default_factory=dict)
    node_id: int = 5


def _message(machine: StageMachine, kind: str, **kw) -> _Message:
    """The message ``machine`` would send, its records as plain dicts."""
    records = machine._content(**kw)
    return _Message({k: dict(v) for k, v in records.items()}, _Metadata(kind))


@pytest.fixture
def machine() -> StageMachine:
    return StageMachine(None, TrainConfig(hidden=16, rounds=[60, 200]), RunRecorder(None, stream=None))


def test_train_messages_carry_the_digest_not_the_config(machine):
    train = machine._content(by_digest=True, stage=0, round=3)[P.CONFIG]
    setup = machine._content(keys="{}")[P.CONFIG]
    assert P.RUN not in train
    assert train[P.RUN_DIGEST] == P.config_digest(machine.run_json)
    assert setup[P.RUN] == machine.run_json
    assert P.RUN_DIGEST not in setup
    assert len(machine.run_json) > 500  # what each train message no longer carries


def test_a_node_keeps_the_config_setup_brought(machine, tmp_path):
    ctx = _Context({"work-dir": str(tmp_path), "partition-id": 2})
    setup = _message(machine, P.SETUP)
    train = _message(machine, P.TRAIN, by_digest=True, round=1)
    assert _run_config(setup, ctx).to_dict() == machine.cfg.to_dict()
    got = _run_config(train, ctx)
    assert got.hidden == 16 and got.rounds == [60, 200]
    assert got.to_dict() == machine.cfg.to_dict()


def test_a_train_message_for_an_unknown_or_other_config_is_refused(machine, tmp_path):
    ctx = _Context({"work-dir": str(tmp_path), "partition-id": 2})
    train = _message(machine, P.TRAIN, by_digest=True, round=1)
    with pytest.raises(ValueError, match=r"holds none for run key .*missed key setup and setup"):
        _run_config(train, ctx)
    other = StageMachine(None, TrainConfig(hidden=32), RunRecorder(None, stream=None))
    other.run_key = machine.run_key  # the same run key, another config: a stale or forged message
    _run_config(_message(other, P.SETUP), ctx)
    with pytest.raises(ValueError, match=r"names run config '[0-9a-f]{32}'; this node holds '[0-9a-f]{32}'"):
        _run_config(train, ctx)
