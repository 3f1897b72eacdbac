"""The server's side of a federation, whatever the loop: who holds what, messaging, relaying, decoding.

A :class:`FederationView` wraps a :class:`~retexo_fl.coordinator.transport.Transport`: it builds each
message's records, applies the failure policy to clients that were lost, runs key setup and
setup, relays sealed frames between clients (counting their bytes), decodes and checks model
updates, and aggregates evaluations. The lazy stage machine and the eager / local round loop
both hold one (composition), so none of this is written twice.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from retexo_fl import protocol as P
from retexo_fl.compress.boundary import ExchangeStats
from retexo_fl.compress.updates import ModelBroadcast, UpdateCodec
from retexo_fl.config import TrainConfig
from retexo_fl.coordinator.aggregate import check_state, state_nbytes
from retexo_fl.coordinator.privacy import make_privacy
from retexo_fl.coordinator.secure_aggregation import SecureAggregator
from retexo_fl.coordinator.selection import StageTracker
from retexo_fl.coordinator.transport import ClientFailure, Membership, Transport
from retexo_fl.metrics import RunRecorder
from retexo_fl.plan import check_plans
from retexo_fl.protocol import Records
from retexo_fl.records import EvalResult, StateDict, state_digest
from retexo_fl.secure.boundary_noise import gaussian_epsilon
from retexo_fl.secure.keys import load_pins, pin_digest

Frames = dict[str, bytes]
"""Relayed frames of one client: delivery or outgoing key -> sealed bytes."""


#: The key of :meth:`FederationView.evaluate`'s one result under secure aggregation: the sum.
AGGREGATE = -1


@dataclass
class ClientCounts:
    """What a client reported at setup.

    Args:
        num_classes (int): classes of the dataset.
        num_features (int): raw feature width.
        counts (dict[str, int]): its partition's node, edge and split counts.
    """

    num_classes: int
    num_features: int
    counts: dict[str, int]


class FederationView:
    """The server's view of a run's clients over a transport.

    Args:
        transport (Transport): how clients are reached.
        cfg (TrainConfig): the run configuration.
        rec (RunRecorder): where events and progress go.
    """

    def __init__(self, transport: Transport, cfg: TrainConfig, rec: RunRecorder) -> None:
        self.transport = transport
        self.cfg = cfg
        self.rec = rec
        self.members = Membership(cfg, rec)
        self.privacy = make_privacy(cfg, cfg.clients)
        self.secure = SecureAggregator(cfg) if cfg.secure_aggregation else None
        # Clients key their node-local state and their channel keys on this, not on Flower's
        # run id, so a resumed run (a new Flower run) finds both again.
        self.run_key = secrets.randbits(62)
        self.run_json = P.config_to_json(cfg)
        self.run_digest = P.config_digest(self.run_json)
        self.keys: dict[str, str] = {}  # client id -> public key hex (the directory relayed)
        self.contributions: dict[str, str] = {}  # client id -> transcript contribution hex (relayed)
        self.boundary_releases = 0  # times each boundary row's value went out (boundary-noise)
        # stage -> "sender->receiver" -> payloads a receiver expected and filled in (on-missing-halo)
        self.missing_payloads: dict[str, dict[str, int]] = {}
        self.counts: dict[int, ClientCounts] = {}
        self.bytes_boundary = 0  # relayed frames (degrees and boundary rows), headers included
        # message type ("train", "evaluate", "unmask", ...) -> messages sent, one per client each
        self.messages: dict[str, int] = {}
        # stage -> message type -> messages sent in it (setup's under "-1")
        self.messages_per_stage: dict[str, dict[str, int]] = {}
        # Training nodes of clients whose count changed since setup (self-training's relabelling).
        self.training_nodes: dict[int, int] = {}
        # stage -> client -> [boundary bytes sent, boundary bytes received, model bytes] (the
        # exchange that ends a stage counts to it; setup's degree frames to stage -1)
        self.client_bytes: dict[int, dict[int, list[int]]] = {}
        # Clients that hold no copy of the state a stage ends with (its best: they were neither
        # sent it last nor told to keep it): evaluate and embed send it to them whole, not by digest.
        self.unheld: set[int] = set()
        # first-stage auto: what layer-0 stages are, mlp or local (the one being tried, then the
        # one kept); every message names it (see content).
        self.first_stage: str | None = None

    @property
    def pids(self) -> list[int]:
        """The live clients' partition ids, in order."""
        return self.members.pids

    @property
    def bytes_secure(self) -> int:
        """Secure aggregation's traffic besides the masked vectors: shares and unmask answers."""
        return self.secure.bytes_extra if self.secure is not None else 0

    # -- messages ---------------------------------------------------------------------------
    def content(
        self,
        state: StateDict | None = None,
        payloads: Frames | None = None,
        model: ModelBroadcast | None = None,
        by_digest: bool = False,
        missed: Frames | None = None,
        **config: Any,
    ) -> Records:
        """A message's records.

        Args:
            state (StateDict, optional): a model state sent whole. (default: :obj:`None`)
            payloads (Frames, optional): relayed frames for the recipient. (default: :obj:`None`)
            model (ModelBroadcast, optional): sends its prepared delta frames instead of
                ``state`` when it has them. (default: :obj:`None`)
            missed (Frames, optional): with ``model``'s frames, the deltas of rounds the recipient
                missed (:func:`~retexo_fl.protocol.chain_record`). (default: :obj:`None`)
            by_digest (bool, optional): name the run config by its digest instead of carrying it
                (train messages: see :func:`~retexo_fl.protocol.config_digest`). (default: :obj:`False`)
            **config: further :data:`~retexo_fl.protocol.CONFIG` entries (stage, round, split, ...).
        """
        run = {P.RUN_DIGEST: self.run_digest} if by_digest else {P.RUN: self.run_json}
        variant = {P.FIRST_STAGE: self.first_stage} if self.first_stage is not None else {}
        records: Records = {P.CONFIG: {**run, P.RUN_KEY: self.run_key, **variant, **config}}
        if model is not None and model.frames is not None:
            records[P.MODEL] = model.frames
            if missed:
                records[P.MODEL_BEFORE] = missed
        elif state is not None:
            records[P.ARRAYS] = state
        if payloads is not None:
            records[P.PAYLOADS] = payloads
        return records

    def live(self, pids: list[int] | None = None) -> list[int]:
        """The live clients among ``pids`` (``None``: every live client), in order."""
        if pids is None:
            return self.pids
        wanted = set(pids)
        return [p for p in self.pids if p in wanted]

    def trains(self, pid: int) -> bool:
        """Whether client ``pid`` holds training nodes (given labels, or self-training's)."""
        if pid in self.training_nodes:
            return self.training_nodes[pid] > 0
        counts = self.counts.get(pid)
        return counts is None or counts.counts.get("train", 1) > 0  # unknown: assume it does

    def validates(self, pid: int) -> bool:
        """Whether client ``pid`` holds validation nodes."""
        counts = self.counts.get(pid)
        return counts is None or counts.counts.get("val", 1) > 0

    def has_test_nodes(self) -> bool:
        """Whether any client reported test nodes at setup (``True`` when none reported counts)."""
        return not self.counts or any(c.counts.get("test", 1) > 0 for c in self.counts.values())

    def tests(self, pid: int) -> bool:
        """Whether client ``pid`` holds test nodes."""
        counts = self.counts.get(pid)
        return counts is None or counts.counts.get("test", 1) > 0

    def send_to(
        self, kind: str, requests: dict[int, Records], phase: str, stage: int = -1
    ) -> dict[int, Records]:
        """Send ``requests`` by address; lose (or fail on) those that did not answer.

        Returns:
            dict[int, Records]: address -> reply, for the clients that answered.
        """
        name = kind.rsplit(".", 1)[-1]
        self.messages[name] = self.messages.get(name, 0) + len(requests)
        per_stage = self.messages_per_stage.setdefault(str(stage), {})
        per_stage[name] = per_stage.get(name, 0) + len(requests)
        batch = self.transport.send(kind, requests, phase, stage)
        for address in requests:
            if address in batch.failures:
                pid = self.members.who(address)
                self.members.lose(pid, phase, f"{self.members.name(address)} {batch.failures[address]}")
        replies = {a: r for a, r in batch.replies.items() if a not in batch.failures}
        for address, reply in list(replies.items()):
            if P.MISSING not in reply:
                continue
            pid = self.members.who(address)
            try:
                events = json.loads(str(reply[P.MISSING][P.STATS_JSON]))
                self.count_missing(pid, [(str(k), int(s), int(q)) for k, s, q in events])
            except (ValueError, TypeError, KeyError):  # one client's bad report is its failure
                del replies[address]
                self.members.lose(
                    pid, phase, f"{self.members.name(address)} sent a malformed missing-payload report"
                )
        return replies

    def count_missing(self, receiver: int | None, events: list[tuple[str, int, int]]) -> None:
        """Count the payloads ``receiver`` reported missing (filled in by ``on-missing-halo``)."""
        for kind, stage, sender in events:
            pair = f"{int(sender)}->{receiver}"
            per_stage = self.missing_payloads.setdefault(str(int(stage)), {})
            per_stage[pair] = per_stage.get(pair, 0) + 1
            self.rec.progress(
                f"warning: client {receiver} got no {kind} payload from client {sender} (stage {stage})"
            )

    def send(
        self, kind: str, requests: dict[int, Records], phase: str, stage: int = -1
    ) -> dict[int, Records]:
        """Send ``requests`` by partition id to the live clients; replies by partition id."""
        nodes = self.members.nodes
        by_address = self.send_to(
            kind, {nodes[p]: r for p, r in requests.items() if p in nodes}, phase, stage
        )
        return {p: by_address[a] for p, a in list(nodes.items()) if a in by_address}

    def send_state(
        self,
        kind: str,
        state: StateDict,
        phase: str,
        stage: int,
        config: dict[str, Any],
        payloads: dict[int, Frames] | None = None,
        pids: list[int] | None = None,
    ) -> dict[int, Records]:
        """``state`` to every live client (or the live ones of ``pids``) with ``config``
        (:data:`~retexo_fl.protocol.CONFIG` entries); replies by partition id.

        With compressed broadcasts (``broadcast-bits`` < 32) clients hold the views they were
        broadcast, and the one the server named the stage's best (:data:`~retexo_fl.protocol.KEEP`),
        so the state goes by its digest (:data:`~retexo_fl.protocol.HELD`, 16 bytes) instead of
        whole; a client that holds no such state (a node restarted without its folder) answers
        :data:`~retexo_fl.protocol.NOT_HELD` and is sent the state whole. Messages that carry
        ``payloads`` always carry the state whole: their frames are opened once. So do messages to
        the clients in :attr:`unheld` (holding no copy of the stage's best), which hold it from then on.
        """
        held = self.cfg.broadcast_bits < 32
        named = {P.HELD: state_digest(state)} if held else {}

        def request(pid: int, whole: bool) -> Records:
            frames = payloads.get(pid) if payloads else None
            if whole or frames or pid in self.unheld:
                return self.content(state, frames, **config)
            return self.content(None, frames, **config, **named)

        to = self.live(pids)
        requests = {pid: request(pid, not held) for pid in to}
        replies = self.send(kind, requests, phase, stage)
        self.unheld -= set(replies)  # a state received whole is held from then on
        again = [pid for pid, r in replies.items() if P.NOT_HELD in r.get(P.METRICS, {})]
        if again:
            self.rec.event("state-resent", stage=stage, message=kind, clients=again)
            replies.update(self.send(kind, {pid: request(pid, True) for pid in again}, phase, stage))
        return replies

    def broadcast(self, kind: str, phase: str, stage: int = -1, **content: Any) -> dict[int, Records]:
        """The same content (see :meth:`content`) to every live client; replies by partition id."""
        return self.send(kind, {p: self.content(**content) for p in self.pids}, phase, stage)

    # -- setup ------------------------------------------------------------------------------
    def setup(self) -> dict[int, Frames]:
        """Key setup and setup: claim partitions, relay the key directory, check the plans.

        Returns:
            dict[int, Frames]: the degree frames each client is to receive (GCN), to deliver
            with the first conv stage.

        Raises:
            ClientFailure: a client is missing or claims a partition another one holds.
            PlanMismatchError: two clients' boundary plans disagree.
        """
        addresses = self.transport.connect(self.cfg.clients)
        if self.cfg.encrypt:
            # Public keys first: the setup replies already carry sealed degree frames.
            replies = self.send_to(P.HELLO, {a: self.content() for a in addresses}, "key setup")
            addresses = [a for a in addresses if a in replies]  # lost at key setup (min-clients)
            for address, reply in replies.items():
                info = reply[P.CONFIG]
                pid = int(info[P.PARTITION_ID])
                self.members.claim(pid, address)
                self.keys[str(pid)] = str(info[P.PUBLIC_KEY])
                self.contributions[str(pid)] = str(info.get(P.CONTRIBUTION, ""))
            self.rec.progress(f"keys: {len(self.keys)} public keys collected; relaying the directory")
        relay = {P.KEYS: json.dumps(self.keys), P.CONTRIBUTIONS: json.dumps(self.contributions)}
        if self.cfg.pinned_keys:  # clients that pin keys refuse a run that does not pin the same set
            relay[P.PINS] = pin_digest(load_pins(self.cfg.pinned_keys))
        replies = self.send_to(P.SETUP, {a: self.content(**relay) for a in addresses}, "setup")
        digests, outgoing = {}, {}
        for address, reply in replies.items():
            info = reply[P.CONFIG]
            pid = int(info[P.PARTITION_ID])
            if not self.cfg.encrypt:
                self.members.claim(pid, address)
            elif self.members.nodes.get(pid) != address:
                raise ClientFailure(
                    f"node {address} claimed partition {pid} at setup, another one at key setup"
                )
            self.counts[pid] = ClientCounts(
                int(info[P.NUM_CLASSES]),
                int(info[P.NUM_FEATURES]),
                {k: int(v) for k, v in reply[P.METRICS].items()},
            )
            digests[pid] = json.loads(str(info[P.DIGESTS]))
            outgoing[pid] = reply.get(P.PAYLOADS, {})
        check_plans(digests)
        self.rec.progress(f"setup: {len(self.members.nodes)} clients, plans consistent")
        return self.route(outgoing, P.DEGREES)

    def reconnect(self, wanted: list[int]) -> None:
        """Find the clients of a resumed run again: each must come back with its partition and key.

        Raises:
            ClientFailure: a client came back with another key (its saved state is gone) or did
                not come back.
        """
        addresses = self.transport.connect(self.cfg.clients)
        for address, reply in self.send_to(P.HELLO, {a: self.content() for a in addresses}, "resume").items():
            info = reply[P.CONFIG]
            pid = int(info[P.PARTITION_ID])
            if pid not in wanted:
                continue  # lost before the checkpoint: stays lost
            if self.keys and self.keys.get(str(pid)) != str(info[P.PUBLIC_KEY]):
                raise ClientFailure(f"client {pid} came back with another key: its saved state is gone")
            self.members.claim(pid, address)
        missing = sorted(set(wanted) - set(self.members.nodes))
        if missing:
            raise ClientFailure(f"clients {missing} did not come back to resume the run")

    @property
    def reference(self) -> ClientCounts:
        """The lowest client's setup report: what the server builds models from."""
        return self.counts[min(self.counts)]

    # -- relaying ---------------------------------------------------------------------------
    def count_client_bytes(
        self, stage: int, pid: int, sent: int = 0, received: int = 0, model: int = 0
    ) -> None:
        """Add to client ``pid``'s bytes of ``stage`` (see :meth:`bytes_per_client`)."""
        row = self.client_bytes.setdefault(stage, {}).setdefault(pid, [0, 0, 0])
        row[0] += sent
        row[1] += received
        row[2] += model

    def bytes_per_client(self) -> dict[str, dict[str, dict[str, float]]]:
        """Per stage, the distribution over clients of the boundary bytes each sent and received
        and the model bytes each downloaded and uploaded in rounds: mean, median and max (at one
        node per client, per-client rows would be thousands)."""
        out: dict[str, dict[str, dict[str, float]]] = {}
        for stage, rows in sorted(self.client_bytes.items()):
            figures = {}
            clients = set(self.pids) | set(rows)  # a client that moved no bytes counts as 0
            for i, name in enumerate(("boundary_sent", "boundary_received", "model")):
                values = sorted(rows[p][i] if p in rows else 0 for p in clients)
                figures[name] = {
                    "mean": sum(values) / len(values),
                    "median": float(values[len(values) // 2]),
                    "max": float(values[-1]),
                }
            out[str(stage)] = figures
        return out

    def route(self, outgoing: dict[int, Frames], kind: str, stage: int = -1) -> dict[int, Frames]:
        """``{src: {to-q: blob}}`` -> ``{dst: {<kind>-from-src: blob}}`` for every live client,
        counting the relayed bytes (in total, and per client for ``stage``).

        Raises:
            ClientFailure: a client named a destination that is no client of this run.
        """
        incoming: dict[int, Frames] = {pid: {} for pid in self.members.nodes}
        for src, frames in outgoing.items():
            for key, blob in frames.items():
                try:
                    dst = P.parse_outgoing_key(key)
                except ValueError as exc:
                    raise ClientFailure(f"client {src}: {exc}") from None
                if dst not in incoming:  # a client lost since: nothing to deliver to
                    continue
                incoming[dst][P.delivery_key(kind, src)] = bytes(blob)
                self.bytes_boundary += len(blob)
                self.count_client_bytes(stage, src, sent=len(blob))
                self.count_client_bytes(stage, dst, received=len(blob))
        if kind == P.HALO and any(outgoing.values()):
            # One exchange releases each boundary row once (the same noisy row to every peer);
            # an eager round releases every conv layer's input row.
            self.boundary_releases += self.cfg.stages - 1 if self.cfg.mode == "eager" else 1
        return incoming

    @staticmethod
    def add_stats(stats: ExchangeStats, replies: list[Records]) -> None:
        """Fold the exchange figures clients reported (:data:`~retexo_fl.protocol.STATS`) into ``stats``."""
        for reply in replies:
            if P.STATS in reply:
                stats.add(ExchangeStats.from_dict(json.loads(str(reply[P.STATS][P.STATS_JSON]))))

    # -- updates and evaluation -------------------------------------------------------------
    def updates(
        self,
        pids: list[int],
        replies: list[Records],
        base: StateDict,
        codec: UpdateCodec,
        tracker: StageTracker,
        down: int,
    ) -> tuple[list[StateDict], int]:
        """Clients' new states from their train replies (``pids``' in order), counting model bytes.

        Compressed updates are decoded against ``base``, what the clients trained from; ``down``
        is the broadcast's bytes per client.

        Returns:
            tuple[list[StateDict], int]: the states, and the bytes float32 would have taken.

        Raises:
            ClientFailure: an update is malformed, naming its sender, before it touches the model.
        """
        states, raw = [], 0
        coded = [i for i, reply in enumerate(replies) if P.UPDATE in reply]
        frames = {i: {k: bytes(v) for k, v in replies[i][P.UPDATE].items()} for i in coded}
        try:  # in one pass per tensor (many one-node clients); an error names its sender
            decoded = codec.decode_many(
                [frames[i] for i in coded], base, [f"client {pids[i]}" for i in coded]
            )
        except ValueError as exc:  # PayloadError is a ValueError too
            raise ClientFailure(str(exc)) from None
        by_reply = dict(zip(coded, decoded, strict=True))
        for i, (pid, reply) in enumerate(zip(pids, replies, strict=True)):
            try:
                if i in by_reply:
                    new = by_reply[i]
                    up = codec.nbytes(frames[i])
                elif P.ARRAYS in reply:
                    new = reply[P.ARRAYS]
                    up = state_nbytes(new)
                else:
                    raise ValueError(f"update from client {pid}: the reply carries no model")
                states.append(check_state(new, base, f"client {pid}"))
            except ValueError as exc:  # PayloadError is a ValueError too
                raise ClientFailure(str(exc)) from None
            tracker.model_bytes += down + up
            self.count_client_bytes(tracker.stage, pid, model=down + up)
            raw += 2 * state_nbytes(base)
        return states, raw

    def evaluate(
        self,
        state: StateDict,
        split: str,
        stage: int,
        deliveries: dict[int, Frames] | None = None,
        model: ModelBroadcast | None = None,
        pids: list[int] | None = None,
        plans: dict[int, dict[str, Any]] | None = None,
        **config: Any,
    ) -> dict[int, EvalResult]:
        """Every live client's evaluation of ``state`` on ``split``, by partition id.

        Args:
            state (StateDict): the state evaluated (sent whole or by digest, see :meth:`send_state`).
            split (str): ``"val"`` or ``"test"``.
            stage (int): the stage (tags the messages).
            deliveries (dict[int, Frames], optional): relayed frames to open first (eager: the
                last round's halo rows). (default: :obj:`None`)
            model (ModelBroadcast, optional): ``state`` is this broadcast's prepared view: send
                its delta frames (a stage's last validation; ``config`` then names the round).
                (default: :obj:`None`)
            pids (list[int], optional): the clients to ask (a stage's last validation: those that
                took part in its rounds). (default: every live client)
            plans (dict[int, dict], optional): with ``model``, how the state goes to clients that
                do not take its delta as is (:meth:`content` arguments: the deltas they missed, or
                the state whole; a :data:`~retexo_fl.protocol.KEEP`). (default: :obj:`None`)
            **config: further :data:`~retexo_fl.protocol.CONFIG` entries (``round``, ``keep``).

        Returns:
            dict[int, EvalResult]: by partition id; under secure aggregation one entry,
            :data:`AGGREGATE`, the members' sum (the server learns no client's own figures).
        """
        config = {P.SPLIT: split, P.STAGE: stage, **config}
        phase = f"{split} evaluation"
        if self.secure is not None:  # the clients mask their figures: the server learns the sum only
            config.update(self.secure.evaluation_config(self, self.pids))
        if model is not None and model.frames is not None:
            # Only the clients that took part in the rounds hold the view the delta applies to.
            to = self.live(pids)
            plans = plans or {}
            requests = {
                pid: self.content(
                    **{"state": None, "model": model, **plans.get(pid, {})},
                    payloads=deliveries.get(pid) if deliveries else None,
                    **config,
                )
                for pid in to
            }
            replies = self.send(P.EVALUATE, requests, phase, stage)
        else:
            replies = self.send_state(P.EVALUATE, state, phase, stage, config, deliveries, pids)
        if self.secure is not None:
            return {AGGREGATE: self.secure.sum_evaluation(config, replies, phase)}
        return {
            pid: EvalResult(int(m[P.CORRECT]), int(m[P.COUNT]), float(m[P.LOSS]))
            for pid, m in ((p, r[P.METRICS]) for p, r in replies.items())
        }

    def boundary_privacy(self) -> dict[str, Any] | None:
        """What ``boundary-clip`` / ``boundary-noise`` guarantee each released row's value (see
        :mod:`retexo_fl.secure.boundary_noise`), or None when rows go out as computed."""
        cfg = self.cfg
        if cfg.boundary_clip <= 0:
            return None
        return {
            "clip": cfg.boundary_clip,
            "noise": cfg.boundary_noise,
            "releases": self.boundary_releases,
            "epsilon": gaussian_epsilon(cfg.boundary_noise, self.boundary_releases, cfg.dp_delta),
            "delta": cfg.dp_delta,
            "unit": "one boundary row's value (replace-one, L2 sensitivity 2 x clip); not node-level DP",
        }

    def summary(self) -> dict[str, Any]:
        """The run summary's entries about the federation: lost clients, messages sent by type,
        privacy, transport figures."""
        names = {a: p for p, a in self.members.nodes.items()}
        return {
            "lost_clients": self.members.lost,
            "missing_payloads": self.missing_payloads,
            "messages": dict(self.messages),
            "messages_per_stage": {k: dict(v) for k, v in self.messages_per_stage.items()},
            "bytes_per_client": self.bytes_per_client(),
            "boundary_privacy": self.boundary_privacy(),
            "privacy": self.privacy.spent() if self.privacy else None,
            "secure_aggregation": self.secure.summary() if self.secure else None,
            **self.transport.report(names),
        }


def total(results: dict[int, EvalResult]) -> EvalResult:
    """The sum of per-client evaluations."""
    return EvalResult(
        sum(r.correct for r in results.values()),
        sum(r.count for r in results.values()),
        sum(r.loss_sum for r in results.values()),
    )
