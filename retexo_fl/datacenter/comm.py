"""Counted collectives: every byte the data-center engine moves, per process, collective and phase."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from retexo_fl.datacenter.blocks import SparseBlock


@dataclass
class CommLedger:
    """Bytes this process sent and received, keyed by ``(phase, category, collective)``.

    Counts are the payloads of the calls made, attributed as the bandwidth-optimal schedule of
    each collective moves them (what CAGNET's analysis counts):

    - ``broadcast`` of ``b`` bytes over ``g`` processes: each non-root receives ``b``, the root
      sends ``b * (g - 1)``;
    - ``all_reduce`` of ``b`` bytes (ring): each sends and receives ``2 b (g - 1) / g``;
    - ``reduce_scatter`` into blocks: each sends every block but its own and receives ``g - 1``
      contributions to its own block.

    Summed over processes, sent equals received for every collective.

    Args:
        phase (str, optional): where calls are counted now (``train``, ``eval``, ``setup``).
            (default: :obj:`"train"`)
        category (str, optional): what they are for now (``spmm``, ``dense``, ``weights``,
            ``metrics``). (default: :obj:`"spmm"`)
        sent (dict[tuple[str, str, str], int], optional): bytes sent per key.
            (default: :obj:`defaultdict(int)`)
        received (dict[tuple[str, str, str], int], optional): bytes received per key.
            (default: :obj:`defaultdict(int)`)
        calls (dict[tuple[str, str, str], int], optional): calls made per key.
            (default: :obj:`defaultdict(int)`)
    """

    phase: str = "train"
    category: str = "spmm"
    sent: dict[tuple[str, str, str], int] = field(default_factory=lambda: defaultdict(int))
    received: dict[tuple[str, str, str], int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[tuple[str, str, str], int] = field(default_factory=lambda: defaultdict(int))

    def add(self, op: str, sent: float, received: float) -> None:
        """Count one call of collective ``op`` under the current phase and category.

        Args:
            op (str): the collective (``broadcast``, ``all_reduce``, ``reduce_scatter``).
            sent (float): bytes this process sent (rounded).
            received (float): bytes it received (rounded).
        """
        key = (self.phase, self.category, op)
        self.sent[key] += round(sent)
        self.received[key] += round(received)
        self.calls[key] += 1

    def total(self, which: str = "received", phase: str | None = None, category: str | None = None) -> int:
        """Bytes received (or sent) in all calls, or in one phase and / or category.

        Args:
            which (str, optional): ``"received"``, or anything else for bytes sent.
                (default: :obj:`"received"`)
            phase (str | None, optional): only this phase; ``None`` for all. (default: :obj:`None`)
            category (str | None, optional): only this category; ``None`` for all.
                (default: :obj:`None`)
        """
        table = self.received if which == "received" else self.sent
        return sum(
            v
            for (ph, cat, _), v in table.items()
            if (phase is None or ph == phase) and (category is None or cat == category)
        )

    def to_rows(self) -> list[dict]:
        """One row per ``(phase, category, collective)`` with calls, bytes sent and received."""
        return [
            {
                "phase": ph,
                "category": cat,
                "collective": op,
                "calls": self.calls[(ph, cat, op)],
                "bytes_sent": self.sent[(ph, cat, op)],
                "bytes_received": self.received[(ph, cat, op)],
            }
            for (ph, cat, op) in sorted(self.calls)
        ]


class Counted:
    """The collectives of one process, each one recorded in ``ledger``.

    Args:
        ledger (CommLedger): where bytes are counted.
        rank (int): this process's global rank.
    """

    def __init__(self, ledger: CommLedger, rank: int) -> None:
        self.ledger = ledger
        self.rank = rank

    def broadcast(self, tensor: Tensor, src: int, group: Group) -> Tensor:
        """Broadcast ``tensor`` (filled at global rank ``src``) over ``group``, in place.

        Args:
            tensor (Tensor): the data at ``src``, a buffer of its shape elsewhere.
            src (int): the global rank that sends.
            group (Group): the processes taking part.

        Shapes:
            - **input / output:** ``tensor``, any shape (the same at every member)
        """
        if group.size > 1 and tensor.numel() > 0:
            dist.broadcast(tensor, src=src, group=group.handle)
        nbytes = tensor.numel() * tensor.element_size()
        if self.rank == src:
            self.ledger.add("broadcast", nbytes * (group.size - 1), 0)
        else:
            self.ledger.add("broadcast", 0, nbytes)
        return tensor

    def all_reduce(self, tensor: Tensor, group: Group) -> Tensor:
        """Sum ``tensor`` over ``group``, in place.

        Args:
            tensor (Tensor): this member's contribution; the sum on return.
            group (Group): the processes taking part.

        Shapes:
            - **input / output:** ``tensor``, any shape (the same at every member)
        """
        g = group.size
        if g > 1:
            dist.all_reduce(tensor, group=group.handle)
        vol = 2 * tensor.numel() * tensor.element_size() * (g - 1) / g
        self.ledger.add("all_reduce", vol, vol)
        return tensor

    def share(self, own: Tensor, src: int, shape: tuple[int, ...], group: Group) -> Tensor:
        """Global rank ``src``'s tensor at every member of ``group``.

        ``src`` passes ``own``; the others get it in a new buffer of ``shape`` (same dtype and device as
        ``own``).

        Args:
            own (Tensor): this process's tensor (only ``src``'s is sent).
            src (int): the global rank that sends.
            shape (tuple[int, ...]): the shape of ``src``'s tensor.
            group (Group): the processes taking part.

        Shapes:
            - **output:** ``shape``
        """
        buf = own.contiguous() if src == self.rank else own.new_empty(shape)
        return self.broadcast(buf, src, group)

    def share_block(
        self, own: SparseBlock, src: int, nnz: int, shape: tuple[int, int], group: Group
    ) -> SparseBlock:
        """:meth:`share` for a sparse block of ``nnz`` entries: rows, columns and values.

        Args:
            own (SparseBlock): this process's block (only ``src``'s is sent).
            src (int): the global rank that sends.
            nnz (int): the entries of ``src``'s block.
            shape (tuple[int, int]): its shape.
            group (Group): the processes taking part.
        """
        blk = own if src == self.rank else SparseBlock.empty(nnz, shape, own.values.device)
        for t in (blk.rows, blk.cols, blk.values):
            self.broadcast(t, src, group)
        return blk

    def reduce_scatter(self, blocks: Sequence[Tensor], group: Group) -> Tensor:
        """Sum ``blocks[m]`` over ``group`` into member ``m``; returns this member's summed block.

        Args:
            blocks (Sequence[Tensor]): one block per member, in member order.
            group (Group): the processes taking part (this process among them).

        Shapes:
            - **input:** ``blocks[m]`` the same shape at every process
            - **output:** the shape of ``blocks[group.index(rank)]``
        """
        mine = group.index(self.rank)
        out = torch.empty_like(blocks[mine])
        if group.size > 1:
            dist.reduce_scatter(out, [b.contiguous() for b in blocks], group=group.handle)
        else:
            out.copy_(blocks[0])
        sizes = [b.numel() * b.element_size() for b in blocks]
        self.ledger.add("reduce_scatter", sum(sizes) - sizes[mine], sizes[mine] * (group.size - 1))
        return out

    def all_gather(self, mine: Tensor, shapes: Sequence[tuple[int, ...]], group: Group) -> list[Tensor]:
        """Every member's tensor (shapes may differ), gathered by one broadcast per member.

        Gloo's ``all_gather`` wants equal sizes; uneven blocks are the rule here, and padding
        them would put bytes on the wire that carry nothing.

        Args:
            mine (Tensor): this process's tensor.
            shapes (Sequence[tuple[int, ...]]): every member's shape, in member order.
            group (Group): the processes taking part.

        Shapes:
            - **output:** one tensor per member, of shape ``shapes[m]``
        """
        return [self.share(mine, group.ranks[m], shape, group) for m, shape in enumerate(shapes)]


@dataclass(frozen=True)
class Group:
    """A process group and its members' global ranks, in member order.

    Args:
        ranks (tuple[int, ...]): the members' global ranks.
        handle (object | None, optional): the :mod:`torch.distributed` group; ``None`` for a
            single process. (default: :obj:`None`)
    """

    ranks: tuple[int, ...]
    handle: object | None = None

    @property
    def size(self) -> int:
        """The number of members."""
        return len(self.ranks)

    def index(self, rank: int) -> int:
        """The member index of global rank ``rank``.

        Args:
            rank (int): a member's global rank.

        Raises:
            ValueError: if ``rank`` is not a member.
        """
        return self.ranks.index(rank)


def make_groups(rank_sets: Sequence[Sequence[int]]) -> dict[tuple[int, ...], Group]:
    """Create one process group per rank set (every process must call this with the same sets).

    Args:
        rank_sets (Sequence[Sequence[int]]): the groups' global ranks, each in member order;
            repeated sets are created once.

    Returns:
        ``{ranks: Group}``.
    """
    out = {}
    for ranks in rank_sets:
        key = tuple(int(r) for r in ranks)
        if key in out:
            continue
        handle = dist.new_group(list(key)) if len(key) > 1 else None
        out[key] = Group(key, handle)
    return out
