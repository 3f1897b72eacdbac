"""A local graph's aggregation as one cached sparse matrix: the fast path of GCN and SAGE layers.

Message passing over an edge list gathers one row per edge and scatters it back, every layer,
every step. GCN (with its normalization folded into the values) and mean-SAGE aggregate
linearly, so the same layer is a sparse-dense product ``A X`` with ``A`` a CSR matrix built once
per local graph: PyG's ``GCNConv`` and ``SAGEConv`` take it as their ``edge_index`` (PyG's
``Adj``) and run ``torch.sparse.mm``. GAT (edge-wise attention) and max-SAGE keep the edge list.

Rows are targets (the owned nodes), columns sources (owned rows, then halo rows): a client's
layer computes its owned outputs only, and a row slice of ``A`` is a chunk of them.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

#: The conv kinds whose layer runs on a sparse adjacency (:func:`sparse_adjacency`).
SPARSE_KINDS = ("gcn", "sage")


def is_sparse(edge_index: object) -> bool:
    """Whether ``edge_index`` is a sparse adjacency (CSR) rather than a ``[2, E]`` edge list."""
    return isinstance(edge_index, Tensor) and edge_index.layout == torch.sparse_csr


def sparse_adjacency(
    edge_index: Tensor, edge_weight: Tensor | None, num_targets: int, num_sources: int
) -> Tensor:
    r"""The CSR matrix :math:`A` with :math:`A_{ij}` the weight of edge :math:`j \to i`.

    Only edges into the first ``num_targets`` nodes are kept (every edge of a client's local
    graph ends at an owned node). Without weights every entry is 1, which is what mean-SAGE
    reads (``SAGEConv`` divides by the row's entry count).

    Args:
        edge_index (Tensor): ``(src, dst)`` pairs.
        edge_weight (Tensor, optional): one weight per edge (GCN's normalization).
        num_targets (int): rows: the target nodes ``[0, num_targets)``.
        num_sources (int): columns: every node a message can come from.

    Shapes:
        - **input:** ``edge_index`` ``[2, E]``, ``edge_weight`` ``[E]``
        - **output:** CSR ``[num_targets, num_sources]`` on ``edge_index``'s device

    Raises:
        ValueError: an edge from a node outside ``[0, num_sources)``.
    """
    src, dst = edge_index[0], edge_index[1]
    keep = dst < num_targets
    if not bool(keep.all()):
        src, dst = src[keep], dst[keep]
        edge_weight = None if edge_weight is None else edge_weight[keep]
    if src.numel() and (int(src.min()) < 0 or int(src.max()) >= num_sources):
        raise ValueError(f"an edge leaves a node outside the {num_sources} sources")
    # Sorted by target, then source: CSR order (and a fixed summation order per row).
    order = torch.argsort(dst * num_sources + src)
    counts = torch.bincount(dst, minlength=num_targets)
    crow = torch.zeros(num_targets + 1, dtype=torch.int64, device=src.device)
    torch.cumsum(counts, 0, out=crow[1:])
    values = torch.ones(src.numel(), device=src.device) if edge_weight is None else edge_weight[order].float()
    return csr_tensor(crow, src[order].to(torch.int64), values, (num_targets, num_sources))


def csr_tensor(crow: Tensor, col: Tensor, values: Tensor, size: tuple[int, int]) -> Tensor:
    """A CSR tensor of indices built sorted and in range (not checked again), without torch's
    beta warning."""
    with warnings.catch_warnings():  # "CSR support is in beta": it is what PyG runs on
        warnings.simplefilter("ignore", UserWarning)
        # Built sorted and in range above: the invariant checks would only cost a pass.
        return torch.sparse_csr_tensor(crow, col, values, size=size, check_invariants=False)


def adjacency_select(adj: Tensor, rows: Tensor) -> Tensor:
    """Rows ``rows`` of a CSR ``adj``, in that order, as a CSR matrix of their own.

    Each row keeps its entries in their order, so a product with it gives those rows of the
    whole product bit for bit.

    Args:
        adj (Tensor): the CSR adjacency.
        rows (Tensor): int64 row indices.

    Shapes:
        - **input:** ``adj`` CSR ``[T, N]``, ``rows`` ``[R]``
        - **output:** CSR ``[R, N]``
    """
    crow, col, values = adj.crow_indices(), adj.col_indices(), adj.values()
    starts, counts = crow[rows], crow[rows + 1] - crow[rows]
    new_crow = torch.zeros(rows.numel() + 1, dtype=crow.dtype, device=crow.device)
    torch.cumsum(counts, 0, out=new_crow[1:])
    total = int(new_crow[-1])
    # Entry k of selected row i sits at starts[i] + k in the whole matrix.
    pos = torch.repeat_interleave(starts - new_crow[:-1], counts, output_size=total)
    pos += torch.arange(total, dtype=crow.dtype, device=crow.device)
    return csr_tensor(new_crow, col[pos], values[pos], (rows.numel(), adj.shape[1]))


#: A narrowing GCN layer over a fixed input aggregates first when its adjacency holds at most
#: one entry for this many values its map would compute for source rows no target is (see
#: :func:`aggregates_first`). Measured on the local stage 0 of the shared graphs' partitions
#: (one thread, forward and weight gradient): the two orders break even at one entry for 4 to 5
#: such values (Twitch TW and PTBR); at one for 10 to 300, aggregating first is 1.4 to 4.2x as
#: fast (squirrel, Chameleon, Cora, CiteSeer).
SPARE_VALUES_PER_EDGE = 8


def aggregates_first(conv: torch.nn.Module, adj: Tensor, x: Tensor) -> bool:
    """Whether :func:`run_conv` computes a GCN layer over the CSR ``adj`` as ``(A x) W`` rather
    than GCNConv's ``A (x W)``: the same layer, in fewer operations, rounded otherwise.

    Always where the layer does not narrow: no more flops, and the map and its gradient cover
    the adjacency's rows, not every source row (a row-restricted step of a lazy stage, 32 to 32
    wide, reads a few target rows of a client whose sources are 10x more). Where it narrows
    (raw features to the hidden width), only over an input that takes no gradient, and only
    when the adjacency is sparse next to the rows it skips (:data:`SPARE_VALUES_PER_EDGE`):
    aggregating first reads every feature of an edge's source, mapping first every feature of
    every source row. A local stage 0's step reads its training rows' own edges: on Cora with 10
    clients, 14 of a client's 270 rows and 20 edges.

    Args:
        conv (torch.nn.Module): the GCN layer.
        adj (Tensor): its CSR adjacency ``[T, N]``.
        x (Tensor): its input ``[N, in]``.
    """
    if conv.in_channels <= conv.out_channels:
        return True
    if x.requires_grad:  # the input's gradient would take the wide sparse product back
        return False
    spare_rows = adj.shape[1] - adj.shape[0]
    return adj.values().numel() * SPARE_VALUES_PER_EDGE <= spare_rows * conv.out_channels


def run_conv(
    conv: torch.nn.Module,
    kind: str,
    x: Tensor,
    edge_index: Tensor,
    edge_weight: Tensor | None,
    targets: Tensor | None = None,
) -> Tensor:
    """One PyG conv layer over an edge list or a sparse adjacency.

    Over a CSR adjacency ``[T, N]`` the output has the ``T`` target rows (SAGE's root weight
    reads rows ``targets`` of ``x``, else its first ``T``); over an edge list it has every row of
    ``x``.

    Args:
        conv (torch.nn.Module): the layer (:func:`~retexo_fl.models.stage.make_conv`).
        kind (str): its kind (``gcn`` reads ``edge_weight``).
        x (Tensor): the input rows (targets first).
        edge_index (Tensor): ``[2, E]`` edges, or a CSR adjacency (:func:`sparse_adjacency`).
        edge_weight (Tensor, optional): GCN weights of an edge list (in the values of a CSR one).
        targets (Tensor, optional): the rows of ``x`` a CSR adjacency's rows are
            (:func:`adjacency_select`); :obj:`None` for its first ``T``. (default: :obj:`None`)

    Shapes:
        - **input:** ``x`` ``[N, d]``, ``targets`` ``[T]``
        - **output:** ``[T, out]`` over a CSR adjacency, ``[N, out]`` over an edge list
    """
    if is_sparse(edge_index):
        if kind == "sage":
            root = x[: edge_index.shape[0]] if targets is None else x[targets]
            return conv((x, root), edge_index)
        if aggregates_first(conv, edge_index, x):
            out = conv.lin(torch.sparse.mm(edge_index, x))
            return out if conv.bias is None else out + conv.bias
        return conv(x, edge_index)
    return conv(x, edge_index, edge_weight) if kind == "gcn" else conv(x, edge_index)
