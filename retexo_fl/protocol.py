"""The wire vocabulary both Flower apps and the in-process engine speak.

Every message type, record name, config key, metric name, node-config key and payload-key format
is a constant or a function here, so that ``server/``, ``clients/`` and the library's stage
machine never spell one twice. A message travels as :data:`Records`: record name -> a plain
mapping (a state dict for :data:`ARRAYS`, scalars for :data:`CONFIG` and :data:`METRICS`, bytes
for frames). ``server/`` and ``clients/`` turn that into Flower records and back; the in-process
transport hands it to the client handlers as it is.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from retexo_fl.config import TrainConfig

# Message types (Flower requires train / evaluate / query, optionally with .<name>).
HELLO = "query.hello"  # encryption on: report the partition id and this client's public key
SETUP = "query.setup"  # load and validate the partition; report counts, plan digests, degrees
TRAIN = "train"  # validate the incoming state, then train on it; may carry halo deliveries
EVALUATE = "evaluate"  # validation (or test) metrics of one state
EMBED = "query.embed"  # compute the stage's embeddings with the kept state; return boundary rows
UNMASK = "query.unmask"  # secure aggregation: shares and pair seeds that unmask a round's sum
MESSAGE_TYPES = (HELLO, SETUP, TRAIN, EVALUATE, EMBED, UNMASK)

# Record names.
CONFIG = "config"  # run config (RUN or RUN_DIGEST), RUN_KEY, STAGE, ROUND, SPLIT, ... ; replies: identity
RUN = "run"  # in CONFIG: the run config JSON, on every message type but train
RUN_DIGEST = "run-digest"  # in CONFIG of train messages: config_digest() of the config sent before
ARRAYS = "arrays"  # the stage model's state (a whole state dict)
METRICS = "metrics"  # counts, losses, accuracies
PAYLOADS = "payloads"  # outgoing_key(q) (replies) or delivery_key(kind, p) (requests) -> bytes
STATS = "stats"  # a client's exchange figures (bytes before / after, widths) as JSON in STATS_JSON
MISSING = "missing"  # replies: expected payloads not delivered, JSON [[kind, stage, src]] in STATS_JSON
MODEL = "model"  # tensor name -> broadcast delta frame (broadcast-bits < 32)
MODEL_BEFORE = "model-before"  # chain_key(step, name) -> the deltas a client missed, applied before MODEL's
UPDATE = "update"  # tensor name -> compressed update frame (update-bits < 32)
CONTROL = "control"  # train, drift-correction scaffold: the server's control variate (a state dict)
MASKED = "masked"  # train replies, secure aggregation: VECTOR and outgoing_key(q) -> sealed share
SHARES = "shares"  # unmask requests: share_key(src) -> the share src sealed to the recipient
UNMASKED = "unmasked"  # unmask replies: share-<j> -> share of j's self seed, seed-<d> -> pair seed
CONTROL_FRAMES = "control-frames"  # ... or its change since the last round as delta frames (broadcast-bits)
#: Records whose values are tensors (Flower: ``ArrayRecord``); every other record holds scalars or bytes.
ARRAY_RECORDS = (ARRAYS, CONTROL)

# Keys of the CONFIG record.
SECAGG_MEMBERS = "secagg-members"  # train, secure aggregation: JSON list of the round's masking set
SECAGG_THRESHOLD = "secagg-threshold"  # ... the shares that rebuild a self seed
SECAGG_BOUND = "secagg-weight-bound"  # ... the count a training weight is divided by
# ... update-bits < 32, rounds after a stage's first: the shared grid's per-row clips, float32
# little-endian in the update's order (the masked update then travels in narrow lanes)
SECAGG_GRID = "secagg-grid"
# evaluate, secure aggregation: the server's evaluation counter (masks of two evaluations never
# repeat); SECAGG_MEMBERS, SECAGG_BOUND as for train
SECAGG_EVAL = "secagg-evaluation"
SECAGG_SURVIVORS = "secagg-survivors"  # unmask: JSON list of the members whose masked vectors arrived
VECTOR = "vector"  # in MASKED: the packed masked vector
RUN_KEY = "run-key"  # the server's key for this run; it outlives Flower's run id on resume
STAGE = "stage"
# train, evaluate and embed (first-stage auto): what a layer-0 stage is built as, mlp or local
# (stage 0 is trained both ways; later messages name the one the server kept)
FIRST_STAGE = "first-stage"
# train (first-stage auto, trained in parallel): the layer-0 variants one message trains, in order,
# comma-separated; each variant's own records travel as lane_record(variant, name), its CONFIG
# among them (see join_lanes / split_lanes), and the reply answers each the same way.
LANES = "lanes"
ROUND = "round"
VALIDATE = "validate"  # train: validate the received state first (all but a stage's first round)
# train (lazy, plain FedAvg): the recipient holds no training nodes; it validates only and replies
# with its validation figures and no update.
VALIDATE_ONLY = "validate-only"
# train and evaluate (broadcast-bits < 32): the model held before this message's delta is the
# stage's best so far; the client keeps a copy, so that the kept state never travels again.
KEEP = "keep"
# evaluate and embed (broadcast-bits < 32), instead of ARRAYS: the state_digest() of a state the
# client holds (its view, or the copy KEEP made); a client that holds none answers NOT_HELD.
HELD = "held"
SPLIT = "split"  # evaluate: "val" or "test"; embed: "test", the kept state's test before it embeds
# embed (self-training): the embedded state validates best of the run so far; the client keeps its
# predictions of its own nodes, and the next pass's end labels from them (not from the pass's
# last stage, which may validate worse: its labels would put its errors on the test nodes).
TEACHER = "teacher"
# evaluate (eager): after evaluating, reply with the rows of the received state for the peers
# (sealed with ROUND), so that halos computed from later states are refreshed from it.
REFRESH = "refresh"
KEYS = "keys"  # setup: JSON {client id: public key hex}, the key directory
PARTITION_ID = "partition-id"  # replies to hello and setup: which partition this client holds
PUBLIC_KEY = "public-key"  # reply to hello: X25519 public key, hex
CONTRIBUTION = "contribution"  # reply to hello: the client's random transcript contribution, hex
CONTRIBUTIONS = "contributions"  # setup: JSON {client id: contribution hex}, relayed
PINS = "pins"  # setup: the digest of the pin set the run config names (retexo_fl.secure.keys.pin_digest)
NUM_CLASSES = "num-classes"
NUM_FEATURES = "num-features"
DIGESTS = "digests"  # reply to setup: JSON of the boundary plan's digests
STATS_JSON = "json"  # the one key of the STATS record

# Keys of the METRICS record.
NUM_EXAMPLES = "num-examples"  # train: training nodes, the aggregation weight
TRAIN_LOSS = "train-loss"
VAL_CORRECT = "val-correct"
VAL_COUNT = "val-count"
VAL_LOSS = "val-loss"
LOCAL_STEPS = "local-steps"  # train: steps taken (time-based rounds take as many as fit)
CORRECT = "correct"  # evaluate
NOT_HELD = "not-held"  # evaluate and embed replies: no state with the HELD digest; send it whole
COUNT = "count"
LOSS = "loss"

# Node config keys (a party's own settings, never the server's).
NODE_PARTITION_ID = "partition-id"  # simulation: which partition this virtual node cuts and holds
NODE_PARTITION_DIR = "partition-dir"  # deployed: the folder of this node's fixed partition
NODE_WORK_DIR = "work-dir"  # node-local state between messages (default: the temp folder)
NODE_IDENTITY_KEY = "identity-key"  # deployed: this party's long-term X25519 private key file
NODE_AUDIT_DIR = "audit-dir"  # record every reply this node sends (retexo-fl audit)
NODE_WORKER = "worker"  # set by `retexo-fl supernode`: the node worker's folder (socket, secret)
NODE_ENCRYPT = "encrypt"  # policy: require sealed payloads (default true; false allows plaintext)
NODE_PINNED_KEYS = "pinned-keys"  # policy: the pins this party got out of band (JSON file)
NODE_MIN_DP_NOISE = "min-dp-noise"  # policy: the least update DP noise multiplier accepted
NODE_MAX_DP_CLIP = "max-dp-clip"  # policy: with min-dp-noise, the largest clipping norm accepted
NODE_MIN_BOUNDARY_NOISE = "min-boundary-noise"  # policy: the least noise on released boundary rows
NODE_MAX_BOUNDARY_EPSILON = "max-boundary-epsilon"  # policy: the party's own budget over its row releases
NODE_SECURE_AGGREGATION = "secure-aggregation"  # policy: require masked round replies

# Kinds of relayed frames (delivery keys and the envelopes' associated data).
DEGREES = "deg"
HALO = "halo"
EAGER = "eager"

Records = dict[str, dict[str, Any]]
"""A message's content: record name -> mapping (see the record names above)."""


