"""The in-process transport: every client of a run in this process, called directly, no Flower."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from retexo_fl import protocol as P
from retexo_fl.coordinator.transport import Batch, ClientFailure
from retexo_fl.party.client import Client
from retexo_fl.party.cohort import TrainCohort
from retexo_fl.party.handlers import handle, lane_requests
from retexo_fl.party.lazy_client import LazyClient
from retexo_fl.protocol import Records


class InProcessTransport:
    """A :class:`~retexo_fl.coordinator.transport.Transport` over client objects in this process.

    Addresses are indices into ``clients``. A request reaches :func:`~retexo_fl.party.handlers.handle`
    as it is (no copies, no serialization); a client's error propagates with its traceback, since
    there is nobody to lose.

    Args:
        clients (Sequence[Client]): the run's clients.
    """

    engine = "in-process"

    def __init__(self, clients: Sequence[Client]) -> None:
        self.clients = list(clients)

    def connect(self, count: int) -> list[int]:
        if len(self.clients) < count:
            raise ClientFailure(f"only {len(self.clients)} of {count} clients exist in this process")
        return list(range(count))

    def send(self, kind: str, requests: dict[int, Records], phase: str, stage: int) -> Batch:
        if any(P.has_lanes(r) for r in requests.values()):
            return self._send_lanes(kind, requests, phase, stage)
        cohort = None
        if kind == P.TRAIN:
            lazy = {a: c for a in requests if isinstance(c := self.clients[a], LazyClient)}
            cohort = TrainCohort.gather(lazy, requests)
        if cohort is None:
            return Batch({a: handle(self.clients[a], kind, req).records for a, req in requests.items()})
        for client in cohort.members.values():
            client.cohort = cohort
        try:
            return Batch({a: handle(self.clients[a], kind, req).records for a, req in requests.items()})
        finally:
            for client in cohort.members.values():
                client.cohort = None

    def _send_lanes(self, kind: str, requests: dict[int, Records], phase: str, stage: int) -> Batch:
        """Messages of several lanes (:data:`~retexo_fl.protocol.LANES`), lane by lane: each
        lane's messages to every client as one batch, so that a lane's trainers still train as a
        cohort; each client answers its lanes in order, as it would one message of them."""
        by_lane: dict[str, dict[int, Records]] = {}
        for address, request in requests.items():
            for variant, lane in lane_requests(self.clients[address], kind, request).items():
                by_lane.setdefault(variant, {})[address] = lane
        replies: dict[int, Records] = {address: {} for address in requests}
        for variant, lane_batch in by_lane.items():
            for address, records in self.send(kind, lane_batch, phase, stage).replies.items():
                replies[address].update({P.lane_record(variant, k): v for k, v in records.items()})
        return Batch(replies)

    def report(self, names: dict[int, int]) -> dict[str, Any]:
        return {}

    def snapshot(self) -> Any:
        return None

    def restore(self, snapshot: Any) -> None:
        return None
