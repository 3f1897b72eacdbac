"""The whole graph a data-center run trains on: from a dataset, or pooled from partitions it may pool."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch

from retexo_fl.data.partition import (
    CROSS_IN,
    CROSS_OUT,
    Partition,
    PartitionError,
    load_partitions,
    partition_dirs,
    read_manifest,
)
from retexo_fl.datacenter.settings import DatacenterConfig
from retexo_fl.plan import BoundaryPlan, LocalGraph


class ResidencyError(ValueError):
    """Data-center mode was asked to pool partitions whose owners keep them where they are."""


@dataclass
class FullGraph:
    """Everything a data-center process cuts its blocks from.

    Attributes:
        adjacency: ``[n, n]`` GCN-normalized adjacency with self loops; row = target node.
        x: ``[n, F]`` features. y: ``[n]`` labels (``-1`` unlabeled).
        masks: ``train``, ``val``, ``test`` ``[n]`` bool.
        name: dataset name.
    """

    adjacency: sp.csr_matrix
    x: torch.Tensor
    y: torch.Tensor
    masks: dict[str, torch.Tensor]
    name: str
    num_classes: int

    @property
    def num_nodes(self) -> int:
        return int(self.x.shape[0])


def check_residency(cfg: DatacenterConfig) -> None:
    """Refuse partitions marked residency-bound unless the user says the cluster is trusted."""
    if not cfg.partitions:
        return
    root = Path(cfg.partitions)
    dirs = partition_dirs(root)
    if not dirs:
        raise PartitionError(root, "directory", "no part-* sub-directories")
    bound = [d.name for d in dirs if read_manifest(d).get("residency_bound", True)]
    if bound and not cfg.datacenter.trusted_cluster:
        raise ResidencyError(
            f"{root}: partitions {', '.join(bound)} are residency-bound (manifest.json residency_bound); "
            "data-center mode moves every party's rows to other processes. Train them with a "
            "federated mode (lazy, eager, local), or pass --trusted-cluster if every process runs "
            "where that data may go"
        )


def pool_partitions(parts: list[Partition]) -> Partition:
    """One partition holding every node and edge of ``parts`` (the graph they were cut from)."""
    ids = np.concatenate([p.node_ids for p in parts])
    n = parts[0].num_global_nodes
    if ids.shape[0] != n or not np.array_equal(np.sort(ids), np.arange(n)):
        raise PartitionError(
            "partitions",
            "node_ids",
            f"the partitions own {ids.shape[0]} ids ({np.unique(ids).shape[0]} distinct); pooling needs "
            f"each of the {n} nodes exactly once",
        )
    order = np.argsort(ids)
    edges = [p.edges for p in parts]
    for p in parts:
        c = p.cross_edges
        inc, out = c[(c[:, 3] & CROSS_IN) > 0], c[(c[:, 3] & CROSS_OUT) > 0]
        edges += [np.stack([inc[:, 1], inc[:, 0]]), np.stack([out[:, 0], out[:, 1]])]
    all_edges = np.unique(np.concatenate(edges, axis=1), axis=1)

    def cat(field: str) -> np.ndarray:
        return np.concatenate([getattr(p, field) for p in parts])[order]

    return dataclasses.replace(
        parts[0],
        partition_id=0,
        num_partitions=1,
        node_ids=np.arange(n, dtype=np.int64),
        x=cat("x"),
        y=cat("y"),
        train_mask=cat("train_mask"),
        val_mask=cat("val_mask"),
        test_mask=cat("test_mask"),
        edges=all_edges,
        cross_edges=np.zeros((0, 4), dtype=np.int64),
    )


def load_full_graph(cfg: DatacenterConfig) -> FullGraph:
    """The whole graph of ``cfg`` with the centralized reference's GCN normalization."""
    if cfg.partitions:
        check_residency(cfg)
        part = pool_partitions(load_partitions(cfg.partitions))
    else:
        # Imported here: a process handed its graph (the launcher's children) never loads PyG.
        from retexo_fl.data.loading import load_graph
        from retexo_fl.training.centralized import whole_graph_partition

        part = whole_graph_partition(load_graph(cfg))
    graph = LocalGraph.build(part, BoundaryPlan.from_partition(part))
    ei, w = graph.gcn_weights(torch.zeros(0))
    n = part.num_nodes
    # GCN aggregates messages src -> dst at dst: row dst, column src.
    adjacency = sp.csr_matrix((w.numpy(), (ei[1].numpy(), ei[0].numpy())), shape=(n, n))
    return FullGraph(
        adjacency=adjacency,
        x=torch.from_numpy(np.asarray(part.x, dtype=np.float32)),
        y=torch.from_numpy(np.asarray(part.y, dtype=np.int64)),
        masks={k: torch.from_numpy(np.asarray(getattr(part, f"{k}_mask"))) for k in ("train", "val", "test")},
        name=part.dataset,
        num_classes=part.num_classes,
    )
