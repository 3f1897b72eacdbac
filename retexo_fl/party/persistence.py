"""A client's node-local persistence: everything a later message needs, as one
:class:`~retexo_fl.party.state.ClientState`, saved and restored between messages."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import Tensor

from retexo_fl.config import TrainConfig
from retexo_fl.party.state import ClientState
from retexo_fl.records import StateDict
from retexo_fl.secure.channel import PeerChannel


class Persistence:
    """The persistence seam of :class:`~retexo_fl.party.client.Client` (a mixin: a snapshot of the
    state the other seams keep, and its adoption)."""

    cfg: TrainConfig
    channel: PeerChannel
    halo_degree: Tensor | None
    residual: StateDict | None
    control: StateDict | None
    control_view: StateDict | None
    view: StateDict | None
    kept: StateDict | None
    earlier_view: StateDict | None
    earlier_kept: StateDict | None
    journal: list[Any] | None
    delivered: str | None
    boundary_releases: int
    secagg: dict[str, Any] | None
    _edges: tuple[Tensor, Tensor | None] | None
    _adjacency: Tensor | None
    _weights: dict[int, Tensor] | None
    # The client's own (:class:`~retexo_fl.party.client.Client`):
    channel_peers: Callable[[dict[int, Any]], set[int]]

    # -- node-local state -------------------------------------------------------------------
    def snapshot(self) -> ClientState:
        """Everything a later message needs besides the partition."""
        return ClientState(
            halo_degree=self.halo_degree,
            residual=self.residual,
            control=self.control,
            control_view=self.control_view,
            view=self.view if self.cfg.broadcast_bits < 32 else None,
            kept=self.kept if self.cfg.broadcast_bits < 32 else None,
            earlier_view=self.earlier_view if self.cfg.broadcast_bits < 32 else None,
            earlier_kept=self.earlier_kept if self.cfg.broadcast_bits < 32 else None,
            channel=self.channel.to_state(),
            journal=self.journal,
            delivered=self.delivered,
            boundary_releases=self.boundary_releases,
            secagg=self.secagg,
        )

    def load_snapshot(self, state: ClientState) -> None:
        """Adopt a :meth:`snapshot`."""
        self.halo_degree = state.halo_degree
        self.residual = state.residual
        self.control = state.control
        self.control_view = state.control_view
        self.view = state.view
        self.kept = state.kept
        self.earlier_view = state.earlier_view
        self.earlier_kept = state.earlier_kept
        self.journal = state.journal
        self.delivered = state.delivered
        self.boundary_releases = int(state.boundary_releases)
        self.secagg = state.secagg
        self._edges = self._adjacency = None
        self._weights = None
        if state.channel:
            self.channel.load_state(state.channel, self.channel_peers(state.channel.get("directory") or {}))

    def save(self, folder: str | Path) -> None:
        """Write :meth:`snapshot` to a node-local ``folder`` (atomically, owner-only)."""
        self.snapshot().save(folder)

    def restore(self, folder: str | Path) -> bool:
        """Load what :meth:`save` wrote; ``False`` if there is nothing."""
        state = ClientState.load(folder)
        if state is None:
            return False
        self.load_snapshot(state)
        return True
