"""The boundary encoder a client runs between stages: rate schedule, bit policy, then frames.

Policies (``bit-policy``):

- ``fixed``: every row at ``bits`` (or at the schedule's rate, snapped down to a codec width).
- ``adaptive-budget``: per-row widths under ``byte-budget`` per client and exchange, summed over
  its peers (bytes, or ``<r>b`` for what ``r``-bit frames would cost).
- ``adaptive-bandwidth``: one budget per link, ``bandwidth(p, q) * T``; ``T`` is ``time-budget``
  seconds, or when unset the time in which the byte budget drains over all links at once, so
  slow links get fewer bits and every link finishes together (a link too slow for one bit a value
  gets that minimum, and the others share the rest).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from retexo_fl.compress.bits import one_bit_bytes, plan_widths
from retexo_fl.compress.payload import encode_rows, frame_size
from retexo_fl.compress.quantize import CodecError, snap_bits
from retexo_fl.compress.schedule import RateSchedule
from retexo_fl.compress.settings import CompressionSettings


def parse_bandwidths(spec: str) -> dict[str, float]:
    """Parse ``link-bandwidths``: ``"P:bw,P-Q:bw,default:bw"`` in bytes/s, or a JSON file of the same keys.

    ``P`` gives client ``P``'s own link (a link ``P-Q`` runs at the slower of its two ends);
    ``P-Q`` a pair, in either order.

    Args:
        spec (str): the setting; empty for no table.

    Returns:
        ``{key: bytes per second}``.

    Raises:
        ValueError: on an unreadable file, a malformed entry, or a bandwidth that is not a
            positive number.
    """
    spec = spec.strip()
    if not spec:
        return {}
    path = Path(spec)
    if path.suffix == ".json" or path.is_file():
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"link-bandwidths file {path}: {exc}") from exc
        items = list(raw.items())
    else:
        items = [tuple(part.split(":", 1)) for part in spec.split(",") if part.strip()]
    out = {}
    for item in items:
        if len(item) != 2:
            raise ValueError(f"link-bandwidths: bad entry {':'.join(item)!r} (want KEY:bytes-per-second)")
        key, value = str(item[0]).strip(), item[1]
        try:
            bw = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"link-bandwidths: {key!r} has a non-numeric bandwidth {value!r}") from None
        if not bw > 0:
            raise ValueError(f"link-bandwidths: {key!r} must be > 0 bytes/s, got {value!r}")
        out[key] = bw
    return out


def link_bandwidth(table: dict[str, float], p: int, q: int) -> float:
    """Bandwidth of the link between clients ``p`` and ``q`` (inf when the table says nothing).

    A ``P-Q`` entry wins; otherwise the slower end's own (or ``default``) bandwidth.

    Args:
        table (dict[str, float]): from :func:`parse_bandwidths`.
        p (int): one end.
        q (int): the other end.
    """
    for key in (f"{p}-{q}", f"{q}-{p}"):
        if key in table:
            return table[key]
    ends = [table.get(str(c), table.get("default", float("inf"))) for c in (p, q)]
    return min(ends)


@dataclass
class ExchangeStats:
    """What one client's boundary exchange cost, before and after compression.

    Args:
        bytes_raw (int, optional): what the same rows cost as float32 frames. (default: :obj:`0`)
        bytes_sent (int, optional): what was sent. (default: :obj:`0`)
        bits (Counter, optional): width -> rows sent at it. (default: :obj:`Counter()`)
    """

    bytes_raw: int = 0  # the same rows as float32 frames
    bytes_sent: int = 0
    bits: Counter = field(default_factory=Counter)  # width -> rows sent at it

    def add(self, other: ExchangeStats) -> None:
        """Add ``other``'s bytes and width counts to these.

        Args:
            other (ExchangeStats): another exchange's figures.
        """
        self.bytes_raw += other.bytes_raw
        self.bytes_sent += other.bytes_sent
        self.bits.update(other.bits)

    @classmethod
    def from_dict(cls, d: dict) -> ExchangeStats:
        """The inverse of :meth:`to_dict` (what a client reports over the wire).

        Args:
            d (dict): ``bytes_raw``, ``bytes_sent`` and ``bit_histogram`` (width as str -> rows).
        """
        bits = Counter({int(b): int(n) for b, n in d["bit_histogram"].items()})
        return cls(int(d["bytes_raw"]), int(d["bytes_sent"]), bits)

    def to_dict(self) -> dict:
        """A JSON-ready dict: ``bytes_raw``, ``bytes_sent``, ``bit_histogram`` (width as str -> rows)."""
        return {
            "bytes_raw": self.bytes_raw,
            "bytes_sent": self.bytes_sent,
            "bit_histogram": {str(b): n for b, n in sorted(self.bits.items())},
        }


class BoundaryEncoder:
    """Turns one client's boundary blocks into frames, as the compression settings say.

    Args:
        settings (CompressionSettings): the run's ``compression`` section (``bits``,
            ``bit-policy``, ``byte-budget``, ``link-bandwidths``, ``time-budget``,
            ``rate-schedule``, ``range-dtype``), e.g. ``cfg.compression``.

    Raises:
        ValueError: on a bad ``rate-schedule`` or ``link-bandwidths``.
    """

    def __init__(self, settings: CompressionSettings) -> None:
        self.settings = settings
        self.schedule = RateSchedule.parse(settings.rate_schedule)
        self.bandwidths = parse_bandwidths(settings.link_bandwidths)

    def rate(self, exchange: int, total: int) -> float:
        """Bits per value of exchange ``exchange`` of ``total`` (``bits`` under a fixed schedule).

        Args:
            exchange (int): the exchange's index, from 0.
            total (int): the run's number of exchanges.
        """
        return self.schedule.rate(exchange, total, self.settings.bits)

    def _budget(self, rate: float, rows: dict[int, Tensor]) -> int:
        """This exchange's byte budget: ``byte-budget`` in bytes, or what ``r``-bit frames cost
        (``r`` from a ``<r>b`` byte-budget, else from the schedule's rate)."""
        spec = str(self.settings.byte_budget).strip()
        if spec and not spec.endswith("b"):
            return int(float(spec))
        if spec and self.schedule.kind == "fixed":
            rate = float(spec[:-1])
        return sum(_rate_bytes(r.shape[0], r.shape[1], rate) for r in rows.values() if r.shape[0])

    def encode(
        self,
        client: int,
        rows: dict[int, Tensor],
        weights: dict[int, Tensor] | None,
        exchange: int,
        total: int,
        generator: torch.Generator | None = None,
    ) -> tuple[dict[int, bytes], ExchangeStats]:
        """Frames for each peer, and the exchange's byte / width figures.

        Args:
            client (int): the sending client's id.
            rows (dict[int, Tensor]): peer -> block.
            weights (dict[int, Tensor] | None): peer -> aggregation weights (adaptive policies only).
            exchange (int): this exchange's index (for the schedule).
            total (int): the run's number of exchanges (for the schedule).
            generator (torch.Generator | None, optional): the stochastic rounding's random source.
                (default: :obj:`None`)

        Shapes:
            - **input:** ``rows[peer]`` ``[k, d]``, ``weights[peer]`` ``[k]``

        Returns:
            ``(frames, stats)``: ``{peer: frame bytes}`` and the :class:`ExchangeStats`.

        Raises:
            ValueError: if an adaptive policy gets no ``weights``.
            CodecError: if a budget is too small, or the rows hold NaN / Inf.
        """
        where = f"client {client}, exchange {exchange}"
        s = self.settings
        rate = self.rate(exchange, total)
        widths: dict[int, int | Tensor]
        if s.bit_policy == "fixed":
            widths = dict.fromkeys(rows, snap_bits(rate))
        elif weights is None:
            raise ValueError(f"{where}: {s.bit_policy} needs aggregation weights")
        elif s.bit_policy == "adaptive-budget":
            widths = dict(plan_widths(rows, weights, self._budget(rate, rows), where))
        else:
            bw = {q: link_bandwidth(self.bandwidths, client, q) for q in rows}
            budgets = _link_budgets(self._budget(rate, rows), bw, rows, s.time_budget, where)
            widths = dict(plan_widths(rows, weights, budgets, where))
        frames, stats = {}, ExchangeStats()
        for q, block in rows.items():
            w = widths[q]
            frames[q] = encode_rows(
                block, w, generator=generator, half=s.range_dtype, where=f"{where}, rows to client {q}"
            )
            stats.bytes_raw += frame_size(block.shape[0], block.shape[1], 32)
            stats.bytes_sent += len(frames[q])
            if isinstance(w, int):
                stats.bits[w] += block.shape[0]
            else:
                stats.bits.update(Counter(w.tolist()))
        return frames, stats


def _link_budgets(
    total: int, bw: dict[int, float], rows: dict[int, Tensor], time_budget: float, where: str
) -> dict[int, int]:
    """``adaptive-bandwidth``'s budget for each peer's link: ``bandwidth * T`` bytes.

    ``T`` is ``time_budget``, else the time in which ``total`` bytes drain over every link at
    once. A link whose share cannot pay one bit a value (a link far slower than the others) gets
    that minimum, and ``T`` is solved again over the rest: every link but those finishes
    together, and the exchange still sends ``total`` bytes. An infinite link gets 8-bit frames.

    Raises:
        CodecError: ``total`` cannot pay one bit a value on every link, or ``time_budget`` cannot
            on one: naming the settings to raise.
    """
    floors = {q: one_bit_bytes(*rows[q].shape) for q in rows if rows[q].shape[0]}
    out = {q: _rate_bytes(*rows[q].shape, 8.0) for q in rows if bw[q] == float("inf")}
    finite = [q for q in rows if q not in out]
    if time_budget:
        out.update({q: int(bw[q] * time_budget) for q in finite})
        short = [q for q in finite if q in floors and out[q] < floors[q]]
        if short:
            q = short[0]
            raise CodecError(
                f"{where}: time-budget {time_budget} s pays {out[q]} bytes on the link to client {q}, "
                f"below the {floors[q]} that one bit a value needs: raise time-budget or that link's "
                "link-bandwidths entry"
            )
        return out
    fixed: dict[int, int] = {}
    while True:
        rest = [q for q in finite if q not in fixed]
        left = total - sum(fixed.values())
        seconds = left / sum(bw[q] for q in rest) if rest else 0.0
        low = [q for q in rest if q in floors and bw[q] * seconds < floors[q]]
        if not low:
            break
        fixed.update({q: floors[q] for q in low})
    if sum(fixed.values()) > total:
        raise CodecError(
            f"{where}: a byte budget of {total} bytes cannot pay one bit a value on every link (at least "
            f"{sum(floors[q] for q in finite if q in floors)} bytes): raise byte-budget (or the "
            "rate-schedule's lowest rate)"
        )
    out.update(fixed)
    out.update({q: int(bw[q] * seconds) for q in finite if q not in fixed})
    return out


def _rate_bytes(rows: int, cols: int, rate: float) -> int:
    """What ``rows x cols`` values cost at ``rate`` bits per value, with the per-row ranges a
    quantized frame carries (a rate of 16 or more is passthrough-sized)."""
    if rate >= 16:
        return frame_size(rows, cols, 16 if rate < 32 else 32)
    return frame_size(rows, cols, 1) - (rows * cols + 7) // 8 + int(rows * cols * rate) // 8
