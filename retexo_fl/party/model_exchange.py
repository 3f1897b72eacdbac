"""A client's side of the model exchange: the broadcast it holds, its compressed update and its
error feedback, SCAFFOLD's control variates, and the journal that makes a re-sent round start
from where it started."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from retexo_fl import protocol as P
from retexo_fl.compress.updates import UpdateCodec
from retexo_fl.config import TrainConfig
from retexo_fl.protocol import Records
from retexo_fl.records import StateDict, same_bits, state_digest
from retexo_fl.scaffold import next_client_control, zeros_like_state
from retexo_fl.secure.channel import PeerChannel
from retexo_fl.seeding import derive_seed

#: Seed tag of a client's compressed-update rounding.
UPDATE_TAG = 0xC0

# The last broadcast deltas decoded in this process: (view it applied to, its frames, the result).
# Every client a round reaches decodes the same delta from the same view, about 2 ms each at
# Cora's stage 0 (at one node per client, most of a round): the first in a process decodes, the
# others share the result (views are never modified in place). In process the views are the very
# same tensors; a Flower simulation actor serving many nodes reads each node's view from its
# file, so there the view is compared bit for bit (0.06 ms). A deployed client decodes its own.
# A few are kept: clients that missed rounds decode a chain of them, one step after another.
_decoded: list[tuple[StateDict, dict[str, bytes], StateDict]] = []
#: How many decoded deltas :data:`_decoded` keeps: a chain as long as a 4-bit broadcast's kept
#: deltas (about seven) is decoded once, not once per client.
DECODES_KEPT = 8


class RoundCohort(Protocol):
    """The clients of one in-process train message that train and encode together
    (:class:`~retexo_fl.party.cohort.TrainCohort`): what a member asks it."""

    def trained(self, client: Any, state: StateDict, round_: int) -> tuple[StateDict, float, int] | None:
        """``client``'s ``(new state, first step's loss, steps)``, or ``None``: it trains alone."""

    def encoded(
        self, client: Any, new: StateDict, base: StateDict, residual: StateDict | None
    ) -> tuple[dict[str, bytes], StateDict] | None:
        """``client``'s update frames and next residual, or ``None``: it encodes alone."""


