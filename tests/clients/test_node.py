"""A node keeps the run config setup brought, in a work folder of its own, and refuses others."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from clients.node import WORK_DIR_ENV, run_config, work_base
from retexo_fl import protocol as P
from retexo_fl.config import TrainConfig
from retexo_fl.metrics import RunRecorder
from retexo_fl.training.federation import Federation
from retexo_fl.training.inprocess import InProcessTransport


@dataclass
class _Metadata:
    message_type: str
    run_id: int = 1


@dataclass
class _Message:
    """What ``run_config`` reads of a message (a real ``Message`` needs a running Flower context)."""

    content: dict
    metadata: _Metadata


@dataclass
class _Context:
    node_config: dict = field(default_factory=dict)
    node_id: int = 5


def _federation(**kw) -> Federation:
    return Federation(InProcessTransport([]), TrainConfig(**kw), RunRecorder(None, stream=None))


def _message(fed: Federation, kind: str, **kw) -> _Message:
    """The message ``fed`` would send, as the ClientApp sees its records."""
    return _Message(fed.content(**kw), _Metadata(kind))


def test_a_node_keeps_the_config_setup_brought(tmp_path):
    fed = _federation(hidden=16, rounds=[60, 200])
    ctx = _Context({P.NODE_WORK_DIR: str(tmp_path), P.NODE_PARTITION_ID: 2})
    assert run_config(_message(fed, P.SETUP), ctx).to_dict() == fed.cfg.to_dict()
    got = run_config(_message(fed, P.TRAIN, by_digest=True, round=1), ctx)
    assert got.hidden == 16 and got.rounds == [60, 200]
    assert got.to_dict() == fed.cfg.to_dict()
    assert (tmp_path / f"run-{fed.run_key}" / "node-2" / "run-config.json").is_file()


def test_a_train_message_for_an_unknown_or_other_config_is_refused(tmp_path):
    fed = _federation(hidden=16)
    ctx = _Context({P.NODE_WORK_DIR: str(tmp_path), P.NODE_PARTITION_ID: 2})
    train = _message(fed, P.TRAIN, by_digest=True, round=1)
    with pytest.raises(ValueError, match=r"holds none for run key .*missed key setup and setup"):
        run_config(train, ctx)
    other = _federation(hidden=32)
    other.run_key = fed.run_key  # the same run key, another config: a stale or forged message
    run_config(_message(other, P.SETUP), ctx)
    with pytest.raises(ValueError, match=r"names run config '[0-9a-f]{32}'; this node holds '[0-9a-f]{32}'"):
        run_config(train, ctx)


def test_the_work_folder_is_the_nodes_choice(tmp_path, monkeypatch):
    monkeypatch.setenv(WORK_DIR_ENV, str(tmp_path / "env"))
    assert work_base(_Context()) == tmp_path / "env"
    assert work_base(_Context({P.NODE_WORK_DIR: str(tmp_path / "node")})) == tmp_path / "node"
    monkeypatch.delenv(WORK_DIR_ENV)
    assert work_base(_Context()).name == "retexo-fl"
