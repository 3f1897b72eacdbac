"""An ogbn-products-sized graph in one box: generate, partition for 8 clients, train lazily.

    python bench/scale.py --out bench/results/scale.json
    python bench/scale.py --nodes 245000 --out bench/results/scale-tenth.json   # a tenth

The graph is a generated SBM (:func:`retexo_fl.data.datasets.synthetic_sbm`) with
ogbn-products' sizes: 2,449,029 nodes, about 61.9M undirected edges (an average degree of 50.55),
100 features and 47 classes, split as products is (8% train, 2% validation, 90% test, at
random). ``--nodes`` scales the node count at the same degree.

Every phase runs in a child process of its own (this script run with ``--phase``), so that each
phase's peak memory is its own:

1. ``cut-metis`` and ``cut-random``: generate the graph, assign its nodes to 8 clients, split it
   and write the partition folders (``retexo-fl partition``'s work);
2. ``lazy``: a lazy run with the default settings, in process, on the METIS folders (memory
   mapped, as ``--partitions`` loads them);
3. ``centralized``: the centralized GCN with its defaults on the whole graph, as the yardstick;
   ``--skip-centralized`` leaves it out.

For each phase it reports wall seconds (and the child's own split of them), the peak resident
memory of the child's whole process tree (RSS summed every 0.5 s) and the child's ``VmHWM`` (per
step where a phase has steps), and for training the bytes and accuracy. It prints a table and
writes JSON.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import run_measured  # noqa: E402

#: ogbn-products (OGB's node property prediction table).
PRODUCTS = {"nodes": 2_449_029, "undirected_edges": 61_859_140, "features": 100, "classes": 47}
#: Its split's shares: 196,615 train, 39,323 validation and 2,213,091 test nodes.
PRODUCTS_SPLIT = "random:0.08,0.02,0.9"
CLIENTS = 8
PHASES = ("cut-metis", "cut-random", "lazy", "centralized")


def generate(nodes: int, seed: int):
    """The products-sized SBM graph with ``nodes`` nodes (products' degree, features and classes)."""
    from retexo_fl.data.datasets import apply_split, synthetic_sbm

    degree = 2 * PRODUCTS["undirected_edges"] / PRODUCTS["nodes"]
    data = synthetic_sbm(
        nodes,
        PRODUCTS["classes"],
        avg_degree=degree,
        homophily=0.8,
        num_features=PRODUCTS["features"],
        seed=seed,
    )
    apply_split(data, PRODUCTS_SPLIT, seed)
    return data


def vm_hwm_mb() -> float:
    """This process's peak resident memory (``VmHWM``), in MB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def reset_peak() -> float:
    """This process's resident memory now, in MB, after setting its ``VmHWM`` back to it (Linux's
    ``clear_refs`` 5), so that the next :func:`vm_hwm_mb` is the peak of what follows."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def phase_cut(method: str, nodes: int, seed: int, out: Path) -> dict:
    from retexo_fl.data.partition import save_partition
    from retexo_fl.data.partitioners import assign_nodes, split_graph

    figures: dict = {"base_mb": reset_peak()}
    t = time.perf_counter()
    data = generate(nodes, seed)
    figures.update(generate_s=time.perf_counter() - t, generate_peak_mb=vm_hwm_mb())
    figures.update(nodes=data.num_nodes, directed_edges=int(data.edge_index.size(1)), held_mb=reset_peak())
    t = time.perf_counter()
    owner = assign_nodes(data, CLIENTS, method, seed)
    figures.update(
        assign_s=time.perf_counter() - t, assign_peak_mb=vm_hwm_mb(), held_after_assign_mb=reset_peak()
    )
    t = time.perf_counter()
    parts = split_graph(data, owner, CLIENTS, method=method, seed=seed)
    figures.update(split_s=time.perf_counter() - t, split_peak_mb=vm_hwm_mb())
    del data
    reset_peak()
    t = time.perf_counter()
    cross = 0
    for part in parts:
        save_partition(part, out / f"part-{part.partition_id}")
        cross += part.cross_edges.shape[0]
    figures.update(write_s=time.perf_counter() - t, write_peak_mb=vm_hwm_mb())
    figures["cross_edge_records"] = cross
    figures["folder_mb"] = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 2**20
    return figures


