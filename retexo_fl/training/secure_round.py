"""Secure aggregation in the round loop: the client's masked train reply and unmask answer, and
the server's unmasking (protocol and security argument: :mod:`retexo_fl.secure.secagg`).

With ``secure-aggregation`` a train reply carries no update, weight, loss or validation figure
in clear: one masked vector holds them all, with the self-seed shares sealed to the other
members. The server then sends the survivors one :data:`~retexo_fl.protocol.UNMASK` message,
rebuilds the self seeds, removes the masks of members that dropped, and decodes the sum. Only
the local step count stays in clear (time-based rounds report it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from retexo_fl import protocol as P
from retexo_fl.protocol import Records
from retexo_fl.secure.fixedpoint import field_sum
from retexo_fl.secure.masking import masked_update, pairwise_mask_seed
from retexo_fl.secure.secagg import (
    LOSS_CAP,
    SHARE_KIND,
    EvalCodec,
    SecAggError,
    UnmaskLedger,
    UpdateGrid,
    VectorCodec,
    answer_unmask,
    decode_answer,
    encode_answer,
    expand_rows,
    mask_vector,
    members_json,
    noise_share_std,
    parse_members,
    share_seed,
    shares_digest,
    unmask_round,
)
from retexo_fl.secure.settings import min_threshold
from retexo_fl.seeding import derive_seed
from retexo_fl.training.client import Client, EvalResult
from retexo_fl.training.privacy import UpdatePrivacy
from retexo_fl.training.selection import StageTracker
from retexo_fl.training.state import StateDict
from retexo_fl.training.transport import ClientFailure

log = logging.getLogger(__name__)

#: Seed tag of the field encoding's stochastic rounding (not secret: the vector is masked).
ROUNDING_TAG = 0x5A
#: Seed tag of a client's DP noise share under ``dp-reproducible``.
NOISE_TAG = 0xD9
#: How many noise-share standard deviations the field encoding leaves room for under DP.
NOISE_SIGMAS = 8.0
#: A grid row's clip over the clients' mean largest update magnitude in the row, last round, by
#: code width: room for a client whose peak is above the mean, or whose update grew. What a clip
#: cuts goes with the next round (error feedback), and the next grid reaches it; a wider clip
#: makes every step coarser. Chosen on validation, 2026-11-26: at 4 bits, Cora, 4 METIS clients,
#: defaults, seeds 0-2, mean val 0.763 at 1.0, 0.771 at 1.5, 0.760 at 2.0, 0.766 at 3.0 (0.777
#: without secure aggregation); at 8 and 16 bits (the generated 600-node graph, 8 rounds a
#: stage) 1.5 clipped ~300 coordinates and lost 5.7 (8 bits) and 4.7 (16 bits) points of test
#: accuracy, 4.0 clipped 6-7 and matched the plain run within 0.7 points (steps of 4/127 of a
#: peak cost nothing there).
GRID_MARGIN = {2: 1.5, 4: 1.5}
#: The margin of wider codes (see :data:`GRID_MARGIN`).
WIDE_GRID_MARGIN = 4.0


def flat_delta(base: StateDict, new: StateDict) -> np.ndarray:
    """``new - base`` over ``base``'s tensors in sorted key order, as one float64 vector."""
    return np.concatenate([(new[k].double() - base[k].double()).reshape(-1).numpy() for k in sorted(base)])


def _flat(state: StateDict) -> np.ndarray:
    return np.concatenate([state[k].double().reshape(-1).numpy() for k in sorted(state)])


def unflatten(flat: np.ndarray, like: StateDict) -> StateDict:
    """A flat vector (:func:`flat_delta`'s order) back into ``like``'s shapes, float32."""
    out, at = {}, 0
    for k in sorted(like):
        n = like[k].numel()
        out[k] = torch.from_numpy(np.ascontiguousarray(flat[at : at + n])).float().reshape(like[k].shape)
        at += n
    return out


def update_clip(cfg: Any, members: int) -> float:
    """The bound of an update coordinate: ``secagg-clip``, or under DP the clipping norm plus
    :data:`NOISE_SIGMAS` noise-share deviations."""
    if cfg.dp_noise > 0:
        return cfg.dp_clip * (1.0 + NOISE_SIGMAS * cfg.dp_noise / math.sqrt(members))
    return float(cfg.secagg_clip)


def _finite(value: float, otherwise: float) -> float:
    return float(value) if math.isfinite(float(value)) else otherwise


def round_terms(
    stage: int, round_: int, members: list[int], threshold: int, bound: float, grid: bytes = b""
) -> bytes:
    """The digest of a masked round's terms, bound into every pair mask of the round
    (:func:`~retexo_fl.secure.masking.pairwise_mask_seed`): clients sent different terms (members,
    threshold, weight bound, the update grid) derive masks that do not cancel. The clip, update
    bits and fixed-point scale are the run config's, bound by its digest since key setup."""
    text = json.dumps(
        [
            int(stage),
            int(round_),
            sorted(members),
            int(threshold),
            float(bound),
            hashlib.sha256(grid).hexdigest(),
        ]
    )
    return hashlib.sha256(b"retexo-fl secagg terms v2\0" + text.encode()).digest()


