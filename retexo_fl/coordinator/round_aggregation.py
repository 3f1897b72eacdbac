"""One round's aggregation, the hooks :class:`~retexo_fl.coordinator.round_loop.RoundLoop` drives.

The loop owns the transport; an aggregation never sends. A round runs its hooks in this order::

    select()             -> who the round's train message goes to: who trains, who only validates
    configure()          -> config entries of the round's train message
    decorate(requests)   -> records added to the train requests (their extra bytes)
    collect(replies)     -> the replies read: validation sums, raw bytes; or an Exchange
    resume(answers)      -> called with the answers to each Exchange until none is asked
    (the loop records validation and may stop the stage here)
    aggregate()          -> the aggregate state (before the server optimizer) and training loss

Implementations: :class:`FedAvgRound` (FedAvg, and DP-FedAvg when the run has a DP accountant:
:func:`~retexo_fl.coordinator.privacy.aggregate_round`), :class:`ScaffoldRound` (FedAvg with
SCAFFOLD's control variates) and :class:`SecureRound` (secure aggregation: the server learns
sums only, and one more message, the unmasking, is an :class:`Exchange`).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from retexo_fl import protocol as P
from retexo_fl.compress.updates import UpdateCodec
from retexo_fl.coordinator.aggregate import state_nbytes
from retexo_fl.coordinator.checkpoint import RoundState
from retexo_fl.coordinator.federation import FederationView
from retexo_fl.coordinator.privacy import aggregate_round
from retexo_fl.coordinator.secure_aggregation import PendingUnmask
from retexo_fl.coordinator.transport import ClientFailure
from retexo_fl.protocol import Records
from retexo_fl.records import StateDict
from retexo_fl.seeding import derive_seed

#: Seed tag of a round's sample of trainers (``fraction-train``).
SAMPLE_TAG = 0x5A


@dataclass
class Exchange:
    """A message phase an aggregation asks the round loop to send before it can go on.

    Args:
        kind (str): the message type (e.g. :data:`~retexo_fl.protocol.UNMASK`).
        requests (dict[int, Records]): the request to each client, by partition id.
        phase (str): names the phase in messages and progress.
    """

    kind: str
    requests: dict[int, Records]
    phase: str


def sum_val(metrics: list[dict[str, Any]]) -> tuple[int, int, float]:
    """Validation (correct, count, summed loss) over train replies' metrics."""
    return (
        sum(int(m[P.VAL_CORRECT]) for m in metrics),
        sum(int(m[P.VAL_COUNT]) for m in metrics),
        sum(float(m[P.VAL_LOSS]) for m in metrics),
    )


#: What every plain train reply's :data:`~retexo_fl.protocol.METRICS` holds, each a number.
TRAIN_METRICS = (P.NUM_EXAMPLES, P.TRAIN_LOSS, P.VAL_CORRECT, P.VAL_COUNT, P.VAL_LOSS)


def check_train_metrics(pid: int, reply: Records) -> None:
    """Refuse a train reply whose metrics lack a figure the round reads, or hold one that is not
    a number.

    Raises:
        ClientFailure: naming the client and the figure.
    """
    metrics = reply.get(P.METRICS)
    if not isinstance(metrics, Mapping):
        raise ClientFailure(f"client {pid}: its train reply carries no {P.METRICS}")
    for key in TRAIN_METRICS:
        value = metrics.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ClientFailure(f"client {pid}: its train reply's {key} is {str(value)[:40]!r}, not a number")


