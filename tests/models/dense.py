"""Small graphs and their dense matrices, for checking the models against hand computations."""

from __future__ import annotations

import torch
from torch import nn

# A tiny undirected graph: a triangle 0-1-2, a pendant 3 on 2, node 4 isolated.
UNDIRECTED = [(0, 1), (1, 2), (2, 0), (2, 3)]
N = 5


def edges(pairs: list[tuple[int, int]] = UNDIRECTED) -> torch.Tensor:
    """``edge_index`` with both directions of every pair, ``[2, 2 * len(pairs)]``."""
    src = [a for a, b in pairs] + [b for a, b in pairs]
    dst = [b for a, b in pairs] + [a for a, b in pairs]
    return torch.tensor([src, dst], dtype=torch.long)


def adjacency(edge_index: torch.Tensor, n: int) -> torch.Tensor:
    """Dense ``A[i, j] = 1`` for every edge ``j -> i`` (row = target)."""
    a = torch.zeros(n, n)
    a[edge_index[1], edge_index[0]] = 1.0
    return a


def gcn_edges(edge_index: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the lazy engine passes a GCN layer: edges plus self loops, weighted
    ``w(j -> i) = 1 / sqrt((d_i + 1)(d_j + 1))`` with the degrees of ``edge_index``."""
    deg = torch.bincount(edge_index[1], minlength=n).float() + 1.0
    loops = torch.arange(n).repeat(2, 1)
    ei = torch.cat([edge_index, loops], dim=1)
    return ei, deg[ei[0]].rsqrt() * deg[ei[1]].rsqrt()


def layer_norm(x: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
    """``norm(x)`` by hand: biased variance over the last dimension, then scale and shift."""
    mean = x.mean(-1, keepdim=True)
    var = x.var(-1, unbiased=False, keepdim=True)
    return (x - mean) / torch.sqrt(var + norm.eps) * norm.weight + norm.bias


class Recorder(nn.Module):
    """Stands in for the dropout module: records every tensor it is applied to, changes nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.detach().clone())
        return x
