"""Flower ClientApp: one handler per message type, each a thin adapter over the LazyClient."""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode

from retexo_fl import protocol as P
from retexo_fl.compress.boundary import ExchangeStats


def _who(context: Context) -> str:
    if "partition-id" in context.node_config:
        return f"client {context.node_config['partition-id']}"
    return f"client at {context.node_config.get('partition-dir', f'node {context.node_id}')}"


def report_errors(msg: Message, context: Context, call_next) -> Message:
    """Reply to any failure with a one-line reason that names this client, not a traceback."""
    try:
        return call_next(msg, context)
    except Exception as exc:  # every failure must reach the server as a reply
        reason = f"{_who(context)}: {type(exc).__name__}: {exc}"
        return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=msg)


def _plain(content: RecordDict) -> dict[str, dict]:
    """A reply's records as plain values: arrays as NumPy, frames as bytes."""
    out: dict[str, dict] = {}
    for name, record in content.items():
        if isinstance(record, ArrayRecord):
            out[name] = {k: v.numpy() for k, v in record.to_torch_state_dict().items()}
        else:
            out[name] = dict(record)
    return out


def audit_messages(msg: Message, context: Context, call_next) -> Message:
    """With ``audit`` (or node config ``audit-dir``) set, record every reply this client sends."""
    reply = call_next(msg, context)
    if reply.has_error():
        return reply
    # The handler has just built or restored this client: look it up, do not restore it again.
    client = _CACHE[_cache_key(msg, context)]
    cfg = client.cfg
    folder = context.node_config.get("audit-dir") or cfg.audit
    if folder:
        from retexo_fl.secure.audit import AuditLog

        log = AuditLog(str(folder), client.id, str(_partition_dir(context, cfg)), cfg.encrypt)
        log.record(msg.metadata.message_type, _plain(reply.content))
    return reply


app = ClientApp(mods=[report_errors, audit_messages])

# Ray actors serve several virtual nodes and keep Python state between messages; a deployed
# ClientApp is a new process per message and falls back to the node-local work directory.
_CACHE: dict[tuple[int, str], object] = {}


def _work_dir(context: Context, run_id: int, pid_hint: str) -> Path:
    base = context.node_config.get("work-dir") or str(Path(tempfile.gettempdir()) / "retexo-fl")
    return Path(str(base)) / f"run-{run_id}" / f"node-{pid_hint}"


def _partition_dir(context: Context, cfg) -> Path:
    """Where this node's partition lives: given, written earlier, or this run's cached cut."""
    if "partition-dir" in context.node_config:
        return Path(str(context.node_config["partition-dir"]))
    pid = int(context.node_config["partition-id"])
    if cfg.partitions:  # simulation over partitions written earlier by `retexo-fl partition`
        return Path(cfg.partitions) / f"part-{pid}"
    key = json.dumps([cfg.dataset, cfg.split, cfg.split_index, cfg.method, cfg.clients, cfg.seed])
    cache = (
        Path(tempfile.gettempdir())
        / "retexo-fl"
        / "partitions"
        / hashlib.sha256(key.encode()).hexdigest()[:16]
    )
    return cache / f"part-{pid}"


def _load_partition(context: Context, cfg, work: Path):
    from retexo_fl.data.partition import load_partition, save_partition

    part_dir = _partition_dir(context, cfg)
    if "partition-dir" in context.node_config or cfg.partitions or (part_dir / "manifest.json").is_file():
        return load_partition(part_dir, stamp=work / "partition-verified.json")
    # Simulation: every virtual node cuts the same dataset deterministically and keeps its part.
    from retexo_fl.data.partitioners import partition_graph
    from retexo_fl.runner import load_graph

    pid = int(context.node_config["partition-id"])
    parts = partition_graph(load_graph(cfg), cfg.clients, cfg.method, seed=cfg.seed)
    save_partition(parts[pid], part_dir)
    return parts[pid]


