"""Which round and stage a lazy run delivers, by other rules than the best raw validation accuracy,
estimated offline from runs that also recorded every validated round's test accuracy.

Lazy training keeps, within each stage (and each stage-0 training of ``first-stage auto``), the
round of best validation accuracy, and delivers the stage with the best of those. On a small,
noisy validation set the maximum over many rounds and stages is biased upward (a winner's
curse). This script asks whether a smoothed reading of each validation curve chooses better.

``--collect`` runs the defaults on the graphs and partitionings of ``robustness.py`` with every
validated round's state also tested (the test is read, never used to choose), one JSON row a run.
Without it the rows given are read and each rule's choice replayed on them:

- ``raw``: the rule the code applies (best round, then best stage; ties to the first round and
  the later stage);
- ``trailN``: a round's score is the mean validation of it and the ``N - 1`` rounds before;
- ``centerN``: the mean of the rounds within ``N`` on each side;
- ``emaA``: an exponential moving average with weight ``A`` on the newest round.

Usage::

    python bench/selection_rules.py --collect --root ../shared/datasets --out rows.jsonl
    python bench/selection_rules.py bench/results/selection-rules-2026-11-30-s33.jsonl --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

RULES: dict[str, tuple[str, float]] = {
    "raw": ("raw", 0),
    "trail2": ("trail", 2),
    "trail3": ("trail", 3),
    "center1": ("center", 1),
    "center2": ("center", 2),
    "ema0.5": ("ema", 0.5),
    "ema0.3": ("ema", 0.3),
}


def segments(run: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """The run's validation curves: one a stage, and one per stage-0 training under ``auto``."""
    out = []
    for stage in run["stages"]:
        rows = stage["history"]
        variants = list(dict.fromkeys(r["first_stage"] for r in rows if "first_stage" in r))
        out.extend([[r for r in rows if r.get("first_stage") == v] for v in variants] or [rows])
    return [s for s in out if s]


def scores(curve: list[dict[str, Any]], rule: tuple[str, float]) -> list[float]:
    """Each round's score under ``rule``."""
    val = [float(r["val_accuracy"]) for r in curve]
    kind, n = rule
    if kind == "raw":
        return val
    if kind == "ema":
        out: list[float] = []
        for v in val:
            out.append(v if not out else n * v + (1 - n) * out[-1])
        return out
    lo = (lambda i: max(0, i - int(n) + 1)) if kind == "trail" else (lambda i: max(0, i - int(n)))
    hi = (lambda i: i + 1) if kind == "trail" else (lambda i: i + int(n) + 1)
    return [statistics.mean(val[lo(i) : hi(i)]) for i in range(len(val))]


def chosen_test(run: dict[str, Any], rule: tuple[str, float]) -> float:
    """The test accuracy of the round ``rule`` delivers."""
    best: tuple[float, float] | None = None
    for curve in segments(run):
        s = scores(curve, rule)
        i = max(range(len(s)), key=lambda j: (s[j], -j))  # the first round of the best score
        if best is None or s[i] >= best[0]:  # ties to the later stage
            best = (s[i], float(curve[i]["test_accuracy"]))
    assert best is not None
    return best[1]


