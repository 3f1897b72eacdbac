"""The in-process transport: every client of a run in this process, called directly, no Flower."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from retexo_fl import protocol as P
from retexo_fl.coordinator.transport import Batch, ClientFailure
from retexo_fl.party.client import Client
from retexo_fl.party.cohort import TrainCohort
from retexo_fl.party.handlers import Reply, handle, handle_lane, lane_requests, report_missing
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
            return self._send_lanes(kind, requests)
        return Batch(self._answer(kind, requests, lambda client, req: handle(client, kind, req)))

    def _answer(
        self, kind: str, requests: dict[int, Records], answer: Callable[[Client, Records], Reply]
    ) -> dict[int, Records]:
        """Each client's ``answer`` to its request; a train message's trainers as a cohort."""
        cohort = None
        if kind == P.TRAIN:
            lazy = {a: c for a in requests if isinstance(c := self.clients[a], LazyClient)}
            cohort = TrainCohort.gather(lazy, requests)
        if cohort is None:
            return {a: answer(self.clients[a], req).records for a, req in requests.items()}
        for client in cohort.members.values():
            client.cohort = cohort
        try:
            return {a: answer(self.clients[a], req).records for a, req in requests.items()}
        finally:
            for client in cohort.members.values():
                client.cohort = None

    def _send_lanes(self, kind: str, requests: dict[int, Records]) -> Batch:
        """Messages of several lanes (:data:`~retexo_fl.protocol.LANES`), lane by lane: each
        lane's messages to every client as one batch, so that a lane's trainers still train as a
        cohort; each client answers its lanes in order, as it would one message of them
        (:func:`~retexo_fl.party.handlers.handle_lanes`)."""
        by_lane: dict[str, dict[int, Records]] = {}
        for address, request in requests.items():
            for variant, lane in lane_requests(self.clients[address], kind, request).items():
                by_lane.setdefault(variant, {})[address] = lane
        replies: dict[int, Records] = {address: {} for address in requests}
        for variant, lane_batch in by_lane.items():
            for address in lane_batch:  # the lane's round state, before the cohort reads the clients
                self.clients[address].set_first_stage(variant, lane=True)
            answers = self._answer(kind, lane_batch, lambda client, req: handle_lane(client, kind, req))
            for address, records in answers.items():
                replies[address].update({P.lane_record(variant, k): v for k, v in records.items()})
        for address in requests:  # filled-in payloads, once a message (as handle_lanes reports them)
            client = self.clients[address]
            if client.missing:
                report_missing(client, replies[address])
        return Batch(replies)

    def report(self, names: dict[int, int]) -> dict[str, Any]:
        return {}

    def snapshot(self) -> Any:
        return None

    def restore(self, snapshot: Any) -> None:
        return None
