"""Side by side: lazy, eager, local and centralized training on the same partitions and seeds.

One command, one process tree: every mode on Cora, CiteSeer and a generated SBM graph, 4 and 10
clients, METIS and random partitions. Prints a table (test accuracy, bytes total / boundary /
model, bytes to reach a target accuracy, wall seconds), writes ``compare.json`` and a PNG of
accuracy against total bytes. Example::

    python bench/compare.py --quick                        # Cora, 10 random clients, 1 seed (< 5 min)
    python bench/compare.py --quick --mode-defaults        # each mode with its own tuned defaults
    python bench/compare.py --seeds 0,1 --out bench/results/compare.json

"bytes to target" is the run's bytes up to the first round whose validation accuracy reaches
``--target-frac`` of the centralized reference's (best validation) on the same dataset and seed.
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
from common import DEFAULT_ROOT, PEER, peak_rss_mb, private_planetoid, run_jobs

# The synthetic graph: 100,000 nodes, about 2,000,000 undirected edges (4,000,000 directed).
SBM = "sbm:100000,8,40,0.7"
MODES = [("lazy", 32), ("lazy", 8), ("eager", 32), ("eager", 8), ("local", 32)]


def _job(args: tuple[dict, str]) -> dict:
    settings, root = args
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    from retexo_fl.config import TrainConfig
    from retexo_fl.metrics import RunRecorder
    from retexo_fl.runner import train

    run = {k: v for k, v in settings.items() if not k.startswith("_")}
    summary = train(TrainConfig.resolve(data_root=root, **run), RunRecorder(None, stream=None))
    stages = summary.get("stages", [])
    curve = [(h["bytes_total"], h["val_accuracy"]) for s in stages for h in s.get("history", [])]
    best_val = summary["val_accuracy"]
    if settings["mode"] == "centralized":  # the reference: no federated bytes, best validation
        curve = []
    return {
        **settings,
        # One table row per data-center algorithm.
        "mode": f"datacenter {settings['algorithm']}"
        if settings["mode"] == "datacenter"
        else settings["mode"],
        "test_accuracy": summary["test_accuracy"],
        "val_accuracy": best_val,
        "bytes_total": summary["bytes_total"],
        "bytes_boundary": summary["bytes_boundary"],
        "bytes_model": summary["bytes_model"],
        "curve": curve,
        "wall_seconds": summary["wall_seconds"],
        "peak_rss_mb": peak_rss_mb(),
    }


def split_datasets(spec: str) -> list[str]:
    """``"Cora,sbm:1000,4,10,0.8"`` -> ``["Cora", "sbm:1000,4,10,0.8"]``: numbers join the sbm before."""
    out: list[str] = []
    for token in filter(None, (t.strip() for t in spec.split(","))):
        if out and out[-1].startswith("sbm:") and token.replace(".", "", 1).isdigit():
            out[-1] += "," + token
        else:
            out.append(token)
    return out


def update_bits(bits: int, mode_defaults: bool) -> dict[str, int]:
    """8-bit rows go with 8-bit updates; otherwise 32-bit ones, or the mode's own default."""
    if bits == 8:
        return {"update_bits": 8}
    return {} if mode_defaults else {"update_bits": 32}


def grid(args: argparse.Namespace) -> list[dict]:
    seeds = [int(v) for v in args.seeds.split(",")]
    if args.quick:
        datasets, clients, methods, seeds = ["Cora"], [10], ["random"], seeds[:1]
    else:
        datasets = split_datasets(args.datasets)
        clients = [int(k) for k in args.clients.split(",")]
        methods = args.methods.split(",")
    jobs = []
    for seed, ds in itertools.product(seeds, datasets):
        big = ds.startswith("sbm:")
        depth = {"stages": 3, "rounds": args.sbm_rounds, "hidden": 64} if big else {"stages": args.stages}
        if not big:
            depth["rounds"] = args.rounds
        split = "random:0.1,0.1,0.8" if big else "public"
        central = {
            "central_layers": depth["stages"],
            "rounds": depth["rounds"],
            "hidden": depth.get("hidden", 256),
        }
        if args.mode_defaults:  # every mode with its own tuned defaults (MODE_DEFAULTS)
            depth, central = {}, {}
        jobs.append(
            {
                "dataset": ds,
                "split": split,
                "mode": "centralized",
                "bits": 32,
                "clients": 1,
                "method": "-",
                "seed": seed,
                **central,
            }
        )
        for spec in filter(None, args.datacenter.split(",")):
            algorithm, _, procs = spec.partition(":")
            jobs.append(
                {
                    **jobs[-1],
                    "mode": "datacenter",
                    "algorithm": algorithm,
                    "procs": int(procs or 4),
                    "clients": int(procs or 4),
                }
            )
        for k, method, (mode, bits) in itertools.product(clients, methods, MODES):
            jobs.append(
                {
                    "dataset": ds,
                    "split": split,
                    "mode": mode,
                    "bits": bits,
                    **update_bits(bits, args.mode_defaults),
                    "clients": k,
                    "method": method,
                    "seed": seed,
                    **depth,
                }
            )
    return jobs


