"""The in-process lazy (RETEXO) engine: every client of a partitioned graph in one process, no Flower."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from retexo_fl.config import TrainConfig
from retexo_fl.coordinator.stages import LazyStageMachine
from retexo_fl.data.partition import Partition, check_cross_consistency, map_partitions
from retexo_fl.metrics import RunRecorder
from retexo_fl.party.lazy_client import LazyClient
from retexo_fl.records import StateDict
from retexo_fl.summary import RunSummary
from retexo_fl.training.inprocess import InProcessTransport


def run_lazy(
    parts: Sequence[Partition],
    cfg: TrainConfig,
    rec: RunRecorder | None = None,
    on_stage: Callable[[int, StateDict], None] | None = None,
) -> RunSummary:
    """Lazy message passing over ``parts`` in one process; returns the run summary.

    The same :class:`~retexo_fl.coordinator.stages.LazyStageMachine` the Flower ServerApp runs,
    over an :class:`~retexo_fl.training.inprocess.InProcessTransport`.

    Args:
        parts (Sequence[Partition]): every client's partition.
        cfg (TrainConfig): the run configuration (``clients`` is taken from ``parts``).
        rec (RunRecorder, optional): where events and progress go. (default: silent)
        on_stage (Callable[[int, StateDict], None], optional): sees each stage's kept
            (best-validation) weights. (default: :obj:`None`)
    """
    rec = rec or RunRecorder(None, stream=None)
    check_cross_consistency(list(parts))
    cfg = with_clients(cfg, len(parts))
    if cfg.threads:  # here: clients built on pool threads would set it for those threads only
        torch.set_num_threads(cfg.threads)
    transport = InProcessTransport(map_partitions(lambda p: LazyClient(p, cfg), parts))
    return LazyStageMachine(transport, cfg, rec, on_stage=on_stage).run()


def with_clients(cfg: TrainConfig, count: int) -> TrainConfig:
    """``cfg`` for ``count`` clients (in process, the partitions say how many there are)."""
    if cfg.clients == count:
        return cfg
    return dataclasses.replace(cfg, clients=count, min_clients=min(cfg.min_clients, count))
