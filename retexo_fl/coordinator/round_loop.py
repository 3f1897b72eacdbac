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
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

from retexo_fl import protocol as P
from retexo_fl.compress.boundary import ExchangeStats
from retexo_fl.compress.updates import ModelBroadcast, UpdateCodec
from retexo_fl.coordinator.aggregate import ServerOptimizer
from retexo_fl.coordinator.checkpoint import RoundState
from retexo_fl.coordinator.drift import ServerControl
from retexo_fl.coordinator.federation import AGGREGATE, FederationView, Frames, total
from retexo_fl.coordinator.round_aggregation import round_aggregation
from retexo_fl.coordinator.selection import StageTracker
from retexo_fl.metrics import human_bytes
from retexo_fl.protocol import Records
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
            steps = self._round_steps(stage, rounds, rs, deliveries, refresh, label, result, t0, on_round)
            try:  # every round's train message out, its replies back in
                requests, phase = next(steps)
                while True:
                    requests, phase = steps.send(self.fed.send(P.TRAIN, requests, phase, stage))
            except StopIteration:
                pass
            rs.finished, rs.seconds = True, time.perf_counter() - t0
            if on_round is not None:  # clients move on after this: a resume must not ask them again
                on_round(rs)
        return self._finish(rs, result)

    def run_lanes(
        self,
        stage: int,
        rounds: int | dict[str, int],
        lanes: dict[str, RoundState],
        label: str,
        on_round: Callable[[], None] | None = None,
        before: Callable[[str], None] | None = None,
    ) -> dict[str, StageResult]:
        """Rounds ``rs.round + 1 .. rounds`` of a lazy ``stage`` trained as several models at once
        (``first-stage auto``'s variants of stage 0): each round's messages to a client go as one
        message of several lanes (:func:`~retexo_fl.protocol.join_lanes`), so the stage takes the
        longest lane's rounds, not their sum. Each lane runs exactly the rounds :meth:`run` would
        give it alone (its requests, aggregation, early stopping, validation), and names its
        variant (:attr:`FederationView.first_stage`) in its requests and figures.

        Args:
            stage (int): the stage.
            rounds (int or dict[str, int]): the stage's last round, or each lane's by variant.
            lanes (dict[str, RoundState]): by variant, in the order each round's replies are
                read: where each lane stands (:meth:`start`, or a checkpoint's).
            label (str): names the rounds in messages and progress.
            on_round (Callable[[], None], optional): called after each round a lane applied and
                once each lane is finished (checkpoints: the lanes' states). (default: :obj:`None`)
            before (Callable[[str], None], optional): called with a lane's variant before it reads
                its replies (a raced lane's pace, read off the lane before it). (default: :obj:`None`)

        Returns:
            dict[str, StageResult]: by variant.
        """
        fed = self.fed
        start = time.perf_counter()
        results = {v: StageResult({}, {}) for v in lanes}
        t0 = {v: start - rs.seconds for v, rs in lanes.items()}
        steps: dict[str, Generator[tuple[dict[int, Records], str], dict[int, Records], None]] = {}
        waiting: dict[str, tuple[dict[int, Records], str]] = {}

        def advance(variant: str, replies: dict[int, Records] | None) -> None:
            fed.first_stage = variant
            try:
                gen = steps[variant]
                waiting[variant] = next(gen) if replies is None else gen.send(replies)
            except StopIteration:
                waiting.pop(variant, None)
                rs = lanes[variant]
                rs.finished, rs.seconds = True, time.perf_counter() - t0[variant]
                if on_round is not None:  # clients move on after this: a resume must not ask them again
                    on_round()

        # Saved after each lane's every applied round, as run() saves: a lane's round applied
        # and the next message of another lane (its last validation, say) sent before a save
        # would have a resumed server send clients a round they have moved past.
        saved = (lambda _rs: on_round()) if on_round is not None else None

        for variant, rs in lanes.items():
            if not rs.finished:
                last = rounds[variant] if isinstance(rounds, dict) else rounds
                steps[variant] = self._round_steps(
                    stage, last, rs, None, False, label, results[variant], t0[variant], saved
                )
                advance(variant, None)
        while waiting:
            joined: dict[int, dict[str, Records]] = {}
            for variant, (requests, _) in waiting.items():
                for pid, request in requests.items():
                    joined.setdefault(pid, {})[variant] = request
            phase = next(iter(waiting.values()))[1]
            replies = fed.send(P.TRAIN, {pid: P.join_lanes(by) for pid, by in joined.items()}, phase, stage)
            split: dict[int, dict[str, Records]] = {}
            for pid, reply in replies.items():
                try:  # filled-in payloads were reported once for the message (FederationView.send_to)
                    answers = {k: v for k, v in reply.items() if k != P.MISSING}
                    split[pid] = P.split_lane_replies(answers, f"client {pid}")
                    missing = set(joined[pid]) - set(split[pid])
                    if missing:
                        raise ValueError(
                            f"client {pid}: its reply answers no lane {', '.join(sorted(missing))}"
                        )
                except ValueError as exc:  # one client's bad reply is its own failure, not the run's
                    split.pop(pid, None)
                    fed.members.lose(pid, phase, str(exc))
            for variant in list(waiting):
                asked = waiting[variant][0]
                if before is not None:
                    before(variant)
                live = {pid: split[pid][variant] for pid in fed.pids if pid in asked and pid in split}
                advance(variant, live)
        return {v: self._finish(rs, results[v]) for v, rs in lanes.items()}

    def _finish(self, rs: RoundState, result: StageResult) -> StageResult:
        """A finished stage's result (:meth:`run`): its figures, best state and held-back frames."""
        # Clients that hold no copy of the stage's best state are sent it whole with the stage's
        # next message (test or embed); the others are named its digest. From the checkpointed
        # round state, so a resumed server asks as the first would have.
        self.note_unheld(rs)
        result.figures = rs.tracker.figures(rs.seconds)
        result.figures["bytes_model_raw"] = rs.model_raw
        # Rounds whose messages went out: one more than rounds_run where early stopping ended the
        # stage (that round's replies carried the validation that stopped it).
        result.figures["rounds_sent"] = rs.sent
        assert rs.tracker.best_state is not None  # every path above records a round
        result.best_state = rs.tracker.best_state
        result.undelivered = getattr(rs, "undelivered", None) or {}  # older checkpoints lack it
        return result

    def _round_steps(
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
    ) -> Generator[tuple[dict[int, Records], str], dict[int, Records], None]:
        """The rounds of :meth:`run` and the stage's last validation, as steps: each round yields
        its train requests (by partition id) and phase, and is sent the replies (by partition
        id, the live recipients' only). :meth:`run` sends them one round at a time,
        :meth:`run_lanes` several stages' rounds as one message a client."""
        fed = self.fed
        pending = deliveries
        every = int(self.cfg.validate_every)
        if rs.holds is None:  # a checkpoint of older code: the last round's recipients hold its view
            rs.holds = {pid: rs.round for pid in (rs.recipients or [])} if rs.round else {}
            rs.kept_by = []
        for r in range(rs.round + 1, rounds + 1):
            rs.sent = r
            aggregation = round_aggregation(fed, rs, stage, r, label)
            trainers, validators = aggregation.select()
            # A round validates the state it brings (the last round's result): from round 2, every
            # `validate-every`-th. Clients that only validate are sent those rounds alone.
            validating = r > 1 and (r - 1) % every == 0
            rs.validators = validators
            asked = sorted(trainers + (validators if validating else []))
            config = {P.STAGE: stage, P.ROUND: r, P.VALIDATE: validating}
            config.update(aggregation.configure())
            # A recipient that missed rounds is sent the deltas it missed, or the state whole
            # when it holds no view of the stage or those deltas would cost more.
            plans, down_for = self._model_plans(rs, r, asked)
            # A lazy stage's frames go with a client's first round in it: round 1's, or, for a
            # client sampled later, the frames held back for it (else they go with the test).
            held_back = {} if pending or refresh else (getattr(rs, "undelivered", None) or {})
            requests = {
                pid: fed.content(
                    **{"state": rs.view, "model": rs.broadcast, **plans.get(pid, {})},
                    payloads=pending.get(pid) if pending else held_back.get(pid),
                    by_digest=True,
                    **config,
                    **({P.VALIDATE_ONLY: True} if pid in validators else {}),
                )
                for pid in asked
            }
            rs.recipients = asked
            if (pending or held_back) and not refresh:
                # Frames for clients the rounds leave out go with the stage's test (see run).
                rs.undelivered = {p: f for p, f in (pending or held_back).items() if p not in requests}
            pending = None
            aggregation.decorate(requests)
            replies = yield requests, f"{label} round {r}"
            # The round's recipients, without any client lost in this round.
            ordered = {pid: replies[pid] for pid in fed.pids if pid in requests}
            # Counted before the stop check: a round whose replies end the stage was still sent.
            down = rs.broadcast.nbytes() + aggregation.extra_down
            exchange = aggregation.collect(ordered, down)
            for pid in set(down_for) & set(ordered):  # sent the state whole, or deltas it missed
                extra = down_for[pid] - rs.broadcast.nbytes()
                rs.tracker.model_bytes += extra
                fed.count_client_bytes(stage, pid, model=extra)
            while exchange is not None:  # e.g. secure aggregation's unmasking
                answers = fed.send(exchange.kind, exchange.requests, exchange.phase, stage)
                exchange = aggregation.resume(answers)
            rs.model_raw += aggregation.raw + aggregation.extra_raw * len(ordered)
            self._received(rs, r, list(ordered), plans)
            if validating:  # each reply validated the state it received: the previous round's result
                self._record(rs, r - 1, aggregation.val, refresh)
                self._say(rs, r - 1, rounds, label, refresh, last=rs.tracker.should_stop)
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
            if on_round is not None:
                on_round(rs)
        else:  # the last state still needs its validation (eager: with the last round's halo rows)
            # It goes as the next broadcast delta, so that clients hold it too (embed, test): to
            # the last round's recipients and the stage's validators, who may have missed rounds.
            last = fed.pids if rs.recipients is None else rs.recipients
            asked = sorted(set(last) | set(rs.validators or []))
            plans, _ = self._model_plans(rs, rounds + 1, asked)
            if not refresh:  # a validator no round reached (rounds <= validate-every) lacks the stage's rows
                held_back = getattr(rs, "undelivered", None) or {}
                pending = {p: held_back[p] for p in asked if p in held_back} or None
            ask = {"model": rs.broadcast, "pids": asked, "plans": plans, P.ROUND: rounds + 1}
            val = total(fed.evaluate(rs.view, "val", stage, pending, **ask))
            live = set(fed.pids)  # without any client lost in the validation
            self._received(rs, rounds + 1, [p for p in asked if p in live], plans)
            if pending and not refresh:
                rs.undelivered = {p: f for p, f in rs.undelivered.items() if p not in pending}
            self._record(rs, rounds, (val.correct, val.count, val.loss_sum), refresh)
            self._say(rs, rounds, rounds, label, refresh, last=True)

    def note_unheld(self, rs: RoundState) -> None:
        """Name the clients that hold no copy of the best state of the stage ``rs`` ended
        (:attr:`FederationView.unheld`): its next message sends it to them whole."""
        if rs.holds is not None:
            self.fed.unheld = set(self.fed.pids) - self._holding_best(rs) - set(rs.kept_by or [])

    def _say(self, rs: RoundState, round_: int, rounds: int, label: str, refresh: bool, last: bool) -> None:
        """The progress line of round ``round_``'s result, once its validation is recorded (in
        the next round's replies, or the stage's last validation): about five a stage, and the
        stage's last."""
        line = rs.tracker.progress_line(round_, rounds, last=last)
        if line:
            where = f" boundary so far {human_bytes(self.fed.bytes_boundary)}" if refresh else ""
            self.rec.progress(f"{label} {line}{where}" if refresh else line)

    def _model_plans(
        self, rs: RoundState, round_: int, recipients: list[int]
    ) -> tuple[dict[int, dict[str, Any]], dict[int, int]]:
        """How round ``round_``'s model goes to each recipient that does not take the broadcast
        as is (:meth:`FederationView.content` arguments), and the bytes those are sent.

        The round's delta applies to the previous round's view. A client that missed rounds
        (sampled out, or a validator asked every few rounds) is sent the deltas it missed first,
        oldest first (:meth:`~retexo_fl.compress.updates.ModelBroadcast.chain`), so that it holds
        the others' view for the bytes they were sent; a client holding no view of the stage, or
        one the kept deltas no longer reach, is sent the state whole. A recipient whose view is
        the stage's best so far is told to keep it (:data:`~retexo_fl.protocol.KEEP`).
        """
        b, holds = rs.broadcast, rs.holds or {}
        keep_for = self._untold(rs)
        plans: dict[int, dict[str, Any]] = {}
        down: dict[int, int] = {}
        missed: dict[int | None, tuple[Frames, int] | None] = {}  # by round held: shared records
        for pid in recipients:
            plan: dict[str, Any] = {P.KEEP: True} if pid in keep_for else {}
            held = holds.get(pid)
            if round_ > 1 and b.frames is not None and held != round_ - 1:
                if held not in missed:
                    steps = b.chain(held) if held is not None else None
                    ok = steps is not None and len(steps) - 1 <= P.MAX_CHAIN
                    missed[held] = (
                        (P.chain_record(steps[:-1]), sum(UpdateCodec.nbytes(f) for f in steps))
                        if ok and steps
                        else None
                    )
                chain = missed[held]
                if chain is None:
                    plan.update(state=rs.view, model=None)
                    down[pid] = b.whole_nbytes()
                else:
                    plan["missed"], down[pid] = chain
            if plan:
                plans[pid] = plan
        return plans, down

    @staticmethod
    def _received(rs: RoundState, round_: int, pids: list[int], plans: dict[int, dict[str, Any]]) -> None:
        """Clients ``pids`` answered round ``round_``'s message: they hold its view, and those told
        to keep the best view kept it."""
        holds = rs.holds if rs.holds is not None else {}
        for pid in pids:
            holds[pid] = round_
        rs.holds = holds
        told = {pid for pid in pids if plans.get(pid, {}).get(P.KEEP)}
        # A state sent whole without KEEP is taken afresh: what its client kept is gone.
        afresh = {pid for pid in pids if "state" in plans.get(pid, {}) and pid not in told}
        if told or afresh:
            rs.kept_by = sorted((set(rs.kept_by or []) | told) - afresh)

    def _untold(self, rs: RoundState) -> set[int]:
        """The clients whose view is the stage's best so far and that no message reached since:
        their next one tells them to keep it (compressed broadcasts only: clients persist their
        views then). A client told moved on to a later round's view."""
        if self.cfg.broadcast_bits >= 32 or not rs.tracker.history:
            return set()
        return self._holding_best(rs)

    @staticmethod
    def _holding_best(rs: RoundState) -> set[int]:
        """The clients whose view is the stage's best so far (they took part in the round whose
        message brought it)."""
        best = rs.tracker.best_round + 1
        return {p for p, h in (rs.holds or {}).items() if h == best}

    def _record(self, rs: RoundState, round_: int, val: tuple[int, int, float], refresh: bool) -> None:
        if refresh:  # bytes so far include this run's relayed rows
            rs.tracker.bytes_offset = self.fed.bytes_boundary
        correct, count, loss = val
        acc = correct / count if count else 0.0
        val_loss = loss / count if count else 0.0
        rs.tracker.record(round_, rs.view, acc, train_loss=rs.train_loss, val_loss=val_loss)
        # A new best accuracy: the view its validators hold now (a falling loss resets patience,
        # not the best); nobody kept it yet (:meth:`_untold` says who is to).
        if rs.tracker.best_round == round_:
            rs.kept_by = []
        # Under first-stage auto a layer-0 stage is trained twice: its rows name the variant.
        variant = self.fed.first_stage if self.cfg.layer(rs.tracker.stage) == 0 else None
        self.rec.event(
            "round",
            stage=rs.tracker.stage,
            round=round_,
            train_loss=rs.train_loss,
            val_accuracy=acc,
            **({"first_stage": variant} if variant is not None else {}),
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
