"""CAGNET 1D: row blocks of A and H; each product broadcasts every H block to every process."""

from __future__ import annotations

import scipy.sparse as sp
import torch
from torch import Tensor

from retexo_fl.datacenter.blocks import SparseBlock, block, width
from retexo_fl.datacenter.comm import Counted, Group
from retexo_fl.datacenter.spmm import DistributedSpMM


class OneD(DistributedSpMM):
    """Process ``p`` holds rows ``R_p`` of A (all columns, cut into P column blocks) and of H.

    ``(A H)_p = sum_q A_pq H_q``: P broadcasts per product, each process receiving
    ``(P - 1) / P * n * F`` words.

    Args:
        adjacency (sp.csr_matrix): ``[n, n]`` normalized adjacency; only this process's blocks are
            kept.
        comm (Counted): this process's counted collectives.
        world (tuple[int, int]): global rank and world size as ``(rank, size)``.
        device (torch.device | None, optional): where blocks and products live; ``None`` for CPU.
            (default: :obj:`None`)
    """

    name = "1d"

    def __init__(
        self,
        adjacency: sp.csr_matrix,
        comm: Counted,
        world: tuple[int, int],
        device: torch.device | None = None,
    ) -> None:
        super().__init__(adjacency, comm, world, device)
        self.world = Group(tuple(range(self.size)))
        self.row = block(self.n, self.size, self.rank)
        transpose = adjacency.T.tocsr()
        cols = [block(self.n, self.size, q) for q in range(self.size)]
        self.a = [SparseBlock.cut(adjacency, self.row, c, self.device) for c in cols]
        self.at = [SparseBlock.cut(transpose, self.row, c, self.device) for c in cols]

    def rows(self, layer: int) -> slice:
        """Global rows this process holds at the input of ``layer``.

        Its row block ``R_p``, the same at every layer.

        Args:
            layer (int): the layer.
        """
        return self.row

    @property
    def gradient_group(self) -> Group:
        """Every process: each holds distinct rows, so all of them sum to the weight gradient."""
        return self.world

    def spmm(self, h: Tensor, layer: int, transposed: bool = False) -> Tensor:
        """``A @ h`` (or ``A.T @ h``) in this process's blocks; every process of the world calls it.

        Process ``q`` broadcasts ``H_q`` to all; each adds ``A_pq H_q``.

        Args:
            h (Tensor): this process's block of the dense matrix.
            layer (int): the layer.
            transposed (bool, optional): compute ``A.T @ h`` (the backward pass).
                (default: :obj:`False`)

        Shapes:
            - **input:** ``h`` ``[width(rows(layer)), f]``
            - **output:** ``[width(rows(layer + 1)), f]`` (the other way round when ``transposed``)
        """
        blocks = self.at if transposed else self.a
        out = h.new_zeros(h.shape[0], h.shape[1])
        for q in range(self.size):
            rows = width(block(self.n, self.size, q))
            out += blocks[q].matmul(self.comm.share(h, q, (rows, h.shape[1]), self.world))
        return out