def phase_train(mode: str, nodes: int, seed: int, parts: Path, out: Path) -> dict:
    from retexo_fl.config import TrainConfig
    from retexo_fl.metrics import RunRecorder
    from retexo_fl.training.centralized import run_centralized, whole_graph_partition
    from retexo_fl.training.lazy import run_lazy

    if mode == "lazy":
        from retexo_fl.data.partition import load_partitions

        cfg = TrainConfig.from_mapping({"mode": "lazy", "partitions": str(parts), "seed": seed})
        cfg.validate()
        t = time.perf_counter()
        partitions = load_partitions(parts)
        load_s = time.perf_counter() - t
        t = time.perf_counter()
        summary = run_lazy(partitions, cfg, RunRecorder(out))
    else:
        cfg = TrainConfig.from_mapping({"mode": "centralized", "seed": seed})
        cfg.validate()
        t = time.perf_counter()
        partition = whole_graph_partition(generate(nodes, seed))
        load_s = time.perf_counter() - t
        t = time.perf_counter()
        summary = run_centralized(partition, cfg, RunRecorder(out))
    return {
        "load_s": load_s,
        "train_s": time.perf_counter() - t,
        "test_accuracy": summary["test_accuracy"],
        "val_accuracy": summary["val_accuracy"],
        "bytes_total": summary.get("bytes_total", 0),
        "bytes_boundary": summary.get("bytes_boundary", 0),
        "rounds": sum(len(s.get("history", [])) for s in summary.get("stages", [])) or None,
        # Self-training: the pass kept (best validation) and every pass's figures.
        "kept_pass": summary.get("kept_pass"),
        "passes": summary.get("passes") or summary.get("stages") if "kept_pass" in summary else None,
    }


def run_phase(phase: str, args: argparse.Namespace, work: Path) -> dict:
    """Run ``phase`` in a child process; its figures plus wall seconds and peak memory."""
    result = work / f"{phase}.json"
    cmd = [
        sys.executable, __file__, "--phase", phase, "--nodes", str(args.nodes), "--seed", str(args.seed),
        "--work", str(work),
    ]  # fmt: skip
    log = work / f"{phase}.log"
    wall, peak, rc = run_measured(cmd, log, pss=False, interval=0.5)  # RSS: PSS walks cost a core
    row = {"phase": phase, "wall_s": wall, "peak_tree_mb": peak, "rc": rc}
    if rc == 0 and result.is_file():
        row.update(json.loads(result.read_text()))
    else:
        row["error"] = log.read_text()[-2000:]
    return row


def child(args: argparse.Namespace) -> int:
    work = Path(args.work)
    if args.phase.startswith("cut-"):
        method = args.phase.removeprefix("cut-")
        row = phase_cut(method, args.nodes, args.seed, work / f"parts-{method}")
    else:
        row = phase_train(args.phase, args.nodes, args.seed, work / "parts-metis", work / f"run-{args.phase}")
    row["vm_hwm_mb"] = max([vm_hwm_mb(), *(v for k, v in row.items() if k.endswith("_peak_mb"))])
    row["ru_maxrss_children_mb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    (work / f"{args.phase}.json").write_text(json.dumps(row))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=PRODUCTS["nodes"], help="node count (default products')")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--phases", default=",".join(PHASES), help=f"comma separated, of {', '.join(PHASES)}")
    parser.add_argument("--skip-centralized", action="store_true", help="leave out the centralized yardstick")
    parser.add_argument(
        "--work", default=None, help="folder for partitions and runs (default: a new temp one)"
    )
    parser.add_argument("--out", default="bench/results/scale.json")
    parser.add_argument("--phase", default=None, help=argparse.SUPPRESS)  # a child's one phase
    args = parser.parse_args()
    if args.phase:
        return child(args)

    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="retexo-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    phases = [p for p in args.phases.split(",") if p and not (args.skip_centralized and p == "centralized")]
    unknown = sorted(set(phases) - set(PHASES))
    if unknown:
        parser.error(f"unknown phases {unknown}: choose from {', '.join(PHASES)}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    print(f"{args.nodes} nodes, {CLIENTS} clients; work in {work}", flush=True)
    for phase in phases:
        print(f"== {phase}", flush=True)
        row = run_phase(phase, args, work)
        rows.append(row)
        print(json.dumps(row), flush=True)
        out.write_text(json.dumps({"nodes": args.nodes, "clients": CLIENTS, "phases": rows}, indent=2))
    print(f"\n{args.nodes} nodes, {CLIENTS} clients, 2 cores")
    print(f"{'phase':12} {'wall s':>8} {'peak tree MB':>13} {'VmHWM MB':>9}  detail")
    for r in rows:
        keys = (
            "generate_s",
            "assign_s",
            "split_s",
            "write_s",
            "load_s",
            "train_s",
            "test_accuracy",
            "bytes_total",
        )
        detail = " ".join(
            f"{k}={r[k]:.3g}" if isinstance(r[k], float) else f"{k}={r[k]}" for k in keys if k in r
        )
        status = detail if r["rc"] == 0 else f"FAILED rc={r['rc']}"
        print(
            f"{r['phase']:12} {r['wall_s']:8.1f} {r['peak_tree_mb']:13.0f} "
            f"{r.get('vm_hwm_mb', 0):9.0f}  {status}"
        )
    print(f"-> {out}")
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
