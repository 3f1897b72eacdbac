"""Start a data-center run: P local processes on this host, or one process of a ``torchrun`` job."""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import socket
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from retexo_fl.datacenter.graph import FullGraph, check_residency, load_full_graph
from retexo_fl.datacenter.settings import DatacenterConfig
from retexo_fl.datacenter.trainer import train_process
from retexo_fl.metrics import RunRecorder


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def host_backend(device: str, local_procs: int) -> tuple[str, str]:
    """Where this host's ``local_procs`` processes compute, and with which backend.

    NCCL needs a GPU of its own for each process of a communicator ("Duplicate GPU detected"),
    so ``auto`` takes the GPUs only where there is one for every process on the host, and the
    CPU with gloo otherwise; ``cuda`` with too few GPUs is refused.

    Args:
        device (str): the run's ``device`` (``auto``, ``cpu``, ``cuda`` or ``cuda:N``).
        local_procs (int): the run's processes on this host.

    Returns:
        tuple[str, str]: ``"cuda"`` and ``"nccl"``, or ``"cpu"`` and ``"gloo"``.

    Raises:
        RuntimeError: ``cuda`` without CUDA, or with fewer GPUs than processes on the host.
    """
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cpu" or (device == "auto" and gpus == 0):
        return "cpu", "gloo"
    if device == "auto" and gpus < local_procs:
        return "cpu", "gloo"
    if gpus == 0:
        raise RuntimeError(f"device {device!r}: CUDA is not available on this host")
    if gpus < local_procs:
        raise RuntimeError(
            f"device {device!r}: {local_procs} processes on this host and {gpus} GPU(s): NCCL needs "
            f"a GPU for each process; give --procs {gpus} or fewer, or --device cpu"
        )
    return "cuda", "nccl"


def _local_procs() -> int:
    """This host's processes of the job: torchrun's ``LOCAL_WORLD_SIZE``, else (our own spawn,
    one host) ``WORLD_SIZE``."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))


def _device(cfg: DatacenterConfig) -> tuple[torch.device, str]:
    """This process's device and backend (:func:`host_backend`): with NCCL, its own GPU."""
    kind, backend = host_backend(cfg.device, _local_procs())
    if kind == "cpu":
        return torch.device("cpu"), backend
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    # A single process on the host takes the GPU it was given (cuda:N), else GPU LOCAL_RANK.
    index = torch.device(cfg.device).index if cfg.device.startswith("cuda:") else None
    torch.cuda.set_device(index if index is not None and _local_procs() == 1 else local_rank)
    return torch.device("cuda", torch.cuda.current_device()), backend


def run_process(
    cfg: DatacenterConfig,
    summary_path: str | None,
    graph: FullGraph | None = None,
    weights_path: str | None = None,
    timeout_s: float = 600.0,
) -> dict | None:
    """Join the process group described by the environment (``torchrun`` sets it) and train.

    Rank 0 writes the summary to ``summary_path`` (if given) and returns it, and the final
    weights to ``weights_path`` (if given). ``graph`` skips loading ``cfg``'s dataset.
    """
    device, backend = _device(cfg)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        rec = RunRecorder(None) if dist.get_rank() == 0 else None
        if graph is None:
            # PyG writes processed/ on first load: one process per host goes first, the rest read it.
            first = os.environ.get("LOCAL_RANK", "0") == "0"
            if first:
                graph = load_full_graph(cfg)
            dist.barrier()
            if not first:
                graph = load_full_graph(cfg)
        summary = train_process(cfg, graph, device, rec)
        if summary is not None:
            weights = summary.pop("final_weights")
            if summary_path:
                Path(summary_path).write_text(json.dumps(summary))
            if weights_path:
                torch.save(weights, weights_path)
        return summary
    finally:
        dist.destroy_process_group()


def _start_method() -> str:
    """``forkserver`` where the platform has it, else ``spawn``.

    A spawned process imports torch and this package before it does anything (seconds each, and
    P of them share the host's cores); the fork server imports them once and forks every process
    from that, single-threaded, so no lock or thread pool of the caller is inherited. Each
    process still sets its own environment (rank, world size, address): it inherits the fork
    server's, not the caller's.
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    # Only read when the fork server starts (the first run of this interpreter): later calls
    # leave a running server as it is.
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed", __name__])
    return "forkserver"


def _spawned(
    rank: int,
    cfg: DatacenterConfig,
    port: int,
    summary_path: str,
    graph: FullGraph | None,
    weights_path: str | None,
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(cfg.datacenter.procs),
        LOCAL_WORLD_SIZE=str(cfg.datacenter.procs),  # not a launcher's, inherited
        LOCAL_RANK=str(rank),
    )
    # The host's cores are shared by all P processes: oversubscribing them costs more than it gives.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.datacenter.procs))
    run_process(cfg, summary_path, graph, weights_path)


def run_datacenter(
    cfg: DatacenterConfig,
    rec: RunRecorder | None = None,
    graph: FullGraph | None = None,
    keep_weights: bool = False,
) -> dict:
    """Run ``cfg`` (mode ``datacenter``) as ``procs`` processes on this host; returns rank 0's summary.

    Args:
        graph: train on this in-memory graph instead of loading ``cfg``'s dataset in every process.
        keep_weights: put the final ``[(W, b)]`` per layer in the summary as ``final_weights``.
    """
    if graph is None:
        check_residency(cfg)  # before anything is spawned or loaded
    rec = rec or RunRecorder(None, stream=None)
    dc = cfg.datacenter
    kind, backend = host_backend(cfg.device, dc.procs)  # refused here, before anything starts
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    why = (
        f" ({dc.procs} processes and {gpus} GPU(s): NCCL needs one a process)"
        if cfg.device == "auto" and kind == "cpu" and gpus
        else ""
    )
    rec.progress(
        f"data-center {dc.algorithm}: starting {dc.procs} processes on 127.0.0.1, {kind} and {backend}{why}"
    )
    with tempfile.TemporaryDirectory(prefix="retexo-dc-") as tmp:
        path, wpath = str(Path(tmp) / "summary.json"), str(Path(tmp) / "weights.pt")
        try:
            mp.start_processes(
                _spawned,
                args=(cfg, _free_port(), path, graph, wpath if keep_weights else None),
                nprocs=cfg.datacenter.procs,
                start_method=_start_method(),
            )
        except mp.ProcessRaisedException as exc:
            last = str(exc).strip().splitlines()[-1]
            raise RuntimeError(f"data-center process failed: {last}") from None
        summary = json.loads(Path(path).read_text())
        if keep_weights:
            summary["final_weights"] = torch.load(wpath)
        return summary
