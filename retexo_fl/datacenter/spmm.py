"""The distributed sparse-dense product's interface and the autograd functions built on it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import contextmanager

import scipy.sparse as sp
import torch
from torch import Tensor

from retexo_fl.datacenter.blocks import block
from retexo_fl.datacenter.comm import Counted, Group


class DistributedSpMM(ABC):
    """One of CAGNET's ways to compute ``A @ H`` with ``A`` and ``H`` spread over P processes.

    A dense matrix ``H`` (``[n, F]``) lives as one block per process: the rows ``rows(layer)``
    and the columns ``cols(F)``. Processes with the same block (1.5D's teams) hold identical
    copies. ``spmm`` maps the input layout of ``layer`` to the input layout of ``layer + 1``;
    with ``transposed=True`` it computes ``A.T @ G`` the other way, for the backward pass.

    Args:
        adjacency (sp.csr_matrix): ``[n, n]`` normalized adjacency; only this process's blocks are
            kept.
        comm (Counted): this process's counted collectives.
        world (tuple[int, int]): global rank and world size as ``(rank, size)``.
        device (torch.device | None, optional): where blocks and products live; ``None`` for CPU.
            (default: :obj:`None`)
    """

    name: str = ""

    def __init__(
        self,
        adjacency: sp.csr_matrix,
        comm: Counted,
        world: tuple[int, int],
        device: torch.device | None = None,
    ) -> None:
        self.device = device or torch.device("cpu")
        self.n = int(adjacency.shape[0])
        self.comm = comm
        self.rank, self.size = world
        self.nnz = int(adjacency.nnz)

    @abstractmethod
    def rows(self, layer: int) -> slice:
        """Global rows of the dense blocks this process holds at the input of ``layer``.

        Args:
            layer (int): the layer (``L`` for the output of an ``L``-layer model).
        """

    @property
    def column_group(self) -> Group | None:
        """Processes that split the columns of one row block (None: every process has all columns)."""
        return None

    @property
    @abstractmethod
    def gradient_group(self) -> Group:
        """Processes whose weight-gradient contributions sum to the full gradient."""

    @property
    def counts_rows(self) -> bool:
        """Whether this process's rows count in metrics (one copy of every row does)."""
        g = self.column_group
        return g is None or g.index(self.rank) == 0

    def cols(self, width: int, member: int | None = None) -> slice:
        """Columns of a ``width``-wide dense matrix held by column-group ``member`` (default: us).

        Args:
            width (int): the matrix's number of columns.
            member (int | None, optional): a member index of :attr:`column_group`; ``None`` for this
                process. (default: :obj:`None`)
        """
        g = self.column_group
        if g is None:
            return slice(0, width)
        return block(width, g.size, g.index(self.rank) if member is None else member)

    @abstractmethod
    def spmm(self, h: Tensor, layer: int, transposed: bool = False) -> Tensor:
        """``A @ h`` (or ``A.T @ h``) in this process's blocks; every member of the world calls it.

        Args:
            h (Tensor): this process's block of the dense matrix, in ``layer``'s input layout (in
                ``layer + 1``'s when ``transposed``).
            layer (int): the layer.
            transposed (bool, optional): compute ``A.T @ h``, mapping ``layer + 1``'s layout back to
                ``layer``'s (the backward pass). (default: :obj:`False`)

        Shapes:
            - **input:** ``h`` ``[width(rows(layer)), f]``
            - **output:** ``[width(rows(layer + 1)), f]`` (the other way round when ``transposed``)
        """

    @contextmanager
    def counting(self, category: str):
        """A context in which this process's collectives are counted under ``category``.

        Args:
            category (str): the ledger category (``spmm``, ``dense``, ``weights``, ``metrics``).
        """
        ledger = self.comm.ledger
        before, ledger.category = ledger.category, category
        try:
            yield
        finally:
            ledger.category = before


class _SpMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor, algo: DistributedSpMM, layer: int) -> Tensor:
        ctx.algo, ctx.layer = algo, layer
        with algo.counting("spmm"):
            return algo.spmm(h.contiguous(), layer)

    @staticmethod
    def backward(ctx, grad: Tensor):
        with ctx.algo.counting("spmm"):
            return ctx.algo.spmm(grad.contiguous(), ctx.layer, transposed=True), None, None


