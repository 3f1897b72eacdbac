"""The standard (non-lazy) K-layer GNN, trained end to end: the centralized accuracy reference."""

from __future__ import annotations

import itertools

import torch
from torch import Tensor, nn

from retexo_fl.models.stage import make_conv, make_norm


class GNN(nn.Module):
    """``layers`` conv layers (GCN / SAGE / GAT), the last one producing class logits.

    Args:
        kind: conv kind, see :func:`retexo_fl.models.stage.make_conv`.
        in_dim: input features. hidden: hidden width. num_classes: output classes.
        layers: number of conv layers (default 2). dropout: dropout before every layer.
        norm: norm after each hidden layer (``none`` by default, as in the GCN paper).

    Shapes:
        ``forward(x [N, in_dim], edge_index [2, E], edge_weight [E]?)`` -> ``[N, num_classes]``.
    """

    def __init__(
        self,
        kind: str,
        in_dim: int,
        hidden: int,
        num_classes: int,
        *,
        layers: int = 2,
        dropout: float = 0.5,
        norm: str = "none",
        heads: int = 4,
    ) -> None:
        super().__init__()
        dims = [in_dim] + [hidden] * (layers - 1) + [num_classes]
        self.kind = kind
        self.convs = nn.ModuleList(make_conv(kind, a, b, heads=heads) for a, b in itertools.pairwise(dims))
        self.norms = nn.ModuleList(make_norm(norm, hidden) for _ in range(layers - 1))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, edge_index: Tensor, edge_weight: Tensor | None = None) -> Tensor:
        for i, conv in enumerate(self.convs):
            x = self.dropout(x)
            x = conv(x, edge_index, edge_weight) if self.kind == "gcn" else conv(x, edge_index)
            if i < len(self.convs) - 1:
                x = torch.relu(self.norms[i](x))
        return x
