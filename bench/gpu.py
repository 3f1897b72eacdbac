"""One GPU check: the GPU and the same host's CPU side by side, in one call of at most 5 minutes.

    python bench/gpu.py --out gpu-check                # on a machine with a GPU
    python bench/gpu.py --out /tmp/smoke --device cpu --quick   # the plumbing, anywhere

Each section runs in a child process of its own (this script with ``--section``), under a time
limit of its own, so that one that fails or hangs costs its own row and no other:

- ``env``: the GPU's name, torch, CUDA and PyG versions, the host's cores.
- ``tests``: the tests that need a GPU (``tests/training/test_device.py``, the fused codec
  kernels' and the CUDA codec test), passed / failed.
- ``codec``: the 8-bit row codec, encode + decode of a 1,000,000 x 64 float32 block, against a
  ``clone`` of it, on the GPU and on the host's CPU (compiled loops).
- ``profile``: torch's profiler over five 8-bit encode + decode pairs of that block on the GPU:
  the ops of most device time and of most host time.
- ``cora``: Cora, 10 random clients, the defaults, in process, on each device: training seconds,
  rounds, test accuracy (Cora from ``--root``; skipped without it).
- ``syncs``: the host synchronizations a short Cora run makes on the GPU, per client and round,
  and the lines that make them (CUDA's sync debug mode).
- ``crossover``: one client holding a whole generated graph of 2k to 128k nodes, a 2-stage lazy
  run of fixed rounds on each device: the partition size from which the GPU is faster, what
  ``--device auto`` is held to.
- ``large``: a generated graph of 300,000 nodes and about 6M directed edges, 8 random clients,
  in process: 2 stages x 8 rounds on each device (a ratio in bounded time), the GPU side again
  under cProfile (where its time goes), then the defaults on each device, the CPU last.
- ``centralized``: the centralized GCN (2 x 256, 200 epochs) on the same graph on the GPU,
  against PyG's ``GCNConv`` on a cached CSR adjacency in the same process.
- ``shared-gpu``: a deployed federation on 127.0.0.1 (``deploy/federation.py``: a SuperLink and
  three SuperNodes) whose three clients share the one GPU, on Cora. It needs Flower's
  executables beside the interpreter or on ``PATH``; without them the row says so.

It prints one table and writes ``gpu.json`` and ``gpu.log`` into ``--out``. ``--device cpu``
runs every section with the "GPU" side on the CPU too: a check of the script, not of a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

MARK = "@@gpu-row "
#: Sections in the order they run, each with its time limit in seconds (full, --quick). ``large``
#: goes last: its CPU side at the defaults has never ended inside its limit, so before, as the
#: limit was the budget's rest, it left no time for the sections after it.
SECTIONS: dict[str, tuple[float, float]] = {
    "env": (60, 30),
    "tests": (150, 120),
    "codec": (60, 30),
    "profile": (45, 30),
    "cora": (120, 60),
    "syncs": (60, 60),
    "crossover": (60, 60),
    "centralized": (60, 30),
    "shared-gpu": (130, 120),
    "large": (150, 90),
}
#: Seconds a section past its limit has to stop what it started (SIGTERM: the federation
#: launcher stops its SuperLink and SuperNodes on it) before everything left is killed.
STOP_GRACE = 15.0
#: What the in-process sections import beyond torch and PyG, and what ``shared-gpu`` runs: the
#: ``env`` row says which are missing, so the table's first row tells a bare GPU host's gaps.
NEEDED_MODULES = ("cryptography", "pymetis", "triton", "flwr")
NEEDED_TOOLS = ("flower-superlink", "flwr", "retexo-fl")


def emit(row: dict) -> None:
    """Hand one result row to the parent (a marked JSON line on stdout)."""
    print(MARK + json.dumps(row), flush=True)


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, repeats: int = 1) -> tuple[float, object]:
    """Median seconds of ``fn`` over ``repeats`` runs (the device synchronized around each)."""
    times, out = [], None
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def devices(args: argparse.Namespace):
    import torch

    return [("gpu", torch.device(args.device)), ("cpu", torch.device("cpu"))]


def quiet():
    from retexo_fl.metrics import RunRecorder

    return RunRecorder(None, stream=None)


def total_rounds(summary) -> int:
    return int(sum(int(s.get("rounds_run", 0)) for s in summary.stages))


# -- sections ------------------------------------------------------------------------------------
def section_env(args: argparse.Namespace) -> None:
    import torch
    import torch_geometric

    cuda = torch.cuda.is_available()
    emit(
        {
            "section": "env",
            "gpu": torch.cuda.get_device_name(0) if cuda else "none",
            "gpu_memory_gb": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
            if cuda
            else 0,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "pyg": torch_geometric.__version__,
            "python": platform.python_version(),
            "cpu_cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "missing_modules": [m for m in NEEDED_MODULES if importlib.util.find_spec(m) is None],
            "missing_tools": [t for t in NEEDED_TOOLS if not _which(t, _tool_path())],
        }
    )


#: The test files that hold ``cuda``-marked tests and import nothing a bare GPU host may lack
#: (Flower): ``-m cuda`` selects the tests in them that need the device.
CUDA_TEST_FILES = (
    "tests/training/test_device.py",
    "tests/compress/test_fused.py",
    "tests/compress/test_quantize.py",
    "tests/models/test_dropout.py",
    "tests/party/test_plain_sgd.py",
)


def section_tests(args: argparse.Namespace) -> None:
    """The ``cuda``-marked tests. On a CUDA device a skipped one counts as not run (Triton
    missing, say): the row names each skip's reason, and the table marks the row failed."""
    argv = [
        sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", "-o", "addopts=",
        "--import-mode=importlib", "-m", "cuda", *CUDA_TEST_FILES,
    ]  # fmt: skip
    try:
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=args.limit - 10)
        out, err, rc = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:  # what ran is still counted
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        rc = "timeout"
    print(out[-4000:], err[-2000:], flush=True)
    summary = out.strip().splitlines()[-1] if out.strip() else ""
    counts = {f"tests_{k}": int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", summary)}
    if "tests_errors" in counts:
        counts["tests_error"] = counts.pop("tests_errors")
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
    skipped = re.findall(r"^SKIPPED \[(\d+)\] (\S+): (.*)$", out, re.M)
    row = {
        "section": "tests",
        **counts,
        "failed_tests": failed,
        "skipped_tests": [f"{n} in {where}: {why}" for n, where, why in skipped],
        "rc": rc,
        "device": args.device,
    }
    if not counts:  # nothing ran: a collection error (a conftest's import, say) or a timeout
        row["error"] = f"pytest rc {rc}, no test counted: " + (out + err).strip()[-600:]
    emit(row)


def section_codec(args: argparse.Namespace) -> None:
    import torch

    from retexo_fl.compress import native, quantize
    from retexo_fl.compress.quantize import dequantize_rows, quantize_rows

    rows = 100_000 if args.quick else 1_000_000
    for side, device in devices(args):
        x = torch.randn(rows, 64, device=device)
        gen = torch.Generator(device=device).manual_seed(0)
        timed(lambda x=x: x.clone(), device)  # warm-up (allocator, kernels)
        clone, _ = timed(lambda x=x: x.clone(), device, 5)
        # "1": compiled CPU loops / fused GPU kernels where they serve; "0": torch ops alone.
        for switch in ("1", "0"):
            os.environ[native.NATIVE_ENV] = switch
            for bits in (8, 4):
                # Warm-up (and the kernels' compilation), then the median of 20: a pair takes
                # under a millisecond on a GPU, where 5 runs gave medians 10x apart.
                dequantize_rows(quantize_rows(x, bits, generator=gen))
                # Named after the warm-up: kernels that fail there are switched off for good.
                compiled = switch == "1" and (native.usable(x) or quantize._fused(x))
                path = "compiled" if compiled else "torch ops"
                enc, q = timed(lambda b=bits, x=x, g=gen: quantize_rows(x, b, generator=g), device, 20)
                dec, _ = timed(lambda q=q: dequantize_rows(q), device, 20)
                emit(
                    {
                        "section": "codec",
                        "side": side,
                        "path": path,
                        "device": str(device),
                        "rows": rows,
                        "bits": bits,
                        "clone_s": clone,
                        "encode_s": enc,
                        "decode_s": dec,
                        "vs_clone": (enc + dec) / clone,
                        "packed_on": str(q.data.device),
                    }
                )
    os.environ.pop(native.NATIVE_ENV, None)


def _lazy_on(parts, cfg, device, label: str) -> dict:
    import copy

    from retexo_fl.training.lazy import run_lazy

    seconds, summary = timed(
        lambda: run_lazy(copy.deepcopy(parts), dataclasses.replace(cfg, device=str(device)), quiet()), device
    )
    return {
        "device": str(device),
        "seconds": round(seconds, 2),
        "rounds": total_rounds(summary),
        "test_accuracy": round(summary.test_accuracy, 4),
        "val_accuracy": round(summary.val_accuracy, 4),
        "bytes_boundary": summary.bytes_boundary,
        "label": label,
    }


def _warm_up(args: argparse.Namespace, parts, cfg) -> None:
    """A one-round, two-stage run on each device, untimed: the process's first run pays one-time
    costs (PyG's import, the device's context, torch.optim's first optimizer importing
    ``torch._dynamo``: about 1.6 s on 2 cores), which the first device timed would otherwise
    carry alone."""
    short = dataclasses.replace(
        cfg, stages=2, rounds=1, min_rounds=0, warm_min_rounds=0, self_training=0, first_stage="mlp"
    )
    for _side, device in devices(args):
        _lazy_on(parts, short, device, "warm-up")


def section_cora(args: argparse.Namespace) -> None:
    from retexo_fl.config import TrainConfig
    from retexo_fl.data.loading import load_graph
    from retexo_fl.data.partitioners import partition_graph

    if not args.root:
        emit({"section": "cora", "skipped": "no --root with Planetoid/Cora"})
        return
    from common import private_planetoid

    root = private_planetoid(args.root, ("Cora",))
    cfg = TrainConfig.resolve(dataset="Cora", data_root=str(root), clients=10, method="random", seed=0)
    if args.quick:
        cfg = dataclasses.replace(cfg, rounds=4, min_rounds=0, warm_min_rounds=0, self_training=0)
    data = load_graph(cfg)
    parts = partition_graph(data, cfg.clients, cfg.method, seed=cfg.seed)
    _warm_up(args, parts, cfg)
    for side, device in devices(args):
        emit({"section": "cora", "side": side, **_lazy_on(parts, cfg, device, "Cora 10 random")})


def section_syncs(args: argparse.Namespace) -> None:
    """Host synchronizations a short Cora run makes on the GPU (``torch.cuda`` sync debug mode
    warns at each), per round and client."""
    import warnings

    import torch

    from retexo_fl.config import TrainConfig
    from retexo_fl.data.loading import load_graph
    from retexo_fl.data.partitioners import partition_graph
    from retexo_fl.training.lazy import run_lazy

    device = devices(args)[0][1]
    if device.type != "cuda" or not args.root:
        emit({"section": "syncs", "skipped": "needs a CUDA device and --root"})
        return
    from common import private_planetoid

    root = private_planetoid(args.root, ("Cora",))
    rounds = 5
    cfg = TrainConfig(
        dataset="Cora", data_root=str(root), clients=10, method="random", seed=0, stages=2,
        rounds=rounds, min_rounds=rounds, warm_min_rounds=0, self_training=0, device=str(device),
    )  # fmt: skip
    parts = partition_graph(load_graph(cfg), cfg.clients, cfg.method, seed=0)
    run_lazy(parts, cfg, quiet())  # warm-up: the count is of a run, not of first-call set-up
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = run_lazy(parts, cfg, quiet())
    torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    where: dict[str, int] = {}
    for w in syncs:
        key = f"{Path(w.filename).name}:{w.lineno}"
        where[key] = where.get(key, 0) + 1
    client_rounds = total_rounds(summary) * cfg.clients
    emit(
        {
            "section": "syncs",
            "device": str(device),
            "syncs": len(syncs),
            "client_rounds": client_rounds,
            "syncs_per_client_round": round(len(syncs) / max(1, client_rounds), 2),
            "top": sorted(where.items(), key=lambda kv: -kv[1])[:12],
        }
    )


def _generated(nodes: int, degree: float, seed: int = 0):
    from retexo_fl.data.datasets import apply_split, synthetic_sbm

    data = synthetic_sbm(nodes, 10, avg_degree=degree, homophily=0.8, num_features=64, seed=seed)
    apply_split(data, "random:0.6,0.2,0.2", seed=seed)
    return data


def section_crossover(args: argparse.Namespace) -> None:
    from retexo_fl.config import TrainConfig
    from retexo_fl.data.partitioners import partition_graph

    sizes = (2_000, 8_000) if args.quick else (2_000, 8_000, 32_000, 128_000)
    cfg = TrainConfig(
        stages=2, rounds=10, min_rounds=10, warm_min_rounds=0, self_training=0, clients=1, seed=0
    )
    for nodes in sizes:
        parts = partition_graph(_generated(nodes, 20.0), 1, "random", seed=0)
        for side, device in devices(args):
            if nodes == sizes[0]:
                _lazy_on(parts, cfg, device, "warm-up")
            row = _lazy_on(parts, cfg, device, f"{nodes} nodes, one client")
            emit({"section": "crossover", "side": side, "nodes": nodes, **row})


def _cprofile_top(fn, n: int = 18) -> tuple[object, list]:
    """Run ``fn`` under cProfile; its result and the ``n`` functions of most own time."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    out = prof.runcall(fn)
    stats = pstats.Stats(prof)
    top = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:n]  # (cc, nc, tottime, cumtime, callers)
    return out, [
        [f"{Path(f).name}:{line}({name})", nc, round(tt, 3), round(ct, 3)]
        for (f, line, name), (_cc, nc, tt, ct, _callers) in top
    ]


def section_large(args: argparse.Namespace) -> None:
    """The 300,000-node graph: first a fixed number of rounds on each device (a ratio that ends
    in bounded time), the defaults on the GPU, the fixed run's GPU side once more under cProfile
    (where its time goes), then the defaults on the CPU, last (the section's limit may cut it)."""
    import copy

    from retexo_fl.config import TrainConfig
    from retexo_fl.data.partitioners import partition_graph
    from retexo_fl.training.lazy import run_lazy

    nodes = 30_000 if args.quick else 300_000
    t0 = time.perf_counter()
    data = _generated(nodes, 20.0)
    parts = partition_graph(data, 8, "random", seed=0)
    made = time.perf_counter() - t0
    edges = int(data.edge_index.shape[1])
    label = f"{nodes} nodes, {edges} directed edges, 8 random"
    fixed = TrainConfig(
        clients=8, method="random", seed=0, stages=2, rounds=8, min_rounds=8, warm_min_rounds=0,
        self_training=0,
    )  # fmt: skip
    _warm_up(args, partition_graph(_generated(2_000, 20.0), 8, "random", seed=0), fixed)
    for side, device in devices(args):
        row = _lazy_on(parts, fixed, device, label + ", 2 stages x 8 rounds")
        emit({"section": "large-fixed", "side": side, "nodes": nodes, "edges": edges, **row})
    defaults = TrainConfig.resolve(clients=8, method="random", seed=0)
    if args.quick:
        defaults = dataclasses.replace(defaults, rounds=4, min_rounds=0, warm_min_rounds=0, self_training=0)

    def at_defaults(side: str, device) -> None:
        row = _lazy_on(parts, defaults, device, label)
        made_s = round(made, 1)
        emit({"section": "large", "side": side, "nodes": nodes, "edges": edges, "made_s": made_s, **row})

    (gpu_side, gpu), (cpu_side, cpu) = devices(args)
    at_defaults(gpu_side, gpu)
    cfg = dataclasses.replace(fixed, device=str(gpu))
    t0 = time.perf_counter()
    _, top = _cprofile_top(lambda: run_lazy(copy.deepcopy(parts), cfg, quiet()))
    sync(gpu)
    seconds = round(time.perf_counter() - t0, 2)
    # cProfile sees the main thread only: the clients built on map_partitions' threads (graphs of
    # 50,000 nodes or more) count in `seconds`, not in `top`.
    emit(
        {
            "section": "large-profile",
            "device": str(gpu),
            "seconds": seconds,
            "top": top,
            "threads": "main only",
        }
    )
    at_defaults(cpu_side, cpu)  # the slowest row, last: the section's limit may cut it


def section_profile(args: argparse.Namespace) -> None:
    """Where the 8-bit row codec's time goes on the GPU (1,000,000 x 64): torch's profiler,
    the ops of most device time and of most host time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from retexo_fl.compress.quantize import dequantize_rows, quantize_rows

    device = devices(args)[0][1]
    if device.type != "cuda":
        emit({"section": "profile", "skipped": "needs a CUDA device"})
        return
    x = torch.randn(100_000 if args.quick else 1_000_000, 64, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    for _ in range(3):
        dequantize_rows(quantize_rows(x, 8, generator=gen))
    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            dequantize_rows(quantize_rows(x, 8, generator=gen))
        sync(device)
    events = prof.key_averages()
    print(events.table(sort_by="self_device_time_total", row_limit=25), flush=True)

    def top(attr: str) -> list:
        rows = sorted(events, key=lambda e: -getattr(e, attr, 0))[:12]
        return [
            [e.key[:60], e.count, round(getattr(e, "self_device_time_total", 0) / 5, 1),
             round(e.self_cpu_time_total / 5, 1)]
            for e in rows
        ]  # fmt: skip

    # Wall time against device time, without the profiler: the wall figure of ``codec`` is many
    # times the kernels' time, so say which Python functions the host spends it in (cProfile).
    import cProfile
    import pstats

    def walls(fn: Callable[[], object], n: int = 20) -> tuple[float, float]:
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        wall = []
        for i in range(n):
            sync(device)
            t0 = time.perf_counter()
            starts[i].record()
            fn()
            ends[i].record()
            sync(device)
            wall.append(time.perf_counter() - t0)
        device_ms = [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]
        return statistics.median(wall) * 1e6, statistics.median(device_ms) * 1e3

    q8 = quantize_rows(x, 8, generator=gen)
    split = {
        "encode_wall_us, event_us": walls(lambda: quantize_rows(x, 8, generator=gen)),
        "decode_wall_us, event_us": walls(lambda: dequantize_rows(q8)),
        "clone_wall_us, event_us": walls(lambda: x.clone()),
    }
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(20):
        dequantize_rows(quantize_rows(x, 8, generator=gen))
    sync(device)
    profiler.disable()
    stats = pstats.Stats(profiler)
    python_top = sorted(
        ((f"{Path(k[0]).name}:{k[1]}:{k[2]}", v[1], round(v[2] / 20 * 1e6, 1), round(v[3] / 20 * 1e6, 1))
         for k, v in stats.stats.items()),
        key=lambda r: -r[2],
    )[:15]  # fmt: skip
    emit({"section": "profile", "per": "encode + decode, us", "by_device": top("self_device_time_total"),
          "by_host": top("self_cpu_time_total"), "split": split,
          "python_self_us_per_pair": python_top})  # fmt: skip


def section_centralized(args: argparse.Namespace) -> None:
    from kernels import pyg_loop

    from retexo_fl.config import TrainConfig
    from retexo_fl.training.centralized import run_centralized, whole_graph_partition

    nodes = 30_000 if args.quick else 300_000
    epochs = 20 if args.quick else 200
    part = whole_graph_partition(_generated(nodes, 20.0))
    device = devices(args)[0][1]
    cfg = TrainConfig.resolve(
        mode="centralized", hidden=256, rounds=epochs, server_lr=0.01, local_epochs=1,
        self_training=0, patience=0, seed=0, device=str(device),
    )  # fmt: skip
    pyg_loop(part, 2, 256, True, device=device)  # warm-up: kernels, allocator
    ref, _ = timed(lambda: pyg_loop(part, epochs, 256, True, device=device), device)
    ours, summary = timed(lambda: run_centralized(part, cfg, quiet()), device)
    emit(
        {
            "section": "centralized",
            "device": str(device),
            "nodes": nodes,
            "epochs": epochs,
            "pyg_csr_s": round(ref, 2),
            "ours_s": round(ours, 2),
            "ours_over_pyg": round(ours / ref, 3),
            "best_epoch": summary.stages[0]["best_round"],  # patience 0: all the epochs ran
            "test_accuracy": round(summary.test_accuracy, 4),
        }
    )


def section_shared_gpu(args: argparse.Namespace) -> None:
    from retexo_fl.cli import main as cli

    if not args.root:
        emit({"section": "shared-gpu", "skipped": "no --root with Planetoid/Cora"})
        return
    t_start = time.perf_counter()
    sys.path.insert(0, str(ROOT / "deploy"))
    from common import private_planetoid
    from federation import main as federate

    missing = [t for t in NEEDED_TOOLS if not _which(t, _tool_path())]
    if missing:
        emit({"section": "shared-gpu", "skipped": f"not found beside the interpreter or on PATH: {missing}"})
        return
    root = private_planetoid(args.root, ("Cora",))
    work = Path(tempfile.mkdtemp(prefix="retexo-gpu-shared-"))
    argv = [
        "partition",
        "--dataset",
        "Cora",
        "--root",
        str(root),
        "--clients",
        "3",
        "--out",
        str(work / "parts"),
    ]
    assert cli(argv) == 0
    device = devices(args)[0][1]
    rounds = 4
    # One stage-0 training (first-stage auto would train it twice): a check that three clients
    # share the GPU, not a measurement of the defaults.
    run = (
        f"device='{device}' stages=2 rounds='{rounds}' min-rounds={rounds} self-training=0 seed=0 "
        "first-stage='mlp'"
    )
    # The run's own timeout ends inside the section's limit, so the launcher stops its
    # SuperLink and SuperNodes itself and the row keeps the logs' tail.
    # 40 s for what the launcher does around the run: the SuperLink's start, the submission, the
    # stop; never past the section's limit, which the budget may have cut short.
    timeout = max(5, int(args.limit - (time.perf_counter() - t_start) - 40))
    t0 = time.perf_counter()
    row = {"section": "shared-gpu", "device": str(device), "clients": 3}
    try:
        argv = ["--partitions", str(work / "parts"), "--out", str(work / "run"), "--run-config", run]
        rc: int | str = federate([*argv, "--timeout", str(timeout)])
    except Exception as exc:  # a timeout or a process that did not start: the row says which
        rc = f"{type(exc).__name__}: {exc}"[:400]
    seconds = time.perf_counter() - t0
    summary_file = work / "run" / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    row.update(rc=rc, seconds=round(seconds, 1), timeout=timeout)
    row["test_accuracy"] = summary.get("test_accuracy")
    row["config_device"] = summary.get("config", {}).get("device")
    if rc != 0:
        logs = sorted((work / "run" / "federation").glob("*.log"))
        row["log_tail"] = "".join(p.read_text(errors="replace")[-600:] for p in logs)[-2400:]
    emit(row)


def _which(name: str, path: str) -> str | None:
    import shutil

    return shutil.which(name, path=path)


def _tool_path() -> str:
    """Where the federation launcher looks for Flower's executables (its ``tool_path``), or
    ``PATH`` where the launcher cannot be imported (a host missing the project's dependencies)."""
    sys.path.insert(0, str(ROOT / "deploy"))
    try:
        from federation import tool_path
    except ImportError:
        return os.environ.get("PATH", "")
    return tool_path()


RUNNERS = {
    "env": section_env,
    "tests": section_tests,
    "codec": section_codec,
    "profile": section_profile,
    "cora": section_cora,
    "syncs": section_syncs,
    "crossover": section_crossover,
    "large": section_large,
    "centralized": section_centralized,
    "shared-gpu": section_shared_gpu,
}


# -- the parent: run sections, print the table ---------------------------------------------------
def run_section(name: str, args: argparse.Namespace, limit: float, log) -> list[dict]:
    """Run one section in a child process; its rows, or one row saying why there are none."""
    argv = [sys.executable, __file__, "--section", name, "--device", args.device, "--out", args.out]
    argv += ["--limit", f"{limit:.0f}"]
    argv += ["--root", args.root] if args.root else []
    argv += ["--quick"] if args.quick else []
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    t0 = time.perf_counter()
    rows: list[dict] = []
    log.write(f"\n=== {name} (limit {limit:.0f} s)\n")
    # A session of its own, so that a section past its limit is stopped with everything in its
    # process group (pytest, its workers), not left computing beside the next one.
    pipe = subprocess.PIPE
    child = subprocess.Popen(
        argv, stdout=pipe, stderr=pipe, text=True, cwd=ROOT, env=env, start_new_session=True
    )
    try:
        out, err = child.communicate(timeout=limit)
        rc: int | str = child.returncode
    except subprocess.TimeoutExpired:
        # SIGTERM first: the federation launcher (shared-gpu) stops its SuperLink and SuperNodes,
        # which run in sessions of their own that the group's SIGKILL would not reach.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGTERM)
        try:
            out, err = child.communicate(timeout=STOP_GRACE)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            try:  # bounded: a process outside the group could still hold the pipes
                out, err = child.communicate(timeout=STOP_GRACE)
            except subprocess.TimeoutExpired:
                out, err = "", "the section's output was lost: its pipes stayed open after SIGKILL"
        rc = "timeout"
    with contextlib.suppress(ProcessLookupError):  # what a finished section left running
        os.killpg(child.pid, signal.SIGKILL)
    log.write(out + err)
    log.flush()
    for line in out.splitlines():
        if line.startswith(MARK):
            rows.append(json.loads(line[len(MARK) :]))
    seconds = round(time.perf_counter() - t0, 1)
    if rc != 0:
        rows.append({"section": name, "error": f"exit {rc}", "tail": err.strip()[-800:]})
    for row in rows:
        row.setdefault("section_seconds", seconds)
    return rows


def print_table(rows: list[dict]) -> None:
    def pair(section: str) -> dict[str, dict]:
        return {r["side"]: r for r in rows if r.get("section") == section and "side" in r}

    env = next((r for r in rows if r.get("section") == "env" and "gpu" in r), {})
    print(
        f"\nGPU check: {env.get('gpu', '?')} ({env.get('gpu_memory_gb', '?')} GiB), "
        f"torch {env.get('torch', '?')} "
        f"(CUDA {env.get('cuda', '?')}), PyG {env.get('pyg', '?')}, {env.get('cpu_cores', '?')} CPU cores"
    )
    lacking = [*env.get("missing_modules", []), *env.get("missing_tools", [])]
    if lacking:
        print(f"missing on this host: {', '.join(lacking)} (bench/README.md, gpu.py: what to carry)")
    head = f"{'check':<44} {'GPU':>12} {'host CPU':>12} {'ratio':>9}  note"
    print(head)
    print("-" * len(head))

    def line(name: str, gpu, cpu, ratio, note: str = "") -> None:
        def cell(v):
            return f"{v:>12.3f}" if isinstance(v, float) else f"{'' if v is None else v!s:>12}"

        r = f"{ratio:>8.2f}x" if isinstance(ratio, float) else f"{'':>9}"
        print(f"{name:<44} {cell(gpu)} {cell(cpu)} {r}  {note}")

    for r in rows:
        if r.get("section") == "tests" and "rc" in r:
            passed, failed = r.get("tests_passed", 0), r.get("tests_failed", 0) + r.get("tests_error", 0)
            skipped = r.get("tests_skipped", 0)
            # On a CUDA device every cuda-marked test must run: a skip is a test not run.
            if r.get("device") == "cpu":  # --device cpu: the script's check, no CUDA test can run
                verdict = "not run (no CUDA device)"
            else:
                ok = r["rc"] == 0 and not failed and passed > 0 and not skipped
                verdict = "met" if ok else "NOT MET"
            note = f"{verdict}: {skipped} skipped, rc {r['rc']}"
            note += "".join(f"; {t}" for t in r["failed_tests"] + r.get("skipped_tests", []))
            note += f"; {r['error']}" if "error" in r else ""
            line("CUDA tests passed / failed", passed, failed, None, note)
    codec = [r for r in rows if r.get("section") == "codec" and "side" in r]
    for bits in sorted({r["bits"] for r in codec}, reverse=True):
        for path in ("compiled", "torch ops"):
            by = {r["side"]: r for r in codec if r["bits"] == bits and r.get("path", "compiled") == path}
            g, c = by.get("gpu", {}), by.get("cpu", {})
            if g or c:
                what = f"{bits}-bit row codec ({path}), enc+dec / clone"
                line(what, g.get("vs_clone"), c.get("vs_clone"), None, "target GPU <= 4x")
    for section, what in (
        ("cora", "Cora 10 random, defaults: seconds"),
        ("large-fixed", "generated graph, 8 random, 2 x 8 rounds: s"),
        ("large", "generated graph, 8 random: seconds"),
    ):
        p = pair(section)
        if p:
            g, c = p.get("gpu", {}), p.get("cpu", {})
            ratio = c["seconds"] / g["seconds"] if g.get("seconds") and c.get("seconds") else None
            line(what, g.get("seconds"), c.get("seconds"), ratio, "CPU / GPU")
            line(
                f"  test accuracy ({g.get('rounds')} / {c.get('rounds')} rounds)",
                g.get("test_accuracy"),
                c.get("test_accuracy"),
                None,
            )
    for r in rows:
        if r.get("section") == "syncs" and "syncs" in r:
            line("host syncs per client-round (Cora, 2 x 5)", r["syncs_per_client_round"], None, None)
    cross = [r for r in rows if r.get("section") == "crossover" and "side" in r]
    for nodes in sorted({r["nodes"] for r in cross}):
        by = {r["side"]: r for r in cross if r["nodes"] == nodes}
        g, c = by.get("gpu", {}), by.get("cpu", {})
        ratio = c["seconds"] / g["seconds"] if g.get("seconds") and c.get("seconds") else None
        line(
            f"one client, {nodes} nodes, 2 stages x 10 rounds: s",
            g.get("seconds"),
            c.get("seconds"),
            ratio,
            "CPU / GPU",
        )
    for r in rows:
        if r.get("section") == "centralized" and "ours_s" in r:
            line(
                "centralized GCN: ours / PyG cached CSR (s)",
                r["ours_s"],
                r["pyg_csr_s"],
                r["ours_over_pyg"],
                "ours / PyG; target <= 1.1x",
            )
        if r.get("section") == "shared-gpu" and "rc" in r:
            rc = r["rc"]
            failed = "" if isinstance(rc, int) else f"; {rc}"  # the exception the launcher raised
            line(
                "3 SuperNodes sharing the GPU (s, rc)",
                r["seconds"],
                rc if isinstance(rc, int) else None,
                None,
                f"test {r.get('test_accuracy')}{failed}",
            )
    for r in rows:
        if r.get("section") == "large-profile" and "top" in r:
            print(f"GPU side of the fixed-round run under cProfile ({r['seconds']} s), most own time:")
            for name, calls, own, cumulative in r["top"][:10]:
                print(f"  {own:>8.3f} s own {cumulative:>8.3f} s cum {calls:>9} calls  {name}")
        if r.get("section") == "profile" and "by_device" in r:
            print("8-bit codec, 1M x 64, encode + decode: ops of most device time (us per pair)")
            for key, count, dev, host in r["by_device"][:8]:
                print(f"  {dev:>9.1f} device {host:>9.1f} host {count:>5}x  {key}")
    for r in rows:
        if "error" in r or "skipped" in r:
            print(f"{r['section']}: {r.get('error') or r.get('skipped')} {r.get('tail', '')[-300:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for gpu.json and gpu.log")
    parser.add_argument(
        "--device", default="cuda", help="the accelerator compared with the host's CPU (default cuda)"
    )
    parser.add_argument("--root", default="", help="dataset root holding Planetoid/Cora/raw (Cora sections)")
    parser.add_argument("--quick", action="store_true", help="small sizes: a check of the script itself")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset, in order")
    parser.add_argument(
        "--budget", type=float, default=300.0, help="seconds for the whole check (default 300)"
    )
    parser.add_argument("--section", default="", help=argparse.SUPPRESS)
    parser.add_argument("--limit", type=float, default=120.0, help=argparse.SUPPRESS)  # a section's seconds
    args = parser.parse_args(argv)
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
    if args.section:
        RUNNERS[args.section](args)
        return 0
    names = [s for s in args.sections.split(",") if s]
    unknown = [s for s in names if s not in SECTIONS]
    if unknown:  # before any section runs, not after the first ones' minutes
        parser.error(f"unknown section(s) {', '.join(unknown)}; known: {', '.join(SECTIONS)}")
    import torch

    if args.device != "cpu" and not torch.cuda.is_available():
        print(
            f"--device {args.device}: torch sees no GPU here; --device cpu checks the script alone",
            file=sys.stderr,
        )
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    rows: list[dict] = []
    with open(out / "gpu.log", "w") as log:
        for name in names:
            left = args.budget - (time.perf_counter() - start)
            limit = min(SECTIONS[name][1 if args.quick else 0], left)
            if limit < 10:
                rows.append({"section": name, "skipped": f"budget of {args.budget:.0f} s spent"})
                continue
            print(f"[{time.perf_counter() - start:6.1f} s] {name}", flush=True)
            rows.extend(run_section(name, args, limit, log))
            with contextlib.suppress(OSError):
                (out / "gpu.json").write_text(json.dumps({"device": args.device, "rows": rows}, indent=1))
    print_table(rows)
    print(f"{time.perf_counter() - start:.0f} s; wrote {out / 'gpu.json'} and {out / 'gpu.log'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
