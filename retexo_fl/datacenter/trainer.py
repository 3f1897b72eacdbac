"""One data-center process: cut its blocks, train the full-graph GCN, count every byte it moves."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from retexo_fl.datacenter.comm import CommLedger, Counted, Group
from retexo_fl.datacenter.graph import FullGraph
from retexo_fl.datacenter.model import DistributedGCN, initial_weights
from retexo_fl.datacenter.one_d import OneD
from retexo_fl.datacenter.one_half_d import OneHalfD
from retexo_fl.datacenter.settings import DatacenterConfig
from retexo_fl.datacenter.spmm import DistributedSpMM
from retexo_fl.datacenter.three_d import ThreeD
from retexo_fl.datacenter.two_d import TwoD
from retexo_fl.datacenter.volumes import epoch_spmm_bytes
from retexo_fl.metrics import RunRecorder, human_bytes


def make_algorithm(
    cfg: DatacenterConfig, graph: FullGraph, comm: Counted, world: tuple[int, int], device: torch.device
) -> DistributedSpMM:
    """The ``cfg.datacenter.algorithm`` product over ``graph``'s adjacency for this process."""
    dc = cfg.datacenter
    if dc.algorithm == "1.5d":
        return OneHalfD(graph.adjacency, comm, world, device, replication=dc.replication)
    kind = {"1d": OneD, "2d": TwoD, "3d": ThreeD}[dc.algorithm]
    return kind(graph.adjacency, comm, world, device)


def schedule(cfg: DatacenterConfig) -> tuple[int, float, float]:
    """``(epochs, lr, dropout)``: the centralized reference's, so the two are comparable."""
    epochs = int(cfg.per_stage("rounds", 1)) * int(cfg.per_stage("local_epochs", 1))
    lr = float(cfg.per_stage("server_lr" if cfg.per_stage("server_optimizer", 1) == "adam" else "lr", 1))
    return epochs, lr, float(cfg.per_stage("dropout", 1))


