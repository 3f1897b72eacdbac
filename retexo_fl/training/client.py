"""What every party of a federated run holds and does, whatever the mode: the base :class:`Client`.

A client owns its partition, boundary plan and local graph; it validates and trains whatever
model the server sends, seals the frames it sends peers, and keeps its node-local state in one
:class:`~retexo_fl.training.state.ClientState`. :class:`~retexo_fl.training.lazy_client.LazyClient`
(one stage at a time) and :class:`~retexo_fl.training.eager_client.EagerClient` (every layer
every round) fill in the model, its inputs and what crosses to peers.
"""

from __future__ import annotations

import logging
import os
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from retexo_fl import protocol as P
from retexo_fl.compress.bits import aggregation_weights
from retexo_fl.compress.boundary import BoundaryEncoder
from retexo_fl.compress.payload import decode_rows, encode_rows
from retexo_fl.compress.updates import UpdateCodec
from retexo_fl.config import TrainConfig
from retexo_fl.data.partition import Partition
from retexo_fl.models.adjacency import SPARSE_KINDS, sparse_adjacency
from retexo_fl.plan import BoundaryPlan, LocalGraph
from retexo_fl.protocol import DEGREES, Records
from retexo_fl.secure.boundary_noise import release_rows
from retexo_fl.secure.channel import PeerChannel
from retexo_fl.secure.policy import PartyPolicy
from retexo_fl.seeding import derive_seed, resolve_device, seed_dropout
from retexo_fl.training.drift import next_client_control, zeros_like_state
from retexo_fl.training.state import ClientState, StateDict, state_digest

log = logging.getLogger(__name__)

#: Seed tag of a client's compressed-update rounding.
UPDATE_TAG = 0xC0


@dataclass
class EvalResult:
    """One client's evaluation of a state on one split.

    Args:
        correct (int): correctly classified nodes.
        count (int): nodes of the split.
        loss_sum (float): summed cross-entropy over them.
    """

    correct: int
    count: int
    loss_sum: float

    @property
    def accuracy(self) -> float:
        """``correct / count`` (0 for an empty split)."""
        return self.correct / self.count if self.count else 0.0


