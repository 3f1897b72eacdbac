"""Data-center mode's graph: pooled partitions equal the whole graph, and residency is enforced."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from retexo_fl.config import TrainConfig
from retexo_fl.data.partition import load_partitions, save_partition
from retexo_fl.data.partitioners import partition_graph
from retexo_fl.datacenter.graph import ResidencyError, check_residency, load_full_graph, pool_partitions
from retexo_fl.datacenter.model import ReferenceGCN, initial_weights
from retexo_fl.models.gnn import GNN
from retexo_fl.plan import BoundaryPlan, LocalGraph
from retexo_fl.seeding import derive_seed
from retexo_fl.training.centralized import whole_graph_partition


def _write(parts, root, bound: bool):
    for p in parts:
        save_partition(dataclasses.replace(p, residency_bound=bound), root / f"part-{p.partition_id}")
    return root


def test_pooled_partitions_are_the_whole_graph(sbm, tmp_path):
    parts = partition_graph(sbm, 4, "metis", seed=0)
    pooled = pool_partitions(load_partitions(_write(parts, tmp_path, bound=False)))
    whole = whole_graph_partition(sbm)
    for f in ("node_ids", "x", "y", "train_mask", "val_mask", "test_mask"):
        np.testing.assert_array_equal(getattr(pooled, f), getattr(whole, f), err_msg=f)
    key = lambda e: set(map(tuple, e.T.tolist()))  # noqa: E731
    assert key(pooled.edges) == key(whole.edges)


def test_pooling_needs_every_node_once(sbm):
    parts = partition_graph(sbm, 3, "random", seed=0)
    with pytest.raises(ValueError, match="each of the 600 nodes exactly once"):
        pool_partitions(parts[:2])


def test_residency_bound_partitions_are_refused(sbm, tmp_path):
    root = _write(partition_graph(sbm, 2, "metis", seed=0), tmp_path, bound=True)
    cfg = TrainConfig.resolve(profile="exact", mode="datacenter", partitions=str(root), procs=2)
    with pytest.raises(ResidencyError, match=r"part-0, part-1 are residency-bound.*--trusted-cluster"):
        check_residency(cfg)
    with pytest.raises(ResidencyError):
        load_full_graph(cfg)
    # The user vouches for the cluster: the same partitions pool into the graph they came from.
    graph = load_full_graph(dataclasses.replace(cfg, trusted_cluster=True))
    assert graph.num_nodes == 600 and graph.adjacency.shape == (600, 600)


def test_manifest_without_the_field_is_bound(sbm, tmp_path):
    root = _write(partition_graph(sbm, 2, "metis", seed=0), tmp_path, bound=False)
    check_residency(
        TrainConfig.resolve(profile="exact", mode="datacenter", partitions=str(root), procs=2)
    )  # free: fine
    manifest = root / "part-1" / "manifest.json"
    data = json.loads(manifest.read_text())
    del data["residency_bound"]
    manifest.write_text(json.dumps(data))
    with pytest.raises(ResidencyError, match="part-1"):
        check_residency(
            TrainConfig.resolve(profile="exact", mode="datacenter", partitions=str(root), procs=2)
        )


def test_adjacency_is_the_centralized_normalization(sbm):
    """The matrix the processes cut is what the centralized GCN propagates with."""
    cfg = TrainConfig.resolve(profile="exact", dataset="unused")
    part = whole_graph_partition(sbm)
    graph = LocalGraph.build(part, BoundaryPlan.from_partition(part))
    ei, w = graph.gcn_weights(torch.zeros(0))
    torch.manual_seed(derive_seed(cfg.seed, 0xC3))
    central = GNN("gcn", 16, 32, 3, layers=2, dropout=0.0).eval()
    adj = sp.csr_matrix((w.numpy(), (ei[1].numpy(), ei[0].numpy())), shape=(600, 600)).tocoo()
    a = torch.sparse_coo_tensor(np.vstack([adj.row, adj.col]), torch.tensor(adj.data), adj.shape)
    ref = ReferenceGCN(initial_weights(16, 32, 3, 2, cfg.seed), a).eval()
    x = sbm.x.float()
    torch.testing.assert_close(ref(x), central(x, ei, w), rtol=1e-5, atol=1e-5)


def test_process_grids_are_checked():
    with pytest.raises(ValueError, match="square"):
        TrainConfig.resolve(profile="exact", mode="datacenter", algorithm="2d", procs=6).validate()
    with pytest.raises(ValueError, match="cube"):
        TrainConfig.resolve(profile="exact", mode="datacenter", algorithm="3d", procs=4).validate()
    with pytest.raises(ValueError, match="replication factor 3"):
        TrainConfig.resolve(
            profile="exact", mode="datacenter", algorithm="1.5d", procs=4, replication=3
        ).validate()
    with pytest.raises(ValueError, match="algorithm"):
        TrainConfig.resolve(profile="exact", mode="datacenter", algorithm="4d").validate()