def bytes_to_target(curve: list[tuple[int, float]], target: float) -> int | None:
    for nbytes, val in curve:
        if val >= target:
            return nbytes
    return None


def summarize(rows: list[dict], target_frac: float) -> list[dict]:
    central = {(r["dataset"], r["seed"]): r["val_accuracy"] for r in rows if r["mode"] == "centralized"}
    keyf = ("dataset", "clients", "method", "mode", "bits")
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in keyf), []).append(r)
    table = []
    for key, rs in groups.items():
        reach = [
            bytes_to_target(r["curve"], target_frac * central[(r["dataset"], r["seed"])])
            for r in rs
            if (r["dataset"], r["seed"]) in central and r["mode"] != "centralized"
        ]
        reached = [b for b in reach if b is not None]
        table.append(
            {
                **dict(zip(keyf, key, strict=True)),
                "seeds": len(rs),
                "test_mean": statistics.mean(r["test_accuracy"] for r in rs),
                "test_std": statistics.pstdev(r["test_accuracy"] for r in rs),
                "bytes_total": statistics.mean(r["bytes_total"] for r in rs),
                "bytes_boundary": statistics.mean(r["bytes_boundary"] for r in rs),
                "bytes_model": statistics.mean(r["bytes_model"] for r in rs),
                # Mean over the seeds that reached the target; None if any did not.
                "bytes_to_target": statistics.mean(reached) if reach and len(reached) == len(reach) else None,
                "seconds": statistics.mean(r["wall_seconds"] for r in rs),
                "peak_mb": max((r.get("peak_rss_mb", 0.0) for r in rs), default=0.0),
            }
        )
    order = {m: i for i, m in enumerate(["centralized", "lazy", "eager", "local"])}
    order.update({f"datacenter {a}": 0.5 for a in ("1d", "1.5d", "2d", "3d")})
    table.sort(
        key=lambda r: (
            r["dataset"],
            r["clients"] if r["mode"] != "centralized" and not r["mode"].startswith("datacenter") else 0,
            r["method"],
            order.get(r["mode"], 9),
            -r["bits"],
        )
    )
    return table


def _fmt_bytes(v) -> str:
    if v is None:
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if v >= size:
            return f"{v / size:.1f} {unit}"
    return f"{v:.0f} B"


def print_table(table: list[dict]) -> None:
    head = (
        f"{'dataset':22} {'K':>3} {'part':8} {'mode':24} {'bits':>4} {'test acc':>15} {'total':>10} "
        f"{'boundary':>10} {'model':>10} {'to target':>10} {'s':>7} {'peak MB':>8}"
    )
    print(head)
    print("-" * len(head))
    for r in table:
        print(
            f"{r['dataset']:22} {r['clients']:>3} {r['method']:8} {r['mode']:24} {r['bits']:>4} "
            f"{r['test_mean']:.4f}±{r['test_std']:.4f} {_fmt_bytes(r['bytes_total']):>10} "
            f"{_fmt_bytes(r['bytes_boundary']):>10} {_fmt_bytes(r['bytes_model']):>10} "
            f"{_fmt_bytes(r['bytes_to_target']):>10} {r['seconds']:>7.1f} {r.get('peak_mb', 0):>8.0f}"
        )


def ratios(table: list[dict]) -> list[dict]:
    """Lazy against eager at the same width: accuracy gap and how many times fewer boundary bytes."""
    out = []
    index = {(r["dataset"], r["clients"], r["method"], r["mode"], r["bits"]): r for r in table}
    for (ds, k, method, mode, bits), lazy in index.items():
        eager = index.get((ds, k, method, "eager", bits))
        local = index.get((ds, k, method, "local", 32))
        if mode != "lazy" or eager is None:
            continue
        out.append(
            {
                "dataset": ds,
                "clients": k,
                "method": method,
                "bits": bits,
                "lazy_minus_eager": lazy["test_mean"] - eager["test_mean"],
                "boundary_ratio": eager["bytes_boundary"] / max(lazy["bytes_boundary"], 1),
                "total_ratio": eager["bytes_total"] / max(lazy["bytes_total"], 1),
                "lazy_minus_local": None if local is None else lazy["test_mean"] - local["test_mean"],
            }
        )
    return out


