"""The headline: what a user gets with default settings, against the previous defaults, FedGCN
and the centralized GCN, in rounds, bytes, seconds and memory.

Cells, each with three seeds, through the command line as a user runs it:

- Cora, 10 random clients, public split, Flower simulation (bytes: serialized messages), beside
  FedGCN's measured row;
- Cora, 4 METIS clients; CiteSeer, 10 random clients; a generated ``sbm:`` graph of 20,000
  nodes, 8 random clients (in process; bytes: payloads).

Each cell runs ``defaults`` (no training flags at all) and ``previous`` (the flags that spell out
the defaults this benchmark was written against), plus the centralized GCN with its defaults.
``--candidate "FLAGS"`` adds a row for a candidate configuration (flags as a user types them).
Wall time is the whole command (start-up included); memory the peak summed PSS of its process
tree. Prints a table, writes JSON (``--out``) and a PNG beside it of validation accuracy
against cumulative bytes::

    python bench/rounds.py --seeds 0,1,2 --out bench/results/rounds.json
    python bench/rounds.py --previous-seeds 0      # the slow previous defaults on seed 0 only
    python bench/rounds.py --cells cora-random --seeds 0 --candidate "--local-epochs 5 --patience 10"
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_ROOT, PEER, private_planetoid, run_measured

#: cell -> (engine, dataset, clients, method)
CELLS = {
    "cora-random": ("simulation", "Cora", 10, "random"),
    "cora-metis": ("in-process", "Cora", 4, "metis"),
    "citeseer-random": ("in-process", "CiteSeer", 10, "random"),
    "sbm-random": ("in-process", "sbm:20000,8,20,0.7", 8, "random"),
}

#: The defaults as of 2026-11-23 (TrainConfig), spelled out so they stay comparable after the
#: defaults change: 5 stages x 200 rounds, one full-batch SGD step (lr 1) a round, server Adam.
PREVIOUS = [
    "--stages", "5", "--hidden", "256", "--rounds", "200", "--local-epochs", "1",
    "--optimizer", "sgd", "--lr", "1.0", "--server-optimizer", "adam", "--server-lr", "0.01",
    "--patience", "0", "--min-rounds", "0", "--bits", "32", "--update-bits", "32",
    "--broadcast-bits", "32", "--norm", "layer", "--self-training", "0", "--pseudo-threshold", "0.9",
]  # fmt: skip


def run_cell(cell: str, config: str, flags: list[str], seed: int, root: Path, work: Path) -> dict:
    """One run of ``config`` in ``cell``; the summary's figures plus wall seconds and memory."""
    engine, dataset, clients, method = CELLS[cell]
    out = work / f"{cell}-{config}-{seed}"
    mode = ["--mode", "centralized"] if config == "centralized" else []
    if config == "centralized":
        engine = "in-process"
    cmd = [
        sys.executable, "-m", "retexo_fl.cli", "train", "--engine", engine, "--dataset", dataset,
        "--root", str(root), "--clients", str(clients), "--method", method, "--seed", str(seed),
        *mode, *flags, "--out", str(out),
    ]  # fmt: skip
    log = work / f"{out.name}.log"
    seconds, peak, rc = run_measured(cmd, log)
    if rc != 0:
        raise RuntimeError(f"{cell} {config} seed {seed} exited {rc}:\n{log.read_text()[-2000:]}")
    s = json.loads((out / "summary.json").read_text())
    traffic = s.get("traffic") or {}
    stages = s.get("stages", [])
    curve = [(h["bytes_total"], h["val_accuracy"]) for st in stages for h in st.get("history", [])]
    return {
        "cell": cell,
        "config": config,
        "flags": flags,
        "engine": engine,
        "seed": seed,
        "test_accuracy": s["test_accuracy"],
        "val_accuracy": s["val_accuracy"],
        "rounds": sum(st.get("rounds_sent", st.get("rounds_run", 0)) for st in stages),
        "bytes": traffic.get("bytes_wire") or s.get("bytes_total", 0),
        "bytes_on": "wire" if traffic.get("bytes_wire") else "payload",
        "wall_seconds": seconds,
        "peak_mb": peak,
        "curve": curve,
    }


