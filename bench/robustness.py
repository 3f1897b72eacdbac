"""Every shared graph x partitioning: lazy defaults against the centralized GCN and MLP, and eager.

One table, the worst cell first: for each graph (the shared datasets, the Twitch social graphs as
plain files, the filtered Chameleon and Squirrel npz files) and partitioning (4 METIS, 10 random,
10 label-skew clients), the lazy default's test accuracy (mean ± std over seeds), the centralized
GCN's and MLP's, the eager default's, and the gap from lazy to the better centralized reference
(the one with the higher mean validation accuracy on that graph: the choice reads validation
only), with its standard error from the gaps split by split (runs of one seed share a split). Lazy's
rounds, bytes and wall seconds go beside it, and the centralized GCN's wall seconds (compare them
only from a run with one worker and nothing else on the machine). A lazy run whose delivered model
validates below its stage 0 is flagged (``below-stage-0``). The centralized references do not
depend on the partitioning: one run per graph and seed serves every row of that graph.

``--attribute`` splits each cell's gap in two: the lazy candidate also runs with one client that
holds the whole graph (no cut edge, nothing averaged), once per graph and seed. Its gap to the
reference is what lazy training itself costs on that graph (stage by stage, over frozen
embeddings, with the lazy recipe); the rest of the cell's gap is what the partitioning and
federation cost. The causes of the cells more than 1 point below are printed under the table.

Candidate settings for lazy are given with ``--set key=value`` (repeatable; the defaults
otherwise); ``--tag`` names the candidate in the JSON. Examples::

    python bench/robustness.py --quick                                 # 3 social graphs, 1 seed
    python bench/robustness.py --seeds 0,1,2 --out bench/results/robustness.json
    python bench/robustness.py --graphs twitch-ES,squirrel --set root-weight=true --tag root
    python bench/robustness.py --graphs twitch-TW --attribute --lazy-only --partitionings metis:4

Every run is appended at once to ``<out stem>.jsonl``, so a cut-off run keeps what it measured.
A row keeps each stage's wall seconds, and each stage-0 training's under ``first-stage auto``
(:func:`run_row`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_ROOT, run_jobs

TWITCH = ("ENGB", "ES", "FR", "PTBR", "RU", "TW")
RANDOM_SPLIT = "random:0.6,0.2,0.2"


def graphs(root: Path) -> dict[str, tuple[str, str]]:
    """Graph name -> (``--dataset`` value, split) over the datasets under ``root``."""
    out: dict[str, tuple[str, str]] = {
        "cora": ("Cora", "public"),
        "citeseer": ("CiteSeer", "public"),
        "actor": ("Actor", "public"),
        "cornell": ("Cornell", "public"),
        "texas": ("Texas", "public"),
        "wisconsin": ("Wisconsin", "public"),
        "usa": ("USA", RANDOM_SPLIT),
        "brazil": ("Brazil", RANDOM_SPLIT),
        "europe": ("Europe", RANDOM_SPLIT),
        "tolokers": ("Tolokers", "public"),
    }
    for name in ("chameleon", "squirrel"):
        out[name] = (str(root / "heterophilous-npz" / f"{name}_filtered.npz"), "public")
    for c in TWITCH:
        base = root / "Twitch" / c / f"musae_{c}"
        spec = (
            f"files:edges={base}_edges.csv,features={base}_features.json,labels={base}_target.csv,"
            "id-column=new_id,label-column=mature"
        )
        out[f"twitch-{c}"] = (spec, RANDOM_SPLIT)
    return out


#: Graphs that ship several fixed splits (the Geom-GCN splits of WebKB and Actor, the filtered
#: heterophilous npz files, Tolokers): seed ``s`` trains on split ``s`` (``--split-per-seed``), so
#: three seeds are three test sets, as the papers average them; one 37-node WebKB test set
#: moves 2.7 points a node.
MULTI_SPLIT = ("actor", "cornell", "texas", "wisconsin", "tolokers", "chameleon", "squirrel")

#: The partitionings of every row: (method, clients).
PARTITIONINGS = (("metis", 4), ("random", 10), ("label-skew", 10))

#: ``--attribute``: the run's ``_method`` and ``_part`` for lazy training with one client holding
#: the whole graph.
WHOLE_METHOD = "lazy-whole"
WHOLE_PART = "random-1"
#: A cell this far below its reference (or further) gets its cause printed under the table.
ATTRIBUTED_GAP = -0.01

#: ``--tune-references``: each centralized reference (GCN and MLP) runs at every one of these
#: settings, and the cell compares with the one that validates best (mean over seeds). Four
#: settings a reference: the lazy candidates compared in one table are about as many.
REFERENCE_GRID = tuple({"hidden": hidden, "weight_decay": wd} for hidden in (64, 256) for wd in (5e-4, 5e-3))
QUICK_GRAPHS = ("twitch-ES", "twitch-PTBR", "squirrel")


def private_root(root: Path) -> Path:
    """A private copy of the datasets with PyG's ``processed/`` files written once, here.

    PyG writes ``processed/`` beside ``raw/``: workers that each process the same folder race,
    and the shared folder is not ours to write.
    """
    tmp = Path(tempfile.mkdtemp(prefix="retexo-robustness-"))
    shutil.copytree(root, tmp / "datasets", ignore=shutil.ignore_patterns("processed"))
    load = (
        "import sys\nfrom retexo_fl.data.datasets import load_dataset\n"
        "for n in sys.argv[2:]: load_dataset(n, sys.argv[1], split='random:0.6,0.2,0.2')"
    )
    names = [
        "Cora",
        "CiteSeer",
        "Actor",
        "Cornell",
        "Texas",
        "Wisconsin",
        "USA",
        "Brazil",
        "Europe",
        "Tolokers",
    ]
    subprocess.run([sys.executable, "-c", load, str(tmp / "datasets"), *names], check=True)
    return tmp / "datasets"


def _job(args: tuple[dict, str]) -> dict:
    settings, root = args
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    from retexo_fl.config import TrainConfig
    from retexo_fl.metrics import RunRecorder
    from retexo_fl.runner import train

    run = {k: v for k, v in settings.items() if not k.startswith("_")}
    try:
        summary = train(
            TrainConfig.resolve(data_root=root, device="cpu", **run), RunRecorder(None, stream=None)
        )
    except Exception as exc:  # one graph that cannot be read or trained must not end the sweep
        return {
            **{k: v for k, v in settings.items() if k != "dataset"},
            "error": f"{type(exc).__name__}: {exc}",
        }
    return run_row(settings, summary)


def run_row(settings: dict, summary: Mapping[str, Any]) -> dict:
    """A run's JSON row: its settings (without the dataset spec) and what the table reads.

    Besides the accuracies, rounds and bytes, a row carries each stage's wall seconds
    (``stage_seconds``; a lazy run's self-training pass's stages after the first pass's) and, under
    ``first-stage auto``, each stage-0 training's seconds and rounds (``stage0_trial_seconds``,
    ``stage0_trial_rounds``), so that a run's wall can be split without running it again. The
    stage rows (``stage0_val``, ``stage_vals``, ``stage_tests``) are the chain's; a tested sprint
    lane (``first-stage-sprint``) is its own ``sprint_val`` and ``sprint_test`` (rows written before
    session 46's change listed it first in ``stage_vals``), and ``kept_variant`` says when the run
    delivered it.

    Args:
        settings (dict): the job's settings (``_``-prefixed keys are the table's labels).
        summary (Mapping[str, Any]): the run's summary (a :class:`~retexo_fl.summary.RunSummary`
            or its :meth:`~retexo_fl.summary.RunSummary.to_dict`).
    """
    stages = summary.get("stages", [])
    every = summary.get("stage_results") or []
    results = [r for r in every if "variant" not in r]  # the chain's stages
    sprint = [r for r in every if "variant" in r]
    stage0 = results[0]["val_accuracy"] if results else None
    # first-stage auto: each stage-0 training's validation curve, to study when to stop the second
    trials: dict[str, list[float]] = {}
    for row in stages[0].get("history", []) if stages else []:
        if "first_stage" in row:
            trials.setdefault(row["first_stage"], []).append(row["val_accuracy"])
    each = (stages[0].get("first_stage_trials") or []) if stages else []
    timed = {
        "stage0_trial_seconds": {t["variant"]: t["seconds"] for t in each},
        "stage0_trial_rounds": {t["variant"]: t["rounds_sent"] for t in each},
    }
    return {
        **{k: v for k, v in settings.items() if k != "dataset"},
        "test_accuracy": summary["test_accuracy"],
        "val_accuracy": summary["val_accuracy"],
        "stage0_val": stage0,
        "kept_stage": summary.get("kept_stage"),
        **({"kept_variant": summary["kept_variant"]} if summary.get("kept_variant") else {}),
        **(
            {"sprint_val": sprint[0]["val_accuracy"], "sprint_test": sprint[0].get("test_accuracy")}
            if sprint
            else {}
        ),
        "stage_vals": [r["val_accuracy"] for r in results],
        # Reported to explain a cell (which stage would have tested how), never used to choose.
        "stage_tests": [r.get("test_accuracy") for r in results],
        **({"stage0_trials": trials, "first_stage": stages[0].get("first_stage")} if trials else {}),
        "rounds": sum(s.get("rounds_sent", 0) for s in stages),
        "bytes_total": summary.get("bytes_total", 0),
        "wall_seconds": summary["wall_seconds"],
        **({"stage_seconds": [s.get("seconds") for s in stages]} if stages else {}),
        **(timed if each else {}),
    }


def grid(args: argparse.Namespace, table: dict[str, tuple[str, str]]) -> list[dict]:
    """Every run: per graph and seed the two centralized references, per partitioning lazy and eager."""
    jobs = []
    lazy_set = dict(parse_set(s) for s in args.set)
    for name in args.graphs:
        dataset, split = table[name]
        for seed in args.seeds:
            base = {"_graph": name, "dataset": dataset, "split": split}
            if args.split_per_seed and name in MULTI_SPLIT:
                base["split_index"] = seed
            if not args.lazy_only:
                for ref in REFERENCE_GRID if args.tune_references else ({},):
                    tag = {"_ref_config": reference_tag(ref)} if ref else {}
                    jobs.append(
                        {**base, **ref, **tag, "_method": "central-gcn", "mode": "centralized", "seed": seed}
                    )
                    jobs.append(
                        {
                            **base,
                            **ref,
                            **tag,
                            "_method": "central-mlp",
                            "mode": "centralized",
                            "model": "mlp",
                            "seed": seed,
                        }
                    )
            if args.references_only:
                continue
            for method, clients in args.partitionings:
                part = {"method": method, "clients": clients, "seed": seed, "_part": f"{method}-{clients}"}
                jobs.append({**base, **part, **lazy_set, "_method": "lazy", "_tag": args.tag, "mode": "lazy"})
                if args.eager:
                    jobs.append({**base, **part, "_method": "eager", "mode": "eager"})
            if args.attribute:
                whole = {"method": "random", "clients": 1, "seed": seed, "_part": WHOLE_PART}
                jobs.append(
                    {**base, **whole, **lazy_set, "_method": WHOLE_METHOD, "_tag": args.tag, "mode": "lazy"}
                )
    return jobs


def reference_tag(settings: dict) -> str:
    """A reference setting's name in the JSON rows: ``hidden=256,weight_decay=0.005``."""
    return ",".join(f"{k}={v}" for k, v in sorted(settings.items()))


