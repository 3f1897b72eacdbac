"""The eager and local baselines' run: one :class:`~retexo_fl.coordinator.round_loop.RoundLoop`
over a whole run, the halo refreshed every round (eager) or never sent (local)."""

from __future__ import annotations

import time

from retexo_fl import protocol as P
from retexo_fl.config import TrainConfig
from retexo_fl.coordinator.federation import FederationView, Frames, total
from retexo_fl.coordinator.round_loop import (
    BROADCAST_TAG,
    RoundLoop,
    StageResult,
    compression_totals,
    exchange_figures,
    per_client,
)
from retexo_fl.coordinator.selection import StageTracker
from retexo_fl.coordinator.transport import Transport
from retexo_fl.metrics import RunRecorder
from retexo_fl.models.factory import build_layered_model
from retexo_fl.seeding import derive_seed
from retexo_fl.summary import RunSummary


class BaselineRun:
    """Eager and local training over a transport: one ``train`` message per round.

    Round ``r`` carries the global state and the boundary frames peers computed in round
    ``r - 1``; each client validates the state, sends this round's frames and its update back in
    one reply.

    Args:
        transport (Transport): how clients are reached.
        cfg (TrainConfig): the run configuration (``mode`` eager or local).
        rec (RunRecorder): where events and progress go.
    """

    def __init__(self, transport: Transport, cfg: TrainConfig, rec: RunRecorder) -> None:
        if cfg.mode not in ("eager", "local"):
            raise ValueError(f"BaselineRun runs eager or local mode, not {cfg.mode!r}")
        self.cfg = cfg
        self.rec = rec
        self.fed = FederationView(transport, cfg, rec)
        self.loop = RoundLoop(self.fed)

    def run(self) -> RunSummary:
        """Set up, train, test; returns the run summary."""
        cfg, fed = self.cfg, self.fed
        t0 = time.perf_counter()
        degrees = fed.setup()  # degrees (eager GCN) ride with round 1
        ref = fed.reference
        model = build_layered_model(cfg, ref.num_features, ref.num_classes)
        state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        tracker = StageTracker(0, cfg.patience, cfg.min_rounds, cfg.stop_metric)
        rs = self.loop.start(state, 1, tracker, derive_seed(cfg.seed, BROADCAST_TAG))
        rounds = int(cfg.per_stage("rounds", 1))
        result = self.loop.run(0, rounds, rs, degrees, refresh=True, label=cfg.mode)
        before = fed.bytes_boundary
        deliveries = self.refresh_halos(result, rounds)
        refreshed = fed.bytes_boundary - before  # after the last round of the curve
        figures = result.figures
        figures.update(bytes_boundary=fed.bytes_boundary, **exchange_figures(result.stats))
        tests = fed.evaluate(result.best_state, "test", 0, deliveries)
        test = total(tests)
        summary = RunSummary(
            mode=cfg.mode,
            engine=fed.transport.engine,
            test_accuracy=test.accuracy,
            val_accuracy=figures["val_accuracy"],
            bytes_total=fed.bytes_boundary + figures["bytes_model"] + fed.bytes_secure,
            bytes_boundary=fed.bytes_boundary,
            bytes_model=figures["bytes_model"],
            stages=[figures],
            wall_seconds=time.perf_counter() - t0,
            config=cfg.to_dict(),
            clients=per_client(fed, tests),
            **compression_totals([figures]),
            federation=fed.summary(),
            extra={"bytes_halo_refresh": refreshed, "local_steps": result.local_steps},
        )
        if not fed.has_test_nodes():  # the engines computed 0 over no node
            summary.without_test()
        return summary

    def refresh_halos(self, result: StageResult, rounds: int) -> dict[int, Frames] | None:
        """Eager: the halo rows of the best state, for its test.

        The rows clients hold were computed from the last rounds' states, not from the best one,
        and the standard model's first-layer rows (``X W``) do not fit another state's weights.
        One exchange per conv layer of rows computed from the best state settles every layer, so
        the test evaluates the model the best validation named as the whole graph would. The
        exchanges are counted as boundary bytes. Not with ``boundary-clip``: see below.

        Returns:
            dict[int, Frames] | None: the last exchange's frames, to deliver with the test.
        """
        cfg, fed = self.cfg, self.fed
        # Clipped (and noised) rows are releases counted against each party's budget: a run that
        # releases them makes no extra ones, and tests on the last rounds' halos.
        if cfg.mode != "eager" or cfg.stages < 2 or cfg.boundary_clip > 0:
            return None
        deliveries = None
        for i in range(1, cfg.stages):
            config = {P.STAGE: 0, P.ROUND: rounds + 1 + i, P.SPLIT: "val", P.REFRESH: True}
            replies = fed.send_state(P.EVALUATE, result.best_state, "halo refresh", 0, config, deliveries)
            ordered = [replies[pid] for pid in fed.pids]
            fed.add_stats(result.stats, ordered)
            outgoing = {pid: r[P.PAYLOADS] for pid, r in replies.items() if P.PAYLOADS in r}
            deliveries = fed.route(outgoing, P.HALO, 0) if outgoing else None
        return deliveries
