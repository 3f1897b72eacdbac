"""Flower ServerApp: the lazy stage machine (setup, rounds, embed, relay, test) over the Message API."""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

from retexo_fl import protocol as P
from retexo_fl.compress.boundary import ExchangeStats
from retexo_fl.config import TrainConfig
from retexo_fl.metrics import RunRecorder, human_bytes
from retexo_fl.models.layered import LayeredGNN
from retexo_fl.training.privacy import aggregate_round, make_privacy

app = ServerApp()


def wire_bytes(msg: Message) -> int:
    """Serialized size of a message as it travels (all its content-addressed objects)."""
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    return sum(len(obj.deflate()) for obj in get_all_nested_objects(msg).values())


def payload_bytes(msg: Message) -> int:
    """Bytes of the records' contents alone."""
    return sum(record.count_bytes() for record in msg.content.values())


CHECKPOINT = "checkpoint.pt"


class ClientFailure(RuntimeError):
    """A client replied with an error or did not reply in time."""


class StageMachine:
    """Drives one lazy run over a Flower ``Grid``; the server routes payloads it never decodes."""

    def __init__(self, grid: Grid, cfg: TrainConfig, rec: RunRecorder, timeout: float | None = None) -> None:
        self.grid, self.cfg, self.rec = grid, cfg, rec
        self.timeout = cfg.client_timeout if timeout is None else timeout
        self.lost: list[dict] = []  # clients lost on the way: who, when, why
        self.privacy = make_privacy(cfg, cfg.clients)
        # Clients key their node-local state and their channel keys on this, not on Flower's
        # run id, so a resumed run (a new Flower run) finds both again.
        self.run_key = secrets.randbits(62)
        self.keys: dict[str, str] = {}
        self.checkpoint: dict = {}
        self.run_json = P.config_to_json(cfg)
        self.nodes: dict[int, int] = {}  # partition id -> node id
        self.counts: dict[int, dict] = {}
        self.bytes_boundary = 0  # relayed frames (degrees and boundary rows), headers included
        self.exchange_stats: dict[int, dict] = {}  # stage -> compression figures of its exchange
        self.model_bytes_done = 0  # model bytes of finished stages
        # (stage, message type, node id, direction) -> [messages, wire bytes, payload bytes]
        self.traffic: dict[tuple[int, str, int, str], list[int]] = {}

    # -- messaging --------------------------------------------------------------------------
    def _send(
        self, kind: str, per_node: dict[int, RecordDict], phase: str, stage: int = -1
    ) -> dict[int, Message]:
        messages = [
            Message(content, dst_node_id=node, message_type=kind) for node, content in per_node.items()
        ]
        sent = {m.metadata.dst_node_id: m for m in messages}
        by_node = self._exchange(messages)
        who = {node: pid for pid, node in self.nodes.items()}
        for node in per_node:
            name = f"client {who[node]}" if node in who else f"node {node}"
            reply = by_node.get(node)
            if reply is None:
                self._lose(
                    node, who.get(node), phase, f"{name} did not reply to {phase} within {self.timeout:.0f}s"
                )
            elif reply.has_error():
                self._lose(node, who.get(node), phase, f"{name} failed during {phase}: {reply.error.reason}")
                del by_node[node]
        for node in by_node:
            for direction, msg in (("down", sent[node]), ("up", by_node[node])):
                row = self.traffic.setdefault((stage, kind, node, direction), [0, 0, 0])
                row[0] += 1
                row[1] += wire_bytes(msg)
                row[2] += payload_bytes(msg)
        return by_node

    def _exchange(self, messages: list[Message]) -> dict[int, Message]:
        """Push ``messages`` and pull their replies until all are in or the time-out passes.

        Replies are matched to requests by ``reply_to_message_id``, so an error reply the
        SuperLink writes for a node that died (its source is the SuperLink) is that node's. The
        pull interval starts at 20 ms and backs off to 0.5 s, where Flower's own
        ``send_and_receive`` sleeps 3 s between pulls.
        """
        ids = list(self.grid.push_messages(messages))
        node_of = {mid: m.metadata.dst_node_id for mid, m in zip(ids, messages, strict=True)}
        pending, replies = set(ids), {}
        deadline, pause = time.monotonic() + self.timeout, 0.02
        while pending:
            for reply in self.grid.pull_messages(pending):
                mid = reply.metadata.reply_to_message_id
                if mid in pending:
                    pending.discard(mid)
                    replies[node_of[mid]] = reply
            if not pending or time.monotonic() >= deadline:
                break
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(0.5, pause * 1.5)
        return replies

    def _lose(self, node: int, pid: int | None, phase: str, reason: str) -> None:
        """Drop a client that timed out or failed, or end the run if the policy says so."""
        cfg = self.cfg
        required = cfg.min_clients or cfg.clients
        if pid is not None:
            self.nodes.pop(pid, None)
        left = len(self.nodes)
        halo_bound = cfg.mode != "local" and cfg.on_missing_halo == "fail"
        if required >= cfg.clients or pid is None or left < required or halo_bound:
            why = ""
            if pid is not None and required < cfg.clients and left < required:
                why = f" ({left} of {cfg.clients} clients left, min-clients {required})"
            elif pid is not None and required < cfg.clients and halo_bound:
                why = " (on-missing-halo fail: its peers would miss its boundary rows)"
            raise ClientFailure(reason + why)
        self.lost.append({"client": pid, "phase": phase, "reason": reason, "t": round(self.rec.elapsed(), 3)})
        self.rec.event("client_lost", client=pid, phase=phase, reason=reason)
        self.rec.progress(f"lost {reason}; continuing with {left} clients (min-clients {required})")

    def traffic_summary(self) -> dict:
        """Per (stage, message type, client, direction) counts, and wire / payload ratios."""
        who = {node: pid for pid, node in self.nodes.items()}
        rows = [
            {
                "stage": s,
                "message": k,
                "client": who.get(node, -1),
                "direction": d,
                "messages": n,
                "wire": w,
                "payload": p,
            }
            for (s, k, node, d), (n, w, p) in sorted(self.traffic.items())
        ]
        wire = sum(r["wire"] for r in rows)
        payload = sum(r["payload"] for r in rows)
        embed = [r for r in rows if r["message"] == P.EMBED and r["direction"] == "up"]
        embed_wire, embed_payload = sum(r["wire"] for r in embed), sum(r["payload"] for r in embed)
        return {
            "bytes_wire": wire,
            "bytes_payload": payload,
            "overhead": wire / payload if payload else None,
            "boundary_overhead": embed_wire / embed_payload if embed_payload else None,
            "by_message": rows,
        }

    def _content(
        self,
        state=None,
        payloads: ConfigRecord | None = None,
        model=None,
        by_digest: bool = False,
        **config,
    ) -> RecordDict:
        """A message's records; ``model`` (a :class:`ModelBroadcast`) sends its prepared delta
        frames instead of ``state`` when it has them. ``by_digest`` names the run config by its
        digest instead of carrying it (train messages: see :func:`retexo_fl.protocol.config_digest`)."""
        run = {P.RUN_DIGEST: P.config_digest(self.run_json)} if by_digest else {P.RUN: self.run_json}
        records = {P.CONFIG: ConfigRecord({**run, "run-key": self.run_key, **config})}
        if model is not None and model.frames is not None:
            records[P.MODEL] = ConfigRecord(model.frames)
        elif state is not None:
            records[P.ARRAYS] = ArrayRecord(state)
        if payloads is not None:
            records[P.PAYLOADS] = payloads
        return RecordDict(records)

    # -- phases -----------------------------------------------------------------------------
    def wait_for_nodes(self) -> list[int]:
        deadline = time.monotonic() + self.timeout
        while True:
            nodes = sorted(self.grid.get_node_ids())
            if len(nodes) >= self.cfg.clients:
                return nodes[: self.cfg.clients]
            if time.monotonic() > deadline:
                raise ClientFailure(f"only {len(nodes)} of {self.cfg.clients} clients connected")
            time.sleep(0.5)

    def setup(self) -> dict[int, ConfigRecord]:
        from retexo_fl.plan import check_plans

        nodes = self.wait_for_nodes()
        keys = {}
        if self.cfg.encrypt:
            # Public keys first: the setup replies already carry sealed degree frames.
            for node, reply in self._send(P.HELLO, {n: self._content() for n in nodes}, "key setup").items():
                info = reply.content[P.CONFIG]
                self._claim(int(info["partition-id"]), node)
                keys[str(int(info["partition-id"]))] = str(info["public-key"])
            self.keys = keys
            self.rec.progress(f"keys: {len(keys)} public keys collected; relaying the directory")
        replies = self._send(P.SETUP, {n: self._content(keys=json.dumps(keys)) for n in nodes}, "setup")
        digests, outgoing = {}, {}
        for node, reply in replies.items():
            info = reply.content[P.CONFIG]
            pid = int(info["partition-id"])
            if not self.cfg.encrypt:
                self._claim(pid, node)
            elif self.nodes.get(pid) != node:
                raise ClientFailure(f"node {node} claimed partition {pid} at setup, another one at key setup")
            self.counts[pid] = {
                **dict(reply.content[P.METRICS]),
                "num-classes": int(info["num-classes"]),
                "num-features": int(info["num-features"]),
            }
            digests[pid] = json.loads(str(info["digests"]))
            outgoing[pid] = reply.content[P.PAYLOADS]
        check_plans(digests)
        self.rec.progress(f"setup: {len(self.nodes)} clients, plans consistent")
        return self._route(outgoing, "deg")

    def _claim(self, pid: int, node: int) -> None:
        if pid in self.nodes and self.nodes[pid] != node:
            raise ClientFailure(f"nodes {self.nodes[pid]} and {node} both hold partition {pid}")
        self.nodes[pid] = node

    def _route(self, outgoing: dict[int, ConfigRecord], kind: str) -> dict[int, ConfigRecord]:
        """``{src: {"to-q": bytes}}`` -> ``{dst: {"<kind>-from-p": bytes}}``, counting bytes."""
        incoming = {pid: ConfigRecord() for pid in self.nodes}
        for src, record in outgoing.items():
            for key, blob in record.items():
                dst = P.parse_peer_key(key)
                if dst not in incoming:  # a client lost since: nothing to deliver to
                    continue
                incoming[dst][f"{kind}-from-{src}"] = blob
                self.bytes_boundary += len(blob)
        return incoming

    def _updates(
        self, replies: list[Message], state: dict, codec, tracker, down: int
    ) -> tuple[list[dict], int]:
        """Clients' new states from their replies (decoding compressed updates against ``state``,
        what they trained from), counting model bytes (``down`` per client for the broadcast).

        Returns the states, in ``sorted(self.nodes)`` order, and the bytes float32 would have taken.
        """
        from retexo_fl.training.aggregate import check_state, state_nbytes

        states, raw = [], 0
        for pid, m in zip(sorted(self.nodes), replies, strict=True):
            # A malformed update ends the run naming its sender before it touches the model.
            try:
                if P.UPDATE in m.content:
                    frames = {k: bytes(v) for k, v in m.content[P.UPDATE].items()}
                    new = codec.decode(frames, state, f"client {pid}")
                    up = codec.nbytes(frames)
                elif P.ARRAYS in m.content:
                    new = m.content[P.ARRAYS].to_torch_state_dict()
                    up = state_nbytes(new)
                else:
                    raise ValueError(f"update from client {pid}: the reply carries no model")
                states.append(check_state(new, state, f"client {pid}"))
            except ValueError as exc:  # PayloadError is a ValueError too
                raise ClientFailure(str(exc)) from None
            tracker.model_bytes += down + up
            raw += 2 * state_nbytes(state)
        return states, raw

    @staticmethod
    def _add_stats(stats, replies) -> None:
        """Fold the exchange figures clients reported (``P.STATS``) into ``stats``."""
        for reply in replies:
            if P.STATS in reply.content:
                stats.add(ExchangeStats.from_dict(json.loads(str(reply.content[P.STATS]["json"]))))

    def run_stage(
        self, stage: int, deliveries: dict[int, ConfigRecord] | None, resume: dict | None = None
    ) -> tuple[dict, dict]:
        """Train ``stage`` by rounds; ``resume`` (a checkpoint's stage state) continues after its round."""
        from retexo_fl.compress.updates import ModelBroadcast, UpdateCodec
        from retexo_fl.training.aggregate import ServerOptimizer
        from retexo_fl.training.client import build_stage_model, derive_seed, stage_input_dim
        from retexo_fl.training.selection import StageTracker

        cfg = self.cfg
        rounds = int(cfg.per_stage("rounds", cfg.layer(stage)))
        codec = UpdateCodec(cfg.update_bits, cfg.range_dtype)
        t0 = time.perf_counter()
        if resume is None:
            c0 = self.counts[min(self.counts)]
            in_dim = stage_input_dim(cfg, stage, c0["num-features"], c0["num-classes"])
            model = build_stage_model(cfg, stage, in_dim, c0["num-classes"])
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            lr = float(cfg.per_stage("server_lr", cfg.layer(stage)))
            server = ServerOptimizer(cfg.server_optimizer, state, lr)
            tracker = StageTracker(stage, cfg.patience)
            tracker.bytes_offset = self.bytes_boundary + self.model_bytes_done
            broadcast = ModelBroadcast(
                cfg.broadcast_bits, cfg.range_dtype, derive_seed(cfg.seed, stage, 0xBC)
            )
            view = broadcast.prepare(state, 1)
            train_loss, model_raw, start = 0.0, 0, 1
        else:
            state, view, server = resume["state"], resume["view"], resume["server"]
            tracker, broadcast = resume["tracker"], resume["broadcast"]
            train_loss, model_raw, start = resume["train_loss"], resume["model_raw"], resume["round"] + 1
            t0 -= resume["seconds"]
        for r in range(start, rounds + 1):
            first = r == 1 and deliveries
            contents = {
                self.nodes[pid]: self._content(
                    view,
                    deliveries.get(pid) if first else None,
                    model=broadcast,
                    by_digest=True,
                    stage=stage,
                    round=r,
                    validate=r > 1,
                )
                for pid in self.nodes
            }
            replies = self._send(P.TRAIN, contents, f"stage {stage} round {r}", stage)
            ordered = [replies[self.nodes[pid]] for pid in sorted(self.nodes)]
            metrics = [dict(m.content[P.METRICS]) for m in ordered]
            if r > 1:  # each reply validated the state it received: the previous round's average
                self._record(tracker, r - 1, view, metrics, train_loss)
                if tracker.should_stop:
                    break
            weights = [m["num-examples"] for m in metrics]
            train_loss = sum(m["train-loss"] * w for m, w in zip(metrics, weights, strict=True)) / sum(
                weights
            )
            states, raw = self._updates(ordered, view, codec, tracker, broadcast.nbytes())
            model_raw += raw
            state = server.step(aggregate_round(state, view, states, weights, self.privacy, (stage, r)))
            view = broadcast.prepare(state, r + 1)
            if line := tracker.progress_line(r, rounds):
                self.rec.progress(line)
            self.checkpoint.update(
                deliveries=None,  # delivered with round 1
                stage_state={
                    "round": r,
                    "state": state,
                    "view": view,
                    "server": server,
                    "tracker": tracker,
                    "broadcast": broadcast,
                    "train_loss": train_loss,
                    "model_raw": model_raw,
                    "seconds": time.perf_counter() - t0,
                },
            )
            self._save_checkpoint()
        else:  # the last (or only) state still needs its validation
            correct, count, _ = self.evaluate(view, "val", stage)
            self._record(tracker, rounds, view, [{"val-correct": correct, "val-count": count}], train_loss)
        figures = tracker.figures(time.perf_counter() - t0)
        figures["bytes_model_raw"] = model_raw
        return tracker.best_state, figures

    def _record(self, tracker, round_: int, state: dict, metrics: list[dict], train_loss: float) -> None:
        if self.cfg.mode in ("eager", "local"):
            tracker.bytes_offset = self.bytes_boundary
        count = sum(m["val-count"] for m in metrics)
        acc = sum(m["val-correct"] for m in metrics) / count if count else 0.0
        tracker.record(round_, state, acc, train_loss=train_loss)
        self.rec.event("round", stage=tracker.stage, round=round_, train_loss=train_loss, val_accuracy=acc)

    def evaluate(
        self, state: dict, split: str, stage: int, deliveries: dict[int, ConfigRecord] | None = None
    ) -> tuple[int, int, float]:
        contents = {
            self.nodes[pid]: self._content(
                state, deliveries.get(pid) if deliveries else None, split=split, stage=stage
            )
            for pid in self.nodes
        }
        replies = self._send(P.EVALUATE, contents, f"{split} evaluation", stage)
        ms = [dict(r.content[P.METRICS]) for r in replies.values()]
        return sum(m["correct"] for m in ms), sum(m["count"] for m in ms), sum(m["loss"] for m in ms)

    def embed(self, state: dict, stage: int) -> dict[int, ConfigRecord]:
        replies = self._send(
            P.EMBED,
            {self.nodes[p]: self._content(state, stage=stage) for p in self.nodes},
            f"stage {stage} embed",
            stage,
        )
        stats = ExchangeStats()
        self._add_stats(stats, replies.values())
        self.exchange_stats[stage] = stats
        who = {node: pid for pid, node in self.nodes.items()}
        return self._route({who[n]: r.content[P.PAYLOADS] for n, r in replies.items()}, "halo")

    def run(self) -> dict:
        from retexo_fl.training.lazy import compression_totals, exchange_figures

        t0 = time.perf_counter()
        if self.cfg.resume:
            self._resume()
        else:
            degrees = self.setup()
            self.checkpoint = {
                "stage": 0,
                "before": self.bytes_boundary,
                "deliveries": None,
                "degrees": degrees,
            }
            self.checkpoint.update(stages=[], stage_state=None)
            self._save_checkpoint()
        ck = self.checkpoint
        stages, state = ck["stages"], {}
        last = self.cfg.total_stages - 1
        for stage in range(ck["stage"], last + 1):
            state, figures = self.run_stage(stage, ck["deliveries"], ck["stage_state"])
            self.model_bytes_done += figures["bytes_model"]
            deliveries = None
            if stage < last:
                # Clients embed, or after a pass's last stage label their own nodes (nothing to relay).
                deliveries = self.embed(state, stage)
                if self.cfg.ends_pass(stage):
                    deliveries = None
                    self.rec.progress(f"self-training pass {stage // self.cfg.stages + 1} begins")
                if stage == 0 and deliveries is not None:  # degrees go with the first conv stage's rows
                    for pid, rec in (ck.pop("degrees", None) or {}).items():
                        if pid in deliveries:  # else lost since setup
                            for k, v in rec.items():
                                deliveries[pid][k] = v
            figures["bytes_boundary"] = self.bytes_boundary - ck["before"]
            if stage in self.exchange_stats:
                figures.update(exchange_figures(self.exchange_stats[stage]))
            stages.append(figures)
            self.rec.progress(
                f"stage {stage} done: best val {figures['val_accuracy']:.4f} at round "
                f"{figures['best_round']}, boundary so far {human_bytes(self.bytes_boundary)}"
            )
            ck.update(stage=stage + 1, before=self.bytes_boundary, deliveries=deliveries, stage_state=None)
            self._save_checkpoint()
        correct, count, _ = self.evaluate(state, "test", last)
        bytes_model = sum(s["bytes_model"] for s in stages)
        return {
            **compression_totals(stages),
            "mode": "lazy",
            "engine": "flower",
            "test_accuracy": correct / count if count else 0.0,
            "val_accuracy": stages[-1]["val_accuracy"],
            "bytes_total": self.bytes_boundary + bytes_model,
            "bytes_boundary": self.bytes_boundary,
            "bytes_model": bytes_model,
            "lost_clients": self.lost,
            "privacy": self.privacy.spent() if self.privacy else None,
            "traffic": self.traffic_summary(),
            "stages": stages,
            "wall_seconds": time.perf_counter() - t0,
            "config": self.cfg.to_dict(),
            "resumed": bool(self.cfg.resume),
        }

    # -- checkpoint and resume --------------------------------------------------------------
    def _save_checkpoint(self) -> None:
        """Persist the stage machine (after setup, every round and every exchange), atomically."""
        if not self.cfg.out_dir:
            return
        plain = {  # relayed ciphertext, as plain bytes
            k: None if self.checkpoint.get(k) is None else {p: dict(r) for p, r in self.checkpoint[k].items()}
            for k in ("deliveries", "degrees")
        }
        ck = {
            **self.checkpoint,
            **plain,
            "run_key": self.run_key,
            "config": self.cfg.to_dict(),
            "nodes": sorted(self.nodes),
            "keys": self.keys,
            "counts": self.counts,
            "lost": self.lost,
            "bytes_boundary": self.bytes_boundary,
            "model_bytes_done": self.model_bytes_done,
            "exchange_stats": self.exchange_stats,
            "traffic": self.traffic,
            "privacy": self.privacy,
        }
        path = Path(self.cfg.out_dir) / CHECKPOINT
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(ck, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").replace(path)

    def _resume(self) -> None:
        """Load ``resume``'s checkpoint and find the surviving clients again on this run's nodes."""
        path = Path(self.cfg.resume) / CHECKPOINT
        if not path.is_file():
            raise ValueError(f"{path}: no checkpoint to resume from (the run folder of a lazy run)")
        # Our own file, written by _save_checkpoint: it holds optimizer and tracker objects.
        ck = torch.load(path, weights_only=False)
        for key in ("run_key", "keys", "counts", "lost", "bytes_boundary", "model_bytes_done"):
            setattr(self, key, ck.pop(key))
        self.exchange_stats, self.traffic, self.privacy = (
            ck.pop("exchange_stats"),
            ck.pop("traffic"),
            ck.pop("privacy"),
        )
        wanted = ck.pop("nodes")
        ck.pop("config")
        for k in ("deliveries", "degrees"):
            if ck.get(k) is not None:
                ck[k] = {p: ConfigRecord(r) for p, r in ck[k].items()}
        self.checkpoint = ck
        self.run_json = P.config_to_json(self.cfg)
        nodes = self.wait_for_nodes()
        for node, reply in self._send(P.HELLO, {n: self._content() for n in nodes}, "resume").items():
            info = reply.content[P.CONFIG]
            pid = int(info["partition-id"])
            if pid not in wanted:
                continue  # lost before the checkpoint: stays lost
            if self.keys and self.keys.get(str(pid)) != str(info["public-key"]):
                raise ClientFailure(f"client {pid} came back with another key: its saved state is gone")
            self._claim(pid, node)
        missing = sorted(set(wanted) - set(self.nodes))
        if missing:
            raise ClientFailure(f"clients {missing} did not come back to resume the run")
        where = f"stage {ck['stage']}" + (
            f" after round {ck['stage_state']['round']}" if ck.get("stage_state") else ""
        )
        self.rec.progress(f"resumed {self.cfg.resume} at {where} with {len(self.nodes)} clients")


class RoundMachine(StageMachine):
    """Eager and local baselines over a Flower ``Grid``: one ``train`` message per round.

    Round ``r`` carries the global state and the boundary frames peers computed in round ``r - 1``;
    each client validates the state, sends this round's frames and its update back in one reply.
    """

    def run(self) -> dict:
        from retexo_fl.compress.updates import ModelBroadcast, UpdateCodec
        from retexo_fl.training.aggregate import ServerOptimizer
        from retexo_fl.training.client import derive_seed
        from retexo_fl.training.lazy import compression_totals, exchange_figures
        from retexo_fl.training.selection import StageTracker

        cfg = self.cfg
        mode = cfg.mode
        t0 = time.perf_counter()
        deliveries = self.setup()  # degrees (eager GCN) ride with round 1
        c0 = self.counts[min(self.counts)]
        torch.manual_seed(derive_seed(cfg.seed, 0xE0))
        model = LayeredGNN(
            cfg.model,
            c0["num-features"],
            cfg.hidden,
            c0["num-classes"],
            layers=cfg.stages,
            dropout=float(cfg.per_stage("dropout", 1)),
            norm=cfg.norm,
            heads=cfg.heads,
        )
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        server = ServerOptimizer(cfg.server_optimizer, state, float(cfg.per_stage("server_lr", 1)))
        codec = UpdateCodec(cfg.update_bits, cfg.range_dtype)
        broadcast = ModelBroadcast(cfg.broadcast_bits, cfg.range_dtype, derive_seed(cfg.seed, 0xBC))
        view = broadcast.prepare(state, 1)
        rounds = int(cfg.per_stage("rounds", 1))
        tracker = StageTracker(0, cfg.patience)
        stats, model_raw, steps, train_loss = ExchangeStats(), 0, [], 0.0
        for r in range(1, rounds + 1):
            pids = sorted(self.nodes)
            contents = {
                self.nodes[pid]: self._content(
                    view,
                    deliveries.get(pid) if deliveries else None,
                    model=broadcast,
                    by_digest=True,
                    stage=0,
                    round=r,
                    validate=r > 1,
                )
                for pid in pids
            }
            replies = self._send(P.TRAIN, contents, f"{mode} round {r}", 0)
            pids = sorted(self.nodes)  # without any client lost in this round
            ordered = [replies[self.nodes[pid]] for pid in pids]
            metrics = [dict(m.content[P.METRICS]) for m in ordered]
            if r > 1:  # each reply validated the state it received, with the halo it was delivered
                self._record(tracker, r - 1, view, metrics, train_loss)
                if tracker.should_stop:
                    deliveries = None
                    break
            steps.append([int(m["local-steps"]) for m in metrics])
            self._add_stats(stats, ordered)
            outgoing = {
                pid: m.content[P.PAYLOADS]
                for pid, m in zip(pids, ordered, strict=True)
                if P.PAYLOADS in m.content
            }
            deliveries = self._route(outgoing, "halo") if outgoing else None
            weights = [m["num-examples"] for m in metrics]
            train_loss = sum(m["train-loss"] * w for m, w in zip(metrics, weights, strict=True)) / sum(
                weights
            )
            states, raw = self._updates(ordered, view, codec, tracker, broadcast.nbytes())
            model_raw += raw
            state = server.step(aggregate_round(state, view, states, weights, self.privacy, (0, r)))
            view = broadcast.prepare(state, r + 1)
            if line := tracker.progress_line(r, rounds):
                self.rec.progress(f"{mode} {line} boundary so far {human_bytes(self.bytes_boundary)}")
        else:  # the last state's validation, with the last round's halo rows delivered
            correct, count, _ = self.evaluate(view, "val", 0, deliveries)
            self._record(tracker, rounds, view, [{"val-correct": correct, "val-count": count}], train_loss)
        figures = tracker.figures(time.perf_counter() - t0)
        figures.update(
            bytes_boundary=self.bytes_boundary, bytes_model_raw=model_raw, **exchange_figures(stats)
        )
        correct, count, _ = self.evaluate(tracker.best_state, "test", 0)
        return {
            **compression_totals([figures]),
            "mode": mode,
            "engine": "flower",
            "test_accuracy": correct / count if count else 0.0,
            "val_accuracy": figures["val_accuracy"],
            "bytes_total": self.bytes_boundary + figures["bytes_model"],
            "bytes_boundary": self.bytes_boundary,
            "bytes_model": figures["bytes_model"],
            "local_steps": steps,
            "lost_clients": self.lost,
            "privacy": self.privacy.spent() if self.privacy else None,
            "traffic": self.traffic_summary(),
            "stages": [figures],
            "wall_seconds": time.perf_counter() - t0,
            "config": cfg.to_dict(),
        }


def resumed_config(cfg: TrainConfig) -> TrainConfig:
    """The configuration of the run in ``cfg.resume``, set to resume it in that folder."""
    path = Path(cfg.resume) / "config.json"
    if not path.is_file():
        raise ValueError(f"{path}: not a run folder (no config.json); resume needs the --out of a lazy run")
    values = json.loads(path.read_text())
    values.pop("extra", None)
    resumed = TrainConfig.from_mapping({**values, "resume": str(cfg.resume), "out_dir": str(cfg.resume)})
    if resumed.mode != "lazy":
        raise ValueError(f"{cfg.resume}: resume continues lazy runs; this one is {resumed.mode}")
    return resumed


def run_server(grid: Grid, cfg: TrainConfig) -> dict:
    """Run a job on ``grid`` (or resume the one in ``cfg.resume``) and write the run folder."""
    if cfg.resume:
        cfg = resumed_config(cfg)
    rec = RunRecorder(cfg.out_dir or None, append=bool(cfg.resume))
    if not cfg.resume:
        rec.write_json("config.json", cfg.to_dict())
    if cfg.mode == "centralized":
        raise ValueError(
            "centralized mode trains on one graph in process; the Flower app runs lazy, eager, local"
        )
    machine = RoundMachine if cfg.mode in ("eager", "local") else StageMachine
    summary = machine(grid, cfg, rec).run()
    rec.write_json("summary.json", summary)
    if cfg.out_dir:
        from retexo_fl.plots import write_plots

        write_plots(summary, cfg.out_dir)
    rec.progress(
        f"test accuracy {summary['test_accuracy']:.4f}  boundary {human_bytes(summary['bytes_boundary'])}"
        f"  model {human_bytes(summary['bytes_model'])}  in {summary['wall_seconds']:.1f}s"
    )
    return summary


@app.main()
def main(grid: Grid, context: Context) -> None:
    run_server(grid, TrainConfig.from_mapping(dict(context.run_config)))