def best_reference(rows: list[dict]) -> tuple[str, list[dict]]:
    """The reference setting whose mean validation over seeds is highest, and its rows.

    Rows without a setting (the references at their defaults) form one setting, ``""``.
    """
    by_setting: dict[str, list[dict]] = {}
    for r in rows:
        by_setting.setdefault(r.get("_ref_config", ""), []).append(r)
    best = max(sorted(by_setting), key=lambda k: _stats([r["val_accuracy"] for r in by_setting[k]])[0])
    return best, by_setting[best]


def parse_set(text: str) -> tuple[str, object]:
    """``key=value`` -> (snake_case key, JSON value, a per-stage setting's comma list as the CLI
    reads it (``server-optimizer=adam,avg``), or the string itself)."""
    from retexo_fl.config import PER_STAGE, parse_list

    key, _, value = text.partition("=")
    name = key.strip().replace("-", "_")
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = parse_list(value) if name in PER_STAGE else value
    return name, parsed


def _stats(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def paired_gap_se(lazy: list[dict], reference: list[dict]) -> float | None:
    """The standard error of a cell's test gap, from the gaps seed by seed.

    Runs are paired by seed and split (``split_index``, on the graphs that ship several splits;
    a random split is drawn from the seed), so a pair shares its test nodes: the gap's spread is
    then the spread of the difference, not the two spreads added. ``None`` with fewer than two
    pairs.
    """
    ref_by_split = {(r["seed"], r.get("split_index")): r["test_accuracy"] for r in reference}
    pairs = [(r["test_accuracy"], (r["seed"], r.get("split_index"))) for r in lazy]
    gaps = [accuracy - ref_by_split[key] for accuracy, key in pairs if key in ref_by_split]
    if len(gaps) < 2:
        return None
    return statistics.stdev(gaps) / math.sqrt(len(gaps))


def summarize(rows: list[dict]) -> list[dict]:
    """One cell per (graph, partitioning, lazy tag): means, the reference and the gap.

    Where the tag also ran with one client holding the whole graph (``--attribute``), the gap is
    split: ``whole_gap``, that run's gap to the same reference (lazy training's own cost), and
    ``partition_gap``, the rest (the partitioning's and federation's). Runs that failed (an
    ``error`` row) are left out; :func:`main` prints them.
    """
    rows = [r for r in rows if "error" not in r]
    cells = []
    graphs_seen = sorted({r["_graph"] for r in rows})
    for g in graphs_seen:
        ref_rows = {
            m: [r for r in rows if r["_graph"] == g and r["_method"] == m]
            for m in ("central-gcn", "central-mlp")
        }
        refs = {m: best_reference(rs)[1] for m, rs in ref_rows.items() if rs}
        ref = max(refs, key=lambda m: _stats([r["val_accuracy"] for r in refs[m]])[0]) if refs else None
        lazy = [r for r in rows if r["_graph"] == g and r["_method"] == "lazy"]
        for part, tag in sorted({(r["_part"], r.get("_tag", "")) for r in lazy}):
            mine = [r for r in lazy if r["_part"] == part and r.get("_tag", "") == tag]
            eager = [r for r in rows if r["_graph"] == g and r["_method"] == "eager" and r["_part"] == part]
            cell = {"graph": g, "partitioning": part, "tag": tag, "seeds": len(mine)}
            cell["lazy_test"], cell["lazy_std"] = _stats([r["test_accuracy"] for r in mine])
            cell["lazy_val"] = _stats([r["val_accuracy"] for r in mine])[0]
            for m, rs in refs.items():
                cell[f"{m}_test"], cell[f"{m}_std"] = _stats([r["test_accuracy"] for r in rs])
                cell[f"{m}_val"] = _stats([r["val_accuracy"] for r in rs])[0]
                cell[f"{m}_setting"] = rs[0].get("_ref_config", "")
                if all("wall_seconds" in r for r in rs):  # rows saved by hand may lack it
                    cell[f"{m}_wall_seconds"] = _stats([r["wall_seconds"] for r in rs])[0]
            if eager:
                cell["eager_test"], cell["eager_std"] = _stats([r["test_accuracy"] for r in eager])
            if ref is not None:
                cell["reference"] = ref
                cell["gap"] = cell["lazy_test"] - cell[f"{ref}_test"]
                cell["val_gap"] = cell["lazy_val"] - cell[f"{ref}_val"]
                cell["gap_se"] = paired_gap_se(mine, refs[ref])
                whole = [
                    r
                    for r in rows
                    if r["_graph"] == g and r["_method"] == WHOLE_METHOD and r.get("_tag", "") == tag
                ]
                if whole:
                    cell["whole_test"] = _stats([r["test_accuracy"] for r in whole])[0]
                    cell["whole_gap"] = cell["whole_test"] - cell[f"{ref}_test"]
                    cell["whole_gap_se"] = paired_gap_se(whole, refs[ref])
                    cell["partition_gap"] = cell["gap"] - cell["whole_gap"]
            cell["rounds"] = _stats([r["rounds"] for r in mine])[0]
            cell["bytes_total"] = _stats([r["bytes_total"] for r in mine])[0]
            cell["wall_seconds"] = _stats([r["wall_seconds"] for r in mine])[0]
            # "0s": the sprint lane of stage 0 delivered (first-stage-sprint), not the chain's stage 0
            cell["kept_stages"] = [
                f"{r['kept_stage']}s" if r.get("kept_variant") == "sprint" else r["kept_stage"] for r in mine
            ]
            cell["below_stage_0"] = sum(
                1 for r in mine if r["stage0_val"] is not None and r["val_accuracy"] < r["stage0_val"]
            )
            cells.append(cell)
    return sorted(cells, key=lambda c: c.get("gap", 0.0))


def print_table(cells: list[dict]) -> None:
    """The table, worst gap first."""

    def pm(c: dict, key: str) -> str:
        return f"{c[key + '_test']:.3f}±{c[key + '_std']:.3f}" if key + "_test" in c else "-"

    head = (
        f"{'graph':<14}{'clients':<14}{'tag':<8}{'lazy':>13}{'central GCN':>13}{'central MLP':>13}"
        f"{'eager':>13}{'gap':>8}{'± se':>6}{'rounds':>8}{'MB':>8}{'s':>7}{'GCN s':>7}  kept stages"
    )
    print(head)
    print("-" * len(head))
    for c in cells:
        lazy = f"{c['lazy_test']:.3f}±{c['lazy_std']:.3f}"
        gap = f"{100 * c['gap']:+.1f}" if "gap" in c else "-"
        se = f"{100 * c['gap_se']:.1f}" if c.get("gap_se") is not None else "-"
        flag = f"  below-stage-0 x{c['below_stage_0']}" if c["below_stage_0"] else ""
        gcn_s = f"{c['central-gcn_wall_seconds']:.1f}" if "central-gcn_wall_seconds" in c else "-"
        print(
            f"{c['graph']:<14}{c['partitioning']:<14}{c['tag']:<8}{lazy:>13}{pm(c, 'central-gcn'):>13}"
            f"{pm(c, 'central-mlp'):>13}{pm(c, 'eager'):>13}{gap:>8}{se:>6}{c['rounds']:>8.0f}"
            f"{c['bytes_total'] / 1e6:>8.1f}{c['wall_seconds']:>7.1f}{gcn_s:>7}  {c['kept_stages']}{flag}"
        )


def cause(cell: dict) -> str | None:
    """What a cell more than 1 point below its reference owes its gap to, from ``--attribute``'s
    split; ``None`` for a cell within 1 point or without the split.

    The larger share names the cause: lazy training itself (one client holding the whole graph
    trails about as far) or the partitioning and federation (that client does not).
    """
    if "whole_gap" not in cell or cell["gap"] > ATTRIBUTED_GAP:
        return None
    whole, split = 100 * cell["whole_gap"], 100 * cell["partition_gap"]
    # The one-client runs' own spread: at 3 seeds on a small test set it is as wide as the cell's.
    se = f" ± {100 * cell['whole_gap_se']:.1f}" if cell.get("whole_gap_se") is not None else ""
    shares = f"one client holding the whole graph {whole:+.1f}{se}, the partitioning {split:+.1f}"
    if whole <= split:
        return f"lazy training itself ({shares})"
    return f"the partitioning and federation ({shares})"


def print_causes(cells: list[dict]) -> None:
    """Under the table, each attributed cell more than 1 point below, with its cause."""
    lines = [(c, cause(c)) for c in cells]
    lines = [(c, why) for c, why in lines if why is not None]
    if not lines:
        return
    print(f"\nCells more than {-100 * ATTRIBUTED_GAP:.0f} point below, and why:")
    for c, why in lines:
        print(f"  {c['graph']} {c['partitioning']} {c['tag']}: {100 * c['gap']:+.1f}: {why}")


def candidate_table(cells: list[dict]) -> list[dict]:
    """Per lazy tag over the cells it ran: the worst and mean gap on validation and on test.

    Candidates are chosen by the worst validation gap, then the mean; compare only tags that ran
    the same cells (the table gives the count).
    """
    out = []
    for tag in sorted({c["tag"] for c in cells}):
        mine = [c for c in cells if c["tag"] == tag and "gap" in c]
        if not mine:
            continue
        worst_val = min(mine, key=lambda c: c["val_gap"])
        worst_test = min(mine, key=lambda c: c["gap"])
        out.append(
            {
                "tag": tag,
                "cells": len(mine),
                "worst_val_gap": worst_val["val_gap"],
                "worst_val_cell": f"{worst_val['graph']} {worst_val['partitioning']}",
                "mean_val_gap": statistics.mean(c["val_gap"] for c in mine),
                "worst_test_gap": worst_test["gap"],
                "worst_test_cell": f"{worst_test['graph']} {worst_test['partitioning']}",
                "mean_test_gap": statistics.mean(c["gap"] for c in mine),
                "mean_rounds": statistics.mean(c["rounds"] for c in mine),
                "mean_mb": statistics.mean(c["bytes_total"] for c in mine) / 1e6,
            }
        )
    return sorted(out, key=lambda r: (-r["worst_val_gap"], -r["mean_val_gap"]))


def print_candidates(rows: list[dict]) -> None:
    """The candidate table, best first (worst validation gap, then mean), in points."""
    if len(rows) < 2:
        return
    head = (
        f"\n{'candidate':<12}{'cells':>6}{'worst val':>10}  {'(cell)':<26}{'mean val':>9}"
        f"{'worst test':>11}  {'(cell)':<26}{'mean test':>10}{'rounds':>8}{'MB':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['tag']:<12}{r['cells']:>6}{100 * r['worst_val_gap']:>+10.1f}  {r['worst_val_cell']:<26}"
            f"{100 * r['mean_val_gap']:>+9.2f}{100 * r['worst_test_gap']:>+11.1f}  {r['worst_test_cell']:<26}"
            f"{100 * r['mean_test_gap']:>+10.2f}{r['mean_rounds']:>8.0f}{r['mean_mb']:>7.1f}"
        )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=DEFAULT_ROOT, help="the shared datasets folder")
    ap.add_argument("--graphs", default="all", help="comma-separated names, or all")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument(
        "--partitionings",
        default="metis:4,random:10,label-skew:10",
        help="METHOD:CLIENTS,... (default: all three)",
    )
    ap.add_argument("--set", action="append", default=[], help="a lazy setting, key=value (repeatable)")
    ap.add_argument("--tag", default="default", help="names the lazy candidate in the JSON")
    ap.add_argument("--eager", action="store_true", help="also run the eager default")
    ap.add_argument(
        "--attribute",
        action="store_true",
        help="also run the lazy candidate with one client holding the whole graph, to split each gap",
    )
    ap.add_argument("--lazy-only", action="store_true", help="skip the centralized references")
    ap.add_argument("--references-only", action="store_true", help="only the centralized references")
    ap.add_argument(
        "--tune-references",
        action="store_true",
        help="run each reference at every setting of REFERENCE_GRID; cells use the best on validation",
    )
    ap.add_argument(
        "--split-per-seed",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=f"seed s uses split s on the graphs that ship several ({', '.join(MULTI_SPLIT)}); "
        "--no-split-per-seed keeps split 0 (the rows before 2026-11-27)",
    )
    ap.add_argument("--quick", action="store_true", help=f"{', '.join(QUICK_GRAPHS)}, seed 0")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("robustness.json"))
    ap.add_argument("--from-jsonl", type=Path, nargs="*", help="summarize runs saved earlier instead")
    args = ap.parse_args(argv)
    if args.from_jsonl:
        rows = [json.loads(line) for p in args.from_jsonl for line in p.read_text().splitlines() if line]
        cells = summarize(rows)
        print_table(cells)
        print_causes(cells)
        print_candidates(candidate_table(cells))
        return
    table = graphs(args.root)
    args.graphs = (
        list(QUICK_GRAPHS)
        if args.quick
        else (list(table) if args.graphs == "all" else args.graphs.split(","))
    )
    unknown = [g for g in args.graphs if g not in table]
    if unknown:
        ap.error(f"unknown graph(s) {', '.join(unknown)}; known: {', '.join(table)}")
    # An empty list runs no partitioning: with --attribute, the one-client runs alone.
    args.partitionings = [(p.split(":")[0], int(p.split(":")[1])) for p in args.partitionings.split(",") if p]
    args.seeds = [0] if args.quick else [int(s) for s in args.seeds.split(",")]
    root = private_root(args.root)
    jobs = grid(args, graphs(root))
    try:
        rows = run_jobs(
            _job,
            jobs,
            str(root),
            args.out.with_suffix(".jsonl"),
            args.workers,
            lambda r: (
                f"{r['_graph']} {r.get('_part', '')} {r['_method']} seed {r['seed']}: "
                + (
                    f"FAILED {r['error']}"
                    if "error" in r
                    else f"test {r['test_accuracy']:.3f} val {r['val_accuracy']:.3f}"
                )
            ),
        )
    finally:
        shutil.rmtree(root.parent, ignore_errors=True)
    cells = summarize(rows)
    print_table(cells)
    for r in rows:
        if "error" in r:
            print(f"FAILED {r['_graph']} {r.get('_part', '')} {r['_method']} seed {r['seed']}: {r['error']}")
    print_causes(cells)
    candidates = candidate_table(cells)
    print_candidates(candidates)
    args.out.write_text(json.dumps({"cells": cells, "candidates": candidates, "runs": rows}, indent=1))
    print(f"-> {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
