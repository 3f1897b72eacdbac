"""Runs one configured training job in process: loads data or partitions, dispatches on the mode."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np

from retexo_fl.config import TrainConfig
from retexo_fl.data.datasets import check_split, split_without_test
from retexo_fl.data.loading import load_graph
from retexo_fl.data.partition import Partition, cut_settings, load_partitions, partition_dirs
from retexo_fl.data.partitioners import OWNERS_METHOD, PARTITIONERS, partition_graph
from retexo_fl.datacenter.launch import run_datacenter
from retexo_fl.metrics import CHECKPOINT_FILE, RunRecorder
from retexo_fl.plots import write_plots
from retexo_fl.seeding import check_device_name, device_choice
from retexo_fl.summary import RunSummary
from retexo_fl.training.centralized import run_centralized, whole_graph_partition
from retexo_fl.training.eager import run_eager
from retexo_fl.training.lazy import run_lazy, with_clients


def partitions_config(cfg: TrainConfig, clients_given: bool = False) -> TrainConfig:
    """``cfg`` for a run over the partition folders ``cfg.partitions`` (itself without them):
    their count sets ``clients`` (each party holds one), and their manifests' dataset, split and
    partitioner are the ones recorded (:func:`~retexo_fl.data.partition.cut_settings`; with
    partitions ``dataset``, ``split`` and ``method`` are not read), so ``config.json`` says what
    trained. ``method`` also declares the node level, whose defaults are chosen before this:
    it is taken from the folders only where neither it nor theirs is ``node``.

    Args:
        cfg (TrainConfig): the run's settings.
        clients_given (bool, optional): ``clients`` was set explicitly: a count other than the
            folders' is refused rather than overruled. (default: :obj:`False`)

    Raises:
        ValueError: an explicit ``clients`` the folders do not hold.
    """
    if not cfg.partitions:
        return cfg
    dirs = partition_dirs(cfg.partitions)
    if not dirs:
        return cfg  # load_partitions says what is wrong with the folder
    if clients_given and cfg.clients != len(dirs):
        raise ValueError(
            f"--clients {cfg.clients}, but {cfg.partitions} holds {len(dirs)} partitions: with "
            "--partitions the folders set the clients (leave --clients out)"
        )
    cut = cut_settings(cfg.partitions)  # empty for a bad manifest: load_partitions names it
    if "node" in (cut.get("method"), cfg.method) or cut.get("method") not in (*PARTITIONERS, OWNERS_METHOD):
        cut.pop("method", None)
    return dataclasses.replace(with_clients(cfg, len(dirs)), **cut)


def make_partitions(cfg: TrainConfig, rec: RunRecorder | None = None) -> list[Partition]:
    """The run's partitions: read from ``cfg.partitions`` or cut from the dataset."""
    if cfg.partitions:
        parts = load_partitions(cfg.partitions)
        if rec:
            said_loaded(parts, cfg, rec)
        return parts
    data = load_graph(cfg)
    parts = partition_graph(data, cfg.clients, cfg.method, seed=cfg.seed)
    if rec:
        cut = sum(p.cross_edges.shape[0] for p in parts)
        rec.progress(
            f"{data.name}: {data.num_nodes} nodes, {data.edge_index.size(1)} edges -> "
            f"{len(parts)} {cfg.method} partitions, {cut} cross-edge records"
        )
    return parts


def said_loaded(parts: list[Partition], cfg: TrainConfig, rec: RunRecorder) -> None:
    """The progress lines of partitions read from ``cfg.partitions``."""
    rec.progress(f"loaded {len(parts)} partitions from {cfg.partitions}")
    note = node_level_note(parts, cfg)
    if note:
        rec.progress(note)


def node_level_note(parts: list[Partition], cfg: TrainConfig) -> str | None:
    """What to say when partitions read from files hold one node each but the run was not
    declared node level (``method node``), else ``None``.

    The level's defaults (:data:`~retexo_fl.config.NODE_LEVEL_DEFAULTS`, and stage 0 as the MLP
    where partitions get ``first-stage auto``) are chosen from the settings, before any
    partition is read: a deployed server never reads one. Only ``--method node`` declares the
    level, so files cut with ``partition --method node`` would otherwise train with the defaults
    of partitions, without saying so.
    """
    if cfg.mode != "lazy" or cfg.method == "node" or len(parts) < 2:
        return None
    if any(p.num_nodes != 1 for p in parts):
        return None
    return (
        f"note: each of the {len(parts)} partitions holds one node, but the run is not declared "
        'node level: add --method node (the run config\'s method = "node") for the node-level '
        "defaults (at most 512 trainers a round, the server's Adam at 0.05, stage 0 as the MLP)"
    )


def device_line(setting: str, sizes: list[int]) -> str:
    """The progress line that says where the parties of a run compute, and why.

    Args:
        setting (str): the ``device`` setting (``auto``, ``cpu``, ``cuda[:i]``).
        sizes (list[int]): the nodes of each partition (one entry for a centralized run).
    """
    picks = [device_choice(setting, n) for n in sizes]
    counts: dict[str, int] = {}
    for device, _ in picks:
        counts[str(device)] = counts.get(str(device), 0) + 1
    # The reason given is the smallest partition's: the one a size rule keeps off the GPU.
    reason = picks[min(range(len(sizes)), key=sizes.__getitem__)][1] if picks else setting
    if len(sizes) == 1:
        return f"device {reason}"
    where = ", ".join(f"{d} for {k} of {len(sizes)} partitions" for d, k in counts.items())
    return f"device {where} ({reason})"