class Client(ABC):
    """One party of a federated GNN run, independent of any transport.

    Subclasses say which model a round trains (:meth:`make_model`, :meth:`model_key`), how it
    reads the local graph (:meth:`forward`), and what crosses to peers.

    Args:
        part (Partition): this client's validated partition.
        cfg (TrainConfig): the run configuration (the server's, in a federation).
        policy (PartyPolicy, optional): this party's own security policy; :obj:`None` for the
            security settings in ``cfg`` (a party the user started with that config).
            (default: :obj:`None`)

    Raises:
        PolicyError: ``cfg`` is weaker than the policy.
    """

    def __init__(self, part: Partition, cfg: TrainConfig, policy: PartyPolicy | None = None) -> None:
        self.part = part
        self.cfg = cfg
        self.device = resolve_device(cfg.device, part.num_nodes)
        if cfg.threads:  # edge devices: bounded compute threads
            torch.set_num_threads(cfg.threads)
        self.plan = BoundaryPlan.from_partition(part)
        self.graph = LocalGraph.build(part, self.plan)
        self.y = torch.from_numpy(np.array(part.y)).to(self.device)
        self.masks = {
            k: torch.from_numpy(np.array(m)).to(self.device)
            for k, m in (("train", part.train_mask), ("val", part.val_mask), ("test", part.test_mask))
        }
        # What local training fits: the given labels, plus (lazy self-training) this client's own
        # confident predictions; they stay here, like the labels.
        self.train_y = self.y
        self.given_train = self.masks["train"]
        # A local step reads rows by index, never by boolean mask: indexing with a mask, or
        # ``nonzero``, waits for the device to say how many rows there are. The indices of each
        # split (keyed by the mask tensor, which self-training and restores replace, never edit)
        # and the training labels at them are built once, outside any step (see split_rows()).
        self._split_rows: dict[str, tuple[Tensor, Tensor]] = {}
        self._train_labels: tuple[Tensor, Tensor, Tensor] | None = None
        self.halo_degree: Tensor | None = None
        self._edges: tuple[Tensor, Tensor | None] | None = None
        self._adjacency: Tensor | None = None  # GCN / SAGE: the local graph as one CSR matrix
        self._model: tuple[object, torch.nn.Module] | None = None  # (model_key(), module)
        self._weights: dict[int, Tensor] | None = None
        self.encoder = BoundaryEncoder(cfg.compression)
        self.update_codec = UpdateCodec(cfg.update_bits, cfg.range_dtype) if cfg.update_bits < 32 else None
        self.residual: StateDict | None = None  # error feedback of compressed updates, this stage
        self.control: StateDict | None = None  # drift correction: this client's c_i, this stage
        self.control_view: StateDict | None = None  # ... and the server's c as broadcast
        self.view: StateDict | None = None  # the model as the compressed broadcast left it
        self.kept: StateDict | None = None  # a view the server named the stage's best so far (KEEP)
        # [[stage, round], {name: state}]: what the last round found (view, residual, control
        # variates), so that a round a resumed server sends again starts from there, not from
        # what that round already left (a delta applied twice, a residual counted twice).
        self.journal: list[Any] | None = None
        # The party's own policy, never the server's run config, says what it requires and which
        # pins, key and audit folder it uses.
        self.policy = policy if policy is not None else PartyPolicy.from_settings(cfg.security)
        self.policy.check(cfg, f"client {part.partition_id}")
        self.channel = PeerChannel(
            part.partition_id,
            cfg.encrypt,
            self.policy.identity_file(part.partition_id),
            self.policy.pinned_keys,
        )
        # Payloads the boundary plan expected and the server did not deliver, as (kind, stage,
        # sender): reported with the next reply, never filled in silently.
        self.missing: list[tuple[str, int, int]] = []
        self.boundary_releases = 0  # boundary row releases this party made (its own budget)
        # Secure aggregation: {"answered": {"stage:round": survivors}, "sent": the last masked
        # round's reply and own share} (retexo_fl.training.secure_round).
        self.secagg: dict[str, Any] | None = None
        self.delay = 0.0  # emulated seconds per local step (eager / local: step-delay)
        self.last_steps = 0  # local steps the last round took

    @property
    def id(self) -> int:
        """This client's partition id."""
        return self.part.partition_id

    @property
    def num_train(self) -> int:
        """Training nodes (given labels plus self-training labels): the aggregation weight."""
        return self.split_rows("train").numel()  # a host-side size: no read of the mask

    def split_rows(self, split: str) -> Tensor:
        """The indices of ``split``'s rows (int64, ascending) on the device.

        Built once per mask tensor: the one read of the mask, so that no step, and no later
        count, waits on the device. The masks are replaced, never modified in place.
        """
        mask = self.masks[split]
        cached = self._split_rows.get(split)
        if cached is None or cached[0] is not mask:
            cached = (mask, mask.nonzero().squeeze(1))
            self._split_rows[split] = cached
        return cached[1]

    def train_labels(self) -> Tensor:
        """The labels local training fits (:attr:`train_y`) at :meth:`split_rows` ``("train")``,
        gathered once per label tensor and mask (self-training replaces both)."""
        rows = self.split_rows("train")
        cached = self._train_labels
        if cached is None or cached[0] is not self.train_y or cached[1] is not rows:
            cached = (self.train_y, rows, self.train_y.index_select(0, rows))
            self._train_labels = cached
        return cached[2]

    @property
    def peers(self) -> set[int]:
        """The clients this one sends rows to or receives rows from."""
        return set(self.plan.send) | set(self.plan.recv)

    # -- hooks ------------------------------------------------------------------------------
    @abstractmethod
    def make_model(self) -> torch.nn.Module:
        """The model a round trains, with its initial weights, on this client's device."""

    @abstractmethod
    def model_key(self) -> object:
        """What the model's shape depends on: a new key builds a new module."""

    @abstractmethod
    def forward(self, model: torch.nn.Module, rows: Tensor | None = None) -> Tensor:
        """Class logits of the owned nodes, or of those at int64 indices ``rows`` (in that order;
        see :meth:`split_rows`), ``[n or rows, C]``."""

    @abstractmethod
    def layer_index(self) -> int:
        """Which layer's per-stage settings (``lr``, ``local-epochs``) a round uses."""

    @abstractmethod
    def seed_tags(self, round_: int) -> tuple[int, ...]:
        """The integers (after the run seed) that seed ``round_``'s dropout on this client."""

    @property
    @abstractmethod
    def seed_stage(self) -> int:
        """The stage number that seeds this client's update rounding and boundary codecs."""

    @property
    def message_stage(self) -> int:
        """The stage number the server's train messages carry for this client's rounds."""
        return self.seed_stage

    @abstractmethod
    def receive_deliveries(self, frames: dict[int, bytes]) -> None:
        """Take the halo frames the server relayed (source -> frame), sealed by their senders."""

    def check_deliveries(self, round_: int, delivered: set[int]) -> None:
        """Called with a train message's round and the senders whose rows it delivered; eager
        clients hold each round's delivery to their plan. (default: nothing is due every round)"""
        return None

    def round_payloads(self, state: StateDict, round_: int) -> tuple[dict[int, bytes], dict] | None:
        """Frames for peers computed in a round (eager), with their exchange figures; lazy: ``None``."""
        return None

    def step_budget(self) -> tuple[int, float | None]:
        """``(steps, deadline)`` of one round's local training (a deadline: time-based rounds)."""
        return int(self.cfg.per_stage("local_epochs", self.layer_index())), None

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

    def conv_edges(self) -> tuple[Tensor, Tensor | None]:
        """The local graph's edges and, for GCN, their global-degree weights, cached on the device."""
        if self._edges is None:
            if self.cfg.model == "gcn":
                if self.halo_degree is None:
                    if self.graph.num_halo:
                        raise RuntimeError(f"client {self.id}: GCN needs halo degrees first")
                    self.halo_degree = torch.zeros(0)
                ei, w = self.graph.gcn_weights(self.halo_degree.cpu())
                self._edges = (ei.to(self.device), w.to(self.device))
            else:
                self._edges = (self.graph.edge_index.to(self.device), None)
        return self._edges

    def message_graph(self) -> tuple[Tensor, Tensor | None]:
        """What a conv layer reads: for GCN and mean-SAGE the owned rows' CSR adjacency over
        owned then halo rows (built once, GCN's weights folded in), else :meth:`conv_edges`.

        Shapes:
            - **output:** CSR ``[n, n + H]`` and ``None``, or ``[2, E]`` edges and ``[E]`` weights
        """
        if self.cfg.model not in SPARSE_KINDS:
            return self.conv_edges()
        if self._adjacency is None:
            ei, w = self.conv_edges()
            n = self.graph.num_owned
            self._adjacency = sparse_adjacency(ei, w, n, n + self.graph.num_halo)
        return self._adjacency, None

    # -- rounds -----------------------------------------------------------------------------
    def loaded_model(self, state: StateDict) -> torch.nn.Module:
        """The current model holding ``state``.

        Built once per :meth:`model_key` and reused, also across :meth:`restore`: every caller
        loads a whole state into it, and building (a fresh random init of a 1433-wide encoder,
        say) cost a third of an in-process run.
        """
        key = self.model_key()
        if self._model is None or self._model[0] != key:
            self._model = (key, self.make_model())
        model = self._model[1]
        model.load_state_dict(state)
        return model

    def optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        """The local optimizer the run config names, at this layer's learning rate."""
        cfg = self.cfg
        lr = float(cfg.per_stage("lr", self.layer_index()))
        if cfg.optimizer == "adam":
            return torch.optim.Adam(model.parameters(), lr=lr, weight_decay=cfg.weight_decay)
        return torch.optim.SGD(
            model.parameters(), lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
        )

    def train(
        self, state: StateDict, round_: int, control: StateDict | None = None
    ) -> tuple[StateDict, float]:
        """Local steps from ``state``: ``local-epochs`` of them, or as many as fit in a deadline.

        Args:
            state (StateDict): the round's model.
            round_ (int): the round (seeds dropout; round 1 starts a stage).
            control (StateDict, optional): the server's control variate :math:`c`
                (``drift-correction scaffold``): every step's gradient is corrected by
                :math:`c - c_i`. (default: :obj:`None`)

        Returns:
            tuple[StateDict, float]: the new state (CPU copies) and the training loss of
            ``state`` itself (the first step's, before any update), so that the
            training-node-weighted sum over clients is the whole graph's loss at ``state``.
        """
        model = self.loaded_model(state)
        opt = self.optimizer(model)
        correction = self._correction(control, round_)
        # What the steps read (row indices, labels, row-restricted graphs) is built here, before
        # the first step: building reads sizes off the device, which no step may do.
        rows, labels = self.split_rows("train"), self.train_labels()
        self.prepare_steps(model, rows, labels)
        seed_dropout(derive_seed(self.cfg.seed, *self.seed_tags(round_)), self.device)
        model.train()
        steps, deadline = self.step_budget()
        first, taken = self.run_steps(model, opt, rows, labels, correction, steps, deadline)
        self.last_steps = taken
        # A copy: the module is reused next round and would overwrite these tensors in place.
        new = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        # The round's one read of a loss (the first step's), after the last step was queued.
        return new, float(first) if first is not None else 0.0

    def run_steps(
        self,
        model: torch.nn.Module,
        opt: torch.optim.Optimizer,
        rows: Tensor,
        labels: Tensor,
        correction: dict[str, Tensor] | None,
        steps: int,
        deadline: float | None,
    ) -> tuple[Tensor | None, int]:
        """The round's local steps: ``steps`` of them, or (a deadline) as many as fit before it.

        No step waits for the device: the losses stay there (only the first is kept, the loss
        of the round's state), and what a step branches on is known on the host (sizes of the
        indices built before, the step count, the clock). On a GPU the clock check does not
        wait for queued work either; the queue's own depth bounds how far the host runs ahead.

        Returns:
            tuple[Tensor | None, int]: the first step's loss (a 0-dim tensor on the device;
            ``None`` without steps) and the steps taken.
        """
        first: Tensor | None = None
        taken = 0
        while deadline is not None or taken < steps:
            opt.zero_grad()
            loss = self.step_gradients(model, rows, labels, taken)
            if correction:
                for name, p in model.named_parameters():
                    if p.grad is not None and name in correction:
                        p.grad.add_(correction[name])
            opt.step()
            if first is None:
                first = loss
            taken += 1
            if self.delay:
                time.sleep(self.delay)
            if deadline is not None and time.perf_counter() >= deadline:
                break
        return first, taken

    def prepare_steps(self, model: torch.nn.Module, rows: Tensor, labels: Tensor) -> None:
        """Build what this round's steps read, once, before the first (the graph a step passes
        messages over, say), so that no step reads a size off the device. (default: nothing)"""
        return None

    def step_gradients(self, model: torch.nn.Module, rows: Tensor, labels: Tensor, step: int) -> Tensor:
        """One local step's gradients, accumulated into ``model``'s parameters; its training loss,
        a 0-dim tensor left on the device (read once per round, never per step).

        Args:
            model (torch.nn.Module): the model being trained.
            rows (Tensor): the training rows' indices (:meth:`split_rows`).
            labels (Tensor): their labels (:meth:`train_labels`).
            step (int): the local step, from 0.
        """
        loss, objective = self.objective(model, rows, labels, step)
        objective.backward()
        return loss.detach()

    def objective(
        self, model: torch.nn.Module, rows: Tensor, labels: Tensor, step: int
    ) -> tuple[Tensor, Tensor]:
        """One local step's training loss and the objective the step differentiates.

        Both are the cross-entropy of the training rows here; eager adds the term through which
        its peers' halo gradients reach the weights (:class:`EagerClient`).

        Args:
            model (torch.nn.Module): the model being trained.
            rows (Tensor): the training rows' indices (:meth:`split_rows`).
            labels (Tensor): their labels (:meth:`train_labels`).
            step (int): the local step, from 0.
        """
        loss = torch.nn.functional.cross_entropy(self.forward(model, rows), labels)
        return loss, loss

    def _correction(self, control: StateDict | None, round_: int) -> dict[str, Tensor] | None:
        """:math:`c - c_i` on this client's device, or ``None`` without drift correction."""
        if control is None:
            return None
        if round_ == 1 or self.control is None:  # a new stage trains a new model
            self.control = zeros_like_state(control)
        return {k: (control[k] - self.control[k]).to(self.device) for k in control}

    def update_control(self, base: StateDict, trained: StateDict, control: StateDict) -> None:
        """Advance this client's control variate from the update as the server will decode it.

        Args:
            base (StateDict): the round's model, :math:`x`.
            trained (StateDict): the local result as the server decodes it, :math:`y_i`.
            control (StateDict): the server's control variate this round, :math:`c`.
        """
        assert self.control is not None  # train() set it this round
        lr = float(self.cfg.per_stage("lr", self.layer_index()))
        self.control = next_client_control(self.control, control, base, trained, self.last_steps, lr)

    @torch.no_grad()
    def evaluate(self, state: StateDict, split: str) -> EvalResult:
        """``state``'s accuracy and summed loss on this client's ``split`` nodes."""
        model = self.loaded_model(state)
        model.eval()
        rows = self.split_rows(split)
        count = rows.numel()
        if count == 0:
            return EvalResult(0, 0, 0.0)
        logits = self.forward(model, rows)
        y = self.y.index_select(0, rows)
        loss = torch.nn.functional.cross_entropy(logits, y, reduction="sum")
        correct = (logits.argmax(1) == y).sum()
        # One read for both (exact: a float32 loss and a count below 2^53 are float64 values).
        got_correct, got_loss = torch.stack([correct.double(), loss.double()]).tolist()
        return EvalResult(int(got_correct), count, got_loss)

    _ROUND_STATE = ("view", "kept", "residual", "control", "control_view")

    def begin_round(self, round_: int) -> bool:
        """Mark the start of train round ``round_``: remember what it finds or, for a round seen
        before (a resumed server sending it again), go back to what it found then.

        What it finds: the broadcast view, the update residual, the control variates and the
        incoming payload counters, so that the round's deliveries open again and nothing is
        applied twice. Counters go back no further than the round's start: payloads of earlier
        rounds stay refused.

        Rounds only go forward: the stage is this client's own, and a round before the last one
        begun (a server replaying an earlier round, say round 1 to skip the check that every
        peer's rows arrived) is refused.

        Returns:
            bool: the journal holds state that must outlive the process.

        Raises:
            ValueError: ``round_`` is before the last round this client began in its stage.
        """
        key = [int(self.seed_stage), int(round_)]
        if self.journal is not None and key < self.journal[0]:
            raise ValueError(
                f"client {self.id}: train round {key[1]} of stage {key[0]} after round "
                f"{self.journal[0][1]} of stage {self.journal[0][0]} began: rounds only go forward"
            )
        if self.journal is not None and self.journal[0] == key:
            for name, value in self.journal[1].items():
                setattr(self, name, None if value is None else dict(value))
            self.channel.rewind(self.journal[2] if len(self.journal) > 2 else None)
            return False
        found = {name: getattr(self, name) for name in self._ROUND_STATE}
        accepted = self.channel.accepted()
        self.journal = [key, {k: None if v is None else dict(v) for k, v in found.items()}, accepted]
        return any(v is not None for v in found.values()) or bool(accepted)

    def receive_model(
        self, state: StateDict | None, frames: dict[str, bytes] | None, keep: bool = False
    ) -> StateDict:
        """The round's model: ``state`` sent whole, or ``frames`` of a delta from the last one.

        Args:
            state (StateDict, optional): the model sent whole.
            frames (dict[str, bytes], optional): the model as a broadcast delta from the view held.
            keep (bool, optional): the view held before this message is the stage's best so far
                (:data:`~retexo_fl.protocol.KEEP`): keep a copy. (default: :obj:`False`)
        """
        if keep and self.view is not None:
            self.kept = self.view  # views are never modified in place once made
        if frames is None:
            if state is None:
                raise ValueError(f"client {self.id}: a model message with neither state nor delta")
            if not keep:
                self.kept = None  # a stage's first state: what was kept belongs to the last stage
            self.view = state
            return state
        if self.view is None:
            raise RuntimeError(f"client {self.id}: a model delta arrived before any whole state")
        codec = UpdateCodec(self.cfg.broadcast_bits, self.cfg.range_dtype)
        self.view = codec.decode(frames, self.view, "server broadcast")
        return self.view

    def held_state(self, digest: str) -> StateDict | None:
        """The state this client holds whose :func:`~retexo_fl.training.state.state_digest` is
        ``digest`` (its view, or the one it kept), or ``None``: the server then sends it whole."""
        for state in (self.view, self.kept):
            if state is not None and state_digest(state) == digest:
                return state
        return None

    def encode_update(self, new: StateDict, base: StateDict, round_: int) -> dict[str, bytes] | None:
        """``new``'s update from ``base`` as frames (``update-bits``), or ``None`` when uncompressed."""
        if self.update_codec is None:
            return None
        if round_ == 1:
            self.residual = None  # a new stage trains a new model
        stage = self.seed_stage
        gen = torch.Generator().manual_seed(derive_seed(self.cfg.seed, stage, round_, UPDATE_TAG, self.id))
        frames, self.residual = self.update_codec.encode(
            new, base, self.residual, gen, where=f"client {self.id}, stage {stage} update"
        )
        return frames

    def receive_control(self, request: Records, state: StateDict, round_: int) -> StateDict | None:
        """The server's control variate for this round (``drift-correction scaffold``), else ``None``.

        A stage's first round carries none (it is zero); later rounds carry it whole
        (:data:`~retexo_fl.protocol.CONTROL`) or as deltas from the one held
        (:data:`~retexo_fl.protocol.CONTROL_FRAMES`).

        Args:
            request (Records): the train message.
            state (StateDict): the round's model (for keys and shapes at a stage's start).
            round_ (int): the round.
        """
        if self.cfg.drift_correction != "scaffold":
            return None
        if round_ == 1 or self.control_view is None:
            self.control_view = zeros_like_state(state)
        if P.CONTROL in request:
            self.control_view = dict(request[P.CONTROL])
        elif P.CONTROL_FRAMES in request:
            frames = {k: bytes(v) for k, v in request[P.CONTROL_FRAMES].items()}
            codec = UpdateCodec(self.cfg.broadcast_bits, self.cfg.range_dtype)
            self.control_view = codec.decode(frames, self.control_view, "server control variate")
        return self.control_view

    def decode_own_update(self, frames: dict[str, bytes], base: StateDict) -> StateDict:
        """This client's compressed update as the server decodes it (``base`` plus the deltas).

        Args:
            frames (dict[str, bytes]): what :meth:`encode_update` returned.
            base (StateDict): the state the update was taken from.
        """
        assert self.update_codec is not None  # frames exist only with a codec
        return self.update_codec.decode(frames, base, f"client {self.id}")

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
            channel=self.channel.to_state(),
            journal=self.journal,
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
        self.journal = state.journal
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
