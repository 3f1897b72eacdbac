"""Key-based edge clean-up equals PyG's remove_self_loops / to_undirected / coalesce chain."""

from __future__ import annotations

import pytest
import torch
from torch_geometric.utils import coalesce, is_undirected, remove_self_loops, to_undirected

from retexo_fl.data.edges import coalesced, coalesced_facts, undirected_coalesced


def _messy(n: int, e: int, seed: int) -> torch.Tensor:
    """Random edges with duplicates and self loops, in no order."""
    gen = torch.Generator().manual_seed(seed)
    ei = torch.randint(n, (2, e), generator=gen)
    return torch.cat([ei, ei[:, : e // 5], torch.arange(3).repeat(2, 1)], 1)


@pytest.mark.parametrize(("n", "e", "seed"), [(50, 400, 0), (1000, 3000, 1), (7, 40, 2)])
def test_undirected_coalesced_equals_pyg(n, e, seed):
    ei = _messy(n, e, seed)
    loops_gone, _ = remove_self_loops(ei)
    expected = coalesce(to_undirected(loops_gone, num_nodes=n), num_nodes=n)
    assert torch.equal(undirected_coalesced(ei, n), expected)
    assert torch.equal(coalesced(ei, n), coalesce(loops_gone, num_nodes=n))


def test_facts_tell_a_clean_undirected_list_from_the_others():
    n = 200
    clean = undirected_coalesced(_messy(n, 800, 3), n)
    assert coalesced_facts(clean, n) == (True, True)
    directed = coalesced(_messy(n, 800, 4), n)
    assert coalesced_facts(directed, n) == (True, is_undirected(directed, num_nodes=n))
    assert coalesced_facts(directed, n) == (True, False)
    shuffled = clean[:, torch.randperm(clean.size(1), generator=torch.Generator().manual_seed(0))]
    assert coalesced_facts(shuffled, n) == (False, False)  # unsorted: not coalesced
    duplicate = torch.cat([clean[:, :1], clean], 1)
    assert coalesced_facts(duplicate, n) == (False, False)
    looped = torch.cat([torch.tensor([[0], [0]]), clean], 1)
    assert coalesced_facts(looped, n) == (False, False)
    empty = torch.zeros(2, 0, dtype=torch.long)
    assert coalesced_facts(empty, n) == (True, True)
    assert undirected_coalesced(empty, n).shape == (2, 0)


def test_keys_refuse_a_node_count_that_overflows():
    with pytest.raises(ValueError, match="overflow int64"):
        undirected_coalesced(torch.zeros(2, 1, dtype=torch.long), 4_000_000_000)
