"""A lazy run's checkpoint: typed, written after setup, every round and every exchange.

The stage machine builds a :class:`Checkpoint` and hands it to a :class:`CheckpointStore`;
``server/checkpoint.py`` keeps it in the run folder. In process there is nobody to come back,
so no store is given.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from retexo_fl.compress.boundary import ExchangeStats
from retexo_fl.compress.updates import ModelBroadcast
from retexo_fl.coordinator.aggregate import ServerOptimizer
from retexo_fl.coordinator.drift import ServerControl
from retexo_fl.coordinator.privacy import UpdatePrivacy
from retexo_fl.coordinator.selection import StageTracker
from retexo_fl.records import StateDict

Frames = dict[str, bytes]


@dataclass
class RoundState:
    """A stage's rounds so far: everything the round loop needs to go on after round ``round``.

    Args:
        round (int): the last round whose update was applied.
        state (StateDict): the server's model after it.
        view (StateDict): what the clients will train from next (the broadcast's view).
        server (ServerOptimizer): the server optimizer, with its moments.
        tracker (StageTracker): validation history and the best state so far.
        broadcast (ModelBroadcast): the compressed broadcast's state.
        train_loss (float): the last round's mean training loss.
        model_raw (int): model bytes float32 would have taken so far.
        seconds (float): the stage's wall time so far.
        control (ServerControl, optional): drift correction's control variates.
        sent (int): the last round whose messages went out (one more than ``round`` where early
            stopping ended the stage).
        finished (bool): the stage's rounds are over and its last validation recorded; a resumed
            server goes straight on to the exchange (clients may have moved on already).
        keep (bool): written by older code: the view clients hold is the stage's best so far
            (now derived from :attr:`holds` and the tracker's best round).
        recipients (list[int], optional): the clients the last round went to (a lazy stage's
            rounds leave out those with neither training nor validation nodes).
        undelivered (dict[int, dict[str, bytes]], optional): the stage's relayed frames for the
            clients its rounds left out, delivered with the stage's test.
        holds (dict[int, int], optional): client -> the round whose broadcast view it holds (it
            took part in that round); clients that hold no view of the stage are not in it.
        kept_by (list[int], optional): the clients told to keep the stage's best so far.
        validators (list[int], optional): the last round's clients that only validate (sent the
            round's message only when it validates: see ``validate-every``).
    """

    round: int
    state: StateDict
    view: StateDict
    server: ServerOptimizer
    tracker: StageTracker
    broadcast: ModelBroadcast
    train_loss: float = 0.0
    model_raw: int = 0
    seconds: float = 0.0
    control: ServerControl | None = None
    sent: int = 0
    finished: bool = False
    keep: bool = False
    recipients: list[int] | None = None
    undelivered: dict[int, dict[str, bytes]] | None = None
    holds: dict[int, int] | None = None
    kept_by: list[int] | None = None
    validators: list[int] | None = None


@dataclass
class Checkpoint:
    """Where a lazy run stands: enough to resume it with the same clients.

    Args:
        config (dict): the run configuration (``TrainConfig.to_dict``).
        run_key (int): the key clients file their node-local state under.
        pids (list[int]): the live clients.
        keys (dict[str, str]): the key directory (client id -> public key hex).
        counts (dict): what each client reported at setup.
        lost (list[dict]): clients lost so far.
        bytes_boundary (int): relayed bytes so far.
        model_bytes_done (int): model bytes of finished stages.
        stage (int): the stage to run (or go on with).
        boundary_before (int): relayed bytes before that stage's exchange.
        deliveries (dict, optional): frames to deliver with the stage's first round.
        degrees (dict, optional): degree frames not yet delivered (GCN, before stage 1).
        stages (list[dict]): finished stages' figures.
        round_state (RoundState, optional): the stage's rounds so far.
        exchange_stats (dict[int, ExchangeStats]): each exchange's compression figures.
        privacy (UpdatePrivacy, optional): the DP accountant so far.
        secure (SecureAggregator, optional): secure aggregation's figures so far.
        transport (Any): the transport's own accounting (:meth:`Transport.snapshot`).
        boundary_releases (int): boundary row releases so far (``boundary-noise`` accounting).
        missing_payloads (dict): payloads clients reported missing so far, by stage and pair.
        messages (dict): messages sent so far, by message type (before this run's resume).
        messages_per_stage (dict): the same by stage, then message type.
        training_nodes (dict[int, int]): training nodes of clients whose count self-training
            changed (a lazy stage's rounds go to the clients that train or validate).
        client_bytes (dict): bytes per stage and client so far (boundary sent, received, model).
        kept (StateDict, optional): the last finished stage's kept weights (after the last stage:
            what the test evaluates).
        pass_weights (dict[int, StateDict]): kept weights by layer of the stages that a later
            self-training pass starts from (``pass-init warm``).
        passes (list[dict]): each finished stage's kept model's validation and test accuracy
            (the run delivers the stage with the best validation; the name predates stage
            selection, when only each self-training pass's last stage was tested).
        first_stage_trials (list[dict]): ``first-stage auto``'s finished trainings of stage 0,
            each its ``variant``, kept ``state``, ``figures`` and ``undelivered`` frames.
        first_stage_lanes (dict[str, RoundState], optional): ... trained in parallel
            (``first-stage-schedule parallel``): each variant's rounds so far, until both end.
    """

    config: dict[str, Any]
    run_key: int
    pids: list[int]
    keys: dict[str, str]
    counts: dict[int, Any]
    lost: list[dict[str, Any]]
    bytes_boundary: int
    model_bytes_done: int
    stage: int = 0
    boundary_before: int = 0
    deliveries: dict[int, Frames] | None = None
    degrees: dict[int, Frames] | None = None
    stages: list[dict[str, Any]] = field(default_factory=list)
    round_state: RoundState | None = None
    exchange_stats: dict[int, ExchangeStats] = field(default_factory=dict)
    privacy: UpdatePrivacy | None = None
    secure: Any = None
    transport: Any = None
    boundary_releases: int = 0
    missing_payloads: dict[str, dict[str, int]] = field(default_factory=dict)
    messages: dict[str, int] = field(default_factory=dict)
    messages_per_stage: dict[str, dict[str, int]] = field(default_factory=dict)
    training_nodes: dict[int, int] = field(default_factory=dict)
    client_bytes: dict[int, dict[int, list[int]]] = field(default_factory=dict)
    kept: StateDict | None = None
    pass_weights: dict[int, StateDict] = field(default_factory=dict)
    passes: list[dict[str, Any]] = field(default_factory=list)
    first_stage_trials: list[dict[str, Any]] = field(default_factory=list)
    first_stage_lanes: dict[str, RoundState] | None = None


class CheckpointStore(Protocol):
    """Where checkpoints are kept (``server/checkpoint.py``: a file in the run folder)."""

    def save(self, checkpoint: Checkpoint) -> None:
        """Keep ``checkpoint``, replacing the last one atomically."""
        ...

    def load(self) -> Checkpoint:
        """The last checkpoint kept.

        Raises:
            ValueError: there is none, naming where it was looked for.
        """
        ...
