"""What a curious peer and a curious server learn in the default lazy run, with and without the
boundary-row defense.

python bench/inversion.py [--root ../shared/datasets] [--datasets Cora] [--seeds 0,1]
                          [--noise none,0.05,0.2,1] [--clip 1.0] [--synth 20000] [--epochs 10]
                          [--out bench/results/inversion-DATE.json]

Every run is TrainConfig's default lazy run, in process, with only the dataset, the seed and the
defense set (4 METIS clients, 3 stages, one self-training pass, 4-bit updates and broadcasts,
sealed boundary rows). Such a run releases boundary rows 4 times: the stage-0 rows and the conv
stage's rows of the first pass, then the same of the second (stages 0, 1, 3 and 4; stage 2 ends
the pass and relabels, nothing crosses). Playing:

- **the curious peer** (client 0), against every release ``k`` (and against all of them at once).
  It holds its own partition, every stage model the server broadcast, the halo nodes' degrees and
  the rows its peers released to it. Two attackers, each scored by the R^2 of the recovered
  features against the true ones (all entries), the fraction of rows recovered exactly (binary
  features: every bit; continuous: every entry within 0.1 of the feature's standard deviation)
  and, for binary features, the precision of the bits it calls set (chance: their density):

  * ``own`` (the earlier benchmark's attacker): fits rows -> raw features on its own nodes, whose
    rows it computed (released through the same clip and noise as the run config says), with a
    ridge regression (every release) and a small MLP (the first release, as before: it costs as
    much as the stronger peer), and applies them to the received rows.
  * ``synth`` (the stronger peer): synthesizes ``--synth`` nodes from its own (each a random own
    row with each set bit kept at 0.6 and words added at 0.4 of its count, drawn by its own word
    frequencies: of four such settings tried on seed 0's first release, the best; continuous
    features: plus Gaussian noise at 0.3 std), each with the neighbourhood of the own node it came
    from (own neighbours perturbed the same way, halo neighbours stood in by random own rows at
    their known degrees), and computes the rows a sender would release for them with the broadcast
    models: the stage-0 model, and for a conv release the GCN aggregation (global-degree weights;
    other parties' rows clipped and noised, the sender's own clipped) through the conv stage's
    model, each clipped and noised with fresh noise as the run config says. An MLP fitted on those
    (row, feature) pairs inverts the received rows; a joint one reads all releases of a node at
    once (release ``all``).

- **the curious server**. From each client's first update of stage 0's head bias, decoded as the
  server decodes it (4-bit by default; error feedback leaves nothing over in a first round), it
  estimates the client's training-label histogram (one SGD step: y_bar ~ 1/C + delta_bias / lr),
  scored by total variation against the true one (a uniform guess as chance), the rank
  correlation and whether its largest class is the true one. The same for float32 updates
  (``update-bits`` and ``broadcast-bits`` 32, a run stopped after its first round).

"none" runs with rows as computed; a number is --boundary-noise with --boundary-clip --clip
("0": clipping only). Test accuracy, and the epsilon per row (delta 1e-5) the project's accountant
gives after each release and for the run, are reported beside. Prints tables and writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import DEFAULT_ROOT, private_planetoid
from retexo_fl.config import TrainConfig
from retexo_fl.coordinator.stages import LazyStageMachine
from retexo_fl.data.loading import load_graph
from retexo_fl.data.partitioners import partition_graph
from retexo_fl.metrics import RunRecorder
from retexo_fl.models.factory import build_stage_model, stage_input_dim
from retexo_fl.party.lazy_client import LazyClient
from retexo_fl.records import StateDict
from retexo_fl.secure.boundary_noise import gaussian_epsilon, release_rows
from retexo_fl.training.inprocess import InProcessTransport

ATTACKER = 0
KEEP, ADD, NOISE_STD = 0.6, 0.4, 0.3  # the synthesizer's perturbation (see the docstring)
SETUP_KEYS = ("clients", "method", "stages", "self_training", "rounds", "local_epochs", "hidden", "norm",
              "bits", "update_bits", "broadcast_bits", "encrypt", "dp_delta")  # fmt: skip
PEER_COLS = ["dataset", "defense", "release", "stage", "test_accuracy", "epsilon_after",
             "own_r2_linear", "own_r2", "own_precision", "synth_r2", "synth_precision", "synth_exact",
             "r2_chance", "precision_chance"]  # fmt: skip


def r2(pred: np.ndarray, true: np.ndarray) -> float:
    """1 - SSE / SST over every entry, SST around each feature's mean."""
    sst = float(((true - true.mean(0)) ** 2).sum())
    return 1.0 - float(((pred - true) ** 2).sum()) / max(sst, 1e-12)


