"""One party of the baselines: eager (every layer every round, halo refreshed) and local (no cross edges).

Eager: every round the client trains the whole ``stages``-layer :class:`LayeredGNN` on its owned
and halo rows; the halo rows of every conv layer are what peers computed in the previous round
(one round stale; zeros in round 1). Local: the same model with every cross edge dropped,
optionally with time-based rounds (``round-seconds``): the client trains until its time is up
and reports how many steps it took, so a slow client never stalls a round.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch
from torch import Tensor

from retexo_fl.compress.boundary import ExchangeStats
from retexo_fl.compress.payload import decode_rows
from retexo_fl.config import TrainConfig
from retexo_fl.data.partition import Partition
from retexo_fl.models.factory import build_layered_model
from retexo_fl.models.layered import LayeredGNN
from retexo_fl.protocol import EAGER
from retexo_fl.secure.policy import PartyPolicy
from retexo_fl.seeding import derive_seed
from retexo_fl.training.client import Client
from retexo_fl.training.state import ClientState, StateDict

#: Seed tags of an eager client's dropout and boundary-row rounding.
DROPOUT_TAG, BOUNDARY_TAG = 0xEA, 0xEB
#: The stage number an eager run's update rounding is seeded with (one stage, numbered 1).
EAGER_SEED_STAGE = 1


def without_cross_edges(part: Partition) -> Partition:
    """``part`` as the local-only baselines see it: its own subgraph, no edge to any peer."""
    return dataclasses.replace(part, cross_edges=np.zeros((0, 4), dtype=np.int64))


def step_delays(spec: str) -> dict[int, float]:
    """``step-delay`` ``"P:seconds,..."``: extra seconds per local step of client P (slow devices).

    Raises:
        ValueError: an entry is not ``CLIENT:seconds``.
    """
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        pid, _, sec = item.partition(":")
        try:
            out[int(pid)] = float(sec)
        except ValueError:
            raise ValueError(f"step-delay: bad entry {item!r} (want CLIENT:seconds)") from None
    return out


class EagerClient(Client):
    """One party of eager or local training.

    Args:
        part (Partition): this client's validated partition.
        cfg (TrainConfig): the run configuration.
        local (bool, optional): drop every cross edge (local mode). (default: :obj:`False`)
        policy (PartyPolicy, optional): this party's own security policy (see :class:`Client`).
            (default: :obj:`None`)
    """

    def __init__(
        self, part: Partition, cfg: TrainConfig, local: bool = False, policy: PartyPolicy | None = None
    ) -> None:
        super().__init__(without_cross_edges(part) if local else part, cfg, policy)
        self.local = local
        self.layers = cfg.stages
        self.owned = torch.from_numpy(np.array(self.part.x, dtype=np.float32)).to(self.device)
        self.halo_layers = [torch.zeros(self.plan.num_halo, cfg.hidden, device=self.device)] * (
            self.layers - 1
        )
        self.halo_round = 0  # the newest round whose halo rows were accepted
        self.delay = step_delays(cfg.step_delay).get(self.id, 0.0)

    @property
    def seed_stage(self) -> int:
        return EAGER_SEED_STAGE

    @property
    def message_stage(self) -> int:
        return 0  # one stage: the server numbers it 0

    def layer_index(self) -> int:
        return 1  # every conv layer at once: the conv layers' per-stage settings

    def seed_tags(self, round_: int) -> tuple[int, ...]:
        return (DROPOUT_TAG, round_, self.id)

    def step_budget(self) -> tuple[int, float | None]:
        if self.cfg.round_seconds > 0:
            return 0, time.perf_counter() + self.cfg.round_seconds
        return super().step_budget()

    def make_model(self) -> LayeredGNN:
        return build_layered_model(self.cfg, self.part.num_features, self.part.num_classes).to(self.device)

    def model_key(self) -> object:
        return "layered"

    def forward(self, model: torch.nn.Module, rows: Tensor | None = None) -> Tensor:
        ei, w = self.message_graph() if self.layers > 1 else (None, None)
        logits, _ = model(self.owned, ei, w, self.halo_layers)
        return logits if rows is None else logits[rows]

    @torch.no_grad()
    def boundary_rows(self, state: StateDict) -> dict[int, Tensor]:
        """Per peer, the conv inputs of its halo rows for every layer, stacked ``[(K - 1) k, hidden]``
        (clipped and noised as released)."""
        if self.local or self.layers < 2 or not self.plan.send:
            return {}
        model = self.loaded_model(state)
        model.eval()
        ei, w = self.message_graph()
        _, inputs = model(self.owned, ei, w, self.halo_layers)
        per_layer = [self.plan.rows_for(self.released(h.float().cpu())) for h in inputs]
        return {q: torch.cat([rows[q] for rows in per_layer]) for q in self.plan.send}

    def encode_rows_for_round(
        self, rows: dict[int, Tensor], round_: int
    ) -> tuple[dict[int, bytes], ExchangeStats]:
        """Sealed frames of :meth:`boundary_rows`, compressed on the rate schedule over rounds."""
        weights = None
        if self.cfg.bit_policy != "fixed":  # every layer's block of a row weighs the same
            weights = {q: w.repeat(self.layers - 1) for q, w in self.boundary_weights().items()}
        gen = torch.Generator().manual_seed(derive_seed(self.cfg.seed, BOUNDARY_TAG, round_, self.id))
        rounds = int(self.cfg.per_stage("rounds", 1))
        frames, stats = self.encoder.encode(self.id, rows, weights, round_ - 1, rounds, gen)
        return self.channel.seal(frames, EAGER, 0, round_), stats

    def round_payloads(self, state: StateDict, round_: int) -> tuple[dict[int, bytes], dict] | None:
        """This round's rows for the peers' next round (computed before training), and figures."""
        rows = self.boundary_rows(state)
        if not rows:
            return {}, {}
        frames, stats = self.encode_rows_for_round(rows, round_)
        return frames, stats.to_dict()

    def receive_deliveries(self, frames: dict[int, bytes]) -> None:
        """Replace the halo of every layer with what peers sent (missing peers: as the policy says).

        Sealed rows older than the newest already accepted are refused as replays.
        """
        frames, newest = self.channel.open(frames, EAGER, 0, self.halo_round + 1)
        self.halo_round = max(self.halo_round, newest)
        k_layers = self.layers - 1
        blocks: list[dict[int, Tensor]] = [{} for _ in range(k_layers)]
        for p, blob in frames.items():
            k = self.expected_rows(p)
            rows = decode_rows(blob, f"client {p}", None if k is None else k * k_layers, self.cfg.hidden)
            for layer, chunk in enumerate(rows.chunk(k_layers)):
                blocks[layer][p] = chunk
        if frames:
            self._complete(blocks)

    def _complete(self, blocks: list[dict[int, Tensor]]) -> None:
        dim = self.cfg.hidden
        filled = [self.complete_halo(b, dim, self.halo_layers[i], EAGER, 0) for i, b in enumerate(blocks)]
        self.halo_layers = [self.plan.assemble_halo(b, dim).to(self.device) for b in filled]

    def check_deliveries(self, round_: int, delivered: set[int]) -> None:
        """From round 2 on every peer's rows of the round before are due: a round that brought
        none at all is completed as ``on-missing-halo`` says (an error naming the senders, or
        filled in and reported), never trained on stale rows in silence."""
        if self.local or round_ <= 1 or not self.plan.recv or delivered:
            return
        self._complete([{} for _ in range(self.layers - 1)])

    def snapshot(self) -> ClientState:
        state = super().snapshot()
        # Stage inputs are the raw features throughout; the per-layer halo is what changes.
        state.halo_layers = [h.cpu() for h in self.halo_layers]
        state.halo_round = self.halo_round
        return state

    def load_snapshot(self, state: ClientState) -> None:
        super().load_snapshot(state)
        if state.halo_layers is not None:
            self.halo_layers = [h.to(self.device) for h in state.halo_layers]
        self.halo_round = int(state.halo_round)
