"""What every party of a federated run holds and does, whatever the mode: the base :class:`Client`.

A client owns its partition, boundary plan and local graph; it validates and trains whatever
model the server sends, seals the frames it sends peers, and keeps its node-local state in one
:class:`~retexo_fl.party.state.ClientState`. :class:`~retexo_fl.party.lazy_client.LazyClient`
(one stage at a time) and :class:`~retexo_fl.party.eager_client.EagerClient` (every layer
every round) fill in the model, its inputs and what crosses to peers.

The client is carved along its seams, one module each: the peer exchange (keys, sealed
channels, degrees, halo rows: :mod:`~retexo_fl.party.halo_exchange`), the model exchange
(broadcast, compressed update, control variates, round journal:
:mod:`~retexo_fl.party.model_exchange`), evaluation (:mod:`~retexo_fl.party.evaluation`) and
persistence (:mod:`~retexo_fl.party.persistence`). This module keeps what they share: the
partition, its labels and masks, the local graph and local training.
"""

from __future__ import annotations

import logging
import math
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from retexo_fl import protocol as P
from retexo_fl.compress.boundary import BoundaryEncoder
from retexo_fl.compress.updates import UpdateCodec
from retexo_fl.config import TrainConfig
from retexo_fl.data.partition import Partition
from retexo_fl.models.adjacency import SPARSE_KINDS, sparse_adjacency
from retexo_fl.party.evaluation import Evaluation
from retexo_fl.party.halo_exchange import HaloExchange
from retexo_fl.party.model_exchange import ModelExchange, RoundCohort
from retexo_fl.party.persistence import Persistence
from retexo_fl.party.plain_sgd import PlainSGD
from retexo_fl.plan import BoundaryPlan, LocalGraph
from retexo_fl.records import StateDict
from retexo_fl.scaffold import zeros_like_state
from retexo_fl.secure.channel import PeerChannel
from retexo_fl.secure.policy import PartyPolicy, PolicyError
from retexo_fl.seeding import derive_seed, dropout_stream, resolve_device

log = logging.getLogger(__name__)


class TrainingDiverged(RuntimeError):
    """A client's local steps left NaN or Inf in its loss or weights."""


