"""What a curious peer and a curious server learn, with and without the boundary-row defense.

python bench/inversion.py [--root ../shared/datasets] [--datasets Cora,CiteSeer,sbm:1200,4]
                          [--noise none,0,0.05,0.2,1] [--clip 1.0] [--out bench/results/inversion-DATE.json]

For each dataset and defense setting it runs a lazy and an eager federation in process (4 random
clients, 2 stages / layers, 30 rounds, the default hidden width, optimizer and norm), playing:

- **the curious peer** (client 0). It holds its own partition, the shared model, and the
  boundary rows its peers sent it. It fits an inversion rows -> raw features on its own nodes
  (whose rows it computes, and releases through the same clip and noise, as the run config says)
  and applies it to the received rows: a ridge regression ("linear") and a small MLP ("mlp").
  Lazy: the stage-0 rows of stage 1's halo. Eager: the last round's layer-1 input rows.
  Reported: R^2 of the recovered features against the true ones (all entries), and the fraction
  of rows recovered exactly (binary features: every bit; continuous: every entry within 0.1 of
  the feature's standard deviation), with the chance level (the attacker's own mean row).
- **the curious server**. From each client's first-round update of the head's bias it estimates
  the client's training-label histogram (one SGD step: y_bar ~ 1/C + delta_bias / lr; scale-free
  rank correlation too) against the true one, with the chance level (a uniform guess).

"none" runs with rows as computed; a number is --boundary-noise with --boundary-clip --clip
("0": clipping only). Test accuracy and the per-row epsilon (delta 1e-5) are reported beside.
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import DEFAULT_ROOT, private_planetoid
from retexo_fl import protocol as P
from retexo_fl.config import TrainConfig
from retexo_fl.data.loading import load_graph
from retexo_fl.data.partitioners import partition_graph
from retexo_fl.metrics import RunRecorder
from retexo_fl.secure.boundary_noise import release_rows
from retexo_fl.training.eager_client import EagerClient
from retexo_fl.training.inprocess import InProcessTransport
from retexo_fl.training.lazy_client import LazyClient
from retexo_fl.training.rounds import BaselineRun
from retexo_fl.training.stages import LazyStageMachine

ATTACKER = 0


def r2(pred: np.ndarray, true: np.ndarray) -> float:
    """1 - SSE / SST over every entry, SST around each feature's mean."""
    sst = float(((true - true.mean(0)) ** 2).sum())
    return 1.0 - float(((pred - true) ** 2).sum()) / max(sst, 1e-12)


def exact_rows(pred: np.ndarray, true: np.ndarray, binary: bool, std: np.ndarray) -> float:
    """Fraction of rows recovered exactly (binary: every bit; else every entry within 0.1 std)."""
    if binary:
        return float(((pred >= 0.5) == (true >= 0.5)).all(axis=1).mean())
    return float((np.abs(pred - true) <= 0.1 * np.maximum(std, 1e-6)).all(axis=1).mean())


def ridge(h: np.ndarray, x: np.ndarray, lam: float = 1e-2) -> tuple[np.ndarray, np.ndarray]:
    """Least squares x ~ h A + c with an L2 penalty (closed form)."""
    hm, xm = h.mean(0), x.mean(0)
    hc = h - hm
    a = np.linalg.solve(hc.T @ hc + lam * len(h) * np.eye(h.shape[1]), hc.T @ (x - xm))
    return a, xm - hm @ a


