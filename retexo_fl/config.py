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
import difflib
import inspect
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, get_args

from retexo_fl.compress.settings import CompressionSettings
from retexo_fl.data.settings import DataSettings
from retexo_fl.datacenter.settings import DatacenterSettings
from retexo_fl.secure.settings import MAX_SECAGG_CLIENTS, SecuritySettings, min_threshold
from retexo_fl.setting import SettingInfo, check_choices, section, setting, settings_of

Mode = Literal["lazy", "eager", "local", "centralized", "datacenter"]
#: The training modes (``mode``).
MODES: tuple[str, ...] = get_args(Mode)
FirstStage = Literal["mlp", "local", "auto"]
#: What stage 0 of a lazy run can be (``first-stage``).
FIRST_STAGES: tuple[str, ...] = get_args(FirstStage)
#: What a layer-0 stage is built as; ``first-stage auto`` trains both and keeps one.
FIRST_STAGE_VARIANTS: tuple[str, ...] = ("mlp", "local")
#: ``first-stage-sprint``'s lane of stage 0: the local layer over more hops, with less dropout. A
#: candidate for the delivered model only: never embedded, never a self-training teacher.
SPRINT = "sprint"
#: The largest ``gnn-input-rms-floor``: trained embeddings have a root mean square of about 0.1-1.
MAX_INPUT_RMS_FLOOR = 10.0
#: Upper bounds on the sizes a run config sets, far past any real run: a client builds what its
#: run config says, and a server's ``hidden`` of 10^9 or ``local-epochs`` of 10^12 would take a
#: party's memory or its machine for good instead of being refused. Widths (``hidden``) ...
MAX_WIDTH = 1 << 16
#: ... layers, stages, attention heads and self-training passes ...
MAX_LAYERS = 64
#: ... local steps a round ...
MAX_STEPS = 100_000
#: ... and rounds a stage.
MAX_ROUNDS = 1_000_000
DriftCorrection = Literal["none", "scaffold"]
#: ``drift-correction``: none, or SCAFFOLD's control variates (:mod:`retexo_fl.scaffold`).
DRIFT_CORRECTIONS: tuple[str, ...] = get_args(DriftCorrection)

_Section = TypeVar("_Section")