def config_to_json(cfg: TrainConfig) -> str:
    """The run config as it travels in :data:`RUN`."""
    return json.dumps(cfg.to_dict())


def config_digest(run_json: str) -> str:
    """What a train message carries instead of the run config: its SHA-256, 16 bytes in hex.

    The config is about a kilobyte of JSON; every client gets a train message every round, and
    with a small model (16 hidden units, 4-bit deltas) it was 64% of a conv stage's train
    payload. The client keeps the config the hello / setup messages brought and checks it
    against this.

    Args:
        run_json (str): :func:`config_to_json` of the run's config.
    """
    return hashlib.sha256(run_json.encode()).hexdigest()[:32]


#: Settings only the server reads, which a resumed run sets to its own folder: left out of the
#: config a client binds at setup (:func:`client_config_digest`).
SERVER_ONLY_SETTINGS = ("resume", "out_dir")


def client_config_digest(cfg: TrainConfig) -> str:
    """The digest of ``cfg`` as a client trains by it (:data:`SERVER_ONLY_SETTINGS` left out),
    which setup binds into the run transcript and the client holds to for the rest of the run.

    A client rebuilt from a message (a deployed ClientApp is a new process per message, a node
    worker drops an idle run) takes that message's run config: were a later config not checked
    against this one, a server could hand every member of a masked round but one a learning
    rate of 0, and the masked sum would be that one member's update.

    Settings at their declared default are left out too: a run resumed by a newer release, whose
    config holds a setting the run's start did not know (at its default, as ``resumed_config``
    fills it), still has the digest its clients bound.

    Args:
        cfg (TrainConfig): the run config.
    """
    global _last_digest
    last = _last_digest
    if last is not None and last[0] is cfg:  # a run's clients in one process share its config
        return last[1]
    defaults = _field_defaults()
    values = {
        name: value
        for name, value in cfg.to_dict().items()
        if name not in SERVER_ONLY_SETTINGS and not (name in defaults and value == defaults[name])
    }
    digest = config_digest(json.dumps(values, sort_keys=True))
    _last_digest = (cfg, digest)
    return digest