def exact_rows(pred: np.ndarray, true: np.ndarray, binary: bool, std: np.ndarray) -> float:
    """Fraction of rows recovered exactly (binary: every bit; else every entry within 0.1 std)."""
    if binary:
        return float(((pred >= 0.5) == (true >= 0.5)).all(axis=1).mean())
    return float((np.abs(pred - true) <= 0.1 * np.maximum(std, 1e-6)).all(axis=1).mean())


def scores(pred: np.ndarray, true: np.ndarray, own_x: np.ndarray, binary: bool, prefix: str) -> dict:
    """R^2, exact rows and (binary) the precision of the called bits, keys prefixed."""
    out = {
        f"{prefix}_r2": round(r2(pred, true), 4),
        f"{prefix}_exact": round(exact_rows(pred, true, binary, own_x.std(0)), 4),
    }
    if binary:  # of the bits it calls set, how many are (by chance: the density of set bits)
        called = pred >= 0.5
        out[f"{prefix}_precision"] = round(float(true[called].mean()) if called.any() else 0.0, 4)
    return out


def ridge(h: np.ndarray, x: np.ndarray, lam: float = 1e-2) -> tuple[np.ndarray, np.ndarray]:
    """Least squares x ~ h A + c with an L2 penalty (closed form)."""
    hm, xm = h.mean(0), x.mean(0)
    hc = h - hm
    a = np.linalg.solve(hc.T @ hc + lam * len(h) * np.eye(h.shape[1]), hc.T @ (x - xm))
    return a, xm - hm @ a


def mlp_inversion(h: np.ndarray, x: np.ndarray, binary: bool, seed: int = 0) -> torch.nn.Module:
    """The ``own`` attacker's two-layer MLP rows -> features, full batch on its own nodes."""
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


def own_attack(
    own_rows: np.ndarray, own_x: np.ndarray, got: np.ndarray, true_x: np.ndarray, mlp: bool = True
) -> dict:
    """The ``own`` attacker: fit on (own rows, own features), invert the received rows (ridge;
    and the MLP where ``mlp``)."""
    binary = bool(np.isin(own_x, (0.0, 1.0)).all())
    a, c = ridge(own_rows, own_x)
    linear = {"own_r2_linear": round(r2(got @ a + c, true_x), 4)}
    if not mlp:
        return linear
    net = mlp_inversion(own_rows, own_x, binary)
    with torch.no_grad():
        out = net(torch.from_numpy(got).float())
        pred = (torch.sigmoid(out) if binary else out).numpy()
    return {**linear, **scores(pred, true_x, own_x, binary, "own")}


class CuriousClient(LazyClient):
    """A lazy client that behaves exactly as one and keeps, per exchange, what it legitimately
    holds: the broadcast stage model, its own rows before release and the rows peers released."""

    def __init__(self, part, cfg: TrainConfig) -> None:
        super().__init__(part, cfg)
        self.states: dict[int, StateDict] = {}  # stage -> the model the server broadcast
        self.own: dict[int, Tensor] = {}  # stage -> its own rows as computed
        self.got: dict[int, Tensor] = {}  # stage that made them -> the rows peers released

    def next_stage(self, state: StateDict) -> dict[int, Tensor]:
        self.states[self.stage] = {k: v.detach().cpu().clone() for k, v in state.items()}
        return super().next_stage(state)

    def advance(self, embeddings: Tensor) -> dict[int, Tensor]:
        self.own[self.stage] = embeddings.detach().cpu().clone()
        return super().advance(embeddings)

    def receive_halo(self, incoming: dict[int, Tensor]) -> None:
        super().receive_halo(incoming)
        self.got[self.stage - 1] = self.halo.detach().cpu().clone()


def stage_model(c: LazyClient, stage: int, state: StateDict) -> torch.nn.Module:
    cfg, part = c.cfg, c.part
    in_dim = stage_input_dim(cfg, stage, part.num_features, part.num_classes)
    model = build_stage_model(cfg, stage, in_dim, part.num_classes)
    model.load_state_dict(state)
    return model.eval()


