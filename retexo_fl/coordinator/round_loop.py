"""The one round loop, shared by every mode.


A round: the server sends the model (whole, or as compressed deltas) with any relayed frames;
each client validates what it received (the previous round's result, so validation costs no
extra message), trains, and replies with its update; the round's aggregation
(:mod:`~retexo_fl.coordinator.round_aggregation`: FedAvg, DP-FedAvg, SCAFFOLD or secure aggregation)
reads the replies, asking the loop for any further message phase such as the unmasking, and the
server takes its optimizer step on the aggregate. Only this loop talks to the transport.
:class:`RoundLoop` is that body, written once: the lazy stage machine runs it once per stage,
:class:`~retexo_fl.coordinator.baseline_run.BaselineRun` once for a whole eager or local run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from retexo_fl import protocol as P
from retexo_fl.compress.boundary import ExchangeStats
from retexo_fl.compress.updates import ModelBroadcast
from retexo_fl.coordinator.aggregate import ServerOptimizer, state_nbytes
from retexo_fl.coordinator.checkpoint import RoundState
from retexo_fl.coordinator.drift import ServerControl
from retexo_fl.coordinator.federation import AGGREGATE, FederationView, Frames, total
from retexo_fl.coordinator.round_aggregation import round_aggregation
from retexo_fl.coordinator.selection import StageTracker
from retexo_fl.metrics import human_bytes
from retexo_fl.records import StateDict
from retexo_fl.seeding import derive_seed

#: Seed tag of the server's compressed broadcast.
BROADCAST_TAG = 0xBC
#: Seed tag of the control variate's compressed broadcast (drift correction).
CONTROL_TAG = 0xC7


def exchange_figures(stats: ExchangeStats) -> dict[str, Any]:
    """A stage's boundary figures for the summary: bytes before / after compression, widths."""
    d = stats.to_dict()
    return {
        "bytes_boundary_raw": d["bytes_raw"],
        "bytes_boundary_sent": d["bytes_sent"],
        "bit_histogram": d["bit_histogram"],
    }


def compression_totals(stages: list[dict[str, Any]]) -> dict[str, Any]:
    """Run-level compression figures from the per-stage ones."""
    hist: dict[str, int] = {}
    for s in stages:
        for b, n in s.get("bit_histogram", {}).items():
            hist[b] = hist.get(b, 0) + n
    return {
        "bytes_boundary_raw": sum(s.get("bytes_boundary_raw", 0) for s in stages),
        "bytes_model_raw": sum(s.get("bytes_model_raw", 0) for s in stages),
        "bit_histogram": hist,
    }


@dataclass
class StageResult:
    """What :meth:`RoundLoop.run` leaves.

    Args:
        best_state (StateDict): the best-validation state.
        figures (dict): the stage's figures (rounds run, best round, bytes, history, seconds).
        local_steps (list[list[int]]): per round, each client's local steps (refreshing runs).
        stats (ExchangeStats): the compression figures of frames sent during the rounds.
        undelivered (dict[int, Frames]): relayed frames for the clients the rounds left out (a
            lazy stage's clients with neither training nor validation nodes), to go with the
            stage's next message to them.
    """

    best_state: StateDict
    figures: dict[str, Any]
    local_steps: list[list[int]] = field(default_factory=list)
    stats: ExchangeStats = field(default_factory=ExchangeStats)
    undelivered: dict[int, Frames] = field(default_factory=dict)


