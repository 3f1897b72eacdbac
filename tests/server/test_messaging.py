"""Counting a batch's wire bytes: every message's own figure, a shared record serialized once."""

from __future__ import annotations

import time
from types import SimpleNamespace

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


def test_the_traffic_a_checkpoint_keeps_is_the_rows_it_was_taken_from(tmp_path):
    import io

    from server.checkpoint import SAFE_GLOBALS
    from server.messaging import Traffic

    traffic = Traffic()
    # Flower node ids are unsigned 64-bit: one above int64's range must come back as it was.
    nodes = [7, 2**63 + 5, 2**64 - 1]

    def saved_and_read(snapshot):
        buffer = io.BytesIO()
        torch.save(snapshot, buffer)
        buffer.seek(0)
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(buffer, weights_only=True)  # as a checkpoint is read

    for stage in (-1, 0, 1):
        for _ in range(2):  # each stage is snapshotted after each of its rounds
            for i, node in enumerate(nodes):
                traffic.add(stage, "train", node, "down", 1000 * i + stage, 900 * i)
                traffic.add(stage, "embed", node, "up", 10 + i, 5 + stage)
            snapshot = saved_and_read(traffic.snapshot())
            resumed = Traffic()
            resumed.restore(snapshot)
            assert resumed.rows == traffic.rows  # the rounds of a finished stage, and this one's
            assert list(resumed.rows) == list(traffic.rows)  # the summary's order too
    assert traffic.rows[(1, "train", 2**64 - 1, "down")] == [2, 2 * 2001, 2 * 1800]
    resumed.add(1, "train", 7, "down", 5, 4)  # a resumed run counts on from what it found
    assert resumed.rows[(1, "train", 7, "down")] == [3, 7, 4]
    older = Traffic()
    older.restore(saved_and_read(dict(traffic.rows)))  # a checkpoint from before kept the rows
    assert older.rows == traffic.rows
    empty = Traffic()
    empty.restore(Traffic().snapshot())
    assert empty.rows == {}


class _Grid:
    """A grid whose nodes answer when the test says; it records the ids each pull asks for."""

    def __init__(self) -> None:
        self.done: set[str] = set()
        self.asked: list[set[str]] = []
        self.ids: list[str] = []

    def push_messages(self, messages):
        self.ids = [f"m{i}" for i in range(len(messages))]
        return self.ids

    def pull_messages(self, ids):
        self.asked.append(set(ids))
        ready = [
            SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=m)) for m in ids if m in self.done
        ]
        self.done -= set(ids)  # a reply is handed out once
        return ready


def _requests(n: int) -> list:
    return [SimpleNamespace(metadata=SimpleNamespace(dst_node_id=100 + i)) for i in range(n)]


def test_exchange_asks_for_the_earliest_pending_replies_and_collects_every_one(monkeypatch):
    from server import messaging

    monkeypatch.setattr(messaging, "PULL_WINDOW", 4)
    grid = _Grid()
    clock = {"pulls": 0}
    real_pull = grid.pull_messages

    def pull(ids):  # nodes answer out of order, a few per pull
        clock["pulls"] += 1
        grid.done |= {f"m{i}" for i in (9, 2, 0, 5, 1, 3, 4, 8, 7, 6)[: 2 * clock["pulls"]]}
        return real_pull(ids)

    grid.pull_messages = pull
    monkeypatch.setattr(messaging, "time", SimpleNamespace(monotonic=time.monotonic, sleep=lambda s: None))
    replies = messaging.exchange(grid, _requests(10), timeout=60)
    assert sorted(replies) == list(range(100, 110))
    assert all(len(asked) <= 4 for asked in grid.asked)
    assert grid.asked[0] == {"m0", "m1", "m2", "m3"}  # the earliest sent


def test_exchange_asks_for_every_pending_reply_before_it_gives_up(monkeypatch):
    from server import messaging

    monkeypatch.setattr(messaging, "PULL_WINDOW", 2)
    grid = _Grid()
    grid.done = {"m3", "m4"}  # m0-m2 never answer; m3 and m4 lie beyond the window
    now = {"t": 0.0}
    clock = SimpleNamespace(monotonic=lambda: now["t"], sleep=lambda s: now.__setitem__("t", now["t"] + s))
    monkeypatch.setattr(messaging, "time", clock)
    replies = messaging.exchange(grid, _requests(5), timeout=1.0)
    assert sorted(replies) == [103, 104]
    assert grid.asked[-1] == {"m0", "m1", "m2", "m3", "m4"}
    assert all(len(asked) <= 2 for asked in grid.asked[:-1])


def test_an_interrupt_ends_a_wait_for_replies_at_the_next_pull_not_at_the_timeout():
    import pytest

    from server import messaging

    class Silent:  # nodes that are gone: messages pushed, no reply ever; interrupted at pull 3
        pulls = 0

        def push_messages(self, messages):
            return [f"m{i}" for i in range(len(messages))]

        def pull_messages(self, ids):
            self.pulls += 1
            if self.pulls == 3:
                messaging.STOP.set()
            return []

    grid = Silent()
    msg = SimpleNamespace(metadata=SimpleNamespace(dst_node_id=3))
    messaging.STOP.clear()
    try:
        with pytest.raises(messaging.RunInterrupted, match="interrupted while 1 replies were pending"):
            messaging.exchange(grid, [msg], timeout=300.0)  # type: ignore[arg-type]
    finally:
        messaging.STOP.clear()
    assert grid.pulls == 3  # it left after the pull that saw the interrupt, not at the timeout
