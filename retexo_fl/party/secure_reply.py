"""The client's half of a secure round: its masked train reply, its masked evaluation and its
unmask answer (protocol and security argument: :mod:`retexo_fl.secure.secagg`).

With ``secure-aggregation`` a train reply carries no update, weight, loss or validation figure
in clear: one masked vector holds them all, with the self-seed shares sealed to the other
members. Only the local step count stays in clear (time-based rounds report it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from retexo_fl import protocol as P
from retexo_fl.party.client import Client
from retexo_fl.protocol import Records
from retexo_fl.records import EvalResult, StateDict
from retexo_fl.secure.masking import masked_update, pairwise_mask_seed
from retexo_fl.secure.round_encoding import (
    NOISE_TAG,
    ROUNDING_TAG,
    finite_or,
    flat_delta,
    flat_state,
    masked_state_digest,
    parse_grid,
    round_codec,
    round_terms,
    unflatten,
)
from retexo_fl.secure.secagg import (
    LOSS_CAP,
    SHARE_KIND,
    EvalCodec,
    SecAggError,
    UnmaskLedger,
    answer_unmask,
    encode_answer,
    mask_vector,
    noise_share_std,
    parse_members,
    share_seed,
    shares_digest,
)
from retexo_fl.secure.settings import min_threshold
from retexo_fl.seeding import derive_seed

log = logging.getLogger(__name__)

#: The error-feedback residual a client keeps on an update grid is bounded to this many times the
#: run's ``secagg-clip`` per coordinate. More than a few rounds can ever send of it is of no use,
#: and without a bound a large update (a learning rate of the server's, a state crafted so that
#: one gradient follows a count over the client's data) piled up past float32, after which the
#: next round's encoder refused it in clear: a per-client answer about that data.
RESIDUAL_CLIPS = 4.0


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


def note_stage_inputs(client: Client, stage: int, state: StateDict) -> None:
    """Fold the state a client embeds stage ``stage`` with into its running digest of where its
    stage inputs came from, which every later masked round binds (:func:`round_terms`).

    A GNN stage trains on inputs the client computed from an embed message's state, which the
    server sends each client on its own: sent every member but one a state that embeds to zero
    rows, the others' updates would be known to the server (zero where their inputs are), and the
    round's sum that one member's update, though every member trained from the same state.
    Bound, members embedded from different states derive masks that do not cancel."""
    secagg = _state(client)
    before = str(secagg.get("inputs", ""))
    text = json.dumps([before, int(stage), masked_state_digest(state)])
    secagg["inputs"] = hashlib.sha256(b"retexo-fl stage inputs v1\0" + text.encode()).hexdigest()


def _history_terms(client: Client) -> dict[str, str]:
    """What a masked round or evaluation binds of the client's past besides the message: where
    its stage inputs came from (:func:`note_stage_inputs`), stage 0's variant and the run config."""
    return {
        "inputs": str(_state(client).get("inputs", "")),
        "variant": str(getattr(client, "first_stage", "") or ""),
        # The config the client trains by: members rebuilt with another config than their
        # peers' derive masks that do not cancel.
        "config": P.client_config_digest(client.cfg),
    }


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
    digest = masked_state_digest(state)
    if sent is not None and sent["stage"] == stage:
        _check_stage_terms(sent, members, bound, digest, round_, where)
    terms = round_terms(
        stage,
        round_,
        members,
        threshold,
        bound,
        grid_blob,
        state_digest=digest,
        validate=bool(config.get(P.VALIDATE, True)),
        **_history_terms(client),
    )
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
    diverged: bool = False,
) -> Records:
    """The train reply's :data:`~retexo_fl.protocol.MASKED` record: the masked vector of the
    weighted update ``new - base`` and the round's metrics, with the sealed shares; kept so that
    the same round sent again gets the same reply.

    A client whose local training ``diverged`` sends ``new = base`` (no update) and counts 1 in
    the sum's ``diverged`` metric: the server learns how many members diverged, never which.

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
    codec = round_codec(cfg, base, len(members), prep.bound, prep.grid)
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
            update += flat_state(client.residual)
    metrics = {
        "weight": weight,
        # No training nodes: no loss (PyG's empty mean is NaN); a diverged one counts as the cap.
        "weighted_loss": 0.0 if weight == 0 else weight * min(finite_or(loss, LOSS_CAP), LOSS_CAP),
        "val_correct": val.correct,
        "val_count": val.count,
        "val_loss": val.loss_sum,
        "dp_clipped": dp_clipped,
        "diverged": float(diverged),
    }
    rng = np.random.default_rng(derive_seed(cfg.seed, ROUNDING_TAG, stage, round_, client.id))
    pair = _pair_seeds(client, members, stage, round_, prep.terms)
    packed, clipped, sent = mask_vector(
        codec, update, metrics, client.id, prep.self_seed, pair, stage, round_, rng
    )
    # In weighted units; a field element's rounding (below 2**-scale_bits) is not worth keeping.
    if codec.grid is not None:
        cap = RESIDUAL_CLIPS * codec.update_clip
        client.residual = unflatten(np.clip(np.nan_to_num(update - sent, nan=0.0), -cap, cap), base)
    else:
        client.residual = None
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


def evaluation_terms(
    split: str,
    digest: str,
    members: list[int],
    bound: float,
    counter: int,
    inputs: str = "",
    variant: str = "",
    config: str = "",
) -> bytes:
    """The digest of a masked evaluation's terms, bound into its pair masks: members sent
    different terms (split, state, member set, count bound, evaluation counter, where their stage
    inputs came from as :func:`note_stage_inputs` folds it, stage 0's variant, the run config)
    derive masks that do not cancel. Without ``inputs``, a server that embedded an earlier stage
    with a dead state on every member but one could difference two evaluations' sums into that
    member's own figures."""
    text = json.dumps(
        [
            str(split),
            str(digest),
            sorted(members),
            float(bound),
            int(counter),
            str(inputs),
            str(variant),
            str(config),
        ]
    )
    return hashlib.sha256(b"retexo-fl secagg evaluation v3\0" + text.encode()).digest()


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
    digest = masked_state_digest(state)
    terms = evaluation_terms(split, digest, members, bound, counter, **_history_terms(client))
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