def mlp_inversion(h: np.ndarray, x: np.ndarray, binary: bool, seed: int = 0) -> torch.nn.Module:
    """A two-layer MLP rows -> features, fitted on the attacker's own nodes."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(
        torch.nn.Linear(h.shape[1], 256), torch.nn.ReLU(), torch.nn.Linear(256, x.shape[1])
    )
    opt = torch.optim.Adam(net.parameters(), lr=1e-3, weight_decay=1e-5)
    ht, xt = torch.from_numpy(h).float(), torch.from_numpy(x).float()
    loss_fn = torch.nn.BCEWithLogitsLoss() if binary else torch.nn.MSELoss()
    for _ in range(400):
        opt.zero_grad()
        loss_fn(net(ht), xt).backward()
        opt.step()
    return net


def peer_attack(own_rows: np.ndarray, own_x: np.ndarray, got_rows: np.ndarray, true_x: np.ndarray) -> dict:
    """Fit on (own rows, own features), invert the received rows, score against their truth."""
    binary = bool(np.isin(own_x, (0.0, 1.0)).all())
    std = own_x.std(0)
    a, c = ridge(own_rows, own_x)
    linear = got_rows @ a + c
    net = mlp_inversion(own_rows, own_x, binary)
    with torch.no_grad():
        out = net(torch.from_numpy(got_rows).float())
        mlp = (torch.sigmoid(out) if binary else out).numpy()
    chance = np.broadcast_to(own_x.mean(0), true_x.shape)
    extra = {}
    if binary:  # of the bits the MLP calls set, how many are (the density of set bits: by chance)
        called = mlp >= 0.5
        extra = {
            "bit_precision_mlp": round(float(true_x[called].mean()) if called.any() else 0.0, 4),
            "bit_precision_chance": round(float(true_x.mean()), 4),
        }
    return {
        "rows": len(true_x),
        "binary_features": binary,
        "r2_linear": round(r2(linear, true_x), 4),
        "r2_mlp": round(r2(mlp, true_x), 4),
        "exact_linear": round(exact_rows(linear, true_x, binary, std), 4),
        "exact_mlp": round(exact_rows(mlp, true_x, binary, std), 4),
        "exact_chance": round(exact_rows(chance, true_x, binary, std), 4),
        **extra,
    }


def label_attack(first_round: dict[int, tuple[dict, dict]], clients: list, cfg: TrainConfig) -> dict:
    """The server's estimate of each client's training-label histogram from its first update."""
    tvs, chance_tvs, rhos = [], [], []
    for a, (sent, reply) in first_round.items():
        if P.ARRAYS not in reply:
            continue  # a compressed update (update-bits < 32): not measured here
        key = next(k for k in reply[P.ARRAYS] if k.endswith("head.bias"))
        delta = (reply[P.ARRAYS][key] - sent[P.ARRAYS][key]).numpy()
        c = clients[a]
        y = c.y[c.masks["train"]].cpu().numpy()
        true = np.bincount(y, minlength=len(delta)) / max(len(y), 1)
        est = np.clip(1.0 / len(delta) + delta / cfg.lr, 0, None)
        est = est / est.sum() if est.sum() > 0 else np.full(len(delta), 1.0 / len(delta))
        tvs.append(0.5 * np.abs(est - true).sum())
        chance_tvs.append(0.5 * np.abs(1.0 / len(delta) - true).sum())
        rt, rd = np.argsort(np.argsort(true)), np.argsort(np.argsort(delta))
        rhos.append(float(np.corrcoef(rt, rd)[0, 1]) if true.std() > 0 else 0.0)
    if not tvs:
        return {}
    return {
        "label_tv": round(float(np.mean(tvs)), 4),
        "label_tv_chance": round(float(np.mean(chance_tvs)), 4),
        "label_rank_corr": round(float(np.nanmean(rhos)), 4),
    }


class Spy(InProcessTransport):
    """The in-process transport, keeping what a curious server and the attacking peer see."""

    def __init__(self, clients: list, cfg: TrainConfig) -> None:
        super().__init__(clients)
        self.cfg = cfg
        self.first_round: dict[int, tuple[dict, dict]] = {}
        self.peer: dict[str, np.ndarray] = {}
        self.last_state: dict | None = None  # the attacker's last broadcast model (eager)

    def send(self, kind, requests, phase, stage):
        batch = super().send(kind, requests, phase, stage)
        if kind == P.TRAIN and not self.first_round:
            self.first_round = {a: (requests[a], batch.replies[a]) for a in requests}
        if kind == P.TRAIN and P.ARRAYS in requests.get(ATTACKER, {}):
            self.last_state = requests[ATTACKER][P.ARRAYS]
        c = self.clients[ATTACKER]
        if isinstance(c, LazyClient) and c.stage == 1 and c.halo is not None and "got" not in self.peer:
            # Stage 1's halo holds the stage-0 rows peers released; the owned rows are this
            # client's exact stage-0 rows, released through the same clip and noise to fit on.
            own = c.owned.cpu()
            if self.cfg.boundary_clip > 0:
                gen = torch.Generator().manual_seed(12345)
                own = release_rows(own, self.cfg.boundary_clip, self.cfg.boundary_noise, gen)
            self.peer = {"own": own.numpy(), "got": c.halo.cpu().numpy(), "ids": c.plan.halo_ids}
        return batch


def eager_peer(c: EagerClient, state: dict, cfg: TrainConfig) -> dict[str, np.ndarray]:
    """The eager attacker's own layer-1 input rows (released as the run does) and the received ones."""
    model = c.loaded_model(state)
    model.eval()
    with torch.no_grad():
        ei, w = c.conv_edges()
        _, inputs = model(c.owned, ei, w, c.halo_layers)
    own = inputs[0].float().cpu()
    if cfg.boundary_clip > 0:
        own = release_rows(own, cfg.boundary_clip, cfg.boundary_noise, torch.Generator().manual_seed(12345))
    return {"own": own.numpy(), "got": c.halo_layers[0].cpu().numpy(), "ids": c.plan.halo_ids}


