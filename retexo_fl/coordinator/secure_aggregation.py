"""The server's half of a secure round: it sends the survivors one
:data:`~retexo_fl.protocol.UNMASK` message (through the round loop), rebuilds the self seeds,
removes the masks of members that dropped, and decodes the sum (protocol and security
argument: :mod:`retexo_fl.secure.secagg`; the client's half: :mod:`retexo_fl.party.secure_reply`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from retexo_fl import protocol as P
from retexo_fl.coordinator.privacy import UpdatePrivacy
from retexo_fl.coordinator.selection import StageTracker
from retexo_fl.coordinator.transport import ClientFailure
from retexo_fl.protocol import Records
from retexo_fl.records import EvalResult, StateDict
from retexo_fl.secure.fixedpoint import field_sum
from retexo_fl.secure.round_encoding import (
    GRID_MARGIN,
    WIDE_GRID_MARGIN,
    grid_bits,
    round_codec,
    unflatten,
    update_clip,
)
from retexo_fl.secure.secagg import (
    EvalCodec,
    SecAggError,
    decode_answer,
    members_json,
    parse_members,
    unmask_round,
)
from retexo_fl.secure.settings import min_threshold

log = logging.getLogger(__name__)


class UnmaskContext(Protocol):
    """What the server's unmasking needs of :class:`~retexo_fl.coordinator.federation.FederationView`
    (which holds a :class:`SecureAggregator`, so this module cannot import it): message content,
    counts and the DP accountant; never the transport, which only the round loop drives."""

    counts: dict[int, Any]
    privacy: UpdatePrivacy | None

    def content(self, state: StateDict | None = None, payloads: Any = None, model: Any = None,
                by_digest: bool = False, **config: Any) -> Records:  # fmt: skip
        """A message's records (:meth:`~retexo_fl.coordinator.federation.FederationView.content`)."""
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

    def round_config(self, fed: UnmaskContext, stage: int, members: list[int]) -> dict[str, Any]:
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
        fed: UnmaskContext,
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
            fed (UnmaskContext): the run's clients (message content, counts).
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
        codec = round_codec(self.cfg, view, len(members), float(config[P.SECAGG_BOUND]), rows)
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
        fed: UnmaskContext,
        pending: PendingUnmask,
        answered: dict[int, Records],
        state: StateDict,
        view: StateDict,
    ) -> RoundSum:
        """Unmask and decode a round from the survivors' answers to :meth:`collect`'s requests.

        Args:
            fed (UnmaskContext): the run's clients (its DP accountant).
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
        if metrics.get("diverged", 0.0) > 0:
            raise ClientFailure(
                f"secure aggregation: {pending.label}: local training diverged (NaN or Inf) on "
                f"{int(metrics['diverged'])} of the {n} members summed (which ones is masked); "
                "inputs of large magnitude do this: scale the node features to about unit size, "
                "or lower --lr"
            )
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

    def evaluation_config(self, fed: UnmaskContext, live: list[int]) -> dict[str, Any]:
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
