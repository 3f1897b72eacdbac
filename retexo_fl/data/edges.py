"""Edge-list clean-up in linear memory: one int64 key per edge, sorted in place.

PyG's ``remove_self_loops`` -> ``to_undirected`` -> ``coalesce`` chain copies the ``[2, E]`` list
at every step, and ``coalesce`` sorts through several temporaries: on an ogbn-products-sized
graph (123.7M directed edges, 2 GB as int64) the chain peaked above 10 GB. Here an edge
``(i, j)`` of an ``n``-node graph is the key ``i * n + j``; sorting the keys sorts the edges by
source, then target, which is ``coalesce``'s order, and equal neighbours are duplicates.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from retexo_fl.data.partition import sorted_unique


def _check_key_range(n: int) -> None:
    if n > 0 and (n - 1) * n + (n - 1) > np.iinfo(np.int64).max:
        raise ValueError(f"{n} nodes: edge keys i * n + j overflow int64")


def _endpoints(edge_index: Tensor) -> tuple[np.ndarray, np.ndarray]:
    """``(src, dst)`` as int64 NumPy arrays (views of a CPU int64 edge list, no copy)."""
    return edge_index[0].numpy().astype(np.int64, copy=False), edge_index[1].numpy().astype(
        np.int64, copy=False
    )


def _from_keys(keys: np.ndarray, n: int) -> Tensor:
    """The ``[2, E]`` int64 edge list of sorted keys."""
    out = np.empty((2, keys.size), dtype=np.int64)
    np.floor_divide(keys, n, out=out[0])
    np.remainder(keys, n, out=out[1])
    return torch.from_numpy(out)


def undirected_coalesced(edge_index: Tensor, num_nodes: int) -> Tensor:
    """Every edge in both directions, self loops dropped, duplicates merged, sorted by source then
    target: what PyG's ``remove_self_loops``, ``to_undirected`` and ``coalesce`` give, in order.

    Args:
        edge_index (Tensor): ``(src, dst)`` pairs.
        num_nodes (int): ``n``; every index lies in ``[0, n)``.

    Shapes:
        - **input:** ``edge_index`` ``[2, E]``
        - **output:** ``[2, E']`` int64

    Raises:
        ValueError: if ``n * n`` overflows int64 (over 3 billion nodes).
    """
    _check_key_range(num_nodes)
    src, dst = _endpoints(edge_index)
    loops = src == dst
    if bool(loops.any()):
        src, dst = src[~loops], dst[~loops]
    del loops
    m = src.size
    keys = np.empty(2 * m, dtype=np.int64)
    np.multiply(src, num_nodes, out=keys[:m])
    keys[:m] += dst
    np.multiply(dst, num_nodes, out=keys[m:])
    keys[m:] += src
    del src, dst
    return _from_keys(sorted_unique(keys, in_place=True), num_nodes)


def coalesced(edge_index: Tensor, num_nodes: int) -> Tensor:
    """Self loops dropped, duplicates merged, sorted by source then target: PyG's
    ``remove_self_loops`` then ``coalesce``, in order (directions are kept).

    Args:
        edge_index (Tensor): ``(src, dst)`` pairs.
        num_nodes (int): ``n``; every index lies in ``[0, n)``.

    Shapes:
        - **input:** ``edge_index`` ``[2, E]``
        - **output:** ``[2, E']`` int64

    Raises:
        ValueError: if ``n * n`` overflows int64 (over 3 billion nodes).
    """
    _check_key_range(num_nodes)
    src, dst = _endpoints(edge_index)
    keep = src != dst
    keys = src[keep] * num_nodes + dst[keep]
    del keep
    return _from_keys(sorted_unique(keys, in_place=True), num_nodes)


def coalesced_facts(edge_index: Tensor, num_nodes: int) -> tuple[bool, bool]:
    """Whether ``edge_index`` is already loop-free, sorted by (source, target) without duplicates,
    and whether it is then also symmetric (every edge present both ways).

    Costs one int64 key per edge and one sort of the reversed keys when the first holds.

    Args:
        edge_index (Tensor): ``(src, dst)`` pairs.
        num_nodes (int): ``n``.

    Shapes:
        - **input:** ``edge_index`` ``[2, E]``

    Returns:
        ``(coalesced, undirected)``; ``undirected`` is False whenever ``coalesced`` is.
    """
    _check_key_range(num_nodes)
    src, dst = _endpoints(edge_index)
    if src.size == 0:
        return True, True
    if bool((src == dst).any()):
        return False, False
    keys = src * num_nodes + dst
    if not bool((keys[1:] > keys[:-1]).all()):
        return False, False
    reverse = dst * num_nodes + src
    reverse.sort()
    return True, bool(np.array_equal(keys, reverse))