def release(rows: Tensor, cfg: TrainConfig, gen: torch.Generator, noised: bool = True) -> Tensor:
    """``rows`` as a party releases them (``noised``) or keeps its own (clipped only)."""
    if cfg.boundary_clip <= 0:
        return rows.float()
    return release_rows(rows, cfg.boundary_clip, cfg.boundary_noise if noised else 0.0, gen)


class Synthesizer:
    """The stronger peer's synthetic nodes, their neighbourhoods and the rows released for them."""

    def __init__(self, c: CuriousClient, gen: torch.Generator) -> None:
        self.c, self.gen = c, gen
        self.x = c.raw_features().cpu()
        self.binary = bool(((self.x == 0) | (self.x == 1)).all())
        counts = self.x.sum(0) + 0.1
        self.freq = counts / counts.sum()
        self.std = self.x.std(0)
        g = c.graph
        n = g.num_owned
        self.deg = g.in_degree.float().cpu()
        halo_deg = c.halo_degree.float().cpu() if c.halo_degree is not None else torch.zeros(0)
        self.nbrs: list[list[tuple[int, bool, float]]] = [[] for _ in range(n)]  # (own base, halo?, deg)
        for s, d in g.edge_index.t().tolist():
            if s < n:
                self.nbrs[d].append((s, False, float(self.deg[s])))
            else:
                self.nbrs[d].append((-1, True, float(halo_deg[s - n])))

    def perturb(self, base: Tensor) -> Tensor:
        x = self.x[base]
        if not self.binary:
            return x + torch.randn(x.shape, generator=self.gen) * (NOISE_STD * self.std)
        out = torch.bernoulli(torch.full_like(x, KEEP), generator=self.gen) * x
        add = torch.poisson(ADD * x.sum(1), generator=self.gen).long()
        most = int(add.max()) if len(add) else 0
        if most:
            words = torch.multinomial(self.freq, len(x) * most, replacement=True, generator=self.gen)
            words = words.view(len(x), most)
            rows = torch.arange(len(x)).unsqueeze(1).expand(-1, most)
            keep = torch.arange(most).unsqueeze(0) < add.unsqueeze(1)
            out[rows[keep], words[keep]] = 1.0
        return out

    @torch.no_grad()
    def batch(self, size: int, releases: list[tuple[int, torch.nn.Module, torch.nn.Module | None]], cfg):
        """``size`` synthetic nodes: their features and, per release, the rows a sender releases.

        ``releases``: (layer, stage-0 model of that pass, conv model or None) per release.
        """
        n = len(self.nbrs)
        base = torch.randint(0, n, (size,), generator=self.gen)
        x = self.perturb(base)
        # Neighbourhoods: the base node's own neighbours (perturbed), halo ones from random rows.
        tgt, nb_base, nb_halo, nb_deg = [], [], [], []
        for i, b in enumerate(base.tolist()):
            for s, halo, d in self.nbrs[b]:
                tgt.append(i)
                nb_base.append(int(torch.randint(0, n, (1,), generator=self.gen)) if halo else s)
                nb_halo.append(halo)
                nb_deg.append(d)
        tgt_t = torch.tensor(tgt, dtype=torch.long)
        halo_t = torch.tensor(nb_halo, dtype=torch.bool)
        nb_x = self.perturb(torch.tensor(nb_base, dtype=torch.long)) if tgt else None
        d_t = self.deg[base] + 1.0
        w = (d_t[tgt_t] * (torch.tensor(nb_deg) + 1.0)).pow(-0.5) if tgt else None
        rows = []
        for layer, m0, m1 in releases:
            h0 = m0(x)[0]
            if layer == 0:
                rows.append(release(h0, cfg, self.gen))
                continue
            mine = release(h0, cfg, self.gen, noised=False)  # the sender's own row, clipped
            agg = mine / d_t.unsqueeze(1)
            if nb_x is not None:
                hn = m0(nb_x)[0]
                hn = torch.where(
                    halo_t.unsqueeze(1), release(hn, cfg, self.gen), release(hn, cfg, self.gen, False)
                )
                agg = agg.index_add(0, tgt_t, hn * w.unsqueeze(1))
            z = m1.body.lin(agg) + (m1.body.bias if m1.body.bias is not None else 0.0)
            if m1.root is not None:
                z = z + m1.root(mine)
            rows.append(release(torch.relu(m1.norm(z)), cfg, self.gen))
        return x, rows


