"""The lazy (RETEXO) stage machine: setup, each stage's rounds, embed and relay, passes, test.

One implementation for every engine: it reaches clients through a
:class:`~retexo_fl.coordinator.transport.Transport` (in process, or Flower's ``Grid``), runs each
stage's rounds with the shared :class:`~retexo_fl.coordinator.round_loop.RoundLoop`, relays the sealed
boundary rows it never opens, and, given a :class:`~retexo_fl.coordinator.checkpoint.CheckpointStore`,
checkpoints after setup, every round and every exchange so a run can be resumed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from retexo_fl import protocol as P
from retexo_fl.compress.boundary import ExchangeStats
from retexo_fl.config import FIRST_STAGE_VARIANTS, SPRINT, TrainConfig
from retexo_fl.coordinator.checkpoint import Checkpoint, CheckpointStore, RoundState
from retexo_fl.coordinator.federation import AGGREGATE, FederationView, Frames, total
from retexo_fl.coordinator.round_loop import (
    BROADCAST_TAG,
    RoundLoop,
    compression_totals,
    exchange_figures,
    per_client,
)
from retexo_fl.coordinator.selection import StageTracker, keep_best_stage, pace_by_round, same_clients
from retexo_fl.coordinator.transport import Transport
from retexo_fl.metrics import RunRecorder, human_bytes
from retexo_fl.models.factory import build_stage_model, stage_input_dim
from retexo_fl.records import EvalResult, StateDict
from retexo_fl.seeding import derive_seed
from retexo_fl.summary import RunSummary


class LazyStageMachine:
    """Drives one lazy run; the server routes payloads it never decodes.

    Args:
        transport (Transport): how clients are reached.
        cfg (TrainConfig): the run configuration.
        rec (RunRecorder): where events and progress go.
        store (CheckpointStore, optional): where checkpoints go (none: no checkpoints). (default: :obj:`None`)
        on_stage (Callable[[int, StateDict], None], optional): sees each stage's kept
            (best-validation) weights. (default: :obj:`None`)
    """

    def __init__(
        self,
        transport: Transport,
        cfg: TrainConfig,
        rec: RunRecorder,
        store: CheckpointStore | None = None,
        on_stage: Callable[[int, StateDict], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.rec = rec
        self.store = store
        self.on_stage = on_stage
        self.fed = FederationView(transport, cfg, rec)
        self.loop = RoundLoop(self.fed)
        self.exchange_stats: dict[int, ExchangeStats] = {}
        self.model_bytes_done = 0  # model bytes of finished stages
        # training nodes after the last relabelling (self-training); None: not reported (secure aggregation)
        self.relabeled: int | None = 0
        self.teacher: int | None = None  # the stage the clients label from (self-training)

    def run(self, resume: bool = False) -> RunSummary:
        """Run every stage (or, with ``resume``, go on from the store's checkpoint); returns the summary."""
        cfg, fed = self.cfg, self.fed
        t0 = time.perf_counter()
        if resume:
            ck = self._resume()
        else:
            degrees = fed.setup()
            ck = Checkpoint(
                cfg.to_dict(), fed.run_key, fed.pids, fed.keys, fed.counts, fed.members.lost, 0, 0
            )
            ck.boundary_before, ck.degrees = fed.bytes_boundary, degrees
            self._save(ck)
        last = cfg.total_stages - 1
        state: StateDict = ck.kept or {}  # resumed after the last stage: the test is all that is left
        auto = cfg.first_stage == "auto"
        if auto and ck.stage > 0:  # resumed past stage 0: its messages name the variant kept
            fed.first_stage = self._kept_first_stage(ck)
        for stage in range(ck.stage, last + 1):
            if stage == 0 and auto:
                # Clients hold the first training's kept state through the second, so the
                # stage's test and embed name either by digest (one a client lacks goes whole).
                state, figures, undelivered = self._train_first_stage(ck)
            else:
                state, figures, undelivered = self._train_stage(stage, ck)
            if cfg.pass_init == "warm" and stage + cfg.stages <= last:
                ck.pass_weights[cfg.layer(stage)] = state  # the next pass's same layer starts here
            self.model_bytes_done += figures["bytes_model"]
            deliveries = None
            # The stage's model is tested while clients still hold its stage inputs; the run
            # delivers the stage with the best validation accuracy (see _kept). Before a stage
            # the run goes on from, the test rides on the embed (one message a client, not two:
            # at one node per client a test message each for a thousand clients). Under secure
            # aggregation it is its own message: its counts are masked over every live client.
            untested = all(r["stage"] != stage for r in chain_rows(ck.passes))
            test_with_embed = untested and stage < last and self._tests_with_embed()
            if untested and not test_with_embed:
                # Saved at once: a server resumed after the clients embedded or relabelled must
                # not test again, as they have moved on.
                ck.passes.append(self._stage_result(state, stage, figures, undelivered))
                self._save(ck)
            if stage < last:
                # Clients embed, or after a pass's last stage label their own nodes (nothing to
                # relay); those the test did not reach are sent the stage's frames they lack now.
                rows = [r for r in chain_rows(ck.passes) if r["stage"] == stage]  # none: the embed tests
                tested = set(rows[0].get("members", fed.pids)) if rows else set()
                late = {pid: f for pid, f in undelivered.items() if pid not in tested}
                teacher = self._names_teacher(ck, stage, figures)
                if teacher:
                    self.teacher = stage
                deliveries, tests = self._embed(state, stage, late, test=test_with_embed, teacher=teacher)
                if test_with_embed:
                    ck.passes.append(self._result_row(stage, figures, tests))
                if cfg.ends_pass(stage):
                    deliveries = None
                    self.rec.event("relabel", stage=stage, train_nodes=self.relabeled, teacher=self.teacher)
                    pass_ = stage // cfg.stages + 1
                    source = "" if self.teacher is None else f", labels from {cfg.stage_name(self.teacher)}"
                    counted = self.relabeled
                    nodes = "training nodes not reported" if counted is None else f"{counted} training nodes"
                    self.rec.progress(f"self-training pass {pass_}: {nodes}{source}")
                if stage == 0 and deliveries is not None:  # degrees go with the first conv stage's rows
                    for pid, frames in (ck.degrees or {}).items():
                        if pid in deliveries:  # else lost since setup
                            deliveries[pid].update(frames)
                    ck.degrees = None
            figures["bytes_boundary"] = fed.bytes_boundary - ck.boundary_before
            if stage in self.exchange_stats:
                figures.update(exchange_figures(self.exchange_stats[stage]))
            ck.stages.append(figures)
            self.rec.progress(
                f"{cfg.stage_name(stage)} done: best val {figures['val_accuracy']:.4f} at round "
                f"{figures['best_round']}, boundary so far {human_bytes(fed.bytes_boundary)}"
            )
            ck.stage, ck.boundary_before, ck.deliveries, ck.round_state, ck.kept = (
                stage + 1,
                fed.bytes_boundary,
                deliveries,
                None,
                state,
            )
            self._save(ck)
        stages = ck.stages
        if all(
            r["stage"] != last for r in chain_rows(ck.passes)
        ):  # older code's checkpoint, resumed at the end
            ck.passes.append(self._stage_result(state, last, stages[-1]))
        kept, selection = self._kept(ck)
        bytes_model = sum(s["bytes_model"] for s in stages)
        summary = RunSummary(
            mode="lazy",
            engine=fed.transport.engine,
            test_accuracy=kept["test_accuracy"],
            val_accuracy=kept["val_accuracy"],
            bytes_total=fed.bytes_boundary + bytes_model + fed.bytes_secure,
            bytes_boundary=fed.bytes_boundary,
            bytes_model=bytes_model,
            stages=stages,
            wall_seconds=time.perf_counter() - t0,
            config=cfg.to_dict(),
            clients=kept["clients"],
            **compression_totals(stages),
            **selection,
            resumed=resume,
            federation=fed.summary(),
        )
        if not fed.has_test_nodes():  # the engines computed 0 over no node
            summary.without_test()
        return summary

    def _train_stage(
        self, stage: int, ck: Checkpoint, bytes_before: int = 0, pace: list[float] | None = None
    ) -> tuple[StateDict, dict[str, Any], dict[int, Frames]]:
        """The stage's rounds, from its initial weights or from the checkpoint's round: the kept
        state, the stage's figures, and the relayed frames of clients its rounds left out.

        ``bytes_before``: model bytes this stage already sent (``first-stage auto``'s first
        training), counted before its rounds' in the history. ``pace``: the first training's
        validation by round, which the second races (``first-stage-race``)."""
        cfg = self.cfg
        layer = cfg.layer(stage)
        rs = ck.round_state
        if rs is None:
            rs = self._start_stage(stage, ck, bytes_before, pace)

        def after_round(rs: RoundState) -> None:
            ck.deliveries, ck.round_state = None, rs  # deliveries went with round 1
            self._save(ck)

        rounds = int(cfg.per_stage("rounds", layer))
        result = self.loop.run(
            stage, rounds, rs, ck.deliveries, refresh=False, label=f"stage {stage}", on_round=after_round
        )
        if self.on_stage is not None and not (stage == 0 and cfg.first_stage == "auto"):
            self.on_stage(stage, result.best_state)
        return result.best_state, result.figures, result.undelivered

    def _start_stage(
        self, stage: int, ck: Checkpoint, bytes_before: int = 0, pace: list[float] | None = None
    ) -> RoundState:
        """Round 0 of ``stage`` (a layer-0 stage as :attr:`FederationView.first_stage`'s variant):
        its initial weights, server optimizer and early stopping; ``bytes_before`` and ``pace``
        as for :meth:`_train_stage`."""
        cfg, fed = self.cfg, self.fed
        layer = cfg.layer(stage)
        ref = fed.reference
        in_dim = stage_input_dim(cfg, stage, ref.num_features, ref.num_classes)
        warm = stage >= cfg.stages and cfg.pass_init == "warm"
        if warm:
            state = {k: v.detach().clone() for k, v in ck.pass_weights[layer].items()}
        else:
            variant = fed.first_stage if layer == 0 else None
            model = build_stage_model(cfg, stage, in_dim, ref.num_classes, variant)
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        name = cfg.stage_name(stage)
        min_rounds = cfg.warm_min_rounds if warm else cfg.min_rounds
        tracker = StageTracker(stage, cfg.patience, min_rounds, cfg.stop_metric, name)
        tracker.bytes_offset = fed.bytes_boundary + self.model_bytes_done + bytes_before
        if pace is not None:
            tracker.race(pace, cfg.first_stage_race, cfg.first_stage_race_margin)
        return self.loop.start(state, layer, tracker, derive_seed(cfg.seed, stage, BROADCAST_TAG))

    def _train_lanes(self, ck: Checkpoint) -> None:
        """``first-stage auto`` in parallel: stage 0 trained as every variant in the same rounds
        (:meth:`RoundLoop.run_lanes`), each training exactly as :meth:`_train_first_stage` would
        train it in turn, the second racing the first round by round, and the sprint
        (``first-stage-sprint``: :data:`~retexo_fl.config.SPRINT`) beside them for its own
        rounds; the finished trainings go to ``ck.first_stage_trials`` in order. Resumable: the
        lanes' rounds are checkpointed after every round."""
        cfg, fed = self.cfg, self.fed
        lanes = ck.first_stage_lanes
        if lanes is None:
            lanes = {}
            for i, variant in enumerate(cfg.first_stage_lanes):
                fed.first_stage = variant
                raced = 0 < i < len(cfg.first_stage_order)  # the second variant races the first
                lanes[variant] = rs = self._start_stage(0, ck, pace=[] if raced else None)
                rs.tracker.name = f"{rs.tracker.name} as {variant}"  # progress lines tell them apart
            ck.first_stage_lanes = lanes
            self._save(ck)
        order = list(lanes)  # as the lanes began (a resumed run's config is its checkpoint's)
        racer = lanes[order[1]].tracker

        def before(variant: str) -> None:
            if variant == order[1]:  # the second's pace: the first's validation so far
                racer.pace = pace_by_round(lanes[order[0]].tracker.history)
            # A history row's bytes are the run's so far: the other lanes' model bytes too.
            others = sum(rs.tracker.model_bytes for v, rs in lanes.items() if v != variant)
            lanes[variant].tracker.bytes_offset = fed.bytes_boundary + self.model_bytes_done + others

        most = int(cfg.per_stage("rounds", 0))
        rounds = {v: min(most, cfg.first_stage_sprint) if v == SPRINT else most for v in order}
        results = self.loop.run_lanes(
            0, rounds, lanes, "stage 0", on_round=lambda: self._save(ck), before=before
        )
        for variant in order:
            result = results[variant]
            figures = result.figures
            best = f"best val {figures['val_accuracy']:.4f} at round {figures['best_round']}"
            self.rec.progress(f"stage 0 as {variant}: {best}")
            self.loop.note_unheld(lanes[variant])
            ck.first_stage_trials.append(
                {
                    "variant": variant,
                    "state": result.best_state,
                    "figures": figures,
                    "undelivered": result.undelivered,
                    "unheld": sorted(fed.unheld),
                    "parallel": True,
                }
            )
        ck.first_stage_lanes = None
        self._save(ck)

    def _train_first_stage(self, ck: Checkpoint) -> tuple[StateDict, dict[str, Any], dict[int, Frames]]:
        """``first-stage auto``: stage 0 trained as each variant in turn (``first-stage-first``:
        the local layer, then the MLP, by default), and the one with the better validation kept
        (accuracy, then loss, as stages are kept: :func:`keep_best_stage`); every later message
        names it, so a self-training pass's stage 0 is built the same way. With
        ``first-stage-race``, the second training races the first: it stops once, that many
        rounds in, it validates more than ``first-stage-race-margin`` below the best the first
        reached in as many rounds.

        Neither reads another client's rows, so the choice costs no boundary traffic: it costs
        the second training's rounds and model bytes, which the stage's figures count
        (``bytes_model`` is both trainings' sum; ``rounds_run`` and ``rounds_sent`` are their sum
        one after the other, the longer one's in parallel, ``first_stage_schedule``, where both
        share their rounds: :meth:`_train_lanes`; ``history`` is both trainings' rows, each
        naming its ``first_stage``; ``first_stage_trials`` gives each training's own figures).
        Resumable: a finished training is in the checkpoint.
        """
        trials = ck.first_stage_trials
        if self.cfg.first_stage_schedule == "parallel" and not trials and ck.round_state is None:
            self._train_lanes(ck)  # (a checkpoint mid-training of the other schedule goes on as it was)
        for variant in self.cfg.first_stage_order[len(trials) :]:
            self.fed.first_stage = variant
            before = sum(int(t["figures"]["bytes_model"]) for t in trials)
            # The second races the first: stopped once it trails what the first had by then.
            pace = pace_by_round(trials[0]["figures"]["history"]) if trials else None
            state, figures, undelivered = self._train_stage(0, ck, bytes_before=before, pace=pace)
            best = f"best val {figures['val_accuracy']:.4f} at round {figures['best_round']}"
            self.rec.progress(f"stage 0 as {variant}: {best}")
            trials.append(
                {
                    "variant": variant,
                    "state": state,
                    "figures": figures,
                    "undelivered": undelivered,
                    "unheld": sorted(self.fed.unheld),
                }
            )
            ck.round_state = None  # the next training starts from its own initial weights
            self._save(ck)
        chosen = self._kept_first_stage(ck)
        self.fed.first_stage = chosen
        kept = next(t for t in trials if t["variant"] == chosen)
        # Who holds no copy of the kept training's best (a checkpoint of older code: as left).
        if "unheld" in kept:
            self.fed.unheld = set(kept["unheld"])
        each = [{"variant": t["variant"], **_trial_figures(t["figures"])} for t in trials]
        self.rec.event("first-stage", kept=chosen, trials=each)
        self.rec.progress(f"stage 0: kept the {chosen} variant (first-stage auto)")
        self._test_sprint(ck, kept)
        figures = dict(kept["figures"])
        # In parallel a round carries both trainings: the stage's rounds are the longer one's.
        per_round = max if all(t.get("parallel") for t in trials) else sum
        for key in ("rounds_run", "rounds_sent", "seconds"):
            figures[key] = per_round(t["figures"].get(key, 0) for t in trials)
        for key in ("bytes_model", "bytes_model_raw"):
            figures[key] = sum(t["figures"].get(key, 0) for t in trials)
        figures["history"] = [
            {**row, "first_stage": t["variant"]} for t in trials for row in t["figures"]["history"]
        ]
        figures["first_stage"] = chosen
        figures["first_stage_trials"] = each
        figures["first_stage_schedule"] = "parallel" if per_round is max else "sequential"
        if self.on_stage is not None:
            self.on_stage(0, kept["state"])
        return kept["state"], figures, kept["undelivered"]

    def _test_sprint(self, ck: Checkpoint, kept: dict[str, Any]) -> None:
        """Test the sprint's best model (``first-stage-sprint``) where it validates above the stage
        0 ``kept`` trial (:func:`keep_best_stage`), so that it is a candidate for the delivered
        model (a row of ``ck.passes`` naming its ``variant``); a sprint that does not cannot be
        kept, and costs no message. Once: a resumed server that tested it does not again."""
        sprint = next((t for t in ck.first_stage_trials if t["variant"] == SPRINT), None)
        if sprint is None or any(r.get("variant") == SPRINT for r in ck.passes):
            return
        if keep_best_stage([sprint["figures"], kept["figures"]]) is not sprint["figures"]:
            return
        fed = self.fed
        unheld = fed.unheld
        fed.first_stage, fed.unheld = SPRINT, set(sprint["unheld"])
        try:
            row = self._stage_result(sprint["state"], 0, sprint["figures"])
        finally:
            fed.first_stage, fed.unheld = kept["variant"], unheld
        ck.passes.append({**row, "variant": SPRINT})
        self.rec.progress(
            f"stage 0 as {SPRINT}: test {row['test_accuracy']:.4f}, a candidate for the delivered model"
        )
        self._save(ck)

    @staticmethod
    def _kept_first_stage(ck: Checkpoint) -> str:
        """The layer-0 variant ``first-stage auto`` keeps: the better validation of its trainings
        (the sprint's is never kept: its embeddings make poor inputs for later stages)."""
        trials = [t for t in ck.first_stage_trials if t["variant"] in FIRST_STAGE_VARIANTS]
        if len(trials) < len(FIRST_STAGE_VARIANTS):
            raise RuntimeError(f"first-stage auto: {len(trials)} of stage 0's trainings in the checkpoint")
        best = keep_best_stage([t["figures"] for t in trials])
        return next(t["variant"] for t in trials if t["figures"] is best)

    def _stage_result(
        self,
        state: StateDict,
        stage: int,
        figures: dict[str, Any],
        deliveries: dict[int, Frames] | None = None,
    ) -> dict[str, Any]:
        """The test of a stage's kept model (``state``), beside the validation accuracy and loss
        of the stage's ``figures`` (the loss breaks ties between stages; a checkpoint of older
        code has none); with ``deliveries``, the stage's relayed frames for clients its rounds
        left out.

        Without secure aggregation only the clients that hold test nodes are asked (the others'
        counts are zero; at one node per client that is most of them): the stage's embed brings
        the others the state and the frames. Under it every live client is, as its masks are
        summed over all of them."""
        fed = self.fed
        pids = None if fed.secure is not None else [p for p in fed.live() if fed.tests(p)]
        if pids is not None and deliveries:
            asked = set(pids)
            deliveries = {p: f for p, f in deliveries.items() if p in asked}
        tests = fed.evaluate(state, "test", stage, deliveries or None, pids=pids)
        return self._result_row(stage, figures, tests)

    def _tests_with_embed(self) -> bool:
        """Whether a stage the run goes on from is tested by its embed (no test message of its
        own): unless under secure aggregation, whose masked counts are summed over every live
        client in a message of their own."""
        return self.fed.secure is None

    def _result_row(
        self, stage: int, figures: dict[str, Any], tests: dict[int, EvalResult]
    ) -> dict[str, Any]:
        """A stage's row of ``ck.passes``: its ``figures``' validation beside ``tests``, the
        test counts by partition id (or the masked sum, :data:`AGGREGATE`)."""
        return {
            "pass": stage // self.cfg.stages,
            "stage": stage,
            "val_accuracy": figures["val_accuracy"],
            "val_loss": figures.get("val_loss"),
            "test_accuracy": total(tests).accuracy,
            "clients": per_client(self.fed, tests),
            # who was measured: under secure aggregation the summed members, else every client
            # that holds test nodes
            "members": sorted(self.fed.secure.last_survivors if AGGREGATE in tests else tests),
        }

    def _kept(self, ck: Checkpoint) -> tuple[dict[str, Any], dict[str, Any]]:
        """The stage whose model the run delivers (see :func:`keep_best_stage`) and the summary's
        figures: ``kept_stage`` and ``kept_pass`` name it, ``stage_results`` lists every stage's
        validation and test accuracy, ``passes`` the rows of the stages that end a pass."""
        # A sprint row goes before its stage's: a full tie goes to the later, the chain's.
        results = sorted(ck.passes, key=lambda r: (r["stage"], "variant" not in r))
        last = results[-1]
        kept = keep_best_stage(results)
        if kept is not last:
            as_ = f" as {kept['variant']}" if "variant" in kept else ""
            self.rec.progress(
                f"kept {self.cfg.stage_name(kept['stage'])}{as_}: validation "
                f"{kept['val_accuracy']:.4f}, the last stage's {last['val_accuracy']:.4f}"
            )
        keys = ("pass", "stage", "val_accuracy", "val_loss", "test_accuracy")
        figures = [
            {
                **{k: r[k] for k in keys},
                **{k: r[k] for k in ("variant",) if k in r},
                "eligible": same_clients(r, last),
            }
            for r in results
        ]
        ends = {s for s in range(self.cfg.total_stages) if self.cfg.ends_pass(s)} | {last["stage"]}
        self.rec.event("selection", kept_stage=kept["stage"], stages=figures)
        return kept, {
            "kept_stage": kept["stage"],
            **({"kept_variant": kept["variant"]} if "variant" in kept else {}),
            "kept_pass": kept["pass"],
            "stage_results": figures,
            "passes": [f for f in figures if f["stage"] in ends and "variant" not in f],
        }

    def _names_teacher(self, ck: Checkpoint, stage: int, figures: dict[str, Any]) -> bool:
        """Whether ``stage``'s embed names its model the self-training teacher: a relabelling is
        still ahead and the stage validates best of the run so far (:func:`keep_best_stage` over
        every finished stage's figures and this one's, the rule that picks the delivered model)."""
        cfg = self.cfg
        if stage >= cfg.stages * cfg.self_training:  # no pass's end after it
            return False
        candidates = [*ck.stages, figures]
        return keep_best_stage(candidates) is figures

    def _embed(
        self,
        state: StateDict,
        stage: int,
        late: dict[int, Frames],
        test: bool = False,
        teacher: bool = False,
    ) -> tuple[dict[int, Frames], dict[int, EvalResult]]:
        """Clients move on from ``stage`` with ``state``: their sealed boundary rows, relayed,
        and, with ``test``, the test counts of the clients that hold test nodes, which each
        took of ``state`` before it moved on (by partition id; else empty).

        ``late``: the stage's relayed frames for clients that neither its rounds nor its test
        reached, opened before they embed. ``teacher``: clients keep ``state``'s predictions,
        which the next pass's end labels from (:data:`~retexo_fl.protocol.TEACHER`)."""
        fed = self.fed
        config: dict[str, Any] = {P.STAGE: stage, **({P.SPLIT: "test"} if test else {})}
        if teacher:
            config[P.TEACHER] = 1
        phase = f"stage {stage} embed"
        replies = fed.send_state(P.EMBED, state, phase, stage, config, late or None)
        tests: dict[int, EvalResult] = {}
        for pid in [p for p in replies if fed.tests(p)] if test else []:
            try:
                tests[pid] = test_counts(pid, replies[pid])
            except ValueError as exc:  # one client's bad reply is its own failure, not the run's
                del replies[pid]
                fed.members.lose(pid, phase, str(exc))
        stats = ExchangeStats()
        fed.add_stats(stats, list(replies.values()))
        self.exchange_stats[stage] = stats
        relabeled = {
            pid: int(r[P.METRICS][P.NUM_EXAMPLES])
            for pid, r in replies.items()
            if P.NUM_EXAMPLES in r.get(P.METRICS, {})
        }
        fed.training_nodes.update(relabeled)  # the next pass's rounds go to who trains now
        # Under secure aggregation no client reports its count (see the party's embed handler).
        self.relabeled = None if self.cfg.secure_aggregation else sum(relabeled.values())
        before = fed.bytes_boundary
        incoming = fed.route({pid: r.get(P.PAYLOADS, {}) for pid, r in replies.items()}, P.HALO, stage)
        self.rec.event("exchange", stage=stage, bytes=fed.bytes_boundary - before, **exchange_figures(stats))
        return incoming, tests

    # -- checkpoint and resume --------------------------------------------------------------
    def _save(self, ck: Checkpoint) -> None:
        """Bring ``ck`` up to date with the federation and hand it to the store."""
        if self.store is None:
            return
        fed = self.fed
        ck.run_key, ck.pids, ck.keys, ck.counts = fed.run_key, fed.pids, fed.keys, fed.counts
        ck.lost, ck.bytes_boundary, ck.model_bytes_done = (
            fed.members.lost,
            fed.bytes_boundary,
            self.model_bytes_done,
        )
        ck.exchange_stats, ck.privacy, ck.transport = (
            self.exchange_stats,
            fed.privacy,
            fed.transport.snapshot(),
        )
        ck.boundary_releases, ck.missing_payloads = fed.boundary_releases, fed.missing_payloads
        ck.messages = dict(fed.messages)
        ck.messages_per_stage = {k: dict(v) for k, v in fed.messages_per_stage.items()}
        ck.training_nodes = dict(fed.training_nodes)
        ck.client_bytes = {s: {p: list(r) for p, r in rows.items()} for s, rows in fed.client_bytes.items()}
        ck.secure = fed.secure
        self.store.save(ck)

    def _resume(self) -> Checkpoint:
        """Load the store's checkpoint and find the surviving clients again."""
        if self.store is None:
            raise ValueError("resume needs a checkpoint store (the run folder of a lazy run)")
        ck = self.store.load()
        if not hasattr(ck, "passes"):  # a checkpoint written before stages were kept by validation
            ck.passes = []
        if not hasattr(ck, "first_stage_trials"):  # ... or before first-stage auto
            ck.first_stage_trials = []
        if ck.stage > 1 and len(chain_rows(ck.passes)) < min(ck.stage, self.cfg.total_stages):
            self.rec.progress(
                "the checkpoint predates tests of every stage: the untested ones are not candidates "
                "for the delivered model"
            )
        fed = self.fed
        fed.run_key, fed.keys, fed.counts = ck.run_key, ck.keys, ck.counts
        fed.members.lost, fed.bytes_boundary, fed.privacy = ck.lost, ck.bytes_boundary, ck.privacy
        fed.boundary_releases, fed.missing_payloads = ck.boundary_releases, ck.missing_payloads
        # Counted on: the messages this resume sends again (the round in flight) count twice.
        resumed = dict(getattr(ck, "messages", {}))  # checkpoints from before the count lack it
        for name, n in fed.messages.items():  # sent since this server started (hello, setup)
            resumed[name] = resumed.get(name, 0) + n
        fed.messages = resumed
        per_stage = {k: dict(v) for k, v in getattr(ck, "messages_per_stage", {}).items()}
        for stage, counts in fed.messages_per_stage.items():
            for name, n in counts.items():
                per_stage.setdefault(stage, {})[name] = per_stage.get(stage, {}).get(name, 0) + n
        fed.messages_per_stage = per_stage
        fed.training_nodes = dict(getattr(ck, "training_nodes", {}))
        before = getattr(ck, "client_bytes", {})  # what this server counted since (setup) is added
        for stage, rows in before.items():
            for pid, (sent, received, model) in rows.items():
                fed.count_client_bytes(stage, pid, sent, received, model)
        if ck.secure is not None:
            fed.secure = ck.secure
        self.model_bytes_done, self.exchange_stats = ck.model_bytes_done, ck.exchange_stats
        fed.transport.restore(ck.transport)
        fed.reconnect(ck.pids)
        where = f"stage {ck.stage}" + (f" after round {ck.round_state.round}" if ck.round_state else "")
        self.rec.progress(f"resumed at {where} with {len(fed.pids)} clients")
        return ck


def chain_rows(passes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of ``ck.passes`` of the stages the run trained one on another: not the sprint's
    (a candidate of stage 0 beside the kept variant's, never embedded)."""
    return [r for r in passes if "variant" not in r]


def test_counts(pid: int, reply: dict[str, Any]) -> EvalResult:
    """The test counts an embed's ``reply`` carries (client ``pid``'s).

    Raises:
        ValueError: the reply lacks them, or they are not counts (naming the client).
    """
    metrics = reply.get(P.METRICS, {})
    try:
        correct, count, loss = int(metrics[P.CORRECT]), int(metrics[P.COUNT]), float(metrics[P.LOSS])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"client {pid}: the embed asked for test counts, its reply carries none") from None
    if not 0 <= correct <= count:
        raise ValueError(f"client {pid}: its embed reply's test counts are not counts: {correct} of {count}")
    return EvalResult(correct, count, loss)


def _trial_figures(figures: dict[str, Any]) -> dict[str, Any]:
    """One ``first-stage auto`` training's figures, without its round history."""
    keys = ("val_accuracy", "val_loss", "best_round", "rounds_run", "rounds_sent", "bytes_model", "seconds")
    raced = {"behind_pace": figures["behind_pace"]} if "behind_pace" in figures else {}
    return {k: figures.get(k) for k in keys} | raced
