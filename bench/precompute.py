"""Precomputed aggregation (--precompute) against message passing, side by side, on Cora.

python bench/precompute.py [DATA_ROOT] > bench/results/precompute-DATE.jsonl: lazy runs, 10 random
clients, 3 stages, hidden 64, 60 rounds a stage, default input dropout 0.5 (where precompute is
an approximation), GCN and SAGE, seeds 0 and 1, one thread. Prints one JSON line per run with
validation / test accuracy, wall seconds and each stage's seconds.
"""

import json
import sys
import time

from retexo_fl.config import TrainConfig
from retexo_fl.metrics import RunRecorder
from retexo_fl.runner import train

ROOT = sys.argv[1] if len(sys.argv) > 1 else "data"
q = RunRecorder(None, stream=None)
for model in ("gcn", "sage"):
    for seed in (0, 1):
        for pre in (False, True):
            t = time.time()
            cfg = TrainConfig(
                dataset="Cora", data_root=ROOT, clients=10, method="random", stages=3, hidden=64,
                rounds=60, model=model, seed=seed, threads=1, device="cpu", precompute=pre,
            )  # fmt: skip
            s = train(cfg, q)
            row = dict(
                model=model, seed=seed, precompute=pre, val=round(s["val_accuracy"], 4),
                test=round(s["test_accuracy"], 4), s=round(time.time() - t, 1),
                conv_stage_s=[round(st["seconds"], 2) for st in s["stages"]],
            )  # fmt: skip
            print(json.dumps(row), flush=True)