def train_inverter(
    h: Tensor, x: Tensor, binary: bool, epochs: int, seed: int
) -> Callable[[Tensor], np.ndarray]:
    """The ``synth`` attacker's MLP rows -> features (inputs standardized), minibatch Adam."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    mu, sd = h.mean(0), h.std(0).clamp_min(1e-6)
    net = torch.nn.Sequential(
        torch.nn.Linear(h.shape[1], 512), torch.nn.ReLU(), torch.nn.Linear(512, x.shape[1])
    )
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    loss_fn = torch.nn.BCEWithLogitsLoss() if binary else torch.nn.MSELoss()
    hs = (h - mu) / sd
    for _ in range(epochs):
        perm = torch.randperm(len(h), generator=gen)
        for i in range(0, len(h), 256):
            idx = perm[i : i + 256]
            opt.zero_grad()
            loss_fn(net(hs[idx]), x[idx]).backward()
            opt.step()

    def invert(rows: Tensor) -> np.ndarray:
        with torch.no_grad():
            out = net((rows - mu) / sd)
            return (torch.sigmoid(out) if binary else out).numpy()

    return invert


def peer_attacks(c: CuriousClient, cfg: TrainConfig, x_all: np.ndarray, seed: int) -> list[dict]:
    """Both attackers against every release the attacker received, and ``synth`` against all."""
    if cfg.model != "gcn" or cfg.pass_embedding != "hidden":
        raise SystemExit("the synthesizer computes GCN stages on hidden rows (the defaults) only")
    stages = sorted(c.got)
    ids = c.plan.halo_ids
    if not stages or not len(ids):
        return []
    true_x = x_all[ids]
    own_x = c.raw_features().cpu().numpy()
    binary = bool(np.isin(own_x, (0.0, 1.0)).all())
    gen = torch.Generator().manual_seed(seed * 1000 + 7)
    releases = []
    for s in stages:
        layer = cfg.layer(s)
        m_layer = stage_model(c, s, c.states[s])
        m0 = m_layer if layer == 0 else stage_model(c, s - layer, c.states[s - layer])
        releases.append((layer, m0, None if layer == 0 else m_layer))
    synth = Synthesizer(c, gen)
    xs, rows = [], [[] for _ in stages]
    for start in range(0, ARGS.synth, 2000):
        x, r = synth.batch(min(2000, ARGS.synth - start), releases, cfg)
        xs.append(x)
        for k, rk in enumerate(r):
            rows[k].append(rk)
    sx = torch.cat(xs)
    srows = [torch.cat(r) for r in rows]
    out = []
    for k, s in enumerate(stages):
        got = c.got[s].float()
        own = release(c.own[s], cfg, torch.Generator().manual_seed(12345)).numpy()
        t0 = time.perf_counter()
        invert = train_inverter(srows[k], sx, binary, ARGS.epochs, seed)
        row = {
            "release": k + 1,
            "stage": s,
            "layer": cfg.layer(s),
            "rows": len(ids),
            "epsilon_after": eps(cfg, k + 1),
            **own_attack(own, own_x, got.numpy(), true_x, mlp=k == 0),
            **scores(invert(got), true_x, own_x, binary, "synth"),
            "synth_seconds": round(time.perf_counter() - t0, 1),
        }
        out.append(row)
    invert = train_inverter(torch.cat(srows, 1), sx, binary, ARGS.epochs, seed)
    got_all = torch.cat([c.got[s].float() for s in stages], 1)
    out.append(
        {
            "release": "all",
            "rows": len(ids),
            "epsilon_after": eps(cfg, len(stages)),
            **scores(invert(got_all), true_x, own_x, binary, "synth"),
        }
    )
    chance = np.broadcast_to(own_x.mean(0), true_x.shape)
    for row in out:
        row["r2_chance"] = round(r2(chance, true_x), 4)
        row["exact_chance"] = round(exact_rows(chance, true_x, binary, own_x.std(0)), 4)
        if binary:
            row["precision_chance"] = round(float(true_x.mean()), 4)
    return out


def eps(cfg: TrainConfig, releases: int) -> float | None:
    """The accountant's epsilon per row after ``releases`` (None: no clip, or no noise)."""
    if cfg.boundary_clip <= 0:
        return None
    e = gaussian_epsilon(cfg.boundary_noise, releases, cfg.dp_delta)
    return None if math.isinf(e) else round(e, 1)


