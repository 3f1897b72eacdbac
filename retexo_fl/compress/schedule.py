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

    Build one from the ``rate-schedule`` setting with :meth:`parse`.

    Args:
        kind (str, optional): ``fixed``, ``linear`` or ``step``. (default: :obj:`"fixed"`)
        rates (tuple[float, ...], optional): the ``(LO, HI)`` pair, or the step rates; empty for
            ``fixed``. (default: :obj:`()`)
    """

    kind: str = "fixed"
    rates: tuple[float, ...] = ()

    @classmethod
    def parse(cls, spec: str) -> RateSchedule:
        """The schedule a ``rate-schedule`` setting names (empty means ``fixed``).

        Args:
            spec (str): ``fixed``, ``linear:LO,HI`` or ``step:R0,R1,...``, rates in bits per value.

        Raises:
            ValueError: on another form, or a rate outside ``[1, 32]``.
        """
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
        """Bits per value for exchange ``t`` (0-based) of ``total``; ``base`` for ``fixed``.

        ``linear`` goes from ``LO`` at the first exchange to ``HI`` at the last.

        Args:
            t (int): the exchange's index.
            total (int): the number of exchanges.
            base (float): the fixed rate (the ``bits`` setting).
        """
        if self.kind == "fixed":
            return float(base)
        if self.kind == "step":
            return self.rates[min(t, len(self.rates) - 1)]
        lo, hi = self.rates
        return lo if total <= 1 else lo + (hi - lo) * min(t, total - 1) / (total - 1)
