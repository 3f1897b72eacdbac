"""The in-process lazy (RETEXO) engine: every client of a partitioned graph in one process, no Flower."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from torch import Tensor

from retexo_fl.config import TrainConfig
from retexo_fl.data.partition import Partition, check_cross_consistency
from retexo_fl.metrics import RunRecorder, human_bytes
from retexo_fl.plan import check_plans
from retexo_fl.training.aggregate import (
    ServerOptimizer,
    StateDict,
    state_nbytes,
    weighted_average,
)
from retexo_fl.training.client import LazyClient
from retexo_fl.training.selection import StageTracker


def exchange(outgoing: dict[int, dict[int, Tensor]]) -> tuple[dict[int, dict[int, Tensor]], int]:
    """Route ``{src: {dst: rows}}`` to ``{dst: {src: rows}}``; returns it and the payload bytes."""
    incoming: dict[int, dict[int, Tensor]] = {}
    nbytes = 0
    for src, per_dst in outgoing.items():
        for dst, rows in per_dst.items():
            incoming.setdefault(dst, {})[src] = rows
            nbytes += rows.numel() * rows.element_size()
    return incoming, nbytes


def _aggregate_eval(clients: Sequence[LazyClient], state: StateDict, split: str) -> tuple[float, float]:
    results = [c.evaluate(state, split) for c in clients]
    count = sum(r.count for r in results)
    correct = sum(r.correct for r in results)
    loss = sum(r.loss_sum for r in results)
    return (correct / count if count else 0.0), (loss / count if count else 0.0)


def run_stage(
    clients: Sequence[LazyClient], cfg: TrainConfig, stage: int, rec: RunRecorder
) -> tuple[StateDict, dict]:
    """Train one stage by FedAvg rounds; returns the best-validation state and stage figures."""
    t0 = time.perf_counter()
    model = clients[0].make_model()
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    server = ServerOptimizer(cfg.server_optimizer, state, float(cfg.per_stage("server_lr", stage)))
    rounds = int(cfg.per_stage("rounds", stage))
    weights = [c.num_train for c in clients]
    tracker = StageTracker(stage, cfg.patience)
    for r in range(1, rounds + 1):
        results = [c.train(state, r) for c in clients]
        state = server.step(weighted_average([s for s, _ in results], weights))
        tracker.model_bytes += 2 * state_nbytes(state) * len(clients)
        train_loss = sum(loss * w for (_, loss), w in zip(results, weights, strict=True)) / sum(weights)
        val_acc, val_loss = _aggregate_eval(clients, state, "val")
        tracker.record(r, state, val_acc, train_loss=train_loss, val_loss=val_loss)
        rec.event("round", stage=stage, round=r, train_loss=train_loss, val_accuracy=val_acc)
        if line := tracker.progress_line(r, rounds):
            rec.progress(line)
        if tracker.should_stop:
            rec.progress(f"stage {stage}: no validation gain for {cfg.patience} rounds, stopping")
            break
    if rounds == 0:
        tracker.record(0, state, _aggregate_eval(clients, state, "val")[0])
    return tracker.best_state, tracker.figures(time.perf_counter() - t0)


def run_lazy(
    parts: Sequence[Partition],
    cfg: TrainConfig,
    rec: RunRecorder | None = None,
    on_stage: Callable[[int, StateDict], None] | None = None,
) -> dict:
    """Lazy message passing over ``parts`` in one process; returns the run summary.

    Per stage: R rounds of local training and training-node-weighted averaging, the
    best-validation state kept; then each client computes the stage's embeddings and sends its
    boundary rows, in boundary-plan order, to the peers that hold them as halo nodes.
    ``on_stage(stage, state)`` sees each stage's kept (best-validation) weights.
    """
    rec = rec or RunRecorder(None, stream=None)
    check_cross_consistency(list(parts))
    clients = [LazyClient(p, cfg) for p in parts]
    check_plans({c.id: c.plan.digests() for c in clients})
    bytes_boundary = 0
    stages = []
    if cfg.model == "gcn" and cfg.stages > 1:
        incoming, nbytes = exchange({c.id: c.degree_rows() for c in clients})
        for c in clients:
            c.receive_degrees(incoming.get(c.id, {}))
        bytes_boundary += nbytes
        rec.event("degrees", bytes=nbytes)
    state: StateDict = {}
    for stage in range(cfg.stages):
        state, figures = run_stage(clients, cfg, stage, rec)
        if on_stage is not None:
            on_stage(stage, state)
        figures["bytes_boundary"] = 0
        if stage < cfg.stages - 1:
            outgoing = {c.id: c.advance(c.embeddings(state)) for c in clients}
            incoming, nbytes = exchange(outgoing)
            for c in clients:
                c.receive_halo(incoming.get(c.id, {}))
            figures["bytes_boundary"] = nbytes
            bytes_boundary += nbytes
            rec.event("exchange", stage=stage, bytes=nbytes)
        stages.append(figures)
        rec.progress(
            f"stage {stage} done: best val {figures['val_accuracy']:.4f} at round "
            f"{figures['best_round']}, boundary {human_bytes(figures['bytes_boundary'])}"
        )
    per_client = [c.evaluate(state, "test") for c in clients]
    test_acc = sum(r.correct for r in per_client) / max(1, sum(r.count for r in per_client))
    bytes_model = sum(s["bytes_model"] for s in stages)
    return {
        "mode": "lazy",
        "engine": "in-process",
        "test_accuracy": test_acc,
        "val_accuracy": stages[-1]["val_accuracy"],
        "bytes_total": bytes_boundary + bytes_model,
        "bytes_boundary": bytes_boundary,
        "bytes_model": bytes_model,
        "clients": [
            {"client": c.id, "test_accuracy": r.accuracy, "test_count": r.count, **c.part.counts()}
            for c, r in zip(clients, per_client, strict=True)
        ],
        "stages": stages,
    }
