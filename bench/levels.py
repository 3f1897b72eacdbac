"""One table over the decentralization levels RETEXO names, on Cora and CiteSeer.

Levels, each a whole run with its mode's defaults (``TrainConfig.resolve``) and the same seed:

- ``datacenter``: CAGNET 1D on 4 processes (``torch.distributed``, full-batch GCN);
- ``wan-4`` / ``wan-10``: lazy training over 4 / 10 METIS partitions;
- ``edge``: 10 METIS partitions, ``--profile edge`` (phone-class clients: CPU, one thread,
  8-bit rows);
- ``node``: one node per client (``--method node``: 2,708 clients on Cora, 3,327 on CiteSeer).

Each row: test accuracy and its gap to the centralized GCN of the same seed (measured in the same
benchmark), rounds sent, bytes per client per stage (boundary rows received, model state in
rounds: mean over clients, and the largest client's, averaged over stages), at node level the
median device's boundary bytes per stage against its degree times one row's bytes (the median
over nodes of distinct neighbours x hidden width x bits / 8), in-process wall time,
and peak memory: the run's process (every client of the run, in process) and that divided by
the clients. ``--simulation`` adds the node level's wall time in Flower simulation. Every run is
its own process, so each peak is its own. Writes JSON and prints a table::

    python bench/levels.py --out bench/results/levels.json
    python bench/levels.py --datasets Cora --levels node --seeds 0,1,2
    python bench/levels.py --node-settings '{"self_training": 0}'   # node level, one pass
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_ROOT, peak_rss_mb, private_planetoid, run_jobs

#: Level -> the settings it adds to the dataset and seed.
LEVELS: dict[str, dict] = {
    "centralized": dict(mode="centralized"),
    "datacenter": dict(mode="datacenter", algorithm="1d", procs=4),
    "wan-4": dict(clients=4, method="metis"),
    "wan-10": dict(clients=10, method="metis"),
    "edge": dict(clients=10, method="metis", profile="edge"),
    "node": dict(method="node"),
}
NODES = {"Cora": 2708, "CiteSeer": 3327}


def _stage_means(per_client: dict, kind: str) -> tuple[float | None, float | None]:
    """Mean over the run's stages of the clients' mean and of the largest client's ``kind`` bytes."""
    stages = [v for k, v in per_client.items() if int(k) >= 0]
    if not stages:
        return None, None
    return (
        statistics.fmean(s[kind]["mean"] for s in stages),
        statistics.fmean(s[kind]["max"] for s in stages),
    )


def _exchange_median(per_client: dict) -> float | None:
    """The median client's boundary bytes received, averaged over the stages that exchange rows
    (the last stage sends none)."""
    stages = [v for k, v in per_client.items() if int(k) >= 0 and v["boundary_received"]["mean"] > 0]
    return statistics.fmean(s["boundary_received"]["median"] for s in stages) if stages else None


def degree_row_bytes(cfg) -> float:
    """The median over nodes of (distinct neighbours x one embedding row's bytes): what one
    device at node level must receive per stage at the least, before framing and sealing."""
    import torch

    from retexo_fl.data.loading import load_graph

    data = load_graph(cfg)
    ei = torch.cat([data.edge_index, data.edge_index.flip(0)], dim=1)
    pairs = torch.unique(ei[:, ei[0] != ei[1]], dim=1)  # each neighbour once, either direction
    degree = torch.bincount(pairs[1], minlength=data.num_nodes).float()
    return float(degree.median()) * int(cfg.hidden) * int(cfg.bits) / 8


def one(args: tuple[dict, str]) -> dict:
    """One run in this (fresh) process: its row."""
    job, root = args
    from retexo_fl.config import TrainConfig
    from retexo_fl.metrics import RunRecorder
    from retexo_fl.runner import train

    settings = dict(LEVELS[job["level"]], dataset=job["dataset"], data_root=root, seed=job["seed"])
    if job["level"] == "node":
        settings["clients"] = NODES[job["dataset"]]
        settings.update(job.get("node_settings", {}))
    if job.get("engine") == "simulation":
        from server.simulation import simulate

        cfg = TrainConfig.resolve(**settings)
        t0 = time.perf_counter()
        summary = simulate(cfg).to_dict()
    else:
        cfg = TrainConfig.resolve(**settings)
        t0 = time.perf_counter()
        summary = train(cfg, RunRecorder(None, stream=None)).to_dict()
    seconds = time.perf_counter() - t0
    per_client = summary.get("bytes_per_client") or {}
    boundary_mean, boundary_max = _stage_means(per_client, "boundary_received")
    model_mean, model_max = _stage_means(per_client, "model")
    rounds = sum(s.get("rounds_sent", s.get("rounds_run", 0)) for s in summary.get("stages", []))
    clients = int(cfg.clients)
    if cfg.mode in ("centralized", "datacenter"):  # epochs of full-batch training, one "stage"
        rounds = int(cfg.rounds if isinstance(cfg.rounds, int) else cfg.rounds[0])
        clients = int(cfg.procs) if cfg.mode == "datacenter" else 1
    if cfg.mode == "datacenter":  # every process receives its share of the rows, every epoch
        boundary_mean = boundary_max = (summary.get("bytes_total") or 0) / clients
    peak = peak_rss_mb()
    boundary_median = reference = None
    if job["level"] == "node":
        boundary_median, reference = _exchange_median(per_client), degree_row_bytes(cfg)
    return {
        **job,
        "clients": clients,
        "test_accuracy": summary["test_accuracy"],
        "val_accuracy": summary.get("val_accuracy"),
        "rounds_sent": rounds,
        "bytes_total": summary.get("bytes_total"),
        "boundary_per_client_stage_mean": boundary_mean,
        "boundary_per_client_stage_max": boundary_max,
        "boundary_per_client_stage_median": boundary_median,
        "degree_x_row_bytes_median": reference,
        "model_per_client_stage_mean": model_mean,
        "model_per_client_stage_max": model_max,
        "messages": summary.get("messages"),
        "seconds": seconds,
        "peak_mb": peak,
        "peak_mb_per_client": peak / clients,
    }


