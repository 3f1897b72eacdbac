"""CAGNET 1.5D: 1D row blocks replicated ``c`` times; replicas split the block sum and all-reduce."""

from __future__ import annotations

import scipy.sparse as sp
import torch
from torch import Tensor

from retexo_fl.datacenter.blocks import SparseBlock, block, width
from retexo_fl.datacenter.comm import Counted, Group, make_groups
from retexo_fl.datacenter.settings import check_procs
from retexo_fl.datacenter.spmm import DistributedSpMM


class OneHalfD(DistributedSpMM):
    """P processes in ``P / c`` teams of ``c``; team ``t`` holds row block ``R_t`` of A and H.

    Process ``t c + r`` is replica ``r`` of team ``t``. Replica ``r`` of team ``t`` computes
    ``sum_{q = r mod c} A_tq H_q``, receiving ``H_q`` by broadcast among the replicas ``r`` of all
    teams; the team then all-reduces its ``c`` partial sums. Per product a process receives about
    ``n F / c`` words by broadcast plus ``2 (c - 1) / c * n F c / P`` in the all-reduce: ``c``
    trades memory for bandwidth.

    Args:
        adjacency (sp.csr_matrix): ``[n, n]`` normalized adjacency; only this process's blocks are
            kept.
        comm (Counted): this process's counted collectives.
        world (tuple[int, int]): global rank and world size as ``(rank, size)``.
        device (torch.device | None, optional): where blocks and products live; ``None`` for CPU.
            (default: :obj:`None`)
        replication (int, optional): ``c``, which must divide P. (default: :obj:`2`)

    Raises:
        ValueError: if ``replication`` does not divide P.
    """

    name = "1.5d"

    def __init__(
        self,
        adjacency: sp.csr_matrix,
        comm: Counted,
        world: tuple[int, int],
        device: torch.device | None = None,
        replication: int = 2,
    ) -> None:
        super().__init__(adjacency, comm, world, device)
        c = int(replication)
        check_procs("1.5d", self.size, c)
        self.c, self.teams = c, self.size // c
        self.team, self.replica = divmod(self.rank, c)
        groups = make_groups(
            [[t * c + r for r in range(c)] for t in range(self.teams)]
            + [[t * c + r for t in range(self.teams)] for r in range(c)]
        )
        self.team_group = groups[tuple(self.team * c + r for r in range(c))]
        self.replica_group = groups[tuple(t * c + self.replica for t in range(self.teams))]
        self.row = block(self.n, self.teams, self.team)
        self.stages = [q for q in range(self.teams) if q % c == self.replica]
        transpose = adjacency.T.tocsr()
        cols = {q: block(self.n, self.teams, q) for q in self.stages}
        self.a = {q: SparseBlock.cut(adjacency, self.row, cols[q], self.device) for q in self.stages}
        self.at = {q: SparseBlock.cut(transpose, self.row, cols[q], self.device) for q in self.stages}

    def rows(self, layer: int) -> slice:
        """Global rows this process holds at the input of ``layer``.

        Its team's row block ``R_t``, the same at every layer.

        Args:
            layer (int): the layer.
        """
        return self.row

    @property
    def gradient_group(self) -> Group:
        """Replica ``r`` of every team: the replicas of a team hold the same rows, so one per team sums."""
        # Every replica of a team holds the same rows: one replica per team makes the sum.
        return self.replica_group

    @property
    def counts_rows(self) -> bool:
        """Only replica 0 of each team counts its rows in metrics."""
        return self.replica == 0

    def spmm(self, h: Tensor, layer: int, transposed: bool = False) -> Tensor:
        """``A @ h`` (or ``A.T @ h``) in this process's blocks; every process of the world calls it.

        Sums ``A_tq H_q`` over this replica's share of ``q``, then all-reduces within the team.

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
        for q in self.stages:
            shape = (width(block(self.n, self.teams, q)), h.shape[1])
            out += blocks[q].matmul(self.comm.share(h, q * self.c + self.replica, shape, self.replica_group))
        return self.comm.all_reduce(out, self.team_group)
