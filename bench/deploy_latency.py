"""Round latency deployed (SuperLink + 3 SuperNodes on 127.0.0.1) against simulation, and where it goes.

One sitting: lazy GCN on Cora, 3 clients, one stage of R rounds (each round one ``train``
message that also validates the incoming state), in Flower's simulation engine and deployed
twice: on Flower's plain ``flower-supernode`` (a ``flwr-clientapp`` process per message that
imports torch and reloads the partition), and on ``retexo-fl supernode`` (a node worker holding
them, shortened SuperNode sleeps, a 20 ms SuperExec poll). A round's latency is the time
between consecutive ``round`` events of the run. Also measured: what a fresh interpreter pays to
import the ClientApp module (with torch, as ``flower-supernode`` runs it, and as the shim a
worker's node runs), the node workers' peak resident memory, a third deployed run whose
SuperLink keeps its state in memory instead of its SQLite file (the file costs the SuperLink most
of its CPU on a 2-core machine), and with ``--whole-run`` a whole run of ``--whole-config``
deployed on ``retexo-fl supernode``. Prints a table, writes JSON. Example::

    python bench/deploy_latency.py --out bench/results/deploy_latency.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "deploy"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_ROOT, private_planetoid  # noqa: E402
from federation import FederationProcesses  # noqa: E402

from retexo_fl.data.partition import partition_dirs  # noqa: E402


def round_latencies(run_dir: Path) -> list[float]:
    t = [
        e["t"]
        for e in map(json.loads, (run_dir / "events.jsonl").read_text().splitlines())
        if e["event"] == "round"
    ]
    return [b - a for a, b in itertools.pairwise(t)]


def import_seconds(module: str, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", f"import {module}"], check=True, cwd=ROOT)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def worker_memory_mb(work: Path, parties: int, field: str = "VmHWM") -> list[float]:
    """Each party's current node worker's ``field`` of ``/proc/PID/status`` in MB (``VmHWM``: peak
    resident memory; ``VmRSS``: now), the worker found in its SuperNode log."""
    values = []
    for i in range(parties):
        found = re.findall(r"node worker (\d+) listening", (work / f"supernode-{i}.log").read_text())
        status = Path(f"/proc/{found[-1]}/status").read_text() if found else ""
        kb = re.search(rf"{field}:\s+(\d+) kB", status)
        values.append(int(kb.group(1)) / 1024 if kb else float("nan"))
    return values


@dataclass
class DeployedRun:
    """One deployed run's figures.

    Args:
        out (Path): the run folder (``events.jsonl``, ``summary.json``).
        work (Path): the federation's work folder (the SuperNodes' logs).
        wall (float): seconds from submit to finish.
        peak_mb (list[float]): each node worker's peak resident memory (worker runs only).
        end_mb (list[float]): each node worker's resident memory at the end (worker runs only).
    """

    out: Path
    work: Path
    wall: float
    peak_mb: list[float] = field(default_factory=list)
    end_mb: list[float] = field(default_factory=list)


def deployed(
    parts: Path, work: Path, run_config: str, worker: bool, timeout: float = 1800, database: bool = True
) -> DeployedRun:
    """A whole deployed run of ``run_config`` on SuperNodes holding ``parts``' partitions."""
    fed = FederationProcesses(work, database=database)
    parties = partition_dirs(parts)
    run = DeployedRun(work / "run", fed.work, 0.0)
    try:
        t0 = time.monotonic()
        record = fed.run_parties(parties, run.out, run_config, timeout, worker=worker)
        run.wall = time.monotonic() - t0
        if record.get("status") != "finished:completed":
            raise RuntimeError(f"deployed run ended {record.get('status')}; see {work}")
        if worker:  # read before the workers stop with their SuperNodes
            run.peak_mb = worker_memory_mb(fed.work, len(parties))
            run.end_mb = worker_memory_mb(fed.work, len(parties), "VmRSS")
    finally:
        fed.stop_all()
    return run


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", default=str(DEFAULT_ROOT))
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--out", default="bench/results/deploy_latency.json")
    parser.add_argument(
        "--whole-run", action="store_true", help="also run a whole Cora run deployed (minutes)"
    )
    parser.add_argument("--whole-config", default="", help="the whole run's run config (default: defaults)")
    args = parser.parse_args()

    from retexo_fl.cli import main as cli
    from retexo_fl.config import TrainConfig
    from server.simulation import simulate

    tmp = Path(tempfile.mkdtemp(prefix="retexo-latency-"))
    data = private_planetoid(args.root, ("Cora",))
    parts = tmp / "parts"
    cli(["partition", "--dataset", "Cora", "--root", str(data), "--clients", "3", "--out", str(parts)])

    sim_dir = tmp / "sim"
    # resolve, as the deployed ServerApp's run config does: both sides train the same stage 0
    cfg = TrainConfig.resolve(
        partitions=str(parts), clients=3, stages=1, rounds=args.rounds, hidden=64, out_dir=str(sim_dir)
    )
    simulate(cfg)
    sim = round_latencies(sim_dir)
    run_config = f"stages=1 rounds='{args.rounds}' hidden=64"
    plain_run = deployed(parts, tmp / "flower-supernode", run_config, worker=False)
    ours_run = deployed(parts, tmp / "retexo-supernode", run_config, worker=True)
    memory_run = deployed(parts, tmp / "in-memory", run_config, worker=True, database=False)
    plain, ours, memory = (round_latencies(r.out) for r in (plain_run, ours_run, memory_run))
    plain_wall, ours_wall, memory_wall = plain_run.wall, ours_run.wall, memory_run.wall
    peaks = ours_run.peak_mb
    imports = {
        "flwr.clientapp": import_seconds("flwr.clientapp"),
        "ClientApp shim (clients.app, no torch)": import_seconds("clients.app"),
        "ClientApp answering itself (clients.node_client, torch)": import_seconds("clients.node_client"),
    }
    med = {
        "simulation": statistics.median(sim),
        "flower-supernode": statistics.median(plain),
        "retexo-fl supernode": statistics.median(ours),
        "retexo-fl supernode, SuperLink state in memory": statistics.median(memory),
    }
    whole = {}
    if args.whole_run:  # on both SuperLink stores: the SQLite file is most of its CPU on 2 cores
        for store, database in (("sqlite", True), ("in-memory", False)):
            whole_run = deployed(parts, tmp / f"whole-{store}", args.whole_config, True, 3600, database)
            lat, wall = round_latencies(whole_run.out), whole_run.wall
            whole[store] = {
                "rounds": len(lat) + 1,
                "wall_seconds": wall,
                "median_round": statistics.median(lat),
            }

    print(f"\nmedian round latency, 3 clients, Cora, {args.rounds} rounds")
    for name, sec in med.items():
        ratio = sec / med["simulation"]
        print(f"  {name:<48} {sec:6.2f} s   {ratio:6.1f}x simulation")
    print(
        f"  whole {args.rounds}-round run, submit to finish: flower-supernode {plain_wall:.1f} s, "
        f"retexo-fl supernode {ours_wall:.1f} s"
    )
    print(f"  node worker peak RSS: {', '.join(f'{p:.0f} MB' for p in peaks)}")
    print("\nfresh interpreter importing (what each per-message ClientApp process pays)")
    for name, sec in imports.items():
        print(f"  {name:<58} {sec:5.2f} s")
    for store, w in whole.items():
        print(
            f"\nwhole Cora run ({args.whole_config or 'defaults'}) on retexo-fl supernode, "
            f"SuperLink state {store}: {w['wall_seconds']:.0f} s, {w['rounds']} rounds, "
            f"median round {w['median_round']:.2f} s"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "rounds": args.rounds,
                "latencies": {
                    "simulation": sim,
                    "flower-supernode": plain,
                    "retexo-fl supernode": ours,
                    "retexo-fl supernode, SuperLink state in memory": memory,
                },
                "median": med,
                "run_wall_seconds": {
                    "flower-supernode": plain_wall,
                    "retexo-fl supernode": ours_wall,
                    "retexo-fl supernode, SuperLink state in memory": memory_wall,
                },
                "worker_peak_mb": peaks,
                "import_seconds": imports,
                "whole_run": {"config": args.whole_config or "defaults", **whole} if whole else None,
            },
            indent=2,
        )
    )
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