class _ReduceScatterColumns(torch.autograd.Function):
    """Sum per-process partial products over the column group, keeping this process's columns."""

    @staticmethod
    def forward(ctx, partial: Tensor, algo: DistributedSpMM) -> Tensor:
        ctx.algo = algo
        g = algo.column_group
        w = partial.shape[1]
        blocks = [partial[:, algo.cols(w, m)] for m in range(g.size)]
        ctx.shapes = [tuple(b.shape) for b in blocks]
        with algo.counting("dense"):
            return algo.comm.reduce_scatter(blocks, g)

    @staticmethod
    def backward(ctx, grad: Tensor):
        algo = ctx.algo
        with algo.counting("dense"):
            parts = algo.comm.all_gather(grad.contiguous(), ctx.shapes, algo.column_group)
        return torch.cat(parts, dim=1), None


class _GatherColumns(torch.autograd.Function):
    """Whole rows from column blocks; the copies are one variable, so the gradient is a slice."""

    @staticmethod
    def forward(ctx, h: Tensor, algo: DistributedSpMM, width: int) -> Tensor:
        ctx.algo, ctx.width = algo, width
        g = algo.column_group
        shapes = [(h.shape[0], algo.cols(width, m).stop - algo.cols(width, m).start) for m in range(g.size)]
        with algo.counting("dense"):
            return torch.cat(algo.comm.all_gather(h.contiguous(), shapes, g), dim=1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad[:, ctx.algo.cols(ctx.width)].contiguous(), None, None


def spmm(h: Tensor, algo: DistributedSpMM, layer: int) -> Tensor:
    """``A @ h`` with autograd (the backward pass is the transposed product, same algorithm).

    Args:
        h (Tensor): this process's block, in ``layer``'s input layout.
        algo (DistributedSpMM): the distributed product.
        layer (int): the layer.

    Shapes:
        - **input:** ``h`` ``[width(rows(layer)), f]``
        - **output:** ``[width(rows(layer + 1)), f]``
    """
    return _SpMM.apply(h, algo, layer)


def column_linear(h: Tensor, weight: Tensor, algo: DistributedSpMM) -> Tensor:
    """``H @ W`` for ``H`` in this process's blocks and ``W`` replicated.

    Where columns are split, each process multiplies its columns by its rows of ``W`` and the
    partial products are reduce-scattered back into column blocks of the output.

    Args:
        h (Tensor): this process's block of ``H``.
        weight (Tensor): the whole weight matrix.
        algo (DistributedSpMM): the distributed product (its column group and column blocks).

    Shapes:
        - **input:** ``h`` ``[rows, cols(F_in)]``, ``weight`` ``[F_in, F_out]``
        - **output:** ``[rows, cols(F_out)]``
    """
    g = algo.column_group
    if g is None or g.size == 1:
        return h @ weight
    return _ReduceScatterColumns.apply(h @ weight[algo.cols(weight.shape[0])], algo)


def gather_columns(h: Tensor, algo: DistributedSpMM, width: int) -> Tensor:
    """Whole rows from this process's column block (all-gathered over the column group).

    Args:
        h (Tensor): this process's block.
        algo (DistributedSpMM): the distributed product.
        width (int): the whole matrix's number of columns.

    Shapes:
        - **input:** ``h`` ``[rows, cols(width)]``
        - **output:** ``[rows, width]``
    """
    g = algo.column_group
    if g is None or g.size == 1:
        return h
    return _GatherColumns.apply(h, algo, width)
