"""A node worker's resident memory over a whole deployed run on the edge test's graph.

The graph is the one ``tests/test_edge.py`` states the edge profile's ceiling on: a generated
40,000-node SBM with about 2,000,000 edges. It is cut into ``--parties`` random partitions (one,
by default: a single node then holds the whole 40,000-node partition, as in the test). Each
party runs ``retexo-fl supernode`` (a node worker) under a real SuperLink on 127.0.0.1, and a
whole run with the default settings plus ``--run-config`` goes through it. The worker holds
torch, the partition and the client state for the whole run, across stages, so its peak resident
memory (``VmHWM`` of its own process) is what a small node must have. It is compared with the
ceiling that ``--profile edge`` states (900 MB). Prints a table, writes JSON. Example::

    python bench/worker_memory.py --profiles edge,default --out bench/results/worker_memory.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "deploy"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from deploy_latency import deployed  # noqa: E402

#: The ceiling ``--profile edge`` states (docs/deployment.md, tests/test_edge.py).
EDGE_CEILING_MB = 900


def edge_graph_partitions(out: Path, parties: int) -> dict:
    """The edge test's graph, cut into ``parties`` random partitions under ``out``; their sizes."""
    from retexo_fl.data.datasets import apply_split, synthetic_sbm
    from retexo_fl.data.partition import save_partition
    from retexo_fl.data.partitioners import partition_graph

    data = synthetic_sbm(40_000, 4, avg_degree=50, homophily=0.8, num_features=8, seed=0)
    apply_split(data, "random:0.1,0.1,0.8", seed=0)
    sizes = []
    for part in partition_graph(data, parties, "random", seed=0):
        save_partition(part, out / f"part-{part.partition_id}")
        sizes.append({"nodes": int(part.num_nodes), "edges": int(part.edges.shape[1])})
    return {"nodes": int(data.num_nodes), "edges": int(data.edge_index.shape[1]), "parties": sizes}


def deployed_run(parts: Path, work: Path, run_config: str, timeout: float) -> dict:
    """One whole deployed run on ``retexo-fl supernode``: its figures and the workers' memory."""
    run = deployed(parts, work, run_config, worker=True, timeout=timeout, database=False)
    parties = len(run.peak_mb)
    restarts = [
        len(re.findall(r"node worker \d+ listening", (run.work / f"supernode-{i}.log").read_text())) - 1
        for i in range(parties)
    ]
    summary = json.loads((run.out / "summary.json").read_text())
    return {
        "wall_seconds": run.wall,
        "test_accuracy": summary.get("test_accuracy"),
        "rounds": sum(int(s.get("rounds_sent", 0)) for s in summary.get("stages", [])),
        "stages": len(summary.get("stages", [])),
        "worker_peak_mb": run.peak_mb,
        "worker_end_mb": run.end_mb,
        "worker_restarts": restarts,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--parties", type=int, default=1, help="SuperNodes, each with a random partition")
    parser.add_argument(
        "--profiles", default="edge", help="comma-separated run profiles to compare (edge, default)"
    )
    parser.add_argument(
        "--run-config",
        default="model='sage-max' hidden=64 stages=2",
        help="run config beside the profile (default: the edge test's model, 64-wide max-SAGE, 2 stages)",
    )
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--out", default="bench/results/worker_memory.json")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="retexo-worker-memory-"))
    parts = tmp / "parts"
    graph = edge_graph_partitions(parts, args.parties)
    print(
        f"graph: {graph['nodes']} nodes, {graph['edges']} edges; parties: "
        + ", ".join(f"{p['nodes']} nodes / {p['edges']} edges" for p in graph["parties"]),
        flush=True,
    )
    rows = {}
    for profile in [p.strip() for p in args.profiles.split(",") if p.strip()]:
        run_config = f"profile='{profile}' {args.run_config}".strip()
        print(f"\n== {run_config}", flush=True)
        rows[profile] = {
            "run_config": run_config,
            **deployed_run(parts, tmp / profile, run_config, args.timeout),
        }

    print(f"\nnode worker memory over a whole deployed run, {args.parties} part(s) of the edge test's graph")
    print(f"{'profile':<10} {'peak MB':>9} {'end MB':>8} {'ceiling':>8} {'rounds':>7} {'s':>6} {'test':>6}")
    for profile, r in rows.items():
        peak = max(r["worker_peak_mb"])
        print(
            f"{profile:<10} {peak:>9.0f} {max(r['worker_end_mb']):>8.0f} {EDGE_CEILING_MB:>8} "
            f"{r['rounds']:>7} {r['wall_seconds']:>6.0f} {r['test_accuracy']:>6.3f}"
            + ("" if profile != "edge" else ("  within" if peak < EDGE_CEILING_MB else "  OVER"))
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"graph": graph, "ceiling_mb": EDGE_CEILING_MB, "runs": rows}, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
