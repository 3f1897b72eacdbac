"""Every partitioner: deterministic for a seed, covers every node once, cross edges mirrored."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from retexo_fl.data.partition import CROSS_BOTH, check_cross_consistency
from retexo_fl.data.partitioners import PARTITIONERS, assign_nodes, partition_graph, split_graph

METHODS = ["metis", "louvain", "random", "supernode", "label-skew"]


def test_every_registered_method_is_tested():
    assert set(PARTITIONERS) == {*METHODS, "node"}


@pytest.mark.parametrize("method", METHODS)
def test_deterministic_and_seeded(sbm, method):
    a = assign_nodes(sbm, 4, method, seed=3)
    b = assign_nodes(sbm, 4, method, seed=3)
    np.testing.assert_array_equal(a, b)
    assert a.shape == (sbm.num_nodes,)
    assert set(np.unique(a)) == {0, 1, 2, 3}
    if method in ("random", "label-skew", "supernode"):
        assert not np.array_equal(a, assign_nodes(sbm, 4, method, seed=4))


@pytest.mark.parametrize("method", METHODS)
def test_partitions_cover_graph_and_mirror_cross_edges(sbm, method):
    parts = partition_graph(sbm, 4, method, seed=0)
    ids = np.concatenate([p.node_ids for p in parts])
    assert np.array_equal(np.sort(ids), np.arange(sbm.num_nodes)), "every node exactly once"
    check_cross_consistency(parts)
    # Every directed edge is either local to one part or one IN cross-edge record at its target.
    local = sum(p.edges.shape[1] for p in parts)
    cross = sum(p.cross_edges.shape[0] for p in parts)
    assert local + cross == sbm.edge_index.size(1)
    for p in parts:
        assert (p.cross_edges[:, 3] == CROSS_BOTH).all()
        for split in ("train", "val", "test"):
            np.testing.assert_array_equal(
                getattr(p, f"{split}_mask"), sbm[f"{split}_mask"].numpy()[p.node_ids]
            )


def test_metis_cuts_fewer_edges_than_random(sbm):
    def cut(method):
        return sum(p.cross_edges.shape[0] for p in partition_graph(sbm, 4, method, seed=0))

    assert cut("metis") < 0.5 * cut("random")


def test_label_skew_concentrates_labels(sbm):
    owner = assign_nodes(sbm, 4, "label-skew", seed=0, alpha=0.1)
    y = sbm.y.numpy()
    # With alpha 0.1 most of each class lands on one client.
    top_share = [np.bincount(owner[y == c], minlength=4).max() / (y == c).sum() for c in range(3)]
    assert np.mean(top_share) > 0.6


def test_one_node_per_client():
    from torch_geometric.data import Data

    data = Data(
        x=torch.randn(5, 2), y=torch.arange(5) % 2, edge_index=torch.tensor([[0, 1, 1, 2], [1, 0, 2, 1]])
    )
    owner = assign_nodes(data, 5, "node")
    np.testing.assert_array_equal(owner, np.arange(5))
    with pytest.raises(ValueError, match="clients == num_nodes"):
        assign_nodes(data, 3, "node")


def test_directed_graph_records_directions():
    from torch_geometric.data import Data

    ei = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 0]])  # a directed 4-cycle
    data = Data(x=torch.randn(4, 2), y=torch.zeros(4, dtype=torch.long), edge_index=ei)
    for k in ("train_mask", "val_mask", "test_mask"):
        data[k] = torch.zeros(4, dtype=torch.bool)
    parts = split_graph(data, np.array([0, 0, 1, 1]), 2)
    check_cross_consistency(parts)
    assert parts[0].directed
    # part 0 owns 0,1: 1->2 leaves (OUT), 3->0 arrives (IN).
    rows = {tuple(r) for r in parts[0].cross_edges.tolist()}
    assert rows == {(1, 2, 1, 2), (0, 3, 1, 1)}


def test_unknown_method_and_empty_clients(sbm):
    with pytest.raises(ValueError, match="unknown partition method"):
        assign_nodes(sbm, 2, "bogus")
    with pytest.raises(ValueError, match="without nodes"):
        assign_nodes(sbm, 5000, "random")
