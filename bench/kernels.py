"""Sparse (CSR) aggregation against edge-list message passing, side by side in one process.

    python bench/kernels.py [--dataset sbm:2500,5,140,0.8] [--epochs 200] [--hidden 256]
        [--lazy-rounds 200] [--out bench/results/kernels-DATE.json]

On one generated graph (at least 2,000 nodes and 150,000 edges by default), it times:

- the centralized 2-layer GCN of ``retexo-fl train --mode centralized`` (``run_centralized``),
  on the cached CSR adjacency it now uses, and on the edge list it used before;
- PyG's ``GCNConv`` trained by a plain loop on a cached ``torch.sparse_csr`` adjacency (the
  reference the centralized GCN's time is held to) and on ``edge_index``, with the same
  weights, epochs and per-epoch validation;
- a whole lazy run in process (every stage, default settings but ``--lazy-rounds``), on the
  CSR path and on the edge list.

It prints a table and writes JSON. The edge-list rows patch the model kinds that use the
adjacency to none, which is what the code did before; nothing else differs.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from datetime import date
from pathlib import Path

import torch

from retexo_fl.config import TrainConfig
from retexo_fl.data.loading import load_graph
from retexo_fl.data.partitioners import partition_graph
from retexo_fl.metrics import RunRecorder
from retexo_fl.party import client
from retexo_fl.plan import BoundaryPlan, LocalGraph
from retexo_fl.training import centralized
from retexo_fl.training.centralized import run_centralized, whole_graph_partition
from retexo_fl.training.lazy import run_lazy


class EdgeLists:
    """Within it, no model kind uses the CSR adjacency: the code path before it existed."""

    def __enter__(self) -> None:
        self.saved = (client.SPARSE_KINDS, centralized.SPARSE_KINDS)
        client.SPARSE_KINDS = centralized.SPARSE_KINDS = ()

    def __exit__(self, *exc: object) -> None:
        client.SPARSE_KINDS, centralized.SPARSE_KINDS = self.saved


def pyg_loop(
    part, epochs: int, hidden: int, sparse: bool, seed: int = 0, device: torch.device | None = None
) -> float:
    """Seconds of a plain PyG training loop: 2 GCNConv layers, Adam, validation every epoch
    (on ``device``, default the CPU; the tensors are moved there before the clock starts)."""
    device = device or torch.device("cpu")
    from torch_geometric.nn import GCNConv

    graph = LocalGraph.build(part, BoundaryPlan.from_partition(part))
    ei, w = graph.gcn_weights(torch.zeros(0))
    n = graph.num_owned
    if sparse:  # PyG's own conversion, as its docs show; built once, outside the timing
        from torch_geometric.utils import to_torch_csr_tensor

        adj = to_torch_csr_tensor(ei.flip(0), w, size=(n, n)).to(device)
    ei, w = ei.to(device), w.to(device)
    x = torch.from_numpy(part.x.astype("float32")).to(device)
    y = torch.from_numpy(part.y.astype("int64")).to(device)
    train_mask, val_mask = (
        torch.from_numpy(m.astype(bool)).to(device) for m in (part.train_mask, part.val_mask)
    )
    torch.manual_seed(seed)
    convs = torch.nn.ModuleList(
        [GCNConv(x.shape[1], hidden, normalize=False), GCNConv(hidden, part.num_classes, normalize=False)]
    )
    convs = convs.to(device)
    drop = torch.nn.Dropout(0.5)

    def forward() -> torch.Tensor:
        h = x
        for i, conv in enumerate(convs):
            h = drop(h)
            h = conv(h, adj) if sparse else conv(h, ei, w)
            if i == 0:
                h = torch.relu(h)
        return h

    opt = torch.optim.Adam(convs.parameters(), lr=0.01, weight_decay=5e-4)
    t0 = time.perf_counter()
    for _ in range(epochs):
        convs.train()
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(forward()[train_mask], y[train_mask])
        loss.backward()
        opt.step()
        convs.eval()
        with torch.no_grad():
            (forward().argmax(1)[val_mask] == y[val_mask]).float().mean()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="sbm:2500,5,140,0.8")
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--lazy-rounds", type=int, default=200, help="rounds per lazy stage (default 200)")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument(
        "--lazy-defaults",
        action="store_true",
        help="the lazy run with the package's defaults (hidden, rounds, early stopping, self-training) "
        "instead of --hidden and --lazy-rounds",
    )
    parser.add_argument(
        "--skip-edge-list", action="store_true", help="leave out the edge-list rows (the code before CSR)"
    )
    parser.add_argument("--out", default=f"bench/results/kernels-{date.today()}.json")
    args = parser.parse_args()
    quiet = RunRecorder(None, stream=None)
    base = TrainConfig(dataset=args.dataset, hidden=args.hidden, seed=0, device="cpu")
    data = load_graph(base)
    part = whole_graph_partition(data)
    edges = int(data.edge_index.shape[1])
    print(f"{args.dataset}: {data.num_nodes} nodes, {edges // 2} undirected edges ({edges} directed)")
    central = TrainConfig.resolve(
        **{
            **base.to_dict(),
            "mode": "centralized",
            "rounds": args.epochs,
            "server_lr": 0.01,
            # exactly --epochs full-batch epochs, as PyG's loop runs: one pass, one epoch a round
            "local_epochs": 1,
            "self_training": 0,
        }
    )
    rows = []

    def timed(name: str, fn) -> dict:
        t0 = time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - t0
        row = {"run": name, "seconds": round(seconds, 2)}
        if isinstance(out, dict):
            row.update(
                test_accuracy=round(out["test_accuracy"], 4), val_accuracy=round(out["val_accuracy"], 4)
            )
        rows.append(row)
        print(f"  {name:<44} {seconds:8.1f} s  {row.get('test_accuracy', '')}", flush=True)
        return row

    timed("PyG GCNConv, cached CSR (reference)", lambda: pyg_loop(part, args.epochs, args.hidden, True))
    if not args.skip_edge_list:
        timed("PyG GCNConv, edge_index", lambda: pyg_loop(part, args.epochs, args.hidden, False))
    ours = timed("retexo-fl centralized, CSR", lambda: run_centralized(part, central, quiet))["seconds"]
    if not args.skip_edge_list:
        with EdgeLists():
            timed("retexo-fl centralized, edge list (before)", lambda: run_centralized(part, central, quiet))
    if args.lazy_defaults:
        lazy = TrainConfig.resolve(dataset=args.dataset, clients=args.clients, seed=0, device="cpu")
    else:
        lazy = TrainConfig.resolve(**{**base.to_dict(), "clients": args.clients, "rounds": args.lazy_rounds})
    parts = partition_graph(data, args.clients, lazy.method, seed=0)
    lazy_s = timed("retexo-fl lazy, in process, CSR", lambda: run_lazy(copy.deepcopy(parts), lazy, quiet))[
        "seconds"
    ]
    if not args.skip_edge_list:
        with EdgeLists():
            timed("retexo-fl lazy, in process, edge list (before)", lambda: run_lazy(parts, lazy, quiet))
    ref = rows[0]["seconds"]
    summary = {
        "dataset": args.dataset,
        "nodes": int(data.num_nodes),
        "undirected_edges": edges // 2,
        "epochs": args.epochs,
        "hidden": args.hidden,
        "lazy": {
            "clients": args.clients,
            "stages": lazy.total_stages,
            "hidden": lazy.hidden,
            "rounds_per_stage": lazy.rounds,
            "defaults": args.lazy_defaults,
        },
        "threads": torch.get_num_threads(),
        "rows": rows,
        "centralized_over_pyg_csr": round(ours / ref, 3),
        "lazy_over_centralized": round(lazy_s / ours, 3),
    }
    print(
        f"centralized / PyG CSR: {summary['centralized_over_pyg_csr']}x (target <= 1.25); "
        f"lazy / centralized: {summary['lazy_over_centralized']}x (target <= 1)"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
