"""Time to target accuracy, lazy against eager, deployed over emulated WAN links of 100 and 5 Mbit/s.

A real federation (SuperLink + one SuperNode per Cora partition, ``deploy/federation.py``) whose
SuperNodes each sit in their own network namespace behind a token-bucket link of the given rate
in both directions (``deploy/wan.py``; root only). Every mode runs the same partitions and seed.
A run's time to target is the server's clock (its ``events.jsonl``) at the first round whose
validation accuracy reaches ``--target``; lazy's rounds count across stages, so it includes the
earlier stages and the boundary exchanges. Writes JSON and prints a table. Example::

    sudo python bench/wan_compare.py --rates 100,5 --out bench/results/wan_compare.json

SuperNodes are ``retexo-fl supernode`` (a node worker each); ``--flower-supernode`` measures
Flower's plain SuperNode instead. The default settings are chosen so that both modes reach the
target within a few deployed rounds (local Adam, 10 local epochs a round, plain averaging): a
deployed round on Flower's plain SuperNode costs seconds of plumbing, and the comparison is
about what the link adds on top. ``--defaults`` runs each mode with its own default settings
instead (``MODE_DEFAULTS``; whole runs, as a user gets them)::

    sudo python bench/wan_compare.py --defaults --rates 5 --out bench/results/wan_compare-defaults.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "deploy"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_ROOT, private_planetoid  # noqa: E402
from federation import FederationProcesses  # noqa: E402
from wan import EmulatedWan, wan_unavailable  # noqa: E402

from retexo_fl.data.partition import partition_dirs  # noqa: E402

COMMON = "optimizer='adam' lr='0.01' server-optimizer='avg' local-epochs='10'"
MODES = {
    "lazy": "mode='lazy' stages=3 rounds='6'",
    "lazy-local": "mode='lazy' first-stage='local' stages=3 rounds='6'",
    "eager": "mode='eager' stages=3 rounds='12'",
}
#: ``--defaults``: what each mode name adds to its mode's defaults.
DEFAULT_MODES = {
    "lazy": "mode='lazy'",
    "lazy-local": "mode='lazy' first-stage='local'",
    "eager": "mode='eager'",
}


def round_events(run_dir: Path) -> list[dict]:
    """The run's ``round`` events, in order."""
    events = map(json.loads, (run_dir / "events.jsonl").read_text().splitlines())
    return [e for e in events if e["event"] == "round"]


def time_to_target(rounds: list[dict], target: float) -> tuple[float | None, int | None]:
    """Server seconds and round count at the first round with validation accuracy >= target."""
    for n, event in enumerate(rounds, 1):
        if event.get("val_accuracy", 0.0) >= target:
            return float(event["t"]), n
    return None, None


def median_round_seconds(rounds: list[dict]) -> float:
    """Median seconds between consecutive rounds of the same stage (the link's share per round)."""
    gaps = [b["t"] - a["t"] for a, b in itertools.pairwise(rounds) if a["stage"] == b["stage"]]
    return statistics.median(gaps) if gaps else float("nan")


