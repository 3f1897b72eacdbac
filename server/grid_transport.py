"""The Flower transport: the library's stage machine and round loop, over a ``Grid``."""

from __future__ import annotations

import time
from logging import INFO
from typing import Any

from flwr.app import Message
from flwr.common.logger import log
from flwr.serverapp import Grid

from clients.records import Record, from_flower, to_flower
from retexo_fl.coordinator.transport import Batch, ClientFailure
from retexo_fl.protocol import Records
from server.messaging import Traffic, exchange, wire_sizes

#: Seconds between the lines a run waiting for its SuperNodes logs.
WAIT_REPORT_S = 10.0


class GridTransport:
    """A :class:`~retexo_fl.coordinator.transport.Transport` that sends Flower Messages over ``grid``.

    Addresses are Flower node ids. A node that does not reply within ``timeout`` seconds, or
    replies with an error, is reported as a failure; the stage machine's policy decides what
    that means.

    Args:
        grid (Grid): the ServerApp's grid (simulation or deployment).
        timeout (float): seconds to wait for each batch's replies (``client-timeout``).
    """

    engine = "flower"

    def __init__(self, grid: Grid, timeout: float) -> None:
        self.grid = grid
        self.timeout = timeout
        self.traffic = Traffic()

    def connect(self, count: int) -> list[int]:
        start = time.monotonic()
        deadline, said = start + self.timeout, start
        while True:
            nodes = sorted(self.grid.get_node_ids())
            if len(nodes) >= count:
                return nodes[:count]
            now = time.monotonic()
            if now > deadline:
                raise ClientFailure(
                    f"only {len(nodes)} of {count} clients connected within client-timeout "
                    f"{self.timeout:g}s: start the missing SuperNodes, or set clients to the "
                    "number of parties"
                )
            if now - said >= WAIT_REPORT_S:  # a run waiting for SuperNodes says so
                said = now
                left = deadline - now
                log(INFO, "waiting for clients: %d of %d connected (%.0fs left)", len(nodes), count, left)
            time.sleep(0.5)

    def send(self, kind: str, requests: dict[int, Records], phase: str, stage: int) -> Batch:
        # A record many requests share (a round's broadcast frames) is built and hashed once.
        built: dict[tuple[str, int], tuple[object, Record]] = {}
        messages = [
            Message(to_flower(r, built), dst_node_id=node, message_type=kind) for node, r in requests.items()
        ]
        sent = {m.metadata.dst_node_id: m for m in messages}
        replies = exchange(self.grid, messages, self.timeout)
        batch = Batch()
        answered = []
        for node in requests:
            reply = replies.get(node)
            if reply is None:
                batch.failures[node] = f"did not reply to {phase} within {self.timeout:.0f}s"
            elif reply.has_error():
                batch.failures[node] = f"failed during {phase}: {reply.error.reason}"
            else:
                answered.append(node)
                batch.replies[node] = from_flower(reply.content)
        down = wire_sizes([sent[node] for node in answered])  # the shared broadcast once
        up = wire_sizes([replies[node] for node in answered])
        for node, wire_down, wire_up in zip(answered, down, up, strict=True):
            self.traffic.count(stage, kind, node, "down", sent[node], wire_down)
            self.traffic.count(stage, kind, node, "up", replies[node], wire_up)
        return batch

    def report(self, names: dict[int, int]) -> dict[str, Any]:
        return {"traffic": self.traffic.summary(names)}

    def snapshot(self) -> Any:
        return self.traffic.snapshot()

    def restore(self, snapshot: Any) -> None:
        if snapshot is not None:
            self.traffic.restore(snapshot)