class Client(HaloExchange, ModelExchange, Evaluation, Persistence, ABC):
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
        # first-stage auto: the first training of stage 0's last and kept views, held while
        # the second trains (either may be the stage's best)
        self.earlier_view: StateDict | None = None
        self.earlier_kept: StateDict | None = None
        # first-stage auto trained in parallel (LANES): the round state (the fields above, the
        # journal, last_steps) of each variant's training but the one the fields hold (lane)
        self.lanes: dict[str, dict[str, Any]] = {}
        self.lane: str | None = None
        # [[stage, round], {name: state}]: what the last round found (view, residual, control
        # variates), so that a round a resumed server sends again starts from there, not from
        # what that round already left (a delta applied twice, a residual counted twice).
        self.journal: list[Any] | None = None
        # Saved: the file in the work folder that holds the journal's round state (the state
        # file as the round found it, kept by a hard link), and what the state file holds now.
        self.journal_file: str | None = None
        self.state_folder: Path | None = None
        self.on_file: dict[str, Any] | None = None
        # The digest of the last deliveries a test or an embed opened: the same message sent
        # again by a resumed server finds them applied (and saved) already, and does not open
        # them twice (a sender's second frame in it would refuse its first as a replay).
        self.delivered: str | None = None
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
        # round's reply and own share} (retexo_fl.party.secure_reply).
        self.secagg: dict[str, Any] | None = None
        # The digest of the run config setup bound (retexo_fl.protocol.client_config_digest):
        # every later message's config must be this one (check_run_config).
        self.run_config: str | None = None
        self.delay = 0.0  # emulated seconds per local step (eager / local: step-delay)
        self.last_steps = 0  # local steps the last round took
        # In process, the train message's cohort this client trains and encodes with (set by
        # the engine around one message; retexo_fl.party.cohort), else None: it works alone.
        self.cohort: RoundCohort | None = None

    def check_run_config(self, cfg: TrainConfig) -> None:
        """Refuse ``cfg``, a message's run config, unless it is the one this client was set up
        with (a client rebuilt from a message takes that message's config).

        Raises:
            PolicyError: another run config after setup, naming both digests.
        """
        if self.run_config is None:
            return
        got = P.client_config_digest(cfg)
        if got != self.run_config:
            raise PolicyError(
                f"client {self.id}",
                "run config",
                f"this message's ({got}) is not the one bound at setup ({self.run_config}); a "
                "server handing one client another learning rate, seed or clip mid-run could "
                "single out another's update",
            )

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
        """Which layer's per-stage settings (``lr``, ``weight-decay``, ``local-epochs``) a round uses."""

    @abstractmethod
    def seed_tags(self, round_: int) -> tuple[int, ...]:
        """The integers (after the run seed) that seed ``round_``'s dropout on this client."""

    @property
    @abstractmethod
    def seed_stage(self) -> int:
        """The stage number that seeds this client's update rounding and boundary codecs."""

    @property
    def round_trial(self) -> int:
        """Which training of the stage the rounds belong to: 0, or 1 for ``first-stage auto``'s
        second stage 0 (its rounds count from 1 again; the journal orders rounds by stage, trial
        and round)."""
        return 0

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

    def drop_round_gradients(self) -> None:
        """Forget what this round's training found for peers (eager's halo gradients): a round
        that diverged sends none. Lazy: nothing to forget."""

    def step_budget(self) -> tuple[int, float | None]:
        """``(steps, deadline)`` of one round's local training (a deadline: time-based rounds)."""
        return int(self.cfg.per_stage("local_epochs", self.layer_index())), None

    def weight_decay(self) -> float:
        """The L2 weight decay of this round's local steps: this layer's ``weight-decay``."""
        return float(self.cfg.per_stage("weight_decay", self.layer_index()))

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

    def optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer | PlainSGD:
        """The local optimizer the run config names, at this layer's learning rate and weight
        decay: plain SGD (the default) as :class:`~retexo_fl.party.plain_sgd.PlainSGD`, the same
        steps without ``torch.optim``'s import of ``torch._dynamo`` (seconds in a fresh process)."""
        cfg = self.cfg
        lr = float(cfg.per_stage("lr", self.layer_index()))
        decay = self.weight_decay()
        if cfg.optimizer == "adam":
            return torch.optim.Adam(model.parameters(), lr=lr, weight_decay=decay)
        if cfg.momentum == 0:
            return PlainSGD(model.parameters(), lr=lr, weight_decay=decay)
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=cfg.momentum, weight_decay=decay)

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
        model.train()
        steps, deadline = self.step_budget()
        with dropout_stream(derive_seed(self.cfg.seed, *self.seed_tags(round_)), self.device):
            first, taken = self.run_steps(model, opt, rows, labels, correction, steps, deadline)
        # A copy: the module is reused next round and would overwrite these tensors in place.
        new = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        # The round's one read of a loss (the first step's), after the last step was queued.
        return self.checked_round(new, float(first) if first is not None else 0.0, taken, round_)

    def checked_round(self, new: StateDict, loss: float, taken: int, round_: int) -> tuple[StateDict, float]:
        """A round's result, ``(new, loss)`` after ``taken`` steps, once its values are checked.

        Raises:
            TrainingDiverged: a weight or the loss is NaN or Inf, naming this client and round.
        """
        self.last_steps = taken
        weights = [v.isfinite().all() for v in new.values() if v.is_floating_point()]
        # A client with no training rows has no loss to speak of (the mean of nothing): its
        # weights, which its steps leave as they were, are what is checked.
        bad_loss = self.num_train > 0 and not math.isfinite(loss)
        if bad_loss or (weights and not bool(torch.stack(weights).all())):
            lr = float(self.cfg.per_stage("lr", self.layer_index()))
            raise TrainingDiverged(
                f"client {self.id}, stage {self.message_stage}, round {round_}: local training "
                f"diverged (NaN or Inf after {taken} step(s) at learning rate {lr:g}); inputs of "
                "large magnitude do this: scale the node features to about unit size, or lower --lr"
            )
        return new, loss

    def run_steps(
        self,
        model: torch.nn.Module,
        opt: torch.optim.Optimizer | PlainSGD,
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
