"""Counting a batch's wire bytes: every message's own figure, a shared record serialized once."""

from __future__ import annotations

import torch
from flwr.app import ConfigRecord, Message

from clients.records import to_flower
from server.messaging import wire_bytes, wire_sizes


def _one_by_one(msg: Message) -> int:
    # From first principles: every content-addressed object of the message, serialized anew.
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    return sum(len(obj.deflate()) for obj in get_all_nested_objects(msg).values())


def test_a_batch_counts_each_message_as_it_travels_and_serializes_a_shared_record_once(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    # A ServerApp's messages belong to its run and task and come from its node.
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)
    state = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(4)}
    frames = {"w": b"\x01" * 300, "b": b"\x02" * 40}
    built: dict = {}
    messages = [
        Message(
            to_flower({"arrays": state, "model": frames, "config": {"round": 3, "client": i}}, built),
            dst_node_id=100 + i,
            message_type="train",
        )
        for i in range(5)
    ]
    expected = [_one_by_one(m) for m in messages]

    calls = {"n": 0}
    real = ConfigRecord.deflate

    def counted(self):
        calls["n"] += 1
        return real(self)

    monkeypatch.setattr(ConfigRecord, "deflate", counted)
    assert wire_sizes(messages) == expected
    # The shared frames record (a ConfigRecord) once, twice in all with its id; each message's
    # own config twice: 2 + 2 x 5, not 4 x 5 as serialized message by message.
    assert calls["n"] == 2 + 2 * len(messages)
    assert wire_bytes(messages[0]) == expected[0]