def table(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean test accuracy per cell and rule, the mean over cells, and each rule's change
    against ``raw`` in its worst cell (points)."""
    cells: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for run in rows:
        for name, rule in RULES.items():
            cells[(run["graph"], run["part"])][name].append(chosen_test(run, rule))
    per_cell = {
        f"{g} {p}": {name: statistics.mean(v) for name, v in c.items()} | {"runs": len(c["raw"])}
        for (g, p), c in sorted(cells.items())
    }
    summary = {}
    for name in RULES:
        changes = {cell: 100 * (c[name] - c["raw"]) for cell, c in per_cell.items()}
        worst = min(changes, key=changes.__getitem__)
        summary[name] = {
            "mean_test": statistics.mean(c[name] for c in per_cell.values()),
            "worst_change_points": changes[worst],
            "worst_cell": worst,
            "cells_better": sum(v > 1e-9 for v in changes.values()),
            "cells_worse": sum(v < -1e-9 for v in changes.values()),
        }
    return {"cells": per_cell, "summary": summary}


def collect(root: Path, out: Path, jobs: list[tuple[str, str, int]]) -> None:
    """Run the defaults with every validated round's state also tested; append one row a run."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    import robustness

    from retexo_fl.config import TrainConfig
    from retexo_fl.coordinator import round_loop
    from retexo_fl.metrics import RunRecorder
    from retexo_fl.runner import train

    record = round_loop.RoundLoop._record

    def tested(self, rs, round_, val, refresh):  # the test is read, never used to choose
        record(self, rs, round_, val, refresh)
        fed = self.fed
        pids = [p for p in fed.live() if fed.tests(p)]
        t = round_loop.total(fed.evaluate(rs.view, "test", rs.tracker.stage, None, pids=pids))
        rs.tracker.history[-1]["test_accuracy"] = t.correct / t.count

    round_loop.RoundLoop._record = tested
    specs = robustness.graphs(root)
    for graph, part, seed in jobs:
        spec, split = specs[graph]
        method, clients = part.rsplit("-", 1)
        run = {"dataset": spec, "split": split, "method": method, "clients": int(clients), "seed": seed}
        if graph in robustness.MULTI_SPLIT:
            run["split_index"] = seed
        try:
            cfg = TrainConfig.resolve(data_root=str(root), device="cpu", **run)
            s = train(cfg, RunRecorder(None, stream=None)).to_dict()
        except Exception as exc:  # one run that fails must not end the collection
            print(f"{graph} {part} seed {seed}: {type(exc).__name__}: {exc}", flush=True)
            continue
        keep = ("round", "val_accuracy", "test_accuracy", "first_stage")
        stages = [
            {"stage": st["stage"], "history": [{k: h[k] for k in keep if k in h} for h in st["history"]]}
            for st in s["stages"]
        ]
        row = {"graph": graph, "part": part, "seed": seed}
        row |= {"test": s["test_accuracy"], "val": s["val_accuracy"]}
        with out.open("a") as f:
            f.write(json.dumps({**row, "kept": s.get("kept_stage"), "stages": stages}) + "\n")
        print(f"{graph} {part} seed {seed}: test {s['test_accuracy']:.3f}", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rows", nargs="*", type=Path, help="JSON-lines rows of --collect")
    ap.add_argument("--collect", action="store_true", help="run the defaults and write rows to --out")
    ap.add_argument("--root", type=Path, default=Path("../shared/datasets"))
    ap.add_argument("--out", type=Path, help="--collect: the rows file (appended)")
    ap.add_argument("--graphs", default="all", help="--collect: comma-separated, or all")
    ap.add_argument("--partitionings", default="metis-4,random-10,label-skew-10")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--json", type=Path, help="write the table here")
    args = ap.parse_args(argv)
    if args.collect:
        if args.out is None:
            ap.error("--collect needs --out")
        import robustness

        names = list(robustness.graphs(args.root)) if args.graphs == "all" else args.graphs.split(",")
        parts = args.partitionings.split(",")
        seeds = [int(s) for s in args.seeds.split(",")]
        collect(args.root, args.out, [(g, p, s) for g in names for s in seeds for p in parts])
        return
    if not args.rows:
        ap.error("give rows to read, or --collect")
    rows = [json.loads(line) for path in args.rows for line in path.read_text().splitlines() if line]
    result = table(rows)
    names = list(RULES)
    cells = len(result["cells"])
    print(f"| rule | mean test over {cells} cells | worst change vs raw (cell) | cells better / worse |")
    print("|---|---:|---|---:|")
    for name in names:
        s = result["summary"][name]
        print(
            f"| {name} | {s['mean_test']:.4f} | {s['worst_change_points']:+.1f} ({s['worst_cell']}) | "
            f"{s['cells_better']} / {s['cells_worse']} |"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
