"""A client's side of the protocol: one handler per message type, over plain records.

The Flower ClientApp (``clients/``) and the in-process transport both call :func:`handle`, so a
message does the same thing whichever engine carries it. Handlers never touch Flower records, the
file system or the network: the caller restores the client before and saves it after a reply
whose :attr:`Reply.changed` is set.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from retexo_fl import protocol as P
from retexo_fl.compress.boundary import ExchangeStats
from retexo_fl.config import SPRINT
from retexo_fl.party import secure_reply
from retexo_fl.party.client import Client, TrainingDiverged
from retexo_fl.party.lazy_client import LazyClient
from retexo_fl.protocol import Records
from retexo_fl.records import EvalResult, StateDict
from retexo_fl.secure.channel import frozen_directory
from retexo_fl.secure.keys import KeyMaterialError, parse_public

log = logging.getLogger(__name__)


@dataclass
class Reply:
    """A handler's answer.

    Args:
        records (Records): the reply's content.
        changed (bool): the client's node-local state changed; save it before replying.
    """

    records: Records
    changed: bool


def _halo_senders(request: Records) -> set[int]:
    """The senders whose rows (not degrees) ``request`` delivers."""
    keys = (P.parse_delivery_key(k) for k in request.get(P.PAYLOADS, {}))
    return {src for kind, src in keys if kind != P.DEGREES}


def _deliveries_digest(payloads: Mapping[str, object], stage: object) -> str:
    """One digest of a message's deliveries for ``stage``, whatever their order. The stage is in
    it: an isolated client's deliveries are empty at every stage, and each must still be applied."""
    h = hashlib.sha256(f"stage {stage}:".encode())
    for key in sorted(payloads):
        blob = bytes(payloads[key])  # type: ignore[call-overload]
        h.update(f"{key}:{len(blob)}:".encode())
        h.update(blob)
    return h.hexdigest()


def _deliver(client: Client, request: Records, once: bool = False) -> bool:
    """Apply halo rows and degrees delivered with ``request``; ``True`` if any arrived.

    ``once``: a test's or an embed's deliveries. A resumed server that sends the same message
    again finds them opened and saved already: they are not opened again (a sender's two frames
    in one message, its degrees and its rows, would otherwise refuse the first as a replay of a
    counter older than the second's). Skipping applies nothing, so a server gains nothing by it.
    A train round's deliveries open again instead, from the counters its journal rewinds to.
    """
    if P.PAYLOADS not in request:
        return False
    if once:
        digest = _deliveries_digest(request[P.PAYLOADS], request.get(P.CONFIG, {}).get(P.STAGE))
        if digest == client.delivered:
            return False
        client.delivered = digest
    degrees, halo = {}, {}
    for key, blob in request[P.PAYLOADS].items():
        kind, src = P.parse_delivery_key(key)
        (degrees if kind == P.DEGREES else halo)[src] = bytes(blob)
    if degrees:
        client.receive_degrees(client.decode_degrees(degrees))
    client.receive_deliveries(halo)
    return True


def hello(client: Client, request: Records) -> Reply:
    """Key setup: report this client's partition, public key and transcript contribution."""
    info = {
        P.PARTITION_ID: client.id,
        P.PUBLIC_KEY: client.public_key().hex(),
        P.CONTRIBUTION: client.channel.contribution().hex(),
    }
    return Reply({P.CONFIG: info}, changed=True)  # the private key stays node-local


def _add_payloads(records: Records, sent: tuple[dict[int, bytes], dict] | None) -> None:
    """Put a client's sealed frames for its peers (and their figures) into its reply records."""
    if not sent:
        return
    frames, stats = sent
    records[P.PAYLOADS] = {P.outgoing_key(q): f for q, f in frames.items()}
    if stats:
        records[P.STATS] = {P.STATS_JSON: json.dumps(stats)}


def _hex_map(text: object, what: str, where: str) -> dict[int, bytes]:
    values = P.json_field(text, what, where, dict)
    try:
        return {int(q): bytes.fromhex(v) for q, v in values.items()}
    except (ValueError, TypeError, AttributeError):
        raise KeyMaterialError(
            f"{where}: the setup message's {what} is not a JSON map of id -> hex"
        ) from None


#: The last key directory parsed in this process: ``(keys text, contributions text, directory,
#: contributions)``. In process every party is sent the same texts, so n parties parse them
#: once, not n times (at one node a client, n^2 entries: 7.3 million for Cora's 2,708).
_last_directory: tuple[str, str, Mapping[int, bytes], Mapping[int, bytes]] | None = None


