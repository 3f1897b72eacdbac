"""The in-process lazy (RETEXO) engine: every client of a partitioned graph in one process, no Flower."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from torch import Tensor

from retexo_fl.compress.boundary import ExchangeStats
from retexo_fl.compress.updates import ModelBroadcast
from retexo_fl.config import TrainConfig
from retexo_fl.data.partition import Partition, check_cross_consistency
from retexo_fl.metrics import RunRecorder, human_bytes
from retexo_fl.plan import check_plans
from retexo_fl.training.aggregate import (
    ServerOptimizer,
    StateDict,
    state_nbytes,
)
from retexo_fl.training.client import LazyClient, connect_clients, derive_seed
from retexo_fl.training.privacy import UpdatePrivacy, aggregate_round, make_privacy
from retexo_fl.training.selection import StageTracker

T = TypeVar("T", bytes, Tensor)


def exchange(outgoing: dict[int, dict[int, T]]) -> tuple[dict[int, dict[int, T]], int]:
    """Route ``{src: {dst: item}}`` to ``{dst: {src: item}}``; returns it and the bytes moved.

    Items are frames (``bytes``) or, for tests of the plan alone, tensors.
    """
    incoming: dict[int, dict[int, T]] = {}
    nbytes = 0
    for src, per_dst in outgoing.items():
        for dst, item in per_dst.items():
            incoming.setdefault(dst, {})[src] = item
            nbytes += len(item) if isinstance(item, bytes) else item.numel() * item.element_size()
    return incoming, nbytes


def exchange_figures(stats: ExchangeStats) -> dict:
    """A stage's boundary figures for the summary: bytes before / after compression, widths."""
    d = stats.to_dict()
    return {
        "bytes_boundary_raw": d["bytes_raw"],
        "bytes_boundary_sent": d["bytes_sent"],
        "bit_histogram": d["bit_histogram"],
    }


def aggregate_eval(clients: Sequence[LazyClient], state: StateDict, split: str) -> tuple[float, float]:
    """Accuracy and mean loss of ``state`` over every client's ``split`` nodes."""
    results = [c.evaluate(state, split) for c in clients]
    count = sum(r.count for r in results)
    correct = sum(r.correct for r in results)
    loss = sum(r.loss_sum for r in results)
    return (correct / count if count else 0.0), (loss / count if count else 0.0)


def run_stage(
    clients: Sequence[LazyClient],
    cfg: TrainConfig,
    stage: int,
    rec: RunRecorder,
    bytes_before: int = 0,
    privacy: UpdatePrivacy | None = None,
) -> tuple[StateDict, dict]:
    """Train one stage by FedAvg rounds; returns the best-validation state and stage figures.

    ``bytes_before`` (all bytes of earlier stages and exchanges) starts the history's byte count;
    ``privacy`` (the run's, shared by all stages) makes each round DP-FedAvg.
    """
    t0 = time.perf_counter()
    model = clients[0].make_model()
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    layer = cfg.layer(stage)
    server = ServerOptimizer(cfg.server_optimizer, state, float(cfg.per_stage("server_lr", layer)))
    rounds = int(cfg.per_stage("rounds", layer))
    weights = [c.num_train for c in clients]
    tracker = StageTracker(stage, cfg.patience)
    tracker.bytes_offset = bytes_before
    model_raw = 0
    broadcast = ModelBroadcast(cfg.broadcast_bits, cfg.range_dtype, derive_seed(cfg.seed, stage, 0xBC))
    view = broadcast.prepare(state, 1)  # what the clients hold and train from
    for r in range(1, rounds + 1):
        results = []
        down = broadcast.nbytes()
        for c in clients:
            new, loss = c.train(view, r)
            frames = c.encode_update(new, view, r)
            if frames is not None:  # what the server receives is the decoded update
                new = c.update_codec.decode(frames, view, f"client {c.id}")
            results.append((new, loss))
            tracker.model_bytes += down + (
                state_nbytes(new) if frames is None else sum(map(len, frames.values()))
            )
            model_raw += 2 * state_nbytes(state)
        state = server.step(
            aggregate_round(state, view, [s for s, _ in results], weights, privacy, (stage, r))
        )
        view = broadcast.prepare(state, r + 1)
        train_loss = sum(loss * w for (_, loss), w in zip(results, weights, strict=True)) / sum(weights)
        val_acc, val_loss = aggregate_eval(clients, view, "val")
        tracker.record(r, view, val_acc, train_loss=train_loss, val_loss=val_loss)
        rec.event("round", stage=stage, round=r, train_loss=train_loss, val_accuracy=val_acc)
        if line := tracker.progress_line(r, rounds):
            rec.progress(line)
        if tracker.should_stop:
            rec.progress(f"stage {stage}: no validation gain for {cfg.patience} rounds, stopping")
            break
    if rounds == 0:
        tracker.record(0, state, aggregate_eval(clients, state, "val")[0])
    figures = tracker.figures(time.perf_counter() - t0)
    figures["bytes_model_raw"] = model_raw
    return tracker.best_state, figures


