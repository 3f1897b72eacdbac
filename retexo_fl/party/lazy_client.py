"""One party of lazy (RETEXO) training: one stage at a time over frozen inputs."""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from retexo_fl import protocol as P
from retexo_fl.compress.boundary import ExchangeStats
from retexo_fl.compress.payload import decode_rows
from retexo_fl.config import FIRST_STAGE_VARIANTS, SPRINT, TrainConfig
from retexo_fl.data.partition import Partition
from retexo_fl.models.adjacency import SPARSE_KINDS, is_sparse, sparse_adjacency
from retexo_fl.models.factory import build_stage_model, stage_model_spec
from retexo_fl.models.stage import StageModel, select_in_edges
from retexo_fl.party.client import Client
from retexo_fl.party.pseudo import pseudo_labels
from retexo_fl.party.state import ClientState
from retexo_fl.protocol import HALO
from retexo_fl.records import EvalResult, StateDict
from retexo_fl.secure.boundary_noise import release_rows
from retexo_fl.secure.policy import PartyPolicy
from retexo_fl.seeding import derive_seed, dropout_generator

log = logging.getLogger(__name__)

#: Stage modules kept per thread, one per architecture and device (LazyClient.make_model).
_SHARED_MODELS_KEPT = 8
_thread_models = threading.local()


def _shared_models() -> OrderedDict[tuple, StageModel]:
    models = getattr(_thread_models, "models", None)
    if models is None:
        models = _thread_models.models = OrderedDict()
    return models


def _versions(state: StateDict, model: torch.nn.Module) -> tuple[int, ...]:
    """The version counters of ``state``'s tensors and ``model``'s parameters and buffers: any
    in-place change to one (a load, an optimizer step) moves its counter."""
    tensors = [*state.values(), *model.parameters(), *model.buffers()]
    return tuple(t._version for t in tensors)


#: Seed tag of a client's boundary-row rounding.
BOUNDARY_TAG = 0xB0


@dataclass(eq=False)
class StepPlan:
    """What a conv stage's local steps read, built once (:meth:`LazyClient.prepare_steps`): the
    graph restricted to the training rows' in-edges, whole or per chunk of ``chunk`` rows.

    It is built for the graph ``(ei, w)``, the ``rows`` and ``labels`` tensors, the chunk size
    and the stage input's row count, and :meth:`matches` them by identity: a new stage input,
    graph or row set (self-training replaces masks and labels) builds a new plan. An evaluation's
    rows (:meth:`LazyClient.rows_graph`) get one too, without labels.
    """

    ei: Tensor
    w: Tensor | None
    rows: Tensor
    labels: Tensor | None
    chunk: int
    num_nodes: int
    #: ``(rows, restricted graph)``: the training rows in one piece.
    whole: tuple[Tensor, tuple[Tensor, Tensor | None]] | None = None
    #: ``(rows, labels, restricted graph)`` per chunk of ``chunk`` rows.
    chunks: list[tuple[Tensor, Tensor, tuple[Tensor, Tensor | None]]] = field(default_factory=list)

    def matches(
        self, ei: Tensor, w: Tensor | None, rows: Tensor, labels: Tensor | None, chunk: int, num_nodes: int
    ) -> bool:
        """Whether this plan was built for these (the tensors compared by identity)."""
        return (
            self.ei is ei
            and self.w is w
            and self.rows is rows
            and self.labels is labels
            and self.chunk == chunk
            and self.num_nodes == num_nodes
        )


#: Rows at least, before a client's features are called node identities (fewer say little).
IDENTITY_MIN_ROWS = 8

_identity_warned = False
_identity_lock = threading.Lock()  # in process, clients may be built on threads (map_partitions)


#: The largest factor ``gnn-input-rms-floor`` scales a stage's input by. Trained embeddings have a
#: root mean square of 0.1-1 (Twitch TW's 0.12 takes a factor of about 2 at the default floor).
MAX_INPUT_SCALE = 100.0


def identity_like(x: Tensor) -> bool:
    """Whether ``x``'s rows are one-hot and no two share their column: node identities (a
    featureless graph's usual stand-in) or a category each node has alone.

    An MLP stage 0 learns nothing from such features for a node without a label: the weights
    of its column never receive a gradient. A GNN learns them through the node's labelled
    neighbours, end to end; lazy's stage 0 can only if it aggregates (``--first-stage local``).

    Args:
        x (Tensor): ``[n, F]`` features.
    """
    if x.dim() != 2 or x.shape[0] < IDENTITY_MIN_ROWS or x.shape[1] < x.shape[0]:
        return False
    nonzero = x != 0
    if not bool((nonzero.sum(dim=1) == 1).all()) or not bool((x[nonzero] == 1).all()):
        return False
    columns = nonzero.to(torch.uint8).argmax(dim=1)
    return int(torch.unique(columns).numel()) == x.shape[0]