_last_digest: tuple[TrainConfig, str] | None = None


@functools.cache
def _field_defaults() -> dict[str, Any]:
    return TrainConfig().to_dict()


#: Run configs parsed in this process, by their text: a node-level run's thousands of clients
#: are each sent (or name) the same one, and parsing and validating it was a twentieth of a
#: simulated client's time a message.
_parsed_configs: dict[str, TrainConfig] = {}
_CONFIGS_KEPT = 4


def config_from_json(text: str) -> TrainConfig:
    """The :class:`TrainConfig` a :data:`RUN` value holds (validated); a copy of the one parsed
    before for the same text."""
    cfg = _parsed_configs.get(text)
    if cfg is None:
        values = json.loads(text)
        values.pop("extra", None)
        cfg = TrainConfig.from_mapping(values)
        _parsed_configs[text] = cfg
        while len(_parsed_configs) > _CONFIGS_KEPT:
            _parsed_configs.pop(next(iter(_parsed_configs)))
    # Its own object for each caller: settings are plain values, so a shallow copy isolates them.
    return copy.copy(cfg)


def outgoing_key(dst: int) -> str:
    """The :data:`PAYLOADS` key of a frame a client sends to peer ``dst``: ``"to-<dst>"``."""
    return f"to-{int(dst)}"


def _client_after(key: str, prefix: str, what: str) -> int:
    head, _, client = key.partition("-")
    if head != prefix or not client.isdigit():
        raise ValueError(f"{what} key {key!r}: expected '{prefix}-<client id>'")
    return int(client)


def parse_outgoing_key(key: str) -> int:
    """The peer an :func:`outgoing_key` names.

    Raises:
        ValueError: ``key`` is not ``"to-<int>"``.
    """
    return _client_after(key, "to", "payload")