def _key_directory(
    keys_text: str, contributions_text: str, where: str
) -> tuple[Mapping[int, bytes], Mapping[int, bytes]]:
    """The setup message's key directory and transcript contributions, parsed and checked, as
    read-only maps; the last texts' maps again when the texts are the same."""
    global _last_directory
    last = _last_directory
    if last is not None and last[0] == keys_text and last[1] == contributions_text:
        return last[2], last[3]
    keys = P.json_field(keys_text, P.KEYS, where, dict)
    try:
        directory = {int(q): parse_public(k, f"key directory, client {q}") for q, k in keys.items()}
    except (TypeError, ValueError) as exc:
        raise KeyMaterialError(f"{where}: the setup message's {P.KEYS}: {exc}") from None
    contributions = _hex_map(contributions_text, "transcript contributions", where)
    # Read-only views nobody else holds the dicts of: the channel reuses its transcript for them.
    parsed = frozen_directory(directory, contributions)
    _last_directory = (keys_text, contributions_text, *parsed)
    return parsed


def setup(client: Client, request: Records) -> Reply:
    """Check the run against this party's pins; connect to the peers in the key directory;
    report counts, plan digests and degree frames."""
    config = request[P.CONFIG]
    where = f"client {client.id}"
    client.policy.check_pins(str(config.get(P.PINS, "")) or None, where)
    bound_config = P.client_config_digest(client.cfg)
    if client.cfg.encrypt:
        directory, contributions = _key_directory(
            str(config[P.KEYS]), str(config.get(P.CONTRIBUTIONS, "{}")), where
        )
        # The config this client was sent is bound into the keys: parties handed different
        # configs by the server derive different keys, and their payloads fail to open.
        client.connect(directory, int(config[P.RUN_KEY]), contributions, bytes.fromhex(bound_config))
    client.run_config = bound_config
    frames = client.degree_frames() if client.needs_degrees() else {}
    info = {
        P.PARTITION_ID: client.id,
        P.NUM_CLASSES: client.part.num_classes,
        P.NUM_FEATURES: client.part.num_features,
        # Keyed to each pair when encrypted: an unkeyed digest of a one- or two-id list gives its
        # ids (and a private cross edge) to a server that hashes every guess.
        P.DIGESTS: json.dumps(client.plan.digests(client.channel.plan_tag if client.cfg.encrypt else None)),
    }
    return Reply(
        {
            P.CONFIG: info,
            P.METRICS: {k: int(v) for k, v in client.part.counts().items()},
            P.PAYLOADS: {P.outgoing_key(q): f for q, f in frames.items()},
        },
        changed=True,
    )