def _positive(value: Any) -> bool:
    """Whether a given setting is a number above 0 (a mistyped one is refused by validate)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


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


def check_stage_lists(obj: Any, stages: int) -> None:
    """Raise :class:`ValueError` naming a per-stage setting of section ``obj`` with more values
    than stages (``rounds 2,2,2,2`` over 3), which the run would silently cut; a default list
    (``server-optimizer adam,avg``) is as long as it is whatever the stages."""
    for info in settings_of(type(obj)):
        value = getattr(obj, info.name)
        longest = max(stages, len(info.default) if isinstance(info.default, list) else 1)
        if info.per_stage and isinstance(value, list | tuple) and len(value) > longest:
            raise ValueError(
                f"{info.key} has {len(value)} values for {stages} stage(s): give one value, or at "
                "most one per stage"
            )


@section
class ModelSettings:
    r"""The model stack: the GNN kind, its depth and widths, its regularization.

    The ``architecture`` section of :class:`TrainConfig`.
    """

    model: Literal["gcn", "sage", "sage-max", "gat", "mlp"] = setting(
        "gcn",
        "the conv of stages >= 1: gcn, sage, sage-max or gat; centralized mode also takes mlp, "
        "the graph-free reference",
    )
    stages: int = setting(
        3, "stages of a lazy run (stage 0 an MLP or a local layer: first-stage; K stages, K - 1 GNN layers)"
    )
    central_layers: int = setting(
        2, "layers of the centralized (end-to-end) reference GNN", modes=("centralized", "datacenter")
    )
    eager_model: Literal["auto", "standard", "layered"] = setting(
        "auto",
        "the eager / local model of stages - 1 GNN layers: standard (the centralized reference's "
        "GNN split at its linear maps, so peers get X W, never X; gcn and mean-sage, 2 or more "
        "layers), layered (an MLP encoder, the conv layers, a linear head) or auto (standard "
        "wherever it applies)",
        modes=("eager", "local"),
    )
    hidden: int = setting(32, "hidden width")
    pass_embedding: Literal["hidden", "logits"] = setting(
        "hidden", "what the next stage receives", modes=("lazy",)
    )
    norm: Literal["layer", "none"] = setting("none", "the normalization after each hidden layer")
    heads: int = setting(4, "attention heads of gat", needs="model=gat")
    root_weight: bool = setting(
        False,
        "gcn and gat stages add a linear map of each node's own input to what they aggregate, as "
        "SAGE's root weight does (a GCN layer alone weighs a node's own row by 1 / (degree + 1))",
    )
    gnn_input_rms_floor: float = setting(
        0.0,
        "a GNN stage's input (the previous stage's frozen embeddings, own and halo rows) is scaled "
        "up on each client, by one factor, so that the root mean square of the client's own rows "
        "is at least this (0: never). Embeddings that come out small make SGD's steps on them as "
        "small, and the stage then sits at the majority class. A client scales by its own rows "
        "alone, so nothing crosses for it, but the stage then depends on the partitioning. A lazy "
        "run over partitions defaults to 0.25 (LAZY_PARTITION_DEFAULTS)",
        modes=("lazy",),
    )
    first_stage: FirstStage = setting(
        "mlp",
        "stage 0: mlp (an MLP on each node's own features), local (one model layer over the "
        "subgraph the client's own nodes induce, GCN normalized by degrees inside it: no boundary "
        "traffic, so residency holds, but stage 0 then depends on the partitioning) or auto (stage "
        "0 trained both ways, the one with the better validation kept, and a self-training pass's "
        "stage 0 built the same way; it costs the second stage 0's rounds and model bytes). A lazy "
        "run over partitions defaults to auto (not with the exact profile, secure aggregation, DP "
        "or boundary noise: LAZY_PARTITION_DEFAULTS); the default below applies elsewhere",
        modes=("lazy",),
    )
    first_stage_first: Literal["mlp", "local"] = setting(
        "local",
        "first-stage auto: the variant stage 0 is trained as first (the second races it)",
        modes=("lazy",),
        needs="first_stage=auto",
    )
    first_stage_race: int = setting(
        8,
        "first-stage auto: the second training of stage 0 stops once it has run this many rounds "
        "and its best validation accuracy is more than first-stage-race-margin below the best the "
        "first training reached in as many rounds (0: it trains as long as the first could)",
        modes=("lazy",),
        needs="first_stage=auto",
    )
    first_stage_race_margin: float = setting(
        0.02,
        "first-stage auto: how far (accuracy, 0.02 is 2 points) the second training may trail",
        modes=("lazy",),
        needs="first_stage=auto",
    )
    first_stage_schedule: Literal["parallel", "sequential"] = setting(
        "sequential",
        "first-stage auto: parallel trains the two variants of stage 0 in the same rounds (one "
        "message a client carries both, so the stage costs the longer training's rounds, not their "
        "sum; the same trainings, bytes and choice as sequential), sequential one after the other. "
        "A lazy run over partitions defaults to parallel (LAZY_PARTITION_DEFAULTS); a run resumed "
        "from a config that predates the setting goes on sequential, as it began",
        modes=("lazy",),
        needs="first_stage=auto",
    )
    first_stage_sprint: int = setting(
        0,
        "first-stage auto in parallel: the rounds of a third lane of stage 0, the sprint (0: none): "
        "the local layer over first-stage-sprint-hops hops with dropout first-stage-sprint-dropout, "
        "which validates high within a few rounds where the graph is homophilous but makes poor "
        "inputs for later stages. It is a candidate for the delivered model (tested when it "
        "validates above the stage 0 kept), never embedded nor a self-training teacher; it costs "
        "its rounds' model bytes and no boundary traffic. A lazy run over partitions defaults to "
        "8 (LAZY_PARTITION_DEFAULTS)",
        modes=("lazy",),
        needs="first_stage=auto",
    )
    first_stage_sprint_hops: int = setting(
        3,
        "first-stage-sprint: the hops of the client's own subgraph its input reads (as local-hops)",
        modes=("lazy",),
        needs="first_stage_sprint",
    )
    first_stage_sprint_dropout: float = setting(
        0.2,
        "first-stage-sprint: its dropout (its input dropout is input-dropout's)",
        modes=("lazy",),
        needs="first_stage_sprint",
    )
    local_hops: int = setting(
        1,
        "a local stage 0 (first-stage local or auto) reads its input propagated this many hops "
        "less one over the client's own edges first (GCN-normalized by the degrees inside the "
        "client, as SGC does, once per stage): 2 makes a GCN stage 0 read two hops of its own "
        "subgraph. Like a local stage 0 itself, it sends nothing and depends on the partitioning. "
        "A lazy run over partitions defaults to 2 (LAZY_PARTITION_DEFAULTS)",
        modes=("lazy",),
        needs="first_stage=local|auto",
    )
    dropout: float | list[float] = setting(0.5, "dropout", per_stage=True)
    input_dropout: float | list[float] = setting(0.5, "dropout of each stage's input", per_stage=True)

    def validate(self) -> ModelSettings:
        """Raise :class:`ValueError` naming the first bad setting; return ``self`` otherwise."""
        check_choices(self)
        sizes = (
            ("stages", self.stages, MAX_LAYERS),
            ("hidden", self.hidden, MAX_WIDTH),
            ("heads", self.heads, MAX_LAYERS),
            ("central-layers", self.central_layers, MAX_LAYERS),
            ("local-hops", self.local_hops, MAX_LAYERS),
            ("first-stage-sprint-hops", self.first_stage_sprint_hops, MAX_LAYERS),
        )
        for name, value, most in sizes:
            if not 1 <= value <= most:
                raise ValueError(f"{name} must be in [1, {most}], got {value}")
        check_stage_lists(self, self.stages)
        for name, value in (("dropout", self.dropout), ("input-dropout", self.input_dropout)):
            for p in value if isinstance(value, list | tuple) else [value]:
                if not 0 <= p < 1:
                    raise ValueError(f"{name} must be in [0, 1) (the share of values dropped), got {p}")
        if not 0 <= self.gnn_input_rms_floor <= MAX_INPUT_RMS_FLOOR:
            # Bounded: the factor multiplies a stage's input, and one without limit would let a
            # run config push rows past float32 exactly where a client's data makes them nonzero.
            raise ValueError(
                f"gnn-input-rms-floor must be in [0, {MAX_INPUT_RMS_FLOOR:g}], got {self.gnn_input_rms_floor}"
            )
        if not 0 <= self.first_stage_sprint <= MAX_ROUNDS or not 0 <= self.first_stage_sprint_dropout < 1:
            raise ValueError(
                f"first-stage-sprint must be in [0, {MAX_ROUNDS}] and first-stage-sprint-dropout in "
                f"[0, 1), got {self.first_stage_sprint} and {self.first_stage_sprint_dropout}"
            )
        if self.first_stage_race < 0 or not 0 <= self.first_stage_race_margin <= 1:
            raise ValueError(
                "first-stage-race must be >= 0 and first-stage-race-margin in [0, 1], got "
                f"{self.first_stage_race} and {self.first_stage_race_margin}"
            )
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


@section
class TrainingSettings:
    r"""How a run trains: the mode, the per-stage schedule, optimizers, self-training, resources.

    The ``training`` section of :class:`TrainConfig`. ``rounds``, ``local_epochs``, ``lr``,
    ``weight_decay``, ``server_optimizer`` and ``server_lr`` take one value for every stage or a
    list with one value per stage.
    """

    mode: Mode = setting(
        "lazy",
        "lazy (RETEXO), eager (standard federated GNN), local (no cross edges, TMA), centralized, "
        "or datacenter (CAGNET full-graph training on torch.distributed, trusted clusters only)",
    )
    seed: int = setting(0, "the run's root seed; every other seed derives from it")
    rounds: int | list[int] = setting(
        32, "rounds per stage (at most: early stopping ends a stage sooner)", per_stage=True
    )
    local_epochs: int | list[int] = setting(5, "local epochs (steps) per round", per_stage=True)
    mlp_local_epochs: int = setting(
        0,
        "local epochs per round of a layer-0 stage built as the MLP (0: that stage's local-epochs); "
        "a lazy run over partitions defaults to 1 (LAZY_PARTITION_DEFAULTS)",
        modes=("lazy",),
    )
    mlp_weight_decay: float = setting(
        0.0,
        "weight decay of a layer-0 stage built as the MLP (0: that layer's weight-decay); a lazy "
        "run over partitions defaults to 5e-3 (LAZY_PARTITION_DEFAULTS)",
        modes=("lazy",),
    )
    optimizer: Literal["sgd", "adam"] = setting("sgd", "the clients' optimizer")
    momentum: float = setting(0.0, "the clients' SGD momentum", needs="optimizer=sgd")
    lr: float | list[float] = setting(1.0, "the clients' learning rate", per_stage=True)
    server_optimizer: Literal["avg", "adam"] | list[Literal["avg", "adam"]] = setting(
        ["adam", "avg"],
        "avg (FedAvg) or adam (FedAdam on the averaged update); adam normalizes each weight's "
        "step, so a feature that few clients' nodes have is not diluted by the average. By "
        "default stage 0 (the MLP over raw features) takes adam, the GNN stages avg",
        per_stage=True,
    )
    server_lr: float | list[float] = setting(
        [0.05, 1.0], "the server optimizer's learning rate (avg ignores it)", per_stage=True
    )
    fraction_train: float = setting(
        1.0,
        "lazy: the fraction of the clients with training nodes that train in a round, sampled "
        "each round from the run's seed (Flower's fraction-train); the others only validate",
        modes=("lazy",),
    )
    clients_per_round: int = setting(
        0,
        "lazy: at most this many clients with training nodes train in a round, sampled each round "
        "from the run's seed after fraction-train (cross-device training's clients per round); "
        "the others only validate. 0: no cap",
        modes=("lazy",),
    )
    validate_every: int = setting(
        1,
        "validate every this many rounds: a stage's rounds 1+k, 1+2k, ... carry the validation of "
        "the state they bring, and the stage's last state is validated too. Clients that only "
        "validate are sent those rounds alone, with the broadcast deltas they missed. Patience and "
        "min-rounds still count rounds",
    )
    weight_decay: float | list[float] = setting(
        5e-4,
        "L2 weight decay of the clients' optimizer (centralized and datacenter runs: of theirs)",
        per_stage=True,
    )
    patience: int = setting(
        5, "early stopping: rounds without a validation gain before a stage stops (0: never)"
    )
    min_rounds: int = setting(
        16, "rounds a stage that starts from fresh weights runs before early stopping may end it"
    )
    warm_min_rounds: int = setting(
        4,
        "the same for a stage that starts from the previous self-training pass's weights "
        "(pass-init warm): it starts past the plateau a fresh stage must first leave",
        modes=("lazy",),
        needs="self_training",
    )
    stop_metric: Literal["accuracy", "accuracy-or-loss"] = setting(
        "accuracy-or-loss",
        "what early stopping counts as progress: a higher validation accuracy (accuracy), or that "
        "or a lower validation loss (accuracy-or-loss)",
    )
    precompute: bool = setting(
        False,
        "gcn and sage stages aggregate their frozen inputs once a stage, so every round is a dense "
        "step (exact without input dropout; with it, the dropout hits aggregated rows)",
        modes=("lazy",),
    )
    drift_correction: DriftCorrection = setting(
        "none",
        "none, or scaffold: correct each local step by SCAFFOLD's control variates so that many "
        "local steps a round do not drift on skewed partitions (one more state sent down a round)",
    )
    halo_gradients: bool = setting(
        False,
        "eager: each client returns, with its rows, the gradient of its loss with respect to the "
        "halo rows it trained on, one round stale (PipeGCN); peers' gradients tell of the "
        "sender's labels (docs/baselines.md); on by default in eager mode",
        modes=("eager",),
    )
    self_training: int = setting(
        1,
        "extra passes over all stages, each client training on its own confident predictions as "
        "labels (lazy, centralized); the labels never leave the client",
    )
    pseudo_threshold: float = setting(
        0.6, "softmax confidence a prediction needs to become a self-training label", needs="self_training"
    )
    pseudo_per_class: int = setting(
        0,
        "the most self-training labels per predicted class and client, most confident first (0: no cap)",
        needs="self_training",
    )
    pass_init: Literal["warm", "fresh"] = setting(
        "warm",
        "where a self-training pass's stages start: warm (the previous pass's kept weights of the "
        "same layer) or fresh (new initial weights)",
        modes=("lazy",),
        needs="self_training",
    )
    profile: Literal["default", "edge", "exact"] = setting(
        "default",
        "default; edge for small clients (CPU, one thread, chunked embeddings, 8-bit payloads "
        "where those are left 32-bit); exact, one full-batch step a round with server Adam, 5 "
        "stages x 200 rounds, 32-bit (EXACT_PROFILE); a profile sets what the run left unset",
    )
    device: str = setting(
        "auto",
        "auto, cpu or cuda[:i]; auto puts a party on the GPU when there is one and its partition "
        "holds at least 4,096 nodes (below that the CPU measured faster), and the run's first "
        "lines say where each party computes",
    )
    threads: int = setting(0, "torch threads per client (0: torch's default)")
    cohorts: bool = setting(
        True,
        "in process: the clients of a round whose local steps batch exactly (few training rows "
        "or a small stage input, stage 0's MLP or a GCN stage, SGD) train and encode their "
        "updates as one computation, with each one's own result; false: each client alone",
        modes=("lazy",),
    )
    chunk_rows: int = setting(0, "compute embeddings for this many target rows at a time (0: all at once)")
    round_seconds: float = setting(
        0.0,
        "local / eager: seconds of local training per round, time-based aggregation (0: local-epochs)",
        modes=("local", "eager"),
    )
    step_delay: str = setting("", "P:seconds,...: slow client P down by that much per step (emulation)")
    out_dir: str = setting("", "the run folder for config.json, events.jsonl and summary.json (empty: none)")

    def validate(self, stages: int = 1) -> TrainingSettings:
        """Raise :class:`ValueError` naming the first bad setting; return ``self`` otherwise.

        Args:
            stages (int, optional): the run's stage count, over which the per-stage values are
                checked. (default: :obj:`1`)
        """
        check_choices(self)
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.round_seconds < 0:
            raise ValueError(f"round-seconds must be >= 0 (0: local-epochs), got {self.round_seconds}")
        if self.round_seconds and self.mode not in ("local", "eager"):
            raise ValueError(f"round-seconds applies to local and eager mode, not {self.mode}")
        check_stage_lists(self, stages)
        if self.self_training < 0 or not 0 <= self.pseudo_threshold <= 1 or self.pseudo_per_class < 0:
            raise ValueError(
                "self-training and pseudo-per-class must be >= 0 and pseudo-threshold in [0, 1], got "
                f"{self.self_training}, {self.pseudo_per_class} and {self.pseudo_threshold}"
            )
        if self.self_training > MAX_LAYERS:
            raise ValueError(f"self-training must be at most {MAX_LAYERS} passes, got {self.self_training}")
        if self.self_training and self.mode not in ("lazy", "centralized"):
            raise ValueError(f"self-training applies to lazy and centralized mode, not {self.mode}")
        if self.halo_gradients and self.mode != "eager":
            raise ValueError(f"halo-gradients applies to eager mode, not {self.mode}")
        if self.threads < 0 or self.chunk_rows < 0:
            raise ValueError("threads and chunk-rows must be >= 0")
        if not 0 < self.fraction_train <= 1:
            raise ValueError(f"fraction-train must be in (0, 1], got {self.fraction_train}")
        cap = self.clients_per_round
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
            raise ValueError(f"clients-per-round must be a whole number >= 0 (0: no cap), got {cap!r}")
        for name, samples in (
            ("fraction-train below 1", self.fraction_train < 1),
            ("clients-per-round", self.clients_per_round > 0),
        ):
            if samples and (self.mode != "lazy" or self.drift_correction != "none"):
                raise ValueError(
                    f"{name} samples a lazy run's trainers: not eager or local runs (every client "
                    "refreshes its rows each round) nor drift-correction (every control variate "
                    f"advances each round); got mode {self.mode}, drift-correction {self.drift_correction}"
                )
        every = self.validate_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"validate-every must be a whole number >= 1, got {every!r}")
        if self.patience < 0 or self.min_rounds < 0 or self.warm_min_rounds < 0:
            raise ValueError(
                "patience, min-rounds and warm-min-rounds must be >= 0, got "
                f"{self.patience}, {self.min_rounds} and {self.warm_min_rounds}"
            )
        if not 0 <= self.mlp_local_epochs <= MAX_STEPS:
            raise ValueError(f"mlp-local-epochs must be in [0, {MAX_STEPS}], got {self.mlp_local_epochs}")
        if self.mlp_weight_decay < 0:
            raise ValueError(f"mlp-weight-decay must be >= 0, got {self.mlp_weight_decay}")
        for s in range(stages):
            decay = float(stage_value("weight_decay", self.weight_decay, s))
            if decay < 0:
                raise ValueError(f"weight-decay must be >= 0, got {decay} for stage {s}")
            lr, server_lr = stage_value("lr", self.lr, s), stage_value("server_lr", self.server_lr, s)
            if lr < 0 or server_lr <= 0:
                raise ValueError(f"lr must be >= 0 and server-lr > 0, got {lr} and {server_lr} for stage {s}")
            rounds = int(stage_value("rounds", self.rounds, s))
            epochs = int(stage_value("local_epochs", self.local_epochs, s))
            if not 0 <= rounds <= MAX_ROUNDS:
                raise ValueError(f"rounds must be in [0, {MAX_ROUNDS}], got {rounds} for stage {s}")
            if epochs < 0 or (epochs == 0 and not self.round_seconds) or epochs > MAX_STEPS:
                raise ValueError(
                    f"local-epochs must be in [1, {MAX_STEPS}] (or 0 with round-seconds), got {epochs} "
                    f"for stage {s}"
                )
            if self.patience and rounds == 0:
                raise ValueError(f"patience {self.patience} needs rounds >= 1; stage {s} has 0 rounds")
        return self


@section
class FailureSettings:
    r"""Client failures (Flower engines): how many clients a run needs and how it continues.

    The ``failures`` section of :class:`TrainConfig`.
    """

    min_clients: int = setting(
        0, "continue while at least this many clients remain (0: every client; a lost client ends the run)"
    )
    on_missing_halo: Literal["fail", "zero", "reuse-last"] = setting(
        "fail", "what replaces a lost client's boundary rows"
    )
    client_timeout: float = setting(300.0, "seconds the server waits for each message's replies")
    resume: str = setting("", "a lazy run's folder (out-dir) to continue from its last checkpoint")

    def validate(self, clients: int) -> FailureSettings:
        """Raise :class:`ValueError` naming the first bad setting; return ``self`` otherwise.

        Args:
            clients (int): the run's client count, the most ``min_clients`` may be.
        """
        check_choices(self)
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


def settings() -> list[SettingInfo]:
    """Every setting of a run, section by section: name, key, type, default, doc and choices.

    What the CLI's flags and help, the docs and the check of ``pyproject.toml``'s run-config
    table read.
    """
    return [info for cls in SECTIONS.values() for info in settings_of(cls)]


#: The per-stage settings: one value for every stage, or a list with one value per stage.
PER_STAGE: tuple[str, ...] = tuple(info.name for info in settings() if info.per_stage)


def ignored_settings(cfg: TrainConfig, given: Iterable[str]) -> list[str]:
    """One line for each setting in ``given`` that ``cfg``'s run does not read: one of another
    mode (``--algorithm`` in a lazy run) or one that acts through a setting left off
    (``--secagg-threshold`` without ``--secure-aggregation``), as each declares it
    (:func:`~retexo_fl.setting.setting`'s ``modes`` and ``needs``).

    Args:
        cfg (TrainConfig): the resolved run config.
        given (Iterable[str]): the settings the user set, snake- or kebab-case.
    """
    infos = {info.name: info for info in settings()}
    lines = []
    for key in given:
        info = infos.get(key.replace("-", "_"))
        if info is None:
            continue
        if info.modes and cfg.mode not in info.modes:
            lines.append(f"{info.key} applies to {' and '.join(info.modes)} mode, not {cfg.mode}: ignored")
            continue
        if not info.needs_met(cfg):
            phrase = info.needs_phrase
            if phrase.startswith("without"):  # "name=": the dataset's settings beside --partitions
                lines.append(f"{info.key} is read only {phrase}: ignored")
            else:
                lines.append(f"{info.key} acts {phrase} only: ignored")
    names = {key.replace("-", "_") for key in given}
    sprint = "first_stage_sprint" in names and cfg.first_stage_sprint > 0 and cfg.first_stage == "auto"
    if cfg.mode == "lazy" and sprint and cfg.first_stage_schedule != "parallel":
        # A lane of the parallel schedule: its own `needs` names first-stage auto alone.
        lines.append("first-stage-sprint acts with first-stage-schedule parallel only: ignored")
    if cfg.mode == "lazy" and "server_lr" in names:
        # Per stage: a stage whose server optimizer is avg applies the averaged update as it is.
        avg = [str(s) for s in range(cfg.stages) if cfg.per_stage("server_optimizer", s) == "avg"]
        if avg:
            where = (
                "at any stage"
                if len(avg) == cfg.stages
                else f"at stage{'s' * (len(avg) > 1)} {', '.join(avg)}"
            )
            lines.append(
                f"server-lr is not read {where}: server-optimizer avg takes no learning rate there "
                "(server-optimizer adam does)"
            )
    return lines


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

#: ``--profile edge`` (small clients: phones, gateways): the CPU, one torch thread, embeddings
#: computed 4,096 target rows at a time and 8-bit boundary rows, each where the run does not set it;
#: :meth:`TrainConfig.resolve` also makes a mode's 32-bit updates and broadcasts (eager, local) 8-bit.
EDGE_PROFILE: dict[str, Any] = {"device": "cpu", "threads": 1, "chunk_rows": 4096, "bits": 8}

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


#: What one node per client (``--method node``, lazy mode) changes from the lazy defaults: the
#: server's Adam in every stage, not only stage 0. A client's round there is one example's
#: steps, and FedAvg of such updates at server-lr 1 made the GCN stages swing: on CiteSeer
#: (seed 1) stage 1 validated at 0.560 and its loss rose from 1.2 to 2.4 in 12 rounds. Chosen on
#: validation over Cora and CiteSeer x 3 seeds against the lazy defaults, a lower client lr in
#: the GCN stages and higher pseudo-label thresholds
#: (``bench/results/node-round-structure-2026-11-27.jsonl``). And at most 512 trainers a round:
#: a self-training pass trains every confident node, a client each at this level (1,474 on Cora),
#: and a sample of 512 had the better worst seed (0.804 against 0.800 on Cora, 0.714 against
#: 0.712 on CiteSeer; 3 of the 6 seeds validated up to 0.8 points lower) in about half the
#: time; 256 validated 1-2 points lower
#: (``bench/results/node-clients-per-round-2026-11-27.jsonl``). Not where every client must take
#: every round (secure aggregation, DP, drift correction): :meth:`TrainConfig.resolve` leaves it.
NODE_LEVEL_DEFAULTS: dict[str, Any] = {
    "server_optimizer": "adam",
    "server_lr": 0.05,
    "clients_per_round": 512,
}

#: What a lazy run over partitions (not one node per client, not ``--profile exact``) changes from the
#: section defaults: stage 0 trained as the local layer and, racing it, as the MLP, the better validation
#: kept (``first-stage auto``; its order and race are the section defaults: local first, the MLP stopped
#: after 8 rounds more than 2 points behind). Over every shared graph x 4 METIS, 10 random and 10
#: label-skew clients x 3 seeds, side by side with stage 0 as the MLP: the worst cell's validation gap to
#: the best centralized reference -6.6 -> -6.2 points, the mean's -0.68 -> +0.04, mean test gap -0.72 ->
#: +0.17, at 114 rounds a run instead of 101; Cora with 10 random clients 0.813 in 102 rounds against
#: 0.821 in 93 (``bench/results/robustness-2026-11-29-s16-*.jsonl``; with dropout masks hashed since,
#: another draw of the same randomness: 0.822 in 99 rounds, ``-s22-hashed.jsonl``). Not at one node per
#: client (a client's own subgraph is its node: local is the MLP), nor with secure aggregation (a client
#: masks a stage's rounds once), DP noise (a second stage 0 would spend privacy budget) or boundary noise
#: (a local stage 0's row mixes same-client neighbours' features, which the per-row privacy figure does
#: not account): :meth:`TrainConfig.resolve` leaves those at mlp.
#:
#: And one local step a round when stage 0 is the MLP (``mlp-local-epochs 1``; the local layer keeps
#: ``local-epochs``): on the 183-node WebKB graphs (~9 training nodes a client with 10 clients) the
#: federated MLP with five steps validated 5.0 points below the centralized MLP on average over the
#: 9 cells, 4.2 with one. Over the same sweep, with self-training labels from the best stage so far,
#: side by side with five steps: the worst cell's validation gap -6.8 -> -6.2, the mean +0.16 ->
#: +0.23, mean test gap +0.47 -> +0.61, 116 -> 113 rounds; Cora with 10 random clients unchanged
#: (0.822 in 99 rounds: the local layer wins its stage 0 there). Against it: Twitch ES 1.4-1.9
#: points lower on validation in every partitioning, Twitch TW random-10 3.0 lower on test. One
#: step for every layer-0 stage, the local layer's too, tested +0.80 but took Cora to 111 rounds
#: (``bench/results/robustness-2026-11-29-s24-*.jsonl``).
#:
#: And weight decay 5e-3 for an MLP stage 0 (``mlp-weight-decay``; the local layer and the GNN stages keep
#: ``weight-decay`` 5e-4): the tuned centralized MLP chose 5e-3 on 11 of 13 graphs, and on Cornell with 10
#: label-skew clients (seed 0) the federated MLP's validation peaked at round 8 (0.797) with 5e-4, at round
#: 30 (0.847) with 5e-3. Over every shared graph x partitioning x 3 seeds, side by side with 5e-4: the
#: worst cell's validation gap -6.2 -> -5.1 points, the mean +0.23 -> +0.44, mean test gap +0.61 -> +0.85,
#: 113 -> 115 rounds; Cora's headline run unchanged. Against it: Twitch TW 4 METIS and 10 random test 2.1
#: and 1.1 points lower (validation 0.3 and 0.1 lower), Texas with 10 random clients 3.6 lower (validation
#: 1.7 lower). 5e-3 for every layer-0 stage, the local layer's too, took Cora with 10 random clients to 104
#: rounds (``bench/results/robustness-2026-11-30-s25-*.jsonl``).
#:
#: And the two trainings of stage 0 in the same rounds (``first-stage-schedule parallel``): the same
#: trainings, choice and bytes, stage 0 at the longer one's rounds instead of their sum. Cora with 10
#: random clients over seeds 0-9: every test accuracy and byte count as one after the other, 106.9 ->
#: 94.7 rounds (``bench/results/robustness-2026-12-01-s41-parallel-*.jsonl``).
#:
#: And a GNN stage's input scaled up on each client to a root mean square of 0.25 where its own rows'
#: is below it (``gnn-input-rms-floor``): Twitch TW's stage-0 embeddings come out at 0.12 (Cora's at
#: 0.90), and its GCN stages stayed at the majority class. Over every shared graph x partitioning x
#: 3 seeds, side by side with 0: the worst cells unchanged (validation -5.1, test -6.3, WebKB), the
#: mean validation gap +0.44 -> +0.46, mean test gap +0.85 -> +0.90, cells more than 3 points below
#: 5 -> 3 (Twitch TW random-10 -4.3 -> -1.7, squirrel 4 METIS -4.2 -> -1.2), 114.5 -> 113.3 rounds;
#: Cora and CiteSeer the same runs. Against it: Twitch ENGB random-10 1.1 points lower, USA random-10
#: 0.7 lower, Tolokers 13-20 more rounds. A floor of 0.5 took Cora with 10 random clients to 102.7
#: rounds (``bench/results/robustness-2026-11-30-s27-*.jsonl``).
#:
#: And a local stage 0 over two hops of the client's own subgraph (``local-hops 2``: its input
#: propagated once over the client's own edges; nothing crosses). Over every shared graph x
#: partitioning x 3 seeds, side by side with 1: the worst cells unchanged (Texas random-10 and
#: Cornell label-skew -6.3, MLP stage 0s), cells more than 3 points below 4 -> 3 (Twitch TW 4 METIS
#: -3.7 -> -2.0; over its 10 splits -3.5 -> -3.2), more than 1 point below 13 -> 10, mean test gap
#: +1.15 -> +1.31. Against it: the USA and Europe airports cells 0.7-2.2 points lower, Brazil
#: label-skew 2.6, CiteSeer 4 METIS 1.1, Cora with 10 random clients 0.815 -> 0.810 over seeds 0-9
#: (94.7 -> 91.6 rounds), Cora 10 METIS 0.810 -> 0.803
#: (``bench/results/robustness-2026-12-01-s42-hops2*.jsonl``).
#:
#: And a third lane of stage 0, the sprint (``first-stage-sprint 8``: the local layer over three
#: hops of the client's own subgraph, dropout 0.2, 8 rounds), a candidate for the delivered model
#: that is never embedded: it reaches Cora's slow-link target in stage 0 (``bench/wan_compare.py``).
#: Over every shared graph x partitioning x 3 seeds, side by side with the rows without it: 123 of
#: 126 runs deliver the same model; validation's worst cell unchanged (-5.1), mean validation gap
#: +0.96 -> +0.97, mean test gap +1.31 -> +1.30. Against it: 30.6 -> 35.6 MB a run (Cora with 10
#: random clients, seeds 0-9, 30.5 -> 35.8, the same models), and USA label-skew -2.4 -> -3.2 on
#: test (one seed delivered the sprint, validating 0.5 points higher and testing 2.5 lower)
#: (``bench/results/robustness-2026-12-02-s46-sprint8.jsonl``).
LAZY_PARTITION_DEFAULTS: dict[str, Any] = {
    "first_stage": "auto",
    "first_stage_schedule": "parallel",
    "first_stage_sprint": 8,
    "local_hops": 2,
    "mlp_local_epochs": 1,
    "mlp_weight_decay": 5e-3,
    "gnn_input_rms_floor": 0.25,
}


def _flat_fields(cls: type) -> type:
    """Make ``cls`` a dataclass with every section's settings as its own flat fields.

    Each field is the section's own (type, default and doc in its metadata), so a setting is
    declared once, in its section; ``cls``'s own fields (``extra``) follow them.
    """
    own = inspect.get_annotations(cls)
    flat: dict[str, Any] = {}
    for section_cls in SECTIONS.values():
        for f in dataclasses.fields(section_cls):
            flat[f.name] = f.type
            kept = {"default": f.default} if f.default is not dataclasses.MISSING else {}
            if f.default_factory is not dataclasses.MISSING:
                kept = {"default_factory": f.default_factory}
            setattr(cls, f.name, field(**kept, metadata=f.metadata))
    cls.__annotations__ = {**flat, **own}
    return dataclass(cls)


@_flat_fields
class TrainConfig:
    """Every setting of a training run, flat; kebab-case names are the run-config / CLI keys.

    The fields are those of the sections (:data:`SECTIONS`), where each is declared once with
    its type, default and doc, and read back grouped (``cfg.data``, ``cfg.architecture``,
    ``cfg.training``, ``cfg.compression``, ``cfg.security``, ``cfg.failures``,
    ``cfg.datacenter``). Per-stage settings (``rounds``, ``local_epochs``, ``lr``,
    ``server_lr``, ``dropout``, ``input_dropout``) take one value for every stage or a list with
    one value per stage. ``extra`` holds free-form settings outside every section.

    A ``TrainConfig(...)`` is exactly what it is given, every other field at its section's
    default: the lazy defaults. A mode's or profile's own defaults are applied by one function,
    :meth:`resolve`, which the CLI, the run config (:meth:`from_mapping`, :meth:`from_run_config`)
    and :meth:`from_sections` use: ``TrainConfig.resolve(mode="eager")`` is eager's default run.
    ``TrainConfig(mode="eager")`` is lazy's settings in eager mode (and fails :meth:`validate`:
    lazy's self-training pass does not apply to eager).
    """

    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def resolve(cls, **given: Any) -> TrainConfig:
        """The configuration of a run given ``given``: mode and profile defaults for the rest.

        In order: ``profile exact`` sets :data:`EXACT_PROFILE`, then ``mode`` sets its
        :data:`MODE_DEFAULTS`, then a lazy run at one node per client (``method node``, no
        exact profile) :data:`NODE_LEVEL_DEFAULTS` and any other lazy run without the exact
        profile, secure aggregation, DP noise or boundary noise :data:`LAZY_PARTITION_DEFAULTS`,
        each only where ``given`` has no value (``clients_per_round`` not with secure
        aggregation, DP noise or drift correction, which take every client every round);
        ``boundary-noise`` turns eager's halo gradients off unless they were given (noised rows
        with raw gradients back would undo the noise); ``profile edge`` sets
        :data:`EDGE_PROFILE`. What ``given`` names is kept as given.

        Args:
            **given: settings by snake-case name (those a user, a run config or a caller set).
        """
        # A folder given as a Path is text in config.json and in the messages' configs.
        given = {k: os.fspath(v) if isinstance(v, os.PathLike) else v for k, v in given.items()}
        defaults = cls()
        profile = given.get("profile", defaults.profile)
        mode = given.get("mode", defaults.mode)
        values: dict[str, Any] = {}
        if profile == "exact":
            values.update(EXACT_PROFILE)
        values.update(MODE_DEFAULTS.get(mode, {}))
        secure = given.get("secure_aggregation", defaults.secure_aggregation)
        noised = _positive(given.get("dp_noise", defaults.dp_noise))
        rows_noised = _positive(given.get("boundary_noise", defaults.boundary_noise))
        node_level = given.get("method", defaults.method) == "node"
        if mode == "lazy" and profile != "exact" and node_level:
            values.update(NODE_LEVEL_DEFAULTS)
            drift = given.get("drift_correction", defaults.drift_correction) != "none"
            every_round = secure or noised or drift
            if every_round:  # each needs every client in every round: no sample to cap
                values.pop("clients_per_round")
        if mode == "lazy" and profile != "exact" and not (node_level or secure or noised or rows_noised):
            values.update(LAZY_PARTITION_DEFAULTS)
        if rows_noised:
            values["halo_gradients"] = False
        if profile == "edge":
            values.update(EDGE_PROFILE)
            for key in ("update_bits", "broadcast_bits"):  # eager's and local's 32-bit models
                if values.get(key, getattr(defaults, key)) == 32:
                    values[key] = 8
        values.update(given)
        return cls(**values)

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

    @property
    def first_stage_order(self) -> tuple[str, ...]:
        """The order in which ``first-stage auto`` trains the layer-0 variants."""
        first = self.first_stage_first
        return (first, *(v for v in FIRST_STAGE_VARIANTS if v != first))

    @property
    def first_stage_lanes(self) -> tuple[str, ...]:
        """What ``first-stage auto`` trains stage 0 as, in order: :attr:`first_stage_order`, and
        the sprint (:data:`SPRINT`) last when ``first-stage-sprint`` trains one (in parallel only)."""
        sprint = self.first_stage_sprint > 0 and self.first_stage_schedule == "parallel"
        return (*self.first_stage_order, *((SPRINT,) if sprint else ()))

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
        parts = self.sections()  # built once: a client validates every message's config
        for part in parts.values():  # types first: a range check compares numbers
            check_choices(part)
        parts["training"].validate(stages=self.stages)
        parts["architecture"].validate()
        parts["data"].validate()
        parts["compression"].validate()
        parts["security"].validate()
        parts["failures"].validate(clients=self.clients)
        federated = self.mode in ("lazy", "eager", "local")
        if self.drift_correction != "none" and (self.dp_noise > 0 or not federated):
            raise ValueError(
                "drift-correction scaffold trains federated modes (lazy, eager, local) without "
                "dp-noise: control variates derived from clipped, noised updates are not supported"
            )
        if (self.fraction_train < 1 or self.clients_per_round > 0) and (
            self.dp_noise > 0 or self.secure_aggregation
        ):
            raise ValueError(
                "fraction-train below 1 or clients-per-round with dp-noise or secure-aggregation: DP's "
                "accounting and secure aggregation's masking set take every client in every round"
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
            if self.round_seconds:
                raise ValueError(
                    "secure-aggregation with round-seconds: a time-based round's step count "
                    "travels in clear, and a crafted state can slow a client's arithmetic where its "
                    "values are subnormal; use local-epochs"
                )
            if self.bit_policy != "fixed":
                raise ValueError(
                    f"secure-aggregation with bit-policy {self.bit_policy}: adaptive widths follow "
                    "each row's values, and the widths and frame sizes the server sees would count "
                    "a client's rows past a threshold of its choosing; use bit-policy fixed"
                )
            if self.clients > MAX_SECAGG_CLIENTS:
                raise ValueError(
                    f"secure-aggregation with {self.clients} clients: every client masks with every "
                    f"other (a complete graph), refused above {MAX_SECAGG_CLIENTS} clients, where "
                    "the server's unmasking measured 4.5 s a round and growing faster than the "
                    "square of the clients (a sparse SecAgg+-style masking graph is not implemented)"
                )
            if self.secagg_threshold and not least <= self.secagg_threshold <= self.clients:
                raise ValueError(
                    f"secagg-threshold must be {least} to {self.clients} for {self.clients} clients "
                    "(0: the least safe one)"
                )
        if self.first_stage != "mlp" and self.mode != "lazy":
            raise ValueError(f"first-stage {self.first_stage} applies to lazy mode, not {self.mode}")
        if self.first_stage == "auto" and self.secure_aggregation:
            raise ValueError(
                "first-stage auto trains stage 0 twice, and under secure-aggregation a client "
                "masks each stage's rounds once, in order: use first-stage mlp or local"
            )
        if self.model == "mlp" and self.mode != "centralized":
            raise ValueError("model mlp (the graph-free reference) trains in centralized mode only")
        # Only a data-center run needs procs to form the algorithm's process grid.
        parts["datacenter"].validate(grid=self.mode == "datacenter")
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
                near = difflib.get_close_matches(name.lower(), sorted(names), n=1)
                hint = f" (did you mean {near[0].replace('_', '-')!r}?)" if near else ""
                raise ValueError(f"unknown setting {key!r}{hint}")
            kwargs[name] = parse_list(value) if name in PER_STAGE else value
        return cls.resolve(**kwargs).validate()

    @classmethod
    def from_run_config(cls, values: dict[str, Any], overridden: Iterable[str] | None = None) -> TrainConfig:
        """Build from a Flower run config.

        Flower merges ``[tool.flwr.app.config]`` into every run config, so every key arrives;
        those at their section's default must leave room for the mode's and profile's own
        defaults (``--run-config "mode='eager'"`` gets eager's). A key counts as given when its
        value is not its section's default (an edited ``pyproject.toml`` is honoured: the app's
        ``out-dir``, a ``hidden = 64``), or, with ``overridden``, when the submitter set it
        (Flower's ``Run.override_config``), whatever its value: ``hidden=32`` in eager mode is
        kept although it is the lazy default. Without ``overridden``, such a value set on
        purpose is taken as the mode's default.

        Args:
            values (dict): the run config, kebab-case keys.
            overridden (Iterable[str], optional): the keys the run's submitter set.
                (default: :obj:`None`)
        """
        defaults = {
            f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            for f in dataclasses.fields(cls)
        }
        given = None if overridden is None else {k.replace("-", "_") for k in overridden}
        kept = {}
        for key, value in values.items():
            name = key.replace("-", "_")
            if name not in ("mode", "profile") and name in defaults:
                parsed = parse_list(value) if name in PER_STAGE else value
                if parsed == defaults[name] and (given is None or name not in given):
                    continue
            kept[key] = value
        return cls.from_mapping(kept)

    @classmethod
    def from_sections(cls, extra: dict[str, Any] | None = None, **sections: Any) -> TrainConfig:
        """Build from section objects by name (see :data:`SECTIONS`); an omitted one takes the
        defaults of the given mode and profile (:meth:`resolve`).

        Args:
            extra (dict, optional): free-form settings outside every section. (default: :obj:`None`)
            **sections: e.g. ``data=DataSettings(dataset="CiteSeer")``.
        """
        kwargs: dict[str, Any] = {"extra": dict(extra or {})}
        for name, given in sections.items():
            want = SECTIONS.get(name)
            if want is None:
                raise ValueError(f"unknown section {name!r}; sections: {', '.join(SECTIONS)}")
            if not isinstance(given, want):
                raise TypeError(f"section {name!r} must be a {want.__name__}, got {type(given).__name__}")
            kwargs.update(dataclasses.asdict(given))
        # Every setting of a given section counts as given; the mode's and profile's defaults
        # fill the sections left out.
        return cls.resolve(**kwargs).validate()


def parse_list(value: Any) -> Any:
    """``"200,100"`` -> ``[200, 100]``, ``"adam,avg"`` -> ``["adam", "avg"]``; numbers and lists
    pass through, and an item that is not a number stays a string (its setting's check names it)."""
    if isinstance(value, str):
        items = [_number_or_text(v) for v in value.replace(" ", "").split(",") if v]
        return items[0] if len(items) == 1 else items
    return value


def _number_or_text(text: str) -> int | float | str:
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text
