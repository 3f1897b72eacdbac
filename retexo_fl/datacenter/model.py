"""Full-graph GCN over a distributed sparse-dense product, and its single-process reference."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from retexo_fl.datacenter.spmm import DistributedSpMM, column_linear, gather_columns, spmm
from retexo_fl.models.gnn import GNN
from retexo_fl.seeding import derive_seed

_M32 = 0xFFFFFFFF


def _fmix32(h: Tensor) -> Tensor:
    # MurmurHash3's finalizer on int64 holding 32-bit values; products wrap, the mask keeps
    # the low 32 bits, which is all the finalizer needs.
    h = h & _M32
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def dropout_keep(rows: slice, cols: slice, p: float, seed: int, epoch: int, layer: int, device) -> Tensor:
    """Float mask (0 or ``1 / (1 - p)``) of dropout on one block of a matrix.

    A pure function of the element's global row and column, so every process cuts its block
    from the same mask the single-process reference draws for the whole matrix.

    Args:
        rows (slice): the block's global rows.
        cols (slice): the block's global columns.
        p (float): the dropout rate, in ``[0, 1)``.
        seed (int): the run's dropout seed.
        epoch (int): the epoch (a fresh mask each).
        layer (int): the layer (a fresh mask each).
        device (torch.device): where the mask is made.

    Shapes:
        - **output:** ``[width(rows), width(cols)]`` float32
    """
    s = derive_seed(seed, epoch, layer, 0xD0) & _M32
    r = torch.arange(rows.start, rows.stop, dtype=torch.int64, device=device)
    c = torch.arange(cols.start, cols.stop, dtype=torch.int64, device=device)
    h = _fmix32(_fmix32(r ^ s).unsqueeze(1) ^ (c.unsqueeze(0) * 0x9E3779B1))
    u = (h >> 8).to(torch.float32) / float(1 << 24)
    return (u >= p).to(torch.float32) / (1.0 - p)


def initial_weights(
    in_dim: int, hidden: int, num_classes: int, layers: int, seed: int
) -> list[tuple[Tensor, Tensor]]:
    """``[(W [in, out], b [out])]`` per layer: exactly the centralized GCN's initial weights.

    Args:
        in_dim (int): input features.
        hidden (int): hidden width.
        num_classes (int): output classes.
        layers (int): the number of GCN layers.
        seed (int): the run seed (the centralized reference's model seed derives from it).

    Shapes:
        - **output:** ``W`` ``[in, out]`` and ``b`` ``[out]`` per layer (``W`` transposed from PyG's
          ``lin.weight``, so ``H @ W``)
    """
    torch.manual_seed(derive_seed(seed, 0xC3))
    ref = GNN("gcn", in_dim, hidden, num_classes, layers=layers, dropout=0.0)
    return [(c.lin.weight.detach().T.contiguous(), c.bias.detach().clone()) for c in ref.convs]


class GCNWeights(nn.Module):
    """The replicated weights of a ``layers``-layer GCN (every process holds all of them).

    Args:
        init (list[tuple[Tensor, Tensor]]): initial ``(W [in, out], b [out])`` per layer; copied.
    """

    def __init__(self, init: list[tuple[Tensor, Tensor]]) -> None:
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(w.clone()) for w, _ in init)
        self.biases = nn.ParameterList(nn.Parameter(b.clone()) for _, b in init)

    @property
    def layers(self) -> int:
        """The number of layers."""
        return len(self.weights)


class DistributedGCN(nn.Module):
    """``H_{l+1} = relu(A (drop(H_l) W_l) + b_l)``, the last layer without relu, over ``algo``.

    Args:
        init (list[tuple[Tensor, Tensor]]): initial ``(W, b)`` per layer (see
            :func:`initial_weights`).
        algo (DistributedSpMM): the distributed product; inputs and outputs are this process's
            blocks.
        dropout (float, optional): dropout rate before every layer. (default: :obj:`0.0`)
        seed (int, optional): the dropout masks' seed. (default: :obj:`0`)

    Shapes:
        - **input:** ``x`` ``[rows(0), cols(F)]`` (this process's block of the features)
        - **output:** ``[rows(L), num_classes]`` (whole rows)
    """

    def __init__(
        self, init: list[tuple[Tensor, Tensor]], algo: DistributedSpMM, dropout: float = 0.0, seed: int = 0
    ) -> None:
        super().__init__()
        self.params = GCNWeights(init)
        self.algo, self.p, self.seed = algo, float(dropout), seed

    def forward(self, x: Tensor, epoch: int = 0) -> Tensor:
        """This process's rows of the logits; every process of the world must call it.

        Args:
            x (Tensor): this process's block of the input features.
            epoch (int, optional): the epoch, which picks the dropout masks. (default: :obj:`0`)

        Shapes:
            - **input:** ``x`` ``[rows(0), cols(F)]``
            - **output:** ``[rows(L), num_classes]``
        """
        h, algo = x, self.algo
        last = self.params.layers - 1
        for layer, (w, b) in enumerate(zip(self.params.weights, self.params.biases, strict=True)):
            if self.training and self.p > 0:
                cols = algo.cols(w.shape[0])
                h = h * dropout_keep(algo.rows(layer), cols, self.p, self.seed, epoch, layer, h.device)
            h = spmm(column_linear(h, w, algo), algo, layer) + b[algo.cols(w.shape[1])]
            if layer < last:
                h = torch.relu(h)
        return gather_columns(h, algo, self.params.weights[last].shape[1])


class ReferenceGCN(nn.Module):
    """The same GCN in one process on the whole ``[n, n]`` sparse adjacency: the exactness reference.

    Args:
        init (list[tuple[Tensor, Tensor]]): initial ``(W, b)`` per layer (see
            :func:`initial_weights`).
        adjacency (Tensor): the normalized adjacency, a sparse ``[n, n]`` tensor.
        dropout (float, optional): dropout rate before every layer. (default: :obj:`0.0`)
        seed (int, optional): the dropout masks' seed. (default: :obj:`0`)

    Shapes:
        - **input:** ``x`` ``[n, F]``
        - **output:** ``[n, num_classes]``
    """

    def __init__(
        self, init: list[tuple[Tensor, Tensor]], adjacency: Tensor, dropout: float = 0.0, seed: int = 0
    ) -> None:
        super().__init__()
        self.params = GCNWeights(init)
        self.adjacency, self.p, self.seed = adjacency, float(dropout), seed

    def forward(self, x: Tensor, epoch: int = 0) -> Tensor:
        """The logits of every node.

        Args:
            x (Tensor): the input features.
            epoch (int, optional): the epoch, which picks the dropout masks. (default: :obj:`0`)

        Shapes:
            - **input:** ``x`` ``[n, F]``
            - **output:** ``[n, num_classes]``
        """
        h, n = x, x.shape[0]
        last = self.params.layers - 1
        for layer, (w, b) in enumerate(zip(self.params.weights, self.params.biases, strict=True)):
            if self.training and self.p > 0:
                h = h * dropout_keep(
                    slice(0, n), slice(0, h.shape[1]), self.p, self.seed, epoch, layer, h.device
                )
            h = torch.sparse.mm(self.adjacency, h @ w) + b
            if layer < last:
                h = torch.relu(h)
        return h
