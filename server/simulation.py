"""Run the retexo-fl ServerApp and ClientApp in Flower's simulation engine from Python."""

from __future__ import annotations

import os

from retexo_fl.config import TrainConfig


def simulate(cfg: TrainConfig, *, cpus_per_client: float = 1.0) -> dict:
    """Run one lazy, eager or local job through Flower's simulation engine (Ray) and return its summary.

    Flower's Python ``run_simulation`` API passes no run config, so the config travels in the
    ServerApp's closure; ``flwr run .`` uses ``server.app:app`` with ``[tool.flwr.app.config]``.
    """
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation

    from clients.app import app as client_app
    from server.app import resumed_config, run_server

    if cfg.resume:  # the federation's size comes from the run being resumed
        cfg = resumed_config(cfg)

    result: dict = {}
    server_app = ServerApp()

    @server_app.main()
    def _main(grid, context) -> None:
        result.update(run_server(grid, cfg))

    run_simulation(
        server_app=server_app,
        client_app=client_app,
        num_supernodes=cfg.clients,
        backend_config={
            "client_resources": {"num_cpus": cpus_per_client},
            "init_args": {"num_cpus": os.cpu_count() or 1},
        },
    )
    if "test_accuracy" not in result:
        raise RuntimeError(
            "the Flower simulation ended without a summary (see the log above for the ServerApp error)"
        )
    return result
