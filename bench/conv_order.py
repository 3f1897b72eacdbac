"""A local stage 0's step in PyG's order, ``A (x W)``, against ``run_conv``'s choice.

For each graph x partitioning, every client of one cut builds its local stage 0 (a GCN layer
over its own edges, raw features to the hidden width) and its step graph (its training rows'
in-edges), and times a step's forward pass and weight gradient both ways, interleaved: PyG's
GCNConv, and :func:`retexo_fl.models.adjacency.run_conv`, which aggregates first,
``(A x) W``, where :func:`~retexo_fl.models.adjacency.aggregates_first` says so. Prints the
milliseconds summed over a cut's clients and how many clients aggregate first; writes JSON.

    python bench/conv_order.py --cells cora:random:10,citeseer:metis:4,twitch-TW:metis:4 --out x.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_ROOT

DEFAULT_CELLS = (
    "cora:random:10,cora:metis:4,citeseer:metis:4,citeseer:random:10,chameleon:random:10,"
    "squirrel:random:10,twitch-PTBR:random:10,twitch-TW:metis:4,twitch-ENGB:random:10"
)


def time_cell(root: Path, graph: str, method: str, clients: int, repeats: int) -> dict:
    """One cut's clients: PyG's order and run_conv's, summed over clients (ms a step)."""
    import robustness
    import torch

    from retexo_fl.config import TrainConfig
    from retexo_fl.models.adjacency import aggregates_first, run_conv
    from retexo_fl.party.lazy_client import LazyClient
    from retexo_fl.runner import make_partitions

    dataset, split = robustness.graphs(root)[graph]
    extra = {"split_index": 0} if graph in robustness.MULTI_SPLIT else {}
    cfg = TrainConfig.resolve(
        data_root=str(root), device="cpu", dataset=dataset, split=split, method=method,
        clients=clients, seed=0, mode="lazy", first_stage="local", **extra,
    )  # fmt: skip
    totals = {"pyg": 0.0, "run_conv": 0.0}
    first = members = 0
    for part in make_partitions(cfg):
        client = LazyClient(part, cfg)
        model = client.make_model().train()
        rows = client.split_rows("train")
        if rows.numel() == 0:
            continue
        adj = client.step_graph(model, rows, client.train_labels())
        x = client.stage_input()
        mask = (torch.rand_like(x) > 0.5).float() * 2  # input dropout, drawn once
        members += 1
        first += aggregates_first(model.body, adj, x)
        conv = model.body

        def pyg(conv=conv, x=x, mask=mask, adj=adj) -> None:
            conv(x * mask, adj).sum().backward()

        def ours(conv=conv, x=x, mask=mask, adj=adj, rows=rows) -> None:
            run_conv(conv, "gcn", x * mask, adj, None, rows).sum().backward()

        steps = {"pyg": pyg, "run_conv": ours}
        for step in steps.values():  # warm
            step()
        times: dict[str, list[float]] = {k: [] for k in steps}
        for _ in range(repeats):
            for name, step in steps.items():
                t = time.process_time()
                step()
                times[name].append(time.process_time() - t)
        for name in steps:
            totals[name] += statistics.median(times[name])
    return {
        "graph": graph,
        "partitioning": f"{method}-{clients}",
        "features": int(x.shape[1]),
        "clients": members,
        "aggregate_first": int(first),
        "pyg_ms": 1000 * totals["pyg"],
        "run_conv_ms": 1000 * totals["run_conv"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=Path(DEFAULT_ROOT), help="the shared datasets folder")
    ap.add_argument("--cells", default=DEFAULT_CELLS, help="graph:method:clients,... (robustness.py's names)")
    ap.add_argument("--repeats", type=int, default=7, help="timed steps a client and order (the median)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    import robustness

    root = robustness.private_root(args.root)  # PyG's processed files, written here once
    rows = []
    print(f"{'graph':14}{'clients':>14}{'agg. first':>12}{'PyG ms':>10}{'run_conv ms':>13}{'speed-up':>10}")
    for cell in args.cells.split(","):
        graph, method, clients = cell.split(":")
        row = time_cell(root, graph, method, int(clients), args.repeats)
        rows.append(row)
        print(
            f"{graph:14}{row['partitioning']:>14}{row['aggregate_first']:>6} of {row['clients']:<3}"
            f"{row['pyg_ms']:>10.1f}{row['run_conv_ms']:>13.1f}{row['pyg_ms'] / row['run_conv_ms']:>9.2f}x",
            flush=True,
        )
    if args.out:
        args.out.write_text(json.dumps({"threads": 1, "rows": rows}, indent=1))
        print(f"-> {args.out}")


if __name__ == "__main__":
    main()
