"""The in-process baselines: eager (standard federated GNN, halo refresh every round) and local (TMA)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from retexo_fl.config import TrainConfig
from retexo_fl.coordinator.baseline_run import BaselineRun
from retexo_fl.data.partition import Partition, check_cross_consistency, map_partitions
from retexo_fl.metrics import RunRecorder
from retexo_fl.party.eager_client import EagerClient
from retexo_fl.summary import RunSummary
from retexo_fl.training.inprocess import InProcessTransport
from retexo_fl.training.lazy import with_clients


def run_eager(
    parts: Sequence[Partition], cfg: TrainConfig, rec: RunRecorder | None = None, local: bool = False
) -> RunSummary:
    """Eager (or, with ``local``, local-only) federated training in one process; returns the summary.

    The same :class:`~retexo_fl.coordinator.baseline_run.BaselineRun` the Flower ServerApp runs, over an
    :class:`~retexo_fl.training.inprocess.InProcessTransport`.

    Args:
        parts (Sequence[Partition]): every client's partition.
        cfg (TrainConfig): the run configuration.
        rec (RunRecorder, optional): where events and progress go. (default: silent)
        local (bool, optional): drop cross edges (local mode). (default: :obj:`False`)
    """
    rec = rec or RunRecorder(None, stream=None)
    check_cross_consistency(list(parts))
    cfg = with_clients(cfg, len(parts))
    mode = "local" if local else "eager"
    if cfg.mode != mode:
        # Another mode's config would train with that mode's defaults: say so rather than guess.
        raise ValueError(
            f"run_eager(local={local}) trains mode {mode}, but the config's mode is {cfg.mode}: "
            f"build it with TrainConfig.resolve(mode={mode!r}, ...)"
        )
    if cfg.threads:  # here: clients built on pool threads would set it for those threads only
        torch.set_num_threads(cfg.threads)
    transport = InProcessTransport(map_partitions(lambda p: EagerClient(p, cfg, local), parts))
    return BaselineRun(transport, cfg, rec).run()
