"""Dropout masks: the hashed lanes against the drawn lanes they replaced and ``nn.Dropout``.

    python bench/dropout.py [--repeats 21] [--threads 2] [--runs cora,large --root DATASETS]
        [--out bench/results/dropout-DATE.json]

For each input shape (one node's features or hidden row at node level, a Cora client's
partition, a whole Cora graph, a conv stage's input on a 300,000-node graph), it times, median
of ``--repeats`` calls in one process:

- ``keep_mask`` as it is (one key, the counter hash: the compiled loop on the CPU);
- the same with ``RETEXO_FL_NATIVE=0`` (the hash as torch integer ops: the path on a GPU);
- the lanes drawn from torch's generator (``randint`` of every lane, compare, cast, scale: the
  code before 2026-11-29, rebuilt here as the reference);
- a whole dropout forward and backward: ours, the drawn lanes, and ``nn.functional.dropout``.

With ``--runs``, whole lazy runs in process with each mask, alternated, ``--run-repeats`` times
each (the drawn lanes patched in where the package draws masks): ``cora`` (10 random clients,
the defaults a user gets; the two masks train differently, so rounds differ too) and ``large``
(a generated 300,000-node graph, 8 random clients, 2 stages x 8 rounds each way: the same work).

It prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from datetime import date
from pathlib import Path

import torch

from retexo_fl.compress import native
from retexo_fl.models.dropout import dropout, keep_mask

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, gpu.py
from common import DEFAULT_ROOT

SHAPES = {
    "one node, Cora features": (1, 1433),
    "one node, hidden 64": (1, 64),
    "Cora client (10 random), features": (271, 1433),
    "Cora, whole graph, features": (2708, 1433),
    "300,000-node graph, conv input 64": (300_000, 64),
}
CPU = torch.device("cpu")


def drawn_mask(shape: tuple[int, ...], p: float) -> torch.Tensor:
    """The mask as drawn before the hash: every lane from torch's generator, then four passes."""
    n = math.prod(shape)
    dropped = min(round(p * 65536), 65535)
    words = torch.randint(-(2**63), 2**63 - 1, ((n + 3) // 4,), dtype=torch.int64)
    lanes = words.view(torch.int16)[:n].view(shape)
    return lanes.ge(dropped - 32768).to(torch.float32).mul_(65536 / (65536 - dropped))


@contextlib.contextmanager
def drawn_masks() -> Iterator[None]:
    """Every mask the package draws drawn as before the hash (``Dropout``, stages, cohorts)."""
    import retexo_fl.models.dropout as module
    import retexo_fl.models.stage as stage
    import retexo_fl.party.cohort as cohort

    def keep(shape: tuple[int, ...], p: float, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return drawn_mask(shape, p).to(dtype)

    def drop(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
        if not training or p == 0.0:
            return x
        return x * 0.0 if p >= 1.0 else x * keep(tuple(x.shape), p, dtype=x.dtype, device=x.device)

    saved = (module.dropout, module.keep_mask, stage.keep_mask, cohort.keep_mask)
    module.dropout, module.keep_mask, stage.keep_mask, cohort.keep_mask = drop, keep, keep, keep
    try:
        yield
    finally:
        module.dropout, module.keep_mask, stage.keep_mask, cohort.keep_mask = saved


def whole_runs(names: list[str], root: str | None, repeats: int) -> list[dict]:
    """Whole lazy runs with each mask, alternated: seconds, rounds, test accuracy."""
    import copy
    import dataclasses

    from common import private_planetoid
    from gpu import _generated, quiet, total_rounds

    from retexo_fl.config import TrainConfig
    from retexo_fl.data.loading import load_graph
    from retexo_fl.data.partitioners import partition_graph
    from retexo_fl.training.lazy import run_lazy

    rows = []
    for name in names:
        if name == "cora":
            if not root:
                raise SystemExit("--runs cora needs --root (the folder holding Planetoid/Cora/raw)")
            data_root = str(private_planetoid(root, ("Cora",)))
            cfg = TrainConfig.resolve(
                dataset="Cora", data_root=data_root, clients=10, method="random", seed=0
            )
            parts = partition_graph(load_graph(cfg), cfg.clients, cfg.method, seed=cfg.seed)
        elif name == "large":
            cfg = TrainConfig(
                clients=8, method="random", seed=0, stages=2, rounds=8, min_rounds=8, warm_min_rounds=0,
                self_training=0,
            )  # fmt: skip
            parts = partition_graph(_generated(300_000, 20.0), 8, "random", seed=0)
        else:
            raise SystemExit(f"--runs: unknown run {name!r} (cora, large)")
        cfg = dataclasses.replace(cfg, device="cpu")
        for i in range(repeats):
            for mask in ("hashed", "drawn") if i % 2 == 0 else ("drawn", "hashed"):
                with drawn_masks() if mask == "drawn" else contextlib.nullcontext():
                    t0 = time.perf_counter()
                    summary = run_lazy(copy.deepcopy(parts), cfg, quiet())
                    seconds = time.perf_counter() - t0
                rows.append({
                    "run": name, "mask": mask, "repeat": i, "seconds": round(seconds, 2),
                    "rounds": total_rounds(summary), "test_accuracy": round(summary.test_accuracy, 4),
                })  # fmt: skip
                print(f"  {name} {mask}: {seconds:.2f} s, {rows[-1]['rounds']} rounds", flush=True)
    return rows


def median_us(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm: the library's first load, allocator pools
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def forward_backward(drop: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        x.grad = None
        drop(x).sum().backward()

    return run


def measure(shape: tuple[int, ...], p: float, repeats: int) -> dict:
    """One shape's row: each mask and each forward and backward, median microseconds."""

    def ours() -> torch.Tensor:
        return keep_mask(shape, p, dtype=torch.float32, device=CPU)

    row: dict = {"size": list(shape), "elements": math.prod(shape)}
    row["mask_hashed_us"] = median_us(ours, repeats)
    switch = os.environ.get(native.NATIVE_ENV)
    os.environ[native.NATIVE_ENV] = "0"
    row["mask_hashed_torch_ops_us"] = median_us(ours, repeats)
    if switch is None:
        del os.environ[native.NATIVE_ENV]
    else:
        os.environ[native.NATIVE_ENV] = switch
    row["mask_drawn_us"] = median_us(lambda: drawn_mask(shape, p), repeats)
    x = torch.randn(*shape, requires_grad=True)
    drops = {
        "hashed": lambda t: dropout(t, p),
        "drawn": lambda t: t * drawn_mask(shape, p),
        "nn_dropout": lambda t: torch.nn.functional.dropout(t, p),
    }
    for name, drop in drops.items():
        row[f"fwd_bwd_{name}_us"] = median_us(forward_backward(drop, x), repeats)
    return row


COLUMNS = {
    "mask hashed (C)": "mask_hashed_us",
    "hashed, torch ops": "mask_hashed_torch_ops_us",
    "drawn (before)": "mask_drawn_us",
    "fwd+bwd hashed": "fwd_bwd_hashed_us",
    "drawn": "fwd_bwd_drawn_us",
    "nn.Dropout": "fwd_bwd_nn_dropout_us",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=21, help="calls per figure (x20 below 1M elements)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--p", type=float, default=0.5)
    ap.add_argument("--runs", default="", help="whole runs too: cora, large (comma-separated)")
    ap.add_argument("--run-repeats", type=int, default=2)
    ap.add_argument("--root", default=str(DEFAULT_ROOT), help="the folder holding Planetoid/Cora/raw")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    compiled = native.library() is not None
    rows = []
    for name, shape in SHAPES.items():
        repeats = args.repeats if math.prod(shape) > 1_000_000 else args.repeats * 20
        rows.append({"shape": name, **measure(shape, args.p, repeats)})
        print(f"  {name}: done", flush=True)
    loop = "yes" if compiled else "no"
    print(f"\nthreads {args.threads}, p {args.p}, compiled loop {loop}; microseconds, median\n")
    print("| shape | elements | " + " | ".join(COLUMNS) + " |")
    print("|---|---:|" + "---:|" * len(COLUMNS))
    for r in rows:
        cells = " | ".join(f"{r[key]:,.0f}" for key in COLUMNS.values())
        print(f"| {r['shape']} | {r['elements']:,} | {cells} |")
    runs = (
        whole_runs([r for r in args.runs.split(",") if r], args.root, args.run_repeats) if args.runs else []
    )
    if runs:
        print("\n| run | mask | seconds (each repeat) | rounds | s / round | test |")
        print("|---|---|---|---:|---:|---:|")
        for name in dict.fromkeys(r["run"] for r in runs):
            for mask in ("hashed", "drawn"):
                mine = [r for r in runs if r["run"] == name and r["mask"] == mask]
                secs = ", ".join(f"{r['seconds']:.2f}" for r in mine)
                per = statistics.median(r["seconds"] / max(1, r["rounds"]) for r in mine)
                rounds, test = mine[0]["rounds"], mine[0]["test_accuracy"]
                print(f"| {name} | {mask} | {secs} | {rounds} | {per:.3f} | {test:.3f} |")
    if args.out:
        meta = {"date": str(date.today()), "threads": args.threads, "p": args.p, "compiled": compiled,
                "torch": torch.__version__, "cpus": os.cpu_count()}  # fmt: skip
        args.out.write_text(json.dumps({"meta": meta, "rows": rows, "runs": runs}, indent=1))
        print(f"-> {args.out}")


if __name__ == "__main__":
    main()
