"""What secure aggregation costs, side by side with plain aggregation in one process: Cora, 4, 10
and 50 clients; or, with ``--defaults``, the default run (Cora, 4 METIS clients, every other
setting the default: 4-bit updates, early stopping, self-training) over seeds.

    python bench/secagg.py [--root ../shared/datasets] [--clients 4,10,50] [--rounds 10]
        [--out bench/results/secagg-DATE.json]
    python bench/secagg.py --defaults [--seeds 0,1,2] [--out bench/results/secagg-defaults-DATE.json]

Each row is a lazy run (random partitions, 2 stages, hidden 64, 5 local steps a round, FedAvg)
with ``--secure-aggregation`` off and on, in the in-process engine (one thread). Per round it
reports:

- the extra bytes: sealed self-seed shares up, the shares relayed down in the unmask message and
  the unmask answers up (the masked vector itself is as large as the float32 update it replaces,
  so masks cost no bytes);
- the extra messages: one unmask request and its reply per survivor;
- client compute: each client's share sealing, encoding and masking, and its unmask answer
  (wall seconds, summed over clients, divided by clients);
- server compute: unpacking, rebuilding the self seeds, unmasking and decoding;
- accuracy with it on and off (the decoded sum is within ``sum_error_bound`` of the plain one).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_ROOT, private_planetoid

from retexo_fl.config import TrainConfig
from retexo_fl.coordinator import secure_aggregation
from retexo_fl.metrics import RunRecorder
from retexo_fl.party import secure_reply
from retexo_fl.runner import train


class Timers:
    """Wall seconds spent in the wrapped functions, by side."""

    def __init__(self) -> None:
        self.seconds = {"client": 0.0, "server": 0.0}
        self._undo: list[tuple[object, str, object]] = []

    def wrap(self, module: object, name: str, side: str) -> None:
        original: Callable = getattr(module, name)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[side] += time.perf_counter() - t

        setattr(module, name, timed)
        self._undo.append((module, name, original))

    def restore(self) -> None:
        for module, name, original in reversed(self._undo):
            setattr(module, name, original)


def measure(cfg: TrainConfig) -> dict:
    """One run; with secure aggregation, its client and server seconds."""
    timers = Timers()
    if cfg.secure_aggregation:
        for name in ("prepare", "masked_records", "unmask"):
            timers.wrap(secure_reply, name, "client")
        timers.wrap(secure_aggregation, "unmask_round", "server")
    t0 = time.perf_counter()
    try:
        out = train(cfg, RunRecorder(None, stream=None)).to_dict()
    finally:
        timers.restore()
    out["wall"] = time.perf_counter() - t0
    out["timers"] = timers.seconds
    return out


def defaults(root: Path, seeds: list[int], out: str) -> None:
    """The default run with secure aggregation off and on, per seed: accuracy and total bytes."""
    rows = []
    for seed in seeds:
        base = TrainConfig(
            dataset="Cora", data_root=str(root), clients=4, method="metis", seed=seed, threads=1
        )
        plain = measure(base)
        secure = measure(dataclasses.replace(base, secure_aggregation=True))
        rows.append(
            {
                "seed": seed,
                "test_plain": plain["test_accuracy"],
                "test_secure": secure["test_accuracy"],
                "val_plain": plain["val_accuracy"],
                "val_secure": secure["val_accuracy"],
                "bytes_plain": plain["bytes_total"],
                "bytes_secure": secure["bytes_total"],
                "bytes_ratio": secure["bytes_total"] / plain["bytes_total"],
                "rounds_secure": secure["secure_aggregation"]["rounds"],
                "extra_bytes_secure": secure["secure_aggregation"]["bytes_extra"],
                "coordinates_clipped": secure["secure_aggregation"]["coordinates_clipped"],
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    print(f"{'seed':>4} {'test off/on':>13} {'val off/on':>13} {'MB off/on':>13} {'ratio':>6}")
    for r in rows:
        print(
            f"{r['seed']:>4} {r['test_plain']:>6.3f}/{r['test_secure']:<6.3f} "
            f"{r['val_plain']:>6.3f}/{r['val_secure']:<6.3f} "
            f"{r['bytes_plain'] / 1e6:>6.2f}/{r['bytes_secure'] / 1e6:<6.2f} {r['bytes_ratio']:>6.2f}"
        )
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0] if k != "seed"}
    mean["bytes_ratio_of_means"] = mean["bytes_secure"] / mean["bytes_plain"]
    print(
        f"mean {mean['test_plain']:.4f}/{mean['test_secure']:.4f} test, {mean['val_plain']:.4f}/"
        f"{mean['val_secure']:.4f} val, bytes {mean['bytes_ratio_of_means']:.2f}x"
    )
    meta = {"dataset": "Cora", "clients": 4, "method": "metis", "settings": "defaults", "threads": 1}
    Path(out).write_text(json.dumps({**meta, "rows": rows, "mean": mean}, indent=2))
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default=str(DEFAULT_ROOT))
    parser.add_argument("--clients", default="4,10,50")
    parser.add_argument("--rounds", type=int, default=10, help="rounds per stage (default 10)")
    parser.add_argument("--defaults", action="store_true", help="the default run over --seeds instead")
    parser.add_argument("--seeds", default="0,1,2", help="with --defaults (default 0,1,2)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = private_planetoid(args.root, ("Cora",))
    today = datetime.date.today()
    if args.defaults:
        seeds = [int(s) for s in args.seeds.split(",")]
        return defaults(root, seeds, args.out or f"bench/results/secagg-defaults-{today}.json")
    args.out = args.out or f"bench/results/secagg-{today}.json"
    rows = []
    for clients in (int(c) for c in args.clients.split(",")):
        base = TrainConfig(
            dataset="Cora", data_root=str(root), clients=clients, method="random", stages=2, hidden=64,
            rounds=args.rounds, local_epochs=5, server_optimizer="avg", server_lr=1.0, norm="none",
            seed=0, threads=1, device="cpu",
        )  # fmt: skip
        plain = measure(base)
        secure = measure(dataclasses.replace(base, secure_aggregation=True))
        sa = secure["secure_aggregation"]
        rounds = sa["rounds"]
        rows.append(
            {
                "clients": clients,
                "threshold": sa["threshold"],
                "rounds": rounds,
                "model_bytes_per_round_plain": plain["bytes_model"] / rounds,
                "model_bytes_per_round_secure": secure["bytes_model"] / rounds,
                "extra_bytes_per_round": sa["bytes_extra"] / rounds,
                "extra_messages_per_round": 2 * sa["unmask_messages"] / rounds,
                "client_seconds_per_round": secure["timers"]["client"] / rounds / clients,
                "server_seconds_per_round": secure["timers"]["server"] / rounds,
                "wall_plain": plain["wall"],
                "wall_secure": secure["wall"],
                "test_plain": plain["test_accuracy"],
                "test_secure": secure["test_accuracy"],
                "val_plain": plain["val_accuracy"],
                "val_secure": secure["val_accuracy"],
                "sum_error_bound": sa["sum_error_bound"],
                "coordinates_clipped": sa["coordinates_clipped"],
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    header = (
        f"{'clients':>7} {'t':>3} {'model B/rd':>11} {'extra B/rd':>11} {'extra msg/rd':>12} "
        f"{'client s/rd':>11} {'server s/rd':>11} {'wall off/on':>13} {'test off/on':>13}"
    )
    print(header)
    for r in rows:
        print(
            f"{r['clients']:>7} {r['threshold']:>3} {r['model_bytes_per_round_secure']:>11,.0f} "
            f"{r['extra_bytes_per_round']:>11,.0f} {r['extra_messages_per_round']:>12.0f} "
            f"{r['client_seconds_per_round']:>11.4f} {r['server_seconds_per_round']:>11.4f} "
            f"{r['wall_plain']:>6.1f}/{r['wall_secure']:<6.1f} "
            f"{r['test_plain']:>6.3f}/{r['test_secure']:<6.3f}"
        )
    meta = {"dataset": "Cora", "method": "random", "stages": 2, "hidden": 64, "threads": 1}
    Path(args.out).write_text(json.dumps({**meta, "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