def _run_key(msg: Message) -> int:
    """The server's key for this run: it outlives Flower's run id when a run is resumed."""
    return int(msg.content[P.CONFIG].get("run-key", msg.metadata.run_id))


def _cache_key(msg: Message, context: Context) -> tuple[int, str]:
    """(run key, node) of this node's client in this run: its cache slot and work folder."""
    return _run_key(msg), str(context.node_config.get("partition-id", context.node_id))


def _run_config(msg: Message, context: Context):
    """The run config: in the message, or, for a train message that names it by digest, the one
    the node kept from an earlier message of this run (in its work folder: a deployed ClientApp
    is a new process per message)."""
    config = msg.content[P.CONFIG]
    path = _work_dir(context, *_cache_key(msg, context)) / "run-config.json"
    if P.RUN in config:
        text = str(config[P.RUN])
        if not path.is_file() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.with_suffix(".tmp").write_text(text)
            path.with_suffix(".tmp").replace(path)
        return P.config_from_json(text)
    digest = str(config.get(P.RUN_DIGEST, ""))
    if not path.is_file():
        raise ValueError(
            f"a {msg.metadata.message_type} message names run config {digest!r}, "
            f"but this node holds none for run key {_run_key(msg)} (it missed key setup and setup)"
        )
    text = path.read_text()
    if P.config_digest(text) != digest:
        raise ValueError(
            f"a {msg.metadata.message_type} message names run config {digest!r}; "
            f"this node holds {P.config_digest(text)!r} ({path})"
        )
    return P.config_from_json(text)


def _client(msg: Message, context: Context):
    from retexo_fl.training.client import LazyClient
    from retexo_fl.training.eager import EagerClient

    cfg = _run_config(msg, context)
    key = _cache_key(msg, context)
    work = _work_dir(context, *key)
    client = _CACHE.get(key)
    if client is None:
        part = _load_partition(context, cfg, work)
        if cfg.mode in ("eager", "local"):
            client = EagerClient(part, cfg, local=cfg.mode == "local")
        else:
            client = LazyClient(part, cfg)
        for old in [k for k in _CACHE if k[0] != key[0]]:  # drop earlier runs' tensors
            del _CACHE[old]
        _CACHE[key] = client
    # Another Ray actor may have advanced this node since: the saved stage inputs are the truth
    # (a cheap load; the partition and local graph stay cached).
    client.restore(work)
    return client, work


def _state(msg: Message):
    return {k: v.clone() for k, v in msg.content[P.ARRAYS].to_torch_state_dict().items()}


def _deliver(client, msg: Message) -> bool:
    """Apply halo rows and degrees delivered with this message; True if anything arrived."""
    if P.PAYLOADS not in msg.content:
        return False
    payloads = msg.content[P.PAYLOADS]
    degrees, halo = {}, {}
    for key, blob in payloads.items():
        kind, src = key.split("-from-")
        (degrees if kind == "deg" else halo)[int(src)] = blob
    if degrees:
        client.receive_degrees(client.decode_degrees(degrees))
    if hasattr(client, "receive_boundary"):  # eager: every layer's halo, refreshed each round
        client.receive_boundary(halo)
    else:  # lazy: deliveries come with the first round of every stage >= 1, also when empty
        client.receive_halo(client.decode_boundary(halo))
    return True


def _identity(context: Context) -> str:
    """A deployed party's long-term identity key (node config ``identity-key``), if it has one."""
    return str(context.node_config.get("identity-key", ""))


@app.query("hello")
def hello(msg: Message, context: Context) -> Message:
    client, work = _client(msg, context)
    public = client.public_key(_identity(context))
    client.save(work)  # the private key stays in the node-local work directory
    info = ConfigRecord({"partition-id": client.id, "public-key": public.hex()})
    return Message(RecordDict({P.CONFIG: info}), reply_to=msg)


