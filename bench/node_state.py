"""Node-local state at one node per client: what saving and restoring it costs a run.

Flower simulation hands a virtual node's next message to any actor, which restores the node's
client from its work folder unless it holds the current state, and saves it after every
message that changed it. This runs a node-level lazy run in process with every client restored
before and saved after each message (the worst case: every message served by another process),
and prints a table and writes JSON: state bytes written, seconds in save and restore, the whole
run, and a digest of the validation curve (equal across code versions that change no result)::

    python bench/node_state.py --out bench/results/node-state.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=400, help="generated graph nodes (clients)")
    parser.add_argument("--rounds", type=int, default=8, help="rounds of every stage (no early stop before)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="", help="JSON file to write")
    args = parser.parse_args()

    from retexo_fl.config import TrainConfig
    from retexo_fl.coordinator.stages import LazyStageMachine
    from retexo_fl.coordinator.transport import Batch
    from retexo_fl.data.datasets import apply_split, synthetic_sbm
    from retexo_fl.data.partitioners import partition_graph
    from retexo_fl.metrics import RunRecorder
    from retexo_fl.party.handlers import handle
    from retexo_fl.party.lazy_client import LazyClient
    from retexo_fl.party.state import ClientState
    from retexo_fl.training.inprocess import InProcessTransport

    stats = {"saves": 0, "state_bytes": 0, "save_s": 0.0, "restore_s": 0.0}
    real_save = ClientState.save

    def counted_save(self: ClientState, folder, *a, **k):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        path = real_save(self, folder, *a, **k)
        stats["save_s"] += time.perf_counter() - t
        stats["saves"] += 1
        stats["state_bytes"] += path.stat().st_size
        return path

    ClientState.save = counted_save  # type: ignore[method-assign]
    work = Path(tempfile.mkdtemp(prefix="retexo-node-state-"))

    class EveryMessageElsewhere(InProcessTransport):
        """Each message's client restored from its folder first and saved after, as an actor
        that did not serve the node's last message does."""

        def send(self, kind, requests, phase, stage):  # type: ignore[no-untyped-def]
            replies = {}
            for a, request in requests.items():
                client, folder = self.clients[a], work / f"node-{a}"
                t = time.perf_counter()
                client.restore(folder)
                stats["restore_s"] += time.perf_counter() - t
                reply = handle(client, kind, request)
                if reply.changed:
                    client.save(folder)
                replies[a] = reply.records
            return Batch(replies)

    data = synthetic_sbm(
        args.nodes, 3, avg_degree=6, homophily=0.85, num_features=64, feature_signal=0.35, seed=1
    )
    apply_split(data, "random:0.3,0.2,0.5", seed=1)
    parts = partition_graph(data, data.num_nodes, "node", seed=args.seed)
    cfg = TrainConfig.resolve(
        method="node",
        clients=data.num_nodes,
        rounds=args.rounds,
        min_rounds=args.rounds,
        warm_min_rounds=args.rounds,
        seed=args.seed,
        hidden=64,
    )
    clients = [LazyClient(p, cfg) for p in parts]
    t0 = time.perf_counter()
    summary = LazyStageMachine(EveryMessageElsewhere(clients), cfg, RunRecorder(None, stream=None)).run()
    total = time.perf_counter() - t0
    curve = [[h.get("val_accuracy"), h.get("train_loss")] for s in summary["stages"] for h in s["history"]]
    row = {
        "nodes": args.nodes,
        "rounds": args.rounds,
        "seed": args.seed,
        "test_accuracy": summary["test_accuracy"],
        "bytes_model": summary.get("bytes_model"),
        "curve_digest": hashlib.sha256(json.dumps(curve).encode()).hexdigest()[:16],
        **stats,
        "state_mb": round(stats["state_bytes"] / 1e6, 1),
        "total_s": round(total, 1),
    }
    print(f"{'saves':>7} {'state MB':>9} {'save s':>7} {'restore s':>9} {'run s':>7} {'test':>6}  curve")
    print(
        f"{row['saves']:>7} {row['state_mb']:>9.1f} {row['save_s']:>7.1f} {row['restore_s']:>9.1f} "
        f"{row['total_s']:>7.1f} {row['test_accuracy']:>6.3f}  {row['curve_digest']}"
    )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(row, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