def _fmt(v: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if v is None else f"{v / scale:.{digits}f}"


def _ratio(group: list[dict]) -> float | None:
    """Mean over seeds of the median device's boundary bytes per stage over degree x row bytes."""
    values = [
        r["boundary_per_client_stage_median"] / r["degree_x_row_bytes_median"]
        for r in group
        if r.get("boundary_per_client_stage_median") and r.get("degree_x_row_bytes_median")
    ]
    return statistics.fmean(values) if values else None


def table(rows: list[dict]) -> str:
    """The printed table: one line per (dataset, level, engine), means over seeds."""
    central = {(r["dataset"], r["seed"]): r["test_accuracy"] for r in rows if r["level"] == "centralized"}
    lines = [
        f"{'dataset':9} {'level':12} {'engine':10} {'clients':>7} {'test':>6} {'gap':>6} {'rounds':>6} "
        f"{'rows KB/cl/st':>13} {'max':>8} {'median/deg*row':>14} {'model KB/cl/st':>14} {'max':>8} "
        f"{'s':>7} {'peak MB':>8}"
    ]
    keys = sorted({(r["dataset"], r["level"], r.get("engine", "in-process")) for r in rows}, key=str)
    for dataset, level, engine in keys:
        group = [
            r
            for r in rows
            if (r["dataset"], r["level"], r.get("engine", "in-process")) == (dataset, level, engine)
        ]
        gaps = [
            r["test_accuracy"] - central[(dataset, r["seed"])]
            for r in group
            if (dataset, r["seed"]) in central
        ]

        def mean(key: str, group: list[dict] = group) -> float | None:
            values = [r[key] for r in group if r.get(key) is not None]
            return statistics.fmean(values) if values else None

        lines.append(
            f"{dataset:9} {level:12} {engine:10} {group[0]['clients']:7d} {mean('test_accuracy'):6.3f} "
            f"{(statistics.fmean(gaps) if gaps else 0.0):+6.3f} {_fmt(mean('rounds_sent'), 1, 0):>6} "
            f"{_fmt(mean('boundary_per_client_stage_mean'), 1e3):>13} "
            f"{_fmt(mean('boundary_per_client_stage_max'), 1e3):>8} "
            f"{_fmt(_ratio(group), 1, 2):>14} "
            f"{_fmt(mean('model_per_client_stage_mean'), 1e3):>14} "
            f"{_fmt(mean('model_per_client_stage_max'), 1e3):>8} "
            f"{mean('seconds'):7.1f} {mean('peak_mb'):8.0f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datasets", default="Cora,CiteSeer")
    ap.add_argument("--levels", default=",".join(LEVELS), help=f"of {', '.join(LEVELS)}")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--simulation", action="store_true", help="also the node level in Flower simulation")
    ap.add_argument(
        "--node-settings",
        default="{}",
        help="JSON settings for the node level only, e.g. '{\"self_training\": 0}' (default: none)",
    )
    ap.add_argument("--root", default=str(DEFAULT_ROOT))
    ap.add_argument("--workers", type=int, default=1, help="runs at once (1: timings undisturbed)")
    ap.add_argument("--out", default="bench/results/levels.json")
    args = ap.parse_args(argv)
    levels = args.levels.split(",")
    unknown = sorted(set(levels) - set(LEVELS))
    if unknown:
        ap.error(f"unknown levels {unknown}; choose from {', '.join(LEVELS)}")
    if "centralized" not in levels:
        levels.insert(0, "centralized")  # every gap is to the centralized GCN of the same seed
    jobs = [
        {"dataset": d, "level": level, "seed": int(s)}
        for d in args.datasets.split(",")
        for s in args.seeds.split(",")
        for level in levels
    ]
    node_settings = json.loads(args.node_settings)
    for j in jobs:
        if j["level"] == "node" and node_settings:
            j["node_settings"] = node_settings
    if args.simulation:
        jobs += [{**j, "engine": "simulation"} for j in jobs if j["level"] == "node"]
    root = private_planetoid(args.root, tuple(args.datasets.split(",")))
    out = Path(args.out)
    rows = run_jobs(
        one,
        jobs,
        str(root),
        out.with_suffix(".partial.jsonl"),
        args.workers,
        lambda r: (
            f"{r['dataset']} {r['level']} seed {r['seed']}: {r['test_accuracy']:.3f} in {r['seconds']:.0f}s"
        ),
    )
    print(table(rows))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "argv": sys.argv[1:]}, indent=1))
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