class FedAvgRound:
    """FedAvg of the clients' decoded updates, weighted by their training nodes; DP-FedAvg
    (clipped, noised, accounted) when the run has a DP accountant.

    Args:
        fed (FederationView): the run's clients (update decoding, the DP accountant).
        rs (RoundState): the stage's state (view, tracker, broadcast, control variates).
        stage (int): the stage.
        round_ (int): the round.
        label (str): names the round in messages.
    """

    def __init__(self, fed: FederationView, rs: RoundState, stage: int, round_: int, label: str) -> None:
        self.fed, self.rs, self.stage, self.round, self.label = fed, rs, stage, round_, label
        #: What :meth:`collect` read: summed validation and the bytes float32 would have taken.
        self.val: tuple[int, int, float] = (0, 0, 0.0)
        self.raw = 0
        self.extra_down = self.extra_raw = 0  # per client: records :meth:`decorate` added
        self.pids: list[int] = []
        self.metrics: list[dict[str, Any]] = []
        self.states: list[StateDict] = []
        self.validate_only: set[int] = set()

    def select(self) -> tuple[list[int], list[int]]:
        """The round's recipients: the clients that train, and those that only validate.

        A lazy stage's rounds go to the clients that hold training or validation nodes; a client
        with validation nodes only validates (:data:`~retexo_fl.protocol.VALIDATE_ONLY`) and sends
        no update. With ``fraction-train`` below 1 or ``clients-per-round`` set, only a sample of
        the clients with training nodes trains; of the others, those with validation nodes
        validate, and those without are sent nothing that round (sampled later, a client whose
        view is behind gets the round's state whole: see :class:`RoundLoop`). A client with
        neither is sent nothing until the stage's test: at one node per client, most clients.
        Every live client takes part in an eager run's rounds (its halo rows refresh every round), in a
        local run's and under DP-FedAvg, whose weights and noise are per participant.
        """
        fed, cfg = self.fed, self.fed.cfg
        if cfg.mode != "lazy" or fed.privacy is not None:
            return fed.pids, []
        train = [p for p in fed.pids if fed.trains(p)]
        self.validate_only = {p for p in fed.pids if not fed.trains(p) and fed.validates(p)}
        k = max(1, int(cfg.fraction_train * len(train))) if train else 0
        if cfg.clients_per_round:
            k = min(k, cfg.clients_per_round)
        if k < len(train):
            # Flower's convention: that fraction of the candidates, at least one, then at most
            # clients-per-round. The sample is a function of the seed, stage and round, so a
            # resumed server draws it again.
            rng = random.Random(derive_seed(cfg.seed, self.stage, self.round, SAMPLE_TAG))
            sampled = set(rng.sample(train, k))
            # An unsampled trainer with no validation nodes has nothing to do this round: at one
            # node per client, a self-training pass's thousand keep-up messages a round.
            self.validate_only |= {p for p in set(train) - sampled if fed.validates(p)}
            train = sorted(sampled)
        return train, sorted(self.validate_only)

    def configure(self) -> dict[str, Any]:
        """Config entries this aggregation adds to the round's train message."""
        return {}

    def decorate(self, requests: dict[int, Records]) -> None:
        """Add records to the round's train requests (and count their bytes per client)."""

    def collect(self, replies: dict[int, Records], down: int) -> Exchange | None:
        """Read the round's train replies (by partition id, live clients in order).

        Args:
            replies (dict[int, Records]): the replies.
            down (int): the bytes each client was sent (the broadcast and decorations).

        Raises:
            ClientFailure: a reply is malformed, naming its sender, before it touches the model.
        """
        self.pids = [p for p in replies if p not in self.validate_only]
        ordered = [replies[p] for p in self.pids]
        for pid, reply in replies.items():  # a malformed reply names its sender, before it is read
            check_train_metrics(pid, reply)
        self.metrics = [m[P.METRICS] for m in ordered]
        codec = UpdateCodec(self.fed.cfg.update_bits, self.fed.cfg.range_dtype)
        self.states, self.raw = self.fed.updates(
            self.pids, ordered, self.rs.view, codec, self.rs.tracker, down
        )
        for pid in self.validate_only & set(replies):  # the broadcast validators received
            self.rs.tracker.model_bytes += down
            self.raw += state_nbytes(self.rs.view)  # float32 would have sent it whole
            self.fed.count_client_bytes(self.stage, pid, model=down)
        self.val = sum_val([m[P.METRICS] for m in replies.values()])
        return None

    def resume(self, answers: dict[int, Records]) -> Exchange | None:
        """Go on with the answers to the last :class:`Exchange`; FedAvg asks for none."""
        raise AssertionError("FedAvg asks for no exchange")

    def weights(self) -> list[float]:
        return [m[P.NUM_EXAMPLES] for m in self.metrics]

    def aggregate(self) -> tuple[StateDict, float]:
        """The aggregate state (before the server optimizer) and the weighted training loss.

        Called only for a round the stage keeps (not one whose validation stopped it), so DP
        noise is drawn and accounted for applied rounds alone.
        """
        weights = self.weights()
        loss = sum(m[P.TRAIN_LOSS] * w for m, w in zip(self.metrics, weights, strict=True)) / sum(weights)
        rs = self.rs
        tag: tuple[int, ...] = (self.stage, self.round)
        cfg = self.fed.cfg
        if cfg.first_stage == "auto" and cfg.layer(self.stage) == 0 and self.fed.first_stage is not None:
            # Stage 0's second training draws noise of its own: the same noise on both trainings'
            # round would cancel in the difference of their broadcasts, which every client holds.
            trial = cfg.first_stage_lanes.index(self.fed.first_stage)
            tag = (*tag, trial) if trial else tag
        return aggregate_round(rs.state, rs.view, self.states, weights, self.fed.privacy, tag), loss


