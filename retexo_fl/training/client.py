"""One party's side of lazy training: its partition, plan, stage inputs, local training and embeddings."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from torch import Tensor

from retexo_fl.compress.bits import aggregation_weights
from retexo_fl.compress.boundary import BoundaryEncoder, ExchangeStats
from retexo_fl.compress.payload import decode_rows, encode_rows
from retexo_fl.compress.updates import UpdateCodec
from retexo_fl.config import TrainConfig
from retexo_fl.data.partition import Partition
from retexo_fl.models.stage import StageModel
from retexo_fl.plan import BoundaryPlan, LocalGraph
from retexo_fl.secure.envelope import Envelopes, Route
from retexo_fl.secure.keys import (
    KeyMaterialError,
    check_directory,
    load_pins,
    load_private_key,
    private_bytes,
    public_bytes,
)

StateDict = dict[str, Tensor]


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers, identical in every engine and process."""
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (int(p) & 0xFFFFFFFFFFFF)) * 1099511628211) % (1 << 63)
    return h


def connect_clients(clients: list[LazyClient]) -> None:
    """The in-process engines' key setup: what the server does at setup in a Flower run."""
    if not clients or not clients[0].cfg.encrypt:
        return
    run_id = secrets.randbits(63)
    directory = {c.id: c.public_key() for c in clients}
    for c in clients:
        c.connect(directory, run_id)


def seed_dropout(seed: int, device: torch.device) -> None:
    """Seed the generator ``device`` draws dropout masks from.

    ``torch.manual_seed`` would also queue the seed for every accelerator not yet initialised,
    formatting a stack trace for each: about a millisecond a call, paid by every client every
    round. The CPU stream it leaves is the same.
    """
    torch.random.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(seed)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def build_stage_model(cfg: TrainConfig, stage: int, in_dim: int, num_classes: int) -> StageModel:
    """The stage-``stage`` model for ``cfg``; weights are a pure function of the seed and stage.

    A self-training pass repeats the stack: its layers are built as the first pass's are, from
    fresh initial weights.
    """
    torch.manual_seed(derive_seed(cfg.seed, stage, 0xA11))
    layer = cfg.layer(stage)
    return StageModel(
        "mlp" if layer == 0 else cfg.model,
        in_dim,
        cfg.hidden,
        num_classes,
        dropout=float(cfg.per_stage("dropout", layer)),
        input_dropout=float(cfg.per_stage("input_dropout", layer)),
        norm=cfg.norm,
        heads=cfg.heads,
    )


def stage_input_dim(cfg: TrainConfig, stage: int, num_features: int, num_classes: int) -> int:
    if cfg.layer(stage) == 0:
        return num_features
    return cfg.hidden if cfg.pass_embedding == "hidden" else num_classes


@dataclass
class EvalResult:
    correct: int
    count: int
    loss_sum: float

    @property
    def accuracy(self) -> float:
        return self.correct / self.count if self.count else 0.0


