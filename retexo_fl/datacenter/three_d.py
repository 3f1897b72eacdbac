"""CAGNET 3D (split-3D SpMM): a P^(1/3) cube; all-gather A and H pieces, reduce-scatter the sums."""

from __future__ import annotations

import scipy.sparse as sp
import torch
from torch import Tensor

from retexo_fl.datacenter.blocks import SparseBlock, block, sub_block, width
from retexo_fl.datacenter.comm import Counted, Group, make_groups
from retexo_fl.datacenter.spmm import DistributedSpMM
from retexo_fl.datacenter.two_d import grid_side


class ThreeD(DistributedSpMM):
    """Process ``(i, j, k)`` (rank ``i q^2 + j q + k``) of a ``q x q x q`` cube.

    Dense matrices are cut into ``q`` row blocks, each split into ``q`` row pieces, and ``q``
    column blocks. A product of orientation 0 computes ``Z_i = sum_k A_ik H_k`` for column
    block j: the fibre ``(i, *, k)`` all-gathers ``A_ik`` (stored as q row pieces), the fibre
    ``(*, j, k)`` all-gathers ``H_kj`` (piece i at process i), and the fibre ``(i, j, *)``
    reduce-scatters the partial ``A_ik H_kj`` so that process k keeps piece k of ``Z_ij``.
    Orientation 1 swaps the roles of i and k, so the output of one layer is the input of the
    next without moving it, and the transposed product of orientation o is orientation ``1 - o``
    with ``A.T``. Per product a process receives about ``nnz / P^(2/3)`` nonzeros and
    ``2 n F / P^(2/3)`` words.

    Args:
        adjacency (sp.csr_matrix): ``[n, n]`` normalized adjacency; only this process's blocks are
            kept.
        comm (Counted): this process's counted collectives.
        world (tuple[int, int]): global rank and world size as ``(rank, size)``.
        device (torch.device | None, optional): where blocks and products live; ``None`` for CPU.
            (default: :obj:`None`)

    Raises:
        ValueError: if P is not a cube.
    """

    name = "3d"

    def __init__(
        self,
        adjacency: sp.csr_matrix,
        comm: Counted,
        world: tuple[int, int],
        device: torch.device | None = None,
    ) -> None:
        super().__init__(adjacency, comm, world, device)
        q = self.q = grid_side(self.size, 3)
        self.i, rest = divmod(self.rank, q * q)
        self.j, self.k = divmod(rest, q)

        def rank(i: int, j: int, k: int) -> int:
            return i * q * q + j * q + k

        fibres = []
        for a in range(q):
            for b in range(q):
                fibres += [
                    [rank(x, a, b) for x in range(q)],
                    [rank(a, x, b) for x in range(q)],
                    [rank(a, b, x) for x in range(q)],
                ]
        groups = make_groups(fibres)
        self.fibre = [
            groups[tuple(rank(x, self.j, self.k) for x in range(q))],
            groups[tuple(rank(self.i, x, self.k) for x in range(q))],
            groups[tuple(rank(self.i, self.j, x) for x in range(q))],
        ]
        self.world = Group(tuple(range(self.size)))
        transpose = adjacency.T.tocsr()
        # pieces[(transposed, orientation)] = (this process's piece, nnz of every piece)
        self.pieces = {}
        for t, matrix in ((False, adjacency), (True, transpose)):
            for o in (0, 1):
                a, b = (self.i, self.k) if o == 0 else (self.k, self.i)
                cols = block(self.n, q, b)
                cut = [
                    SparseBlock.cut(matrix, sub_block(self.n, q, a, q, m), cols, self.device)
                    for m in range(q)
                ]
                self.pieces[(t, o)] = (cut[self.j], [p.nnz for p in cut])

    def rows(self, layer: int) -> slice:
        """Global rows this process holds at the input of ``layer``.

        Piece ``i`` of row block ``k`` at even layers (the input of an orientation-0 product),
        piece ``k`` of row block ``i`` at odd layers.

        Args:
            layer (int): the layer.
        """
        # Input of an orientation-0 product: block k, piece i; orientation 1: block i, piece k.
        if layer % 2 == 0:
            return sub_block(self.n, self.q, self.k, self.q, self.i)
        return sub_block(self.n, self.q, self.i, self.q, self.k)

    @property
    def column_group(self) -> Group:
        """The fibre ``(i, *, k)``: its ``q`` processes split the columns of one row piece."""
        return self.fibre[1]

    @property
    def gradient_group(self) -> Group:
        """Every process: each holds a distinct block of rows and columns."""
        return self.world

    def spmm(self, h: Tensor, layer: int, transposed: bool = False) -> Tensor:
        """``A @ h`` (or ``A.T @ h``) in this process's blocks; every process of the world calls it.

        Orientation ``(layer + transposed) mod 2``: all-gather ``A`` and ``H``, multiply, reduce-scatter.

        Args:
            h (Tensor): this process's block of the dense matrix.
            layer (int): the layer.
            transposed (bool, optional): compute ``A.T @ h`` (the backward pass).
                (default: :obj:`False`)

        Shapes:
            - **input:** ``h`` ``[width(rows(layer)), f]``
            - **output:** ``[width(rows(layer + 1)), f]`` (the other way round when ``transposed``)
        """
        q, n = self.q, self.n
        o = (layer + int(transposed)) % 2
        a_idx, b_idx = (self.i, self.k) if o == 0 else (self.k, self.i)
        gather_h, reduce_z = (self.fibre[0], self.fibre[2]) if o == 0 else (self.fibre[2], self.fibre[0])
        own, nnz = self.pieces[(transposed, o)]
        cols = block(n, q, b_idx)
        # A_ab from its q row pieces, one at each member of the (i, *, k) fibre.
        shapes = [width(sub_block(n, q, a_idx, q, m)) for m in range(q)]
        group = self.fibre[1]
        a = SparseBlock.stack_rows(
            [
                self.comm.share_block(own, group.ranks[m], nnz[m], (shapes[m], width(cols)), group)
                for m in range(q)
            ]
        )
        # H_b (all of row block b, this column block) from its q pieces.
        h_pieces = self.comm.all_gather(
            h, [(width(sub_block(n, q, b_idx, q, m)), h.shape[1]) for m in range(q)], gather_h
        )
        partial = a.matmul(torch.cat(h_pieces, dim=0))
        offsets = [0]
        for s in shapes:
            offsets.append(offsets[-1] + s)
        blocks = [partial[offsets[m] : offsets[m + 1]] for m in range(q)]
        return self.comm.reduce_scatter(blocks, reduce_z)
