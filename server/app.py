"""Flower ServerApp: the library's lazy stage machine or baseline round loop over the Grid transport."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable
from logging import WARNING
from pathlib import Path

from flwr.app import Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from clients.flower_patch import shorten_object_pulls
from retexo_fl.config import TrainConfig, ignored_settings
from retexo_fl.coordinator.baseline_run import BaselineRun
from retexo_fl.coordinator.stages import LazyStageMachine
from retexo_fl.metrics import RunRecorder, human_bytes
from retexo_fl.plots import write_plots
from retexo_fl.runner import check_out_dir
from retexo_fl.summary import RunSummary
from server.checkpoint import FileCheckpoints, resumed_config
from server.grid_transport import GridTransport

# `flwr run`'s simulation starts Ray, whose init warns of a default change for actors given no
# GPU (they run on the CPU here either way): nobody running the app can act on it.
warnings.filterwarnings("ignore", message="Tip: In future versions of Ray", category=FutureWarning)

app = ServerApp()


def run_server(grid: Grid, cfg: TrainConfig) -> RunSummary:
    """Run a job on ``grid`` (or resume the one in ``cfg.resume``) and write the run folder.

    Args:
        grid (Grid): the ServerApp's grid.
        cfg (TrainConfig): the run configuration (``mode`` lazy, eager or local).

    Raises:
        ValueError: a mode the Flower app does not run, or a folder that cannot be resumed.
        ClientFailure: a client was lost and the failure policy ends the run.
    """
    if cfg.resume:
        cfg = resumed_config(cfg)
    if cfg.mode not in ("lazy", "eager", "local"):
        raise ValueError(f"the Flower app runs lazy, eager and local mode; {cfg.mode} runs in process")
    if not cfg.resume:
        check_out_dir(cfg)  # before anything is written: a finished run's folder stays as it is
    rec = RunRecorder(cfg.out_dir or None, append=bool(cfg.resume))
    if cfg.out_dir:
        rec.progress(f"run folder {cfg.out_dir}")
    if not cfg.resume:
        rec.write_json("config.json", cfg.to_dict())
    transport = GridTransport(grid, cfg.client_timeout)
    if cfg.mode == "lazy":
        store = FileCheckpoints(cfg.out_dir) if cfg.out_dir else None
        summary = LazyStageMachine(transport, cfg, rec, store).run(resume=bool(cfg.resume))
    else:
        summary = BaselineRun(transport, cfg, rec).run()
    rec.write_json("summary.json", summary.to_dict())
    if cfg.out_dir:
        write_plots(summary, cfg.out_dir)
    rec.progress(
        f"test accuracy {summary.accuracy_text()}  boundary {human_bytes(summary.bytes_boundary)}"
        f"  model {human_bytes(summary.bytes_model)}  in {summary.wall_seconds:.1f}s"
    )
    return summary


def run_folder(cfg: TrainConfig, overridden: Iterable[str], run_id: int) -> TrainConfig:
    """``cfg`` with the folder this Flower run writes: the app's ``out-dir`` (``runs/flwr``) is
    where every run's own folder goes (``runs/flwr/run-<Flower run id>``), so that no run writes
    over another's; an ``out-dir`` the submitter set, or a resumed run's folder, is the run's own.

    Args:
        cfg (TrainConfig): the run config.
        overridden (Iterable[str]): the run-config keys the submitter set.
        run_id (int): Flower's id of this run.
    """
    if not cfg.out_dir or "out-dir" in set(overridden):
        return cfg
    if cfg.resume:  # the app's folder of runs is not this run's: a resumed run writes in its own
        return dataclasses.replace(cfg, out_dir="")
    return dataclasses.replace(cfg, out_dir=str(Path(cfg.out_dir) / f"run-{run_id}"))


@app.main()
def main(grid: Grid, context: Context) -> None:
    """The ServerApp's entry point: the run config is the federation's ``[tool.flwr.app.config]``."""
    shorten_object_pulls()  # replies' objects: retry after 20 ms, not Flower's 1 s
    # The keys the submitter set count as given, whatever their value (the rest are pyproject's).
    overridden = list(grid.run.override_config.keys())
    cfg = TrainConfig.from_run_config(dict(context.run_config), overridden)
    for line in ignored_settings(cfg, overridden):
        log(WARNING, "run config %s", line)
    run_server(grid, run_folder(cfg, overridden, grid.run.run_id))