def train_process(
    cfg: DatacenterConfig, graph: FullGraph, device: torch.device, rec: RunRecorder | None = None
) -> dict | None:
    """Train on this process's blocks; every process of the group calls it. Rank 0 returns the summary.

    The weights are replicated and start as the centralized GCN's; each epoch runs the forward
    and backward products, all-reduces the weight gradients over the algorithm's gradient group,
    steps Adam, and evaluates (another forward pass, counted as phase ``eval``).
    """
    rank, size = dist.get_rank(), dist.get_world_size()
    dc = cfg.datacenter
    ledger = CommLedger()
    comm = Counted(ledger, rank)
    world = Group(tuple(range(size)))
    t_setup = time.perf_counter()
    algo = make_algorithm(cfg, graph, comm, (rank, size), device)
    epochs, lr, dropout = schedule(cfg)
    layers = cfg.central_layers
    init = initial_weights(graph.x.shape[1], cfg.hidden, graph.num_classes, layers, cfg.seed)
    model = DistributedGCN([(w.to(device), b.to(device)) for w, b in init], algo, dropout, cfg.seed)
    x = graph.x[algo.rows(0), algo.cols(graph.x.shape[1])].contiguous().to(device)
    out_rows = algo.rows(layers)
    y = graph.y[out_rows].to(device)
    masks = {k: m[out_rows].to(device) for k, m in graph.masks.items()}
    n_train = max(1, int(graph.masks["train"].sum()))
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=float(cfg.per_stage("weight_decay", 1)))
    setup_seconds = time.perf_counter() - t_setup
    counts_rows = float(algo.counts_rows)

    def metrics(values: list[float]) -> list[float]:
        with algo.counting("metrics"):
            t = torch.tensor(values, dtype=torch.float64, device=device)
            return comm.all_reduce(t, world).tolist()

    history, best_val, best_test, best_epoch = [], -1.0, 0.0, 0
    train_s = eval_s = 0.0
    for epoch in range(1, epochs + 1):
        ledger.phase = "train"
        t0 = time.perf_counter()
        model.train()
        opt.zero_grad()
        logits = model(x, epoch)
        m = masks["train"]
        # Every process runs backward (the products in it are collective), train rows or not.
        loss = F.cross_entropy(logits[m], y[m], reduction="sum") / n_train + 0.0 * logits.sum()
        loss.backward()
        with algo.counting("weights"):
            for p in model.parameters():
                comm.all_reduce(p.grad, algo.gradient_group)
        opt.step()
        train_s += time.perf_counter() - t0
        t1 = time.perf_counter()
        ledger.phase = "eval"
        model.eval()
        with torch.no_grad():
            pred = model(x).argmax(1)
        local = [loss.item() * counts_rows]
        for k in ("val", "test"):
            mk = masks[k]
            local += [float((pred[mk] == y[mk]).sum()) * counts_rows, float(mk.sum()) * counts_rows]
        train_loss, val_ok, val_n, test_ok, test_n = metrics(local)
        eval_s += time.perf_counter() - t1
        val, test = val_ok / max(val_n, 1), test_ok / max(test_n, 1)
        history.append({"round": epoch, "train_loss": train_loss, "val_accuracy": val, "test_accuracy": test})
        if val > best_val:
            best_val, best_test, best_epoch = val, test, epoch
        if rec and rank == 0 and (epoch == 1 or epoch % max(1, epochs // 5) == 0):
            rec.progress(
                f"{dc.algorithm} P={size} epoch {epoch:4d}/{epochs}  loss {train_loss:.4f}  val {val:.4f}  "
                f"received {human_bytes(ledger.total())} here"
            )
    rows = [None] * size
    dist.all_gather_object(rows, {"rows": ledger.to_rows(), "train_s": train_s, "eval_s": eval_s})
    if rank != 0:
        return None
    summary = _summary(cfg, graph, model, rows, history, best_val, best_test, best_epoch, setup_seconds)
    summary["final_weights"] = [
        (w.detach().cpu(), b.detach().cpu())
        for w, b in zip(model.params.weights, model.params.biases, strict=True)
    ]
    return summary


def _summary(cfg, graph, model, per_process, history, best_val, best_test, best_epoch, setup_seconds) -> dict:
    dc = cfg.datacenter
    size, epochs = len(per_process), max(1, len(history))

    def total(category: str | None = None, phase: str | None = None, p: int | None = None) -> int:
        procs = range(size) if p is None else [p]
        return sum(
            r["bytes_received"]
            for q in procs
            for r in per_process[q]["rows"]
            if (category is None or r["category"] == category) and (phase is None or r["phase"] == phase)
        )

    widths = [w.shape[1] for w in model.params.weights]
    nnz = int(graph.adjacency.nnz)
    predicted = epoch_spmm_bytes(dc.algorithm, graph.num_nodes, nnz, widths, size, dc.replication)
    measured = total("spmm", "train") / size / epochs
    per_epoch_all = total() / epochs
    for h in history:
        h["bytes_total"] = round(per_epoch_all * h["round"])
    spmm_per_proc = [total("spmm", "train", p) / epochs for p in range(size)]
    return {
        "mode": "datacenter",
        "engine": "torch.distributed",
        "algorithm": dc.algorithm,
        "procs": size,
        "replication": dc.replication if dc.algorithm == "1.5d" else 1,
        "backend": dist.get_backend(),
        "test_accuracy": best_test,
        "val_accuracy": best_val,
        # Summed over processes: every byte any process received, like the federated modes' totals.
        "bytes_total": total(),
        "bytes_boundary": total("spmm"),
        "bytes_model": total("weights"),
        "bytes_dense": total("dense"),
        "bytes_metrics": total("metrics"),
        "graph": {"name": graph.name, "nodes": graph.num_nodes, "nnz": nnz, "widths": widths},
        "per_epoch": {
            "spmm_bytes_measured": measured,
            "spmm_bytes_predicted": predicted,
            "spmm_bytes_max_process": max(spmm_per_proc),
            "dense_bytes": total("dense", "train") / size / epochs,
            "weights_bytes": total("weights", "train") / size / epochs,
            "train_seconds": max(r["train_s"] for r in per_process) / epochs,
            "eval_seconds": max(r["eval_s"] for r in per_process) / epochs,
        },
        "setup_seconds": setup_seconds,
        "communication": [{"rank": p, "collectives": per_process[p]["rows"]} for p in range(size)],
        "stages": [
            {
                "stage": 0,
                "best_round": best_epoch,
                "val_accuracy": best_val,
                "history": history,
            }
        ],
    }