class RoundLoop:
    """Federated rounds over a :class:`FederationView`: the only implementation of a round.

    Args:
        fed (FederationView): the clients, reached through a transport (its config and recorder are
            the loop's).
    """

    def __init__(self, fed: FederationView) -> None:
        self.fed = fed
        self.cfg = fed.cfg
        self.rec = fed.rec

    def start(self, state: StateDict, layer: int, tracker: StageTracker, broadcast_seed: int) -> RoundState:
        """Round 0 of a stage that starts from ``state`` (layer ``layer``'s server learning rate)."""
        cfg = self.cfg
        server = ServerOptimizer(
            cfg.per_stage("server_optimizer", layer), state, float(cfg.per_stage("server_lr", layer))
        )
        broadcast = ModelBroadcast(cfg.broadcast_bits, cfg.range_dtype, broadcast_seed)
        view = broadcast.prepare(state, 1)  # what the clients hold and train from
        control = None
        if cfg.drift_correction == "scaffold":
            lr = float(cfg.per_stage("lr", layer))
            seed = derive_seed(broadcast_seed, CONTROL_TAG)
            control = ServerControl(state, lr, cfg.broadcast_bits, cfg.range_dtype, seed)
        return RoundState(0, state, view, server, tracker, broadcast, control=control)

    def run(
        self,
        stage: int,
        rounds: int,
        rs: RoundState,
        deliveries: dict[int, Frames] | None,
        *,
        refresh: bool,
        label: str,
        on_round: Callable[[RoundState], None] | None = None,
    ) -> StageResult:
        """Rounds ``rs.round + 1 .. rounds`` of ``stage``.

        Args:
            stage (int): the stage (eager / local: 0); tags the messages, DP noise and figures.
            rounds (int): the stage's last round.
            rs (RoundState): where the stage stands (:meth:`start`, or a checkpoint's).
            deliveries (dict[int, Frames], optional): frames for the first round sent.
            refresh (bool): clients send frames every round, relayed with the next round (eager);
                else ``deliveries`` go with the first round only (lazy).
            label (str): names the rounds in messages and progress (``"stage 2"``, ``"eager"``).
            on_round (Callable[[RoundState], None], optional): called after each applied round
                (checkpoints). (default: :obj:`None`)
        """
        t0 = time.perf_counter() - rs.seconds
        result = StageResult({}, {})
        if not rs.finished:
            self._rounds(stage, rounds, rs, deliveries, refresh, label, result, t0, on_round)
            rs.finished, rs.seconds = True, time.perf_counter() - t0
            if on_round is not None:  # clients move on after this: a resume must not ask them again
                on_round(rs)
        result.figures = rs.tracker.figures(time.perf_counter() - t0)
        result.figures["bytes_model_raw"] = rs.model_raw
        # Rounds whose messages went out: one more than rounds_run where early stopping ended the
        # stage (that round's replies carried the validation that stopped it).
        result.figures["rounds_sent"] = rs.sent
        assert rs.tracker.best_state is not None  # every path above records a round
        result.best_state = rs.tracker.best_state
        result.undelivered = getattr(rs, "undelivered", None) or {}  # older checkpoints lack it
        return result

    def _rounds(
        self,
        stage: int,
        rounds: int,
        rs: RoundState,
        deliveries: dict[int, Frames] | None,
        refresh: bool,
        label: str,
        result: StageResult,
        t0: float,
        on_round: Callable[[RoundState], None] | None = None,
    ) -> None:
        """The rounds of :meth:`run` and the stage's last validation."""
        fed = self.fed
        pending = deliveries
        for r in range(rs.round + 1, rounds + 1):
            rs.sent = r
            aggregation = round_aggregation(fed, rs, stage, r, label)
            trainers, validators = aggregation.select()
            config = {P.STAGE: stage, P.ROUND: r, P.VALIDATE: r > 1, **self._keep(rs)}
            config.update(aggregation.configure())
            # A recipient the last round left out holds an older view than the broadcast's delta
            # starts from: it is sent the round's state whole (sampled trainers, clients-per-round).
            behind = self._behind(rs, r, trainers + validators)
            # A lazy stage's frames go with a client's first round in it: round 1's, or, for a
            # client sampled later, the frames held back for it (else they go with the test).
            held_back = {} if pending or refresh else (getattr(rs, "undelivered", None) or {})
            requests = {
                pid: fed.content(
                    rs.view,
                    pending.get(pid) if pending else held_back.get(pid),
                    model=None if pid in behind else rs.broadcast,
                    by_digest=True,
                    **config,
                    **({P.VALIDATE_ONLY: True} if pid in validators else {}),
                )
                for pid in sorted(trainers + validators)
            }
            rs.recipients = sorted(requests)
            fed.unheld = set(fed.pids) - set(requests)  # they will be sent the stage's state whole
            if (pending or held_back) and not refresh:
                # Frames for clients the rounds leave out go with the stage's test (see run).
                rs.undelivered = {p: f for p, f in (pending or held_back).items() if p not in requests}
            pending = None
            aggregation.decorate(requests)
            replies = fed.send(P.TRAIN, requests, f"{label} round {r}", stage)
            # The round's recipients, without any client lost in this round.
            ordered = {pid: replies[pid] for pid in fed.pids if pid in requests}
            # Counted before the stop check: a round whose replies end the stage was still sent.
            down = rs.broadcast.nbytes() + aggregation.extra_down
            exchange = aggregation.collect(ordered, down)
            if behind:  # sent the state whole, not the delta `down` counted
                extra = state_nbytes(rs.view) - rs.broadcast.nbytes()
                for pid in behind & set(ordered):
                    rs.tracker.model_bytes += extra
                    fed.count_client_bytes(stage, pid, model=extra)
            while exchange is not None:  # e.g. secure aggregation's unmasking
                answers = fed.send(exchange.kind, exchange.requests, exchange.phase, stage)
                exchange = aggregation.resume(answers)
            rs.model_raw += aggregation.raw + aggregation.extra_raw * len(ordered)
            if r > 1:  # each reply validated the state it received: the previous round's result
                self._record(rs, r - 1, aggregation.val, refresh)
                if rs.tracker.should_stop:
                    # A lazy stage is named as its progress lines name it ("pass 2 stage 0").
                    who = label if refresh else rs.tracker.name
                    self.rec.progress(f"{who}: {rs.tracker.stop_reason()}")
                    break
            if refresh:
                metrics = [m[P.METRICS] for m in ordered.values()]
                result.local_steps.append([int(m[P.LOCAL_STEPS]) for m in metrics])
                fed.add_stats(result.stats, list(ordered.values()))
                outgoing = {pid: m[P.PAYLOADS] for pid, m in ordered.items() if P.PAYLOADS in m}
                pending = fed.route(outgoing, P.HALO, stage) if outgoing else None
            aggregate, rs.train_loss = aggregation.aggregate()
            rs.state = rs.server.step(aggregate)
            rs.view = rs.broadcast.prepare(rs.state, r + 1)
            rs.round, rs.seconds = r, time.perf_counter() - t0
            if line := rs.tracker.progress_line(r, rounds):
                where = f" boundary so far {human_bytes(fed.bytes_boundary)}" if refresh else ""
                self.rec.progress(f"{label} {line}{where}" if refresh else line)
            if on_round is not None:
                on_round(rs)
        else:  # the last state still needs its validation (eager: with the last round's halo rows)
            # It goes as the next broadcast delta, so that clients hold it too (embed, test).
            extra = {P.ROUND: rounds + 1, **self._keep(rs)}
            asked = getattr(rs, "recipients", None)  # older checkpoints lack it: every client
            val = total(fed.evaluate(rs.view, "val", stage, pending, model=rs.broadcast, pids=asked, **extra))
            self._record(rs, rounds, (val.correct, val.count, val.loss_sum), refresh)

    @staticmethod
    def _behind(rs: RoundState, round_: int, recipients: list[int]) -> set[int]:
        """The round's recipients whose view is not the one the broadcast's delta is taken from:
        those the last round left out (none in a stage's first round, which is whole anyway,
        or without compressed broadcasts)."""
        last = getattr(rs, "recipients", None)  # older checkpoints lack it: every client
        if round_ <= 1 or last is None or rs.broadcast.frames is None:
            return set()
        return set(recipients) - set(last)

    def _keep(self, rs: RoundState) -> dict[str, bool]:
        """The :data:`~retexo_fl.protocol.KEEP` entry of the next message to clients (compressed
        broadcasts only: clients persist their views then), and clear it."""
        keep = getattr(rs, "keep", False) and self.cfg.broadcast_bits < 32  # older checkpoints lack it
        rs.keep = False
        return {P.KEEP: True} if keep else {}

    def _record(self, rs: RoundState, round_: int, val: tuple[int, int, float], refresh: bool) -> None:
        if refresh:  # bytes so far include this run's relayed rows
            rs.tracker.bytes_offset = self.fed.bytes_boundary
        correct, count, loss = val
        acc = correct / count if count else 0.0
        val_loss = loss / count if count else 0.0
        rs.tracker.record(round_, rs.view, acc, train_loss=rs.train_loss, val_loss=val_loss)
        # A new best accuracy: the view clients hold now (a falling loss resets patience, not the best).
        rs.keep = rs.tracker.best_round == round_
        self.rec.event(
            "round", stage=rs.tracker.stage, round=round_, train_loss=rs.train_loss, val_accuracy=acc
        )


def per_client(fed: FederationView, tests: dict[int, Any]) -> list[dict[str, Any]]:
    """The summary's per-client rows: test accuracy and the counts reported at setup; none under
    secure aggregation (the server holds the sum only)."""
    if AGGREGATE in tests:
        return []
    return [
        {"client": pid, "test_accuracy": r.accuracy, "test_count": r.count, **fed.counts[pid].counts}
        for pid, r in sorted(tests.items())
    ]