def share_key(src: int) -> str:
    """The :data:`SHARES` key of the share ``src`` sealed to an unmask request's recipient."""
    return f"from-{int(src)}"


def parse_share_key(key: str) -> int:
    """The sender a :func:`share_key` names.

    Raises:
        ValueError: ``key`` is not ``"from-<int>"``.
    """
    return _client_after(key, "from", "share")


def delivery_key(kind: str, src: int) -> str:
    """The :data:`PAYLOADS` key of a frame the server relays from ``src``: ``"<kind>-from-<src>"``."""
    return f"{kind}-from-{int(src)}"


def parse_delivery_key(key: str) -> tuple[str, int]:
    """``(kind, source client)`` of a :func:`delivery_key`.

    Raises:
        ValueError: ``key`` is not ``"<kind>-from-<int>"`` with a known kind.
    """
    kind, sep, src = key.partition("-from-")
    if not sep or kind not in (DEGREES, HALO) or not src.isdigit():
        raise ValueError(f"payload key {key!r}: expected '{DEGREES}|{HALO}-from-<client id>'")
    return kind, int(src)


#: The most broadcast deltas one message may chain (:data:`MODEL_BEFORE`): a server that sends
#: more sends the state whole, which costs less.
MAX_CHAIN = 64


def chain_key(step: int, name: str) -> str:
    """The :data:`MODEL_BEFORE` key of tensor ``name``'s frame in the ``step``-th missed delta
    (from 0, the oldest): ``"<step>/<name>"``."""
    return f"{int(step)}/{name}"


def chain_record(steps: list[dict[str, bytes]]) -> dict[str, bytes]:
    """The :data:`MODEL_BEFORE` record of missed deltas ``steps`` (oldest first)."""
    return {chain_key(i, name): frame for i, frames in enumerate(steps) for name, frame in frames.items()}


def chain_frames(entries: Mapping[str, Any], where: str) -> list[dict[str, bytes]]:
    """The missed deltas a :data:`MODEL_BEFORE` record holds, oldest first.

    Raises:
        ValueError: a key that is not a :func:`chain_key`, steps that are not 0, 1, ... in
            turn, or more than :data:`MAX_CHAIN` of them; naming ``where``.
    """
    steps: dict[int, dict[str, bytes]] = {}
    for key, frame in entries.items():
        step, sep, name = str(key).partition("/")
        if not sep or not step.isdigit() or not name or int(step) >= MAX_CHAIN:
            expected = f"'<step below {MAX_CHAIN}>/<tensor>'"
            raise ValueError(f"{where}: {MODEL_BEFORE} key {key!r}: expected {expected}")
        steps.setdefault(int(step), {})[name] = bytes(frame)
    if sorted(steps) != list(range(len(steps))):
        raise ValueError(f"{where}: {MODEL_BEFORE} steps {sorted(steps)} are not 0, 1, ... in turn")
    return [steps[i] for i in range(len(steps))]


#: What separates a lane's variant from its record's name (:func:`lane_record`).
LANE_SEP = "|"


def lane_record(variant: str, name: str) -> str:
    """The name under which ``variant``'s record ``name`` travels in a message of several lanes
    (:data:`LANES`): ``"<variant>|<name>"``."""
    return f"{variant}{LANE_SEP}{name}"


def record_kind(name: str) -> str:
    """The record name a (possibly lane-prefixed, :func:`lane_record`) record name stands for:
    what its values are (tensors for :data:`ARRAY_RECORDS`) depends on it alone."""
    _, sep, base = name.partition(LANE_SEP)
    return base if sep else name


def has_lanes(records: Records) -> bool:
    """Whether ``records`` is a message of several lanes (:func:`join_lanes`), not one lane's."""
    return LANES in records.get(CONFIG, {}) and any(LANE_SEP in name for name in records)


def join_lanes(lanes: Mapping[str, Records]) -> Records:
    """One message of several lanes' messages (variant -> its records, each with a
    :data:`CONFIG`): their records under :func:`lane_record` names, beside a :data:`CONFIG` of the
    entries every lane's config holds alike (the run's digest and key, stage, round: what a node
    reads before it answers) and :data:`LANES`."""
    configs = [dict(records[CONFIG]) for records in lanes.values()]
    shared = {k: v for k, v in configs[0].items() if all(k in c and c[k] == v for c in configs[1:])}
    shared.pop(FIRST_STAGE, None)  # each lane names its own
    joined: Records = {CONFIG: {**shared, LANES: ",".join(lanes)}}
    for variant, records in lanes.items():
        for name, values in records.items():
            joined[lane_record(variant, name)] = values
    return joined


