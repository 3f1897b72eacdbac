"""CAGNET 2D: a sqrt(P) x sqrt(P) grid; SUMMA broadcasts A blocks along rows and H blocks down columns."""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import torch
from torch import Tensor

from retexo_fl.datacenter.blocks import SparseBlock, block, bounds, width
from retexo_fl.datacenter.comm import Counted, Group, make_groups
from retexo_fl.datacenter.settings import check_procs
from retexo_fl.datacenter.spmm import DistributedSpMM


def block_nnz(matrix: sp.csr_matrix, row_cuts: np.ndarray, col_cuts: np.ndarray) -> np.ndarray:
    """Nonzeros of every block of ``matrix`` cut at ``row_cuts`` x ``col_cuts``.

    Args:
        matrix (sp.csr_matrix): the matrix.
        row_cuts (np.ndarray): ``[R + 1]`` row cut points (see :func:`~retexo_fl.datacenter.blocks.bounds`).
        col_cuts (np.ndarray): ``[C + 1]`` column cut points.

    Shapes:
        - **output:** ``[R, C]`` int64
    """
    coo = matrix.tocoo()
    rb = np.searchsorted(row_cuts, coo.row, side="right") - 1
    cb = np.searchsorted(col_cuts, coo.col, side="right") - 1
    out = np.zeros((len(row_cuts) - 1, len(col_cuts) - 1), dtype=np.int64)
    np.add.at(out, (rb, cb), 1)
    return out


def grid_side(procs: int, dims: int) -> int:
    """``q`` with ``q ** dims == procs``, or a clear error.

    Args:
        procs (int): the process count.
        dims (int): the grid's dimensions, 2 or 3.

    Raises:
        ValueError: if ``procs`` is not a square (2) or a cube (3).
    """
    check_procs(f"{dims}d", procs)
    return round(procs ** (1.0 / dims))


class TwoD(DistributedSpMM):
    """Process ``(i, j)`` (rank ``i q + j``) holds ``A_ij`` and ``H_ij`` (row block i, column block j).

    ``(A H)_ij = sum_k A_ik H_kj``: at step k, ``A_ik`` is broadcast along grid row i and
    ``H_kj`` down grid column j. Per product a process receives about ``nnz / sqrt(P)``
    nonzeros and ``n F / sqrt(P)`` words.

    Args:
        adjacency (sp.csr_matrix): ``[n, n]`` normalized adjacency; only this process's blocks are
            kept.
        comm (Counted): this process's counted collectives.
        world (tuple[int, int]): global rank and world size as ``(rank, size)``.
        device (torch.device | None, optional): where blocks and products live; ``None`` for CPU.
            (default: :obj:`None`)

    Raises:
        ValueError: if P is not a square.
    """

    name = "2d"

    def __init__(
        self,
        adjacency: sp.csr_matrix,
        comm: Counted,
        world: tuple[int, int],
        device: torch.device | None = None,
    ) -> None:
        super().__init__(adjacency, comm, world, device)
        q = self.q = grid_side(self.size, 2)
        self.i, self.j = divmod(self.rank, q)
        groups = make_groups(
            [[i * q + j for j in range(q)] for i in range(q)]
            + [[i * q + j for i in range(q)] for j in range(q)]
        )
        self.grid_row = groups[tuple(self.i * q + j for j in range(q))]
        self.grid_col = groups[tuple(i * q + self.j for i in range(q))]
        self.world = Group(tuple(range(self.size)))
        self.row = block(self.n, q, self.i)
        transpose = adjacency.T.tocsr()
        cuts = bounds(self.n, q)
        own_cols = block(self.n, q, self.j)
        self.a = SparseBlock.cut(adjacency, self.row, own_cols, self.device)
        self.at = SparseBlock.cut(transpose, self.row, own_cols, self.device)
        self.nnz_a = block_nnz(adjacency, cuts, cuts)[self.i]
        self.nnz_at = block_nnz(transpose, cuts, cuts)[self.i]

    def rows(self, layer: int) -> slice:
        """Global rows this process holds at the input of ``layer``.

        Row block ``i``, the same at every layer.

        Args:
            layer (int): the layer.
        """
        return self.row

    @property
    def column_group(self) -> Group:
        """Grid row ``i``: its ``q`` processes split the columns of row block ``i``."""
        return self.grid_row

    @property
    def gradient_group(self) -> Group:
        """Every process: each holds a distinct block of rows and columns."""
        return self.world

    def spmm(self, h: Tensor, layer: int, transposed: bool = False) -> Tensor:
        """``A @ h`` (or ``A.T @ h``) in this process's blocks; every process of the world calls it.

        SUMMA: for each ``k``, ``A_ik`` comes along grid row ``i`` and ``H_kj`` down grid column ``j``.

        Args:
            h (Tensor): this process's block of the dense matrix.
            layer (int): the layer.
            transposed (bool, optional): compute ``A.T @ h`` (the backward pass).
                (default: :obj:`False`)

        Shapes:
            - **input:** ``h`` ``[width(rows(layer)), f]``
            - **output:** ``[width(rows(layer + 1)), f]`` (the other way round when ``transposed``)
        """
        own, nnz = (self.at, self.nnz_at) if transposed else (self.a, self.nnz_a)
        out = h.new_zeros(h.shape[0], h.shape[1])
        for k in range(self.q):
            k_rows = width(block(self.n, self.q, k))
            a = self.comm.share_block(
                own, self.i * self.q + k, int(nnz[k]), (h.shape[0], k_rows), self.grid_row
            )
            hk = self.comm.share(h, k * self.q + self.j, (k_rows, h.shape[1]), self.grid_col)
            out += a.matmul(hk)
        return out
