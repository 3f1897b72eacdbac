"""RETEXO stage models: an MLP on raw features (stage 0) or one GNN layer over frozen inputs."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from retexo_fl.models.adjacency import adjacency_select, is_sparse, run_conv
from retexo_fl.models.dropout import Dropout, keep_mask

CONV_KINDS = ("gcn", "sage", "sage-max", "gat")


def make_conv(kind: str, in_dim: int, out_dim: int, *, heads: int = 4) -> nn.Module:
    """One PyG conv layer.

    ``gcn`` takes precomputed global-degree edge weights (``normalize=False``, no added self
    loops); ``sage`` is mean aggregation, ``sage-max`` max-pool aggregation over projected
    neighbours; ``gat`` averages ``heads`` attention heads.

    Args:
        kind (str): one of :data:`CONV_KINDS`.
        in_dim (int): input width.
        out_dim (int): output width.
        heads (int, optional): attention heads for ``gat``. (default: :obj:`4`)

    Raises:
        ValueError: on an unknown ``kind``.
    """
    # Imported here: torch_geometric costs about 2 s to import, which a stage-0 (MLP) client in
    # a per-message ClientApp process would otherwise pay on every message.
    from torch_geometric.nn import GATConv, GCNConv, SAGEConv

    if kind == "gcn":
        return GCNConv(in_dim, out_dim, normalize=False, add_self_loops=False)
    if kind == "sage":
        return SAGEConv(in_dim, out_dim, aggr="mean")
    if kind == "sage-max":
        return SAGEConv(in_dim, out_dim, aggr="max", project=True)
    if kind == "gat":
        return GATConv(in_dim, out_dim, heads=heads, concat=False)
    raise ValueError(f"unknown model {kind!r}; known: {', '.join(CONV_KINDS)}")


def make_norm(kind: str, dim: int) -> nn.Module:
    """The normalization after a hidden layer: ``layer`` (:class:`~torch.nn.LayerNorm`) or ``none``.

    Args:
        kind (str): ``"layer"`` or ``"none"``.
        dim (int): the normalized width.

    Raises:
        ValueError: on an unknown ``kind``.
    """
    if kind == "layer":
        return nn.LayerNorm(dim)
    if kind == "none":
        return nn.Identity()
    raise ValueError(f"unknown norm {kind!r}; known: layer, none")


#: Convs that get a separate root weight with ``root_weight`` (SAGE's convs have their own).
ROOTLESS_CONVS = ("gcn", "gat")


def select_in_edges(
    edge_index: Tensor, edge_weight: Tensor | None, rows: Tensor, num_nodes: int
) -> tuple[Tensor, Tensor | None]:
    """The graph a conv layer reads to compute ``rows`` alone: their in-edges.

    Over a CSR adjacency its ``rows`` (:func:`~retexo_fl.models.adjacency.adjacency_select`),
    over an edge list the edges into ``rows``, in their order, with their weights. Either way
    the size of the result is read off the device: a caller that steps many times over the same
    rows builds it once and passes it with ``restricted=True`` (:meth:`StageModel.forward`).

    Args:
        edge_index (Tensor): ``[2, E]`` edges, or a CSR adjacency.
        edge_weight (Tensor, optional): GCN weights of an edge list.
        rows (Tensor): int64 indices of the target rows.
        num_nodes (int): the rows of the input ``x`` the edges index.

    Shapes:
        - **input:** ``edge_index`` ``[2, E]`` or CSR ``[T, N]``, ``edge_weight`` ``[E]``,
          ``rows`` ``[R]``
        - **output:** ``[2, E_rows]`` and ``[E_rows]`` (or ``None``), or CSR ``[R, N]`` and ``None``
    """
    if is_sparse(edge_index):
        return adjacency_select(edge_index, rows), None
    wanted = torch.zeros(num_nodes, dtype=torch.bool, device=edge_index.device)
    wanted[rows] = True
    keep = wanted[edge_index[1]]
    return edge_index[:, keep], None if edge_weight is None else edge_weight[keep]


class StageModel(nn.Module):
    r"""One stage: ``body`` (Linear for stage 0, a conv layer after), norm, ReLU, dropout, head.

    With ``root_weight`` a ``gcn`` or ``gat`` stage adds a linear map of each target node's own
    input, :math:`h_i = \mathrm{conv}(X)_i + x_i W_{\mathrm{root}}`, as SAGE's root weight does:
    a GCN layer's self-loop weight is :math:`1 / (d_i + 1)`, so on a high-degree graph whose
    neighbours say little about a node, aggregation alone drowns the node's own representation.

    Args:
        kind (str): ``mlp`` for stage 0, else one of :data:`CONV_KINDS`.
        in_dim (int): input width (raw features at stage 0, the previous stage's output after).
        hidden (int): width of the hidden representation.
        num_classes (int): output classes of the stage head.
        dropout (float, optional): dropout on the hidden representation. (default: :obj:`0.5`)
        input_dropout (float, optional): dropout on the stage input. (default: :obj:`0.0`)
        norm (str, optional): ``layer`` (LayerNorm, per-row so partition-independent) or
            ``none``. (default: :obj:`"layer"`)
        heads (int, optional): attention heads for ``gat``. (default: :obj:`4`)
        root_weight (bool, optional): a ``gcn`` or ``gat`` stage adds a linear map of each
            target's own input (ignored by ``mlp``, ``sage`` and ``sage-max``, which have one).
            (default: :obj:`False`)

    Shapes:
        - **input:** ``x`` ``[N_in, in_dim]``, ``edge_index`` ``[2, E]`` or a CSR adjacency
          ``[T, N_in]`` (conv stages only), ``edge_weight`` ``[E]`` (``gcn`` only)
        - **output:** ``(hidden [n, hidden], logits [n, num_classes])`` for the first
          ``n = num_targets`` rows (all rows when ``num_targets`` is None; over an adjacency,
          its ``T`` target rows)
    """

    def __init__(
        self,
        kind: str,
        in_dim: int,
        hidden: int,
        num_classes: int,
        *,
        dropout: float = 0.5,
        input_dropout: float = 0.0,
        norm: str = "layer",
        heads: int = 4,
        root_weight: bool = False,
    ) -> None:
        super().__init__()
        self.kind = kind
        self.body = (
            nn.Linear(in_dim, hidden) if kind == "mlp" else make_conv(kind, in_dim, hidden, heads=heads)
        )
        # Built after the body, so the body's initial weights do not depend on the option.
        self.root = nn.Linear(in_dim, hidden, bias=False) if root_weight and kind in ROOTLESS_CONVS else None
        self.norm = make_norm(norm, hidden)
        self.head = nn.Linear(hidden, num_classes)
        self.dropout = Dropout(dropout)
        self.input_dropout = Dropout(input_dropout)

    def forward(
        self,
        x: Tensor,
        edge_index: Tensor | None = None,
        edge_weight: Tensor | None = None,
        num_targets: int | None = None,
        rows: Tensor | None = None,
        restricted: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """The stage's hidden representation and logits for the target rows.

        Args:
            x (Tensor): the stage input: owned rows first, then halo rows.
            edge_index (Tensor | None, optional): local edges, or their CSR adjacency
                (:func:`~retexo_fl.models.adjacency.sparse_adjacency`; conv stages only).
                (default: :obj:`None`)
            edge_weight (Tensor | None, optional): GCN edge weights (``gcn`` only).
                (default: :obj:`None`)
            num_targets (int | None, optional): compute outputs for the first ``num_targets`` rows
                only (the owned nodes); ``None`` for all rows. (default: :obj:`None`)
            rows (Tensor | None, optional): of those, compute only these (int64 indices below
                ``num_targets``): messages travel along their in-edges alone, and the dropout
                masks are drawn as for all ``num_targets`` rows, so each row equals its row of
                the whole computation (to rounding where a narrowing GCN layer aggregates first
                over the rows' edges: :func:`~retexo_fl.models.adjacency.aggregates_first`).
                Needs ``num_targets``. (default: :obj:`None`)
            restricted (bool, optional): ``edge_index`` and ``edge_weight`` are already
                :func:`select_in_edges` of ``rows`` (built once by a caller that steps many
                times: restricting reads a size off the device). (default: :obj:`False`)

        Shapes:
            - **input:** ``x`` ``[N_in, in_dim]``, ``edge_index`` ``[2, E]``, ``edge_weight`` ``[E]``,
              ``rows`` ``[R]``
            - **output:** ``hidden`` ``[n, hidden]`` (after ReLU, before dropout), ``logits``
              ``[n, num_classes]``; ``n = R`` with ``rows``

        Raises:
            ValueError: if a conv stage gets no ``edge_index``, or ``rows`` come without
                ``num_targets``.
        """
        if rows is not None and num_targets is None:
            raise ValueError("rows needs num_targets: the rows the dropout masks are drawn for")
        x = self.input_dropout(x)
        if self.kind == "mlp":
            h = self.body(x if num_targets is None else x[:num_targets])
            if rows is not None:
                h = h[rows]
        else:
            if edge_index is None:
                raise ValueError(f"a {self.kind} stage needs edge_index")
            if rows is None:
                h = run_conv(self.body, self.kind, x, edge_index, edge_weight)
                if num_targets is not None:
                    h = h[:num_targets]
            else:  # the edges into the rows: each target's messages, in their order
                if not restricted:
                    edge_index, edge_weight = select_in_edges(edge_index, edge_weight, rows, x.shape[0])
                if is_sparse(edge_index):
                    h = run_conv(self.body, self.kind, x, edge_index, None, rows)
                else:
                    h = run_conv(self.body, self.kind, x, edge_index, edge_weight)[rows]
            if self.root is not None:
                own = x if num_targets is None else x[:num_targets]
                h = h + self.root(own if rows is None else own[rows])
        h = torch.relu(self.norm(h))
        if rows is None or not self.training or self.dropout.p == 0:
            return h, self.head(self.dropout(h))
        # The mask of all num_targets rows, as the whole computation draws it, then the rows': the
        # same random stream, so a row's mask is the one it gets in the whole computation.
        assert num_targets is not None  # checked above
        if self.dropout.p >= 1.0:
            return h, self.head(h * 0.0)
        mask = keep_mask((num_targets, h.shape[1]), self.dropout.p, dtype=h.dtype, device=h.device)
        return h, self.head(h * mask[rows])

    @property
    def aggregates_linearly(self) -> bool:
        """Whether the body is a fixed aggregation followed by linear maps (``gcn``, ``sage``):
        then :meth:`forward_aggregated` computes it from inputs aggregated once."""
        return self.kind in ("gcn", "sage")

    def forward_aggregated(self, aggregated: Tensor, root: Tensor) -> tuple[Tensor, Tensor]:
        r"""The stage on inputs aggregated in advance: ``gcn`` and ``sage`` stages only.

        A GCN layer is :math:`\hat{A} X W + b` and a mean-SAGE layer
        :math:`\mathrm{mean}_{j \to i}(x_j) W_l + b + x_i W_r`: with the inputs frozen for a
        stage, :math:`\hat{A} X` (or the neighbour mean) is computed once and every round is a
        dense step. Equal to :meth:`forward` (to float rounding) without input dropout; with it,
        the dropout hits the aggregated rows instead of each neighbour's, an approximation.

        Args:
            aggregated (Tensor): the aggregated inputs of the target rows.
            root (Tensor): the target rows' own inputs (read by a root weight).

        Shapes:
            - **input:** ``aggregated`` ``[n, in_dim]``, ``root`` ``[n, in_dim]``
            - **output:** ``hidden`` ``[n, hidden]``, ``logits`` ``[n, num_classes]``

        Raises:
            ValueError: for a stage whose body does not aggregate linearly.
        """
        if self.kind == "gcn":
            h = self.body.lin(self.input_dropout(aggregated)) + self.body.bias
            if self.root is not None:
                h = h + self.root(self.input_dropout(root))
        elif self.kind == "sage":
            h = self.body.lin_l(self.input_dropout(aggregated)) + self.body.lin_r(self.input_dropout(root))
        else:
            raise ValueError(f"a {self.kind} stage cannot run on aggregated inputs")
        h = torch.relu(self.norm(h))
        return h, self.head(self.dropout(h))