class ModelExchange:
    """The model-exchange seam of :class:`~retexo_fl.party.client.Client` (a mixin: it keeps the
    broadcast view, the kept view, the update residual, the control variates and the round journal)."""

    cfg: TrainConfig
    channel: PeerChannel
    update_codec: UpdateCodec | None
    residual: StateDict | None
    control: StateDict | None
    control_view: StateDict | None
    view: StateDict | None
    kept: StateDict | None
    earlier_view: StateDict | None
    earlier_kept: StateDict | None
    journal: list[Any] | None
    journal_file: str | None
    last_steps: int
    cohort: RoundCohort | None
    # The client's own (:class:`~retexo_fl.party.client.Client`):
    id: int
    seed_stage: int
    round_trial: int
    layer_index: Callable[[], int]
    journal_state: Callable[[str], dict[str, StateDict | None]]

    _ROUND_STATE = ("view", "kept", "earlier_view", "earlier_kept", "residual", "control", "control_view")
    # first-stage auto in parallel: each variant's round state (:attr:`_ROUND_STATE`, the journal
    # and last_steps) but the one the fields hold (lane)
    lanes: dict[str, dict[str, Any]]
    lane: str | None

    def switch_lane(self, variant: str) -> None:
        """Hold ``variant``'s round state: the view, residual, journal ... of its training of stage
        0, which a message of several lanes (:data:`~retexo_fl.protocol.LANES`) trains beside the
        other variant's. The state held so far is set aside as its lane's (the first lane takes
        it as it is); a lane not seen yet starts empty, as a stage's first training does.
        Nothing is copied: views are never modified in place."""
        if self.lane == variant:
            return
        if self.lane is None:  # the first lane takes the fields as they are: nothing is dropped
            self.lane = variant
            return
        self.lanes[self.lane] = self._lane_fields()
        found = self.lanes.pop(variant, None)
        for name in self._ROUND_STATE:
            setattr(self, name, found.get(name) if found else None)
        self.journal = found.get("journal") if found else None
        self.last_steps = int(found.get("last_steps", 0)) if found else 0
        self.journal_file = None  # a lane's journal is held whole (see _lane_fields)
        self.lane = variant

    def drop_lanes(self) -> None:
        """Stage 0 is over: the other lanes' round state is no longer needed (the fields keep the
        lane last held, the kept variant's: the stage's test and embed named it)."""
        self.lanes, self.lane = {}, None

    def _lane_fields(self) -> dict[str, Any]:
        """The round state held now, as a lane keeps it: the journal's round state whole, not as
        the name of a file of the work folder (a later save removes journal files it does not name)."""
        journal = self.journal
        if journal is not None and isinstance(journal[1], str):
            journal = [journal[0], self.journal_state(journal[1]), *journal[2:]]
        fields: dict[str, Any] = {name: getattr(self, name) for name in self._ROUND_STATE}
        return fields | {"journal": journal, "last_steps": self.last_steps}

    def begin_round(self, round_: int) -> bool:
        """Mark the start of train round ``round_``: remember what it finds or, for a round seen
        before (a resumed server sending it again), go back to what it found then.

        What it finds: the broadcast view, the update residual, the control variates and the
        incoming payload counters, so that the round's deliveries open again and nothing is
        applied twice. Counters go back no further than the round's start: payloads of earlier
        rounds stay refused.

        Rounds only go forward: the stage is this client's own, and a round before the last one
        begun (a server replaying an earlier round, say round 1 to skip the check that every
        peer's rows arrived) is refused.

        Returns:
            bool: the journal holds state that must outlive the process.

        Raises:
            ValueError: ``round_`` is before the last round this client began in its stage.
        """
        key = [int(self.seed_stage), int(self.round_trial), int(round_)]
        if self.journal is not None and key < self.journal[0]:
            raise ValueError(
                f"client {self.id}: train round {key[-1]} of stage {key[0]} after round "
                f"{self.journal[0][-1]} of stage {self.journal[0][0]} began: rounds only go forward"
            )
        if self.journal is not None and self.journal[0] == key:
            found = self.journal[1]
            if isinstance(found, str):  # saved as a file of the work folder: read it now
                found = self.journal_state(found)
            for name, value in found.items():
                setattr(self, name, None if value is None else dict(value))
            self.channel.rewind(self.journal[2] if len(self.journal) > 2 else None)
            return False
        if self.journal is None or self.journal[0][:2] != key[:2]:
            # This client's first round of a stage (or of stage 0's second training): an update
            # residual left is another model's. Round 1 resets it too, but a client sampled out
            # of round 1 kept the last stage's, and added it to the new model's update.
            self.residual = None
        found = {name: getattr(self, name) for name in self._ROUND_STATE}
        accepted = self.channel.accepted()
        self.journal = [key, {k: None if v is None else dict(v) for k, v in found.items()}, accepted]
        self.journal_file = None  # not saved yet
        return any(v is not None for v in found.values()) or bool(accepted)

    def receive_model(
        self,
        state: StateDict | None,
        frames: dict[str, bytes] | None,
        keep: bool = False,
        missed: list[dict[str, bytes]] | None = None,
    ) -> StateDict:
        """The round's model: ``state`` sent whole, or ``frames`` of a delta from the last one.

        Args:
            state (StateDict, optional): the model sent whole.
            frames (dict[str, bytes], optional): the model as a broadcast delta from the view held.
            keep (bool, optional): the view held before this message is the stage's best so far
                (:data:`~retexo_fl.protocol.KEEP`): keep a copy. (default: :obj:`False`)
            missed (list[dict[str, bytes]], optional): the broadcast deltas of rounds this client
                missed, oldest first, applied before ``frames`` (:data:`~retexo_fl.protocol.MODEL_BEFORE`).
                (default: :obj:`None`)
        """
        if keep and self.view is not None:
            self.kept = self.view  # views are never modified in place once made
        if frames is None:
            if state is None:
                raise ValueError(f"client {self.id}: a model message with neither state nor delta")
            if not keep:
                # A stage's first state: what was kept belongs to the last stage, or, as the
                # second training of stage 0 begins (first-stage auto, one after the other), to
                # the first training, whose best (its last view or the one kept) may still be
                # chosen: held, the stage's test names it by digest instead of sending it whole.
                # Moved once: a later whole state of the second training (a client that missed
                # rounds) leaves the first's where it is. (Trained in parallel, each variant's
                # lane holds its own; a later pass's stage 0 trains one variant.)
                second = self.round_trial > 0 and self.seed_stage == 0 and self.lane is None
                if second and self.earlier_view is None and self.earlier_kept is None:
                    self.earlier_view, self.earlier_kept = self.view, self.kept
                elif not second:
                    self.earlier_view = self.earlier_kept = None
                self.kept = None
            self.view = state
            return state
        if self.view is None:
            raise RuntimeError(f"client {self.id}: a model delta arrived before any whole state")
        view = self.view
        for step in [*(missed or []), frames]:  # a step that fails to decode leaves the view as it was
            view = self._decode_broadcast(view, step)
        self.view = view
        return self.view

    def _decode_broadcast(self, view: StateDict, frames: dict[str, bytes]) -> StateDict:
        """``view`` advanced by one broadcast delta; shared with the other clients of this
        process that decode the same delta from a view of the same bits (see :data:`_decoded`)."""
        for i, (seen, sent, decoded) in enumerate(_decoded):
            if sent == frames and (seen is view or same_bits(seen, view)):
                _decoded.append(_decoded.pop(i))  # most recently used last
                return decoded
        codec = UpdateCodec(self.cfg.broadcast_bits, self.cfg.range_dtype)
        decoded = codec.decode(frames, view, "server broadcast")
        _decoded.append((view, frames, decoded))
        del _decoded[:-DECODES_KEPT]
        return decoded

    def hold(self, state: StateDict) -> bool:
        """Keep ``state``, sent whole (broadcast-bits < 32): later messages may then name it by
        digest. Returns whether it was kept.

        A state comes whole to a client that holds no copy of it: one its rounds left out, or
        one restarted without its folder; what the server names next is this state, not the
        view kept before."""
        if self.cfg.broadcast_bits >= 32 or self.kept is state:
            return False
        self.kept = state
        return True

    def held_state(self, digest: str) -> StateDict | None:
        """The state this client holds whose :func:`~retexo_fl.records.state_digest` is
        ``digest`` (its view, the one it kept, or ``first-stage auto``'s first training of stage
        0's last and kept views), or ``None``: the server then sends it whole."""
        for state in (self.view, self.kept, self.earlier_view, self.earlier_kept):
            if state is not None and state_digest(state) == digest:
                return state
        return None

    def encode_update(self, new: StateDict, base: StateDict, round_: int) -> dict[str, bytes] | None:
        """``new``'s update from ``base`` as frames (``update-bits``), or ``None`` when uncompressed."""
        if self.update_codec is None:
            return None
        if round_ == 1:
            self.residual = None  # a new stage trains a new model
        stage = self.seed_stage
        shared = self.cohort.encoded(self, new, base, self.residual) if self.cohort is not None else None
        if shared is not None:  # encoded with the round's other members, as it would be alone
            frames, self.residual = shared
            return frames
        gen = torch.Generator().manual_seed(derive_seed(self.cfg.seed, stage, round_, UPDATE_TAG, self.id))
        frames, self.residual = self.update_codec.encode(
            new, base, self.residual, gen, where=f"client {self.id}, stage {stage} update"
        )
        return frames

    def receive_control(self, request: Records, state: StateDict, round_: int) -> StateDict | None:
        """The server's control variate for this round (``drift-correction scaffold``), else ``None``.

        A stage's first round carries none (it is zero); later rounds carry it whole
        (:data:`~retexo_fl.protocol.CONTROL`) or as deltas from the one held
        (:data:`~retexo_fl.protocol.CONTROL_FRAMES`).

        Args:
            request (Records): the train message.
            state (StateDict): the round's model (for keys and shapes at a stage's start).
            round_ (int): the round.
        """
        if self.cfg.drift_correction != "scaffold":
            return None
        if round_ == 1 or self.control_view is None:
            self.control_view = zeros_like_state(state)
        if P.CONTROL in request:
            self.control_view = dict(request[P.CONTROL])
        elif P.CONTROL_FRAMES in request:
            frames = {k: bytes(v) for k, v in request[P.CONTROL_FRAMES].items()}
            codec = UpdateCodec(self.cfg.broadcast_bits, self.cfg.range_dtype)
            self.control_view = codec.decode(frames, self.control_view, "server control variate")
        return self.control_view

    def decode_own_update(self, frames: dict[str, bytes], base: StateDict) -> StateDict:
        """This client's compressed update as the server decodes it (``base`` plus the deltas).

        Args:
            frames (dict[str, bytes]): what :meth:`encode_update` returned.
            base (StateDict): the state the update was taken from.
        """
        assert self.update_codec is not None  # frames exist only with a codec
        return self.update_codec.decode(frames, base, f"client {self.id}")

    def update_control(self, base: StateDict, trained: StateDict, control: StateDict) -> None:
        """Advance this client's control variate from the update as the server will decode it.

        Args:
            base (StateDict): the round's model, :math:`x`.
            trained (StateDict): the local result as the server decodes it, :math:`y_i`.
            control (StateDict): the server's control variate this round, :math:`c`.
        """
        assert self.control is not None  # train() set it this round
        lr = float(self.cfg.per_stage("lr", self.layer_index()))
        self.control = next_client_control(self.control, control, base, trained, self.last_steps, lr)
