"""Run the retexo-fl ServerApp and ClientApp in Flower's simulation engine from Python."""

from __future__ import annotations

import os
from pathlib import Path

from flwr.serverapp import ServerApp

from clients.app import app as client_app
from clients.node import WORK_DIR_ENV
from retexo_fl.config import TrainConfig
from server.app import run_server
from server.checkpoint import resumed_config


def simulate(cfg: TrainConfig, *, cpus_per_client: float = 1.0, work_dir: str | Path | None = None) -> dict:
    """Run one lazy, eager or local job through Flower's simulation engine (Ray) and return its summary.

    Flower's Python ``run_simulation`` API passes no run config, so the config travels in the
    ServerApp's closure; ``flwr run .`` uses ``server.app:app`` with ``[tool.flwr.app.config]``.
    This is the ``simulation`` engine of the ``retexo_fl.engines`` entry-point group, which
    ``retexo-fl train --engine simulation`` looks up.

    Args:
        cfg (TrainConfig): the run configuration.
        cpus_per_client (float, optional): CPUs Ray reserves per virtual node. (default: ``1.0``)
        work_dir (str or Path, optional): the base of the virtual nodes' work folders (their saved
            state and cached partitions); else ``$RETEXO_FL_WORK_DIR`` or the temp folder.
            (default: :obj:`None`)
    """
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
    # Flower's simulation engine imports Ray: only when a simulation runs.
    from flwr.simulation import run_simulation

    if cfg.resume:  # the federation's size comes from the run being resumed
        cfg = resumed_config(cfg)

    result: dict = {}
    server_app = ServerApp()

    @server_app.main()
    def _main(grid, context) -> None:
        result.update(run_server(grid, cfg))

    # Ray's workers inherit the driver's environment when run_simulation starts them.
    previous = os.environ.get(WORK_DIR_ENV)
    if work_dir is not None:
        os.environ[WORK_DIR_ENV] = str(work_dir)
    try:
        run_simulation(
            server_app=server_app,
            client_app=client_app,
            num_supernodes=cfg.clients,
            backend_config={
                "client_resources": {"num_cpus": cpus_per_client},
                "init_args": {"num_cpus": os.cpu_count() or 1},
            },
        )
    finally:
        if work_dir is not None:
            if previous is None:
                os.environ.pop(WORK_DIR_ENV, None)
            else:
                os.environ[WORK_DIR_ENV] = previous
    if "test_accuracy" not in result:
        raise RuntimeError(
            "the Flower simulation ended without a summary (see the log above for the ServerApp error)"
        )
    return result
