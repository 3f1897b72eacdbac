"""Block ranges and sparse adjacency blocks: how the matrices are cut over the process grid."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np
import scipy.sparse as sp
import torch
from torch import Tensor

#: Bytes one stored nonzero costs on the wire: int32 row, int32 column, float32 value.
NNZ_BYTES = 12


def bounds(n: int, parts: int) -> np.ndarray:
    """``[parts + 1]`` cut points splitting ``range(n)`` into ``parts`` near-equal blocks.

    Args:
        n (int): the length to split.
        parts (int): the number of blocks.
    """
    return np.array([n * b // parts for b in range(parts + 1)], dtype=np.int64)


def block(n: int, parts: int, b: int) -> slice:
    """The ``b``-th of ``parts`` near-equal blocks of ``range(n)``.

    Args:
        n (int): the length to split.
        parts (int): the number of blocks.
        b (int): the block's index.
    """
    cuts = bounds(n, parts)
    return slice(int(cuts[b]), int(cuts[b + 1]))


def sub_block(n: int, parts: int, b: int, pieces: int, p: int) -> slice:
    """Piece ``p`` of ``pieces`` of block ``b`` of ``parts`` (3D splits each block once more).

    Args:
        n (int): the length to split.
        parts (int): the number of blocks.
        b (int): the block's index.
        pieces (int): the number of pieces the block is split into.
        p (int): the piece's index.
    """
    outer = block(n, parts, b)
    inner = block(outer.stop - outer.start, pieces, p)
    return slice(outer.start + inner.start, outer.start + inner.stop)


def width(s: slice) -> int:
    """The length of a slice with explicit ``start`` and ``stop``.

    Args:
        s (slice): the slice.
    """
    return s.stop - s.start


@dataclass
class SparseBlock:
    """A block of the normalized adjacency in coordinate form, in the block's local indices.

    Build one with :meth:`cut`, :meth:`empty` or :meth:`stack_rows`.

    Args:
        rows (Tensor): ``[nnz]`` int32 local row indices, sorted.
        cols (Tensor): ``[nnz]`` int32 local column indices.
        values (Tensor): ``[nnz]`` float32 entries.
        shape (tuple[int, int]): ``(rows, cols)`` of the block.
    """

    rows: Tensor
    cols: Tensor
    values: Tensor
    shape: tuple[int, int]
    _csr: Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def nnz(self) -> int:
        """The number of stored entries."""
        return int(self.values.numel())

    @classmethod
    def cut(
        cls, matrix: sp.csr_matrix, rows: slice, cols: slice, device: torch.device | None = None
    ) -> SparseBlock:
        """The block ``matrix[rows, cols]``, sorted by row then column, on ``device``.

        Args:
            matrix (sp.csr_matrix): the whole matrix.
            rows (slice): the block's global rows.
            cols (slice): the block's global columns.
            device (torch.device | None, optional): where the block lives; ``None`` for CPU.
                (default: :obj:`None`)
        """
        sub = matrix[rows, cols].tocoo()
        order = np.lexsort((sub.col, sub.row))
        return cls(
            torch.from_numpy(sub.row[order].astype(np.int32)).to(device),
            torch.from_numpy(sub.col[order].astype(np.int32)).to(device),
            torch.from_numpy(sub.data[order].astype(np.float32)).to(device),
            (width(rows), width(cols)),
        )

    @classmethod
    def empty(cls, nnz: int, shape: tuple[int, int], device: torch.device) -> SparseBlock:
        """A receive buffer for a block of ``nnz`` entries.

        Args:
            nnz (int): the entries it will receive.
            shape (tuple[int, int]): the block's shape.
            device (torch.device): where it lives.
        """
        i = torch.empty(nnz, dtype=torch.int32, device=device)
        return cls(i, torch.empty_like(i), torch.empty(nnz, dtype=torch.float32, device=device), shape)

    @staticmethod
    def stack_rows(pieces: list[SparseBlock]) -> SparseBlock:
        """One block from its row pieces, in order (all with the same columns).

        Args:
            pieces (list[SparseBlock]): the pieces, top to bottom.
        """
        offsets, total = [], 0
        for p in pieces:
            offsets.append(total)
            total += p.shape[0]
        return SparseBlock(
            torch.cat([p.rows + off for p, off in zip(pieces, offsets, strict=True)]),
            torch.cat([p.cols for p in pieces]),
            torch.cat([p.values for p in pieces]),
            (total, pieces[0].shape[1]),
        )

    def matmul(self, dense: Tensor) -> Tensor:
        """``self @ dense`` (rows must be sorted); the CSR form is built once per device and kept.

        Args:
            dense (Tensor): the right-hand side.

        Shapes:
            - **input:** ``dense`` ``[shape[1], F]``
            - **output:** ``[shape[0], F]``
        """
        if self.nnz == 0:
            return dense.new_zeros(self.shape[0], dense.shape[1])
        if self._csr is None or self._csr.device != dense.device:
            crow = torch.zeros(self.shape[0] + 1, dtype=torch.int64, device=self.rows.device)
            crow[1:] = torch.bincount(self.rows.long(), minlength=self.shape[0]).cumsum(0)
            with warnings.catch_warnings():  # "sparse CSR support is in beta": it is what we want
                warnings.simplefilter("ignore", UserWarning)
                csr = torch.sparse_csr_tensor(
                    crow, self.cols.long(), self.values, self.shape, check_invariants=False
                )
            self._csr = csr.to(dense.device)
        return self._csr @ dense