def train(client: Client, request: Records) -> Reply:
    """Validate the received state (unless it is a stage's first), train, send this round's rows
    and halo gradients (eager), and return the update."""
    journaled = client.begin_round(int(request[P.CONFIG][P.ROUND]))  # sent again: starts as it did
    delivered = _deliver(client, request)
    client.check_deliveries(int(request[P.CONFIG][P.ROUND]), _halo_senders(request))
    state = _received_model(client, request)
    config = request[P.CONFIG]
    validate = bool(config.get(P.VALIDATE, True))
    val = client.evaluate(state, "val") if validate else EvalResult(0, 0, 0.0)
    round_ = int(config[P.ROUND])
    records: Records = {}
    secure = client.cfg.secure_aggregation
    diverged = False
    if config.get(P.VALIDATE_ONLY) and not secure and client.cfg.mode == "lazy":
        # No training nodes: the round only validates; the view the broadcast advanced and the
        # journal still change.
        records[P.METRICS] = {
            P.NUM_EXAMPLES: 0,
            P.TRAIN_LOSS: 0.0,
            P.VAL_CORRECT: val.correct,
            P.VAL_COUNT: val.count,
            P.VAL_LOSS: val.loss_sum,
            P.LOCAL_STEPS: 0,
        }
        return Reply(records, journaled or delivered or client.cfg.broadcast_bits < 32)
    # Shares are sealed before this round's rows, so that their holders open them (at unmasking)
    # before the rows (with the next round): the channel accepts numbers in order only.
    prep = secure_reply.prepare(client, config, state) if secure else None
    control = client.receive_control(request, state, round_)  # drift-correction scaffold: c
    if control is not None:  # added to every step's gradient: as able to overflow as a state
        check_received_state(control, client, request)
    try:
        new_state, loss = client.train(state, round_, control)
    except TrainingDiverged as exc:
        if prep is None:
            raise
        # Whether a client's steps diverge depends on its data, so a crafted state or learning
        # rate could turn the refusal into a per-client answer about it. Under secure
        # aggregation the round goes on with no update from this client, and the count of
        # members that diverged travels in the masked sum: the server learns how many, not who.
        log.warning("%s (under secure aggregation: counted in the round's masked sum)", exc)
        new_state, loss, diverged = state, math.inf, True
        client.drop_round_gradients()
    # Eager: this round's embeddings (of the received state) go to the peers' next round, with
    # the halo gradients this round's training found (so they are sealed after training).
    sent = client.round_payloads(state, round_)
    _add_payloads(records, sent)
    # Under secure aggregation the masked vector carries the update at its own width (a shared
    # grid, with its own error feedback): the per-row update codec is not used.
    update = None if prep is not None else client.encode_update(new_state, state, round_)
    if control is not None:  # c_i from the update as the server decodes it, so both hold the same
        seen = new_state if update is None else client.decode_own_update(update, state)
        client.update_control(state, seen, control)
    if prep is not None:  # the update, weight, loss and validation travel masked, summed only
        records.update(
            secure_reply.masked_records(client, prep, config, state, new_state, loss, val, diverged)
        )
        records[P.METRICS] = {P.LOCAL_STEPS: client.last_steps}
    else:
        records[P.UPDATE if update is not None else P.ARRAYS] = update if update is not None else new_state
        records[P.METRICS] = {
            P.NUM_EXAMPLES: client.num_train,
            P.TRAIN_LOSS: loss,
            P.VAL_CORRECT: val.correct,
            P.VAL_COUNT: val.count,
            P.VAL_LOSS: val.loss_sum,
            P.LOCAL_STEPS: client.last_steps,
        }
    # Halo rows, the payload counters (rows sealed), the round journal, the update residual,
    # the control variate or the broadcast view changed: they must outlive the process.
    changed = (
        journaled
        or delivered
        or sent is not None
        or update is not None
        or control is not None
        or client.cfg.broadcast_bits < 32
        or secure
    )
    return Reply(records, changed)


#: The largest magnitude a received model value may have. Trained stages hold values of about 1
#: (at most 0.8 to 1.2 over whole default runs on Cora, Chameleon and Twitch TW), and 1.1e6 on
#: features left at 300 times their scale (tests/training/test_lazy.py); a server that sends
#: weights of 1e37 can make a client's loss or rows overflow exactly where a raw feature passes
#: a threshold, and the client's refusal to go on (a diverged round, rows it will not send)
#: would answer that question per client. Refused before the state is used.
MAX_RECEIVED_VALUE = 1e9


class StateRefused(TrainingDiverged, ValueError):
    """A received state (or control variate) with a value beyond :data:`MAX_RECEIVED_VALUE`:
    from an honest server, federated training that diverged; else a crafted state."""


def check_received_state(state: StateDict, client: Client, request: Records) -> StateDict:
    """``state``, if every value is finite and within :data:`MAX_RECEIVED_VALUE` in magnitude.

    Raises:
        StateRefused: naming the client, stage and round, the entry and its largest magnitude,
            and what to change when training diverged.
    """
    for key, value in state.items():
        if not value.is_floating_point() or not value.numel():
            continue
        peak = float(value.detach().abs().max())
        if not peak <= MAX_RECEIVED_VALUE:  # NaN compares false
            config = request.get(P.CONFIG, {})
            stage = config.get(P.STAGE, client.message_stage)
            when = f", round {config[P.ROUND]}" if P.ROUND in config else ""
            raise StateRefused(
                f"client {client.id}, stage {stage}{when}: the received state's {key} holds a value "
                f"of magnitude {peak:.3g}, beyond {MAX_RECEIVED_VALUE:g}; refusing to use it. Either "
                "local training diverged (inputs of large magnitude do this: scale the node features "
                "to about unit size, or lower --lr), or the server sent a state no training gives"
            )
    return state


