"""Runs one configured training job in process: loads data or partitions, dispatches on the mode."""

from __future__ import annotations

import time
from pathlib import Path

from retexo_fl.config import TrainConfig
from retexo_fl.data.loading import load_graph
from retexo_fl.data.partition import Partition, load_partitions
from retexo_fl.data.partitioners import partition_graph
from retexo_fl.datacenter.launch import run_datacenter
from retexo_fl.metrics import RunRecorder
from retexo_fl.plots import write_plots
from retexo_fl.summary import RunSummary
from retexo_fl.training.centralized import run_centralized, whole_graph_partition
from retexo_fl.training.eager import run_eager
from retexo_fl.training.lazy import run_lazy


def make_partitions(cfg: TrainConfig, rec: RunRecorder | None = None) -> list[Partition]:
    """The run's partitions: read from ``cfg.partitions`` or cut from the dataset."""
    if cfg.partitions:
        parts = load_partitions(cfg.partitions)
        if rec:
            rec.progress(f"loaded {len(parts)} partitions from {cfg.partitions}")
        return parts
    data = load_graph(cfg)
    parts = partition_graph(data, cfg.clients, cfg.method, seed=cfg.seed)
    if rec:
        cut = sum(p.cross_edges.shape[0] for p in parts)
        rec.progress(
            f"{data.name}: {data.num_nodes} nodes, {data.edge_index.size(1)} edges -> "
            f"{len(parts)} {cfg.method} partitions, {cut} cross-edge records"
        )
    return parts


def train(cfg: TrainConfig, rec: RunRecorder | None = None) -> RunSummary:
    """Train as ``cfg`` says and return the summary (also written to ``cfg.out_dir`` if set)."""
    cfg.validate()
    if cfg.audit:
        raise ValueError(
            "--audit records what each ClientApp sends, and the in-process engine runs none: "
            "use --engine simulation (or node config audit-dir in a deployment)"
        )
    rec = rec or RunRecorder(cfg.out_dir or None)
    rec.write_json("config.json", cfg.to_dict())
    t0 = time.perf_counter()
    if cfg.mode == "centralized":
        if cfg.partitions:
            raise ValueError("centralized mode trains on the whole graph: give --dataset, not --partitions")
        summary = run_centralized(whole_graph_partition(load_graph(cfg)), cfg, rec)
    elif cfg.mode == "datacenter":
        summary = RunSummary.from_dict(run_datacenter(cfg, rec))
    elif cfg.mode in ("eager", "local"):
        summary = run_eager(make_partitions(cfg, rec), cfg, rec, local=cfg.mode == "local")
    else:
        summary = run_lazy(make_partitions(cfg, rec), cfg, rec)
    summary.wall_seconds = time.perf_counter() - t0
    summary.config = cfg.to_dict()
    rec.write_json("summary.json", summary.to_dict())
    if cfg.out_dir:
        write_plots(summary, cfg.out_dir)
    rec.event("done", test_accuracy=summary.test_accuracy)
    rec.progress(summary.line() + (f"  -> {Path(cfg.out_dir) / 'summary.json'}" if cfg.out_dir else ""))
    return summary