def _warn_identity_features(client: int) -> None:
    global _identity_warned
    with _identity_lock:
        if _identity_warned:  # once a process: an in-process run's clients would each say it
            return
        _identity_warned = True
    log.warning(
        "client %d: the features are one-hot node identities (or a category no two nodes "
        "share); an MLP stage 0 learns nothing from them for unlabelled nodes. --first-stage "
        "local aggregates over a client's own edges instead (on the USA airports graph, whose "
        "features are identities, it lifted lazy from 6.7-7.3 points below the centralized GCN "
        "to between 3.2 below and 1.1 above it; bench/README.md)",
        client,
    )


def own_edges(edge_index: Tensor, num_owned: int) -> Tensor:
    """The edges among a client's own nodes: those from an owned row (halo rows are numbered
    after the owned ones, and no edge goes into a halo row).

    Shapes:
        - **input:** ``[2, E]``
        - **output:** ``[2, E_own]``
    """
    return edge_index[:, edge_index[0] < num_owned]


def own_gcn_edges(edge_index: Tensor, num_owned: int) -> tuple[Tensor, Tensor]:
    """:func:`own_edges` with self loops and GCN weights from the degrees inside the client, as
    PyG's ``gcn_norm`` on the client's induced subgraph: a node with no neighbour on its client
    keeps its own row whole.

    Shapes:
        - **input:** ``[2, E]``
        - **output:** ``[2, E_own + num_owned]`` edges and their ``[E_own + num_owned]`` weights
    """
    loops = torch.arange(num_owned).repeat(2, 1)
    ei = torch.cat([own_edges(edge_index, num_owned), loops], dim=1)
    inv_sqrt = torch.bincount(ei[1], minlength=num_owned).float().pow(-0.5)  # own degree + 1
    return ei, inv_sqrt[ei[0]] * inv_sqrt[ei[1]]


