"""Accuracy benchmark: centralized GCN against lazy GCN / SAGE over datasets, splits, clients, partitioners.

Prints a table (mean and std over seeds) and writes JSON. Example::

    python bench/accuracy.py --root ../shared/datasets --out bench/results/accuracy.json
    python bench/accuracy.py --quick      # Cora, public split, 4 METIS clients, one seed
    python bench/accuracy.py --self-training 0,1 --datasets Cora --splits public --clients 4

``--self-training 0,1`` runs every row without and with one self-training pass (lazy and
centralized alike); "gap" is always against the plain centralized GCN of the same split.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_ROOT, private_planetoid, run_jobs

RETEXO_SPLIT = "per-class:40,500,1000"  # RETEXO's split: 40 labelled nodes per class


def _job(args: tuple[dict, str]) -> dict:
    settings, root = args
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    from retexo_fl.config import TrainConfig
    from retexo_fl.metrics import RunRecorder
    from retexo_fl.runner import train

    cfg = TrainConfig.resolve(data_root=root, **settings)
    summary = train(cfg, RunRecorder(None, stream=None))
    return {
        **settings,
        "test_accuracy": summary["test_accuracy"],
        "val_accuracy": summary["val_accuracy"],
        "bytes_boundary": summary["bytes_boundary"],
        "bytes_model": summary["bytes_model"],
        "wall_seconds": summary["wall_seconds"],
    }


def grid(
    quick: bool,
    seeds: list[int],
    models: list[str],
    self_training: Sequence[int] = (0,),
    datasets: list[str] | None = None,
    splits: list[str] | None = None,
    clients: list[int] | None = None,
    methods: list[str] | None = None,
    modes: Sequence[str] = ("centralized", "lazy"),
    pseudo_per_class: int = 0,
    pseudo_threshold: float | None = None,
) -> list[dict]:
    datasets = datasets or ["Cora", "CiteSeer"]
    splits = splits or ["public", RETEXO_SPLIT]
    clients = clients or [4, 10]
    methods = methods or ["metis", "random"]
    if quick:
        datasets, splits, clients, methods, seeds = ["Cora"], ["public"], [4], ["metis"], seeds[:1]
    jobs = []
    # Seeds outermost: a run cut off early still holds whole seeds of the grid.
    for seed, ds, split, st in itertools.product(seeds, datasets, splits, self_training):
        extra = {"self_training": st} if st else {}
        if st and pseudo_per_class:
            extra["pseudo_per_class"] = pseudo_per_class
        if st and pseudo_threshold is not None:
            extra["pseudo_threshold"] = pseudo_threshold
        if "centralized" in modes:
            jobs.append(
                {
                    "mode": "centralized",
                    "model": "gcn",
                    "dataset": ds,
                    "split": split,
                    "seed": seed,
                    "hidden": 64,
                    "clients": 1,
                    "method": "-",
                    **extra,
                }
            )
        for model, k, method in itertools.product(models if "lazy" in modes else [], clients, methods):
            jobs.append(
                {
                    "mode": "lazy",
                    "model": model,
                    "dataset": ds,
                    "split": split,
                    "seed": seed,
                    "clients": k,
                    "method": method,
                    **extra,
                }
            )
    return jobs


def mode_label(row: dict) -> str:
    """``lazy``; ``lazy+st1``: one self-training pass; ``lazy+st1/pc5/t0``: 5 a class, threshold 0."""
    st, pc, t = row.get("self_training", 0), row.get("pseudo_per_class", 0), row.get("pseudo_threshold")
    if not st:
        return row["mode"]
    return f"{row['mode']}+st{st}" + (f"/pc{pc}" if pc else "") + (f"/t{t:g}" if t is not None else "")


RESULT_KEYS = ("test_accuracy", "val_accuracy", "bytes_boundary", "bytes_model", "wall_seconds")


def latest_runs(rows: list[dict]) -> list[dict]:
    """One row per run setting (seed included): the last, where merged files repeat a run."""
    by_setting = {
        json.dumps({k: v for k, v in r.items() if k not in RESULT_KEYS}, sort_keys=True): r for r in rows
    }
    return list(by_setting.values())


def summarize(rows: list[dict]) -> list[dict]:
    rows = latest_runs(rows)
    keyf = ("dataset", "split", "mode", "model", "clients", "method")
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(mode_label(r) if k == "mode" else r[k] for k in keyf), []).append(r)
    table = []
    for key, rs in sorted(groups.items(), key=lambda kv: tuple(str(v) for v in kv[0])):
        accs = [r["test_accuracy"] for r in rs]
        central = [
            r["test_accuracy"]
            for r in rows
            if mode_label(r) == "centralized" and r["dataset"] == key[0] and r["split"] == key[1]
        ]
        table.append(
            {
                **dict(zip(keyf, key, strict=True)),
                "seeds": len(rs),
                "test_mean": statistics.mean(accs),
                "val_mean": statistics.mean(r["val_accuracy"] for r in rs),
                "test_std": statistics.pstdev(accs),
                "gap_to_centralized": statistics.mean(accs) - statistics.mean(central) if central else None,
                "bytes_boundary": statistics.mean(r["bytes_boundary"] for r in rs),
                "bytes_model": statistics.mean(r["bytes_model"] for r in rs),
                "seconds": statistics.mean(r["wall_seconds"] for r in rs),
            }
        )
    return table


def pick_by_validation(table: list[dict]) -> list[dict]:
    """Per lazy cell (dataset, split, model, clients, partitioner), the variant of best mean validation.

    Variants are the modes measured (``lazy``, ``lazy+st1``, ``lazy+st2``, ...) over the cell's
    largest number of seeds; test accuracy plays no part in the choice.
    """
    cells: dict[tuple, list[dict]] = {}
    for r in table:
        if r["mode"].startswith("lazy"):
            cells.setdefault((r["dataset"], r["split"], r["model"], r["clients"], r["method"]), []).append(r)
    picked = []
    for rs in cells.values():
        most = max(r["seeds"] for r in rs)
        candidates = [r for r in rs if r["seeds"] == most]
        best = max(candidates, key=lambda r: r["val_mean"])
        others = [
            f"{r['mode']} {r['val_mean']:.3f}/{r['test_mean']:.3f}" for r in candidates if r is not best
        ]
        picked.append({**best, "others": others})
    return picked


def print_table(table: list[dict]) -> None:
    head = (
        f"{'dataset':9} {'split':22} {'mode':16} {'model':5} {'K':>3} {'part':7} {'test acc':>15} "
        f"{'gap':>7} {'n':>2} {'boundary B':>12} {'model B':>12} {'s':>6}"
    )
    print(head)
    print("-" * len(head))
    for r in table:
        gap = (
            ""
            if r["gap_to_centralized"] is None or r["mode"] == "centralized"
            else f"{100 * r['gap_to_centralized']:+.1f}"
        )
        print(
            f"{r['dataset']:9} {r['split']:22} {r['mode']:16} {r['model']:5} {r['clients']:>3} "
            f"{r['method']:7} "
            f"{r['test_mean']:.4f}±{r['test_std']:.4f} {gap:>7} {r['seeds']:>2} {r['bytes_boundary']:>12.0f} "
            f"{r['bytes_model']:>12.0f} {r['seconds']:>6.1f}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=str(DEFAULT_ROOT), help="folder with Planetoid/<Name>/raw")
    parser.add_argument("--out", default="bench/results/accuracy.json")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--from-jsonl", default="", help="only print the table of runs saved in these files (comma list)"
    )
    parser.add_argument(
        "--seeds",
        default="0,1,2",
        help="comma list of seeds to run, or to count with --from-jsonl (default 0,1,2)",
    )
    parser.add_argument("--models", default="gcn,sage", help="lazy stage convs (default gcn,sage)")
    parser.add_argument("--self-training", default="0", help="self-training passes to run, e.g. 0,1")
    parser.add_argument("--datasets", default="", help="subset, e.g. Cora (default Cora,CiteSeer)")
    parser.add_argument("--splits", default="", help=f"';'-separated subset of public;{RETEXO_SPLIT}")
    parser.add_argument("--clients", default="", help="subset, e.g. 4 (default 4,10)")
    parser.add_argument("--methods", default="", help="subset, e.g. metis (default metis,random)")
    parser.add_argument(
        "--pseudo-per-class",
        type=int,
        default=0,
        help="self-training labels per class and client (0: no cap)",
    )
    parser.add_argument(
        "--pseudo-threshold", type=float, default=None, help="self-training confidence floor (default 0.6)"
    )
    parser.add_argument(
        "--by-validation",
        action="store_true",
        help="with --from-jsonl: one row per lazy cell, the variant (lazy, +st1, +st2, ...) of best "
        "mean validation accuracy over the cell's seeds",
    )
    parser.add_argument(
        "--modes",
        default="centralized,lazy",
        help="rows to run (default both; merge files with --from-jsonl for the gaps of lazy-only runs)",
    )
    args = parser.parse_args()

    if args.from_jsonl:
        files = [Path(f) for f in args.from_jsonl.split(",")]
        seeds = {int(v) for v in args.seeds.split(",")}
        rows = [json.loads(line) for f in files for line in f.read_text().splitlines() if line]
        table = summarize([r for r in rows if r["seed"] in seeds])
        if args.by_validation:
            table = [r for r in table if r["mode"].startswith("centralized")] + pick_by_validation(table)
        print_table(table)
        if args.by_validation:
            print("\nchosen on validation (val/test of the others):")
            for r in table:
                if r.get("others"):
                    print(
                        f"  {r['dataset']} {r['split']} {r['model']} K={r['clients']} {r['method']}: "
                        f"{r['mode']} (val {r['val_mean']:.3f}) over {', '.join(r['others'])}"
                    )
        return 0
    tmp = private_planetoid(args.root)

    def listed(value: str, kind: type = str) -> list | None:
        return [kind(v) for v in value.split(",")] if value else None

    jobs = grid(
        args.quick,
        [int(v) for v in args.seeds.split(",")],
        args.models.split(","),
        [int(v) for v in args.self_training.split(",")],
        listed(args.datasets),
        # A split holds commas itself ("per-class:40,500,1000"): splits are separated by ";".
        args.splits.split(";") if args.splits else None,
        listed(args.clients, int),
        listed(args.methods),
        modes=args.modes.split(","),
        pseudo_per_class=args.pseudo_per_class,
        pseudo_threshold=args.pseudo_threshold,
    )
    out = Path(args.out)
    t0 = time.perf_counter()
    rows = run_jobs(
        _job,
        jobs,
        str(tmp),
        out.with_suffix(".jsonl"),
        args.workers,
        lambda row: (
            f"{row['dataset']} {row['split']} {row['mode']} {row['model']} K={row['clients']} "
            f"{row['method']} seed {row['seed']}: {row['test_accuracy']:.4f}"
        ),
    )
    shutil.rmtree(tmp, ignore_errors=True)
    table = summarize(rows)
    print_table(table)
    out.write_text(json.dumps({"runs": rows, "table": table, "seconds": time.perf_counter() - t0}, indent=2))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
