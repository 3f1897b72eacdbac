"""The end-to-end K-layer GNN of the eager and local baselines, over owned rows plus constant halo rows."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from retexo_fl.models.adjacency import run_conv
from retexo_fl.models.dropout import Dropout
from retexo_fl.models.stage import make_conv, make_norm


class LayeredGNN(nn.Module):
    """An MLP encoder on raw features, ``layers - 1`` conv layers, a linear head.

    The same layer stack as ``layers`` lazy stages, trained end to end. Layer 0 is row-wise, so
    no raw feature of another client is ever needed; conv layer ``l`` reads the owned rows'
    layer-``l - 1`` output and, for halo rows, ``halo[l - 1]``: embeddings a peer sent (constant
    here, so no gradient crosses clients).

    Args:
        kind (str): conv kind (``gcn``, ``sage``, ``sage-max``, ``gat``).
        in_dim (int): raw feature width.
        hidden (int): hidden width.
        num_classes (int): output classes.
        layers (int, optional): encoder plus convs, at least 1. (default: :obj:`2`)
        dropout (float, optional): dropout before every layer and the head. (default: :obj:`0.5`)
        norm (str, optional): ``layer`` or ``none`` after every hidden layer.
            (default: :obj:`"layer"`)
        heads (int, optional): attention heads (``gat``). (default: :obj:`4`)

    Shapes:
        - **input:** ``x`` ``[n, in_dim]``, ``edge_index`` ``[2, E]``, ``edge_weight`` ``[E]``,
          ``halo`` ``layers - 1`` tensors ``[H, hidden]``
        - **output:** ``(logits [n, num_classes], inputs)`` where ``inputs[l]`` ``[n, hidden]`` is
          what conv layer ``l + 1`` read for the owned rows: the rows peers need

    Raises:
        ValueError: if ``layers < 1``.
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
        norm: str = "layer",
        heads: int = 4,
    ) -> None:
        super().__init__()
        if layers < 1:
            raise ValueError(f"layers must be >= 1, got {layers}")
        self.kind = kind
        self.encoder = nn.Linear(in_dim, hidden)
        self.convs = nn.ModuleList(make_conv(kind, hidden, hidden, heads=heads) for _ in range(layers - 1))
        self.norms = nn.ModuleList(make_norm(norm, hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, num_classes)
        self.dropout = Dropout(dropout)

    @property
    def num_convs(self) -> int:
        """The number of conv layers, ``layers - 1``."""
        return len(self.convs)

    def forward(
        self,
        x: Tensor,
        edge_index: Tensor | None,
        edge_weight: Tensor | None,
        halo: list[Tensor],
    ) -> tuple[Tensor, list[Tensor]]:
        """Logits of the owned rows, and the owned rows' input to every conv layer.

        Args:
            x (Tensor): the owned nodes' raw features.
            edge_index (Tensor | None): local edges over owned then halo rows, or their CSR
                adjacency ``[n, n + H]`` (``None`` with no conv).
            edge_weight (Tensor | None): GCN edge weights (read by ``gcn`` only).
            halo (list[Tensor]): per conv layer, the halo rows' input (empty tensors without halo).

        Shapes:
            - **input:** ``x`` ``[n, in_dim]``, ``edge_index`` ``[2, E]``, ``edge_weight`` ``[E]``,
              ``halo[l]`` ``[H, hidden]``
            - **output:** ``logits`` ``[n, num_classes]``, ``inputs[l]`` ``[n, hidden]``

        Returns:
            ``(logits, inputs)``, ``inputs`` one entry per conv layer.
        """
        n = x.shape[0]
        h = torch.relu(self.norms[0](self.encoder(self.dropout(x))))
        inputs = []
        for i, conv in enumerate(self.convs):
            inputs.append(h)
            full = torch.cat([h, halo[i].to(h.dtype)]) if halo[i].numel() else h
            full = self.dropout(full)
            out = run_conv(conv, self.kind, full, edge_index, edge_weight)
            h = torch.relu(self.norms[i + 1](out[:n]))
        return self.head(self.dropout(h)), inputs
