"""Run configuration shared by the CLI, the in-process engines and the Flower apps.

:class:`TrainConfig` is the one flat set of settings users see (kebab-case run-config / CLI
keys). Its fields are grouped into typed, read-only sections, each validated by the package it
belongs to:

============================  ==========================================================
``cfg.data``                  :class:`~retexo_fl.data.settings.DataSettings`
``cfg.architecture``          :class:`ModelSettings` (``cfg.model`` is the GNN kind)
``cfg.training``              :class:`TrainingSettings`
``cfg.compression``           :class:`~retexo_fl.compress.settings.CompressionSettings`
``cfg.security``              :class:`~retexo_fl.secure.settings.SecuritySettings`
``cfg.failures``              :class:`FailureSettings`
``cfg.datacenter``            :class:`~retexo_fl.datacenter.settings.DatacenterSettings`
============================  ==========================================================

The section modules import nothing from here, so no package that owns a section imports this
module either.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from retexo_fl.compress.settings import CompressionSettings
from retexo_fl.data.settings import DataSettings
from retexo_fl.datacenter.settings import DatacenterSettings
from retexo_fl.secure.settings import SecuritySettings, min_threshold

MODES = ("lazy", "eager", "local", "centralized", "datacenter")
#: What stage 0 of a lazy run can be (``first-stage``).
FIRST_STAGES = ("mlp", "local")
#: ``drift-correction``: none, or SCAFFOLD's control variates (:mod:`retexo_fl.training.drift`).
DRIFT_CORRECTIONS = ("none", "scaffold")
PER_STAGE = ("rounds", "local_epochs", "lr", "server_lr", "dropout", "input_dropout")

_Section = TypeVar("_Section")


def stage_value(name: str, value: Any, stage: int) -> Any:
    """The value of per-stage setting ``name`` for ``stage``: the last list entry repeats.

    Args:
        name (str): the setting's name (for the error message).
        value (Any): one value for every stage, or a list with one value per stage.
        stage (int): the stage.
    """
    if isinstance(value, list | tuple):
        if not value:
            raise ValueError(f"{name}: empty list")
        return value[min(stage, len(value) - 1)]
    return value


@dataclass(frozen=True)
class ModelSettings:
    r"""The model stack: the GNN kind, its depth and widths, its regularization.

    The ``architecture`` section of :class:`TrainConfig`.

    Args:
        model (str, optional): the conv of stages :math:`\geq 1`: ``"gcn"``, ``"sage"``,
            ``"sage-max"`` or ``"gat"``; centralized mode also takes ``"mlp"``, the graph-free
            reference. (default: :obj:`"gcn"`)
        stages (int, optional): stages of a lazy run (stage 0 is the MLP; ``K`` stages are
            ``K - 1`` GNN layers). (default: :obj:`3`)
        central_layers (int, optional): layers of the centralized (end-to-end) reference GNN.
            (default: :obj:`2`)
        eager_model (str, optional): the eager / local model of ``stages - 1`` GNN layers:
            ``"standard"``, the centralized reference's GNN split at its linear maps (GCN and
            mean-SAGE, 2 or more layers: :class:`~retexo_fl.models.split.SplitGNN`);
            ``"layered"``, an MLP encoder, the conv layers and a linear head
            (:class:`~retexo_fl.models.layered.LayeredGNN`); ``"auto"``, standard wherever it
            applies. (default: :obj:`"auto"`)
        hidden (int, optional): hidden width. (default: :obj:`32`)
        pass_embedding (str, optional): what the next stage receives, ``"hidden"`` or
            ``"logits"``. (default: :obj:`"hidden"`)
        norm (str, optional): the normalization after each layer, ``"layer"`` or ``"none"``.
            (default: :obj:`"none"`)
        heads (int, optional): attention heads of ``gat``. (default: :obj:`4`)
        root_weight (bool, optional): ``gcn`` and ``gat`` stages add a linear map of each node's
            own input to what they aggregate, as SAGE's root weight does (a GCN layer alone
            weighs a node's own row by ``1 / (degree + 1)``). (default: :obj:`False`)
        first_stage (str, optional): what stage 0 is: ``"mlp"``, an MLP on each node's own
            features, or ``"local"``, one ``model`` layer over the subgraph the client's own
            nodes induce (GCN normalized by degrees inside it): no boundary traffic, so
            residency holds, but stage 0's output then depends on how the graph was partitioned.
            (default: :obj:`"mlp"`)
        dropout (float or list[float], optional): dropout, one value or one per stage.
            (default: :obj:`0.5`)
        input_dropout (float or list[float], optional): dropout of each stage's input, one value
            or one per stage. (default: :obj:`0.5`)
    """

    model: str = "gcn"
    stages: int = 3
    central_layers: int = 2
    eager_model: str = "auto"
    hidden: int = 32
    pass_embedding: str = "hidden"
    norm: str = "none"
    heads: int = 4
    root_weight: bool = False
    first_stage: str = "mlp"
    dropout: float | list[float] = 0.5
    input_dropout: float | list[float] = 0.5

    def validate(self) -> ModelSettings:
        """Raise :class:`ValueError` naming the first bad setting; return ``self`` otherwise."""
        if self.stages < 1:
            raise ValueError(f"stages must be >= 1, got {self.stages}")
        if self.first_stage not in FIRST_STAGES:
            raise ValueError(f"first-stage must be one of {FIRST_STAGES}, got {self.first_stage!r}")
        if self.pass_embedding not in ("hidden", "logits"):
            raise ValueError(f"pass-embedding must be hidden or logits, got {self.pass_embedding!r}")
        if self.eager_model not in ("auto", "standard", "layered"):
            raise ValueError(f"eager-model must be auto, standard or layered, got {self.eager_model!r}")
        if self.eager_model == "standard" and (self.model not in ("gcn", "sage") or self.stages < 3):
            raise ValueError(
                "eager-model standard splits 2 or more gcn or sage layers (stages >= 3), got "
                f"model {self.model} with stages {self.stages}: use eager-model layered"
            )
        return self

    def split_eager_model(self) -> bool:
        """Whether eager and local runs train the standard GNN split at its linear maps."""
        if self.eager_model == "auto":
            return self.model in ("gcn", "sage") and self.stages >= 3
        return self.eager_model == "standard"


@dataclass(frozen=True)
class TrainingSettings:
    r"""How a run trains: the mode, the per-stage schedule, optimizers, self-training, resources.

    The ``training`` section of :class:`TrainConfig`. ``rounds``, ``local_epochs``, ``lr`` and
    ``server_lr`` take one value for every stage or a list with one value per stage.

    Args:
        mode (str, optional): ``"lazy"`` (RETEXO), ``"eager"``, ``"local"``, ``"centralized"`` or
            ``"datacenter"``. (default: :obj:`"lazy"`)
        seed (int, optional): the run's root seed; every other seed derives from it.
            (default: :obj:`0`)
        rounds (int or list[int], optional): rounds per stage (at most: early stopping ends a
            stage sooner). (default: :obj:`32`)
        local_epochs (int or list[int], optional): local epochs per round. (default: :obj:`5`)
        optimizer (str, optional): the clients' optimizer, ``"sgd"`` or ``"adam"``.
            (default: :obj:`"sgd"`)
        momentum (float, optional): the clients' SGD momentum. (default: :obj:`0.0`)
        lr (float or list[float], optional): the clients' learning rate. (default: :obj:`1.0`)
        server_optimizer (str, optional): ``"avg"`` (FedAvg) or ``"adam"`` (FedAdam on the
            averaged update). (default: :obj:`"avg"`)
        server_lr (float or list[float], optional): the server optimizer's learning rate.
            (default: :obj:`1.0`)
        weight_decay (float, optional): L2 weight decay. (default: :obj:`5e-4`)
        patience (int, optional): rounds without a better validation accuracy before a stage
            stops early; :obj:`0` never stops. (default: :obj:`5`)
        min_rounds (int, optional): rounds a stage that starts from fresh weights runs before
            early stopping may end it. (default: :obj:`16`)
        warm_min_rounds (int, optional): the same for a stage that starts from the previous
            self-training pass's weights (``pass-init warm``): it starts past the plateau a fresh
            stage must first leave. (default: :obj:`4`)
        stop_metric (str, optional): what early stopping counts as progress: ``"accuracy"``
            (a higher validation accuracy) or ``"accuracy-or-loss"`` (that, or a lower
            validation loss). (default: :obj:`"accuracy-or-loss"`)
        precompute (bool, optional): GCN and SAGE stages aggregate their frozen inputs once per
            stage, so every round is a dense step (exact without input dropout; with it, the
            dropout hits aggregated rows). (default: :obj:`False`)
        drift_correction (str, optional): ``"none"``, or ``"scaffold"`` to correct each local
            step by SCAFFOLD's control variates (one more state sent down a round).
            (default: :obj:`"none"`)
        halo_gradients (bool, optional): eager: each client returns, with its rows, the gradient
            of its loss with respect to the halo rows it trained on, one round stale (PipeGCN),
            so that the encoder learns through cross-client edges too. Peers' gradients carry
            information about the sender's labels (see ``docs/baselines.md``). On by default in
            eager mode. (default: :obj:`False`)
        self_training (int, optional): extra passes over all stages on each client's own confident
            predictions (lazy, centralized). (default: :obj:`1`)
        pseudo_threshold (float, optional): softmax confidence a prediction needs to become a
            self-training label. (default: :obj:`0.6`)
        pseudo_per_class (int, optional): the most self-training labels per predicted class and
            client; :obj:`0` for no cap. (default: :obj:`0`)
        pass_init (str, optional): where a self-training pass's stages start: ``"warm"`` from the
            previous pass's kept weights of the same layer (a pass then needs a few rounds a
            stage), or ``"fresh"`` from new initial weights. (default: :obj:`"warm"`)
        profile (str, optional): ``"default"``; ``"edge"`` for small clients (CPU, one thread,
            chunked embeddings, 8-bit payloads where those are left at their defaults); or
            ``"exact"``, the exact mode (one full-batch step a round, server Adam, 5 stages x
            200 rounds, 32-bit; :data:`EXACT_PROFILE`) wherever the defaults are left.
            (default: :obj:`"default"`)
        device (str, optional): ``"auto"``, ``"cpu"`` or ``"cuda[:i]"``. ``auto`` puts a party
            on the GPU when there is one and its partition holds at least 4,096 nodes (below
            that, the CPU measured faster); the run's first lines say where each party computes.
            (default: :obj:`"auto"`)
        threads (int, optional): torch threads per client; :obj:`0` for torch's default.
            (default: :obj:`0`)
        chunk_rows (int, optional): compute embeddings for this many target rows at a time;
            :obj:`0` for all at once. (default: :obj:`0`)
        round_seconds (float, optional): local mode's seconds of local training per round;
            :obj:`0` uses ``local_epochs``. (default: :obj:`0.0`)
        step_delay (str, optional): ``"P:seconds,..."`` slows client ``P`` down per step
            (emulation). (default: :obj:`""`)
        out_dir (str, optional): the run folder for ``config.json``, ``events.jsonl`` and
            ``summary.json``; empty writes none. (default: :obj:`""`)
    """

    mode: str = "lazy"
    seed: int = 0
    rounds: int | list[int] = 32
    local_epochs: int | list[int] = 5
    optimizer: str = "sgd"
    momentum: float = 0.0
    lr: float | list[float] = 1.0
    server_optimizer: str = "avg"
    server_lr: float | list[float] = 1.0
    weight_decay: float = 5e-4
    patience: int = 5
    min_rounds: int = 16
    warm_min_rounds: int = 4
    stop_metric: str = "accuracy-or-loss"
    precompute: bool = False
    drift_correction: str = "none"
    halo_gradients: bool = False
    self_training: int = 1
    pseudo_threshold: float = 0.6
    pseudo_per_class: int = 0
    pass_init: str = "warm"
    profile: str = "default"
    device: str = "auto"
    threads: int = 0
    chunk_rows: int = 0
    round_seconds: float = 0.0
    step_delay: str = ""
    out_dir: str = ""

    def validate(self, stages: int = 1) -> TrainingSettings:
        """Raise :class:`ValueError` naming the first bad setting; return ``self`` otherwise.

        Args:
            stages (int, optional): the run's stage count, over which the per-stage values are
                checked. (default: :obj:`1`)
        """
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.self_training < 0 or not 0 <= self.pseudo_threshold <= 1 or self.pseudo_per_class < 0:
            raise ValueError(
                "self-training and pseudo-per-class must be >= 0 and pseudo-threshold in [0, 1], got "
                f"{self.self_training}, {self.pseudo_per_class} and {self.pseudo_threshold}"
            )
        if self.self_training and self.mode not in ("lazy", "centralized"):
            raise ValueError(f"self-training applies to lazy and centralized mode, not {self.mode}")
        if self.pass_init not in ("warm", "fresh"):
            raise ValueError(f"pass-init must be warm or fresh, got {self.pass_init!r}")
        if self.halo_gradients and self.mode != "eager":
            raise ValueError(f"halo-gradients applies to eager mode, not {self.mode}")
        if self.server_optimizer not in ("avg", "adam"):
            raise ValueError(f"server-optimizer must be avg or adam, got {self.server_optimizer!r}")
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer must be adam or sgd, got {self.optimizer!r}")
        if self.profile not in ("default", "edge", "exact"):
            raise ValueError(f"profile must be default, edge or exact, got {self.profile!r}")
        if self.threads < 0 or self.chunk_rows < 0:
            raise ValueError("threads and chunk-rows must be >= 0")
        if self.drift_correction not in DRIFT_CORRECTIONS:
            raise ValueError(
                f"drift-correction must be one of {DRIFT_CORRECTIONS}, got {self.drift_correction!r}"
            )
        if self.stop_metric not in ("accuracy", "accuracy-or-loss"):
            raise ValueError(f"stop-metric must be accuracy or accuracy-or-loss, got {self.stop_metric!r}")
        if self.patience < 0 or self.min_rounds < 0 or self.warm_min_rounds < 0:
            raise ValueError(
                "patience, min-rounds and warm-min-rounds must be >= 0, got "
                f"{self.patience}, {self.min_rounds} and {self.warm_min_rounds}"
            )
        for s in range(stages):
            rounds = int(stage_value("rounds", self.rounds, s))
            epochs = int(stage_value("local_epochs", self.local_epochs, s))
            if rounds < 0:
                raise ValueError(f"rounds must be >= 0, got {rounds} for stage {s}")
            if epochs < 0 or (epochs == 0 and not self.round_seconds):
                raise ValueError(
                    f"local-epochs must be >= 1 (or 0 with round-seconds), got {epochs} for stage {s}"
                )
            if self.patience and rounds == 0:
                raise ValueError(f"patience {self.patience} needs rounds >= 1; stage {s} has 0 rounds")
        return self


@dataclass(frozen=True)
class FailureSettings:
    r"""Client failures (Flower engines): how many clients a run needs and how it continues.

    The ``failures`` section of :class:`TrainConfig`.

    Args:
        min_clients (int, optional): continue while at least this many clients remain;
            :obj:`0` means every client, so a lost client ends the run. (default: :obj:`0`)
        on_missing_halo (str, optional): what replaces a lost client's boundary rows, ``"fail"``,
            ``"zero"`` or ``"reuse-last"``. (default: :obj:`"fail"`)
        client_timeout (float, optional): seconds the server waits for each message's replies.
            (default: :obj:`300.0`)
        resume (str, optional): a lazy run's folder (``out-dir``) to continue from its last
            checkpoint. (default: :obj:`""`)
    """

    min_clients: int = 0
    on_missing_halo: str = "fail"
    client_timeout: float = 300.0
    resume: str = ""

    def validate(self, clients: int) -> FailureSettings:
        """Raise :class:`ValueError` naming the first bad setting; return ``self`` otherwise.

        Args:
            clients (int): the run's client count, the most ``min_clients`` may be.
        """
        if self.on_missing_halo not in ("fail", "zero", "reuse-last"):
            raise ValueError(
                f"on-missing-halo must be fail, zero or reuse-last, got {self.on_missing_halo!r}"
            )
        if not 0 <= self.min_clients <= clients:
            raise ValueError(f"min-clients must be in [0, clients={clients}], got {self.min_clients}")
        if self.client_timeout <= 0:
            raise ValueError(f"client-timeout must be > 0 seconds, got {self.client_timeout}")
        return self


#: Section name (the :class:`TrainConfig` property) -> its dataclass; every field of
#: :class:`TrainConfig` but ``extra`` belongs to exactly one.
SECTIONS: dict[str, type] = {
    "data": DataSettings,
    "architecture": ModelSettings,
    "training": TrainingSettings,
    "compression": CompressionSettings,
    "security": SecuritySettings,
    "failures": FailureSettings,
    "datacenter": DatacenterSettings,
}


#: ``--profile exact``: the exact mode, the defaults before round-efficient training. Five stages
#: of one full-batch SGD step (lr 1) a round for 200 rounds, so the averaged update is the whole
#: graph's gradient and the server's Adam follows centralized Adam; 32-bit everything, no early
#: stopping, no self-training.
EXACT_PROFILE: dict[str, Any] = {
    "stages": 5,
    "hidden": 256,
    "rounds": 200,
    "local_epochs": 1,
    "lr": 1.0,
    "server_optimizer": "adam",
    "server_lr": 0.01,
    "patience": 0,
    "min_rounds": 0,
    "warm_min_rounds": 0,
    "self_training": 0,
    "update_bits": 32,
    "broadcast_bits": 32,
    "norm": "layer",
}

#: What the end-to-end modes change from the lazy defaults: the 2-layer reference's settings.
#: Centralized and data-center training run full-batch Adam epochs (``rounds`` x
#: ``local-epochs`` of them at ``server-lr``). Of eight centralized candidates (phase D of
#: ``bench/results/sweep-2026-11-24.jsonl``) one self-training pass has the best validation on
#: Cora and CiteSeer, but loses on cornell and wisconsin: the default stays without it.
_END_TO_END: dict[str, Any] = {
    "hidden": 64,
    "rounds": 200,
    "local_epochs": 1,
    "server_optimizer": "adam",
    "server_lr": 0.01,
    "patience": 0,
    "min_rounds": 0,
    "warm_min_rounds": 0,
    "self_training": 0,
}

#: The local baseline: the best validation of eight candidates in 100 rounds (Cora, 10 random
#: clients, seeds 0-2; phase D): the end-to-end settings (one SGD step a round with the
#: server's Adam, as the centralized reference trains) over 2 stages, with layer norm and whole
#: 32-bit updates and broadcasts (val 0.709; the same with 4-bit deltas: 0.699).
_LOCAL: dict[str, Any] = {
    **_END_TO_END,
    "stages": 2,
    "rounds": 100,
    "norm": "layer",
    "update_bits": 32,
    "broadcast_bits": 32,
}

#: Each mode's own defaults, applied wherever a run left the lazy defaults. Eager trains the
#: centralized reference's 2-layer GNN (3 stages, no norm; ``eager-model auto`` splits it at its
#: linear maps) with the backward exchange of halo gradients: the best validation of eight
#: candidates (phase H of ``bench/results/sweep-2026-11-24.jsonl``; docs/baselines.md). Without
#: the gradients a client's loss trains the first layer through its own nodes only, and eager
#: stayed 10-16 points below centralized.
MODE_DEFAULTS: dict[str, dict[str, Any]] = {
    "centralized": _END_TO_END,
    "datacenter": _END_TO_END,
    "eager": {**_LOCAL, "stages": 3, "norm": "none", "halo_gradients": True},
    "local": _LOCAL,
}


@dataclass
class TrainConfig:
    """Every setting of a training run; kebab-case names are the run-config / CLI keys.

    The fields are flat (``cfg.bits``, ``cfg.hidden``) and grouped into read-only typed sections
    (``cfg.data``, ``cfg.architecture``, ``cfg.training``, ``cfg.compression``, ``cfg.security``,
    ``cfg.failures``, ``cfg.datacenter``; see :data:`SECTIONS`), whose classes document every
    setting and validate their own values. Per-stage settings (``rounds``, ``local_epochs``,
    ``lr``, ``server_lr``, ``dropout``, ``input_dropout``) take one value for every stage or a
    list with one value per stage. ``extra`` holds free-form settings outside every section.
    """

    mode: str = "lazy"
    dataset: str = "Cora"
    data_root: str = "data"
    split: str = "public"
    split_index: int = 0
    clients: int = 4
    method: str = "metis"
    partitions: str = ""
    seed: int = 0
    model: str = "gcn"
    stages: int = 3
    central_layers: int = 2
    eager_model: str = "auto"  # standard (the reference GNN, split) | layered | auto
    hidden: int = 32
    pass_embedding: str = "hidden"
    # Self-training (lazy and centralized): after the last stage, every client labels its own
    # unlabeled nodes predicted with at least this confidence (never validation nodes), and the
    # whole stack is trained again on them, once per pass. The labels never leave the client.
    self_training: int = 1  # extra passes
    pseudo_threshold: float = 0.6  # chosen on validation over 10 cells (bench/README.md, phase K)
    pseudo_per_class: int = 0  # at most this many new labels per predicted class and client; 0: no cap
    # A pass's stages start from the previous pass's kept weights ("warm") or new ones ("fresh").
    pass_init: str = "warm"
    # Round-efficient defaults: at most 32 rounds of 5 local SGD steps a stage, FedAvg,
    # early stopping, 4-bit updates and broadcasts, one warm self-training pass.
    # ``profile="exact"`` restores one full-batch step a round with the server's Adam, which
    # follows centralized Adam (see EXACT_PROFILE).
    rounds: int | list[int] = 32
    local_epochs: int | list[int] = 5
    optimizer: str = "sgd"
    momentum: float = 0.0
    lr: float | list[float] = 1.0
    server_optimizer: str = "avg"
    server_lr: float | list[float] = 1.0
    weight_decay: float = 5e-4
    dropout: float | list[float] = 0.5
    input_dropout: float | list[float] = 0.5
    norm: str = "none"
    heads: int = 4
    root_weight: bool = False  # gcn / gat stages: a separate linear map of a node's own input
    first_stage: str = "mlp"  # stage 0: mlp, or local (one layer over the client's own edges)
    patience: int = 5  # early stopping: rounds without a validation gain (0: never stop)
    min_rounds: int = 16  # rounds a fresh stage runs before early stopping may end it
    warm_min_rounds: int = 4  # the same for a stage warm-started from the previous pass
    stop_metric: str = "accuracy-or-loss"  # early stopping's progress: accuracy | accuracy-or-loss
    # GCN / SAGE stages: aggregate the frozen stage input once, then every round is dense.
    precompute: bool = False
    # Many local steps a round: "scaffold" corrects client drift with control variates.
    drift_correction: str = "none"
    # Eager: return the gradient of each halo row to its owner, one round stale (PipeGCN).
    halo_gradients: bool = False
    device: str = "auto"
    # Local mode's time-based aggregation: seconds of local training per round (0: local-epochs).
    round_seconds: float = 0.0
    step_delay: str = ""  # "P:seconds,...": slow client P down by that much per step (emulation)
    # Small clients: profile "edge" means CPU, bounded threads, embeddings in row chunks and
    # 8-bit boundary rows, updates and broadcasts wherever those were 32-bit (model deltas are
    # 4-bit by default).
    profile: str = "default"
    threads: int = 0  # torch threads per client (0: torch's default)
    chunk_rows: int = 0  # embeddings for this many target rows at a time (0: all at once)
    # Compression of boundary rows, model updates and broadcasts (docs/compression.md).
    bits: int = 32
    bit_policy: str = "fixed"
    byte_budget: str = ""
    link_bandwidths: str = ""
    time_budget: float = 0.0
    rate_schedule: str = "fixed"
    update_bits: int = 4
    broadcast_bits: int = 4  # the server's model broadcast as b-bit deltas (32: whole state)
    range_dtype: str = "fp16"
    # End-to-end encryption of boundary payloads between clients (docs/security.md).
    encrypt: bool = True
    identity_keys: str = ""  # folder of client-<id>.key identity keys (else one key pair per run)
    pinned_keys: str = ""  # JSON {client id: public key hex} exchanged out of band
    # Differential privacy of model updates (DP-FedAvg, central noise; needs retexo-fl[dp]).
    dp_noise: float = 0.0  # noise multiplier; 0 turns DP off
    dp_clip: float = 1.0  # L2 norm each client's round update is clipped to
    dp_delta: float = 1e-5
    dp_reproducible: bool = False  # noise from the run seed (engines agree; the seed removes it)
    # Released boundary rows: clipped per row to L2 norm boundary-clip, then Gaussian noise of
    # standard deviation boundary-noise * boundary-clip on every row (0: off).
    boundary_clip: float = 0.0
    boundary_noise: float = 0.0
    # Secure aggregation: masked round replies, the server learns only the survivors' sum.
    secure_aggregation: bool = False
    secagg_threshold: int = 0  # 0: the least safe threshold, (clients + 1) // 2 + 1
    secagg_clip: float = 10.0  # bound of a weighted update coordinate in the field encoding
    # Client failures (Flower engines): how many clients a run needs, what replaces a lost
    # client's boundary rows (fail | zero | reuse-last), and how long the server waits per message.
    min_clients: int = 0  # 0: every client; a lost client ends the run
    on_missing_halo: str = "fail"
    client_timeout: float = 300.0
    resume: str = ""  # a lazy run's folder (--out) to continue from its last checkpoint (Flower engines)
    audit: str = ""  # folder where each client records every message it sends (retexo-fl audit)
    # Data-center mode (CAGNET full-graph training on torch.distributed, trusted clusters only).
    algorithm: str = "1d"
    procs: int = 4
    replication: int = 2  # 1.5d's replication factor c
    trusted_cluster: bool = False
    out_dir: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def __new__(cls, *args: Any, **kwargs: Any) -> TrainConfig:
        # The settings given by name: a profile or a mode's defaults never replace them.
        self = super().__new__(cls)
        self._given = frozenset(kwargs)
        return self

    def __post_init__(self) -> None:
        # A profile or a mode sets what the run did not give (see ``__new__``).
        if self.profile == "exact":
            self._fill(EXACT_PROFILE)
        self._fill(MODE_DEFAULTS.get(self.mode, {}))
        if self.boundary_noise > 0 and "halo_gradients" not in self._given:
            # Noised rows with raw gradients back would undo the noise's point: the default
            # gives way (halo-gradients true with boundary-noise is refused by validate()).
            self.halo_gradients = False
        if self.profile == "edge":
            self.device = "cpu" if self.device == "auto" else self.device
            self.threads = self.threads or 1
            self.chunk_rows = self.chunk_rows or 4096
            self.bits = 8 if self.bits == 32 else self.bits
            self.update_bits = 8 if self.update_bits == 32 else self.update_bits
            self.broadcast_bits = 8 if self.broadcast_bits == 32 else self.broadcast_bits

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with ``changes``, built as this one was.

        The settings this config was given and ``changes`` count as given; a changed mode or
        profile brings its own defaults for the rest. (``dataclasses.replace`` passes every field
        by name, so no mode default would apply: ``dataclasses.replace(TrainConfig(),
        mode="eager")`` keeps the lazy hidden width, where ``TrainConfig().replace(mode="eager")``
        equals ``TrainConfig(mode="eager")``.)

        Args:
            **changes: settings by snake-case name.
        """
        given = {name: getattr(self, name) for name in self._given if name not in changes}
        return type(self)(**given, **changes)

    def _fill(self, values: dict[str, Any]) -> None:
        """Set each of ``values`` that the constructor was not given."""
        given = getattr(self, "_given", frozenset())
        for name, value in values.items():
            if name not in given:
                setattr(self, name, value)

    def _section(self, cls: type[_Section]) -> _Section:
        return cls(**{f.name: getattr(self, f.name) for f in dataclasses.fields(cls)})

    @property
    def data(self) -> DataSettings:
        """The data section: dataset, split, clients and partitions."""
        return self._section(DataSettings)

    @property
    def architecture(self) -> ModelSettings:
        """The model section (``model`` itself is the GNN kind, one of its fields)."""
        return self._section(ModelSettings)

    @property
    def training(self) -> TrainingSettings:
        """The training section: mode, schedule, optimizers, self-training, resources."""
        return self._section(TrainingSettings)

    @property
    def compression(self) -> CompressionSettings:
        """The compression section, what :class:`~retexo_fl.compress.boundary.BoundaryEncoder` takes."""
        return self._section(CompressionSettings)

    @property
    def security(self) -> SecuritySettings:
        """The security section: encryption, keys, audit and differential privacy."""
        return self._section(SecuritySettings)

    @property
    def failures(self) -> FailureSettings:
        """The client-failure section of the Flower engines."""
        return self._section(FailureSettings)

    @property
    def datacenter(self) -> DatacenterSettings:
        """The data-center section."""
        return self._section(DatacenterSettings)

    def sections(self) -> dict[str, Any]:
        """Every section by its name in :data:`SECTIONS`."""
        return {name: self._section(cls) for name, cls in SECTIONS.items()}

    @property
    def total_stages(self) -> int:
        """Stages of a lazy run over all self-training passes."""
        return self.stages * (1 + self.self_training)

    def layer(self, stage: int) -> int:
        """Which layer of the stack a lazy run's ``stage`` trains (passes repeat the stack)."""
        return stage % self.stages

    def stage_name(self, stage: int) -> str:
        """How progress lines name a lazy run's ``stage``: ``"stage 2"``, or with self-training
        passes ``"pass 2 stage 0"`` (passes from 1, stages within a pass from 0)."""
        if self.self_training <= 0:
            return f"stage {stage}"
        return f"pass {stage // self.stages + 1} stage {self.layer(stage)}"

    def ends_pass(self, stage: int) -> bool:
        """Whether ``stage`` is the last of a self-training pass that another pass follows."""
        return stage < self.total_stages - 1 and self.layer(stage) == self.stages - 1

    def per_stage(self, name: str, stage: int) -> Any:
        """The value of a per-stage setting for ``stage`` (the last list entry repeats)."""
        return stage_value(name, getattr(self, name), stage)

    def validate(self) -> TrainConfig:
        """Run every section's checks (and those across sections); return ``self``.

        Raises:
            ValueError: naming the first bad setting by its kebab-case key.
        """
        self.training.validate(stages=self.stages)
        self.architecture.validate()
        self.data.validate()
        self.compression.validate()
        self.security.validate()
        self.failures.validate(clients=self.clients)
        federated = self.mode in ("lazy", "eager", "local")
        if self.drift_correction != "none" and (self.dp_noise > 0 or not federated):
            raise ValueError(
                "drift-correction scaffold trains federated modes (lazy, eager, local) without "
                "dp-noise: control variates derived from clipped, noised updates are not supported"
            )
        if self.halo_gradients and self.boundary_noise > 0:
            raise ValueError(
                "halo-gradients with boundary-noise: the gradients returned for noised rows are "
                "neither clipped nor noised; set halo-gradients false to release noised rows only"
            )
        if self.secure_aggregation:
            least = min_threshold(self.clients)
            if not federated or self.drift_correction != "none" or self.clients < 3:
                raise ValueError(
                    "secure-aggregation runs federated modes (lazy, eager, local) with 3 or more "
                    "clients and no drift-correction (control variates need each client's update)"
                )
            if self.secagg_threshold and not least <= self.secagg_threshold <= self.clients:
                raise ValueError(
                    f"secagg-threshold must be {least} to {self.clients} for {self.clients} clients "
                    "(0: the least safe one)"
                )
        if self.first_stage != "mlp" and self.mode != "lazy":
            raise ValueError(f"first-stage {self.first_stage} applies to lazy mode, not {self.mode}")
        if self.model == "mlp" and self.mode != "centralized":
            raise ValueError("model mlp (the graph-free reference) trains in centralized mode only")
        # Only a data-center run needs procs to form the algorithm's process grid.
        self.datacenter.validate(grid=self.mode == "datacenter")
        return self

    def to_dict(self) -> dict[str, Any]:
        """Every field by its snake-case name (``extra`` included): what ``config.json`` holds."""
        return dataclasses.asdict(self)

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> TrainConfig:
        """Build from kebab- or snake-case keys (run config, CLI); unknown keys are refused."""
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            name = key.replace("-", "_")
            if name not in names:
                raise ValueError(f"unknown setting {key!r}")
            kwargs[name] = parse_list(value) if name in PER_STAGE else value
        return cls(**kwargs).validate()

    @classmethod
    def from_run_config(cls, values: dict[str, Any], overridden: Iterable[str] | None = None) -> TrainConfig:
        """Build from a Flower run config.

        Flower merges ``[tool.flwr.app.config]`` into every run config, so every key arrives;
        those the submitter did not set must leave room for the mode's and profile's own
        defaults (``--run-config "mode='eager'"`` gets eager's). With ``overridden``, the keys
        the submitter set (Flower's ``Run.override_config``), exactly those count as given, so
        ``hidden=32`` in eager mode is kept although it is the lazy default. Without it, a key
        equal to its lazy default counts as not given (such a value set on purpose is then taken
        as the mode's default).

        Args:
            values (dict): the run config, kebab-case keys.
            overridden (Iterable[str], optional): the keys the run's submitter set.
                (default: :obj:`None`)
        """
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        given = None if overridden is None else {k.replace("-", "_") for k in overridden}
        kept = {}
        for key, value in values.items():
            name = key.replace("-", "_")
            if name not in ("mode", "profile"):
                if given is not None and name in defaults and name not in given:
                    continue
                parsed = parse_list(value) if name in PER_STAGE else value
                if given is None and name in defaults and parsed == defaults[name]:
                    continue
            kept[key] = value
        return cls.from_mapping(kept)

    @classmethod
    def from_sections(cls, extra: dict[str, Any] | None = None, **sections: Any) -> TrainConfig:
        """Build from section objects by name (see :data:`SECTIONS`); an omitted one takes its defaults.

        Args:
            extra (dict, optional): free-form settings outside every section. (default: :obj:`None`)
            **sections: e.g. ``data=DataSettings(dataset="CiteSeer")``.
        """
        kwargs: dict[str, Any] = {"extra": dict(extra or {})}
        for name, section in sections.items():
            want = SECTIONS.get(name)
            if want is None:
                raise ValueError(f"unknown section {name!r}; sections: {', '.join(SECTIONS)}")
            if not isinstance(section, want):
                raise TypeError(f"section {name!r} must be a {want.__name__}, got {type(section).__name__}")
            kwargs.update(dataclasses.asdict(section))
        return cls(**kwargs).validate()


def parse_list(value: Any) -> Any:
    """``"200,100"`` -> ``[200, 100]``; numbers and lists pass through."""
    if isinstance(value, str):
        items = [v for v in value.replace(" ", "").split(",") if v]
        nums = [float(v) if any(c in v for c in ".e") else int(v) for v in items]
        return nums[0] if len(nums) == 1 else nums
    return value
