"""Estimate ``first-stage-race`` settings from two robustness sweeps, without training again.

``first-stage auto`` trains stage 0 as the MLP, then as the local layer, and keeps the better.
``--first-stage-race N --first-stage-race-margin M`` stops the second training once it has run N
rounds and its best validation is more than M below the best the first reached in as many. Each
training is the fixed variant's to the bit (``tests/training/test_first_stage_auto.py``), so a
raced run is known from two sweeps: the local training's curve in an auto run's row
(``stage0_trials``), and, where the race cuts a local training that would have been kept, the
run with the MLP stage 0 fixed (the default sweep's row of the same cell and seed). Rounds are
exact (the cut training sends its rounds plus the one whose replies validate the last); bytes
are estimated from the default run's bytes per round. The rounds are those of the sequential
schedule (``first-stage-schedule sequential``: the two trainings one after the other), which the
rows it reads must have been run with; the parallel schedule, the default since 2026-12-01, sends
the longer training's rounds instead of their sum.

    python bench/first_stage_race.py --auto A.jsonl --default D.jsonl --references R1.jsonl R2.jsonl \\
        --after 2,4,6,8 --margin 0,0.02,0.05 --out bench/results/first-stage-race-DATE.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from robustness import candidate_table, print_candidates, print_table, summarize

from retexo_fl.coordinator.selection import PACE_TOLERANCE


def _key(row: dict) -> tuple:
    return (row["_graph"], row["_part"], row["seed"])


def _cut_at(local: list[float], mlp: list[float], after: int, margin: float) -> int | None:
    """The round at which the race stops the local training (``None``: it runs to its end)."""
    for n in range(max(after, 1), len(local) + 1):
        if max(mlp[:n]) - max(local[:n]) > margin + PACE_TOLERANCE:  # the tracker's rule
            return n
    return None


def raced_row(
    auto: dict, fixed: dict[str, dict | None], after: int, margin: float, tag: str, first: str = "mlp"
) -> dict | None:
    """The row a raced run would have written, the ``first`` variant trained first (``None``: the
    race keeps the first variant where auto kept the second, and ``fixed`` has no run of it)."""
    second = "local" if first == "mlp" else "mlp"
    trials = auto["stage0_trials"]
    cut = _cut_at(trials[second], trials[first], after, margin)
    if cut is None:
        return {**auto, "_tag": tag, "race_cut": None}
    # The first variant is kept (the second's best is below the first's), and the run is that
    # variant's fixed run, plus the second training's rounds.
    run = fixed.get(first)
    if run is None:
        if auto.get("first_stage") != first:
            return None
        run = auto  # auto kept the first variant: the same run, fewer of the second's rounds
        second_full = len(trials[second]) + 1
        per_round = auto["bytes_total"] / max(auto["rounds"], 1)
        base_rounds = auto["rounds"] - second_full
        base_bytes = auto["bytes_total"] - per_round * second_full
    else:
        per_round = run["bytes_total"] / max(run["rounds"], 1)
        base_rounds, base_bytes = run["rounds"], run["bytes_total"]
    return {
        **run,
        "_tag": tag,
        "race_cut": cut,
        "rounds": base_rounds + cut + 1,
        "bytes_total": base_bytes + per_round * (cut + 1),
        "first_stage": first,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--auto", type=Path, required=True, help="robustness rows of first-stage auto")
    ap.add_argument("--default", type=Path, required=True, help="robustness rows of the MLP stage 0")
    ap.add_argument("--references", type=Path, nargs="*", default=[], help="rows with the references")
    ap.add_argument("--local", type=Path, help="robustness rows of first-stage local (the local-first race)")
    ap.add_argument("--after", default="2,4,6,8")
    ap.add_argument("--margin", default="0,0.02,0.05")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    def read(path: Path) -> list[dict]:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def runs(path: Path | None) -> dict[tuple, dict]:
        rows = read(path) if path else []
        return {_key(r): r for r in rows if "error" not in r and r.get("_method") == "lazy"}

    auto = list(runs(args.auto).values())
    default, local = runs(args.default), runs(args.local)
    refs = [r for p in args.references for r in read(p) if r.get("_method") != "lazy"]
    auto = [r for r in auto if _key(r) in default and "stage0_trials" in r]
    if not auto:
        sys.exit("no auto row has a default row of the same cell and seed, and the stage-0 curves")
    rows = [{**default[_key(r)], "_tag": "mlp"} for r in auto] + [{**r, "_tag": "auto"} for r in auto]
    cuts: dict[str, int] = {}
    missing: dict[str, list[str]] = {}
    for first, prefix in (("mlp", "race"), ("local", "lrace")):
        for after in (int(a) for a in args.after.split(",")):
            for margin in (float(m) for m in args.margin.split(",")):
                tag = f"{prefix}{after}m{margin:g}"
                raced = []
                for r in auto:
                    fixed = {"mlp": default[_key(r)], "local": local.get(_key(r))}
                    row = raced_row(r, fixed, after, margin, tag, first)
                    if row is None:
                        missing.setdefault(tag, []).append(" ".join(map(str, _key(r))))
                    else:
                        raced.append(row)
                if tag in missing:  # a candidate with a run it cannot know is left out
                    continue
                cuts[tag] = sum(1 for r in raced if r["race_cut"] is not None)
                rows += raced
    cells = summarize(refs + rows)
    print_table([c for c in cells if c["graph"] == "cora"])
    candidates = candidate_table(cells)
    print_candidates(candidates)
    print(f"\nruns whose second training the race cut (of {len(auto)}): {cuts}")
    for tag, keys in missing.items():
        print(f"{tag}: left out, needs the local run of {len(keys)}: {', '.join(keys)}")
    cora = [c for c in cells if c["graph"] == "cora" and c["partitioning"] == "random-10"]
    print("Cora random-10 (headline: >= 0.81, <= 100 rounds, <= 38 MB):")
    for c in sorted(cora, key=lambda c: c["tag"]):
        mb = c["bytes_total"] / 1e6
        print(f"  {c['tag']:<14}{c['lazy_test']:.3f}  {c['rounds']:5.0f} rounds  {mb:5.1f} MB")
    if args.out:
        out = {"cells": cells, "candidates": candidates, "cuts": cuts, "missing": missing}
        args.out.write_text(json.dumps(out))  # 25 candidates x 54 cells: compact
        print(f"-> {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