def _received_model(client: Client, request: Records) -> StateDict:
    """The model a train (or a stage's last evaluate) message brings: a broadcast delta from the
    model held since, or a state sent whole (:func:`check_received_state`)."""
    keep = bool(request[P.CONFIG].get(P.KEEP, False))
    where = f"client {client.id}"
    if P.MODEL in request:
        # A client that missed rounds is sent the deltas it missed first (oldest first).
        missed = P.chain_frames(request.get(P.MODEL_BEFORE, {}), where)
        frames = {k: bytes(v) for k, v in request[P.MODEL].items()}
        return check_received_state(client.receive_model(None, frames, keep, missed), client, request)
    if P.MODEL_BEFORE in request:
        raise ValueError(f"{where}: missed broadcast deltas without the round's own")
    return client.receive_model(check_received_state(request[P.ARRAYS], client, request), None, keep)


def _named_state(client: Client, request: Records) -> StateDict | None:
    """The state an evaluate or embed message sends whole (:func:`check_received_state`), or
    names by digest (``None``: this client does not hold it, and says so)."""
    if P.ARRAYS in request:
        return check_received_state(request[P.ARRAYS], client, request)
    return client.held_state(str(request[P.CONFIG][P.HELD]))


def _not_held() -> Reply:
    """The answer to a digest this client holds no state for: the server sends the state whole."""
    return Reply({P.METRICS: {P.NOT_HELD: 1}}, changed=False)


#: The splits an evaluate message may ask for: the run's model selection and its final test.
EVALUATE_SPLITS = ("val", "test")


def evaluate(client: Client, request: Records) -> Reply:
    """Metrics of the received state on the requested split (eager: after the last halo rows;
    with :data:`~retexo_fl.protocol.REFRESH`, also the rows of the state for the peers).

    The state comes whole, by digest (:data:`~retexo_fl.protocol.HELD`), or, for a stage's last
    validation, as the next broadcast delta, journaled like a train round's so that a resumed
    server's second asking decodes it once. Under secure aggregation the metrics travel masked,
    summed only (:func:`~retexo_fl.party.secure_reply.masked_evaluation`).
    """
    config = request[P.CONFIG]
    decoded = P.MODEL in request  # the view changes: it must outlive the process
    if decoded:
        client.begin_round(int(config[P.ROUND]))
    delivered = _deliver(client, request, once=not decoded)
    state = _received_model(client, request) if decoded else _named_state(client, request)
    if state is None:
        reply = _not_held()
        reply.changed = delivered
        return reply
    # A state sent whole is held from then on, so that the stage's embed can name it by digest
    # (a lazy client the stage's rounds left out is sent it whole with the test).
    held = not decoded and P.ARRAYS in request and client.hold(state)
    split = str(config[P.SPLIT])
    if split not in EVALUATE_SPLITS:  # exact per-client counts of any other nodes: their labels
        raise ValueError(f"client {client.id}: evaluate serves the val and test splits only, not {split!r}")
    result = client.evaluate(state, split)
    records: Records = {}
    masked = bool(client.cfg.secure_aggregation and not config.get(P.REFRESH))
    if not client.cfg.secure_aggregation:
        records[P.METRICS] = {P.CORRECT: result.correct, P.COUNT: result.count, P.LOSS: result.loss_sum}
    elif masked:  # summed only; a halo refresh's metrics are not read at all
        records.update(secure_reply.masked_evaluation(client, config, state, result))
    sent = client.round_payloads(state, int(config[P.ROUND])) if config.get(P.REFRESH) else None
    _add_payloads(records, sent)  # eager: the rows of this state, for the peers' halos
    # Sealed rows changed the counters; a masked evaluation its counter and member sets.
    return Reply(records, changed=delivered or decoded or bool(sent) or masked or held)