class _Stop(Exception):
    """Ends a run once the server has seen the first updates."""


def label_attack(base: StateDict, states: dict[int, StateDict], clients: list, cfg: TrainConfig) -> dict:
    """The server's estimate of each client's training-label histogram from its first update."""
    key = next(k for k in base if k.endswith("head.bias"))
    lr = float(cfg.per_stage("lr", 0))
    tvs, chance_tvs, rhos, top1 = [], [], [], []
    for pid, new in states.items():
        delta = (new[key].float() - base[key].float()).numpy()
        c = clients[pid]
        y = c.y[c.given_train].cpu().numpy()
        true = np.bincount(y, minlength=len(delta)) / max(len(y), 1)
        est = np.clip(1.0 / len(delta) + delta / lr, 0, None)
        est = est / est.sum() if est.sum() > 0 else np.full(len(delta), 1.0 / len(delta))
        tvs.append(0.5 * np.abs(est - true).sum())
        chance_tvs.append(0.5 * np.abs(1.0 / len(delta) - true).sum())
        rt, rd = np.argsort(np.argsort(true)), np.argsort(np.argsort(delta))
        rhos.append(float(np.corrcoef(rt, rd)[0, 1]) if true.std() > 0 else 0.0)
        top1.append(float(np.argmax(delta) == np.argmax(true)))
    return {
        "update_bits": cfg.update_bits,
        "label_tv": round(float(np.mean(tvs)), 4),
        "label_tv_chance": round(float(np.mean(chance_tvs)), 4),
        "label_rank_corr": round(float(np.nanmean(rhos)), 4),
        "label_top1": round(float(np.mean(top1)), 4),
    }


def run(graph, cfg: TrainConfig, first_only: bool = False) -> tuple[dict, list, dict, float]:
    """One in-process lazy run: its summary (None when stopped), clients and first updates."""
    parts = partition_graph(graph, cfg.clients, cfg.method, seed=cfg.seed)
    clients = [CuriousClient(p, cfg) if p.partition_id == ATTACKER else LazyClient(p, cfg) for p in parts]
    assert all(c.id == i for i, c in enumerate(clients))
    machine = LazyStageMachine(InProcessTransport(clients), cfg, RunRecorder(None, stream=None))
    fed, updates, first = machine.fed, machine.fed.updates, {}

    def spy(replies, base, codec, tracker, down):  # the server's own decoding, kept once
        states, raw = updates(replies, base, codec, tracker, down)
        if not first:
            first.update(base=base, states=dict(zip(fed.pids, states, strict=True)))
            if first_only:
                raise _Stop
        return states, raw

    fed.updates = spy
    t0 = time.perf_counter()
    try:
        summary = machine.run()
    except _Stop:
        summary = None
    return summary, clients, first, time.perf_counter() - t0


def one_run(graph, base: TrainConfig, noise: str, seed: int) -> dict:
    cfg = (
        base
        if noise == "none"
        else dataclasses.replace(base, boundary_clip=ARGS.clip, boundary_noise=float(noise))
    )
    cfg = dataclasses.replace(cfg, seed=seed).validate()
    summary, clients, first, seconds = run(graph, cfg)
    bp = summary.get("boundary_privacy")
    t0 = time.perf_counter()
    attacks = peer_attacks(clients[ATTACKER], cfg, graph.x.numpy(), seed)
    return {
        "seed": seed,
        "defense": noise,
        "clip": None if noise == "none" else ARGS.clip,
        "test_accuracy": round(summary["test_accuracy"], 4),
        "releases": len(clients[ATTACKER].got),
        "releases_counted": None if bp is None else bp["releases"],
        "epsilon_per_row": eps(cfg, bp["releases"]) if bp else None,
        "run_seconds": round(seconds, 1),
        "attack_seconds": round(time.perf_counter() - t0, 1),
        "peer": attacks,
        "server": label_attack(first["base"], first["states"], clients, cfg),
    }


