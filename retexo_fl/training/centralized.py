"""Centralized references: the standard end-to-end GNN and lazy training on the whole graph."""

from __future__ import annotations

import copy
import math
import time

import numpy as np
import torch

from retexo_fl.config import TrainConfig
from retexo_fl.coordinator.selection import keep_best_stage
from retexo_fl.data.partition import Partition
from retexo_fl.data.partitioners import split_graph
from retexo_fl.metrics import RunRecorder
from retexo_fl.models.adjacency import SPARSE_KINDS, sparse_adjacency
from retexo_fl.models.gnn import GNN
from retexo_fl.party.client import TrainingDiverged
from retexo_fl.party.pseudo import pseudo_labels
from retexo_fl.plan import BoundaryPlan, LocalGraph
from retexo_fl.seeding import derive_seed, resolve_device
from retexo_fl.summary import RunSummary


def whole_graph_partition(data) -> Partition:
    """The whole graph as one partition (no cross edges).

    Args:
        data (Data): the graph, with ``train/val/test_mask`` set.
    """
    return split_graph(data, np.zeros(data.num_nodes, dtype=np.int64), 1, method="whole")[0]


def run_centralized(part: Partition, cfg: TrainConfig, rec: RunRecorder | None = None) -> RunSummary:
    """Standard full-batch training of a ``cfg.central_layers``-layer GNN (default 2) on one graph.

    Uses the same GCN normalization as lazy mode and the settings of stage 1: epochs =
    ``rounds * local_epochs``, its ``weight_decay``, and the learning rate ``server_lr`` when
    ``server-optimizer`` is ``adam`` (the rate that drives federated training then), else ``lr``;
    the best-validation epoch's weights are tested. With ``self_training`` passes, each pass
    trains a fresh model on the given labels plus the previous pass's predictions of at least
    ``pseudo_threshold`` confidence, at most ``pseudo_per_class`` per class when set (as lazy
    mode does, per client).

    Args:
        part (Partition): the graph as one partition (see :func:`whole_graph_partition`).
        cfg (TrainConfig): the run configuration.
        rec (RunRecorder | None, optional): where progress lines and epoch events go; ``None``
            records nothing. (default: :obj:`None`)

    Returns:
        The run summary: ``test_accuracy`` and ``val_accuracy`` of the pass whose best model
        validates best (ties to the later pass; ``kept_pass`` names it), zero byte counts, and
        one ``stages`` entry per pass.
    """
    rec = rec or RunRecorder(None, stream=None)
    device = resolve_device(cfg.device, part.num_nodes)
    t0 = time.perf_counter()
    graph = LocalGraph.build(part, BoundaryPlan.from_partition(part))
    if cfg.model == "gcn":
        ei, w = graph.gcn_weights(torch.zeros(0))
    else:
        ei, w = graph.edge_index, None
    ei = ei.to(device)
    w = w.to(device) if w is not None else None
    if cfg.model in SPARSE_KINDS:  # one CSR matrix, built once: a sparse-dense product per layer
        ei, w = sparse_adjacency(ei, w, graph.num_owned, graph.num_owned), None
    x = torch.from_numpy(np.array(part.x, dtype=np.float32)).to(device)
    y = torch.from_numpy(np.array(part.y)).to(device)
    masks = {
        k: torch.from_numpy(np.array(getattr(part, f"{k}_mask"))).to(device) for k in ("train", "val", "test")
    }
    layers = cfg.central_layers
    # The server's Adam is what drives federated training when it is on; mirror its rate.
    lr = float(cfg.per_stage("server_lr" if cfg.per_stage("server_optimizer", 1) == "adam" else "lr", 1))
    epochs = int(cfg.per_stage("rounds", 1)) * int(cfg.per_stage("local_epochs", 1))
    decay = float(cfg.per_stage("weight_decay", 1))

    def predict(model: torch.nn.Module) -> torch.Tensor:
        model.eval()
        with torch.no_grad():
            return model(x, ei, w)

    def share(hits: torch.Tensor) -> float:
        # Counted, not a float32 mean: 0.809, not 0.8090000152587891, as the other modes report.
        return int(hits.sum()) / hits.numel() if hits.numel() else float("nan")

    def accuracy(model: torch.nn.Module, split: str) -> float:
        m = masks[split]
        return share(predict(model).argmax(1)[m] == y[m])

    def validate(model: torch.nn.Module) -> tuple[float, float]:
        """Validation accuracy and loss (the loss breaks ties between passes)."""
        m = masks["val"]
        out = predict(model)[m]
        return share(out.argmax(1) == y[m]), float(torch.nn.functional.cross_entropy(out, y[m]))

    train_y, train_mask = y, masks["train"]
    passes: list[dict] = []
    model: torch.nn.Module | None = None
    for pass_ in range(1 + cfg.self_training):
        if model is not None:  # self-training: the last pass's confident predictions become labels
            train_y, train_mask = pseudo_labels(
                predict(model), y, masks["train"], masks["val"], cfg.pseudo_threshold, cfg.pseudo_per_class
            )
            rec.progress(f"self-training pass {pass_}: {int(train_mask.sum())} training nodes")
        torch.manual_seed(derive_seed(cfg.seed, 0xC3, pass_) if pass_ else derive_seed(cfg.seed, 0xC3))
        model = GNN(
            cfg.model,
            x.shape[1],
            cfg.hidden,
            part.num_classes,
            layers=layers,
            dropout=float(cfg.per_stage("dropout", 1)),
            heads=cfg.heads,
        ).to(device)
        opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=decay)

        best_val, best_loss, best_state, best_epoch = -1.0, float("nan"), None, 0
        for epoch in range(1, epochs + 1):
            model.train()
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x, ei, w)[train_mask], train_y[train_mask])
            loss.backward()
            opt.step()
            train_loss = loss.item()
            if not math.isfinite(train_loss):  # else every later epoch trains on NaN weights
                raise TrainingDiverged(
                    f"centralized training diverged: loss {train_loss} at epoch {epoch} (learning rate "
                    f"{lr:g}); inputs of large magnitude do this: scale the node features to about unit "
                    "size, or lower --lr"
                )
            val, val_loss = validate(model)
            rec.event("epoch", epoch=epoch, train_loss=train_loss, val_accuracy=val)
            if val > best_val:
                best_val, best_loss, best_state, best_epoch = (
                    val,
                    val_loss,
                    copy.deepcopy(model.state_dict()),
                    epoch,
                )
            if epoch == 1 or epoch % max(1, epochs // 5) == 0:
                rec.progress(f"epoch {epoch:4d}/{epochs}  loss {train_loss:.4f}  val {val:.4f}")
        if best_state is not None:
            model.load_state_dict(best_state)
        passes.append(
            {
                "stage": pass_,
                "best_round": best_epoch,
                "val_accuracy": best_val,
                "val_loss": best_loss,
                "test_accuracy": accuracy(model, "test"),
                "train_nodes": int(train_mask.sum()),
                "seconds": time.perf_counter() - t0,
            }
        )
    kept = keep_best_stage(passes)  # as in a lazy run
    if kept is not passes[-1]:
        rec.progress(
            f"kept self-training pass {kept['stage']}: validation {kept['val_accuracy']:.4f}, "
            f"the last pass's {passes[-1]['val_accuracy']:.4f}"
        )
    return RunSummary(
        mode="centralized",
        engine="in-process",
        test_accuracy=kept["test_accuracy"],
        val_accuracy=kept["val_accuracy"],
        bytes_total=0,
        bytes_boundary=0,
        bytes_model=0,
        stages=passes,
        kept_pass=kept["stage"] if len(passes) > 1 else None,
    )
