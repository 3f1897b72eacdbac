"""Flower overhead: simulation against in-process wall time, and wire against payload bytes.

Runs the same lazy job (Cora, 4 METIS clients, 2 stages by default) in both engines in one
process tree, prints a table and writes JSON::

    python bench/flower_overhead.py --rounds 50 --out bench/results/flower_overhead.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_root = Path(__file__).resolve().parents[1].parent / "shared" / "datasets"
    parser.add_argument("--root", default=str(default_root), help="folder with Planetoid/Cora/raw")
    parser.add_argument("--dataset", default="Cora")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--rounds", default="50")
    parser.add_argument("--out", default="bench/results/flower_overhead.json")
    args = parser.parse_args()

    from retexo_fl.config import TrainConfig
    from retexo_fl.metrics import RunRecorder
    from retexo_fl.runner import train
    from server.simulation import simulate

    tmp = Path(tempfile.mkdtemp(prefix="retexo-overhead-"))
    src = Path(args.root) / "Planetoid" / args.dataset / "raw"
    if src.is_dir():  # PyG writes processed/ beside raw/: use a private copy
        shutil.copytree(src, tmp / "Planetoid" / args.dataset / "raw")
    cfg = TrainConfig.from_mapping(
        {
            "dataset": args.dataset,
            "data-root": str(tmp),
            "clients": args.clients,
            "stages": args.stages,
            "rounds": args.rounds,
        }
    )
    t0 = time.perf_counter()
    ref = train(cfg, RunRecorder(None, stream=None))
    t_in = time.perf_counter() - t0
    t0 = time.perf_counter()
    sim = simulate(cfg)
    t_sim = time.perf_counter() - t0
    shutil.rmtree(tmp, ignore_errors=True)
    traffic = sim["traffic"]
    result = {
        "config": cfg.to_dict(),
        "in_process_seconds": t_in,
        "simulation_seconds": t_sim,
        "simulation_over_in_process": t_sim / t_in,
        "test_accuracy": {"in_process": ref["test_accuracy"], "simulation": sim["test_accuracy"]},
        "bytes_boundary": {"in_process": ref["bytes_boundary"], "simulation": sim["bytes_boundary"]},
        "bytes_wire": traffic["bytes_wire"],
        "bytes_payload": traffic["bytes_payload"],
        "wire_over_payload": traffic["overhead"],
        "boundary_wire_over_payload": traffic["boundary_overhead"],
    }
    rows = [
        ("wall seconds, in-process", f"{t_in:.1f}"),
        ("wall seconds, Flower simulation (incl. Ray start)", f"{t_sim:.1f}"),
        ("simulation / in-process", f"{t_sim / t_in:.2f}"),
        ("test accuracy in-process / simulation", f"{ref['test_accuracy']:.4f} / {sim['test_accuracy']:.4f}"),
        ("wire bytes / payload bytes, all messages", f"{traffic['overhead']:.4f}"),
        ("wire bytes / payload bytes, boundary (embed replies)", f"{traffic['boundary_overhead']:.4f}"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