def mean_sd(values: list) -> str:
    vals = [v for v in values if v is not None]
    if not vals:
        return "-"
    if len(vals) == 1:
        return f"{vals[0]:.3f}"
    return f"{np.mean(vals):.3f} ± {np.std(vals, ddof=1):.3f}"


def summarise(runs: list[dict]) -> list[dict]:
    """Per (dataset, defense, release): the mean and sd over seeds of every peer figure."""
    out = []
    keys = sorted({(r["dataset"], r["defense"]) for r in runs}, key=lambda k: (k[0], ARGS_NOISE.index(k[1])))
    for dataset, defense in keys:
        group = [r for r in runs if r["dataset"] == dataset and r["defense"] == defense]
        for rel in [p["release"] for p in group[0]["peer"]]:
            peers = [next(p for p in r["peer"] if p["release"] == rel) for r in group]
            row: dict[str, Any] = {
                "dataset": dataset,
                "defense": defense,
                "seeds": [r["seed"] for r in group],
                "release": rel,
                "stage": peers[0].get("stage"),
                "test_accuracy": mean_sd([r["test_accuracy"] for r in group]),
                "epsilon_after": peers[0]["epsilon_after"],
                "epsilon_per_row": group[0]["epsilon_per_row"],
            }
            for k in peers[0]:
                if k.startswith(("own_", "synth_r2", "synth_exact", "synth_precision")) or "chance" in k:
                    row[k] = mean_sd([p.get(k) for p in peers])
            out.append(row)
    return out


def main() -> None:
    torch.set_num_threads(1)
    runs, labels = [], []
    names = ARGS.datasets.split(";")
    root = private_planetoid(ARGS.root, tuple(n for n in names if n in ("Cora", "CiteSeer")))
    for name in names:
        base = TrainConfig(dataset=name, data_root=str(root), threads=1)
        graph = load_graph(base)
        for seed in [int(s) for s in ARGS.seeds.split(",")]:
            for noise in ARGS_NOISE:
                row = {"dataset": name, **one_run(graph, base, noise, seed)}
                runs.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "peer"}), flush=True)
                for p in row["peer"]:
                    print("   ", json.dumps(p), flush=True)
            # The server's view of float32 updates (the first round is all it reads).
            f32 = dataclasses.replace(base, seed=seed, update_bits=32, broadcast_bits=32).validate()
            _, clients, first, _ = run(graph, f32, first_only=True)
            four = next(r for r in runs if r["dataset"] == name and r["seed"] == seed)["server"]
            labels += [
                {"dataset": name, "seed": seed, **four},
                {"dataset": name, "seed": seed, **label_attack(first["base"], first["states"], clients, f32)},
            ]
            print(json.dumps(labels[-2:]), flush=True)
    summary = summarise(runs)
    print("\nCurious peer (mean ± sd over seeds " + ARGS.seeds + ")\n" + " | ".join(PEER_COLS))
    for r in summary:
        print(" | ".join(str(r.get(c, "")) for c in PEER_COLS))
    lcols = ["dataset", "seed", "update_bits", "label_tv", "label_tv_chance", "label_rank_corr", "label_top1"]
    print("\nCurious server\n" + " | ".join(lcols))
    for r in labels:
        print(" | ".join(str(r.get(c, "")) for c in lcols))
    out = Path(ARGS.out or f"bench/results/inversion-{datetime.date.today()}.json")
    setup = TrainConfig()
    out.write_text(
        json.dumps(
            {
                "command": " ".join(["python", *sys.argv]),
                "date": str(datetime.date.today()),
                "setup": {
                    "defaults": "TrainConfig's (lazy)",
                    **{k: getattr(setup, k) for k in SETUP_KEYS},
                    "attacker": ATTACKER,
                    "synth": ARGS.synth,
                    "epochs": ARGS.epochs,
                    "seeds": ARGS.seeds,
                },
                "summary": summary,
                "labels": labels,
                "runs": runs,
            },
            indent=1,
        )
    )
    print(f"\nwrote {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", default=str(DEFAULT_ROOT))
    parser.add_argument("--datasets", default="Cora")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--noise", default="none,0.05,0.2,1")
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--synth", type=int, default=20000)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--out", default="")
    ARGS = parser.parse_args()
    ARGS_NOISE = ARGS.noise.split(",")
    main()