def deployed_run(
    parts: list[Path],
    work: Path,
    rate: float,
    run_config: str,
    timeout: float,
    worker: bool = True,
    database: bool = True,
) -> Path:
    out = work / "run"
    with EmulatedWan(len(parts), rate) as wan:
        fed = FederationProcesses(work, host=wan.host_address, database=database)
        try:
            netns = [wan.netns(i) for i in range(len(parts))]
            record = fed.run_parties(parts, out, run_config, timeout, netns, worker=worker)
        finally:
            fed.stop_all()
    if record.get("status") != "finished:completed":
        raise RuntimeError(f"run ended {record.get('status')}; logs in {work}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", default=str(DEFAULT_ROOT), help="datasets root (Planetoid/Cora/raw)")
    parser.add_argument("--rates", default="100,5", help="link rates in Mbit/s, comma separated")
    parser.add_argument("--modes", default="lazy,eager", help="lazy, lazy-local (first-stage local), eager")
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument(
        "--target",
        default="0.68",
        help="validation accuracy to reach, or eager-final: eager's final validation accuracy at the "
        "same rate minus --margin (eager then runs first)",
    )
    parser.add_argument("--margin", type=float, default=0.01, help="below eager's final (eager-final)")
    parser.add_argument("--run-config", default="", help="added to every run's config")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one run may take")
    parser.add_argument("--out", default="bench/results/wan_compare.json")
    parser.add_argument(
        "--defaults",
        action="store_true",
        help="each mode with its own default settings instead of the fixed short runs above",
    )
    parser.add_argument(
        "--in-memory",
        action="store_true",
        help="the SuperLink keeps its state in memory, not in its SQLite file (less CPU on 2 cores)",
    )
    parser.add_argument(
        "--flower-supernode",
        action="store_true",
        help="SuperNodes on Flower's plain flower-supernode instead of `retexo-fl supernode`",
    )
    args = parser.parse_args()
    if reason := wan_unavailable():
        print(f"cannot emulate WAN links here: {reason}", file=sys.stderr)
        return 2

    from retexo_fl.cli import main as cli

    tmp = Path(tempfile.mkdtemp(prefix="retexo-wan-"))
    data = private_planetoid(args.root, ("Cora",))
    parts_dir = tmp / "parts"
    cli(["partition", "--dataset", "Cora", "--root", str(data), "--clients", str(args.clients),
         "--out", str(parts_dir)])  # fmt: skip
    parts = partition_dirs(parts_dir)
    rows = []
    relative = args.target == "eager-final"
    modes = args.modes.split(",")
    if relative:  # the target comes from eager's run at each rate
        if "eager" not in modes:
            print("--target eager-final needs eager among --modes", file=sys.stderr)
            return 2
        modes = ["eager"] + [m for m in modes if m != "eager"]
    for rate in (float(r) for r in args.rates.split(",")):
        at_rate = []
        for mode in modes:
            base = DEFAULT_MODES[mode] if args.defaults else f"{MODES[mode]} {COMMON}"
            config = f"{base} {args.run_config}".strip()
            print(f"\n== {mode} at {rate:g} Mbit/s: {config}", flush=True)
            t0 = time.perf_counter()
            worker = not args.flower_supernode
            work = tmp / f"{mode}-{rate:g}"
            run = deployed_run(parts, work, rate, config, args.timeout, worker, not args.in_memory)
            wall = time.perf_counter() - t0
            summary = json.loads((run / "summary.json").read_text())
            events = round_events(run)
            per_client = summary["bytes_total"] / args.clients
            row = {
                "rate_mbit": rate,
                "mode": mode,
                "supernode": "retexo-fl supernode" if worker else "flower-supernode",
                "superlink_state": "in-memory" if args.in_memory else "sqlite",
                "config": config,
                "run_seconds": summary["wall_seconds"],
                "median_round_seconds": median_round_seconds(events),
                "wall_seconds": wall,
                "test_accuracy": summary["test_accuracy"],
                "val_accuracy": summary["val_accuracy"],
                "bytes_total": summary["bytes_total"],
                "bytes_boundary": summary["bytes_boundary"],
                "bytes_model": summary["bytes_model"],
                # What one client's link needs at the rate for its share of the bytes.
                "link_seconds_per_client": per_client * 8 / (rate * 1e6),
            }
            at_rate.append((row, events))
            print(json.dumps(row), flush=True)
        target = at_rate[0][0]["val_accuracy"] - args.margin if relative else float(args.target)
        for row, events in at_rate:
            row["target"] = target
            row["seconds_to_target"], row["rounds_to_target"] = time_to_target(events, target)
            rows.append(row)

    kind = "flower-supernode" if args.flower_supernode else "retexo-fl supernode"
    print(f"\nCora, {args.clients} METIS clients on {kind}, target validation accuracy {args.target}"
          + (f" (minus {args.margin}; {', '.join(f'{r:.4f}' for r in sorted({x['target'] for x in rows}))})"
             if relative else ""))  # fmt: skip
    print(f"{'Mbit/s':>7} {'mode':10} {'to target':>10} {'rounds':>6} {'s/round':>7} {'run s':>7} "
          f"{'link s':>7} {'test':>6} {'MB total':>9} {'MB boundary':>11}")  # fmt: skip
    for r in rows:
        to = f"{r['seconds_to_target']:.1f}" if r["seconds_to_target"] is not None else "not met"
        print(
            f"{r['rate_mbit']:7g} {r['mode']:10} {to:>10} {r['rounds_to_target'] or '-':>6} "
            f"{r['median_round_seconds']:7.1f} "
            f"{r['run_seconds']:7.1f} {r['link_seconds_per_client']:7.1f} {r['test_accuracy']:6.3f} "
            f"{r['bytes_total'] / 1e6:9.2f} {r['bytes_boundary'] / 1e6:11.3f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"clients": args.clients, "target": args.target, "runs": rows}, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
