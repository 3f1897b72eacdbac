"""How the server's loops reach clients: a small transport interface, and the failure policy.

The lazy stage machine (:mod:`~retexo_fl.coordinator.stages`) and the round loop every mode runs
(:mod:`~retexo_fl.coordinator.round_loop`) send batches of :data:`~retexo_fl.protocol.Records` through
a :class:`Transport` and get replies back, or learn which clients were lost. Two transports
exist: :class:`~retexo_fl.training.inprocess.InProcessTransport` calls the client handlers
directly; ``server/grid_transport.py`` sends Flower Messages over a ``Grid``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from retexo_fl.config import TrainConfig
from retexo_fl.metrics import RunRecorder
from retexo_fl.protocol import Records


class ClientFailure(RuntimeError):
    """A client replied with an error or did not reply in time, and the run cannot go on without it."""


@dataclass
class Batch:
    """What one :meth:`Transport.send` brought back.

    Args:
        replies (dict[int, Records]): address -> the reply's content.
        failures (dict[int, str]): address -> why it gave none, as a phrase that follows the
            client's name (``"did not reply to stage 1 round 3 within 5s"``).
    """

    replies: dict[int, Records] = field(default_factory=dict)
    failures: dict[int, str] = field(default_factory=dict)


class Transport(Protocol):
    """A way to reach a run's clients. Addresses are the transport's own (Flower node ids, or
    indices in process); the loops learn which partition each one holds from its replies."""

    engine: str
    """The engine's name in the run summary (``"flower"``, ``"in-process"``)."""

    def connect(self, count: int) -> list[int]:
        """Wait until ``count`` clients can be reached; return their addresses.

        Raises:
            ClientFailure: fewer than ``count`` came in time.
        """
        ...

    def send(self, kind: str, requests: dict[int, Records], phase: str, stage: int) -> Batch:
        """Send ``requests`` (address -> content) as messages of type ``kind``; wait for the replies.

        Args:
            kind (str): the message type.
            requests (dict[int, Records]): one content per address.
            phase (str): what the messages are for, as error messages and traffic name it.
            stage (int): the stage they belong to (-1: setup), for byte accounting.
        """
        ...

    def report(self, names: dict[int, int]) -> dict[str, Any]:
        """Extra summary entries (Flower: per-message traffic), with ``names`` address -> client id."""
        ...

    def snapshot(self) -> Any:
        """What a checkpoint keeps of the transport (its accounting), or ``None``."""
        ...

    def restore(self, snapshot: Any) -> None:
        """Adopt a :meth:`snapshot` of a run being resumed."""
        ...


class Membership:
    """Which partition each address holds, who was lost, and what losing a client means.

    A lost client ends the run unless ``min-clients`` allows going on without it, and the boundary
    rows it would have sent can be replaced (``on-missing-halo`` other than ``fail``; local mode
    sends none).

    Args:
        cfg (TrainConfig): the run configuration (``clients``, ``min-clients``, ``on-missing-halo``).
        rec (RunRecorder): where losses are logged.
    """

    def __init__(self, cfg: TrainConfig, rec: RunRecorder) -> None:
        self.cfg = cfg
        self.rec = rec
        self.nodes: dict[int, int] = {}  # partition id -> address
        self.lost: list[dict[str, Any]] = []  # clients lost on the way: who, when, why

    @property
    def pids(self) -> list[int]:
        """The live clients' partition ids, in order."""
        return sorted(self.nodes)

    def claim(self, pid: int, address: int) -> None:
        """Record that ``address`` holds partition ``pid``.

        Raises:
            ClientFailure: another address already holds it.
        """
        if pid in self.nodes and self.nodes[pid] != address:
            raise ClientFailure(f"nodes {self.nodes[pid]} and {address} both hold partition {pid}")
        self.nodes[pid] = address

    def who(self, address: int) -> int | None:
        """The partition ``address`` holds, if known."""
        for pid, node in self.nodes.items():
            if node == address:
                return pid
        return None

    def name(self, address: int) -> str:
        """``"client P"`` for a known address, else ``"node N"``."""
        pid = self.who(address)
        return f"client {pid}" if pid is not None else f"node {address}"

    def lose(self, pid: int | None, phase: str, reason: str) -> None:
        """Drop client ``pid`` (``None``: a node lost at key setup or setup, before it said which
        partition it holds), or end the run if the policy says so.

        Raises:
            ClientFailure: with ``reason``, and why the run cannot go on without the client.
        """
        cfg = self.cfg
        required = cfg.min_clients or cfg.clients
        if pid is not None:
            self.nodes.pop(pid, None)
        # Every client not lost yet, claimed or not (at key setup none has claimed a partition).
        left = cfg.clients - len(self.lost) - 1
        halo_bound = cfg.mode != "local" and cfg.on_missing_halo == "fail"
        if required >= cfg.clients or left < required or halo_bound:
            why = ""
            if required < cfg.clients and left < required:
                why = f" ({left} of {cfg.clients} clients left, min-clients {required})"
            elif required < cfg.clients and halo_bound:
                why = " (on-missing-halo fail: its peers would miss its boundary rows)"
            raise ClientFailure(reason + why)
        self.lost.append({"client": pid, "phase": phase, "reason": reason, "t": round(self.rec.elapsed(), 3)})
        self.rec.event("client_lost", client=pid, phase=phase, reason=reason)
        self.rec.progress(f"lost {reason}; continuing with {left} clients (min-clients {required})")
