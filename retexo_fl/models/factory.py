"""Model factories: the one place a run's stage models and eager models are built and seeded."""

from __future__ import annotations

import threading

import torch

from retexo_fl.config import FIRST_STAGE_VARIANTS, SPRINT, TrainConfig
from retexo_fl.models.layered import LayeredGNN
from retexo_fl.models.split import SplitGNN
from retexo_fl.models.stage import StageModel
from retexo_fl.seeding import derive_seed

#: The seed tag of the eager / local model's initial weights.
EAGER_INIT_TAG = 0xE0
#: The seed tag of a lazy stage model's initial weights.
STAGE_INIT_TAG = 0xA11
#: Held while a model's initial weights are drawn from torch's global generator after seeding it:
#: two runs built side by side in one process (two servers, or a node worker's two runs) would
#: otherwise draw from each other's seeded stream.
_INIT_LOCK = threading.Lock()


def stage_input_dim(cfg: TrainConfig, stage: int, num_features: int, num_classes: int) -> int:
    """Width of what lazy ``stage`` reads: raw features at layer 0, else the previous stage's output.

    Args:
        cfg (TrainConfig): the run configuration (``pass-embedding``, ``hidden``, ``stages``).
        stage (int): the stage, counted over self-training passes.
        num_features (int): raw feature width.
        num_classes (int): number of classes (the logits' width).
    """
    if cfg.layer(stage) == 0:
        return num_features
    return cfg.hidden if cfg.pass_embedding == "hidden" else num_classes


def first_stage_kind(cfg: TrainConfig, first_stage: str | None = None) -> str:
    """What a layer-0 stage is: ``mlp`` or ``local`` (``first-stage``; under ``auto`` the variant
    the run is trying or chose, ``first_stage``; ``first-stage-sprint``'s lane is ``local``).

    Args:
        cfg (TrainConfig): the run configuration.
        first_stage (str, optional): the variant ``first-stage auto`` is at. (default: :obj:`None`)

    Raises:
        ValueError: ``first-stage auto`` without a variant, or a variant that is not one.
    """
    if first_stage is None:
        if cfg.first_stage == "auto":
            raise ValueError("first-stage auto: a layer-0 stage needs the variant it is at (mlp or local)")
        return cfg.first_stage
    if first_stage == SPRINT and SPRINT in cfg.first_stage_lanes:
        return "local"
    if first_stage not in FIRST_STAGE_VARIANTS:
        raise ValueError(
            f"first-stage variant {first_stage!r} is not one of {', '.join(cfg.first_stage_lanes)}"
        )
    return first_stage


def stage_model_spec(
    cfg: TrainConfig, stage: int, in_dim: int, num_classes: int, first_stage: str | None = None
) -> tuple:
    """What :func:`build_stage_model`'s module is built from, as a hashable tuple: equal specs
    give modules of one architecture (their weights differ only by the seed).

    Args:
        cfg (TrainConfig): the run configuration.
        stage (int): the stage, counted over self-training passes.
        in_dim (int): input width (:func:`stage_input_dim`).
        num_classes (int): number of classes.
        first_stage (str, optional): a layer-0 stage's variant under ``first-stage auto``
            (:func:`first_stage_kind`). (default: :obj:`None`)
    """
    layer = cfg.layer(stage)
    sprint = layer == 0 and first_stage == SPRINT
    return (
        "mlp" if layer == 0 and first_stage_kind(cfg, first_stage) == "mlp" else cfg.model,
        in_dim,
        cfg.hidden,
        num_classes,
        float(cfg.first_stage_sprint_dropout if sprint else cfg.per_stage("dropout", layer)),
        float(cfg.per_stage("input_dropout", layer)),
        cfg.norm,
        cfg.heads,
        cfg.root_weight,
    )


def build_stage_model(
    cfg: TrainConfig, stage: int, in_dim: int, num_classes: int, first_stage: str | None = None
) -> StageModel:
    """The stage-``stage`` model of a lazy run; its weights are a pure function of the seed and stage.

    A self-training pass repeats the stack: its layers are built as the first pass's are, from
    fresh initial weights. Seeds torch's global CPU generator (every engine does the same).

    Args:
        cfg (TrainConfig): the run configuration.
        stage (int): the stage, counted over self-training passes.
        in_dim (int): input width (:func:`stage_input_dim`).
        num_classes (int): number of classes.
        first_stage (str, optional): a layer-0 stage's variant under ``first-stage auto``
            (:func:`first_stage_kind`). (default: :obj:`None`)
    """
    # The CPU generator only (models are built on the CPU): torch.manual_seed would also queue the
    # seed for every accelerator not initialised, formatting a stack trace for each (0.13 ms a
    # call against 1.4 us, measured alone), once per client and stage.
    kind, in_dim, hidden, classes, dropout, input_dropout, norm, heads, root_weight = stage_model_spec(
        cfg, stage, in_dim, num_classes, first_stage
    )
    with _INIT_LOCK:  # seeded and drawn with no other thread's draws between
        torch.random.default_generator.manual_seed(derive_seed(cfg.seed, stage, STAGE_INIT_TAG))
        return StageModel(
            kind,
            in_dim,
            hidden,
            classes,
            dropout=dropout,
            input_dropout=input_dropout,
            norm=norm,
            heads=heads,
            root_weight=root_weight,
        )


def build_layered_model(cfg: TrainConfig, num_features: int, num_classes: int) -> LayeredGNN | SplitGNN:
    """The eager / local baselines' GNN of ``stages - 1`` conv layers, with the run's initial weights.

    ``eager-model`` picks the centralized reference's GNN split at its linear maps
    (:class:`SplitGNN`) or an MLP encoder, the convs and a head (:class:`LayeredGNN`).

    Seeds torch's global generator, so the server and every client build the same weights.

    Args:
        cfg (TrainConfig): the run configuration.
        num_features (int): raw feature width.
        num_classes (int): number of classes.
    """
    with _INIT_LOCK:
        torch.manual_seed(derive_seed(cfg.seed, EAGER_INIT_TAG))
        if cfg.architecture.split_eager_model():
            return SplitGNN(
                cfg.model,
                num_features,
                cfg.hidden,
                num_classes,
                layers=cfg.stages - 1,
                dropout=float(cfg.per_stage("dropout", 1)),
                norm=cfg.norm,
            )
        return LayeredGNN(
            cfg.model,
            num_features,
            cfg.hidden,
            num_classes,
            layers=cfg.stages,
            dropout=float(cfg.per_stage("dropout", 1)),
            norm=cfg.norm,
            heads=cfg.heads,
        )
