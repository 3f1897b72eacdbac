"""Messaging over a Flower ``Grid``: push a batch, pull its replies, and count every byte.

Flower's own ``send_and_receive`` sleeps 3 s between pulls; :func:`exchange` starts at 20 ms and
backs off to 0.1 s. :class:`Traffic` keeps the serialized (wire) and record (payload) bytes of
every message, per stage, message type, client and direction, so protocol overhead is a
measured ratio.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from typing import Any

from flwr.app import Message
from flwr.serverapp import Grid
from flwr.supercore.inflatable.inflatable_object import (
    InflatableObject,
    get_all_nested_objects,
    no_object_id_recompute,
)

from retexo_fl import protocol as P


def wire_bytes(msg: Message) -> int:
    """Serialized size of a message as it travels (all its content-addressed objects)."""
    return wire_sizes([msg])[0]


def wire_sizes(messages: list[Message]) -> list[int]:
    """:func:`wire_bytes` of each of ``messages``, an object several of them share (a round's
    broadcast frames, built once for every recipient) serialized once, not once a message.

    Each message still counts every object it carries (a shared one travels to each recipient);
    the objects are not changed while they are counted, so their ids are computed once each
    (Flower's ``no_object_id_recompute``, as its own senders do). At one node per client a round
    is a thousand messages sharing one broadcast: serialized and hashed per message, counting
    was a fifth of the server's work in Flower simulation.
    """
    sizes: dict[int, int] = {}  # id(object) -> its serialized size (the objects outlive the call)

    def size(obj: InflatableObject) -> int:
        known = sizes.get(id(obj))
        if known is None:
            known = sizes[id(obj)] = len(obj.deflate())
        return known

    with no_object_id_recompute():
        return [sum(size(obj) for obj in get_all_nested_objects(msg).values()) for msg in messages]


def payload_bytes(msg: Message) -> int:
    """Bytes of the records' contents alone."""
    return sum(record.count_bytes() for record in msg.content.values())


#: How many of a batch's pending replies a pull asks for: the earliest sent (see :func:`exchange`).
PULL_WINDOW = 256


#: Set when the process is interrupted (Ctrl-C): a ServerApp thread waiting for replies leaves
#: at its next pull instead of waiting out ``client-timeout`` for nodes that are gone.
STOP = threading.Event()


class RunInterrupted(RuntimeError):
    """The run was interrupted while the server waited for replies."""


def exchange(grid: Grid, messages: list[Message], timeout: float) -> dict[int, Message]:
    """Push ``messages`` and pull their replies until all are in or ``timeout`` seconds pass.

    Replies are matched to requests by ``reply_to_message_id``, so an error reply the SuperLink
    writes for a node that died (its source is the SuperLink) is that node's.

    A pull asks for the :data:`PULL_WINDOW` earliest-sent pending replies, not all of them:
    Flower's link state checks every id a pull names, under its lock, and nodes answer about in
    the order they were sent. At one node per client a round's thousand pending ids asked every
    0.1 s were a seventh of the server's Python time in a profile. Replies further on wait until
    the window reaches them; before giving up, the last pull asks for every pending reply.

    Returns:
        dict[int, Message]: destination node id -> reply, for the replies that came.

    Raises:
        RunInterrupted: :data:`STOP` was set while replies were pending.
    """
    ids = list(grid.push_messages(messages))
    node_of = {mid: m.metadata.dst_node_id for mid, m in zip(ids, messages, strict=True)}
    pending, replies = dict.fromkeys(ids), {}  # pending keeps the order sent
    deadline, pause = time.monotonic() + timeout, 0.02
    while pending:
        last = time.monotonic() >= deadline
        asked = set(pending) if last else set(itertools.islice(pending, PULL_WINDOW))
        for reply in grid.pull_messages(asked):
            mid = reply.metadata.reply_to_message_id
            if mid in pending:
                del pending[mid]
                replies[node_of[mid]] = reply
        if not pending or last:
            break
        if STOP.is_set():
            raise RunInterrupted(f"interrupted while {len(pending)} replies were pending")
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(0.1, pause * 1.5)
    return replies


class Traffic:
    """Message counts and bytes per (stage, message type, node id, direction)."""

    def __init__(self) -> None:
        # (stage, message type, node id, direction) -> [messages, wire bytes, payload bytes]
        self.rows: dict[tuple[int, str, int, str], list[int]] = {}
        self._keys: dict[int, list[tuple[int, str, int, str]]] = {}  # each stage's rows, in order
        self._saved: dict[int, bytes] = {}  # each stage's rows as the last snapshot encoded them
        self._changed: set[int] = set()  # stages with rows added to since

    def count(
        self, stage: int, kind: str, node: int, direction: str, msg: Message, wire: int | None = None
    ) -> None:
        """Add one message.

        Args:
            stage (int): the stage it belongs to.
            kind (str): its message type.
            node (int): the Flower node id it went to or came from.
            direction (str): ``"down"`` (to the node) or ``"up"``.
            msg (Message): the message.
            wire (int, optional): its :func:`wire_bytes`, if counted already (:func:`wire_sizes`
                of its batch). (default: :obj:`None`)
        """
        self.add(stage, kind, node, direction, wire_bytes(msg) if wire is None else wire, payload_bytes(msg))

    def add(
        self, stage: int, kind: str, node: int, direction: str, wire: int, payload: int, messages: int = 1
    ) -> None:
        """Add ``messages`` messages of ``wire`` serialized and ``payload`` record bytes in all
        (see :meth:`count`)."""
        key = (stage, kind, node, direction)
        row = self.rows.get(key)
        if row is None:
            row = self.rows[key] = [0, 0, 0]
            self._keys.setdefault(stage, []).append(key)
        row[0] += messages
        row[1] += wire
        row[2] += payload
        self._changed.add(stage)

    def snapshot(self) -> dict[str, Any]:
        """The rows as a checkpoint keeps them: each stage's rows encoded once it has changed.

        The server saves its checkpoint after every round. At one node per client the rows are
        tens of thousands of keys, and ``torch.save`` visits each key and list in Python: 172 ms
        for the traffic of a shortened Cora run (2,708 clients) and 290 ms for 97,000 rows, with
        the actors idle. A finished stage's rows are now
        encoded once (JSON text, which a weights-only load reads as bytes), and a round
        re-encodes only its own stage's.
        """
        for stage in self._changed:
            rows = [[k, n, d, *self.rows[(s, k, n, d)]] for s, k, n, d in self._keys[stage]]
            self._saved[stage] = json.dumps(rows, separators=(",", ":")).encode()
        self._changed.clear()
        return {"stages": dict(self._saved)}

    def restore(self, snapshot: dict[str, Any]) -> None:
        """Adopt a :meth:`snapshot` (or the plain rows an older checkpoint kept) in place of
        the rows counted so far."""
        self.rows, self._keys, self._saved, self._changed = {}, {}, {}, set()
        if "stages" not in snapshot:  # (stage, type, node, direction) -> counts, as saved before
            for (stage, kind, node, direction), (n, wire, payload) in snapshot.items():
                self.add(stage, kind, node, direction, wire, payload, n)
            return
        for stage, encoded in snapshot["stages"].items():
            for kind, node, direction, n, wire, payload in json.loads(encoded):
                self.add(stage, kind, node, direction, wire, payload, n)

    def summary(self, names: dict[int, int]) -> dict[str, Any]:
        """Per-row counts (``names``: node id -> client id) and wire / payload ratios."""
        rows = [
            {
                "stage": s,
                "message": k,
                "client": names.get(node, -1),
                "direction": d,
                "messages": n,
                "wire": w,
                "payload": p,
            }
            for (s, k, node, d), (n, w, p) in sorted(self.rows.items())
        ]
        wire = sum(r["wire"] for r in rows)
        payload = sum(r["payload"] for r in rows)
        embed = [r for r in rows if r["message"] == P.EMBED and r["direction"] == "up"]
        embed_wire, embed_payload = sum(r["wire"] for r in embed), sum(r["payload"] for r in embed)
        return {
            "bytes_wire": wire,
            "bytes_payload": payload,
            "overhead": wire / payload if payload else None,
            "boundary_overhead": embed_wire / embed_payload if embed_payload else None,
            "by_message": rows,
        }
