"""Variable-rate schedules (Cervino et al.): compression that starts high and eases over exchanges.

A schedule maps exchange ``t`` of ``T`` (stages in lazy mode, rounds in eager mode) to a rate in
bits per value. The fixed policy snaps the rate down to a codec width; the adaptive policies take
it as their byte budget (a rate of ``r`` pays what ``r``-bit frames would cost).
:func:`~retexo_fl.compress.quantize.snap_bits` does the snapping.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RateSchedule:
    """``fixed``, ``linear:LO,HI`` or ``step:R0,R1,...`` (the last rate repeats).

    Attributes:
        kind: ``fixed``, ``linear`` or ``step``.
        rates: the ``(LO, HI)`` pair, or the step rates; empty for ``fixed``.
    """

    kind: str = "fixed"
    rates: tuple[float, ...] = ()

    @classmethod
    def parse(cls, spec: str) -> RateSchedule:
        spec = (spec or "fixed").strip()
        if spec == "fixed":
            return cls()
        kind, _, body = spec.partition(":")
        try:
            rates = tuple(float(v) for v in body.split(",") if v.strip())
        except ValueError:
            rates = ()
        if kind not in ("linear", "step") or not rates or (kind == "linear" and len(rates) != 2):
            raise ValueError(
                f"rate-schedule {spec!r}: expected fixed, linear:LO,HI or step:R0,R1,... (bits per value)"
            )
        if any(not 1 <= r <= 32 for r in rates):
            raise ValueError(f"rate-schedule {spec!r}: rates must lie in [1, 32] bits per value")
        return cls(kind, rates)

    def rate(self, t: int, total: int, base: float) -> float:
        """Bits per value for exchange ``t`` (0-based) of ``total``; ``base`` for ``fixed``."""
        if self.kind == "fixed":
            return float(base)
        if self.kind == "step":
            return self.rates[min(t, len(self.rates) - 1)]
        lo, hi = self.rates
        return lo if total <= 1 else lo + (hi - lo) * min(t, total - 1) / (total - 1)

