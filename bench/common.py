"""Shared benchmark plumbing: a private copy of the datasets and a process pool that saves as it goes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

DEFAULT_ROOT = Path(__file__).resolve().parents[1].parent / "shared" / "datasets"

# A peer measured on these machines: FedGraph 0.2.5 running FedGCN on Cora, 10
# trainers, public split, 100 rounds, its documented settings. Its bytes are computed by FedGraph,
# not measured; ours are counted on the payloads.
PEER = {
    "dataset": "Cora",
    "clients": 10,
    "method": "fedgraph",
    "mode": "FedGCN (FedGraph 0.2.5)",
    "bits": 32,
    "seeds": 1,
    "test_mean": 0.788,
    "test_std": 0.0,
    "bytes_total": 379e6,
    "bytes_boundary": None,
    "bytes_model": None,
    "bytes_to_target": None,
    "seconds": 120.0,
    "peak_mb": 5000.0,  # about 5 GB across its processes
}


def private_planetoid(root: str, names: tuple[str, ...] = ("Cora", "CiteSeer")) -> Path:
    """Copy ``Planetoid/<name>/raw`` into a temporary folder (PyG writes ``processed/`` beside raw)."""
    tmp = Path(tempfile.mkdtemp(prefix="retexo-bench-"))
    copied = []
    for name in names:
        src = Path(root) / "Planetoid" / name / "raw"
        if src.is_dir():
            shutil.copytree(src, tmp / "Planetoid" / name / "raw")
            copied.append(name)
    # Write processed/ once, here: workers that each process the same folder race on its files.
    # In a child process, so that this one stays small (workers are forked from it).
    load = (
        "import sys; from torch_geometric.datasets import Planetoid\n"
        "for n in sys.argv[2:]: Planetoid(sys.argv[1], n)"
    )
    cmd = [sys.executable, "-c", load, str(tmp / "Planetoid"), *copied]
    subprocess.run(cmd, check=True, capture_output=True)
    return tmp


def peak_rss_mb() -> float:
    """Peak resident memory of this process, or of its largest finished child process (the
    data-center mode's workers), so far, in MB.

    This process's own peak is read from ``VmHWM`` where Linux has it: ``ru_maxrss`` survives
    ``exec`` and so would report the peak of whatever process started this one.
    """
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        with open("/proc/self/status") as f:
            own = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        pass
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, children) / 1024


def run_jobs(
    job: Callable[[tuple[dict, str]], dict],
    jobs: list[dict],
    root: str,
    partial: Path,
    workers: int,
    label: Callable[[dict], str],
) -> list[dict]:
    """Run ``job((settings, root))`` for every job on ``workers`` processes.

    Each finished run is appended to ``partial`` (JSON lines) at once, so a cut-off benchmark
    keeps what it measured; progress goes to stderr.
    """
    partial.parent.mkdir(parents=True, exist_ok=True)
    partial.write_text("")
    print(f"{len(jobs)} runs on {workers} worker(s)", file=sys.stderr)
    t0 = time.perf_counter()
    rows = []
    # One process per run, so each run's peak memory is its own.
    with ProcessPoolExecutor(workers, max_tasks_per_child=1) as pool:
        for i, row in enumerate(pool.map(job, [(j, root) for j in jobs]), 1):
            rows.append(row)
            with open(partial, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(
                f"[{time.perf_counter() - t0:7.1f}s] {i}/{len(jobs)} {label(row)}",
                file=sys.stderr,
                flush=True,
            )
    return rows


def tree_pss_mb(pid: int, pss: bool = True) -> float:
    """Summed PSS (RSS where PSS is unreadable) of ``pid`` and its descendants, in MB.

    With ``pss=False``, their summed RSS: shared pages count once per process, but it costs
    far less, where the ``smaps`` walk behind PSS took a third of a core at 0.2 s on an 8 GB
    process.
    """
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0
    for p in procs:
        try:
            if pss:
                mem = p.memory_full_info()
                total += getattr(mem, "pss", mem.rss)
            else:
                total += p.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total / 2**20


def run_measured(
    cmd: list[str], log: Path, pss: bool = True, interval: float = 0.2
) -> tuple[float, float, int]:
    """Run ``cmd`` with its output in ``log``; returns (wall seconds, peak tree memory MB, exit
    code), the memory sampled every ``interval`` seconds by :func:`tree_pss_mb` (``pss``)."""
    peak = 0.0
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        done = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not done.wait(interval):
                peak = max(peak, tree_pss_mb(proc.pid, pss))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        rc = proc.wait()
        done.set()
        sampler.join()
    return time.perf_counter() - t0, peak, rc
