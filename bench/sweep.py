"""Candidate sweep for the defaults: every candidate x cell x seed, in process.

A candidate is a name and the flags a user would type (``retexo-fl train`` flags). A cell is a
dataset, a partitioning and a client count. Every run is appended at once to ``--out`` (JSON
lines) with its validation and test accuracy, rounds sent, bytes and wall seconds, so a sweep cut
off keeps what it measured. Choose on ``val_accuracy``; ``test_accuracy`` is recorded so the
choice can be reported, never to make it::

    python bench/sweep.py --cells "Cora:random:10,Cora:metis:4,Cora:label-skew:10" --seeds 0,1,2 \\
        --candidates bench/candidates.json --out bench/results/sweep.jsonl
    python bench/sweep.py --cells Cora:random:10 --candidate "c1=--local-epochs 5 --patience 5"

``--candidates`` is a JSON object ``{name: "flags"}``; ``--candidate name=flags`` adds one (it may
be repeated). ``--mode centralized`` in a candidate's flags makes it a centralized run on the
whole graph (the cell's partitioning then plays no part). ``--summary`` prints the mean
validation and test accuracy, rounds and bytes per candidate and cell from a JSON lines file.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_ROOT, run_jobs


def private_root(root: str, datasets: list[str]) -> Path:
    """Copy the shared datasets' raw files into a temporary folder and process each one once.

    Once, here, in a child process: workers that process the same folder at once race on its files.
    """
    import shutil
    import subprocess
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="retexo-sweep-"))
    shutil.copytree(root, tmp, ignore=shutil.ignore_patterns("processed"), dirs_exist_ok=True)
    # Any split will do: this only processes the raw files (graphs such as Airports have no split
    # of their own, and a candidate's flags give theirs).
    load = (
        "import sys; from retexo_fl.data.datasets import load_dataset\n"
        "for n in sys.argv[2:]: load_dataset(n, sys.argv[1], split='random:0.6,0.2,0.2')"
    )
    names = sorted({d for d in datasets if not d.startswith("sbm:")})
    subprocess.run([sys.executable, "-c", load, str(tmp), *names], check=True)
    return tmp


def cells_from(spec: str) -> list[tuple[str, str, int]]:
    """``"Cora:random:10,Cora:metis:4"`` -> ``[("Cora", "random", 10), ("Cora", "metis", 4)]``."""
    out = []
    for item in spec.split(","):
        dataset, method, clients = item.strip().rsplit(":", 2)
        out.append((dataset, method, int(clients)))
    return out


def run_one(job_root: tuple[dict, str]) -> dict:
    """One in-process run (one torch thread); its figures as a JSON-able row."""
    job, root = job_root
    import torch

    torch.set_num_threads(1)
    from retexo_fl.cli import _config_from_args, build_parser
    from retexo_fl.runner import train

    argv = [
        "train", "--dataset", job["dataset"], "--root", root, "--clients", str(job["clients"]),
        "--method", job["method"], "--seed", str(job["seed"]), "--threads", "1",
        *shlex.split(job["flags"]),
    ]  # fmt: skip
    cfg = _config_from_args(build_parser().parse_args(argv))
    t0 = time.perf_counter()
    try:
        s = train(cfg)
    except Exception as e:  # a candidate that cannot run is a result, not the end of the sweep
        return {**job, "error": f"{type(e).__name__}: {e}"[:500]}
    stages = s.get("stages", [])
    return {
        **job,
        "val_accuracy": s["val_accuracy"],
        "test_accuracy": s["test_accuracy"],
        "rounds": sum(st.get("rounds_sent", st.get("rounds_run", 0)) for st in stages),
        "stage_rounds": [st.get("rounds_sent", st.get("rounds_run", 0)) for st in stages],
        "bytes_total": s.get("bytes_total", 0),
        "bytes_model": s.get("bytes_model", 0),
        "bytes_boundary": s.get("bytes_boundary", 0),
        "wall_seconds": round(time.perf_counter() - t0, 2),
    }


def summary(rows: list[dict]) -> list[dict]:
    """Mean validation / test accuracy, worst rounds and mean bytes per (candidate, cell)."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        if "error" in r:
            continue
        groups.setdefault((r["name"], f"{r['dataset']}:{r['method']}:{r['clients']}"), []).append(r)
    out = []
    for (name, cell), rs in groups.items():
        out.append({
            "name": name,
            "cell": cell,
            "seeds": len(rs),
            "val": statistics.mean(r["val_accuracy"] for r in rs),
            "test": statistics.mean(r["test_accuracy"] for r in rs),
            "test_std": statistics.pstdev(r["test_accuracy"] for r in rs),
            "rounds": max(r["rounds"] for r in rs),
            "mb": statistics.mean(r["bytes_total"] for r in rs) / 1e6,
            "s": statistics.mean(r["wall_seconds"] for r in rs),
        })  # fmt: skip
    return sorted(out, key=lambda t: (t["cell"], -t["val"]))


