"""Data-center mode: bytes and seconds per epoch of CAGNET's 1D / 1.5D / 2D / 3D beside their formulas.

For each dataset the graph is loaded once and handed to every run; each algorithm runs as P
local processes (gloo, P = 4; 3D at P = 8) for a few epochs of full-graph GCN training. The
table gives, per process and epoch, the bytes the distributed products received (mean over
processes, and the largest), the closed-form prediction, the other traffic (column
reductions of 2D/3D, weight-gradient all-reduces), and seconds per training epoch beside one
process training the same model. Writes JSON. Example::

    python bench/datacenter.py --out bench/results/datacenter.json
    python bench/datacenter.py --datasets Cora --epochs 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_ROOT, private_planetoid

from retexo_fl.config import TrainConfig
from retexo_fl.datacenter.graph import FullGraph, load_full_graph
from retexo_fl.datacenter.launch import run_datacenter
from retexo_fl.datacenter.model import ReferenceGCN, initial_weights
from retexo_fl.metrics import human_bytes

# The synthetic graph: 200,000 nodes, about 2,000,000 undirected edges, 64 features.
SBM = "sbm:200000,8,20,0.7"
RUNS = [("1d", 4), ("1.5d", 4), ("2d", 4), ("3d", 8)]


def single_process_seconds(cfg: TrainConfig, graph: FullGraph, epochs: int) -> float:
    """Seconds per epoch of the same training in one process (all cores), after one warm-up epoch."""
    torch.set_num_threads(os.cpu_count() or 1)
    coo = graph.adjacency.tocoo()
    adj = torch.sparse_coo_tensor(
        np.vstack([coo.row, coo.col]), torch.from_numpy(coo.data.astype(np.float32)), coo.shape
    ).to_sparse_csr()
    init = initial_weights(graph.x.shape[1], cfg.hidden, graph.num_classes, cfg.central_layers, cfg.seed)
    model = ReferenceGCN(init, adj, cfg.per_stage("dropout", 1), cfg.seed)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    train = graph.masks["train"]
    times = []
    for epoch in range(epochs + 1):
        t0 = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(graph.x, epoch)[train], graph.y[train]).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return float(np.mean(times[1:]))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--datasets", default=f"Cora;{SBM}", help="';'-separated dataset specs")
    parser.add_argument("--root", default=str(DEFAULT_ROOT))
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--out", default="bench/results/datacenter.json")
    args = parser.parse_args()

    root = private_planetoid(args.root)
    rows = []
    for spec in filter(None, args.datasets.split(";")):
        big = spec.startswith("sbm:")
        cfg = TrainConfig.resolve(
            mode="datacenter",
            dataset=spec,
            data_root=str(root),
            split="random:0.1,0.1,0.8" if big else "public",
            hidden=args.hidden,
            central_layers=args.layers,
            rounds=args.epochs,
        )
        t0 = time.perf_counter()
        graph = load_full_graph(cfg)
        print(
            f"{spec}: {graph.num_nodes} nodes, {graph.adjacency.nnz} nonzeros (with self loops), "
            f"{graph.x.shape[1]} features, loaded in {time.perf_counter() - t0:.1f}s",
            file=sys.stderr,
        )
        single = single_process_seconds(cfg, graph, args.epochs)
        for algorithm, procs in RUNS:
            t0 = time.perf_counter()
            run = TrainConfig.resolve(**{**cfg.to_dict(), "algorithm": algorithm, "procs": procs}).validate()
            s = run_datacenter(run, graph=graph)
            e = s["per_epoch"]
            row = {
                "dataset": graph.name if not big else spec,
                "nodes": graph.num_nodes,
                "nnz": int(graph.adjacency.nnz),
                "widths": s["graph"]["widths"],
                "algorithm": algorithm,
                "procs": procs,
                "spmm_bytes_measured": e["spmm_bytes_measured"],
                "spmm_bytes_predicted": e["spmm_bytes_predicted"],
                "spmm_bytes_max_process": e["spmm_bytes_max_process"],
                "dense_bytes": e["dense_bytes"],
                "weights_bytes": e["weights_bytes"],
                "train_seconds": e["train_seconds"],
                "eval_seconds": e["eval_seconds"],
                "single_process_seconds": single,
                "wall_seconds": time.perf_counter() - t0,
            }
            rows.append(row)
            print(
                f"  {algorithm:>4} P={procs}: products "
                f"{human_bytes(row['spmm_bytes_measured'])}/epoch/process "
                f"(formula {human_bytes(row['spmm_bytes_predicted'])}), {row['train_seconds']:.3f}s/epoch",
                file=sys.stderr,
                flush=True,
            )

    print(
        f"\n{'dataset':<22} {'alg':>4} {'P':>2} {'products':>10} {'formula':>10} {'meas/form':>9} "
        f"{'max proc':>10} {'dense':>9} {'weights':>9} {'s/epoch':>8} {'1 proc':>7}"
    )
    for r in rows:
        print(
            f"{r['dataset']:<22} {r['algorithm']:>4} {r['procs']:>2} "
            f"{human_bytes(r['spmm_bytes_measured']):>10} "
            f"{human_bytes(r['spmm_bytes_predicted']):>10} "
            f"{r['spmm_bytes_measured'] / r['spmm_bytes_predicted']:>9.3f} "
            f"{human_bytes(r['spmm_bytes_max_process']):>10} {human_bytes(r['dense_bytes']):>9} "
            f"{human_bytes(r['weights_bytes']):>9} {r['train_seconds']:>8.3f} "
            f"{r['single_process_seconds']:>7.3f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"epochs": args.epochs, "hidden": args.hidden, "layers": args.layers, "cores": os.cpu_count()}
    out.write_text(json.dumps({"settings": meta, "rows": rows}, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