def grid_bits(cfg: Any) -> int:
    """The code width of the update grid: ``update-bits`` when compressed updates can be summed
    on a shared grid (2 to 16 bits, no DP: noise shares need the field's resolution), else 0."""
    bits = int(cfg.update_bits)
    return bits if 2 <= bits <= 16 and cfg.dp_noise <= 0 else 0


def row_sizes(like: StateDict) -> list[int]:
    """The rows of a state in :func:`flat_delta`'s order, as the update codec frames them: a
    matrix's first dimension (of ``numel / rows`` values each), a vector or scalar as one row."""
    rows: list[int] = []
    for k in sorted(like):
        t = like[k]
        if t.dim() >= 2 and t.shape[0] > 0:
            rows += [t.numel() // t.shape[0]] * t.shape[0]
        else:
            rows.append(t.numel())
    return rows


def state_digest(state: StateDict) -> str:
    """A digest of a broadcast state: the same state sent twice is recognised."""
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode() + b"\0" + state[k].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _codec(
    cfg: Any, like: StateDict, members: int, bound: float, grid: np.ndarray | None = None
) -> VectorCodec:
    """The round's vector layout; ``grid`` (per-row clips) puts the update on a shared grid."""
    size = sum(t.numel() for t in like.values())
    rows = row_sizes(like) if grid_bits(cfg) else []
    shared = None
    if grid is not None:
        shared = UpdateGrid(expand_rows(grid, rows), grid_bits(cfg), members)
    return VectorCodec(size, members, update_clip(cfg, members), bound, shared, tuple(rows))


def parse_grid(blob: object, cfg: Any, like: StateDict, members: int, where: str) -> np.ndarray:
    """The per-row clips of a :data:`~retexo_fl.protocol.SECAGG_GRID` value, checked.

    Raises:
        SecAggError: the run does not put updates on a grid, or the value is not one finite clip
            in ``(0, secagg-clip]`` per row of the model, or its lanes would not fit a field
            element (naming the client and the field).
    """
    field_ = P.SECAGG_GRID
    if not grid_bits(cfg):
        raise SecAggError(
            f"{where}: a {field_} for a run with update-bits {cfg.update_bits} and dp-noise "
            f"{cfg.dp_noise}; its updates are summed as field elements"
        )
    rows = row_sizes(like)
    if not isinstance(blob, bytes | bytearray) or len(blob) != 4 * len(rows):
        raise SecAggError(f"{where}: {field_} is not {len(rows)} float32 row clips ({4 * len(rows)} bytes)")
    clips = np.frombuffer(bytes(blob), dtype="<f4").astype(np.float64)
    top = update_clip(cfg, members)
    if not (np.isfinite(clips).all() and (clips > 0).all() and (clips <= top).all()):
        raise SecAggError(f"{where}: {field_} holds a clip that is not finite, > 0 and <= secagg-clip {top}")
    if (2 * members * (2 ** (grid_bits(cfg) - 1) - 1)).bit_length() > 32:
        raise SecAggError(
            f"{where}: {field_} for {members} members: their sums would not fit a field element"
        )
    return clips


# -- the client's side ---------------------------------------------------------------------------
@dataclass
class Prepared:
    """A train round's secure-aggregation start (:func:`prepare`): the stored reply of a round
    masked before, or the new round's sealed shares and settings."""

    stored: Records | None = None
    members: list[int] = field(default_factory=list)
    threshold: int = 0
    bound: float = 1.0
    self_seed: bytes = b""
    own_share: bytes = b""
    sealed: dict[int, bytes] = field(default_factory=dict)
    terms: bytes = b""
    digest: str = ""
    grid: np.ndarray | None = None


def _state(client: Client) -> dict[str, Any]:
    if client.secagg is None:
        client.secagg = {"answered": {}, "sent": None}
    return client.secagg


def _pair_seeds(
    client: Client, members: list[int], stage: int, round_: int, terms: bytes
) -> dict[int, bytes]:
    channel, where = client.channel, f"client {client.id}"
    if channel.identity is None or channel.directory is None or channel.transcript is None:
        raise SecAggError(f"{where}: secure aggregation before key setup")
    missing = sorted(set(members) - set(channel.directory))
    if missing:
        raise SecAggError(f"{where}: masking set members {missing} are not in the key directory")
    return {
        q: pairwise_mask_seed(
            channel.identity, channel.directory[q], channel.transcript, client.id, q, stage, round_, terms
        )
        for q in members
        if q != client.id
    }


def prepare(client: Client, config: dict[str, Any], state: StateDict) -> Prepared:
    """Start a train round's masking: check its terms, share a fresh self seed and seal the
    shares, before any other frame of the round is sealed (a holder opens them before the round's
    halo rows).

    A stage's round masked before (a resumed server sending it again) gets its first reply again,
    and an earlier round, or another stage than the client's own, is refused: a client masks each
    (stage, round) once and in order, so two masked vectors under the same pair masks never exist.

    The terms that shape a contribution are bound: the threshold is the run config's; within a
    stage the weight bound stays the first round's, the member set never grows and drops only
    members that did not survive the round before, and the broadcast state this client masked
    last is not masked again for another member set. Whatever the server sends each client, the
    round's terms are bound into its pair masks (:func:`round_terms`).

    Raises:
        SecAggError: the settings are missing, unsafe (a masking set or threshold smaller than
            a majority of the key directory) or not the bound ones, naming the client and the
            setting.
    """
    stage, round_ = int(config[P.STAGE]), int(config[P.ROUND])
    where = f"client {client.id}"
    if stage != client.message_stage:  # pair seeds bind the stage: it must be the client's own
        raise SecAggError(
            f"{where}: a train message for stage {stage}; this client is at stage {client.message_stage}"
        )
    sent = _state(client)["sent"]
    if sent is not None and (sent["stage"], sent["round"]) == (stage, round_):
        return Prepared(stored=sent["records"])
    if sent is not None and (stage, round_) < (sent["stage"], sent["round"]):
        raise SecAggError(
            f"{where}: asked to mask stage {stage} round {round_} after stage {sent['stage']} round "
            f"{sent['round']}; a client masks each round once, in order"
        )
    try:
        members = parse_members(config[P.SECAGG_MEMBERS], where, P.SECAGG_MEMBERS)
        threshold = int(config[P.SECAGG_THRESHOLD])
        bound = float(config[P.SECAGG_BOUND])
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise SecAggError(
            f"{where}: a secure-aggregation train message without its settings ({exc})"
        ) from None
    directory = client.channel.directory or {}
    least = min_threshold(len(directory))
    if threshold < least:
        raise SecAggError(
            f"{where}: secure aggregation threshold {threshold} for a key directory of "
            f"{len(directory)} clients; this client requires at least {least}"
        )
    agreed = int(client.cfg.secagg_threshold) or min_threshold(client.cfg.clients)
    if threshold != agreed:
        raise SecAggError(f"{where}: {P.SECAGG_THRESHOLD} {threshold}; the run config's is {agreed}")
    _check_bound(bound, where)
    if client.id not in members or len(members) > len(directory):
        raise SecAggError(
            f"{where}: {P.SECAGG_MEMBERS} {members} must hold this client and at most the "
            f"{len(directory)} clients of the key directory"
        )
    grid, grid_blob = None, b""
    if P.SECAGG_GRID in config:
        grid_blob = bytes(config[P.SECAGG_GRID])
        grid = parse_grid(grid_blob, client.cfg, state, len(members), where)
    digest = state_digest(state)
    if sent is not None and sent["stage"] == stage:
        _check_stage_terms(sent, members, bound, digest, round_, where)
    terms = round_terms(stage, round_, members, threshold, bound, grid_blob)
    self_seed, shares = share_seed(client.id, members, threshold)
    others = {q: s for q, s in shares.items() if q != client.id}
    sealed = client.channel.seal(others, SHARE_KIND, stage, round_)
    return Prepared(
        None, members, threshold, bound, self_seed, shares[client.id], sealed, terms, digest, grid
    )


def _check_stage_terms(
    last: dict[str, Any], members: list[int], bound: float, digest: str, round_: int, where: str
) -> None:
    """Refuse a round whose terms part from the stage's last masked round (see :func:`prepare`)."""
    before = f"round {last['round']} of this stage"
    if bound != float(last["bound"]):
        raise SecAggError(
            f"{where}: {P.SECAGG_BOUND} {bound:g} in round {round_}; {before} was masked with "
            f"{float(last['bound']):g}, and a stage's bound is fixed"
        )
    grown = sorted(set(members) - set(last["members"]))
    if grown:
        raise SecAggError(
            f"{where}: {P.SECAGG_MEMBERS} adds {grown} in round {round_}; within a stage the set only shrinks"
        )
    survived = last.get("survivors")
    removed = sorted(set(survived or []) - set(members))
    if removed:
        raise SecAggError(
            f"{where}: {P.SECAGG_MEMBERS} drops {removed} in round {round_}, who survived {before}; "
            "only members lost in an earlier round may leave"
        )
    if digest == last.get("digest") and sorted(members) != sorted(last["members"]):
        raise SecAggError(
            f"{where}: round {round_} sends the state {before} was masked from, for another member "
            "set; the difference of the two sums would be one client's update"
        )


def masked_records(
    client: Client,
    prep: Prepared,
    config: dict[str, Any],
    base: StateDict,
    new: StateDict,
    loss: float,
    val: EvalResult,
) -> Records:
    """The train reply's :data:`~retexo_fl.protocol.MASKED` record: the masked vector of the
    weighted update ``new - base`` and the round's metrics, with the sealed shares; kept so that
    the same round sent again gets the same reply.

    On the round's grid (:data:`~retexo_fl.protocol.SECAGG_GRID`) the update travels as codes of
    ``update-bits`` and what the grid drops is added to the next round's update (error feedback,
    in ``client.residual``), as the plain run's update codec does; else as field elements.
    """
    if prep.stored is not None:  # sent again: the reply and the residual it left, as they were
        client.residual = _state(client)["sent"].get("residual")
        return prep.stored
    cfg = client.cfg
    stage, round_ = int(config[P.STAGE]), int(config[P.ROUND])
    members = prep.members
    codec = _codec(cfg, base, len(members), prep.bound, prep.grid)
    delta = flat_delta(base, new)
    weight = min(client.num_train / prep.bound, 1.0)
    dp_clipped = 0.0
    if cfg.dp_noise > 0:  # distributed DP: clipped here, and this client's share of the noise
        norm = float(np.linalg.norm(delta))
        if norm > cfg.dp_clip:
            delta *= cfg.dp_clip / norm
            dp_clipped = 1.0
        gen = (
            np.random.default_rng(derive_seed(cfg.seed, NOISE_TAG, stage, round_, client.id))
            if cfg.dp_reproducible
            else np.random.default_rng()
        )
        std = noise_share_std(cfg.dp_noise, cfg.dp_clip, len(members))
        update = delta + gen.normal(0.0, std, delta.shape)
    else:
        update = weight * delta
        if round_ > 1 and client.residual is not None:  # error feedback: what a grid dropped before
            update += _flat(client.residual)
    metrics = {
        "weight": weight,
        # No training nodes: no loss (PyG's empty mean is NaN); a diverged one counts as the cap.
        "weighted_loss": 0.0 if weight == 0 else weight * min(_finite(loss, LOSS_CAP), LOSS_CAP),
        "val_correct": val.correct,
        "val_count": val.count,
        "val_loss": val.loss_sum,
        "dp_clipped": dp_clipped,
    }
    rng = np.random.default_rng(derive_seed(cfg.seed, ROUNDING_TAG, stage, round_, client.id))
    pair = _pair_seeds(client, members, stage, round_, prep.terms)
    packed, clipped, sent = mask_vector(
        codec, update, metrics, client.id, prep.self_seed, pair, stage, round_, rng
    )
    # In weighted units; a field element's rounding (below 2**-scale_bits) is not worth keeping.
    client.residual = unflatten(update - sent, base) if codec.grid is not None else None
    if clipped and codec.grid is None:  # on a grid, clipping is routine: the residual carries it
        log.warning(
            "client %s: %d update coordinates exceeded secagg-clip %s and were clipped",
            client.id,
            clipped,
            codec.update_clip,
        )
    records: Records = {
        P.MASKED: {P.VECTOR: packed, **{P.outgoing_key(q): b for q, b in prep.sealed.items()}}
    }
    _state(client)["sent"] = {
        "stage": stage,
        "round": round_,
        "members": members,
        "threshold": prep.threshold,
        "bound": prep.bound,
        "terms": prep.terms.hex(),
        "digest": prep.digest,
        "survivors": None,
        "own_share": prep.own_share,
        "records": records,
        "residual": client.residual,  # a new dict each round: the reference stays as it was
    }
    return records


def unmask(client: Client, request: Records) -> tuple[Records, bool]:
    """Answer an :data:`~retexo_fl.protocol.UNMASK` message: this survivor's shares of the
    survivors' self seeds and its pair seeds with the dropped members, for the round it masked
    last, and for one survivor set only (:class:`~retexo_fl.secure.secagg.UnmaskLedger`).

    Raises:
        SecAggError: no such masked round, a malformed or unsafe survivor set, a second story, or
            a share that is missing or fails to open (naming the client).
    """
    config = request[P.CONFIG]
    stage, round_ = int(config[P.STAGE]), int(config[P.ROUND])
    where = f"client {client.id}"
    state = _state(client)
    sent = state["sent"]
    if sent is None or (sent["stage"], sent["round"]) != (stage, round_):
        last = "none" if sent is None else f"stage {sent['stage']} round {sent['round']}"
        raise SecAggError(
            f"{where}: asked to unmask stage {stage} round {round_}; the round it masked last: {last}"
        )
    survivors = parse_members(config.get(P.SECAGG_SURVIVORS, ""), where, P.SECAGG_SURVIVORS)
    blobs = {}
    for key, blob in request.get(P.SHARES, {}).items():
        try:
            blobs[P.parse_share_key(key)] = bytes(blob)
        except ValueError as exc:
            raise SecAggError(f"{where}: {exc}") from None
    opened = {}
    for src, blob in blobs.items():  # each share must have been sealed in this very round
        frame, sealed_in = client.channel.open({src: blob}, SHARE_KIND, stage, min_round=round_)
        if sealed_in != round_:
            raise SecAggError(
                f"{where}: the share from client {src} was sealed in round {sealed_in}, not in the "
                f"round being unmasked ({round_})"
            )
        opened[src] = frame[src]
    opened[client.id] = sent["own_share"]
    members = list(sent["members"])
    last = state.get("answered_state")
    if (
        last is not None
        and last["stage"] == stage
        and last["round"] != round_
        and last["digest"] == sent.get("digest")
        and last["survivors"] != survivors
    ):
        raise SecAggError(
            f"{where}: asked to unmask round {round_} for survivors {survivors}; round {last['round']} "
            f"of the same broadcast state was unmasked for {last['survivors']}, and the difference "
            "of the two sums would be one client's update"
        )
    dropped = sorted(set(members) - set(survivors))
    terms = bytes.fromhex(sent.get("terms", ""))
    pair = _pair_seeds(client, [client.id, *dropped], stage, round_, terms) if dropped else {}
    shares, seeds = answer_unmask(client.id, members, survivors, int(sent["threshold"]), opened, pair, where)
    # Only the round masked last can be unmasked, so only its story needs keeping.
    key = f"{stage}:{round_}"
    state["answered"] = {k: v for k, v in state["answered"].items() if k == key}
    UnmaskLedger(state["answered"]).check(stage, round_, survivors, shares_digest(blobs), where)
    # The round's validation figures are a sum over the survivors of the received state's: an
    # evaluation of that state on val for another set would difference to one client's.
    _register(state, f"val:{sent.get('digest')}", survivors, where)
    sent["survivors"] = survivors  # the next round of the stage may drop only the others
    state["answered_state"] = {
        "stage": stage,
        "round": round_,
        "digest": sent.get("digest"),
        "survivors": survivors,
    }
    return {P.UNMASKED: encode_answer(shares, seeds)}, True


def evaluation_terms(split: str, digest: str, members: list[int], bound: float, counter: int) -> bytes:
    """The digest of a masked evaluation's terms, bound into its pair masks: members sent
    different terms (split, state, member set, count bound, evaluation counter) derive masks that
    do not cancel."""
    text = json.dumps([str(split), str(digest), sorted(members), float(bound), int(counter)])
    return hashlib.sha256(b"retexo-fl secagg evaluation v1\0" + text.encode()).digest()


def _check_bound(bound: float, where: str) -> None:
    if not (math.isfinite(bound) and bound >= 1):
        raise SecAggError(f"{where}: {P.SECAGG_BOUND} {bound} is not a count >= 1")


def _evaluated(state: dict[str, Any]) -> dict[str, Any]:
    """A client's record of its masked figures: the last evaluation counter and reply, and the
    member set each (split, state digest) was summed over."""
    return state.setdefault("evaluated", {"counter": -1, "sets": {}, "last": None})


def _register(state: dict[str, Any], key: str, members: list[int], where: str) -> None:
    """Record that the figures of ``key`` (split and state digest) went into a sum over
    ``members``, or refuse another set: the difference of two such sums is one client's."""
    done = _evaluated(state)
    before = done["sets"].get(key)
    if before is not None and sorted(before) != sorted(members):
        split = key.split(":", 1)[0]
        raise SecAggError(
            f"{where}: this state's {split} figures were summed over members {sorted(before)}; not "
            f"again over {sorted(members)} (the difference of the two sums would be one client's)"
        )
    done["sets"][key] = sorted(members)


def masked_evaluation(
    client: Client, config: dict[str, Any], state: StateDict, result: EvalResult
) -> Records:
    """An evaluate reply under secure aggregation: ``result`` masked so that the server learns
    the sum over the members only.

    Pair masks only: the sum decodes when every member's vector arrives, and no unmask message
    ever gives the server a pair seed. The terms are bound as a train round's are: the member set
    must be the survivors of the last round this client unmasked (the server cannot choose a set
    that leaves one client out of the sum it had a moment ago), the counter grows with every
    evaluation (no two masks repeat), and one state is evaluated on one split for one member set
    only.

    Raises:
        SecAggError: the settings are missing or not the bound ones, naming the client and field.
    """
    where = f"client {client.id}"
    split, stage = str(config[P.SPLIT]), int(config[P.STAGE])
    try:
        members = parse_members(config[P.SECAGG_MEMBERS], where, P.SECAGG_MEMBERS)
        counter = int(config[P.SECAGG_EVAL])  # a count: handle() checks it as it does round
        bound = float(config[P.SECAGG_BOUND])
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise SecAggError(
            f"{where}: an evaluation under secure aggregation without its settings ({exc})"
        ) from None
    _check_bound(bound, where)
    state_ = _state(client)
    answered = state_.get("answered_state")
    if answered is None or client.id not in members or sorted(members) != sorted(answered["survivors"]):
        last = "none" if answered is None else answered["survivors"]
        raise SecAggError(
            f"{where}: {P.SECAGG_MEMBERS} {members} for an evaluation; it must be the survivors of "
            f"the last round this client unmasked ({last})"
        )
    done = _evaluated(state_)
    digest = state_digest(state)
    terms = evaluation_terms(split, digest, members, bound, counter)
    last = done.get("last")
    if last is not None and last["counter"] == counter and last["terms"] == terms.hex():
        return {P.MASKED: {P.VECTOR: bytes.fromhex(last["vector"])}}  # asked again (a resumed server)
    if counter <= done["counter"]:
        raise SecAggError(
            f"{where}: {P.SECAGG_EVAL} {counter} after {done['counter']}; each evaluation takes a new one"
        )
    _register(state_, f"{split}:{digest}", members, where)
    codec = EvalCodec(len(members), bound)
    rng = np.random.default_rng(derive_seed(client.cfg.seed, ROUNDING_TAG, stage, counter, client.id))
    vector = codec.encode(result.correct, result.count, result.loss_sum, rng)
    pair = _pair_seeds(client, members, stage, 0, terms)
    packed = codec.pack(masked_update(vector, client.id, None, pair))
    done["counter"] = counter
    done["last"] = {"counter": counter, "terms": terms.hex(), "vector": packed.hex()}
    return {P.MASKED: {P.VECTOR: packed}}


# -- the server's side ---------------------------------------------------------------------------
class Federation(Protocol):
    """What the server's unmasking needs of :class:`~retexo_fl.training.federation.Federation`
    (which holds a :class:`SecureAggregator`, so this module cannot import it): message content,
    counts and the DP accountant; never the transport, which only the round loop drives."""

    counts: dict[int, Any]
    privacy: UpdatePrivacy | None

    def content(self, state: StateDict | None = None, payloads: Any = None, model: Any = None,
                by_digest: bool = False, **config: Any) -> Records:  # fmt: skip
        """A message's records (:meth:`Federation.content`)."""
        ...


@dataclass
class RoundSum:
    """What the server learns of a secure round: the aggregate, and the sums it was built from.

    Args:
        aggregate (StateDict): the global state plus the mean update (before the server optimizer).
        train_loss (float): the training-node-weighted training loss.
        val (tuple[int, int, float]): summed validation (correct, count, loss).
        raw (int): the bytes float32 updates would have taken (both ways).
    """

    aggregate: StateDict
    train_loss: float
    val: tuple[int, int, float]
    raw: int


@dataclass
class PendingUnmask:
    """A secure round between its masked replies and its unmasking (:meth:`SecureAggregator.collect`).

    Args:
        stage (int): the stage.
        round_ (int): the round.
        members (list[int]): the masking set.
        codec (Any): the round's field codec.
        vectors (dict[int, Any]): the survivors' masked vectors.
        requests (dict[int, Records]): the unmask request to each survivor.
        label (str): names the round in messages.
    """

    stage: int
    round_: int
    members: list[int]
    codec: Any
    vectors: dict[int, Any]
    requests: dict[int, Records]
    label: str


class SecureAggregator:
    """The server's side of secure aggregation for one run.

    Args:
        cfg (TrainConfig): the run configuration (``secagg-threshold``, ``secagg-clip``, DP).
    """

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.threshold = int(cfg.secagg_threshold) or min_threshold(cfg.clients)
        self.rounds = 0
        self.unmask_messages = 0
        self.bytes_extra = 0  # shares up, relayed shares down, unmask answers up
        self.clipped = 0  # update coordinates clipped to the field encoding's bound, all clients
        self.dropped_after_masking = 0
        self.largest_error = 0.0  # the largest per-coordinate bound of a decoded sum's error
        self.survivors: dict[int, list[int]] = {}  # stage -> the survivors of its last unmasked round
        # stage -> its next round's update grid (per-row clips, float32 little-endian bytes)
        self.grids: dict[int, bytes] = {}
        self.last_survivors: list[int] = []  # of the run's last unmasked round: who evaluates
        self.evaluations = 0  # masked evaluations asked for: each takes the next counter

    def next_grid(self, peaks: np.ndarray, n: int) -> np.ndarray:
        """Per-row clips for the stage's next round: :data:`GRID_MARGIN` times the survivors'
        mean row peak (``peaks``, their summed largest magnitude per row, decoded with this
        round), within ``(0, secagg-clip]``; the same for every member."""
        top = update_clip(self.cfg, n)
        margin = GRID_MARGIN.get(grid_bits(self.cfg), WIDE_GRID_MARGIN)
        grid = np.clip(margin * peaks / n, math.ldexp(top, -40), top).astype("<f4")
        # float32 may round a clip of ``top`` above it, which every client would refuse
        below = np.nextafter(np.float32(top), np.float32(0))
        return np.where(grid.astype(np.float64) > top, below, grid).astype("<f4")

    def members(self, stage: int, live: list[int]) -> list[int]:
        """A round's masking set: the survivors of the stage's last unmasked round (members lost
        since stay in it and count as dropped: a client refuses a set that drops a survivor), or
        the live clients at a stage's first round."""
        return list(self.survivors.get(stage, live))

    def round_config(self, fed: Federation, stage: int, members: list[int]) -> dict[str, Any]:
        """The train message's secure-aggregation settings for a round of ``stage`` masked by
        ``members``: with the stage's update grid after its first decoded round."""
        bound = max(int(c.counts.get("nodes", 1)) for c in fed.counts.values())
        config: dict[str, Any] = {
            P.SECAGG_MEMBERS: members_json(members),
            P.SECAGG_THRESHOLD: self.threshold,
            P.SECAGG_BOUND: max(bound, 1),
        }
        bits = grid_bits(self.cfg)
        grids = getattr(self, "grids", {})  # checkpoints from before the grid lack it
        if stage in grids and bits and (2 * len(members) * (2 ** (bits - 1) - 1)).bit_length() <= 32:
            config[P.SECAGG_GRID] = grids[stage]
        return config

    def collect(
        self,
        fed: Federation,
        stage: int,
        round_: int,
        members: list[int],
        replies: dict[int, Records],
        view: StateDict,
        tracker: StageTracker,
        down: int,
        label: str,
    ) -> PendingUnmask:
        """Read a round's masked replies and build the unmask requests to the survivors.

        The round loop sends :attr:`PendingUnmask.requests` (kind :data:`~retexo_fl.protocol.UNMASK`)
        and hands the answers to :meth:`decode`: this class never talks to a transport.

        Args:
            fed (Federation): the run's clients (message content, counts).
            stage (int): the stage.
            round_ (int): the round.
            members (list[int]): the masking set the round was sent to.
            replies (dict[int, Records]): the survivors' train replies.
            view (StateDict): the state the clients trained from.
            tracker (StageTracker): counts the model bytes.
            down (int): the broadcast's bytes per client.
            label (str): names the round in messages.

        Raises:
            ClientFailure: a reply is malformed (naming its client), or fewer than the threshold
                survive; no model is produced.
        """
        config = self.round_config(fed, stage, members)
        grid = config.get(P.SECAGG_GRID)
        rows = None if grid is None else np.frombuffer(grid, dtype="<f4").astype(np.float64)
        codec = _codec(self.cfg, view, len(members), float(config[P.SECAGG_BOUND]), rows)
        if grid is not None:  # the grid went down to every member with the model
            self.bytes_extra += len(grid) * len(members)
        vectors, outgoing = {}, {}
        for pid, reply in sorted(replies.items()):
            where = f"client {pid}"
            try:
                record = reply[P.MASKED]
                vectors[pid] = codec.unpack(record[P.VECTOR], stage, round_, where)
                outgoing[pid] = {
                    P.parse_outgoing_key(k): bytes(v) for k, v in record.items() if k != P.VECTOR
                }
            except KeyError as exc:
                raise ClientFailure(f"{where}: a secure-aggregation train reply without {exc}") from None
            except ValueError as exc:
                raise ClientFailure(str(exc)) from None
            tracker.model_bytes += down + len(record[P.VECTOR])
            self.bytes_extra += sum(len(b) for b in outgoing[pid].values())
        survivors = sorted(vectors)
        if len(survivors) < self.threshold:
            raise ClientFailure(
                f"secure aggregation: {len(survivors)} of {len(members)} clients replied to {label} "
                f"round {round_}, fewer than the threshold {self.threshold}; the round is not decoded"
            )
        self.survivors = {stage: survivors}
        self.last_survivors = survivors
        requests = {}
        for s in survivors:
            shares = {P.share_key(j): outgoing[j][s] for j in survivors if s in outgoing[j]}
            cfg_entries = {P.STAGE: stage, P.ROUND: round_, P.SECAGG_SURVIVORS: members_json(survivors)}
            requests[s] = {**fed.content(by_digest=True, **cfg_entries), P.SHARES: shares}
            self.bytes_extra += sum(len(b) for b in shares.values())
        return PendingUnmask(stage, round_, members, codec, vectors, requests, f"{label} round {round_}")

    def decode(
        self,
        fed: Federation,
        pending: PendingUnmask,
        answered: dict[int, Records],
        state: StateDict,
        view: StateDict,
    ) -> RoundSum:
        """Unmask and decode a round from the survivors' answers to :meth:`collect`'s requests.

        Args:
            fed (Federation): the run's clients (its DP accountant).
            pending (PendingUnmask): what :meth:`collect` left.
            answered (dict[int, Records]): the unmask answers by partition id.
            state (StateDict): the global state.
            view (StateDict): the state the clients trained from.

        Raises:
            ClientFailure: an answer is malformed (naming its client), or the sum does not
                decode; no model is produced.
        """
        self.unmask_messages += len(pending.requests)
        answers = {}
        for pid, reply in answered.items():
            try:
                answers[pid] = decode_answer(reply.get(P.UNMASKED, {}), f"client {pid}")
            except SecAggError as exc:
                raise ClientFailure(str(exc)) from None
            self.bytes_extra += sum(len(v) for v in reply.get(P.UNMASKED, {}).values())
        codec, members = pending.codec, pending.members
        try:
            sums, n = unmask_round(codec, pending.vectors, members, self.threshold, answers)
        except SecAggError as exc:
            raise ClientFailure(str(exc)) from None
        total, metrics = sums.update, sums.metrics
        self.rounds += 1
        if codec.row_sizes:
            self.grids = {pending.stage: self.next_grid(sums.peaks, n).tobytes()}
        self.clipped += int(metrics["clipped"])
        self.dropped_after_masking += len(members) - n
        self.largest_error = max(self.largest_error, codec.sum_error(n))
        privacy = fed.privacy
        if privacy is not None:  # distributed DP: equal weights, the noise came from the clients
            mean = total / n
            privacy.account_distributed(n, len(members), int(metrics["dp_clipped"]))
        else:
            if metrics["weight"] <= 0:
                raise ClientFailure(f"secure aggregation: {pending.label}: no training weight in the sum")
            mean = total / metrics["weight"]
        delta = unflatten(mean, view)
        aggregate = {k: (state[k].float() + delta[k]).to(state[k].dtype) for k in state}
        loss = metrics["weighted_loss"] / metrics["weight"] if metrics["weight"] > 0 else 0.0
        val = (int(metrics["val_correct"]), int(metrics["val_count"]), float(metrics["val_loss"]))
        raw = 2 * sum(t.numel() * t.element_size() for t in view.values()) * n
        return RoundSum(aggregate, loss, val, raw)

    def evaluation_config(self, fed: Federation, live: list[int]) -> dict[str, Any]:
        """An evaluate message's secure-aggregation settings: the last unmasked round's survivors
        (clients refuse any other set), the count bound and the next evaluation counter.

        Raises:
            ClientFailure: no round was unmasked yet, or the live clients are not those survivors
                (a survivor was lost since: its vector would be missing and the sum undecodable).
        """
        members = list(getattr(self, "last_survivors", []))
        if not members or sorted(live) != sorted(members):
            raise ClientFailure(
                f"secure aggregation: an evaluation needs the survivors of the last unmasked round "
                f"({members or 'none yet'}) and only them; the live clients are {sorted(live)}"
            )
        self.evaluations = getattr(self, "evaluations", 0) + 1
        bound = max(int(c.counts.get("nodes", 1)) for c in fed.counts.values())
        return {
            P.SECAGG_MEMBERS: members_json(members),
            P.SECAGG_BOUND: max(bound, 1),
            P.SECAGG_EVAL: self.evaluations,
        }

    def sum_evaluation(self, config: dict[str, Any], replies: dict[int, Records], phase: str) -> EvalResult:
        """The summed evaluation of every member's masked reply.

        Raises:
            ClientFailure: a member's reply is missing or malformed, or the sum does not decode.
        """
        members = parse_members(config[P.SECAGG_MEMBERS], "server", P.SECAGG_MEMBERS)
        missing = sorted(set(members) - set(replies))
        if missing:
            raise ClientFailure(
                f"secure aggregation: {phase}: no reply from members {missing}; the sum cannot be decoded"
            )
        codec = EvalCodec(len(members), float(config[P.SECAGG_BOUND]))
        try:
            vectors = [
                codec.unpack(replies[p].get(P.MASKED, {}).get(P.VECTOR), f"client {p}") for p in members
            ]
            correct, count, loss = codec.decode(field_sum(vectors), len(members))
        except SecAggError as exc:
            raise ClientFailure(f"{phase}: {exc}") from None
        return EvalResult(correct, count, loss)

    def summary(self) -> dict[str, Any]:
        """The run summary's ``secure_aggregation`` entry."""
        return {
            "threshold": self.threshold,
            "rounds": self.rounds,
            "unmask_messages": self.unmask_messages,
            "bytes_extra": self.bytes_extra,
            "coordinates_clipped": self.clipped,
            "dropped_after_masking": self.dropped_after_masking,
            "sum_error_bound": self.largest_error,
            "evaluations_masked": getattr(self, "evaluations", 0),
        }