def embed(client: Client, request: Records) -> Reply:
    """Lazy: move on from the stage (embed, or relabel at a pass's end); return the sealed rows.

    With :data:`~retexo_fl.protocol.SPLIT` ``"test"`` the client first tests the state on its
    test nodes, while it still holds the stage's inputs, and the reply carries the counts as an
    evaluate reply's do: a stage's test and embed in one message. A resumed server that asks
    again gets the same counts (the client has moved on and could not test again).
    """
    if not isinstance(client, LazyClient):
        raise ValueError(
            f"client {client.id}: {P.EMBED} is a lazy-mode message, this run is {client.cfg.mode}"
        )
    config = request[P.CONFIG]
    stage = int(config[P.STAGE])
    split = str(config.get(P.SPLIT, ""))
    if split not in ("", "test"):
        raise ValueError(f"client {client.id}: an embed tests the test split only, not {split!r}")
    if split and client.cfg.secure_aggregation:  # its counts would leave unmasked, this client's own
        raise ValueError(f"client {client.id}: under secure aggregation a test is masked, not in an embed")
    changed = False
    ends_pass = client.cfg.ends_pass(stage)
    if client.sent is not None and client.sent[0] == stage:  # asked again by a resumed server
        frames, stats, tested = client.sent[1], ExchangeStats.from_dict(client.sent[2]), client.sent[3]
        if split and tested is None:
            raise ValueError(f"client {client.id}: stage {stage}'s embed asked again, now with a test")
    else:
        # The stage's frames for a client neither its rounds nor its test reached: its halo rows
        # of this stage's input, needed to embed. Not opened again when asked again above.
        changed = _deliver(client, request, once=True)
        state = _named_state(client, request)
        if state is None:
            reply = _not_held()
            reply.changed = changed
            return reply
        tested = client.evaluate(state, "test") if split else None
        if config.get(P.TEACHER):  # before it moves on: its predictions need the stage's inputs
            client.keep_teacher(state)
        if client.cfg.secure_aggregation:  # later masked rounds bind where their inputs came from
            secure_reply.note_stage_inputs(client, stage, state)
        frames, stats = client.encode_boundary(client.next_stage(state))
        client.sent = (stage, frames, stats.to_dict(), tested)
        changed = True
    records: Records = {
        P.PAYLOADS: {P.outgoing_key(q): f for q, f in frames.items()},
        P.STATS: {P.STATS_JSON: json.dumps(stats.to_dict())},
    }
    metrics: dict[str, int | float] = {}
    # Relabelled: the next pass's training nodes, so that the server sends its rounds to who
    # trains. Not under secure aggregation: the count depends on the teacher state the server
    # names, so a crafted teacher would make it a per-client answer about the raw features
    # (how many nodes have x_k above a threshold). There every client that validates trains in
    # the masked rounds on what it holds, and its count travels summed, inside its weight.
    if ends_pass and not client.cfg.secure_aggregation:
        metrics[P.NUM_EXAMPLES] = client.num_train
    if split and tested is not None:
        metrics.update({P.CORRECT: tested.correct, P.COUNT: tested.count, P.LOSS: tested.loss_sum})
    if metrics:
        records[P.METRICS] = metrics
    return Reply(records, changed)


def unmask(client: Client, request: Records) -> Reply:
    """Secure aggregation: shares of the survivors' self seeds and pair seeds with the dropped
    members, for the round this client masked last (:func:`~retexo_fl.party.secure_reply.unmask`)."""
    records, changed = secure_reply.unmask(client, request)
    return Reply(records, changed)


HANDLERS: dict[str, Callable[[Client, Records], Reply]] = {
    P.HELLO: hello,
    P.SETUP: setup,
    P.TRAIN: train,
    P.EVALUATE: evaluate,
    P.EMBED: embed,
    P.UNMASK: unmask,
}


def handle(client: Client, kind: str, request: Records) -> Reply:
    """Answer one message of type ``kind``.

    Args:
        client (Client): the node's client, restored to its saved state.
        kind (str): the message type (one of :data:`~retexo_fl.protocol.MESSAGE_TYPES`).
        request (Records): the message's content.

    Raises:
        ValueError: an unknown message type.
    """
    if kind not in HANDLERS:
        raise ValueError(f"client {client.id}: unknown message type {kind!r}")
    if P.has_lanes(request):
        return handle_lanes(client, kind, request)
    if P.LANES in request.get(P.CONFIG, {}):
        raise ValueError(f"client {client.id}: {P.LANES} in the config of a message that carries no lanes")
    return _answer(client, kind, request)


def _answer(client: Client, kind: str, request: Records, lane: bool = False) -> Reply:
    """One message's reply (``lane``: one lane of a message of several, its lane checked by
    :func:`lane_requests`); filled-in payloads are reported with it, unless it is a lane's,
    whose message reports them once (:func:`handle_lanes`)."""
    config = request.get(P.CONFIG, {})
    P.count_entries(config, f"client {client.id}")
    if P.FIRST_STAGE in config:  # first-stage auto: what this message's layer-0 stage is
        if not isinstance(client, LazyClient):
            raise ValueError(
                f"client {client.id}: {P.FIRST_STAGE} applies to lazy runs, this one is {client.cfg.mode}"
            )
        variant = config[P.FIRST_STAGE]
        if variant == SPRINT and not (client.stage == 0 and (lane or kind == P.EVALUATE)):
            # Its rows would mix more hops of this client's subgraph than any row it releases.
            raise ValueError(
                f"client {client.id}: {P.FIRST_STAGE} {SPRINT} in {'a lane of ' * lane}a {kind} "
                f"message at stage {client.stage}; the sprint trains in stage 0's lanes and is "
                "evaluated there, never embedded"
            )
        client.set_first_stage(variant, lane=lane)
    reply = HANDLERS[kind](client, request)
    if client.missing and not lane:
        report_missing(client, reply.records)
    return reply