def compression_totals(stages: list[dict]) -> dict:
    """Run-level compression figures from the per-stage ones (both engines)."""
    hist: dict[str, int] = {}
    for s in stages:
        for b, n in s.get("bit_histogram", {}).items():
            hist[b] = hist.get(b, 0) + n
    return {
        "bytes_boundary_raw": sum(s.get("bytes_boundary_raw", 0) for s in stages),
        "bytes_model_raw": sum(s.get("bytes_model_raw", 0) for s in stages),
        "bit_histogram": hist,
    }


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
    connect_clients(clients)
    check_plans({c.id: c.plan.digests() for c in clients})
    privacy = make_privacy(cfg, len(clients))
    bytes_boundary = 0
    stages = []
    if cfg.model == "gcn" and cfg.stages > 1:
        incoming, nbytes = exchange({c.id: c.degree_frames() for c in clients})
        for c in clients:
            c.receive_degrees(c.decode_degrees(incoming.get(c.id, {})))
        bytes_boundary += nbytes
        rec.event("degrees", bytes=nbytes)
    state: StateDict = {}
    for stage in range(cfg.total_stages):
        before = bytes_boundary + sum(s["bytes_model"] for s in stages)
        state, figures = run_stage(clients, cfg, stage, rec, before, privacy)
        if on_stage is not None:
            on_stage(stage, state)
        figures["bytes_boundary"] = 0
        if cfg.ends_pass(stage):
            labeled = sum(c.relabel(state) for c in clients)
            rec.event("relabel", stage=stage, train_nodes=labeled)
            rec.progress(f"self-training pass {stage // cfg.stages + 1}: {labeled} training nodes")
        elif stage < cfg.total_stages - 1:
            outgoing, stats = {}, ExchangeStats()
            for c in clients:
                outgoing[c.id], client_stats = c.encode_boundary(c.advance(c.embeddings(state)))
                stats.add(client_stats)
            incoming, nbytes = exchange(outgoing)
            for c in clients:
                c.receive_halo(c.decode_boundary(incoming.get(c.id, {})))
            figures["bytes_boundary"] = nbytes
            figures.update(exchange_figures(stats))
            bytes_boundary += nbytes
            rec.event("exchange", stage=stage, bytes=nbytes, **exchange_figures(stats))
        stages.append(figures)
        rec.progress(
            f"stage {stage} done: best val {figures['val_accuracy']:.4f} at round "
            f"{figures['best_round']}, boundary {human_bytes(figures['bytes_boundary'])}"
        )
    per_client = [c.evaluate(state, "test") for c in clients]
    test_acc = sum(r.correct for r in per_client) / max(1, sum(r.count for r in per_client))
    bytes_model = sum(s["bytes_model"] for s in stages)
    return {
        **compression_totals(stages),
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
        "privacy": privacy.spent() if privacy else None,
        "stages": stages,
    }
