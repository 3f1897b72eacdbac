"""The standard (non-lazy) K-layer GNN, trained end to end: the centralized accuracy reference."""

from __future__ import annotations

import itertools

import torch
from torch import Tensor, nn

from retexo_fl.models.adjacency import run_conv
from retexo_fl.models.dropout import Dropout
from retexo_fl.models.stage import make_conv, make_norm


class GNN(nn.Module):
    """``layers`` conv layers (GCN / SAGE / GAT), the last one producing class logits.

    ``kind="mlp"`` makes the layers linear maps that read no edge: the graph-free reference a
    GNN must beat (on a graph whose neighbourhoods say little about a node, it may not).

    Args:
        kind (str): conv kind, see :func:`retexo_fl.models.stage.make_conv`, or ``"mlp"``.
        in_dim (int): input features.
        hidden (int): hidden width.
        num_classes (int): output classes.
        layers (int, optional): number of conv layers. (default: :obj:`2`)
        dropout (float, optional): dropout before every layer. (default: :obj:`0.5`)
        norm (str, optional): norm after each hidden layer, ``"none"`` as in the GCN paper, or
            ``"layer"``. (default: :obj:`"none"`)
        heads (int, optional): attention heads for ``gat``. (default: :obj:`4`)

    Shapes:
        - **input:** ``x`` ``[N, in_dim]``, ``edge_index`` ``[2, E]``, ``edge_weight`` ``[E]``
          (optional)
        - **output:** logits ``[N, num_classes]``
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
        self.convs = nn.ModuleList(
            nn.Linear(a, b) if kind == "mlp" else make_conv(kind, a, b, heads=heads)
            for a, b in itertools.pairwise(dims)
        )
        self.norms = nn.ModuleList(make_norm(norm, hidden) for _ in range(layers - 1))
        self.dropout = Dropout(dropout)

    def forward(self, x: Tensor, edge_index: Tensor, edge_weight: Tensor | None = None) -> Tensor:
        """Class logits for every node.

        Args:
            x (Tensor): node features.
            edge_index (Tensor): edges ``(src, dst)``, or the graph's CSR adjacency
                (:func:`~retexo_fl.models.adjacency.sparse_adjacency`, square).
            edge_weight (Tensor | None, optional): GCN edge weights (read by ``gcn`` only).
                (default: :obj:`None`)

        Shapes:
            - **input:** ``x`` ``[N, in_dim]``, ``edge_index`` ``[2, E]``, ``edge_weight`` ``[E]``
            - **output:** ``[N, num_classes]``
        """
        for i, conv in enumerate(self.convs):
            x = self.dropout(x)
            x = conv(x) if self.kind == "mlp" else run_conv(conv, self.kind, x, edge_index, edge_weight)
            if i < len(self.convs) - 1:
                x = torch.relu(self.norms[i](x))
        return x