def report_missing(client: Client, records: Records) -> None:
    """Report the payloads ``client`` filled in (never silent) in its reply ``records``."""
    events = sorted(set(client.missing))  # eager: one event per sender, not per layer
    records[P.MISSING] = {P.STATS_JSON: json.dumps([list(e) for e in events])}
    client.missing = []


def lane_requests(client: Client, kind: str, request: Records) -> dict[str, Records]:
    """The lanes of a message of several (:data:`~retexo_fl.protocol.LANES`: stage 0 trained as
    each ``first-stage auto`` variant in the same rounds), by variant, each one train message.

    Lanes are the client's own config's to allow: a lazy run under ``first-stage auto`` with the
    parallel schedule, at stage 0 (the client's, and each lane's), each lane once, naming its own
    variant; and a client that began stage 0's rounds one training at a time trains no lanes (it
    would start its trainings over).

    Raises:
        ValueError: any of that is not so, naming the client.
    """
    where = f"client {client.id}"
    cfg = client.cfg
    if kind != P.TRAIN:
        raise ValueError(f"{where}: lanes in a {kind} message; only train messages carry them")
    if not isinstance(client, LazyClient) or cfg.first_stage != "auto":
        raise ValueError(f"{where}: a train message of several lanes; only first-stage auto trains them")
    if cfg.first_stage_schedule != "parallel":
        raise ValueError(
            f"{where}: a message of several lanes in a run whose first-stage-schedule is sequential"
        )
    if client.stage != 0:
        raise ValueError(f"{where}: a message of several lanes at stage {client.stage}; lanes train stage 0")
    if client.lane is None and client.journal is not None:
        raise ValueError(f"{where}: a message of several lanes after stage 0's rounds began without lanes")
    lanes = P.split_lanes(request, where)
    unknown = [v for v in lanes if v not in cfg.first_stage_lanes]
    if unknown:  # before any lane trains
        raise ValueError(
            f"{where}: lane {unknown[0][:40]!r} is not one of {', '.join(cfg.first_stage_lanes)}"
        )
    for variant, lane in lanes.items():
        named, stage = lane[P.CONFIG].get(P.FIRST_STAGE), lane[P.CONFIG].get(P.STAGE)
        if named != variant or stage != 0:
            raise ValueError(
                f"{where}: lane {variant!r} names {P.FIRST_STAGE} {str(named)[:40]!r} at stage "
                f"{str(stage)[:20]!r}; a lane trains stage 0 as its own variant"
            )
        if P.LANES in lane[P.CONFIG]:
            raise ValueError(f"{where}: lane {variant!r} names lanes of its own; lanes do not nest")
        if P.PAYLOADS in lane:
            # Stage 0 reads no peer's rows; and a lane's round sent again rewinds the one channel
            # the lanes share to that round's start, past frames the other lane opened since.
            raise ValueError(f"{where}: lane {variant!r} delivers payloads; stage 0's rounds carry none")
    return lanes


def handle_lane(client: Client, kind: str, request: Records) -> Reply:
    """Answer one lane of a message of several (checked by :func:`lane_requests`) on its
    variant's round state; filled-in payloads are left for the message's reply to report."""
    return _answer(client, kind, request, lane=True)


def handle_lanes(client: Client, kind: str, request: Records) -> Reply:
    """Answer a message of several lanes: each lane as the train message it is, in order, on
    its own variant's round state; the reply holds each lane's records under its
    :func:`~retexo_fl.protocol.lane_record` names, and any filled-in payloads once."""
    records: Records = {}
    changed = False
    for variant, lane in lane_requests(client, kind, request).items():
        reply = handle_lane(client, kind, lane)
        records.update({P.lane_record(variant, name): values for name, values in reply.records.items()})
        changed = changed or reply.changed
    if client.missing:
        report_missing(client, records)
    return Reply(records, changed)
