"""A client's side of what crosses between peers: keys and sealed channels, the one-time degree
exchange, the halo rows it expects, and what its boundary rows may release."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import Tensor

from retexo_fl.compress.bits import aggregation_weights
from retexo_fl.compress.payload import decode_rows, encode_rows
from retexo_fl.config import TrainConfig
from retexo_fl.data.partition import Partition
from retexo_fl.plan import BoundaryPlan, LocalGraph
from retexo_fl.protocol import DEGREES
from retexo_fl.secure.boundary_noise import release_rows
from retexo_fl.secure.channel import PeerChannel
from retexo_fl.secure.policy import PartyPolicy

log = logging.getLogger(__name__)

#: Under secure aggregation, the largest magnitude a row this client computes for peers (or keeps
#: as its next stage's input) may have; NaN becomes 0. Trained embeddings are about 1. A row past
#: float32, or one the codec refuses, would otherwise end the reply with an error that says, per
#: client, which of its rows a crafted state drove there: a question about its data.
MAX_ROW_VALUE = 1e9


def bounded_rows(rows: Tensor, limit: float = MAX_ROW_VALUE) -> Tensor:
    """``rows`` with NaN as 0 and every value clamped to ``[-limit, limit]``.

    Shapes:
        - **input:** ``rows`` ``[n, d]``
        - **output:** ``[n, d]``, the same dtype
    """
    return torch.nan_to_num(rows, nan=0.0, posinf=limit, neginf=-limit).clamp(-limit, limit)


class HaloExchange:
    """The peer-exchange seam of :class:`~retexo_fl.party.client.Client` (a mixin: it reads the
    client's partition, plan, graph and channel, and keeps the halo degrees and release count)."""

    cfg: TrainConfig
    part: Partition
    plan: BoundaryPlan
    graph: LocalGraph
    channel: PeerChannel
    policy: PartyPolicy
    halo_degree: Tensor | None
    missing: list[tuple[str, int, int]]
    boundary_releases: int
    _edges: tuple[Tensor, Tensor | None] | None
    _adjacency: Tensor | None
    _weights: dict[int, Tensor] | None
    # The client's own (:class:`~retexo_fl.party.client.Client`):
    id: int
    peers: set[int]

    def bounded(self, rows: Tensor) -> Tensor:
        """``rows`` as :func:`bounded_rows` gives them under secure aggregation; as they are
        otherwise (a NaN row is then refused by the codec, naming this client: training diverged)."""
        return bounded_rows(rows) if self.cfg.secure_aggregation else rows

    def released(self, rows: Tensor) -> Tensor:
        """``rows`` as they may leave this client: clipped and noised per row when the run says so
        (``boundary-clip``, ``boundary-noise``).

        The noise is seeded from the operating system's randomness, never from the run's seed:
        every party knows that seed, and noise a peer can regenerate protects nothing. Each call
        is one release of every row, counted against this party's own budget
        (``max-boundary-epsilon``), whatever the server counts.

        Raises:
            PolicyError: the release would exceed this party's budget.
        """
        cfg = self.cfg
        if cfg.boundary_clip <= 0:
            return rows
        self.policy.spend_boundary_release(cfg.boundary_noise, self.boundary_releases, f"client {self.id}")
        self.boundary_releases += 1
        gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
        return release_rows(rows, cfg.boundary_clip, cfg.boundary_noise, gen)

    # -- end-to-end encryption --------------------------------------------------------------
    def public_key(self) -> bytes:
        """This client's X25519 public key (see :meth:`PeerChannel.public_key`)."""
        return self.channel.public_key()

    def connect(
        self,
        directory: dict[int, bytes],
        run_id: int,
        contributions: dict[int, bytes],
        run_config: bytes = b"",
    ) -> None:
        """Derive the sealed channels to every peer from the server's key directory and the
        parties' transcript contributions.

        Raises:
            KeyMaterialError: the directory misses a peer, has another key or contribution for
                this client, or disagrees with this party's pinned keys.
        """
        # Peers lost at key setup are absent; they are tolerated where their rows may be missing.
        allow = self.cfg.on_missing_halo != "fail"
        peers = self.channel_peers(directory)
        self.channel.connect(
            directory, run_id, peers, contributions, allow_missing=allow, run_config=run_config
        )

    def channel_peers(self, directory: dict[int, Any]) -> set[int]:
        """Whom this client seals frames to: its boundary peers, and under secure aggregation
        every party in the key directory (each holds a share of its self seed)."""
        if self.cfg.secure_aggregation:
            return self.peers | ({int(q) for q in directory} - {self.id})
        return self.peers

    # -- one-time setup exchange ------------------------------------------------------------
    def needs_degrees(self) -> bool:
        """Whether peers need this client's degrees: GCN with a conv layer over halo rows."""
        return self.cfg.model == "gcn" and self.cfg.stages > 1

    def degree_rows(self) -> dict[int, Tensor]:
        """Global in-degrees of the rows each peer needs, ``{peer: [k, 1]}`` (GCN only)."""
        return self.plan.rows_for(self.graph.in_degree.view(-1, 1))

    def degree_frames(self) -> dict[int, bytes]:
        """:meth:`degree_rows` as exact (32-bit) frames, sealed for their peers."""
        frames = {
            q: encode_rows(r, 32, where=f"client {self.id}, degrees") for q, r in self.degree_rows().items()
        }
        return self.channel.seal(frames, DEGREES, 0)

    def decode_degrees(self, frames: dict[int, bytes]) -> dict[int, Tensor]:
        """Peers' degree frames -> ``{peer: [k, 1]}``, each checked against the boundary plan."""
        frames, _ = self.channel.open(frames, DEGREES, 0)
        return {
            p: decode_rows(blob, f"client {p} (degrees)", self.expected_rows(p), 1)
            for p, blob in frames.items()
        }

    def expected_rows(self, peer: int) -> int | None:
        """Rows the plan expects from ``peer`` (``None``: it sends this client nothing)."""
        ids = self.plan.recv.get(peer)
        return None if ids is None else int(ids.size)

    def complete_halo(
        self, incoming: dict[int, Tensor], dim: int, previous: Tensor | None, kind: str, stage: int
    ) -> dict[int, Tensor]:
        """``incoming`` plus the blocks of peers lost since (absent), as ``on-missing-halo`` says.

        This client's boundary plan says which senders it expects. ``fail`` leaves a missing
        block missing, so assembling the halo raises an error naming the sender. ``zero`` fills
        it with zeros and ``reuse-last`` with its rows in ``previous`` (the halo held so far, if it
        has the same width; else zeros); either way the miss is logged and recorded in
        :attr:`missing`, which the next reply reports to the run summary (``missing_payloads``).

        Args:
            incoming (dict[int, Tensor]): sender -> the block it sent.
            dim (int): the row width.
            previous (Tensor, optional): the halo held so far.
            kind (str): what the blocks are (``"deg"``, ``"halo"``, ``"eager"``), for the record.
            stage (int): the stage they belong to, for the record.
        """
        missing = sorted(set(self.plan.recv) - set(incoming))
        policy = self.cfg.on_missing_halo
        if not missing or policy == "fail":
            return incoming
        for q in missing:
            self.missing.append((kind, stage, q))
            log.warning(
                "client %d: no %s payload from client %d at stage %d; filled in (on-missing-halo %s)",
                self.id,
                kind,
                q,
                stage,
                policy,
            )
        out, start, spans = dict(incoming), 0, {}
        for q in sorted(self.plan.recv):
            spans[q] = slice(start, start + int(self.plan.recv[q].size))
            start = spans[q].stop
        for q in missing:
            if policy == "reuse-last" and previous is not None and previous.shape[1] == dim:
                out[q] = previous[spans[q]].detach().cpu()
            else:
                out[q] = torch.zeros(int(self.plan.recv[q].size), dim)
        return out

    def receive_degrees(self, incoming: dict[int, Tensor]) -> None:
        """Take the halo nodes' global degrees (GCN's normalization needs them)."""
        blocks = self.complete_halo(incoming, 1, None, DEGREES, 0)
        self.halo_degree = self.plan.assemble_halo(blocks, 1).view(-1)
        self._edges = self._adjacency = None
        self._weights = None

    def boundary_weights(self) -> dict[int, Tensor]:
        """Per peer, the aggregation weights of the rows sent to it (adaptive widths); computed
        once, as they depend only on the graph and the halo degrees."""
        if self._weights is None:
            self._weights = aggregation_weights(
                self.part, self.plan, self.graph.in_degree, self.halo_degree, self.cfg.model
            )
        return self._weights
