"""The standard GNN of the centralized reference, computed by each client over owned plus halo rows.

GCN and mean-SAGE aggregate linearly, so a layer's weight may act before the aggregation:
:math:`A (X W) = (A X) W`. The first layer therefore runs its linear map on the rows' owner, and
a peer receives the rows of :math:`X W`, never raw features; every later layer reads a peer's
hidden rows, as :class:`~retexo_fl.models.layered.LayeredGNN` does. The parameters are
:class:`~retexo_fl.models.gnn.GNN`'s (same names and shapes), so on a whole graph with no halo
this model computes what the centralized reference computes, from the same state dict.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor, nn

from retexo_fl.models.adjacency import SPARSE_KINDS, is_sparse, run_conv
from retexo_fl.models.dropout import Dropout
from retexo_fl.models.stage import make_conv, make_norm


class SplitGNN(nn.Module):
    """``layers`` GCN or mean-SAGE layers, the last one producing class logits, over halo rows.

    Args:
        kind (str): ``gcn`` or ``sage`` (mean aggregation).
        in_dim (int): raw feature width.
        hidden (int): hidden width.
        num_classes (int): output classes.
        layers (int, optional): conv layers, at least 2 (every halo then has ``hidden`` columns).
            (default: :obj:`2`)
        dropout (float, optional): dropout before every layer. (default: :obj:`0.5`)
        norm (str, optional): ``none`` (as in the GCN paper) or ``layer`` after every hidden
            layer. (default: :obj:`"none"`)

    Shapes:
        - **input:** ``x`` ``[n, in_dim]``, the CSR adjacency ``[n, n + H]`` of the owned rows
          over owned then halo rows (GCN's weights folded in), ``halo`` ``layers`` tensors
          ``[H, hidden]``
        - **output:** ``(logits [n, num_classes], inputs)`` where ``inputs[l]`` ``[n, hidden]`` is
          what layer ``l`` aggregates of the owned rows: ``X W`` for the first, the previous
          layer's output after it; the rows peers need

    Raises:
        ValueError: if ``kind`` aggregates non-linearly or ``layers < 2``.
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
    ) -> None:
        super().__init__()
        if kind not in SPARSE_KINDS:
            kinds = ", ".join(SPARSE_KINDS)
            raise ValueError(f"a split GNN needs a linear aggregation ({kinds}), not {kind!r}")
        if layers < 2:
            raise ValueError(f"a split GNN has at least 2 layers, got {layers}")
        dims = [in_dim] + [hidden] * (layers - 1) + [num_classes]
        self.kind = kind
        self.convs = nn.ModuleList(make_conv(kind, a, b) for a, b in itertools.pairwise(dims))
        self.norms = nn.ModuleList(make_norm(norm, hidden) for _ in range(layers - 1))
        self.dropout = Dropout(dropout)

    @property
    def num_convs(self) -> int:
        """The number of conv layers, each with a halo."""
        return len(self.convs)

    def _first_layer(self, x: Tensor, adjacency: Tensor, halo: Tensor) -> tuple[Tensor, Tensor]:
        """The first layer's output for the owned rows, and their ``X W`` (what peers get)."""
        conv = self.convs[0]
        n = x.shape[0]
        if self.kind == "gcn":  # GCNConv: A (X W) + b
            z = conv.lin(x)
            full = torch.cat([z, halo.to(z.dtype)]) if halo.numel() else z
            return torch.sparse.mm(adjacency, full)[:n] + conv.bias, z
        # SAGEConv (mean): mean_j(x_j) W_l + b_l + x_i W_r, with the mean taken after W_l.
        z = nn.functional.linear(x, conv.lin_l.weight)
        full = torch.cat([z, halo.to(z.dtype)]) if halo.numel() else z
        counts = torch.diff(adjacency.crow_indices()).clamp(min=1).to(z.dtype).unsqueeze(1)
        return torch.sparse.mm(adjacency, full) / counts + conv.lin_l.bias + conv.lin_r(x), z

    def forward(
        self, x: Tensor, adjacency: Tensor, edge_weight: Tensor | None, halo: list[Tensor]
    ) -> tuple[Tensor, list[Tensor]]:
        """Logits of the owned rows, and the owned rows every layer aggregates.

        Args:
            x (Tensor): the owned nodes' raw features.
            adjacency (Tensor): the owned rows' CSR adjacency over owned then halo rows.
            edge_weight (Tensor | None): unused (GCN's weights are in the adjacency); kept for
                the same call as :class:`~retexo_fl.models.layered.LayeredGNN`.
            halo (list[Tensor]): per layer, the halo rows' input to it.

        Returns:
            ``(logits, inputs)``, ``inputs`` one entry per layer.

        Raises:
            ValueError: if ``adjacency`` is an edge list rather than a CSR matrix.
        """
        if not is_sparse(adjacency):
            raise ValueError("a split GNN reads the owned rows' CSR adjacency, not an edge list")
        n = x.shape[0]
        out, z = self._first_layer(self.dropout(x), adjacency, halo[0])
        inputs = [z]
        for i, conv in enumerate(self.convs[1:], start=1):
            h = torch.relu(self.norms[i - 1](out))
            inputs.append(h)
            full = torch.cat([h, halo[i].to(h.dtype)]) if halo[i].numel() else h
            out = run_conv(conv, self.kind, self.dropout(full), adjacency, edge_weight)[:n]
        return out, inputs
