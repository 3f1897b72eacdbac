"""Run the retexo-fl ServerApp and ClientApp in Flower's simulation engine from Python."""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from flwr.clientapp import ClientApp
from flwr.serverapp import ServerApp

from clients.app import app as default_client_app
from clients.node import WORK_DIR_ENV, cut_folder, cut_lock, default_work_base
from clients.node_client import write_cut
from retexo_fl.config import TrainConfig
from retexo_fl.secure.policy import POLICY_ENV, PartyPolicy
from retexo_fl.summary import RunSummary
from server.app import run_server
from server.checkpoint import resumed_config
from server.messaging import STOP
from server.simulation_queue import indexed_message_queue


class _DropRunSimulationBanner(logging.Filter):
    """Drops the one record of Flower's ``run_simulation`` deprecation banner.

    Flower 1.38-1.39 (``flwr/simulation/run_simulation.py``, ``run_simulation``) logs "DEPRECATED
    FEATURE: The `run_simulation` function is deprecated ..." through ``warn_deprecated_feature``
    on every call. It is the only in-process simulation entry point of that range (``flwr run``
    needs a SuperLink), so the banner tells a user of this engine nothing to act on.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg) + " " + " ".join(str(a) for a in (record.args or ()))
        return not ("DEPRECATED FEATURE" in text and "run_simulation" in text)


@contextlib.contextmanager
def _quiet_run_simulation() -> Iterator[None]:
    """Flower's logger without the ``run_simulation`` banner for the call's length, and without
    Ray's ``ray.init`` "Tip: In future versions of Ray ... RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"
    FutureWarning (``ray/_private/worker.py``, ``init``): it announces a default change for
    actors given no GPU, which run on the CPU here either way. Nothing else is filtered."""
    banner = _DropRunSimulationBanner()
    flwr_logger = logging.getLogger("flwr")
    flwr_logger.addFilter(banner)
    try:
        with warnings.catch_warnings():
            tip = "Tip: In future versions of Ray"
            warnings.filterwarnings("ignore", message=tip, category=FutureWarning)
            yield
    finally:
        flwr_logger.removeFilter(banner)


def simulate(
    cfg: TrainConfig,
    *,
    cpus_per_client: float | None = None,
    gpus_per_client: float | None = None,
    work_dir: str | Path | None = None,
    policy: PartyPolicy | None = None,
    client_app: ClientApp | None = None,
) -> RunSummary:
    """Run one lazy, eager or local job through Flower's simulation engine (Ray) and return its summary.

    Flower's Python ``run_simulation`` API passes no run config, so the config travels in the
    ServerApp's closure; ``flwr run .`` uses ``server.app:app`` with ``[tool.flwr.app.config]``.
    This is the ``simulation`` engine of the ``retexo_fl.engines`` entry-point group, which
    ``retexo-fl train --engine simulation`` looks up.

    Args:
        cfg (TrainConfig): the run configuration.
        cpus_per_client (float, optional): CPUs Ray reserves per virtual node, which sets how
            many actors serve them; :obj:`None` for :func:`actor_cpus` (one actor more than
            the machine has cores). (default: :obj:`None`)
        gpus_per_client (float, optional): GPUs (a fraction to share one) Ray reserves per
            virtual node; :obj:`None` for :func:`gpus_for_clients` of ``cfg``. Ray hides the GPUs
            from a node that reserves none, so ``--device auto`` would find no GPU there.
            (default: :obj:`None`)
        work_dir (str or Path, optional): the base of the virtual nodes' work folders (their saved
            state and cached partitions); else ``$RETEXO_FL_WORK_DIR`` or the temp folder.
            (default: :obj:`None`)
        policy (PartyPolicy, optional): every virtual party's own security policy; :obj:`None`
            for the security settings of ``cfg`` (the command line the user started them with).
            (default: :obj:`None`)
        client_app (ClientApp, optional): the ClientApp the virtual nodes run; :obj:`None` for
            ``clients.app.app`` (a variant is for tests, e.g. a client built to leak).
            (default: :obj:`None`)
    """
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
    # Flower's simulation engine imports Ray: only when a simulation runs.
    from flwr.simulation import run_simulation

    if cfg.resume:  # the federation's size comes from the run being resumed
        cfg = resumed_config(cfg)
    elif not cfg.partitions:
        # The virtual nodes load their parts of one cut, written here: the cut this process's
        # in-process engine would make, and no stale or half-written one that a node finds in
        # the work folder. Loading the dataset here also means PyG writes processed/ once (Ray
        # actors that did so at once read each other's half-written file).
        from retexo_fl.data.loading import load_graph

        folder = cut_folder(Path(work_dir) if work_dir is not None else default_work_base(), cfg)
        graph = load_graph(cfg)
        with cut_lock(folder, exclusive=True):
            write_cut(cfg, folder, graph)

    result: list[RunSummary] = []
    server_app = ServerApp()

    @server_app.main()
    def _main(grid, context) -> None:
        result.append(run_server(grid, cfg))

    # Ray's workers inherit the driver's environment when run_simulation starts them: the
    # virtual nodes' work folders and their own policy travel that way, not in a server message.
    env = {POLICY_ENV: (policy or PartyPolicy.from_settings(cfg.security)).to_json()}
    if work_dir is not None:
        env[WORK_DIR_ENV] = str(work_dir)
    previous = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    STOP.clear()
    try:
        with _quiet_run_simulation(), indexed_message_queue():
            run_simulation(
                server_app=server_app,
                client_app=client_app or default_client_app,
                num_supernodes=cfg.clients,
                backend_config={
                    "client_resources": {
                        "num_cpus": actor_cpus(cfg.clients) if cpus_per_client is None else cpus_per_client,
                        "num_gpus": gpus_for_clients(cfg) if gpus_per_client is None else gpus_per_client,
                    },
                    "init_args": {"num_cpus": os.cpu_count() or 1},
                },
            )
    except KeyboardInterrupt:
        # Flower's ServerApp thread would otherwise wait out client-timeout for actors that
        # are gone, and keep the process alive after the first Ctrl-C.
        STOP.set()
        raise
    finally:
        for k, v in previous.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if not result:
        raise RuntimeError(
            "the Flower simulation ended without a summary (see the log above for the ServerApp error)"
        )
    return result[0]


def actor_cpus(clients: int, cores: int | None = None) -> float:
    """CPUs each virtual node reserves by default: the share that makes Flower's pool one actor
    more than the machine has cores (no more than there are clients).

    An actor waits for the server between messages (Ray's submit and result, the server's turn
    between rounds), so with one actor a core the cores sat a fifth idle. At one node per client
    on Cora (2,708 clients, 2 cores), shortened to 6 rounds a stage, two actors reached the first
    pass's last round in 218 s, three in 184 s, four in 213 s (they contend for the cores); the
    whole default run took 854 s and 866 s with three (and the ClientApp sent by reference, the
    checkpoint's traffic encoded per stage) against 917 s with two, run between them. Accuracy,
    bytes and messages are the same.

    Args:
        clients (int): the virtual nodes.
        cores (int, optional): the CPUs Ray is given; :obj:`None` for ``os.cpu_count()``.
            (default: :obj:`None`)
    """
    cores = cores or os.cpu_count() or 1
    actors = max(1, min(cores + 1, clients))
    # Flower's pool has int(cores / share) actors: cores over (actors + 0.5) rounds down to
    # actors, with no float landing just below it.
    return cores / (actors + 0.5)


def gpus_for_clients(cfg: TrainConfig, gpus: int | None = None) -> float:
    """GPUs each virtual node reserves so that ``cfg.device`` finds one: the machine's GPUs shared.

    ``cpu`` reserves none; ``auto`` and ``cuda[:i]`` share the GPUs evenly among the clients (a
    fraction each when there are more clients than GPUs, at most one each).

    Args:
        cfg (TrainConfig): the run configuration (``device``, ``clients``).
        gpus (int, optional): the machine's GPUs; :obj:`None` to ask torch. (default: :obj:`None`)
    """
    if cfg.device == "cpu":
        return 0.0
    if gpus is None:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return min(1.0, gpus / max(1, cfg.clients)) if gpus else 0.0