class ScaffoldRound(FedAvgRound):
    """FedAvg with SCAFFOLD's control variates: :math:`c` goes down with the model, and each
    client's :math:`c_i` and then :math:`c` advance from the decoded updates
    (:class:`~retexo_fl.coordinator.drift.ServerControl`)."""

    def decorate(self, requests: dict[int, Records]) -> None:
        control = self.rs.control
        assert control is not None
        for request in requests.values():
            request.update(control.records())
        self.extra_down, self.extra_raw = control.nbytes(), control.raw_nbytes()

    def select(self) -> tuple[list[int], list[int]]:
        """Every live client: each holds a control variate that advances every round."""
        return self.fed.pids, []

    def aggregate(self) -> tuple[StateDict, float]:
        control = self.rs.control
        assert control is not None
        steps = [int(m[P.LOCAL_STEPS]) for m in self.metrics]
        control.step(self.pids, self.rs.view, self.states, steps, self.weights())
        return super().aggregate()


class SecureRound(FedAvgRound):
    """Secure aggregation: the masked replies, then the unmasking as one more message phase;
    the server learns the sums only (:class:`~retexo_fl.coordinator.secure_aggregation.SecureAggregator`).
    """

    def __init__(self, fed: FederationView, rs: RoundState, stage: int, round_: int, label: str) -> None:
        super().__init__(fed, rs, stage, round_, label)
        assert fed.secure is not None
        self.secure = fed.secure
        self.members = self.secure.members(stage, fed.pids)  # the round's masking set
        self.pending: PendingUnmask | None = None
        self.result: tuple[StateDict, float] | None = None

    def select(self) -> tuple[list[int], list[int]]:
        """Every live client: the masking set is fixed per stage, and who holds training nodes
        is what the sums are not to reveal round by round."""
        return self.fed.pids, []

    def configure(self) -> dict[str, Any]:
        return self.secure.round_config(self.fed, self.stage, self.members)

    def collect(self, replies: dict[int, Records], down: int) -> Exchange | None:
        rs = self.rs
        self.pending = self.secure.collect(
            self.fed, self.stage, self.round, self.members, replies, rs.view, rs.tracker, down, self.label
        )
        return Exchange(P.UNMASK, self.pending.requests, f"{self.pending.label} unmasking")

    def resume(self, answers: dict[int, Records]) -> Exchange | None:
        assert self.pending is not None
        summed = self.secure.decode(self.fed, self.pending, answers, self.rs.state, self.rs.view)
        self.val, self.raw = summed.val, summed.raw
        self.result = (summed.aggregate, summed.train_loss)
        return None

    def aggregate(self) -> tuple[StateDict, float]:
        assert self.result is not None
        return self.result


def round_aggregation(
    fed: FederationView, rs: RoundState, stage: int, round_: int, label: str
) -> FedAvgRound:
    """The aggregation a round of this run uses: secure, SCAFFOLD or (DP-)FedAvg."""
    if fed.secure is not None:
        return SecureRound(fed, rs, stage, round_, label)
    if rs.control is not None:
        return ScaffoldRound(fed, rs, stage, round_, label)
    return FedAvgRound(fed, rs, stage, round_, label)