class LazyClient:
    """A client of lazy (RETEXO) training, independent of any transport.

    The engine calls, per stage: :meth:`train` and :meth:`evaluate` for each round,
    :meth:`boundary_rows` after the stage, and :meth:`receive_halo` with what peers sent.
    GCN additionally needs halo degrees once: :meth:`degree_rows` / :meth:`receive_degrees`.

    Args:
        part: this client's validated partition.
        cfg: the run configuration.
    """

    def __init__(self, part: Partition, cfg: TrainConfig) -> None:
        self.part = part
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        if cfg.threads:  # edge devices: bounded compute threads
            torch.set_num_threads(cfg.threads)
        self.plan = BoundaryPlan.from_partition(part)
        self.graph = LocalGraph.build(part, self.plan)
        self.y = torch.from_numpy(np.array(part.y)).to(self.device)
        self.masks = {
            k: torch.from_numpy(np.array(m)).to(self.device)
            for k, m in (("train", part.train_mask), ("val", part.val_mask), ("test", part.test_mask))
        }
        # What local training fits: the given labels, plus this client's own confident
        # predictions after a self-training pass (they stay here, like the labels).
        self.train_y = self.y
        self.given_train = self.masks["train"]
        self.stage = 0
        self.owned = self.raw_features()
        self.halo: Tensor | None = None
        self.halo_degree: Tensor | None = None
        self._edges: tuple[Tensor, Tensor | None] | None = None
        self._model: tuple[int, torch.nn.Module] | None = None  # (stage, module) of loaded_model()
        self.encoder = BoundaryEncoder(cfg)
        self.update_codec = UpdateCodec(cfg.update_bits, cfg.range_dtype) if cfg.update_bits < 32 else None
        self.residual: StateDict | None = None  # error feedback of compressed updates, this stage
        self.view: StateDict | None = None  # the model as the compressed broadcast left it
        self._weights: dict[int, Tensor] | None = None
        self.identity: X25519PrivateKey | None = None
        self.directory: dict[int, bytes] | None = None
        self.run_id = 0
        self.envelopes: Envelopes | None = None
        self.halo_round = 0  # eager: the newest round whose halo rows were accepted
        # (stage, frames, stats) of the last boundary rows sent: a resumed server may ask again.
        self.sent: tuple[int, dict[int, bytes], dict] | None = None

    @property
    def id(self) -> int:
        return self.part.partition_id

    @property
    def layer(self) -> int:
        """The layer of the stack this stage trains (0: the MLP on raw features)."""
        return self.cfg.layer(self.stage)

    def raw_features(self) -> Tensor:
        return torch.from_numpy(np.array(self.part.x, dtype=np.float32)).to(self.device)

    @property
    def num_train(self) -> int:
        return int(self.masks["train"].sum())

    # -- end-to-end encryption --------------------------------------------------------------
    def public_key(self, identity_path: str = "") -> bytes:
        """This client's X25519 public key: from its identity key file, else a key pair for this run."""
        if self.identity is None:
            path = identity_path or (
                str(Path(self.cfg.identity_keys) / f"client-{self.id}.key") if self.cfg.identity_keys else ""
            )
            self.identity = load_private_key(path) if path else X25519PrivateKey.generate()
        return public_bytes(self.identity)

    def connect(self, directory: dict[int, bytes], run_id: int) -> None:
        """Derive the sealed channels to every peer from the server's key directory.

        Raises:
            KeyMaterialError: the directory misses a peer, has another key for this client, or
                disagrees with the pinned keys (``pinned-keys``).
        """
        where = f"client {self.id}"
        pins = load_pins(self.cfg.pinned_keys) if self.cfg.pinned_keys else None
        check_directory(directory, pins, where)
        if directory.get(self.id) != self.public_key():
            raise KeyMaterialError(f"{where}: the key directory holds another key for this client")
        peers = set(self.plan.send) | set(self.plan.recv)
        missing = sorted(peers - set(directory))
        if missing:
            raise KeyMaterialError(f"{where}: no public key for peer clients {missing}")
        self.directory, self.run_id = dict(directory), int(run_id)
        self.envelopes = Envelopes(self.id, self.identity, self.run_id, {q: directory[q] for q in peers})

    def _seal(self, frames: dict[int, bytes], kind: str, stage: int, round_: int = 0) -> dict[int, bytes]:
        if not self.cfg.encrypt:
            return frames
        if self.envelopes is None:
            raise RuntimeError(f"client {self.id}: encryption is on but no key directory arrived")
        return {q: self.envelopes.seal(f, Route(kind, stage, round_, self.id, q)) for q, f in frames.items()}

    def _open(self, blobs: dict[int, bytes], kind: str, stage: int, min_round: int = 0) -> tuple[dict, int]:
        """Opened frames and the newest round they were sealed in."""
        if not self.cfg.encrypt:
            return blobs, 0
        if self.envelopes is None:
            raise RuntimeError(f"client {self.id}: encryption is on but no key directory arrived")
        out, newest = {}, 0
        for p, blob in blobs.items():
            out[p], rnd = self.envelopes.open(blob, kind, stage, p, min_round)
            newest = max(newest, rnd)
        return out, newest

    # -- one-time setup exchange ------------------------------------------------------------
    def degree_rows(self) -> dict[int, Tensor]:
        """Global in-degrees of the rows each peer needs, ``{peer: [k, 1]}`` (GCN only)."""
        return self.plan.rows_for(self.graph.in_degree.view(-1, 1))

    def degree_frames(self) -> dict[int, bytes]:
        """:meth:`degree_rows` as exact (32-bit) frames."""
        frames = {
            q: encode_rows(r, 32, where=f"client {self.id}, degrees") for q, r in self.degree_rows().items()
        }
        return self._seal(frames, "deg", 0)

    def decode_degrees(self, frames: dict[int, bytes]) -> dict[int, Tensor]:
        frames, _ = self._open(frames, "deg", 0)
        return {
            p: decode_rows(blob, f"client {p} (degrees)", self._expect(p), 1) for p, blob in frames.items()
        }

    def _expect(self, peer: int) -> int | None:
        ids = self.plan.recv.get(peer)
        return None if ids is None else int(ids.size)

    def complete_halo(
        self, incoming: dict[int, Tensor], dim: int, previous: Tensor | None
    ) -> dict[int, Tensor]:
        """``incoming`` plus the blocks of peers lost since (absent), as ``on-missing-halo`` says.

        ``zero`` fills them with zeros, ``reuse-last`` with their rows in ``previous`` (the halo
        held so far, if it has the same width; else zeros); ``fail`` leaves them missing, so
        assembling the halo names them.
        """
        missing = sorted(set(self.plan.recv) - set(incoming))
        policy = self.cfg.on_missing_halo
        if not missing or policy == "fail":
            return incoming
        out, start, spans = dict(incoming), 0, {}
        for q in sorted(self.plan.recv):
            spans[q] = slice(start, start + int(self.plan.recv[q].size))
            start = spans[q].stop
        for q in missing:
            if policy == "reuse-last" and previous is not None and previous.shape[1] == dim:
                out[q] = previous[spans[q]].detach().cpu()
            else:
                out[q] = torch.zeros(int(self.plan.recv[q].size), dim)
        return out

    def receive_degrees(self, incoming: dict[int, Tensor]) -> None:
        self.halo_degree = self.plan.assemble_halo(self.complete_halo(incoming, 1, None), 1).view(-1)
        self._edges = None
        self._weights = None

    def boundary_weights(self) -> dict[int, Tensor]:
        """Per peer, the aggregation weights of the rows sent to it (adaptive widths); computed
        once, as they depend only on the graph and the halo degrees."""
        if self._weights is None:
            self._weights = aggregation_weights(
                self.part, self.plan, self.graph.in_degree, self.halo_degree, self.cfg.model
            )
        return self._weights

    # -- stage inputs -----------------------------------------------------------------------
    def stage_input(self) -> Tensor:
        if self.layer == 0:
            return self.owned
        if self.halo is None:
            raise RuntimeError(f"client {self.id}: stage {self.stage} has no halo rows yet")
        return torch.cat([self.owned, self.halo])

    def edges(self) -> tuple[Tensor | None, Tensor | None]:
        if self.layer == 0:
            return None, None
        if self._edges is None:
            if self.cfg.model == "gcn":
                if self.halo_degree is None:
                    if self.graph.num_halo:
                        raise RuntimeError(f"client {self.id}: GCN needs halo degrees first")
                    self.halo_degree = torch.zeros(0)
                ei, w = self.graph.gcn_weights(self.halo_degree.cpu())
                self._edges = (ei.to(self.device), w.to(self.device))
            else:
                self._edges = (self.graph.edge_index.to(self.device), None)
        return self._edges

    def make_model(self) -> StageModel:
        """This stage's model with its initial weights."""
        in_dim = self.owned.shape[1]
        return build_stage_model(self.cfg, self.stage, in_dim, self.part.num_classes).to(self.device)

    def loaded_model(self, state: StateDict) -> torch.nn.Module:
        """This stage's model holding ``state``.

        Built once a stage and reused, also across :meth:`restore` (its shape is a function of the
        stage): every caller loads a whole state into it, and building (a fresh random init of a
        1433-wide encoder, say) cost a third of an in-process run.
        """
        if self._model is None or self._model[0] != self.stage:
            self._model = (self.stage, self.make_model())
        model = self._model[1]
        model.load_state_dict(state)
        return model

    def _forward(self, model: StageModel, rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Outputs for the owned nodes, or only for boolean ``rows`` of them.

        Stage 0 is row-wise, so it runs on the selected rows alone; a conv stage needs the whole
        local graph and is sliced after.
        """
        if self.layer == 0:
            hidden, logits = model(self.owned if rows is None else self.owned[rows])
            return hidden, logits
        ei, w = self.edges()
        hidden, logits = model(self.stage_input(), ei, w, num_targets=self.graph.num_owned)
        return (hidden, logits) if rows is None else (hidden[rows], logits[rows])

    # -- rounds -----------------------------------------------------------------------------
    def optimizer(self, model: torch.nn.Module, layer: int) -> torch.optim.Optimizer:
        """The local optimizer the run config names, at ``layer``'s learning rate."""
        cfg = self.cfg
        lr = float(cfg.per_stage("lr", layer))
        if cfg.optimizer == "adam":
            return torch.optim.Adam(model.parameters(), lr=lr, weight_decay=cfg.weight_decay)
        return torch.optim.SGD(
            model.parameters(), lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
        )

    def train(self, state: StateDict, round_: int) -> tuple[StateDict, float]:
        """Local epochs from ``state``; returns the new state and the mean training loss."""
        model = self.loaded_model(state)
        cfg, stage = self.cfg, self.stage
        opt = self.optimizer(model, self.layer)
        seed_dropout(derive_seed(cfg.seed, stage, round_, self.id), self.device)
        mask = self.masks["train"]
        model.train()
        losses = []
        for _ in range(int(cfg.per_stage("local_epochs", self.layer))):
            opt.zero_grad()
            _, logits = self._forward(model, mask)
            loss = torch.nn.functional.cross_entropy(logits, self.train_y[mask])
            loss.backward()
            opt.step()
            losses.append(loss.item())
        # A copy: the module is reused next round and would overwrite these tensors in place.
        return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}, (
            float(np.mean(losses)) if losses else 0.0
        )

    @torch.no_grad()
    def evaluate(self, state: StateDict, split: str) -> EvalResult:
        model = self.loaded_model(state)
        model.eval()
        mask = self.masks[split]
        count = int(mask.sum())
        if count == 0:
            return EvalResult(0, 0, 0.0)
        _, logits = self._forward(model, mask)
        loss = torch.nn.functional.cross_entropy(logits, self.y[mask], reduction="sum")
        correct = int((logits.argmax(1) == self.y[mask]).sum())
        return EvalResult(correct, count, float(loss))

    # -- between stages ---------------------------------------------------------------------
    @torch.no_grad()
    def embeddings(self, state: StateDict) -> Tensor:
        """This stage's output for every owned node, ``[n, d]``: what the next stage consumes."""
        model = self.loaded_model(state)
        model.eval()
        hidden_out = self.cfg.pass_embedding == "hidden"
        chunk = self.cfg.chunk_rows
        n = self.graph.num_owned
        if not chunk or chunk >= n:
            hidden, logits = self._forward(model)
            return (hidden if hidden_out else logits).float().cpu()
        # In row chunks: a conv stage's messages (one per edge into the chunk) are what dominates
        # memory, and every target's incoming edges are all in its chunk, so the rows are exact.
        out = []
        with torch.no_grad():
            if self.layer == 0:
                for start in range(0, n, chunk):
                    h, z = model(self.owned[start : start + chunk])
                    out.append((h if hidden_out else z).float().cpu())
                return torch.cat(out)
            ei, w = self.edges()
            x, dst = self.stage_input(), ei[1]
            for start in range(0, n, chunk):
                stop = min(n, start + chunk)
                sel = (dst >= start) & (dst < stop)
                h, z = model(x, ei[:, sel], None if w is None else w[sel], num_targets=stop)
                out.append((h if hidden_out else z)[start:stop].float().cpu())
        return torch.cat(out)

    def advance(self, embeddings: Tensor) -> dict[int, Tensor]:
        """Make ``embeddings`` the owned input of the next stage; return the rows peers need."""
        self.owned = embeddings.to(self.device)
        self.stage += 1
        self.halo = None
        return self.plan.rows_for(embeddings)

    def next_stage(self, state: StateDict) -> dict[int, Tensor]:
        """Move on from this stage, trained to ``state``; return the boundary rows peers need.

        Within a pass that is :meth:`advance` with this stage's embeddings. After a pass's last
        stage it is :meth:`relabel`, and nothing crosses: the next stage reads raw features.
        """
        if self.cfg.ends_pass(self.stage):
            self.relabel(state)
            return {}
        return self.advance(self.embeddings(state))

    @torch.no_grad()
    def relabel(self, state: StateDict) -> int:
        """End a self-training pass: label confident predictions of ``state``, restart at layer 0.

        Returns how many nodes the next pass trains on.
        """
        from retexo_fl.training.pseudo import pseudo_labels

        model = self.loaded_model(state)
        model.eval()
        _, logits = self._forward(model)
        self.train_y, self.masks["train"] = pseudo_labels(
            logits,
            self.y,
            self.given_train,
            self.masks["val"],
            self.cfg.pseudo_threshold,
            self.cfg.pseudo_per_class,
        )
        self.stage += 1
        self.owned, self.halo = self.raw_features(), None
        return self.num_train

    def receive_halo(self, incoming: dict[int, Tensor]) -> None:
        dim = self.owned.shape[1]
        self.halo = self.plan.assemble_halo(self.complete_halo(incoming, dim, self.halo), dim).to(self.device)

    def encode_boundary(self, rows: dict[int, Tensor]) -> tuple[dict[int, bytes], ExchangeStats]:
        """Frames of the rows :meth:`advance` returned, compressed as the run config says."""
        if not rows:
            return {}, ExchangeStats()
        exchange = self.layer - 1
        weights = self.boundary_weights() if self.cfg.bit_policy != "fixed" else None
        gen = torch.Generator().manual_seed(derive_seed(self.cfg.seed, self.stage, 0xB0, self.id))
        frames, stats = self.encoder.encode(self.id, rows, weights, exchange, self.cfg.stages - 1, gen)
        return self._seal(frames, "halo", self.stage), stats

    def decode_boundary(self, frames: dict[int, bytes]) -> dict[int, Tensor]:
        """Peer frames -> row blocks, each checked against this client's boundary plan."""
        frames, _ = self._open(frames, "halo", self.stage)
        dim = self.owned.shape[1]
        return {p: decode_rows(blob, f"client {p}", self._expect(p), dim) for p, blob in frames.items()}

    def receive_model(self, state: StateDict | None, frames: dict[str, bytes] | None) -> StateDict:
        """The round's model: ``state`` sent whole, or ``frames`` of a delta from the last one."""
        if frames is None:
            if state is None:
                raise ValueError(f"client {self.id}: a model message with neither state nor delta")
            self.view = state
            return state
        if self.view is None:
            raise RuntimeError(f"client {self.id}: a model delta arrived before any whole state")
        codec = UpdateCodec(self.cfg.broadcast_bits, self.cfg.range_dtype)
        self.view = codec.decode(frames, self.view, "server broadcast")
        return self.view

    def encode_update(self, new: StateDict, base: StateDict, round_: int) -> dict[str, bytes] | None:
        """``new``'s update from ``base`` as frames (``update-bits``), or ``None`` when uncompressed."""
        if self.update_codec is None:
            return None
        if round_ == 1:
            self.residual = None  # a new stage trains a new model
        gen = torch.Generator().manual_seed(derive_seed(self.cfg.seed, self.stage, round_, 0xC0, self.id))
        frames, self.residual = self.update_codec.encode(
            new, base, self.residual, gen, where=f"client {self.id}, stage {self.stage} update"
        )
        return frames

    # -- persistence between messages (a deployed ClientApp is a new process per message) ------
    def _snapshot(self) -> dict:
        """What :meth:`save` writes: everything a later message needs besides the partition."""
        return {
            "stage": self.stage,
            "owned": self.owned.cpu(),
            "halo": None if self.halo is None else self.halo.cpu(),
            "halo_degree": self.halo_degree,
            "residual": self.residual,
            "view": self.view if self.cfg.broadcast_bits < 32 else None,
            # Node-local, like everything here: the private key never leaves this folder.
            "identity": None if self.identity is None else private_bytes(self.identity).hex(),
            "directory": None if self.directory is None else {q: k.hex() for q, k in self.directory.items()},
            "run_id": self.run_id,
            "halo_round": self.halo_round,
            "sent": None if self.sent is None else [self.sent[0], self.sent[1], json.dumps(self.sent[2])],
            # Self-training labels: node-local, restored so that a later message trains on them.
            "pseudo": None
            if self.train_y is self.y
            else {"labels": self.train_y.cpu(), "mask": self.masks["train"].cpu()},
        }

    def _load_snapshot(self, state: dict) -> None:
        self.stage = int(state["stage"])
        self.owned = state["owned"].to(self.device)
        self.halo = None if state["halo"] is None else state["halo"].to(self.device)
        pseudo = state.get("pseudo")
        if pseudo is None:
            self.train_y, self.masks["train"] = self.y, self.given_train
        else:
            self.train_y = pseudo["labels"].to(self.device)
            self.masks["train"] = pseudo["mask"].to(self.device)

    def save(self, directory: str | Path) -> None:
        """Write the stage inputs to a node-local ``directory`` (atomically)."""
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        torch.save(self._snapshot(), path / "client-state.pt.tmp")
        (path / "client-state.pt.tmp").replace(path / "client-state.pt")

    def restore(self, directory: str | Path) -> bool:
        """Load stage inputs saved by :meth:`save`; ``False`` if there are none."""
        path = Path(directory) / "client-state.pt"
        if not path.is_file():
            return False
        state = torch.load(path, weights_only=True)
        self._load_snapshot(state)
        self.halo_degree = state["halo_degree"]
        self.residual = state.get("residual")
        self.view = state.get("view")
        self._edges = None
        self._weights = None
        if state.get("identity"):
            self.identity = X25519PrivateKey.from_private_bytes(bytes.fromhex(state["identity"]))
        self.halo_round = int(state.get("halo_round", 0))
        sent = state.get("sent")
        self.sent = None if sent is None else (int(sent[0]), dict(sent[1]), json.loads(sent[2]))
        if state.get("directory"):
            self.connect({int(q): bytes.fromhex(k) for q, k in state["directory"].items()}, state["run_id"])
        return True
