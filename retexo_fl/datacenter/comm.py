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

    Attributes:
        phase: where calls are counted now (``train``, ``eval``, ``setup``).
        category: what they are for now (``spmm``, ``dense``, ``weights``, ``metrics``).
    """

    phase: str = "train"
    category: str = "spmm"
    sent: dict[tuple[str, str, str], int] = field(default_factory=lambda: defaultdict(int))
    received: dict[tuple[str, str, str], int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[tuple[str, str, str], int] = field(default_factory=lambda: defaultdict(int))

    def add(self, op: str, sent: float, received: float) -> None:
        key = (self.phase, self.category, op)
        self.sent[key] += round(sent)
        self.received[key] += round(received)
        self.calls[key] += 1

    def total(self, which: str = "received", phase: str | None = None, category: str | None = None) -> int:
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
        ledger: where bytes are counted.
        rank: this process's global rank.
    """

    def __init__(self, ledger: CommLedger, rank: int) -> None:
        self.ledger = ledger
        self.rank = rank

    def broadcast(self, tensor: Tensor, src: int, group: Group) -> Tensor:
        """Broadcast ``tensor`` (filled at global rank ``src``) over ``group``, in place."""
        if group.size > 1 and tensor.numel() > 0:
            dist.broadcast(tensor, src=src, group=group.handle)
        nbytes = tensor.numel() * tensor.element_size()
        if self.rank == src:
            self.ledger.add("broadcast", nbytes * (group.size - 1), 0)
        else:
            self.ledger.add("broadcast", 0, nbytes)
        return tensor

    def all_reduce(self, tensor: Tensor, group: Group) -> Tensor:
        """Sum ``tensor`` over ``group``, in place."""
        g = group.size
        if g > 1:
            dist.all_reduce(tensor, group=group.handle)
        vol = 2 * tensor.numel() * tensor.element_size() * (g - 1) / g
        self.ledger.add("all_reduce", vol, vol)
        return tensor

    def share(self, own: Tensor, src: int, shape: tuple[int, ...], group: Group) -> Tensor:
        """Global rank ``src``'s tensor at every member of ``group``: ``src`` passes ``own``, the
        others get it in a new buffer of ``shape`` (same dtype and device as ``own``)."""
        buf = own.contiguous() if src == self.rank else own.new_empty(shape)
        return self.broadcast(buf, src, group)

    def share_block(
        self, own: SparseBlock, src: int, nnz: int, shape: tuple[int, int], group: Group
    ) -> SparseBlock:
        """:meth:`share` for a sparse block of ``nnz`` entries: rows, columns and values."""
        blk = own if src == self.rank else SparseBlock.empty(nnz, shape, own.values.device)
        for t in (blk.rows, blk.cols, blk.values):
            self.broadcast(t, src, group)
        return blk

    def reduce_scatter(self, blocks: Sequence[Tensor], group: Group) -> Tensor:
        """Sum ``blocks[m]`` over ``group`` into member ``m``; returns this member's summed block."""
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
        """
        return [self.share(mine, group.ranks[m], shape, group) for m, shape in enumerate(shapes)]


@dataclass(frozen=True)
class Group:
    """A process group and its members' global ranks, in member order."""

    ranks: tuple[int, ...]
    handle: object | None = None

    @property
    def size(self) -> int:
        return len(self.ranks)

    def index(self, rank: int) -> int:
        return self.ranks.index(rank)


def make_groups(rank_sets: Sequence[Sequence[int]]) -> dict[tuple[int, ...], Group]:
    """Create one process group per rank set (every process must call this with the same sets)."""
    out = {}
    for ranks in rank_sets:
        key = tuple(int(r) for r in ranks)
        if key in out:
            continue
        handle = dist.new_group(list(key)) if len(key) > 1 else None
        out[key] = Group(key, handle)
    return out
