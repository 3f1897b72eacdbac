"""What a curious peer learns about a sender's training labels from eager's halo gradients.

python bench/gradient_leak.py [--root ../shared/datasets] [--rounds 100] [--capture 1,10,30,99]
                              [--out bench/results/gradient_leak-DATE.json]

Threat model. Eager mode with ``halo-gradients`` (its default): in round ``r`` client ``i`` trains
the shared :class:`~retexo_fl.models.layered.LayeredGNN` on its own rows plus the halo rows its
peers sent, and returns to every peer ``q`` the gradient of its *summed* training loss with
respect to the rows of ``q`` it trained on. For the default 2-layer model (encoder, one GCN conv,
head), the gradient ``q`` receives for its row ``j`` is

    g_j = m_j * sum_{t in T_j} A_tj (p_t - e_{y_t})^T J_t W_conv

with ``T_j`` the sender's *training* nodes adjacent to ``j``, ``A_tj`` the GCN weight, ``p_t`` the
softmax, ``J_t = d logits_t / d z_t`` (head after ReLU(LayerNorm) of the conv output ``z_t``; a
dropout mask on the head input too), ``W_conv`` the conv's weight and ``m_j`` the dropout mask of
halo row ``j`` (0 or 2 per coordinate). The curious peer ``q`` is honest-but-curious: it follows
the protocol and only reads what it legitimately holds: the shared model state of every round,
its own rows, features and labels, its cross edges (which of the sender's nodes neighbour each
of its rows), the GCN degrees and the layer-0 rows the sender sent it, and the halo gradients.
It does not know the sender's labels or which of the sender's nodes are training nodes.

What leaks, measured here on Cora (public split), 10 random clients, the eager defaults:

- **Membership.** ``g_j`` is exactly zero unless a sender training node neighbours ``j``. Where
  ``j`` has one neighbour ``t`` in the sender (the peer sees that from its cross edges), a nonzero
  ``g_j`` says ``t`` is a training node, with certainty.
- **Labels.** Per received row, the peer guesses the class ``c`` whose predicted gradient
  direction best matches ``g_j``. First a baseline that reads no gradient, then the attacks:

  * ``model-pred`` (no gradient): the shared model's own prediction for the sender's nodes next
    to ``j``, ``argmax p_t`` at the estimate of ``z_t`` below. The peer can do this from the rows
    it receives with or without halo gradients, so it is the bar a *gradient* leak must clear
    (though without gradients the peer would not know which nodes are training nodes).
  * ``naive``: templates from the shared weights alone, ``v_c = (1/C - e_c)^T W_head W_conv``
    (LayerNorm and ReLU ignored, uniform ``p``); guess the ``c`` of largest cosine with ``g_j``
    over the coordinates the dropout left nonzero (zeros in ``g_j`` reveal ``m_j``).
  * ``estimated``: the same with ``J_t`` and ``p_t`` at an estimate of the sender's ``z_t``:
    its self term from the row ``h_t`` the sender sent, the peer's own rows adjacent to ``t``
    (the exact ones the sender trained on: computed at the previous round's state; zeros in
    round 1, as the protocol has it), and ``t``'s remaining neighbours (count from its degree)
    stood in for by ``h_t`` (homophily) at the peer's mean degree. ``estimated-lstsq`` solves
    ``g_j ~ r^T B_j`` for ``r`` by least squares instead and guesses ``argmin_c r_c`` (the
    label's entry of ``p - e_y`` is the only negative one). ``combined``: ``e_y = p - r``, so
    ``argmax_c (p_hat - r_hat / 2)_c`` (the kept entries of ``g_j`` are doubled by dropout, so
    ``r_hat ~ 2 r``): the model's prediction corrected by the gradient.
  * ``shadow``: no algebra. The peer computes the same kind of gradients itself (what it sends
    its peers, for its own training nodes, whose labels it knows); per class the mean of the
    unit-normalised ones is a template; guess the class of largest cosine (masked as above).
  * ``oracle`` (a reference, *not* available to the peer): the templates at the sender's true
    ``z_t`` and ``p_t`` (without dropout) over the true ``T_j``. Not a ceiling: the unknown
    dropout masks on the sender's input and head input still blur it, and ``naive`` can beat it.

Scored on the received rows with a nonzero gradient, against the labels of ``T_j`` (ground truth,
used only for scoring): ``single`` rows have ``|T_j| = 1``; ``any`` rows count a guess in the set
of ``T_j``'s labels as right. Chance is the majority-class rate over the same rows (for ``any``,
the best single class's hit rate): a guess from the class prior alone; ``model-pred`` is the
stronger no-gradient bar once the model has trained. ``node`` rows: per (peer, sender training
node ``t``) where ``t`` is the sole sender neighbour of at least one nonzero row, the score sums
of those rows vote.

States: the gradients computed in rounds ``--capture`` of one real eager run (round 1: the
initial model, halo rows still zeros), received by the peers in the round after. Prints a table
and writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import shutil
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import DEFAULT_ROOT, private_planetoid
from retexo_fl.config import TrainConfig
from retexo_fl.coordinator.baseline_run import BaselineRun
from retexo_fl.data.loading import load_graph
from retexo_fl.data.partition import CROSS_IN, Partition
from retexo_fl.data.partitioners import partition_graph
from retexo_fl.metrics import RunRecorder
from retexo_fl.models.adjacency import run_conv
from retexo_fl.models.factory import build_layered_model
from retexo_fl.models.layered import LayeredGNN
from retexo_fl.party.eager_client import EagerClient
from retexo_fl.records import StateDict
from retexo_fl.training.inprocess import InProcessTransport

ATTACKS = ("model-pred", "naive", "estimated", "estimated-lstsq", "combined", "shadow", "oracle")


@dataclasses.dataclass
class Capture:
    """What the recording clients keep of a run, per captured round ``r``.

    Args:
        rounds (set[int]): the rounds whose halo gradients are kept.
        states (dict[int, StateDict]): the model state of rounds ``r`` and ``r - 1``.
        received (dict[tuple[int, int], dict[int, Tensor]]): ``(r, receiver)`` -> sender -> the
            layer-0 gradient block computed at round ``r``'s state, as the receiver decoded it.
        peer_halo (dict[tuple[int, int], Tensor]): ``(r, receiver)`` -> its layer-0 halo rows as
            they arrived with those gradients (the senders' rows at round ``r``'s state).
        sender_halo (dict[tuple[int, int], Tensor]): ``(r, sender)`` -> the layer-0 halo rows it
            trained on in round ``r`` (for the oracle only).
        sent (dict[tuple[int, int], dict[int, Tensor]]): ``(r, sender)`` -> peer -> the gradient
            block before encoding (the shadow attack's own data, and a check of the decoding).
    """

    rounds: set[int]
    states: dict[int, StateDict] = dataclasses.field(default_factory=dict)
    received: dict[tuple[int, int], dict[int, Tensor]] = dataclasses.field(default_factory=dict)
    peer_halo: dict[tuple[int, int], Tensor] = dataclasses.field(default_factory=dict)
    sender_halo: dict[tuple[int, int], Tensor] = dataclasses.field(default_factory=dict)
    sent: dict[tuple[int, int], dict[int, Tensor]] = dataclasses.field(default_factory=dict)


class RecordingClient(EagerClient):
    """An eager client that behaves exactly as one, and notes what it sent and received."""

    def __init__(self, part: Partition, cfg: TrainConfig, capture: Capture) -> None:
        super().__init__(part, cfg)
        self.capture = capture

    def train(
        self, state: StateDict, round_: int, control: StateDict | None = None
    ) -> tuple[StateDict, float]:
        cap = self.capture
        if round_ - 1 in cap.rounds:  # delivered with this round: computed in the last one
            cap.received[(round_ - 1, self.id)] = {p: g[0].clone() for p, g in self.grads_in.items()}
            cap.peer_halo[(round_ - 1, self.id)] = self.halo_layers[0].detach().cpu().clone()
        if round_ in cap.rounds or round_ + 1 in cap.rounds:
            cap.states.setdefault(round_, {k: v.detach().cpu().clone() for k, v in state.items()})
        if round_ in cap.rounds:
            cap.sender_halo[(round_, self.id)] = self.halo_layers[0].detach().cpu().clone()
        new, loss = super().train(state, round_, control)
        if round_ in cap.rounds:
            k = self.plan.recv
            cap.sent[(round_, self.id)] = {
                q: g[: int(k[q].size)].clone() for q, g in self.grads_out.items()
            }  # layer 0's block (the only one with the default 2 layers)
        return new, loss


def model_at(cfg: TrainConfig, part: Partition, state: StateDict) -> LayeredGNN:
    model = build_layered_model(cfg, part.num_features, part.num_classes)
    model.load_state_dict(state)
    return model.eval()


@torch.no_grad()
def layer0_rows(model: LayeredGNN, x: Tensor) -> Tensor:
    """The conv layer's input rows ``relu(norm(encoder(x)))`` (no dropout)."""
    return torch.relu(model.norms[0](model.encoder(x)))


def head_jacobians(model: LayeredGNN, z: Tensor) -> tuple[Tensor, Tensor]:
    """``d logits / d z`` ``[N, C, hidden]`` and the softmax ``[N, C]`` at conv outputs ``z``."""

    def logits(v: Tensor) -> Tensor:
        return model.head(torch.relu(model.norms[1](v)))

    if not len(z):
        c = model.head.out_features
        return torch.zeros(0, c, z.shape[1]), torch.zeros(0, c)
    jac = torch.func.vmap(torch.func.jacrev(logits))(z)
    with torch.no_grad():
        p = torch.softmax(logits(z), dim=1)
    return jac.detach(), p


def cos_guess(g: Tensor, templates: Tensor) -> tuple[int, Tensor]:
    """The class whose template ``[C, d]`` has the largest cosine with ``g`` on its nonzero entries."""
    mask = (g != 0).to(g.dtype)
    t = templates * mask
    scores = (t @ g) / (t.norm(dim=1) * g.norm()).clamp_min(1e-30)
    return int(scores.argmax()), scores


def lstsq_fit(g: Tensor, basis: Tensor) -> Tensor:
    """The least-squares ``r`` of ``g ~ r^T basis`` on ``g``'s nonzero entries (``[C]``)."""
    keep = g != 0
    b = basis[:, keep].double()
    return torch.linalg.lstsq(b.T, g[keep].double().unsqueeze(1)).solution.squeeze(1).float()


def templates(a: Tensor, jw: Tensor, p: Tensor) -> Tensor:
    """Rows ``c``: ``sum_t a_t (p_t - e_c)^T (J_t W)``; ``jw`` ``[T, C, d]``, ``p`` ``[T, C]``."""
    per_t = torch.einsum("tk,tkd->td", p, jw).unsqueeze(1) - jw  # [T, C, d]: (p_t - e_c)^T J_t W
    return (a.view(-1, 1, 1) * per_t).sum(0)


class Party:
    """Static facts about one client: ids, labels, cross edges, degrees (from the finished run)."""

    def __init__(self, c: EagerClient) -> None:
        self.c = c
        part = c.part
        self.ids = np.asarray(part.node_ids)
        self.pos = {int(g): i for i, g in enumerate(self.ids)}
        self.y = np.asarray(part.y)
        self.train = np.asarray(part.train_mask, dtype=bool)
        self.x = torch.from_numpy(np.array(part.x, dtype=np.float32))
        self.deg = c.graph.in_degree.float().cpu()
        self.halo_deg = c.halo_degree.float().cpu() if c.halo_degree is not None else torch.zeros(0)
        self.halo_pos = {int(g): i for i, g in enumerate(c.plan.halo_ids)}
        ce = np.asarray(part.cross_edges)
        # (owned id, remote owner) -> remote ids it aggregates (symmetric on Cora)
        self.nbrs: dict[tuple[int, int], list[int]] = defaultdict(list)
        # remote id -> owned ids adjacent to it
        self.by_remote: dict[int, list[int]] = defaultdict(list)
        for own, rem, owner, direction in ce.tolist():
            if direction & CROSS_IN:
                self.nbrs[(own, owner)].append(rem)
                self.by_remote[rem].append(own)


def gcn_weight(d1: float, d2: float) -> float:
    return float((d1 + 1.0) ** -0.5 * (d2 + 1.0) ** -0.5)


def shadow_centroids(cap: Capture, r: int, me: Party, classes: int) -> Tensor:
    """The peer's own outgoing gradient rows with one adjacent own training node, per class the
    mean of the unit-normalised rows (zeros for a class it has none of)."""
    sent = cap.sent[(r, me.c.id)]
    sums = torch.zeros(classes, me.c.cfg.hidden)
    counts = torch.zeros(classes)
    for p, block in sent.items():
        for a, gid in enumerate(me.c.plan.recv[p].tolist()):
            own = [o for o in me.by_remote[gid] if me.train[me.pos[o]]]
            g = block[a]
            if len(own) != 1 or not bool(g.any()):
                continue
            y = int(me.y[me.pos[own[0]]])
            sums[y] += g / g.norm()
            counts[y] += 1
    return sums / counts.clamp_min(1).unsqueeze(1)


def attack_round(
    cfg: TrainConfig, cap: Capture, r: int, parties: list[Party], classes: int
) -> dict[str, Any]:
    """Every peer against every sender, on the gradients computed at round ``r``'s state."""
    state, prev = cap.states[r], cap.states.get(r - 1)
    model = model_at(cfg, parties[0].c.part, state)
    w_conv = model.convs[0].lin.weight.detach()  # z = A h W^T + b
    b_conv = model.convs[0].bias.detach()
    w_naive = model.head.weight.detach() @ w_conv  # [C, d]
    naive_t = w_naive.mean(0, keepdim=True) - w_naive  # (1/C - e_c)^T W_head W_conv
    prev_model = model_at(cfg, parties[0].c.part, prev) if prev is not None else None
    # The senders' true conv outputs (oracle only): their forward at round r, no dropout.
    true_z: dict[int, Tensor] = {}
    with torch.no_grad():
        for s in parties:
            h = layer0_rows(model, s.x)
            full = torch.cat([h, cap.sender_halo[(r, s.c.id)]])
            adj, _ = s.c.message_graph()
            true_z[s.c.id] = run_conv(model.convs[0], "gcn", full, adj, None)[: len(s.ids)]
    rows: list[dict[str, Any]] = []
    decode_err = 0.0
    for me in parties:
        q = me.c.id
        got = cap.received.get((r, q), {})
        if not got:
            continue
        own_rows = layer0_rows(prev_model, me.x) if (prev_model is not None and r > 1) else None
        halo = cap.peer_halo[(r, q)]
        centroids = shadow_centroids(cap, r, me, classes)
        mean_deg = float(me.deg.mean())
        for i, block in got.items():
            sender = parties[i]
            decode_err = max(decode_err, float((cap.sent[(r, i)][q] - block).abs().max()))
            send_idx = me.c.plan.send[i]
            # Every candidate (sender node next to one of these rows): the peer's estimate of z_t.
            cands = sorted({t for j in send_idx.tolist() for t in me.nbrs[(int(me.ids[j]), i)]})
            z_hat = torch.zeros(len(cands), w_conv.shape[0])
            for k, t in enumerate(cands):
                ht = halo[me.halo_pos[t]]
                dt = float(me.halo_deg[me.halo_pos[t]])
                acc = ht / (dt + 1.0)
                known = me.by_remote[t]
                if own_rows is not None:  # round 1: the sender trained on zero halo rows
                    for o in known:
                        acc = acc + gcn_weight(dt, float(me.deg[me.pos[o]])) * own_rows[me.pos[o]]
                unknown = max(dt - len(known), 0.0)
                acc = acc + unknown * gcn_weight(dt, mean_deg) * ht
                z_hat[k] = acc @ w_conv.T + b_conv
            jac, p_hat = head_jacobians(model, z_hat)
            jw_hat = jac @ w_conv  # [T, C, d]
            at = {t: k for k, t in enumerate(cands)}
            t_pos = [sender.pos[t] for t in cands]
            jac_true, p_true = head_jacobians(model, true_z[i][t_pos]) if cands else (jac, p_hat)
            jw_true = jac_true @ w_conv
            for a, j in enumerate(send_idx.tolist()):
                gid = int(me.ids[j])
                g = block[a]
                cset = me.nbrs[(gid, i)]
                train_t = [t for t in cset if sender.train[sender.pos[t]]]
                row: dict[str, Any] = {
                    "round": r,
                    "peer": q,
                    "sender": i,
                    "cands": cset,
                    "train": train_t,
                    "labels": sorted({int(sender.y[sender.pos[t]]) for t in train_t}),
                    "nonzero": bool(g.any()),
                }
                if row["nonzero"] and cset:
                    ks = [at[t] for t in cset]
                    a_t = torch.tensor(
                        [gcn_weight(float(me.deg[j]), float(me.halo_deg[me.halo_pos[t]])) for t in cset]
                    )
                    scores: dict[str, Tensor] = {}
                    row["guess"] = {}
                    row["guess"]["naive"], scores["naive"] = cos_guess(g, naive_t)
                    est = templates(a_t, jw_hat[ks], p_hat[ks])
                    row["guess"]["estimated"], scores["estimated"] = cos_guess(g, est)
                    basis = (a_t.view(-1, 1, 1) * jw_hat[ks]).sum(0)
                    r_hat = lstsq_fit(g, basis)
                    scores["estimated-lstsq"] = -r_hat
                    # The peer's own prediction of the candidates (no gradient used), and that
                    # less the gradient's r = p - e_y (kept entries of g are doubled by dropout).
                    scores["model-pred"] = (a_t.view(-1, 1) * p_hat[ks]).sum(0) / a_t.sum()
                    scores["combined"] = scores["model-pred"] - r_hat / 2
                    for name in ("estimated-lstsq", "model-pred", "combined"):
                        row["guess"][name] = int(scores[name].argmax())
                    row["guess"]["shadow"], scores["shadow"] = cos_guess(g, centroids)
                    if train_t:
                        kt = [at[t] for t in train_t]
                        a_true = torch.tensor(
                            [
                                gcn_weight(float(me.deg[j]), float(me.halo_deg[me.halo_pos[t]]))
                                for t in train_t
                            ]
                        )
                        orc = templates(a_true, jw_true[kt], p_true[kt])
                        row["guess"]["oracle"], scores["oracle"] = cos_guess(g, orc)
                    row["scores"] = {k: v.tolist() for k, v in scores.items()}
                rows.append(row)
    return {"rows": rows, "decode_max_abs_err": decode_err}


def accuracy_vs_chance(items: list[tuple[int | None, list[int]]]) -> dict[str, Any]:
    """Hit rate of guesses against label sets, and the best constant class's hit rate."""
    if not items:
        return {"n": 0}
    hits = float(np.mean([g is not None and g in labels for g, labels in items]))
    per_class = Counter(c for _, labels in items for c in labels)
    chance = max(per_class.values()) / len(items)
    return {"n": len(items), "accuracy": round(hits, 4), "chance": round(chance, 4)}


def summarise(rows: list[dict[str, Any]], parties: list[Party], classes: int) -> dict[str, Any]:
    nz = [r for r in rows if r["nonzero"]]
    out: dict[str, Any] = {
        "rows_received": len(rows),
        "rows_nonzero": len(nz),
        "nonzero_without_train_neighbour": sum(1 for r in nz if not r["train"]),
        "zero_with_train_neighbour": sum(1 for r in rows if not r["nonzero"] and r["train"]),
    }
    # Membership: a nonzero row whose only sender neighbour is t names t a training node.
    named = {(r["sender"], r["cands"][0]) for r in nz if len(r["cands"]) == 1}
    testable = {(r["sender"], r["cands"][0]) for r in rows if len(r["cands"]) == 1}
    total_train = sum(int(p.train.sum()) for p in parties)
    out["membership"] = {
        "train_nodes_named": len(named),
        "train_nodes_total": total_train,
        "precision": round(float(np.mean([parties[s].train[parties[s].pos[t]] for s, t in named])), 4)
        if named
        else None,
        "sole_neighbour_nodes_seen": len(testable),
        "base_rate_train_among_them": round(
            float(np.mean([parties[s].train[parties[s].pos[t]] for s, t in testable])), 4
        )
        if testable
        else None,
    }
    for attack in ATTACKS:
        single = [(r["guess"].get(attack), r["labels"]) for r in nz if len(r["train"]) == 1]
        anyset = [(r["guess"].get(attack), r["labels"]) for r in nz if r["train"]]
        # Node level: per (peer, sender, t) with t the sole candidate of a nonzero row, vote.
        votes: dict[tuple[int, int, int], Tensor] = {}
        truth: dict[tuple[int, int, int], int] = {}
        for r in nz:
            if len(r["cands"]) != 1 or attack not in r.get("scores", {}):
                continue
            key = (r["peer"], r["sender"], r["cands"][0])
            votes[key] = votes.get(key, torch.zeros(classes)) + torch.tensor(r["scores"][attack])
            truth[key] = r["labels"][0]
        nodes = [(int(v.argmax()), [truth[k]]) for k, v in votes.items()]
        out[attack] = {
            "single": accuracy_vs_chance(single),
            "any": accuracy_vs_chance(anyset),
            "node": {**accuracy_vs_chance(nodes), "distinct_train_nodes": len({k[1:] for k in votes})},
        }
    return out


def main(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    root = private_planetoid(args.root, ("Cora",))
    try:
        cfg = TrainConfig.resolve(
            mode="eager",
            dataset="Cora",
            data_root=str(root),
            clients=10,
            method="random",
            seed=0,
            rounds=args.rounds,
            threads=1,
        )
        cfg.validate()
        assert cfg.halo_gradients and cfg.stages == 2 and cfg.model == "gcn"
        graph = load_graph(cfg)
        parts = partition_graph(graph, cfg.clients, cfg.method, seed=cfg.seed)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    capture = Capture({int(r) for r in args.capture.split(",")})
    clients = [RecordingClient(p, cfg, capture) for p in parts]
    summary = BaselineRun(InProcessTransport(clients), cfg, RunRecorder(None, stream=None)).run()
    run_seconds = time.perf_counter() - t0
    parties = [Party(c) for c in clients]
    classes = int(parts[0].num_classes)
    results = []
    for r in sorted(capture.rounds):
        if (r, 0) not in capture.sent:
            print(f"round {r}: not reached (--rounds {args.rounds}); skipped", flush=True)
            continue
        got = attack_round(cfg, capture, r, parties, classes)
        results.append(
            {
                "round": r,
                "decode_max_abs_err": got["decode_max_abs_err"],
                **summarise(got["rows"], parties, classes),
            }
        )
    return {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": str(datetime.date.today()),
        "setup": {
            "dataset": "Cora",
            "split": cfg.split,
            "clients": cfg.clients,
            "method": cfg.method,
            "seed": cfg.seed,
            "stages": cfg.stages,
            "hidden": cfg.hidden,
            "dropout": cfg.dropout,
            "input_dropout": cfg.input_dropout,
            "norm": cfg.norm,
            "rounds": cfg.rounds,
            "lr": cfg.lr,
            "server_optimizer": cfg.server_optimizer,
            "server_lr": cfg.server_lr,
            "halo_gradients": cfg.halo_gradients,
            "bits": cfg.bits,
        },
        "run": {
            "test_accuracy": round(summary["test_accuracy"], 4),
            "val_accuracy": round(summary["val_accuracy"], 4),
            "seconds": round(run_seconds, 1),
        },
        "results": results,
        "seconds_total": round(time.perf_counter() - t0, 1),
    }


def print_table(out: dict[str, Any]) -> None:
    print(f"\neager run: test {out['run']['test_accuracy']}, {out['run']['seconds']} s")
    print(
        "round  rows  nonzero  named-train/total  attack           single acc/chance (n)"
        "   any acc/chance (n)     node acc/chance (n)"
    )
    for res in out["results"]:
        m = res["membership"]
        for k, attack in enumerate(ATTACKS):
            head = (
                (
                    f"{res['round']:>5}  {res['rows_received']:>4}  {res['rows_nonzero']:>7}  "
                    f"{m['train_nodes_named']:>7}/{m['train_nodes_total']:<9}"
                )
                if k == 0
                else " " * 38
            )
            cells = []
            for level in ("single", "any", "node"):
                s = res[attack][level]
                cells.append(
                    f"{s.get('accuracy', float('nan')):.3f}/{s.get('chance', float('nan')):.3f} "
                    f"({s['n']})".ljust(23)
                )
            print(f"{head}  {attack:<15}  " + " ".join(cells))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", default=str(DEFAULT_ROOT))
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--capture", default="1,10,30,99")
    parser.add_argument("--out", default="")
    ARGS = parser.parse_args()
    result = main(ARGS)
    print_table(result)
    path = Path(ARGS.out or f"bench/results/gradient_leak-{datetime.date.today()}.json")
    path.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {path}")