@app.query("setup")
def setup(msg: Message, context: Context) -> Message:
    client, work = _client(msg, context)
    if client.cfg.encrypt:
        from retexo_fl.secure.keys import parse_public

        keys = json.loads(str(msg.content[P.CONFIG]["keys"]))
        directory = {int(q): parse_public(k, f"key directory, client {q}") for q, k in keys.items()}
        client.public_key(_identity(context))
        client.connect(directory, _run_key(msg))
    payloads = ConfigRecord()
    if client.cfg.model == "gcn":
        for q, frame in client.degree_frames().items():
            payloads[P.peer_key("to", q)] = frame
    client.save(work)
    info = ConfigRecord(
        {
            "partition-id": client.id,
            "num-classes": client.part.num_classes,
            "num-features": client.part.num_features,
            "digests": json.dumps(client.plan.digests()),
        }
    )
    counts = MetricRecord({k: int(v) for k, v in client.part.counts().items()})
    return Message(RecordDict({P.CONFIG: info, P.METRICS: counts, P.PAYLOADS: payloads}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    from retexo_fl.training.client import EvalResult

    client, work = _client(msg, context)
    delivered = _deliver(client, msg)
    if P.MODEL in msg.content:  # a compressed broadcast: a delta from the model held since
        frames_in = {k: bytes(v) for k, v in msg.content[P.MODEL].items()}
        state = client.receive_model(None, frames_in)
    else:
        state = client.receive_model(_state(msg), None)
    config = msg.content[P.CONFIG]
    # The server asks to validate the state it sends, except a stage's initial weights.
    val = client.evaluate(state, "val") if bool(config.get("validate", True)) else EvalResult(0, 0, 0.0)
    round_ = int(config["round"])
    records = {}
    if hasattr(client, "boundary_rows"):  # eager: this round's embeddings go to the peers' next round
        rows = client.boundary_rows(state)
        sent, stats = client.encode_rows_for_round(rows, round_) if rows else ({}, None)
        records[P.PAYLOADS] = ConfigRecord({P.peer_key("to", q): f for q, f in sent.items()})
        if stats is not None:
            records[P.STATS] = ConfigRecord({"json": json.dumps(stats.to_dict())})
    new_state, loss = client.train(state, round_)
    frames = client.encode_update(new_state, state, round_)
    if delivered or frames is not None or client.cfg.broadcast_bits < 32:  # halo, residual or view
        client.save(work)
    metrics = MetricRecord(
        {
            "num-examples": client.num_train,
            "train-loss": loss,
            "val-correct": val.correct,
            "val-count": val.count,
            "val-loss": val.loss_sum,
            "local-steps": getattr(client, "last_steps", 0),
        }
    )
    update = {P.ARRAYS: ArrayRecord(new_state)} if frames is None else {P.UPDATE: ConfigRecord(frames)}
    return Message(RecordDict({**update, **records, P.METRICS: metrics}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    client, work = _client(msg, context)
    if _deliver(client, msg):  # eager: the last round's halo rows come with the final evaluation
        client.save(work)
    result = client.evaluate(_state(msg), str(msg.content[P.CONFIG]["split"]))
    metrics = MetricRecord({"correct": result.correct, "count": result.count, "loss": result.loss_sum})
    return Message(RecordDict({P.METRICS: metrics}), reply_to=msg)


@app.query("embed")
def embed(msg: Message, context: Context) -> Message:
    client, work = _client(msg, context)
    stage = int(msg.content[P.CONFIG]["stage"])
    if client.sent is not None and client.sent[0] == stage:  # asked again by a resumed server
        frames, stats = client.sent[1], ExchangeStats.from_dict(client.sent[2])
    else:
        frames, stats = client.encode_boundary(client.next_stage(_state(msg)))
        client.sent = (stage, frames, stats.to_dict())
        client.save(work)
    payloads = ConfigRecord({P.peer_key("to", q): frame for q, frame in frames.items()})
    figures = ConfigRecord({"json": json.dumps(stats.to_dict())})
    return Message(RecordDict({P.PAYLOADS: payloads, P.STATS: figures}), reply_to=msg)
