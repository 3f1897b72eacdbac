"""Lazy mode at a tenth of FedGCN's bytes: the peer's setting, our small-budget configuration.

The peer is FedGraph 0.2.5 running FedGCN on Cora with 10 trainers, the public split,
100 rounds: 0.788 test accuracy with 379 MB of communication that FedGraph computes, about
2 minutes and about 5 GB across its processes, measured on these machines. This runs lazy mode
in the same setting (10 random clients: FedGCN's near-iid split of nodes) with a configuration
chosen on validation accuracy to fit a tenth of those bytes, through the command line as a user
would, in both engines:

- ``in-process``: bytes are the exact payloads;
- ``simulation``: Flower's simulation engine; bytes are the serialized messages (wire).

Wall time is the whole command (start-up included, as the peer's was); memory is the peak of
the summed proportional set size (PSS) of the command's process tree, sampled every 0.2 s::

    python bench/peer.py --seeds 0,1,2 --out bench/results/peer.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_ROOT, PEER, private_planetoid, run_measured

# Chosen on seed 0's validation accuracy from a small sweep (bench/README.md,
# bench/results/peer-sweep-2026-11-22.jsonl): a hidden size of 16 makes the 1433-wide encoder,
# which every client downloads and uploads every round, 23k weights; 4-bit deltas with error
# feedback carry them; one self-training pass buys back what the small model loses; 50 rounds a
# stage (conv stages: two local steps, a faster server step) keep Flower's ~0.55 KB a message
# from adding up.
LEAN = [
    "--stages", "3",
    "--hidden", "16",
    "--rounds", "50,50",
    "--local-epochs", "1,2",
    "--lr", "1.0,0.5",
    "--server-lr", "0.01,0.03",
    "--bits", "8",
    "--update-bits", "4",
    "--broadcast-bits", "4",
    "--self-training", "1",
]  # fmt: skip
BUDGET = PEER["bytes_total"] / 10


def run_one(engine: str, seed: int, root: Path, work: Path) -> dict:
    out = work / f"{engine}-{seed}"
    cmd = [
        sys.executable, "-m", "retexo_fl.cli", "train",
        "--engine", engine, "--mode", "lazy", "--dataset", "Cora", "--root", str(root),
        "--split", "public", "--clients", "10", "--method", "random", "--seed", str(seed),
        *LEAN, "--out", str(out),
    ]  # fmt: skip
    seconds, peak, rc = run_measured(cmd, work / f"{engine}-{seed}.log")
    if rc != 0:
        tail = (work / f"{engine}-{seed}.log").read_text()[-2000:]
        raise RuntimeError(f"{engine} seed {seed} exited {rc}:\n{tail}")
    s = json.loads((out / "summary.json").read_text())
    traffic = s.get("traffic") or {}
    return {
        "engine": engine,
        "seed": seed,
        "test_accuracy": s["test_accuracy"],
        "val_accuracy": s["val_accuracy"],
        "bytes_payload": s["bytes_total"],
        "bytes_wire": traffic.get("bytes_wire"),
        "messages": sum(r["messages"] for r in traffic.get("by_message", [])) or None,
        "wall_seconds": seconds,
        "peak_mb": peak,
    }


def summarize(rows: list[dict]) -> list[dict]:
    table = []
    for engine in dict.fromkeys(r["engine"] for r in rows):
        rs = [r for r in rows if r["engine"] == engine]
        acc = [r["test_accuracy"] for r in rs]
        counted = [r["bytes_wire"] or r["bytes_payload"] for r in rs]
        table.append(
            {
                "engine": engine,
                "seeds": len(rs),
                "test_mean": statistics.mean(acc),
                "test_std": statistics.pstdev(acc),
                "bytes_mean": statistics.mean(counted),
                "bytes_max": max(counted),
                "counted": "wire" if rs[0]["bytes_wire"] else "payload",
                "seconds": statistics.mean(r["wall_seconds"] for r in rs),
                "peak_mb": max(r["peak_mb"] for r in rs),
            }
        )
    return table


def print_table(table: list[dict]) -> None:
    print(f"budget: a tenth of the peer's {PEER['bytes_total'] / 1e6:.1f} MB = {BUDGET / 1e6:.2f} MB")
    print(f"{'run':36} {'seeds':>5} {'test acc':>15} {'MB (max)':>16} {'s':>6} {'peak MB':>8}")
    print(
        f"{PEER['mode'] + ', computed':36} {1:>5} {PEER['test_mean']:>15.4f} "
        f"{PEER['bytes_total'] / 1e6:>16.1f} {PEER['seconds']:>6.0f} {PEER['peak_mb']:>8.0f}"
    )
    for t in table:
        acc = f"{t['test_mean']:.4f}±{t['test_std']:.4f}"
        mb = f"{t['bytes_mean'] / 1e6:.2f} ({t['bytes_max'] / 1e6:.2f})"
        name = f"lazy, {t['engine']}, {t['counted']}"
        print(f"{name:36} {t['seeds']:>5} {acc:>15} {mb:>16} {t['seconds']:>6.0f} {t['peak_mb']:>8.0f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=str(DEFAULT_ROOT), help="folder with Planetoid/Cora/raw")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--engines", default="in-process,simulation")
    parser.add_argument("--out", default="bench/results/peer.json")
    args = parser.parse_args()

    root = private_planetoid(args.root, ("Cora",))
    work = Path(tempfile.mkdtemp(prefix="retexo-peer-"))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".jsonl")  # each run as it finishes: a cut-off run keeps its seeds
    partial.write_text("")
    rows = []
    try:
        for seed in [int(s) for s in args.seeds.split(",")]:
            for engine in args.engines.split(","):
                row = run_one(engine, seed, root, work)
                rows.append(row)
                with open(partial, "a") as f:
                    f.write(json.dumps(row) + "\n")
                print(
                    f"{engine} seed {seed}: test {row['test_accuracy']:.4f}, "
                    f"{(row['bytes_wire'] or row['bytes_payload']) / 1e6:.2f} MB, "
                    f"{row['wall_seconds']:.0f} s, {row['peak_mb']:.0f} MB",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    table = summarize(rows)
    print_table(table)
    out.write_text(json.dumps({"peer": PEER, "budget_bytes": BUDGET, "config": LEAN, "runs": rows,
                               "table": table}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    sys.exit(main())