def summarize(rows: list[dict]) -> list[dict]:
    """Mean and standard deviation over seeds, per cell and configuration."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["cell"], r["config"]), []).append(r)
    table = []
    for (cell, config), rs in groups.items():
        tests = [r["test_accuracy"] for r in rs]
        table.append({
            "cell": cell,
            "config": config,
            "seeds": len(rs),
            "test_mean": statistics.mean(tests),
            "test_std": statistics.pstdev(tests),
            "test_min": min(tests),
            "val_mean": statistics.mean(r["val_accuracy"] for r in rs),
            "rounds": max(r["rounds"] for r in rs),
            "bytes_mean": statistics.mean(r["bytes"] for r in rs),
            "bytes_on": rs[0]["bytes_on"],
            "seconds_mean": statistics.mean(r["wall_seconds"] for r in rs),
            "peak_mb": max(r["peak_mb"] for r in rs),
        })  # fmt: skip
    return table


def print_table(table: list[dict]) -> None:
    """The table in markdown, FedGCN's measured row beside Cora with 10 random clients."""
    print("| cell | config | seeds | test | min | val | rounds | bytes | s | peak MB |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for t in table:
        print(
            f"| {t['cell']} | {t['config']} | {t['seeds']} | {t['test_mean']:.4f}±{t['test_std']:.4f} | "
            f"{t['test_min']:.4f} | {t['val_mean']:.4f} | {t['rounds']} | "
            f"{t['bytes_mean'] / 1e6:.2f} MB {t['bytes_on']} | {t['seconds_mean']:.0f} | {t['peak_mb']:.0f} |"
        )
    if any(t["cell"] == "cora-random" for t in table):
        print(
            f"| cora-random | {PEER['mode']} | 1 | {PEER['test_mean']:.4f} | | | 100 | "
            f"{PEER['bytes_total'] / 1e6:.2f} MB computed | {PEER['seconds']:.0f} | {PEER['peak_mb']:.0f} |"
        )


def plot(rows: list[dict], path: Path) -> None:
    """Validation accuracy against cumulative bytes, one panel per cell, seed 0's runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = sorted({r["cell"] for r in rows})
    fig, axes = plt.subplots(1, len(cells), figsize=(5.5 * len(cells), 4.2), squeeze=False)
    for ax, cell in zip(axes[0], cells, strict=True):
        for r in rows:
            if r["cell"] == cell and r["seed"] == min(x["seed"] for x in rows) and r["curve"]:
                xs, ys = zip(*r["curve"], strict=True)
                ax.plot([x / 1e6 for x in xs], ys, label=r["config"])
        ax.set_xscale("log")
        ax.set_xlabel("cumulative bytes (MB)")
        ax.set_ylabel("validation accuracy")
        ax.set_title(cell)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", default=",".join(CELLS), help=f"comma-separated, of {', '.join(CELLS)}")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--root", default=str(DEFAULT_ROOT), help="folder with Planetoid/<name>/raw")
    p.add_argument("--candidate", default="", help="flags of a candidate configuration, one more row")
    p.add_argument("--no-previous", action="store_true", help="skip the previous defaults (slow)")
    p.add_argument(
        "--previous-seeds",
        default="",
        help="seeds of the previous defaults' runs (default: --seeds); one seed is enough for the PNG",
    )
    p.add_argument("--out", default="bench/results/rounds.json")
    args = p.parse_args()
    root = private_planetoid(args.root)
    configs: dict[str, list[str]] = {"defaults": [], "centralized": []}
    if not args.no_previous:
        configs["previous"] = PREVIOUS
    if args.candidate:
        configs["candidate"] = shlex.split(args.candidate)
    rows = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    previous_seeds = {int(s) for s in (args.previous_seeds or args.seeds).split(",")}
    with tempfile.TemporaryDirectory(prefix="retexo-rounds-") as tmp:
        for cell in args.cells.split(","):
            for seed in (int(s) for s in args.seeds.split(",")):
                for config, flags in configs.items():
                    if config == "previous" and seed not in previous_seeds:
                        continue
                    row = run_cell(cell, config, flags, seed, root, Path(tmp))
                    rows.append(row)
                    print(
                        f"{cell} {config} seed {seed}: test {row['test_accuracy']:.4f} "
                        f"rounds {row['rounds']} {row['bytes'] / 1e6:.2f} MB {row['wall_seconds']:.0f} s",
                        file=sys.stderr,
                        flush=True,
                    )
                    with open(out.with_suffix(".jsonl"), "a") as f:
                        f.write(json.dumps({k: v for k, v in row.items() if k != "curve"}) + "\n")
    table = summarize(rows)
    print_table(table)
    out.write_text(json.dumps({"table": table, "runs": rows, "peer": PEER}, indent=1))
    plot(rows, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
