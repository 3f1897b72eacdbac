"""Round latency deployed (SuperLink + 3 SuperNodes on 127.0.0.1) against simulation, and where it goes.

One sitting: lazy GCN on Cora, 3 clients, one stage of R rounds (each round one ``train``
message that also validates the incoming state), in Flower's simulation engine and deployed
twice: with Flower's defaults, and with the SuperExec polling every 0.1 s
(``FLWR_SUPEREXEC_TASK_POLL_INTERVAL``). A round's latency is the time between consecutive
``round`` events of the run. The causes are measured apart: a fresh interpreter importing the
ClientApp module (what every deployed message pays), the round's work (the simulated round),
the SuperExec poll (the difference the 0.1 s setting makes); the remainder is Flower's fixed
3 s SuperNode idle poll and the message plumbing. Writes JSON. Example::

    python bench/deploy_latency.py --out bench/results/deploy_latency.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "deploy"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_ROOT, private_planetoid  # noqa: E402
from federation import Federation  # noqa: E402


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


def deployed(parts: Path, work: Path, rounds: int, env: dict[str, str] | None) -> list[float]:
    fed = Federation(work)
    out = work / "run"
    try:
        parties = sorted(parts.glob("part-*"))
        record = fed.run_parties(parties, out, f"stages=1 rounds='{rounds}' hidden=64", 1200, env=env)
        if record.get("status") != "finished:completed":
            raise RuntimeError(f"deployed run ended {record.get('status')}; see {work}")
    finally:
        fed.stop_all()
    return round_latencies(out)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", default=str(DEFAULT_ROOT))
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--out", default="bench/results/deploy_latency.json")
    args = parser.parse_args()

    from retexo_fl.cli import main as cli
    from retexo_fl.config import TrainConfig
    from server.simulation import simulate

    tmp = Path(tempfile.mkdtemp(prefix="retexo-latency-"))
    data = private_planetoid(args.root, ("Cora",))
    parts = tmp / "parts"
    cli(["partition", "--dataset", "Cora", "--root", str(data), "--clients", "3", "--out", str(parts)])

    sim_dir = tmp / "sim"
    cfg = TrainConfig(
        partitions=str(parts), clients=3, stages=1, rounds=args.rounds, hidden=64, out_dir=str(sim_dir)
    )
    simulate(cfg)
    sim = round_latencies(sim_dir)
    default = deployed(parts, tmp / "deployed-default", args.rounds, None)
    fast = deployed(parts, tmp / "deployed-poll", args.rounds, {"FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.1"})
    clientapp_import = import_seconds("clients.app")
    flwr_import = import_seconds("flwr.clientapp")

    med = {
        k: statistics.median(v)
        for k, v in (("simulation", sim), ("deployed", default), ("deployed_poll", fast))
    }
    causes = {
        "round work (simulated round)": med["simulation"],
        "ClientApp process: python + flwr imports": flwr_import,
        "ClientApp process: our module (torch, retexo_fl)": max(0.0, clientapp_import - flwr_import),
        "SuperExec poll (default 1 s)": max(0.0, med["deployed"] - med["deployed_poll"]),
    }
    causes["SuperNode 3 s idle poll and message plumbing (rest)"] = max(
        0.0, med["deployed"] - sum(causes.values())
    )
    print(f"\nmedian round latency, 3 clients, Cora, {args.rounds} rounds")
    print(f"  simulation                      {med['simulation']:6.2f} s")
    print(f"  deployed, Flower defaults       {med['deployed']:6.2f} s")
    print(f"  deployed, SuperExec poll 0.1 s  {med['deployed_poll']:6.2f} s")
    print("\nwhere a deployed round goes (defaults)")
    for name, sec in causes.items():
        print(f"  {name:<55} {sec:5.2f} s  {100 * sec / med['deployed']:4.0f}%")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "rounds": args.rounds,
                "latencies": {"simulation": sim, "deployed": default, "deployed_poll": fast},
                "median": med,
                "causes": causes,
            },
            indent=2,
        )
    )
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