class LazyClient(Client):
    """A client of lazy (RETEXO) training, independent of any transport.

    Per stage the engine has it train and validate for each round, then :meth:`next_stage`
    computes the stage's embeddings (or, at the end of a self-training pass, relabels) and
    :meth:`encode_boundary` seals the rows peers need; :meth:`receive_deliveries` takes what
    peers sent. GCN also needs halo degrees once (:meth:`degree_frames` / :meth:`receive_degrees`).

    Args:
        part (Partition): this client's validated partition.
        cfg (TrainConfig): the run configuration.
        policy (PartyPolicy, optional): this party's own security policy (see :class:`Client`).
            (default: :obj:`None`)
    """

    def __init__(self, part: Partition, cfg: TrainConfig, policy: PartyPolicy | None = None) -> None:
        self._raw: Tensor | None = None
        super().__init__(part, cfg, policy)
        self.stage = 0
        self.owned = self.raw_features()
        self.halo: Tensor | None = None
        # (stage input, aggregated): precompute's, the last two (stage 0's lanes alternate)
        self._aggregated: list[tuple[Tensor, Tensor]] = []
        self._joined: tuple[Tensor, Tensor, Tensor] | None = None
        self._own_graph: tuple[Tensor, Tensor | None] | None = None  # a local stage 0's messages
        # a local stage 0's input by hops (local-hops, the sprint's): (raw rows, propagated)
        self._propagated: dict[int, tuple[Tensor, Tensor]] = {}
        # What a layer-0 stage is (mlp, local; sprint in its lane); under auto each message names it.
        self.first_stage: str | None = None if cfg.first_stage == "auto" else cfg.first_stage
        # A conv stage's steps: per row set (the training rows, or each chunk of them), the graph
        # restricted to its in-edges, with the labels of the rows; built by prepare_steps().
        self._step_plan: StepPlan | None = None
        # The same for another row set, read without gradients (the validation rows, every
        # round): its restricted graph, built by rows_graph().
        self._rows_plan: StepPlan | None = None
        # (stage, frames, stats, test) of the last boundary rows sent, with the test of the state
        # they were computed with when the embed asked for it: a resumed server may ask again.
        self.sent: tuple[int, dict[int, bytes], dict, EvalResult | None] | None = None
        # Self-training: the logits, on this client's nodes, of the stage the server named the
        # best-validating so far (keep_teacher); a pass's end labels from them.
        self.teacher: Tensor | None = None

    @property
    def layer(self) -> int:
        """The layer of the stack this stage trains (0: the MLP on raw features)."""
        return self.cfg.layer(self.stage)

    @property
    def row_wise(self) -> bool:
        """Whether this stage reads each node's own row alone: stage 0's MLP. A ``local`` stage 0
        passes messages over the client's own edges (see :meth:`stage_input`)."""
        return self.layer == 0 and self.first_stage_kind() == "mlp"

    def step_budget(self) -> tuple[int, float | None]:
        """A round's local steps: ``mlp-local-epochs`` for a layer-0 MLP stage when set, else the
        stage's ``local-epochs``."""
        if self.row_wise and self.cfg.mlp_local_epochs > 0:
            return self.cfg.mlp_local_epochs, None
        return super().step_budget()

    def weight_decay(self) -> float:
        """A round's weight decay: ``mlp-weight-decay`` for a layer-0 MLP stage when set, else the
        layer's ``weight-decay``."""
        if self.row_wise and self.cfg.mlp_weight_decay > 0:
            return self.cfg.mlp_weight_decay
        return super().weight_decay()

    def first_stage_kind(self) -> str:
        """What this client's layer-0 stages are: ``mlp`` or ``local`` (or, in a lane of stage
        0's messages or its evaluation, ``sprint``: the local layer over its own hops).

        Raises:
            RuntimeError: ``first-stage auto`` and no message has named the variant yet.
        """
        if self.first_stage is None:
            raise RuntimeError(
                f"client {self.id}: first-stage auto, and no message named stage 0's variant "
                f"({P.FIRST_STAGE})"
            )
        return self.first_stage

    def set_first_stage(self, variant: object, lane: bool = False) -> None:
        """Take the layer-0 variant a message names (:data:`~retexo_fl.protocol.FIRST_STAGE`).

        Either variant reads only this client's own features and edges, so the coordinator's
        choice changes no residency property; a run whose config fixes the variant refuses any
        other.

        ``lane``: the message is one lane of several (:data:`~retexo_fl.protocol.LANES`: stage 0
        trained as both variants in the same rounds; only
        :func:`~retexo_fl.party.handlers.lane_requests`'s checks let one through). From the
        first such message until this client moves on from the stage, every message naming a
        variant works on that variant's round state
        (:meth:`~retexo_fl.party.model_exchange.ModelExchange.switch_lane`).

        Raises:
            ValueError: not a variant, or one the run config does not allow.
        """
        allowed = self.cfg.first_stage_lanes if self.cfg.first_stage == "auto" else FIRST_STAGE_VARIANTS
        if variant not in allowed:
            raise ValueError(
                f"client {self.id}: {P.FIRST_STAGE} {str(variant)[:40]!r} is not one of {', '.join(allowed)}"
            )
        if self.cfg.first_stage not in ("auto", variant):
            raise ValueError(
                f"client {self.id}: {P.FIRST_STAGE} {variant} in a run whose first-stage is "
                f"{self.cfg.first_stage}"
            )
        self.first_stage = str(variant)
        if lane or self.lane is not None:
            self.switch_lane(self.first_stage)

    @property
    def seed_stage(self) -> int:
        return self.stage

    @property
    def round_trial(self) -> int:
        # first-stage auto trains stage 0 as each variant, in the run config's order
        if self.cfg.first_stage != "auto" or self.layer != 0 or self.first_stage is None:
            return 0
        return self.cfg.first_stage_lanes.index(self.first_stage)

    def layer_index(self) -> int:
        return self.layer

    def seed_tags(self, round_: int) -> tuple[int, ...]:
        return (self.stage, round_, self.id)

    def raw_features(self) -> Tensor:
        """The partition's features as float32 on the device, ``[n, F]`` (read once)."""
        if self._raw is None:
            self._raw = torch.from_numpy(np.array(self.part.x, dtype=np.float32)).to(self.device)
            if self.cfg.first_stage == "mlp" and identity_like(self._raw):
                _warn_identity_features(self.id)
        return self._raw

    # -- stage inputs -----------------------------------------------------------------------
    def stage_input(self) -> Tensor:
        """What this stage's model reads: owned rows, and halo rows after them for a conv stage,
        the two scaled by :meth:`input_scale`."""
        if self.layer == 0:  # the MLP, or a local stage 0 over owned rows (see edges())
            if self.row_wise or self.local_hops() <= 1:
                return self.owned
            return self.propagated_input()
        if self.halo is None:
            raise RuntimeError(f"client {self.id}: stage {self.stage} has no halo rows yet")
        # Joined once per stage input, not per step: on a products-sized client (300,000 owned
        # and about as many halo rows) the copy cost as much as a row-restricted step.
        cached = self._joined
        if cached is not None and cached[0] is self.owned and cached[1] is self.halo:
            return cached[2]
        joined = torch.cat([self.owned, self.halo])
        scale = self.input_scale()
        if scale != 1.0:
            joined = joined * scale
        self._joined = (self.owned, self.halo, joined)
        return joined

    def local_hops(self) -> int:
        """The hops of its own subgraph a local stage 0 reads: ``first-stage-sprint-hops`` for
        the sprint's lane (:data:`~retexo_fl.config.SPRINT`), else ``local-hops``."""
        return self.cfg.first_stage_sprint_hops if self.first_stage == SPRINT else self.cfg.local_hops

    def propagated_input(self) -> Tensor:
        r"""A local stage 0's input: the raw features propagated :meth:`local_hops` less one
        times over the client's own edges, :math:`\hat{A}_{\mathrm{own}}^{k-1} X`, once per stage
        input and hop count.

        :math:`\hat{A}_{\mathrm{own}}` is the GCN-normalized adjacency of the subgraph the
        client's own nodes induce, self loops included (a GCN stage 0's own messages,
        :meth:`own_graph`), so a GCN stage 0 computes :math:`\hat{A}_{\mathrm{own}}^{k} X W`: SGC's
        propagation over what the client holds. No halo row is read and nothing is sent.

        Shapes:
            - **output:** ``[num_owned, F]``
        """
        hops = self.local_hops()
        cached = self._propagated.get(hops)
        if cached is not None and cached[0] is self.owned:
            return cached[1]
        adj = self.own_adjacency()
        x = self.owned
        for _ in range(hops - 1):
            x = torch.sparse.mm(adj, x)
        self._propagated = {h: c for h, c in self._propagated.items() if c[0] is self.owned}
        self._propagated[hops] = (self.owned, x)
        return x

    def own_adjacency(self) -> Tensor:
        """The GCN-normalized CSR adjacency of the client's own subgraph, self loops included
        (:meth:`own_graph`'s for a GCN stage 0, whatever the run's model)."""
        if self.cfg.model == "gcn":  # the same matrix, built once (GCN's is a CSR adjacency)
            return self.own_graph()[0]
        n = self.graph.num_owned
        ei, w = own_gcn_edges(self.graph.edge_index, n)
        return sparse_adjacency(ei.to(self.device), w.to(self.device), n, n)

    def input_scale(self) -> float:
        """The factor a GNN stage's input is scaled by here: up to ``gnn-input-rms-floor``.

        On Twitch TW the stage-0 embeddings' root mean square is about 0.12 (Cora's 0.9): a GCN
        stage's SGD steps on them are as small, and it stays at the majority class for its first
        rounds. One factor for the client's own and halo rows, read off its own rows alone (1 when
        they are at the floor or above, or all zero).
        """
        floor = self.cfg.gnn_input_rms_floor
        if floor <= 0 or self.layer == 0 or not self.owned.numel():
            return 1.0
        rms = float(self.owned.float().pow(2).mean().sqrt())
        # At most MAX_INPUT_SCALE: a stage-0 state could make the own rows' rms tiny, and the
        # factor, multiplying every row and gradient, would be the server's to set.
        return min(floor / rms, MAX_INPUT_SCALE) if 1e-12 < rms < floor else 1.0

    def edges(self) -> tuple[Tensor | None, Tensor | None]:
        """What a conv stage's layer reads (:meth:`~Client.message_graph`: GCN and SAGE a CSR
        adjacency, other kinds edges and weights); ``(None, None)`` at layer 0."""
        if self.row_wise:
            return None, None
        if self.layer == 0:
            return self.own_graph()
        return self.message_graph()

    def own_graph(self) -> tuple[Tensor, Tensor | None]:
        """A local stage 0's messages: the client's own edges only (no edge from a halo row), so
        no other client's row is read.

        GCN normalizes by the degrees within the client, as PyG's ``gcn_norm`` on the client's
        induced subgraph: a node with no neighbour on its client keeps its own row whole (the
        MLP), where global degrees would shrink it by ``1 / (degree + 1)`` and give rows of
        very different scales on a partition that cuts most edges.

        Shapes:
            - **output:** CSR ``[n, n]`` and ``None`` (GCN, SAGE), or ``[2, E_own]`` edges and
              ``[E_own]`` GCN weights (``None`` for other kinds)
        """
        if self._own_graph is None:
            n = self.graph.num_owned
            if self.cfg.model == "gcn":
                ei, w = own_gcn_edges(self.graph.edge_index, n)
            else:
                ei, w = own_edges(self.graph.edge_index, n), None
            ei = ei.to(self.device)
            w = None if w is None else w.to(self.device)
            if self.cfg.model in SPARSE_KINDS:
                self._own_graph = (sparse_adjacency(ei, w, n, n), None)
            else:
                self._own_graph = (ei, w)
        return self._own_graph

    def make_model(self) -> StageModel:
        """This stage's model with its initial weights."""
        in_dim = self.owned.shape[1]
        variant = self.first_stage_kind() if self.layer == 0 else None
        return build_stage_model(self.cfg, self.stage, in_dim, self.part.num_classes, variant).to(self.device)

    def loaded_model(self, state: StateDict) -> torch.nn.Module:
        """A module of this stage's architecture holding ``state``, shared with the other clients
        of this thread.

        Every use loads a whole state into it first and sets its mode (``train()`` / ``eval()``),
        dropout is seeded per round, what leaves a client is a copy, and a thread runs one
        client's message at a time: sharing changes no result. At one node a client it saves a
        module per client: Cora's 2,708 clients peaked at 652 MB instead of 1,129 MB.
        """
        in_dim = self.owned.shape[1]
        variant = self.first_stage_kind() if self.layer == 0 else None
        spec = stage_model_spec(self.cfg, self.stage, in_dim, self.part.num_classes, variant)
        key = (*spec, str(self.device))
        models = _shared_models()
        model = models.get(key)
        if model is None:
            model = models[key] = self.make_model()
            while len(models) > _SHARED_MODELS_KEPT:
                models.popitem(last=False)
        models.move_to_end(key)
        # A round's validators load the same broadcast state one after another: a model that
        # holds it already is not loaded again. "Already" means the same dict, the same tensors
        # in it (a dict given a new tensor under a key is the same dict, and a fresh tensor's
        # version counter may equal the old one's) and no in-place change since to them or to
        # the model (a load, an optimizer step), which the version counters show.
        loaded = getattr(model, "_retexo_loaded", None)
        tensors = tuple(state.values())
        if (
            loaded is None
            or loaded[0] is not state
            or len(loaded[1]) != len(tensors)
            or any(a is not b for a, b in zip(loaded[1], tensors, strict=True))
            or loaded[2] != _versions(state, model)
        ):
            model.load_state_dict(state)
            model._retexo_loaded = (state, tensors, _versions(state, model))
        return model

    def model_key(self) -> object:
        # first-stage auto trains stage 0 twice, as two architectures
        return (self.stage, self.first_stage if self.layer == 0 else None)

    def train(
        self, state: StateDict, round_: int, control: StateDict | None = None
    ) -> tuple[StateDict, float]:
        """:meth:`Client.train`, or this client's result from the round's cohort (the same steps,
        computed with the other members': :mod:`retexo_fl.party.cohort`)."""
        shared = (
            self.cohort.trained(self, state, round_) if self.cohort is not None and control is None else None
        )
        if shared is None:
            return super().train(state, round_, control)
        new, loss, taken = shared
        return self.checked_round(new, loss, taken, round_)

    def precomputes(self, model: torch.nn.Module) -> bool:
        """Whether ``model``'s stage runs on inputs aggregated once (``--precompute``, GCN and
        mean-SAGE) instead of passing messages."""
        return self.cfg.precompute and isinstance(model, StageModel) and model.aggregates_linearly

    def outputs(self, model: torch.nn.Module, rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``(hidden, logits)`` of the owned nodes, or only of those at int64 indices ``rows``.

        Stage 0 is row-wise, so it runs on the selected rows alone. A conv stage passes messages
        along the selected rows' in-edges only (a round's loss reads the training rows, often a
        tenth of them), with the dropout masks of the whole computation, so the rows are those
        of all rows sliced. Without gradients and with ``chunk-rows``, the rows are computed that
        many at a time: a conv stage's messages, one per edge into the rows, are what dominates
        a client's memory.

        The graph restricted to ``rows``' in-edges is the one :meth:`prepare_steps` built when
        ``rows`` is the tensor it was given (a local step: no size is read off the device);
        other row sets restrict the graph here.
        """
        if self.row_wise:
            hidden, logits = model(self.owned if rows is None else self.owned.index_select(0, rows))
            return hidden, logits
        if self.precomputes(model):
            # All owned rows, then sliced, like message passing: the same dropout masks. The root
            # term reads the owned rows as scaled as the aggregated ones (input_scale).
            root = self.stage_input()[: self.graph.num_owned]
            hidden, logits = model.forward_aggregated(self.aggregated_input(), root)
            if rows is None:
                return hidden, logits
            return hidden.index_select(0, rows), logits.index_select(0, rows)
        ei, w = self.edges()
        n = self.graph.num_owned
        x = self.stage_input()
        plan = self._step_plan
        if rows is not None and plan is not None and plan.whole is not None and plan.whole[0] is rows:
            return model(x, *plan.whole[1], num_targets=n, rows=rows, restricted=True)
        chunk = self.cfg.chunk_rows if not torch.is_grad_enabled() else 0
        if rows is None and not 0 < chunk < n:
            return model(x, ei, w, num_targets=n)
        if rows is not None and not 0 < chunk < rows.numel():
            return model(
                x, *self.rows_graph(ei, w, rows, x.shape[0]), num_targets=n, rows=rows, restricted=True
            )
        # Here 0 < chunk < the rows' count: two pieces or more.
        index = torch.arange(n, device=self.device) if rows is None else rows
        pieces = [
            model(x, ei, w, num_targets=n, rows=index[start : start + chunk])
            for start in range(0, index.numel(), chunk)
        ]
        return torch.cat([h for h, _ in pieces]), torch.cat([z for _, z in pieces])

    def rows_graph(
        self, ei: Tensor, w: Tensor | None, rows: Tensor, num_nodes: int
    ) -> tuple[Tensor, Tensor | None]:
        """The in-edges of ``rows`` (:func:`~retexo_fl.models.stage.select_in_edges`), kept while
        the graph, its weights, the input's row count and the rows tensor stay: a round's
        validation restricted the same graph to the same rows again (2% of a Twitch PTBR run)."""
        plan = self._rows_plan
        if plan is None or plan.whole is None or not plan.matches(ei, w, rows, None, 0, num_nodes):
            plan = StepPlan(ei, w, rows, None, 0, num_nodes)
            plan.whole = (rows, select_in_edges(ei, w, rows, num_nodes))
            self._rows_plan = plan
        return plan.whole[1]

    def prepare_steps(self, model: torch.nn.Module, rows: Tensor, labels: Tensor) -> None:
        """A conv stage passing messages: restrict its graph to the in-edges of the training rows
        (with ``chunk-rows``, of each chunk of them), once per stage input and row set; one
        aggregating its inputs once (``precompute``): aggregate them.

        Restricting reads the restricted graph's size off the device; done in every step, that
        read made each step wait for the device. The plan is kept while the graph, the stage
        input's row count, the rows and the chunk size stay (a new stage, a relabel or a restore
        builds a new one).
        """
        if self.row_wise:
            return
        if self.precomputes(model):
            self.aggregated_input()  # the stage's dense input, aggregated once
            return
        ei, w = self.edges()
        chunk = self.cfg.chunk_rows
        num_nodes = self.stage_input().shape[0]  # the rows messages come from (halo ones too)
        plan = self._step_plan
        if plan is not None and plan.matches(ei, w, rows, labels, chunk, num_nodes):
            return
        plan = StepPlan(ei, w, rows, labels, chunk, num_nodes)
        if 0 < chunk < rows.numel():
            for lo in range(0, rows.numel(), chunk):
                piece = rows[lo : lo + chunk]
                plan.chunks.append((piece, labels[lo : lo + chunk], select_in_edges(ei, w, piece, num_nodes)))
        else:
            plan.whole = (rows, select_in_edges(ei, w, rows, num_nodes))
        self._step_plan = plan

    def step_graph(self, model: torch.nn.Module, rows: Tensor, labels: Tensor) -> Tensor:
        """A conv stage's training rows' in-edges as a CSR matrix over :meth:`stage_input` (what
        its local steps read, built once by :meth:`prepare_steps`; GCN and SAGE, no chunks).

        Raises:
            RuntimeError: a stage whose steps read another graph.
        """
        self.prepare_steps(model, rows, labels)
        plan = self._step_plan
        if plan is None or plan.whole is None or not is_sparse(plan.whole[1][0]):
            raise RuntimeError(f"client {self.id}: stage {self.stage} steps over no row-restricted CSR graph")
        return plan.whole[1][0]

    def step_gradients(self, model: torch.nn.Module, rows: Tensor, labels: Tensor, step: int) -> Tensor:
        """A local step's gradients; on a conv stage with ``chunk-rows``, that many training rows
        at a time.

        Each chunk's graph is freed by its backward pass, so a step holds one chunk's per-edge
        tensors, not every training row's (after self-training, most of a partition's rows). The
        random state is replayed for every chunk: each draws the whole step's dropout masks and
        uses its rows' (see :meth:`StageModel.forward`), so the summed gradient is the whole
        step's, to float rounding. The chunks, their labels and restricted graphs are
        :meth:`prepare_steps`'s; the loss is summed on the device, in float64 as the host
        summed it before.
        """
        plan = self._step_plan
        chunked = plan is not None and bool(plan.chunks) and plan.rows is rows
        if self.row_wise or self.precomputes(model) or not chunked:
            return super().step_gradients(model, rows, labels, step)
        assert plan is not None  # chunked
        x, n, count = self.stage_input(), self.graph.num_owned, rows.numel()
        generator = dropout_generator(self.device)
        start = generator.get_state()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for piece, piece_labels, (ei, w) in plan.chunks:
            generator.set_state(start)
            _, logits = model(x, ei, w, num_targets=n, rows=piece, restricted=True)
            part = torch.nn.functional.cross_entropy(logits, piece_labels, reduction="sum")
            part = part / count
            part.backward()
            total += part.detach().double()
        return total

    def aggregated_input(self) -> Tensor:
        r"""The stage input aggregated over each owned node's in-edges, once per stage input.

        GCN: :math:`\hat{A} X` with the global-degree weights (self loops included); SAGE: the
        mean of the in-neighbours' rows (zero without any). Owned and halo rows are frozen for
        the stage, so this is computed once and every round is a dense step.

        Shapes:
            - **output:** ``[num_owned, d]``
        """
        # Keyed by the stage input itself (one tensor per stage input, see stage_input): at
        # stage 0 the local layer's and the sprint's lanes read inputs of different hops.
        x = self.stage_input()
        for source, total in self._aggregated:
            if source is x:
                return total
        adj, _ = self.edges()  # GCN and SAGE: the CSR adjacency, weights folded in
        total = torch.sparse.mm(adj, x)
        if self.cfg.model == "sage":  # mean aggregation (a node without in-neighbours: zero)
            ptr = adj.crow_indices()
            total = total / (ptr[1:] - ptr[:-1]).clamp(min=1).to(x.dtype).unsqueeze(1)
        # The tensor it was computed from is kept with it: a new stage input is a new tensor.
        self._aggregated = [*self._aggregated[-1:], (x, total)]
        return total

    def forward(self, model: torch.nn.Module, rows: Tensor | None = None) -> Tensor:
        return self.outputs(model, rows)[1]

    # -- between stages ---------------------------------------------------------------------
    @torch.no_grad()
    def embeddings(self, state: StateDict) -> Tensor:
        """This stage's output for every owned node, ``[n, d]``: what the next stage consumes."""
        model = self.loaded_model(state)
        model.eval()
        hidden, logits = self.outputs(model)
        return (hidden if self.cfg.pass_embedding == "hidden" else logits).float().cpu()

    def advance(self, embeddings: Tensor) -> dict[int, Tensor]:
        """Make ``embeddings`` the owned input of the next stage; return the rows peers need."""
        embeddings = self.bounded(embeddings)
        outgoing = self.plan.rows_for(self.released(embeddings))  # refused: nothing changed
        self.stage += 1
        self.halo = None
        clip = self.cfg.boundary_clip
        # Own rows are clipped like the released ones, so that a conv stage mixes rows of one
        # scale; only what leaves is noised.
        self.owned = (release_rows(embeddings, clip, 0.0) if clip > 0 else embeddings).to(self.device)
        return outgoing

    def next_stage(self, state: StateDict) -> dict[int, Tensor]:
        """Move on from this stage, trained to ``state``; return the boundary rows peers need.

        Within a pass that is :meth:`advance` with this stage's embeddings. After a pass's last
        stage it is :meth:`relabel`, and nothing crosses: the next stage reads raw features.
        """
        self.drop_lanes()
        # The sprint's input is not read again (a later pass's stage 0 is the kept variant), nor
        # is this stage's aggregated input (precompute).
        self._propagated = {h: c for h, c in self._propagated.items() if h == self.cfg.local_hops}
        self._aggregated = []
        if self.cfg.ends_pass(self.stage):
            self.relabel(state)
            return {}
        return self.advance(self.embeddings(state))

    @torch.no_grad()
    def predict(self, state: StateDict) -> Tensor:
        """Logits of ``state`` (this stage's model) on every owned node, ``[n, C]``."""
        model = self.loaded_model(state)
        model.eval()
        return self.forward(model)

    def keep_teacher(self, state: StateDict) -> None:
        """Keep ``state``'s predictions as the next relabelling's teacher.

        The server names a stage the best-validating so far (:data:`~retexo_fl.protocol.TEACHER`)
        in its embed, while this client still holds the stage's inputs. A pass's last stage can
        validate worse than an earlier one (a GCN stage on a graph whose neighbours say little
        about a node); its labels would train the next pass to repeat its errors on the unlabeled
        nodes, test nodes included, while validation nodes, never labeled, would not show it.
        """
        self.teacher = self.predict(state)

    @torch.no_grad()
    def relabel(self, state: StateDict) -> int:
        """End a self-training pass: label confident predictions, restart at layer 0.

        The predictions are the teacher's (:meth:`keep_teacher`), else ``state``'s (the pass's
        last stage: a server that names no teacher).

        Returns:
            int: how many nodes the next pass trains on.
        """
        logits = self.teacher if self.teacher is not None else self.predict(state)
        self.train_y, self.masks["train"] = pseudo_labels(
            logits,
            self.y,
            self.given_train,
            self.masks["val"],
            self.cfg.pseudo_threshold,
            self.cfg.pseudo_per_class,
        )
        self.stage += 1
        self.owned, self.halo = self.raw_features(), None
        return self.num_train

    def receive_halo(self, incoming: dict[int, Tensor]) -> None:
        """Assemble the next stage's halo rows from peers' blocks (``{peer: [k, d]}``)."""
        dim = self.owned.shape[1]
        blocks = self.complete_halo(incoming, dim, self.halo, HALO, self.stage)
        self.halo = self.plan.assemble_halo(blocks, dim).to(self.device)

    def encode_boundary(self, rows: dict[int, Tensor]) -> tuple[dict[int, bytes], ExchangeStats]:
        """Sealed frames of the rows :meth:`advance` returned, compressed as the run config says."""
        if not rows:
            return {}, ExchangeStats()
        exchange = self.layer - 1
        weights = self.boundary_weights() if self.cfg.bit_policy != "fixed" else None
        gen = torch.Generator().manual_seed(derive_seed(self.cfg.seed, self.stage, BOUNDARY_TAG, self.id))
        frames, stats = self.encoder.encode(self.id, rows, weights, exchange, self.cfg.stages - 1, gen)
        return self.channel.seal(frames, HALO, self.stage), stats

    def decode_boundary(self, frames: dict[int, bytes]) -> dict[int, Tensor]:
        """Peer frames -> row blocks, each checked against this client's boundary plan."""
        frames, _ = self.channel.open(frames, HALO, self.stage)
        dim = self.owned.shape[1]
        return {p: decode_rows(blob, f"client {p}", self.expected_rows(p), dim) for p, blob in frames.items()}

    def receive_deliveries(self, frames: dict[int, bytes]) -> None:
        """The rows peers sent for this stage (delivered with its first round, also when empty)."""
        self.receive_halo(self.decode_boundary(frames))

    # -- node-local state -------------------------------------------------------------------
    def snapshot(self) -> ClientState:
        state = super().snapshot()
        state.stage = self.stage
        # Layer 0 reads the raw features: they stay in the partition, not in a second file.
        state.owned = None if self.layer == 0 else self.owned.cpu()
        state.halo = None if self.halo is None else self.halo.cpu()
        if self.sent is None:
            state.sent = None
        else:
            stage, frames, stats, tested = self.sent
            test = None if tested is None else [tested.correct, tested.count, tested.loss_sum]
            state.sent = [stage, frames, json.dumps(stats), test]
        if self.train_y is not self.y:  # self-training labels: node-local, kept for later messages
            state.pseudo_labels, state.pseudo_mask = self.train_y.cpu(), self.masks["train"].cpu()
        state.teacher = None if self.teacher is None else self.teacher.cpu()
        return state

    def load_snapshot(self, state: ClientState) -> None:
        super().load_snapshot(state)
        self.stage = int(state.stage)
        self.owned = self.raw_features() if state.owned is None else state.owned.to(self.device)
        self.halo = None if state.halo is None else state.halo.to(self.device)
        sent = state.sent
        if sent is None:
            self.sent = None
        else:  # a state of an earlier version holds no test
            test = sent[3] if len(sent) > 3 else None
            tested = None if test is None else EvalResult(int(test[0]), int(test[1]), float(test[2]))
            self.sent = (int(sent[0]), dict(sent[1]), json.loads(sent[2]), tested)
        if state.pseudo_labels is None or state.pseudo_mask is None:
            self.train_y, self.masks["train"] = self.y, self.given_train
        else:
            self.train_y = state.pseudo_labels.to(self.device)
            self.masks["train"] = state.pseudo_mask.to(self.device)
        self.teacher = None if state.teacher is None else state.teacher.to(self.device)