def preflight(cfg: TrainConfig, in_process: bool = True) -> None:
    """Refuse, before anything is written, what a run would only find out later: an unknown
    partitioner, split form or device, and a run folder that holds a finished run (a failed rerun
    would truncate its events and overwrite its config beside the old summary); in process also
    an audit or a resume (the Flower engines do those).

    Args:
        cfg (TrainConfig): the validated configuration.
        in_process (bool, optional): the run is :func:`train`'s, not a Flower engine's.
            (default: :obj:`True`)

    Raises:
        ValueError: naming the setting (or folder) at fault.
    """
    if in_process and cfg.audit:
        raise ValueError(
            "--audit records what each ClientApp sends, and the in-process engine runs none: "
            "use --engine simulation (or node config audit-dir in a deployment)"
        )
    if in_process and cfg.resume:
        raise ValueError("--resume continues a run of the Flower engines: use --engine simulation")
    cuts = cfg.mode not in ("centralized", "datacenter") and not cfg.partitions
    if cuts and cfg.method not in PARTITIONERS:
        raise ValueError(f"method must be one of {', '.join(PARTITIONERS)}; got {cfg.method!r}")
    if not cfg.partitions:
        check_split(cfg.split)
    check_device_name(cfg.device)  # an unknown name, or cuda without a GPU
    check_out_dir(cfg)


def check_out_dir(cfg: TrainConfig) -> None:
    """Refuse a run folder (``out-dir``) that holds a finished or an interrupted run, unless the
    run resumes it, or that is a file.

    Raises:
        ValueError: naming the folder.
    """
    if cfg.out_dir and not cfg.resume and (Path(cfg.out_dir) / "summary.json").exists():
        raise ValueError(
            f"--out {cfg.out_dir} holds a finished run (summary.json): choose another folder or remove it"
        )
    if cfg.out_dir and not cfg.resume and (Path(cfg.out_dir) / CHECKPOINT_FILE).exists():
        # A fresh run would replace its config and events and leave the checkpoint beside them.
        raise ValueError(
            f"--out {cfg.out_dir} holds an interrupted run ({CHECKPOINT_FILE}): continue it with "
            f"--resume {cfg.out_dir} --engine simulation, or choose another folder or remove it"
        )
    if cfg.out_dir and Path(cfg.out_dir).exists() and not Path(cfg.out_dir).is_dir():
        raise ValueError(f"--out {cfg.out_dir} is a file, not a folder")


def train(cfg: TrainConfig, rec: RunRecorder | None = None) -> RunSummary:
    """Train as ``cfg`` says and return the summary (also written to ``cfg.out_dir`` if set).

    Raises:
        ValueError: on a bad setting (:meth:`TrainConfig.validate`, :func:`preflight`), before
            the run folder is written.
    """
    cfg.validate()
    preflight(cfg)
    if cfg.mode == "centralized" and cfg.partitions:
        raise ValueError("centralized mode trains on the whole graph: give --dataset, not --partitions")
    # What the run reads from files (a centralized run's graph, partitions) is read and checked
    # before the run folder is written: a refused input leaves no folder behind, and config.json
    # records the clients the partitions hold.
    t0 = time.perf_counter()  # the run's seconds count the loading
    loaded, whole = None, None
    if cfg.partitions and cfg.mode not in ("centralized", "datacenter"):
        cfg = partitions_config(cfg)
        loaded = load_partitions(cfg.partitions)
    if cfg.mode == "centralized":
        whole = whole_graph_partition(load_graph(cfg))
    rec = rec or RunRecorder(cfg.out_dir or None)
    rec.write_json("config.json", cfg.to_dict())
    if whole is not None:
        rec.progress(device_line(cfg.device, [whole.num_nodes]))
        summary = run_centralized(whole, cfg, rec)
        if not np.asarray(whole.test_mask).any():  # no test nodes: no test accuracy (not NaN)
            summary.without_test()
    elif cfg.mode == "datacenter":
        summary = RunSummary.from_dict(run_datacenter(cfg, rec))
        if split_without_test(cfg.split):  # its figures are its ranks': 0 over no test node
            summary.without_test()
    else:  # the coordinator marks a run without test nodes from the clients' setup counts
        if loaded is not None:
            said_loaded(loaded, cfg, rec)
        parts = loaded if loaded is not None else make_partitions(cfg, rec)
        rec.progress(device_line(cfg.device, [p.num_nodes for p in parts]))
        if cfg.mode in ("eager", "local"):
            summary = run_eager(parts, cfg, rec, local=cfg.mode == "local")
        else:
            summary = run_lazy(parts, cfg, rec)
    summary.wall_seconds = time.perf_counter() - t0
    summary.config = cfg.to_dict()
    rec.write_json("summary.json", summary.to_dict())
    if cfg.out_dir:
        write_plots(summary, cfg.out_dir)
    rec.event("done", test_accuracy=summary.test_accuracy)
    rec.progress(summary.line() + (f"  -> {Path(cfg.out_dir) / 'summary.json'}" if cfg.out_dir else ""))
    return summary
