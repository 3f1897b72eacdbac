"""One party of the baselines: eager (every layer every round, halo refreshed) and local (no cross edges).

Eager: every round the client trains the whole model of ``stages - 1`` conv layers (the standard
GNN split at its linear maps, :class:`SplitGNN`, or :class:`LayeredGNN`) on its owned and halo
rows; the halo rows of every conv layer are what peers computed in the previous round (one round
stale; zeros in round 1). With ``halo-gradients`` (eager's default) each client also
returns, with its rows, the gradient of its loss with respect to the halo rows it trained on, and
the owner adds those to its own gradient a round later, as PipeGCN does: the weighted sum of the
clients' gradients is then the whole-graph gradient up to one round of staleness.

Local: the same model with every cross edge dropped, optionally with time-based rounds
(``round-seconds``): the client trains until its time is up and reports how many steps it took,
so a slow client never stalls a round.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch
from torch import Tensor

from retexo_fl.compress.boundary import ExchangeStats
from retexo_fl.compress.payload import PayloadError, decode_rows, encode_rows, frame_size, split_frames
from retexo_fl.compress.quantize import snap_bits
from retexo_fl.config import TrainConfig
from retexo_fl.data.partition import Partition
from retexo_fl.models.factory import build_layered_model
from retexo_fl.models.layered import LayeredGNN
from retexo_fl.models.split import SplitGNN
from retexo_fl.party.client import Client
from retexo_fl.party.state import ClientState
from retexo_fl.protocol import EAGER
from retexo_fl.records import StateDict
from retexo_fl.secure.policy import PartyPolicy
from retexo_fl.seeding import derive_seed

#: Seed tags of an eager client's dropout, boundary-row and halo-gradient rounding.
DROPOUT_TAG, BOUNDARY_TAG, GRADIENT_TAG = 0xEA, 0xEB, 0xEC
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
        # Halo gradients: per peer, what its loss's gradient says about the rows this client sent
        # it (one block per conv layer), for this round's training; and what this round's
        # training says about the peers' rows, for the reply. Both live within one message.
        self.grads_in: dict[int, list[Tensor]] = {}
        self.grads_out: dict[int, Tensor] = {}
        self._halo_leaves: list[Tensor] | None = None
        # The rows each peer holds of this client's, on the device once: every local step reads them.
        self._send_index = {q: torch.from_numpy(idx).to(self.device) for q, idx in self.plan.send.items()}

    @property
    def exchanges_gradients(self) -> bool:
        """Whether this client returns halo gradients (``halo-gradients``, eager, a conv layer)."""
        return bool(self.cfg.halo_gradients) and not self.local and self.layers > 1

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

    def make_model(self) -> LayeredGNN | SplitGNN:
        return build_layered_model(self.cfg, self.part.num_features, self.part.num_classes).to(self.device)

    def model_key(self) -> object:
        return "layered"

    def forward(self, model: torch.nn.Module, rows: Tensor | None = None) -> Tensor:
        ei, w = self.message_graph() if self.layers > 1 else (None, None)
        logits, _ = model(self.owned, ei, w, self.halo_layers)
        return logits if rows is None else logits.index_select(0, rows)

    def prepare_steps(self, model: torch.nn.Module, rows: Tensor, labels: Tensor) -> None:
        """Build the local graph before the first step (it reads sizes off the device)."""
        if self.layers > 1:
            self.message_graph()

    def objective(
        self, model: torch.nn.Module, rows: Tensor, labels: Tensor, step: int
    ) -> tuple[Tensor, Tensor]:
        r"""The cross-entropy of the training rows, and with halo gradients, that plus
        :math:`\frac{1}{n}\sum_{q,l} \langle h^{(l)}_{S_q}, G^{(l)}_q \rangle`.

        :math:`h^{(l)}_{S_q}` are the rows this client sent peer ``q`` for conv layer ``l`` (as
        the model now computes them) and :math:`G^{(l)}_q` the gradient of ``q``'s summed loss
        with respect to them, received this round; :math:`n` is this client's training-node
        count, so that the FedAvg weights (training-node counts) turn the clients' gradients
        into the whole graph's. At step 0 the halo rows become leaves whose gradients
        (:meth:`train` returns them to their owners) are taken at the round's state.
        """
        if not self.exchanges_gradients:
            return super().objective(model, rows, labels, step)
        ei, w = self.message_graph()
        halo = self.halo_layers
        if step == 0:
            halo = [h.detach().clone().requires_grad_(True) for h in halo]
            self._halo_leaves = halo
        logits, inputs = model(self.owned, ei, w, halo)
        # Rows by index and the count from its size: no step waits for the device.
        loss = torch.nn.functional.cross_entropy(logits.index_select(0, rows), labels)
        peer_term = loss.new_zeros(())
        for q, blocks in self.grads_in.items():
            idx = self._send_index[q]
            for layer, grad in enumerate(blocks):
                peer_term = peer_term + (inputs[layer][idx] * grad).sum()
        return loss, loss + peer_term / max(rows.numel(), 1)

    def train(
        self, state: StateDict, round_: int, control: StateDict | None = None
    ) -> tuple[StateDict, float]:
        """:meth:`Client.train`, keeping (with halo gradients) the gradient of this client's
        summed loss with respect to each peer's halo rows at the round's state, for the reply."""
        self._halo_leaves = None
        try:
            new, loss = super().train(state, round_, control)
        finally:
            self.grads_in = {}  # they belong to this round's state only
        leaves, self._halo_leaves = self._halo_leaves, None
        self.grads_out = {}
        if leaves is not None and self.plan.recv:
            scale = max(self.num_train, 1)  # the summed loss's gradient: owners divide by theirs
            grads = [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves]
            self.grads_out = self._per_peer([self.bounded(g.detach().cpu() * scale) for g in grads])
        return new, loss

    def _per_peer(self, per_layer: list[Tensor]) -> dict[int, Tensor]:
        """Each peer's block of every layer's halo-row gradients ``[halo, width]``, stacked."""
        peers = sorted(self.plan.recv)
        sizes = [int(self.plan.recv[q].size) for q in peers]
        split = [dict(zip(peers, torch.split(g, sizes), strict=True)) for g in per_layer]
        return {q: torch.cat([blocks[q] for blocks in split]) for q in peers}

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
        per_layer = [self.plan.rows_for(self.released(self.bounded(h.float().cpu()))) for h in inputs]
        return {q: torch.cat([rows[q] for rows in per_layer]) for q in self.plan.send}

    def encode_rows_for_round(
        self, rows: dict[int, Tensor], round_: int, grads: dict[int, Tensor] | None = None
    ) -> tuple[dict[int, bytes], ExchangeStats]:
        """Sealed frames of :meth:`boundary_rows`, compressed on the rate schedule over rounds.

        With halo gradients every frame is two frames back to back: the rows for the peer, then
        ``grads[peer]``, the gradients of the peer's rows this client trained on (at the same
        width; either may have zero rows).
        """
        weights = None
        if self.cfg.bit_policy != "fixed":  # every layer's block of a row weighs the same
            weights = {q: w.repeat(self.layers - 1) for q, w in self.boundary_weights().items()}
        gen = torch.Generator().manual_seed(derive_seed(self.cfg.seed, BOUNDARY_TAG, round_, self.id))
        rounds = int(self.cfg.per_stage("rounds", 1))
        frames, stats = self.encoder.encode(self.id, rows, weights, round_ - 1, rounds, gen)
        if self.exchanges_gradients:
            frames = self._with_gradients(frames, grads or {}, round_, rounds, stats)
        return self.channel.seal(frames, EAGER, 0, round_), stats

    def _with_gradients(
        self,
        frames: dict[int, bytes],
        grads: dict[int, Tensor],
        round_: int,
        rounds: int,
        stats: ExchangeStats,
    ) -> dict[int, bytes]:
        """Each peer's row frame joined with its gradient frame (an empty frame where none)."""
        bits = snap_bits(self.encoder.rate(round_ - 1, rounds))
        gen = torch.Generator().manual_seed(derive_seed(self.cfg.seed, GRADIENT_TAG, round_, self.id))
        half = self.cfg.range_dtype
        empty = torch.zeros(0, self.cfg.hidden)
        out = {}
        for q in sorted(set(frames) | set(grads)):
            block = grads.get(q, empty)
            where = f"client {self.id}, round {round_}, halo gradients to client {q}"
            grad_frame = encode_rows(block, bits, generator=gen, half=half, where=where)
            row_frame = frames.get(q) or encode_rows(empty, bits, half=half, where=where)
            out[q] = row_frame + grad_frame
            stats.bytes_raw += frame_size(block.shape[0], block.shape[1], 32)
            stats.bytes_sent += len(grad_frame)
            stats.bits[bits] += block.shape[0]
        return out

    def drop_round_gradients(self) -> None:
        """Zero this round's halo gradients: a round that diverged sends zeros of the shapes an
        honest round sends (NaN would be refused by the codec, and missing blocks would show in
        the frames' sizes and the figures, either naming this client as the one that diverged)."""
        self.grads_out = {}
        if self.exchanges_gradients and self.plan.recv:
            self.grads_out = self._per_peer([torch.zeros(h.shape) for h in self.halo_layers])

    def round_payloads(self, state: StateDict, round_: int) -> tuple[dict[int, bytes], dict] | None:
        """This round's rows for the peers' next round and, with halo gradients, what this
        round's training found about the peers' rows (call it after :meth:`train`), and figures."""
        rows = self.boundary_rows(state)
        grads, self.grads_out = self.grads_out, {}
        if not rows and not grads:
            return {}, {}
        frames, stats = self.encode_rows_for_round(rows, round_, grads)
        return frames, stats.to_dict()

    def receive_deliveries(self, frames: dict[int, bytes]) -> None:
        """Replace the halo of every layer with what peers sent (missing peers: as the policy says),
        and take the halo gradients that came with them (a lost peer's: none this round).

        Sealed rows older than the newest already accepted are refused as replays.
        """
        frames, newest = self.channel.open(frames, EAGER, 0, self.halo_round + 1)
        self.halo_round = max(self.halo_round, newest)
        self.grads_in = {}
        k_layers = self.layers - 1
        blocks: list[dict[int, Tensor]] = [{} for _ in range(k_layers)]
        for p, joined in sorted(frames.items()):
            blob = joined
            if self.exchanges_gradients:
                blob, grad_blob = split_frames(joined, f"client {p}", 2)
                sent = self.plan.send.get(p)
                k_sent = 0 if sent is None else int(sent.size)
                where = f"client {p} (halo gradients)"
                grads = decode_rows(grad_blob, where, None, self.cfg.hidden)
                if grads.shape[0] not in (0, k_sent * k_layers):  # none, or one per row sent p
                    raise PayloadError(
                        f"payload from {where}: {grads.shape[0]} rows, boundary plan expects "
                        f"{k_sent * k_layers} (or none)"
                    )
                if grads.shape[0]:
                    self.grads_in[p] = [g.to(self.device) for g in grads.chunk(k_layers)]
                if self.expected_rows(p) is None:
                    decode_rows(blob, f"client {p}", 0)  # gradients only: p has no rows for us
                    continue
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
