"""Bit-width benchmark: lazy GCN accuracy and boundary bytes at 32 / 8 / 4 / 2 bits and adaptive widths.

Cora and CiteSeer (public split), 4 and 10 METIS clients, mean of seeds; every setting is compared
with 32 bits on the same partitions and seeds. Prints a table and writes JSON. Example::

    python bench/bits.py --seeds 0,1,2 --out bench/results/bits.json
    python bench/bits.py --quick          # Cora, 4 clients, one seed
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_ROOT, private_planetoid, run_jobs

SETTINGS = {
    "32": {"bits": 32},
    "8": {"bits": 8},
    "4": {"bits": 4},
    "2": {"bits": 2},
    "adaptive@4b": {"bit_policy": "adaptive-budget", "byte_budget": "4b"},
}


def _job(args: tuple[dict, str]) -> dict:
    settings, root = args
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    from retexo_fl.config import TrainConfig
    from retexo_fl.metrics import RunRecorder
    from retexo_fl.runner import train

    run = {k: v for k, v in settings.items() if k != "setting"}
    summary = train(TrainConfig.resolve(data_root=root, **run), RunRecorder(None, stream=None))
    exchanged = [s for s in summary["stages"] if "bytes_boundary_sent" in s]
    return {
        **settings,
        "test_accuracy": summary["test_accuracy"],
        "bytes_boundary": summary["bytes_boundary"],
        "bytes_exchange_sent": sum(s["bytes_boundary_sent"] for s in exchanged),
        "bytes_exchange_raw": sum(s["bytes_boundary_raw"] for s in exchanged),
        "bit_histogram": summary["bit_histogram"],
        "wall_seconds": summary["wall_seconds"],
    }


def grid(quick: bool, seeds: list[int], stages: int, rounds: int) -> list[dict]:
    datasets, clients = (["Cora"], [4]) if quick else (["Cora", "CiteSeer"], [4, 10])
    seeds = seeds[:1] if quick else seeds
    return [
        {
            "setting": name,
            "dataset": ds,
            "clients": k,
            "method": "metis",
            "seed": seed,
            "stages": stages,
            "rounds": rounds,
            **SETTINGS[name],
        }
        for seed, ds, k, name in itertools.product(seeds, datasets, clients, SETTINGS)
    ]


def summarize(rows: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["dataset"], r["clients"], r["setting"]), []).append(r)
    table = []
    for (ds, k, name), rs in groups.items():
        base = groups.get((ds, k, "32"), [])
        acc = statistics.mean(r["test_accuracy"] for r in rs)
        sent = statistics.mean(r["bytes_exchange_sent"] for r in rs)
        raw = statistics.mean(r["bytes_exchange_raw"] for r in rs)
        hist: dict[str, int] = {}
        for r in rs:
            for b, n in r["bit_histogram"].items():
                hist[b] = hist.get(b, 0) + n
        table.append(
            {
                "dataset": ds,
                "clients": k,
                "setting": name,
                "seeds": len(rs),
                "test_mean": acc,
                "test_std": statistics.pstdev(r["test_accuracy"] for r in rs),
                "gap_to_32": acc - statistics.mean(r["test_accuracy"] for r in base) if base else None,
                "bytes_sent": sent,
                "fraction_of_32": sent / raw if raw else None,
                "bit_histogram": hist,
            }
        )
    order = list(SETTINGS)
    table.sort(key=lambda r: (r["dataset"], r["clients"], order.index(r["setting"])))
    return table


def print_table(table: list[dict]) -> None:
    head = (
        f"{'dataset':9} {'K':>3} {'bits':12} {'test acc':>15} {'vs 32':>7} {'boundary B':>12} "
        f"{'of 32-bit':>9}  widths"
    )
    print(head)
    print("-" * len(head))
    for r in table:
        gap = "" if r["gap_to_32"] is None or r["setting"] == "32" else f"{100 * r['gap_to_32']:+.1f}"
        total = sum(r["bit_histogram"].values()) or 1
        widths = " ".join(
            f"{b}:{n / total:.0%}" for b, n in sorted(r["bit_histogram"].items(), key=lambda x: int(x[0]))
        )
        print(
            f"{r['dataset']:9} {r['clients']:>3} {r['setting']:12} {r['test_mean']:.4f}±{r['test_std']:.4f} "
            f"{gap:>7} {r['bytes_sent']:>12.0f} {r['fraction_of_32']:>9.1%}  {widths}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=str(DEFAULT_ROOT), help="folder with Planetoid/<Name>/raw")
    parser.add_argument("--out", default="bench/results/bits.json")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--stages", type=int, default=3, help="lazy stages (default 3)")
    parser.add_argument("--rounds", type=int, default=100, help="rounds per stage (default 100)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--from-jsonl", default="", help="only print the table of runs saved in this file")
    args = parser.parse_args()
    if args.from_jsonl:
        rows = [json.loads(line) for line in Path(args.from_jsonl).read_text().splitlines() if line]
        print_table(summarize(rows))
        return 0
    tmp = private_planetoid(args.root)
    jobs = grid(args.quick, [int(v) for v in args.seeds.split(",")], args.stages, args.rounds)
    out = Path(args.out)
    t0 = time.perf_counter()
    rows = run_jobs(
        _job,
        jobs,
        str(tmp),
        out.with_suffix(".jsonl"),
        args.workers,
        lambda r: (
            f"{r['dataset']} K={r['clients']} {r['setting']} seed {r['seed']}: {r['test_accuracy']:.4f}"
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