def split_lanes(records: Records, where: str) -> dict[str, Records]:
    """The lanes' messages a :func:`join_lanes` message holds, by variant, in :data:`LANES`' order.

    Raises:
        ValueError: a lane named twice, or without its config; a record of a lane the message
            does not name, outside every lane, or whose name holds another lane's (lanes do not
            nest); naming ``where``.
    """
    names = str(records.get(CONFIG, {}).get(LANES, "")).split(",")
    if len(set(names)) != len(names) or not all(names):
        raise ValueError(f"{where}: {LANES} {str(records[CONFIG][LANES])[:60]!r} names no lane or one twice")
    lanes: dict[str, Records] = {v: {} for v in names}
    for name, values in records.items():
        if name != CONFIG:
            variant, base = _lane_of(name, where)
            if variant not in lanes:
                raise ValueError(f"{where}: record {name[:60]!r} belongs to no lane of the message")
            lanes[variant][base] = values
    for variant, lane in lanes.items():
        if CONFIG not in lane:
            raise ValueError(f"{where}: lane {variant[:40]!r} carries no {CONFIG}")
    return lanes


def split_lane_replies(records: Records, where: str) -> dict[str, Records]:
    """A reply to a :func:`join_lanes` message, by variant (every record a lane's).

    Raises:
        ValueError: a record outside every lane, or whose name holds another lane's; naming ``where``.
    """
    lanes: dict[str, Records] = {}
    for name, values in records.items():
        variant, base = _lane_of(name, where)
        lanes.setdefault(variant, {})[base] = values
    return lanes


def _lane_of(name: str, where: str) -> tuple[str, str]:
    """``(variant, record)`` of a :func:`lane_record` name."""
    variant, sep, base = name.partition(LANE_SEP)
    if not sep or not variant or not base or LANE_SEP in base:
        raise ValueError(f"{where}: record {name[:60]!r} belongs to no lane of the message")
    return variant, base


#: The largest JSON text a message field may hold (a key directory of 10,000 clients is ~1 MB).
MAX_JSON_FIELD = 4 << 20
#: The largest round or evaluation number a message may name.
MAX_COUNT = 2**31 - 1
#: The largest stage number a message may name: a sealed payload's header holds it in 16 bits.
MAX_STAGE = 2**16 - 1


def json_field(text: object, field: str, where: str, kind: type) -> Any:
    """The JSON value of a message's config entry ``field``, of type ``kind`` (dict or list).

    Raises:
        ValueError: too long, not JSON, nested too deeply, or not a ``kind``; naming the field.
    """
    raw = str(text)
    if len(raw) > MAX_JSON_FIELD:
        raise ValueError(f"{where}: {field} is {len(raw)} characters, more than {MAX_JSON_FIELD}")
    try:
        value = json.loads(raw)
    except RecursionError:
        raise ValueError(f"{where}: {field} is nested too deeply") from None
    except ValueError:
        raise ValueError(f"{where}: {field} is not JSON") from None
    if not isinstance(value, kind):
        raise ValueError(f"{where}: {field} must be a JSON {'object' if kind is dict else 'list'}")
    return value


def count_entries(config: Mapping[str, Any], where: str) -> None:
    """Refuse a config whose round or evaluation counter is not a count in [0, MAX_COUNT], or
    whose stage is not one in [0, MAX_STAGE].

    Raises:
        ValueError: naming the entry and its value.
    """
    for field in (ROUND, STAGE, SECAGG_EVAL):
        if field not in config:
            continue
        value, top = config[field], MAX_STAGE if field == STAGE else MAX_COUNT
        try:
            ok = not isinstance(value, bool) and int(value) == value and 0 <= int(value) <= top
        except (TypeError, ValueError, OverflowError):
            ok = False
        if not ok:
            raise ValueError(f"{where}: {field} {str(value)[:40]!r} is not a count in [0, {top}]")