def one_run(graph, base: TrainConfig, mode: str, noise: str) -> dict:
    cfg = (
        base
        if noise == "none"
        else dataclasses.replace(base, boundary_clip=ARGS.clip, boundary_noise=float(noise))
    )
    cfg = dataclasses.replace(cfg, mode=mode)
    parts = partition_graph(graph, cfg.clients, cfg.method, seed=cfg.seed)
    clients = [LazyClient(p, cfg) if mode == "lazy" else EagerClient(p, cfg) for p in parts]
    spy = Spy(clients, cfg)
    rec = RunRecorder(None, stream=None)
    t0 = time.perf_counter()
    if mode == "lazy":
        summary = LazyStageMachine(spy, cfg, rec).run()
        peer = spy.peer
    else:
        summary = BaselineRun(spy, cfg, rec).run()
        peer = eager_peer(clients[ATTACKER], spy.last_state, cfg) if spy.last_state else {}
    seconds = time.perf_counter() - t0
    x = graph.x.numpy()
    own_x = np.asarray(parts[ATTACKER].x, dtype=np.float32)
    row = {
        "mode": mode,
        "defense": noise,
        "clip": None if noise == "none" else ARGS.clip,
        "test_accuracy": round(summary["test_accuracy"], 4),
        "epsilon_per_row": None
        if summary.get("boundary_privacy") is None
        else summary["boundary_privacy"]["epsilon"],
        "seconds": round(seconds, 1),
    }
    if peer:
        row.update(peer_attack(peer["own"], own_x, peer["got"], x[peer["ids"]]))
    row.update(label_attack(spy.first_round, clients, cfg))
    return row


def main() -> None:
    rows = []
    root = private_planetoid(ARGS.root)
    for name in ARGS.datasets.split(";"):
        base = TrainConfig(
            dataset=name, data_root=str(root), clients=4, method="random", stages=2, rounds=30,
            patience=0, encrypt=False, seed=0, threads=2,
        )  # fmt: skip
        graph = load_graph(base)
        for mode in ARGS.modes.split(","):
            for noise in ARGS.noise.split(","):
                row = {"dataset": name, **one_run(graph, base, mode, noise)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    cols = ["dataset", "mode", "defense", "test_accuracy", "epsilon_per_row", "r2_linear", "r2_mlp",
            "exact_linear", "exact_mlp", "exact_chance", "bit_precision_mlp", "bit_precision_chance",
            "label_tv", "label_tv_chance", "label_rank_corr"]  # fmt: skip
    print("\n" + " | ".join(cols))
    for r in rows:
        print(" | ".join(str(r.get(c, "")) for c in cols))
    out = Path(ARGS.out or f"bench/results/inversion-{datetime.date.today()}.json")
    out.write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", default=str(DEFAULT_ROOT))
    parser.add_argument("--datasets", default="Cora;CiteSeer;sbm:1200,4")
    parser.add_argument("--modes", default="lazy,eager")
    parser.add_argument("--noise", default="none,0,0.05,0.2,1")
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--out", default="")
    ARGS = parser.parse_args()
    main()
