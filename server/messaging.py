"""Messaging over a Flower ``Grid``: push a batch, pull its replies, and count every byte.

Flower's own ``send_and_receive`` sleeps 3 s between pulls; :func:`exchange` starts at 20 ms and
backs off to 0.5 s. :class:`Traffic` keeps the serialized (wire) and record (payload) bytes of
every message, per stage, message type, client and direction, so protocol overhead is a
measured ratio.
"""

from __future__ import annotations

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


def exchange(grid: Grid, messages: list[Message], timeout: float) -> dict[int, Message]:
    """Push ``messages`` and pull their replies until all are in or ``timeout`` seconds pass.

    Replies are matched to requests by ``reply_to_message_id``, so an error reply the SuperLink
    writes for a node that died (its source is the SuperLink) is that node's.

    Returns:
        dict[int, Message]: destination node id -> reply, for the replies that came.
    """
    ids = list(grid.push_messages(messages))
    node_of = {mid: m.metadata.dst_node_id for mid, m in zip(ids, messages, strict=True)}
    pending, replies = set(ids), {}
    deadline, pause = time.monotonic() + timeout, 0.02
    while pending:
        for reply in grid.pull_messages(pending):
            mid = reply.metadata.reply_to_message_id
            if mid in pending:
                pending.discard(mid)
                replies[node_of[mid]] = reply
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(0.1, pause * 1.5)
    return replies


class Traffic:
    """Message counts and bytes per (stage, message type, node id, direction)."""

    def __init__(self) -> None:
        # (stage, message type, node id, direction) -> [messages, wire bytes, payload bytes]
        self.rows: dict[tuple[int, str, int, str], list[int]] = {}

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
        row = self.rows.setdefault((stage, kind, node, direction), [0, 0, 0])
        row[0] += 1
        row[1] += wire_bytes(msg) if wire is None else wire
        row[2] += payload_bytes(msg)

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