def print_summary(rows: list[dict]) -> None:
    """The summary as a markdown table, best validation first within each cell."""
    print("| cell | candidate | seeds | val | test | rounds | MB | s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for t in summary(rows):
        print(
            f"| {t['cell']} | {t['name']} | {t['seeds']} | {t['val']:.4f} | "
            f"{t['test']:.4f}±{t['test_std']:.4f} | {t['rounds']} | {t['mb']:.1f} | {t['s']:.0f} |"
        )
    errors = [r for r in rows if "error" in r]
    for r in errors:
        print(
            f"error: {r['name']} {r['dataset']}:{r['method']}:{r['clients']} seed {r['seed']}: {r['error']}"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", default="Cora:random:10", help="dataset:method:clients, comma-separated")
    p.add_argument("--seeds", default="0")
    p.add_argument("--candidates", default="", help="JSON file {name: flags}")
    p.add_argument("--candidate", action="append", default=[], help="name=flags (repeatable)")
    p.add_argument("--root", default=str(DEFAULT_ROOT), help="the shared datasets folder")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--phase", default="", help="a label stored with every row")
    p.add_argument("--out", default="bench/results/sweep.jsonl")
    p.add_argument("--summary", default="", help="print the summary of this JSON lines file and exit")
    args = p.parse_args()
    if args.summary:
        print_summary([json.loads(line) for line in Path(args.summary).read_text().splitlines() if line])
        return 0
    candidates: dict[str, str] = json.loads(Path(args.candidates).read_text()) if args.candidates else {}
    for item in args.candidate:
        name, _, flags = item.partition("=")
        candidates[name] = flags
    if not candidates:
        p.error("give --candidates or --candidate")
    cells = cells_from(args.cells)
    root = private_root(args.root, [d for d, _, _ in cells])
    jobs = [
        {
            "phase": args.phase,
            "name": name,
            "flags": flags,
            "dataset": d,
            "method": m,
            "clients": k,
            "seed": int(s),
        }
        for d, m, k in cells
        for name, flags in candidates.items()
        for s in args.seeds.split(",")
    ]
    out = Path(args.out)
    partial = out.with_suffix(".partial.jsonl")
    rows = run_jobs(
        run_one,
        jobs,
        str(root),
        partial,
        args.workers,
        lambda r: (
            f"{r['name']} {r['dataset']}:{r['method']}:{r['clients']} s{r['seed']} "
            + (
                r["error"]
                if "error" in r
                else f"val {r['val_accuracy']:.3f} test {r['test_accuracy']:.3f} "
                f"rounds {r['rounds']} {r['bytes_total'] / 1e6:.1f} MB {r['wall_seconds']:.0f}s"
            )
        ),
    )
    with open(out, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    partial.unlink(missing_ok=True)
    print_summary(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