def plot(table: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = sorted({r["dataset"] for r in table})
    fig, axes = plt.subplots(1, len(datasets), figsize=(5.5 * len(datasets), 4.5), squeeze=False)
    markers = {"lazy": "o", "eager": "s", "local": "^", "datacenter": "D"}
    colors = {
        "lazy 32b": "tab:blue",
        "lazy 8b": "tab:cyan",
        "eager 32b": "tab:red",
        "eager 8b": "tab:orange",
        "local 32b": "tab:green",
        "datacenter 32b": "tab:purple",
    }
    for ax, ds in zip(axes[0], datasets, strict=True):
        for r in table:
            if r["dataset"] != ds or not r["bytes_total"]:
                continue
            mode = r["mode"].split()[0] if r["mode"].split()[0] in markers else "peer"
            label = f"{mode} {r['bits']}b" if mode != "peer" else r["mode"]
            color = colors.get(label, "black")
            hollow = r["method"] == "random"  # filled: METIS, hollow: random partitions
            ax.scatter(
                r["bytes_total"],
                r["test_mean"],
                marker=markers.get(mode, "*"),
                s=60 if mode != "peer" else 160,
                facecolors="none" if hollow else color,
                edgecolors=color,
                label=label,
            )
        for r in table:
            if r["dataset"] == ds and r["mode"] == "centralized":
                ax.axhline(r["test_mean"], color="grey", ls="--", lw=1, label="centralized")
        handles, labels = ax.get_legend_handles_labels()
        seen = dict(zip(labels, handles, strict=True))
        ax.legend(seen.values(), seen.keys(), fontsize=7)
        ax.set_xscale("log")
        ax.set_xlabel("total bytes (log)")
        ax.set_ylabel("test accuracy")
        ax.set_title(f"{ds} (filled: METIS, hollow: random)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=str(DEFAULT_ROOT), help="folder with Planetoid/<Name>/raw")
    parser.add_argument("--out", default="bench/results/compare.json")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--datasets", default=f"Cora,CiteSeer,{SBM}")
    parser.add_argument("--clients", default="4,10")
    parser.add_argument("--methods", default="metis,random")
    parser.add_argument(
        "--stages", type=int, default=3, help="lazy stages = eager / local layers (default 3)"
    )
    parser.add_argument("--rounds", type=int, default=100, help="rounds per stage, and eager / local rounds")
    parser.add_argument("--sbm-rounds", type=int, default=30, help="rounds on the generated graph")
    parser.add_argument("--target-frac", type=float, default=0.95)
    parser.add_argument(
        "--datacenter",
        default="",
        help="data-center rows beside the centralized one: ALG:PROCS,... (e.g. 1d:4,2d:4)",
    )
    parser.add_argument("--quick", action="store_true", help="Cora, 10 random clients, one seed")
    parser.add_argument(
        "--mode-defaults",
        action="store_true",
        help="run every mode with its own defaults instead of one depth, round count and width for all",
    )
    parser.add_argument("--from-jsonl", default="", help="only rebuild table, JSON and PNG from saved runs")
    args = parser.parse_args()

    out = Path(args.out)
    t0 = time.perf_counter()
    if args.from_jsonl:
        rows = [json.loads(line) for line in Path(args.from_jsonl).read_text().splitlines() if line]
    else:
        tmp = private_planetoid(args.root)
        rows = run_jobs(
            _job,
            grid(args),
            str(tmp),
            out.with_suffix(".jsonl"),
            args.workers,
            lambda r: (
                f"{r['dataset']} K={r['clients']} {r['method']} {r['mode']} {r['bits']}b seed {r['seed']}: "
                f"{r['test_accuracy']:.4f} in {r['wall_seconds']:.0f}s"
            ),
        )
        shutil.rmtree(tmp, ignore_errors=True)
    table = summarize(rows, args.target_frac)
    if any(r["dataset"] == "Cora" for r in table):
        table.append(dict(PEER))
    print_table(table)
    print()
    for r in ratios(table):
        local = "" if r["lazy_minus_local"] is None else f", lazy - local {100 * r['lazy_minus_local']:+.1f}"
        print(
            f"{r['dataset']} K={r['clients']} {r['method']} {r['bits']}b: lazy - eager "
            f"{100 * r['lazy_minus_eager']:+.1f} points, {r['boundary_ratio']:.0f}x fewer boundary bytes, "
            f"{r['total_ratio']:.1f}x fewer in total{local}"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"runs": rows, "table": table, "ratios": ratios(table), "seconds": time.perf_counter() - t0},
            indent=2,
        )
    )
    plot(table, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
