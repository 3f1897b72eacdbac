r"""Secure aggregation of one round's replies: the server learns the sum of the survivors' vectors
and nothing else (Bonawitz et al., 2017; Bell et al., 2020), over the Message API's round loop.

A round under ``secure-aggregation`` (:mod:`retexo_fl.party.secure_reply` drives it):

1. **Masking (the train reply).** Client :math:`i` of the round's masking set :math:`M` (the
   clients the server sent the round to, at least :math:`t`) encodes its reply as one vector of
   integers modulo :math:`2^{32}` (:class:`VectorCodec`: its weighted update and its metrics) and
   masks it (:func:`~retexo_fl.secure.masking.masked_update`): a fresh random self seed
   :math:`b_i`, and a pair seed :math:`s_{ij}` with every other member, derived from the two
   parties' identity keys of the sealed channel (X25519), bound to the run transcript, the stage
   and the round (:func:`~retexo_fl.secure.masking.pairwise_mask_seed`). It splits :math:`b_i`
   into Shamir shares, threshold :math:`t`, one per member of :math:`M` (itself included), and
   seals each share to its holder through the authenticated channel. The reply carries the
   masked vector and the sealed shares; the server cannot open the shares.
2. **Unmasking (one more message).** The survivors :math:`S` (members that replied) are asked,
   each with the shares sealed to it: every survivor returns its shares of the survivors' self
   seeds, and, for each dropped member :math:`d`, its own pair seed :math:`s_{id}` of this round.
   The server rebuilds each survivor's :math:`b_j` from :math:`t` shares, removes the self masks
   and the dropped members' pair masks from the sum of the survivors' masked vectors
   (:func:`~retexo_fl.secure.masking.unmask_sum`) and decodes it (:meth:`VectorCodec.decode`).

Double masking: a survivor's self mask is removed only through shares, which honest clients give
only for members they were told survived, and its pair seeds only for members they were told
dropped. A client answers one story per stage and round (the survivor set and the relayed
shares' digest: :class:`UnmaskLedger`), opens a share only in the round it was sealed in, and
masks each of its own stage's rounds once and in order (a round sent again gets the first reply
again; the caller, :mod:`retexo_fl.party.secure_reply`, enforces it), so a server that claims a
slow client dropped, asks twice with two stories, or carries shares or pair seeds from one round
into another cannot get both halves of one client's masks. With self-shares, a server that tells
different clients different survivor sets needs :math:`2(t-1) \le |M| - 1` to unmask anyone;
clients refuse a threshold with :math:`2t \le |M| + 1` (:func:`min_threshold`) and a survivor
set smaller than :math:`t`.

**Compressed updates at close to their width.** With ``update-bits`` below 32 (and no DP), a
round after a stage's first carries the update segment on a shared grid (:class:`UpdateGrid`):
each coordinate becomes a ``b``-bit code on a per-row scale the server announces from the last
decoded sum, the same for every member (it is bound into the pair masks), and only the low
``lane_bits`` bits of each masked coordinate travel, enough for a sum of ``n`` codes. Reducing
modulo :math:`2^w` commutes with the masks' addition modulo :math:`2^{32}`, and a uniform mask
modulo :math:`2^{32}` is uniform modulo :math:`2^w`, so the truncated lanes hide as much as the
whole field elements and unmask to the exact sum of the codes.

What this does not hide: which clients replied, the sum itself, and the per-client counts the
setup message reports (partition sizes, as without secure aggregation). A dropped member's pair
seeds are revealed for that round only; they are one-way functions of the identity keys, so the
sealed channel and other rounds stay closed. Every survivor must answer the unmask message when
a member dropped after masking (its own pair seed with the dropped one is needed); without
dropouts, any :math:`t` answers suffice.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from retexo_fl.protocol import json_field
from retexo_fl.secure import shamir
from retexo_fl.secure.fixedpoint import DTYPE, FixedPoint, field_sum
from retexo_fl.secure.masking import SEED_BYTES, masked_update, unmask_sum
from retexo_fl.secure.settings import min_threshold

#: The channel kind shares are sealed as (:data:`retexo_fl.secure.envelope.KINDS`).
SHARE_KIND = "share"
#: Encodings leave a sum at most this fraction of the field (1/4), so a vector unmasked with a
#: wrong seed (uniform values) shows as out of range in about 3 of every 4 coordinates.
HEADROOM = 4
#: Losses above this are capped in the encoded metrics (a cross-entropy this high is divergence).
LOSS_CAP = 100.0
#: The metrics, in order: training weight, weighted training loss and summed validation loss
#: (fractions, in the float segment), then validation correct and count, update coordinates
#: clipped, updates L2-clipped and members whose local training diverged (integers, in the count
#: segment, summed exactly).
METRIC_NAMES = (
    "weight",
    "weighted_loss",
    "val_loss",
    "val_correct",
    "val_count",
    "clipped",
    "dp_clipped",
    "diverged",
)
_FRACTIONS = 3
_HEADER = struct.Struct(">4sQQIB")
_MAGIC = b"RXSA"
#: The most bits a lane of the update segment may take: a field element's.
FIELD_BITS = 32


class SecAggError(ValueError):
    """A secure-aggregation message, share or setting that is refused; the text names the client."""


def check_threshold(threshold: int, members: int, where: str) -> None:
    """Refuse a threshold that lets a lying server unmask a client, or that no round can meet.

    Raises:
        SecAggError: ``threshold < min_threshold(members)`` or ``threshold > members``, naming ``where``.
    """
    least = min_threshold(members)
    if not least <= threshold <= members:
        raise SecAggError(
            f"{where}: secure aggregation threshold {threshold} for {members} clients; it must be "
            f"{least} to {members} (below {least} a server that lies about who dropped can unmask "
            "a client)"
        )


def pack_lanes(values: np.ndarray, bits: int) -> bytes:
    """The low ``bits`` bits of each ``uint32`` in ``values``, packed back to back (little-endian
    bit order): ``ceil(values.size * bits / 8)`` bytes."""
    shifts = np.arange(bits, dtype=DTYPE)
    planes = ((values.astype(DTYPE)[:, None] >> shifts) & 1).astype(np.uint8)
    return np.packbits(planes.reshape(-1), bitorder="little").tobytes()


def unpack_lanes(blob: bytes, count: int, bits: int) -> np.ndarray:
    """The ``count`` lanes of :func:`pack_lanes`, as ``uint32`` values below ``2**bits``."""
    planes = np.unpackbits(np.frombuffer(blob, np.uint8), count=count * bits, bitorder="little")
    shifts = np.arange(bits, dtype=DTYPE)
    return (planes.reshape(count, bits).astype(DTYPE) << shifts).sum(axis=1, dtype=DTYPE)


def lane_bytes(count: int, bits: int) -> int:
    """Bytes of :func:`pack_lanes` for ``count`` lanes of ``bits`` bits."""
    return (count * bits + 7) // 8


@dataclass(frozen=True, eq=False)
class UpdateGrid:
    r"""A ``bits``-bit grid shared by every member of a round: compressed updates summed securely
    at close to their compressed width.

    Coordinate :math:`x` with clip :math:`c` (its row's, the same for every member) becomes the
    code :math:`q = \lfloor x K / c \rceil + K \in [0, 2K]`, :math:`K = 2^{b-1} - 1`, rounded
    stochastically (unbiased), after clipping :math:`x` to :math:`[-c, c]`. A sum of :math:`n`
    codes lies in :math:`[0, 2nK]`, so :attr:`lane_bits` :math:`= \lceil \log_2 (2nK + 1) \rceil`
    bits hold it exactly (6 bits for 4-bit codes and 4 members): masked lanes are the field
    elements' low bits, and the sum decodes to :math:`(\sum q - nK) \, c / K`.

    Args:
        clips (np.ndarray): the clip of each coordinate, float64, > 0 (a row's clip repeated over
            the row: :func:`expand_rows`).
        bits (int): the code width ``b``, 2 to 16.
        members (int): the most codes summed, >= 1.

    Shapes:
        - **clips:** ``[size]``; codes, sums and decoded floats have that shape.
    """

    clips: np.ndarray
    bits: int
    members: int

    def __post_init__(self) -> None:
        if not 2 <= self.bits <= 16 or self.members < 1:
            raise SecAggError(f"secure aggregation: a grid of {self.bits} bits for {self.members} members")
        if self.lane_bits > FIELD_BITS:
            raise SecAggError(
                f"secure aggregation: a sum of {self.members} {self.bits}-bit codes needs "
                f"{self.lane_bits} bits, more than a field element's {FIELD_BITS}"
            )

    @property
    def levels(self) -> int:
        """:math:`K`: codes run from 0 to ``2K``, zero at ``K``."""
        return 2 ** (self.bits - 1) - 1

    @property
    def lane_bits(self) -> int:
        """The bits a lane needs to hold a sum of ``members`` codes."""
        return (2 * self.members * self.levels).bit_length()

    def encode(self, values: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """``values`` (float, :attr:`clips`' shape) as ``uint32`` codes in ``[0, 2K]``.

        Raises:
            SecAggError: the shape differs from :attr:`clips`'s, or a value is NaN or infinite.
        """
        x = np.asarray(values, dtype=np.float64).reshape(-1)
        if x.shape != self.clips.shape:
            raise SecAggError(f"secure aggregation: {x.size} values for a grid of {self.clips.size}")
        if not np.isfinite(x).all():
            raise SecAggError("secure aggregation: an update to encode holds NaN or infinite values")
        k = self.levels
        scaled = np.clip(x, -self.clips, self.clips) * (k / self.clips)
        low = np.clip(np.floor(scaled), -k, k)
        up = rng.random(x.shape) < (scaled - low)
        return (np.minimum(low + up, k) + k).astype(DTYPE)

    def dequantize(self, codes: np.ndarray) -> np.ndarray:
        """The floats ``codes`` stand for (what the server adds up), float64."""
        return (codes.astype(np.float64) - self.levels) * (self.clips / self.levels)

    def decode_sum(self, total: np.ndarray, n: int) -> np.ndarray:
        """The float sum of ``n`` members' values from the sum of their codes (reduced to lanes).

        Raises:
            SecAggError: ``n`` out of range, or a lane above ``2 n K`` (not a sum of ``n``
                encodings: wrongly unmasked, or a client sent more than its share), naming how many.
        """
        if not 1 <= n <= self.members:
            raise SecAggError(f"secure aggregation: a grid sum of {n} codes; at most {self.members}")
        bad = int(np.count_nonzero(total > 2 * n * self.levels))
        if bad:
            raise SecAggError(
                f"secure aggregation: the unmasked sum does not decode ({bad} of {total.size} update "
                f"lanes exceed {2 * n * self.levels}, so this is not a sum of {n} encoded updates)"
            )
        return (total.astype(np.float64) - n * self.levels) * (self.clips / self.levels)


def expand_rows(row_clips: np.ndarray, row_sizes: list[int]) -> np.ndarray:
    """Per-coordinate clips from per-row ones: row ``r``'s clip repeated ``row_sizes[r]`` times."""
    return np.repeat(np.asarray(row_clips, dtype=np.float64), row_sizes)


class Decoded(NamedTuple):
    """An unmasked round's sums (:meth:`VectorCodec.decode`).

    Args:
        update (np.ndarray): the float sum of the update segment, float64.
        metrics (dict[str, float]): the summed metrics by :data:`METRIC_NAMES`, in raw units.
        peaks (np.ndarray): the sum over clients of each row's largest update magnitude (empty
            without ``row_sizes``), float64: what the next round's grid is set from.
    """

    update: np.ndarray
    metrics: dict[str, float]
    peaks: np.ndarray


@dataclass(frozen=True)
class VectorCodec:
    r"""One client's round reply as integers modulo :math:`2^{32}`: an update segment and a
    metrics segment, each a :class:`~retexo_fl.secure.fixedpoint.FixedPoint` encoding.

    The update segment holds :math:`w_i \Delta_i` (FedAvg) or the clipped, noised :math:`\Delta_i`
    (DP); :math:`w_i` is the client's training nodes over ``weight_bound``, so no coordinate needs
    a client's count in clear. The metrics (:data:`METRIC_NAMES`) follow in two segments: the
    weight and losses as fractions in :math:`[0, 1]` (losses over :data:`LOSS_CAP`, the validation
    loss also over ``weight_bound``), then the counts as integers at scale 1, so that their sum
    is exact whatever the clients and sizes (bounded by the larger of ``weight_bound`` and ``size``).
    With ``row_sizes``, a peaks segment between the update and the metrics holds each row's
    largest update magnitude (fixed point at the update clip): summed over the clients, it sets
    the scale of the next round's grid without any client's own peak leaving it.

    Args:
        size (int): coordinates of the update segment.
        members (int): the most vectors summed (the masking set), >= 1.
        update_clip (float): the bound of an update coordinate, > 0; larger ones are clipped.
        weight_bound (float): the largest count any client reports (its nodes), > 0.
        grid (UpdateGrid, optional): the update segment's shared grid, or :obj:`None` for
            fixed-point field elements. (default: :obj:`None`)
        row_sizes (tuple[int, ...], optional): the update's rows, in order, for the peaks
            segment; empty for none. (default: :obj:`()`)

    Shapes:
        - **vector:** ``[size + len(row_sizes) + len(METRIC_NAMES)]``: update, peaks, metrics
    """

    size: int
    members: int
    update_clip: float
    weight_bound: float
    grid: UpdateGrid | None = None
    row_sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.size < 0 or self.members < 1 or not self.weight_bound > 0:
            raise SecAggError(
                f"secure aggregation: bad vector layout (size {self.size}, members {self.members}, "
                f"weight bound {self.weight_bound})"
            )
        if self.grid is not None and self.grid.clips.size != self.size:
            raise SecAggError(f"secure aggregation: a grid of {self.grid.clips.size} for {self.size} values")
        if self.row_sizes and (sum(self.row_sizes) != self.size or min(self.row_sizes) < 1):
            raise SecAggError(f"secure aggregation: rows of {sum(self.row_sizes)} values for {self.size}")

    @property
    def update_fp(self) -> FixedPoint:
        """The update segment's encoding."""
        return FixedPoint(self.update_clip, HEADROOM * self.members)

    @property
    def metric_fp(self) -> FixedPoint:
        """The fractions segment's encoding (values in [0, 1])."""
        return FixedPoint(1.0, HEADROOM * self.members)

    @property
    def count_fp(self) -> FixedPoint:
        """The counts segment's encoding: integers up to ``max(weight_bound, size)``, exactly."""
        try:
            return FixedPoint(float(max(self.weight_bound, self.size, 1)), HEADROOM * self.members, 0)
        except ValueError as exc:
            raise SecAggError(f"secure aggregation: counts this large do not fit the field ({exc})") from None

    @property
    def length(self) -> int:
        """Coordinates of a whole vector."""
        return self.size + len(self.row_sizes) + len(METRIC_NAMES)

    @property
    def lane_bits(self) -> int:
        """Bits of an update coordinate on the wire: the grid's lanes, else a whole field element."""
        return self.grid.lane_bits if self.grid is not None else FIELD_BITS

    def wire_bytes(self) -> int:
        """Bytes of a packed vector (:meth:`pack`), header included."""
        return _HEADER.size + lane_bytes(self.size, self.lane_bits) + 4 * (self.length - self.size)

    def pack(self, vector: np.ndarray, stage: int, round_: int) -> bytes:
        """A masked vector with its header (magic, stage, round, length, lane bits): the update
        segment's low :attr:`lane_bits` bits per coordinate, then the peaks and metrics as ``uint32``."""
        head = _HEADER.pack(_MAGIC, stage, round_, vector.size, self.lane_bits)
        if self.grid is None:
            return head + vector.astype("<u4").tobytes()
        lanes = pack_lanes(vector[: self.size], self.lane_bits)
        return head + lanes + vector[self.size :].astype("<u4").tobytes()

    def unpack(self, blob: bytes, stage: int, round_: int, where: str) -> np.ndarray:
        """The masked vector in ``blob`` (update lanes widened to ``uint32``), checked against the
        round it must answer and this layout.

        Raises:
            SecAggError: not a masked vector, one for another stage or round, or of another
                length or lane width (naming ``where``).
        """
        blob = bytes(blob)
        if len(blob) < _HEADER.size:
            raise SecAggError(f"{where}: {len(blob)} bytes is no masked vector")
        magic, st, rnd, n, bits = _HEADER.unpack_from(blob)
        if magic != _MAGIC:
            raise SecAggError(f"{where}: not a masked vector (magic {magic!r})")
        if (st, rnd) != (stage, round_):
            raise SecAggError(
                f"{where}: a masked vector for stage {st} round {rnd}, expected stage {stage} round {round_}"
            )
        if n != self.length or bits != self.lane_bits or len(blob) != self.wire_bytes():
            raise SecAggError(
                f"{where}: a masked vector of {len(blob) - _HEADER.size} bytes ({n} values of "
                f"{bits} bits declared), expected {self.length} values, the update's in "
                f"{self.lane_bits}-bit lanes ({self.wire_bytes() - _HEADER.size} bytes)"
            )
        body = blob[_HEADER.size :]
        if self.grid is None:
            return np.frombuffer(body, dtype="<u4").astype(DTYPE)
        split = lane_bytes(self.size, self.lane_bits)
        metrics = np.frombuffer(body[split:], dtype="<u4").astype(DTYPE)
        return np.concatenate([unpack_lanes(body[:split], self.size, self.lane_bits), metrics])

    def encode(
        self, update: np.ndarray, metrics: Mapping[str, float], rng: np.random.Generator
    ) -> tuple[np.ndarray, int]:
        """The ``uint32`` vector of ``update`` (already weighted or noised) and ``metrics``.

        Args:
            update (np.ndarray): the flat float update segment, ``size`` values.
            metrics (Mapping[str, float]): raw values by :data:`METRIC_NAMES` (counts as counts,
                losses as sums; this scales them).
            rng (np.random.Generator): draws the stochastic rounding (need not be secret: the
                vector is masked).

        Returns:
            tuple[np.ndarray, int]: the vector, and how many update coordinates were clipped.
        """
        update = np.asarray(update, dtype=np.float64).reshape(-1)
        if update.size != self.size:
            raise SecAggError(f"secure aggregation: an update of {update.size} values, layout {self.size}")
        peaks = np.zeros(0)
        if self.row_sizes:  # before clipping: the next grid must reach what this one cut
            starts = np.cumsum((0, *self.row_sizes[:-1]))
            peaks = np.minimum(np.maximum.reduceat(np.abs(update), starts), self.update_clip)
        bound = self.update_clip if self.grid is None else self.grid.clips
        clipped = int(np.count_nonzero(np.abs(update) > bound))
        m = dict(metrics)
        m["clipped"] = float(clipped)
        b, cap = self.weight_bound, LOSS_CAP
        fractions = np.array([m["weight"], m["weighted_loss"] / cap, m["val_loss"] / (b * cap)])
        # A diverged loss (inf or NaN) counts at the cap: the metrics stay decodable.
        fractions = np.clip(np.nan_to_num(fractions, nan=1.0, posinf=1.0, neginf=0.0), 0.0, 1.0)
        counts = np.array(
            [m["val_correct"], m["val_count"], m["clipped"], m.get("dp_clipped", 0.0), m.get("diverged", 0.0)]
        )
        parts = [
            self.update_fp.encode(update, rng) if self.grid is None else self.grid.encode(update, rng),
            self.update_fp.encode(peaks, rng),
            self.metric_fp.encode(fractions, rng),
            self.count_fp.encode(np.round(counts), rng),  # integers: rounding never moves them
        ]
        return np.concatenate(parts), clipped

    def decode(self, total: np.ndarray, n: int) -> Decoded:
        """The float update sum, the summed peaks and the summed metrics (raw units) of ``n``
        encoded vectors.

        Raises:
            SecAggError: the sum is not a sum of ``n`` encodings (a wrong seed or share, or a
                client that sent more than its share), naming the segment.
        """
        at = self.size + len(self.row_sizes)
        split = at + _FRACTIONS
        try:
            if self.grid is None:
                update = self.update_fp.decode_sum(total[: self.size], n)
            else:  # the masks were added modulo 2**32; the codes' sum lives in the low lane bits
                lanes = total[: self.size] & DTYPE(2**self.grid.lane_bits - 1)
                update = self.grid.decode_sum(lanes, n)
            peaks = self.update_fp.decode_sum(total[self.size : at], n)
            fractions = self.metric_fp.decode_sum(total[at:split], n)
            counts = self.count_fp.decode_sum(total[split:], n)
        except ValueError as exc:
            raise SecAggError(f"secure aggregation: the unmasked sum does not decode ({exc})") from None
        b, cap = self.weight_bound, LOSS_CAP
        metrics = {
            "weight": float(fractions[0]),
            "weighted_loss": float(fractions[1]) * cap,
            "val_loss": float(fractions[2]) * b * cap,
            "val_correct": float(counts[0]),
            "val_count": float(counts[1]),
            "clipped": float(counts[2]),
            "dp_clipped": float(counts[3]),
            "diverged": float(counts[4]),
        }
        return Decoded(update, metrics, peaks)

    def sum_error(self, n: int) -> float:
        """The largest error of one decoded update-sum coordinate: ``n * 2**-scale_bits``, or
        ``n`` grid steps (the largest clip over ``K``) on a grid."""
        if self.grid is not None:
            return n * float(self.grid.clips.max(initial=0.0)) / self.grid.levels
        return self.update_fp.sum_error(n)


@dataclass(frozen=True)
class EvalCodec:
    """An evaluate reply under secure aggregation: correct and count (integers, exactly) and the
    loss sum (a fraction of ``bound * LOSS_CAP``), as three field elements masked by pair masks
    only (:func:`~retexo_fl.party.secure_reply.masked_evaluation`).

    Args:
        members (int): the clients whose vectors are summed, >= 1.
        bound (float): the largest count any client holds (its nodes), > 0.
    """

    members: int
    bound: float

    @property
    def counts(self) -> FixedPoint:
        """Correct and count: integers up to ``bound``, exactly."""
        return FixedPoint(float(max(self.bound, 1)), HEADROOM * self.members, 0)

    @property
    def loss(self) -> FixedPoint:
        """The loss sum over ``bound * LOSS_CAP``, in [0, 1]."""
        return FixedPoint(1.0, HEADROOM * self.members)

    def encode(self, correct: int, count: int, loss_sum: float, rng: np.random.Generator) -> np.ndarray:
        """The ``uint32`` vector of one client's evaluation (a diverged loss counts at the cap)."""
        loss = float(np.clip(np.nan_to_num(loss_sum / (self.bound * LOSS_CAP), nan=1.0, posinf=1.0), 0, 1))
        return np.concatenate(
            [
                self.counts.encode(np.array([correct, count], dtype=np.float64), rng),
                self.loss.encode([loss], rng),
            ]
        )

    def decode(self, total: np.ndarray, n: int) -> tuple[int, int, float]:
        """``(correct, count, loss sum)`` summed over the ``n`` vectors that add up to ``total``.

        Raises:
            SecAggError: ``total`` is not a sum of ``n`` encodings (a member's vector is missing or
                was masked for other terms).
        """
        try:
            counts = self.counts.decode_sum(total[:2], n)
            loss = self.loss.decode_sum(total[2:], n)
        except ValueError as exc:
            raise SecAggError(f"secure aggregation: the evaluation sum does not decode ({exc})") from None
        return int(counts[0]), int(counts[1]), float(loss[0]) * self.bound * LOSS_CAP

    @staticmethod
    def pack(vector: np.ndarray) -> bytes:
        """The masked vector as it travels: three little-endian ``uint32``."""
        return vector.astype("<u4").tobytes()

    @staticmethod
    def unpack(blob: object, where: str) -> np.ndarray:
        """The masked vector of :meth:`pack`.

        Raises:
            SecAggError: not 12 bytes (naming ``where``).
        """
        if not isinstance(blob, bytes | bytearray) or len(blob) != 12:
            raise SecAggError(f"{where}: a masked evaluation is 3 field elements (12 bytes)")
        return np.frombuffer(bytes(blob), dtype="<u4").astype(DTYPE)


def share_seed(own_id: int, members: list[int], threshold: int) -> tuple[bytes, dict[int, bytes]]:
    """A fresh self seed and its Shamir shares, one per member of the masking set (this client
    included): the first half of the client's step 1, before anything is sealed this round.

    Args:
        own_id (int): this client.
        members (list[int]): the masking set the server announced.
        threshold (int): shares that rebuild the seed.

    Returns:
        tuple[bytes, dict[int, bytes]]: the seed (secret, from the operating system) and
        ``{holder: share}``.

    Raises:
        SecAggError: this client is not a member once, or the threshold is unsafe for the set.
    """
    where = f"client {own_id}"
    if own_id not in members or len(set(members)) != len(members):
        raise SecAggError(f"{where}: the masking set {sorted(members)} does not hold this client once")
    check_threshold(threshold, len(members), where)
    seed = os.urandom(SEED_BYTES)  # secret: never the run seed every party knows
    return seed, shamir.split(seed, threshold, sorted(members))


def mask_vector(
    codec: VectorCodec,
    update: np.ndarray,
    metrics: Mapping[str, float],
    own_id: int,
    self_seed: bytes,
    pair_seeds: Mapping[int, bytes],
    stage: int,
    round_: int,
    rng: np.random.Generator,
) -> tuple[bytes, int, np.ndarray]:
    """Encode and mask: the second half of the client's step 1.

    Args:
        codec (VectorCodec): the round's layout.
        update (np.ndarray): the flat update segment (weighted, or clipped and noised).
        metrics (Mapping[str, float]): the metrics by :data:`METRIC_NAMES`.
        own_id (int): this client.
        self_seed (bytes): the seed :func:`share_seed` made.
        pair_seeds (Mapping[int, bytes]): ``{member: pair seed}`` for every other member.
        stage (int): the stage.
        round_ (int): the round.
        rng (np.random.Generator): the stochastic rounding's generator.

    Returns:
        tuple[bytes, int, np.ndarray]: the packed masked vector (:meth:`VectorCodec.pack`), the
        update coordinates clipped, and the update as the sum will count it (on a grid, its
        dequantized codes, whose difference from ``update`` the client keeps as error feedback;
        else ``update``). The last two stay on the client.
    """
    vector, clipped = codec.encode(update, metrics, rng)
    sent = (
        np.asarray(update, dtype=np.float64)
        if codec.grid is None
        else codec.grid.dequantize(vector[: codec.size])
    )
    masked = masked_update(vector, own_id, self_seed, dict(pair_seeds))
    return codec.pack(masked, stage, round_), clipped, sent


@dataclass
class UnmaskLedger:
    """A client's record of the unmask request it answered for a round: the survivor set and a
    digest of the shares relayed with it.

    It refuses a second, different story about the same round: a server that has one client's
    shares of a survivor's self seed must not also get that client's pair seed with it, nor
    swap in shares sealed for another purpose under the same survivor set.
    """

    answered: dict[str, dict] = field(default_factory=dict)

    def check(self, stage: int, round_: int, survivors: list[int], shares: str, where: str) -> None:
        """Record the story (``survivors`` and the relayed shares' digest ``shares``) for the round,
        or refuse it if another one was answered before."""
        key = f"{stage}:{round_}"
        story = {"survivors": sorted(survivors), "shares": shares}
        before = self.answered.get(key)
        if before is not None and before != story:
            raise SecAggError(
                f"{where}: unmasking stage {stage} round {round_} with survivors {sorted(survivors)} "
                f"after answering it with survivors {before['survivors']}"
                f"{' and other shares' if before['survivors'] == story['survivors'] else ''}; "
                "refusing a second story"
            )
        self.answered[key] = story


def shares_digest(blobs: Mapping[int, bytes]) -> str:
    """A digest of the relayed shares of an unmask request (sender -> sealed bytes)."""
    h = hashlib.sha256()
    for src in sorted(blobs):
        h.update(struct.pack(">QQ", src, len(blobs[src])) + bytes(blobs[src]))
    return h.hexdigest()


def answer_unmask(
    own_id: int,
    members: list[int],
    survivors: list[int],
    threshold: int,
    shares: Mapping[int, bytes],
    pair_seeds: Mapping[int, bytes],
    where: str,
) -> tuple[dict[int, bytes], dict[int, bytes]]:
    """A survivor's half of step 2: its shares of the survivors' self seeds, and its pair seeds
    with the dropped members.

    Args:
        own_id (int): this client.
        members (list[int]): the round's masking set, as this client masked with it.
        survivors (list[int]): who the server says replied; this client among them.
        threshold (int): the round's threshold.
        shares (Mapping[int, bytes]): ``{survivor: the share it sealed to this client}``, opened.
        pair_seeds (Mapping[int, bytes]): this client's pair seeds of the round, by member.
        where (str): names the client in errors.

    Returns:
        tuple[dict[int, bytes], dict[int, bytes]]: ``{survivor: share}`` and ``{dropped: pair seed}``.

    Raises:
        SecAggError: survivors outside the masking set, this client not among them, fewer than
            ``threshold`` of them, or a survivor's share missing.
    """
    s, m = set(survivors), set(members)
    if not s <= m or own_id not in s:
        raise SecAggError(
            f"{where}: survivors {sorted(s)} are not a subset, holding this client, of the masking "
            f"set {sorted(m)}"
        )
    if len(s) < threshold:
        raise SecAggError(
            f"{where}: {len(s)} survivors, fewer than the threshold {threshold}: refusing to unmask"
        )
    missing = sorted(s - set(shares))
    if missing:
        raise SecAggError(f"{where}: no share delivered from survivors {missing}")
    return {j: bytes(shares[j]) for j in sorted(s)}, {d: bytes(pair_seeds[d]) for d in sorted(m - s)}


def rebuild_seed(shares: dict[int, bytes], threshold: int, owner: int) -> bytes:
    """``owner``'s self seed from its survivors' shares, cross-checked when more than ``threshold``
    arrived (two different subsets must rebuild the same seed).

    Raises:
        SecAggError: too few shares, a malformed one, or shares that disagree (naming the owner
            and the holders).
    """
    try:
        seed = shamir.combine(shares, threshold)
        if len(shares) > threshold:
            high = dict(sorted(shares.items())[-threshold:])
            if shamir.combine(high, threshold) != seed:
                raise SecAggError(
                    f"secure aggregation: the shares of client {owner}'s self seed from holders "
                    f"{sorted(shares)} disagree; one of them is wrong"
                )
    except shamir.ShareError as exc:
        raise SecAggError(f"secure aggregation: client {owner}'s self seed: {exc}") from None
    return seed


def unmask_round(
    codec: VectorCodec,
    vectors: dict[int, np.ndarray],
    members: list[int],
    threshold: int,
    answers: dict[int, tuple[dict[int, bytes], dict[int, bytes]]],
) -> tuple[Decoded, int]:
    """The server's half of step 2: rebuild, unmask and decode the survivors' sum.

    Args:
        codec (VectorCodec): the round's layout.
        vectors (dict[int, np.ndarray]): each survivor's masked vector (unpacked).
        members (list[int]): the round's masking set.
        threshold (int): the round's threshold.
        answers (dict[int, tuple]): each answering survivor's ``(shares, pair seeds)``.

    Returns:
        tuple[Decoded, int]: the sums (update, metrics, peaks) and the number of vectors summed.

    Raises:
        SecAggError: fewer than ``threshold`` survivors or answers, a dropped member's pair seed
            missing (a survivor that did not answer), or a sum that does not decode; never a
            wrong result.
    """
    survivors = sorted(vectors)
    dropped = sorted(set(members) - set(survivors))
    if len(survivors) < threshold or len(answers) < threshold:
        raise SecAggError(
            f"secure aggregation: {len(survivors)} clients masked and {len(answers)} answered the "
            f"unmasking, fewer than the threshold {threshold}; the round cannot be decoded"
        )
    self_seeds = {}
    for j in survivors:
        held = {h: a[0][j] for h, a in answers.items() if j in a[0]}
        self_seeds[j] = rebuild_seed(held, threshold, j)
    pair: dict[tuple[int, int], bytes] = {}
    for d in dropped:
        for i in survivors:
            if i not in answers or d not in answers[i][1]:
                raise SecAggError(
                    f"secure aggregation: client {d} dropped after masking and client {i} gave no "
                    f"pair seed with it; its masks cannot be removed"
                )
            seed = answers[i][1][d]
            if len(seed) != SEED_BYTES:
                raise SecAggError(f"secure aggregation: client {i} sent a {len(seed)}-byte pair seed")
            pair[(i, d)] = seed
    total = unmask_sum(field_sum(vectors[j] for j in survivors), self_seeds, pair)
    return codec.decode(total, len(survivors)), len(survivors)


def encode_answer(shares: dict[int, bytes], seeds: dict[int, bytes]) -> dict[str, bytes]:
    """An unmask answer as record entries: ``share-<j>`` and ``seed-<d>``."""
    out = {f"share-{j}": v for j, v in shares.items()}
    out.update({f"seed-{d}": v for d, v in seeds.items()})
    return out


def decode_answer(entries: Mapping[str, object], where: str) -> tuple[dict[int, bytes], dict[int, bytes]]:
    """The ``(shares, pair seeds)`` of :func:`encode_answer`'s entries.

    Raises:
        SecAggError: a key that is neither, a value that is not bytes, or a share or seed of the
            wrong length (naming ``where``).
    """
    shares, seeds = {}, {}
    for key, value in entries.items():
        kind, _, who = str(key).partition("-")
        if kind not in ("share", "seed") or not who.isdigit() or not isinstance(value, bytes | bytearray):
            raise SecAggError(f"{where}: malformed unmask answer entry {key!r}")
        want = shamir.SHARE_BYTES if kind == "share" else SEED_BYTES
        if len(value) != want:
            raise SecAggError(f"{where}: a {kind} of {len(value)} bytes, expected {want}")
        (shares if kind == "share" else seeds)[int(who)] = bytes(value)
    return shares, seeds


def members_json(members: list[int]) -> str:
    """A set of clients as it travels in a config value."""
    return json.dumps(sorted(int(m) for m in members))


def parse_members(text: object, where: str, field: str = "the client set") -> list[int]:
    """The client ids of :func:`members_json`.

    Raises:
        SecAggError: not a JSON list of distinct non-negative ints (naming ``where`` and ``field``).
    """
    try:
        values = json_field(text, field, where, list)
        ids = [int(v) for v in values if not isinstance(v, bool) and int(v) == v and v >= 0]
        if len(ids) != len(values) or len(set(ids)) != len(ids):
            raise ValueError
    except (ValueError, TypeError, OverflowError):
        raise SecAggError(f"{where}: {field} is not a JSON list of distinct client ids") from None
    return sorted(ids)


def noise_share_std(noise: float, clip: float, members: int) -> float:
    """Each client's Gaussian noise share: ``noise * clip / sqrt(members)``, so the full set's sum
    carries the central noise ``noise * clip``."""
    return noise * clip / math.sqrt(members)
