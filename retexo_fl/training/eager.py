"""The baselines: eager (standard federated GNN, halo refresh every round) and local-only (TMA) training.

Eager: every round each client trains the whole ``stages``-layer :class:`LayeredGNN` on its owned
and halo rows; the halo rows of every conv layer are what peers computed in the previous round
(one round stale; zeros in round 1), exchanged every round through the same frames, codecs and
byte accounting as lazy mode, the rate schedule running over rounds.

Local: the same model with every cross edge dropped (no exchange at all), FedAvg over the local
subgraphs, optionally with time-based aggregation (``round-seconds``): a client trains until its
time is up and reports how many steps it took, so a slow client never stalls a round.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from retexo_fl.compress.boundary import ExchangeStats
from retexo_fl.compress.payload import decode_rows
from retexo_fl.compress.updates import ModelBroadcast
from retexo_fl.config import TrainConfig
from retexo_fl.data.partition import Partition, check_cross_consistency
from retexo_fl.metrics import RunRecorder, human_bytes
from retexo_fl.models.layered import LayeredGNN
from retexo_fl.plan import check_plans
from retexo_fl.training.aggregate import ServerOptimizer, StateDict, state_nbytes
from retexo_fl.training.client import LazyClient, connect_clients, derive_seed, seed_dropout
from retexo_fl.training.privacy import aggregate_round, make_privacy
from retexo_fl.training.selection import StageTracker


def without_cross_edges(part: Partition) -> Partition:
    """``part`` as the local-only baselines see it: its own subgraph, no edge to any peer."""
    return dataclasses.replace(part, cross_edges=np.zeros((0, 4), dtype=np.int64))


def step_delays(spec: str) -> dict[int, float]:
    """``step-delay`` ``"P:seconds,..."``: extra seconds per local step of client P (slow devices)."""
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        pid, _, sec = item.partition(":")
        try:
            out[int(pid)] = float(sec)
        except ValueError:
            raise ValueError(f"step-delay: bad entry {item!r} (want CLIENT:seconds)") from None
    return out


class EagerClient(LazyClient):
    """One party of eager or local training (``local=True`` drops its cross edges).

    Reuses the lazy client's plan, graph, degrees, codecs and update compression; what differs is
    the model (all layers at once) and the halo (one block per conv layer, refreshed each round).
    """

    def __init__(self, part: Partition, cfg: TrainConfig, local: bool = False) -> None:
        super().__init__(without_cross_edges(part) if local else part, cfg)
        self.local = local
        self.stage = 1  # conv edges from the start; LazyClient.edges() keys off the stage
        self.layers = cfg.stages
        self.halo_layers = [torch.zeros(self.plan.num_halo, cfg.hidden, device=self.device)] * (
            self.layers - 1
        )
        self.delay = step_delays(cfg.step_delay).get(self.id, 0.0)
        self.last_steps = 0

    @property
    def layer(self) -> int:
        return 1  # every conv layer at once: the edges are always needed

    def make_model(self) -> LayeredGNN:  # type: ignore[override]
        cfg = self.cfg
        return LayeredGNN(
            cfg.model,
            self.part.num_features,
            cfg.hidden,
            self.part.num_classes,
            layers=self.layers,
            dropout=float(cfg.per_stage("dropout", 1)),
            norm=cfg.norm,
            heads=cfg.heads,
        ).to(self.device)

    def _forward(self, model, rows: Tensor | None = None) -> tuple[Tensor | None, Tensor]:  # type: ignore[override]
        ei, w = self.edges() if self.layers > 1 else (None, None)
        logits, _ = model(self.owned, ei, w, self.halo_layers)
        return None, logits if rows is None else logits[rows]

    def train(self, state: StateDict, round_: int) -> tuple[StateDict, float]:
        """Local steps from ``state``: ``local-epochs`` of them, or as many as fit in ``round-seconds``."""
        model = self.loaded_model(state)
        cfg = self.cfg
        opt = self.optimizer(model, 1)
        seed_dropout(derive_seed(cfg.seed, 0xEA, round_, self.id), self.device)
        mask = self.masks["train"]
        model.train()
        deadline = time.perf_counter() + cfg.round_seconds if cfg.round_seconds > 0 else None
        steps = 0 if deadline is not None else int(cfg.per_stage("local_epochs", 1))
        losses = []
        while True:
            if deadline is None and len(losses) >= steps:
                break
            opt.zero_grad()
            _, logits = self._forward(model, mask)
            loss = torch.nn.functional.cross_entropy(logits, self.y[mask])
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if self.delay:
                time.sleep(self.delay)
            if deadline is not None and time.perf_counter() >= deadline:
                break
        self.last_steps = len(losses)
        # A copy: the module is reused next round and would overwrite these tensors in place.
        return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}, float(
            np.mean(losses)
        )

    @torch.no_grad()
    def boundary_rows(self, state: StateDict) -> dict[int, Tensor]:
        """Per peer, the conv inputs of its halo rows for every layer, stacked ``[(K - 1) k, hidden]``."""
        if self.local or self.layers < 2 or not self.plan.send:
            return {}
        model = self.loaded_model(state)
        model.eval()
        ei, w = self.edges()
        _, inputs = model(self.owned, ei, w, self.halo_layers)
        per_layer = [self.plan.rows_for(h.float().cpu()) for h in inputs]
        return {q: torch.cat([rows[q] for rows in per_layer]) for q in self.plan.send}

    def encode_rows_for_round(
        self, rows: dict[int, Tensor], round_: int
    ) -> tuple[dict[int, bytes], ExchangeStats]:
        weights = None
        if self.cfg.bit_policy != "fixed":  # every layer's block of a row weighs the same
            weights = {q: w.repeat(self.layers - 1) for q, w in self.boundary_weights().items()}
        gen = torch.Generator().manual_seed(derive_seed(self.cfg.seed, 0xEB, round_, self.id))
        rounds = int(self.cfg.per_stage("rounds", 1))
        frames, stats = self.encoder.encode(self.id, rows, weights, round_ - 1, rounds, gen)
        return self._seal(frames, "eager", 0, round_), stats

    def receive_boundary(self, frames: dict[int, bytes]) -> None:
        """Replace the halo of every layer with what peers sent this round (missing peers: kept).

        Sealed rows older than the newest already accepted are refused as replays.
        """
        frames, newest = self._open(frames, "eager", 0, self.halo_round + 1)
        self.halo_round = max(self.halo_round, newest)
        k_layers = self.layers - 1
        blocks: list[dict[int, Tensor]] = [{} for _ in range(k_layers)]
        for p, blob in frames.items():
            k = self._expect(p)
            rows = decode_rows(blob, f"client {p}", None if k is None else k * k_layers, self.cfg.hidden)
            for layer, chunk in enumerate(rows.chunk(k_layers)):
                blocks[layer][p] = chunk
        if frames:
            dim = self.cfg.hidden
            self.halo_layers = [
                self.plan.assemble_halo(self.complete_halo(b, dim, self.halo_layers[layer]), dim).to(
                    self.device
                )
                for layer, b in enumerate(blocks)
            ]

    def _snapshot(self) -> dict:
        # Stage inputs are the raw features throughout; the per-layer halo is what changes.
        return {
            **super()._snapshot(),
            "owned": None,
            "halo": None,
            "halo_layers": [h.cpu() for h in self.halo_layers],
        }

    def _load_snapshot(self, state: dict) -> None:
        self.halo_layers = [h.to(self.device) for h in state["halo_layers"]]


def run_eager(
    parts: Sequence[Partition], cfg: TrainConfig, rec: RunRecorder | None = None, local: bool = False
) -> dict:
    """Eager (or, with ``local``, local-only) federated training in one process; returns the summary."""
    from retexo_fl.training.lazy import aggregate_eval, compression_totals, exchange, exchange_figures

    rec = rec or RunRecorder(None, stream=None)
    mode = "local" if local else "eager"
    t0 = time.perf_counter()
    check_cross_consistency(list(parts))
    clients = [EagerClient(p, cfg, local) for p in parts]
    connect_clients(clients)
    check_plans({c.id: c.plan.digests() for c in clients})
    privacy = make_privacy(cfg, len(clients))
    bytes_boundary = 0
    if cfg.model == "gcn" and not local and cfg.stages > 1:
        incoming, nbytes = exchange({c.id: c.degree_frames() for c in clients})
        for c in clients:
            c.receive_degrees(c.decode_degrees(incoming.get(c.id, {})))
        bytes_boundary += nbytes
    torch.manual_seed(derive_seed(cfg.seed, 0xE0))
    state = {k: v.detach().cpu().clone() for k, v in clients[0].make_model().state_dict().items()}
    server = ServerOptimizer(cfg.server_optimizer, state, float(cfg.per_stage("server_lr", 1)))
    rounds = int(cfg.per_stage("rounds", 1))
    weights = [c.num_train for c in clients]
    tracker = StageTracker(0, cfg.patience)
    stats, model_raw, steps = ExchangeStats(), 0, []
    broadcast = ModelBroadcast(cfg.broadcast_bits, cfg.range_dtype, derive_seed(cfg.seed, 0xBC))
    view = broadcast.prepare(state, 1)  # what the clients hold and train from
    for r in range(1, rounds + 1):
        results, outgoing = [], {}
        down = broadcast.nbytes()
        for c in clients:
            rows = c.boundary_rows(view)  # this round's embeddings, for the peers' next round
            if rows:
                outgoing[c.id], s = c.encode_rows_for_round(rows, r)
                stats.add(s)
            new, loss = c.train(view, r)
            frames = c.encode_update(new, view, r)
            if frames is not None:
                new = c.update_codec.decode(frames, view, f"client {c.id}")
            tracker.model_bytes += down + (
                state_nbytes(new) if frames is None else sum(map(len, frames.values()))
            )
            model_raw += 2 * state_nbytes(state)
            results.append((new, loss))
        steps.append([c.last_steps for c in clients])
        incoming, nbytes = exchange(outgoing)
        bytes_boundary += nbytes
        for c in clients:
            c.receive_boundary(incoming.get(c.id, {}))
        state = server.step(aggregate_round(state, view, [s for s, _ in results], weights, privacy, (0, r)))
        view = broadcast.prepare(state, r + 1)
        train_loss = sum(loss * w for (_, loss), w in zip(results, weights, strict=True)) / sum(weights)
        val = aggregate_eval(clients, view, "val")[0]
        tracker.bytes_offset = bytes_boundary
        tracker.record(r, view, val, train_loss=train_loss)
        rec.event("round", mode=mode, round=r, train_loss=train_loss, val_accuracy=val, bytes=nbytes)
        if line := tracker.progress_line(r, rounds):
            rec.progress(f"{mode} {line} boundary so far {human_bytes(bytes_boundary)}")
        if tracker.should_stop:
            break
    figures = tracker.figures(time.perf_counter() - t0)
    figures.update(bytes_boundary=bytes_boundary, bytes_model_raw=model_raw, **exchange_figures(stats))
    best = tracker.best_state
    test = aggregate_eval(clients, best, "test")[0]
    return {
        **compression_totals([figures]),
        "mode": mode,
        "engine": "in-process",
        "test_accuracy": test,
        "val_accuracy": figures["val_accuracy"],
        "bytes_total": bytes_boundary + figures["bytes_model"],
        "bytes_boundary": bytes_boundary,
        "bytes_model": figures["bytes_model"],
        "local_steps": steps,
        "privacy": privacy.spent() if privacy else None,
        "stages": [figures],
    }
