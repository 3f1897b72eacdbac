"""The compression section of a run configuration, and the values its settings may take.

This module is a leaf of the package graph (no torch, no :mod:`retexo_fl.config`):
:class:`~retexo_fl.config.TrainConfig` imports it to build and validate its ``compression``
section, and the codecs import the bit widths from it.
"""

from __future__ import annotations

import math
from typing import Literal, get_args

from retexo_fl.compress.schedule import RateSchedule
from retexo_fl.setting import check_choices, section, setting

#: Widths the quantizer codes (bits per value).
QUANT_BITS = (1, 2, 4, 8)
#: Widths sent unquantized: 16 (the range dtype) and 32 (float32).
PASS_BITS = (16, 32)
#: Every width a frame may carry.
ALL_BITS = QUANT_BITS + PASS_BITS
RangeDtype = Literal["fp16", "bf16"]
#: Names of the 16-bit dtypes for row ranges and 16-bit passthrough.
RANGE_DTYPE_NAMES: tuple[str, ...] = get_args(RangeDtype)
BitPolicy = Literal["fixed", "adaptive-budget", "adaptive-bandwidth"]
#: How boundary rows get their widths (see :mod:`retexo_fl.compress.boundary`).
BIT_POLICIES: tuple[str, ...] = get_args(BitPolicy)


@section
class CompressionSettings:
    r"""Compression of boundary rows, model updates and model broadcasts (``docs/compression.md``).

    The ``compression`` section of :class:`~retexo_fl.config.TrainConfig`, and what
    :class:`~retexo_fl.compress.boundary.BoundaryEncoder` takes.
    """

    bits: int = setting(32, "boundary rows: bits per value under the fixed policy: 1, 2, 4, 8, 16 or 32")
    bit_policy: BitPolicy = setting("fixed", "how boundary rows get their widths")
    byte_budget: str | int = setting(
        "", "bytes per client and exchange, or <r>b for what r-bit frames cost (empty: none)"
    )
    link_bandwidths: str = setting(
        "",
        "P:bw,P-Q:bw,default:bw in bytes/s, or a JSON file of the same keys (adaptive-bandwidth)",
        needs="bit_policy=adaptive-bandwidth",
    )
    time_budget: float = setting(
        0.0,
        "seconds per exchange for adaptive-bandwidth (0: derived from the byte budget)",
        needs="bit_policy=adaptive-bandwidth",
    )
    rate_schedule: str = setting(
        "fixed", "fixed, linear:LO,HI or step:R0,R1,... (bits per value over exchanges)"
    )
    update_bits: int = setting(
        4, "model updates: bits per value, b-bit deltas with error feedback (32: float32)"
    )
    broadcast_bits: int = setting(
        4,
        "the server's model broadcast: bits per value, b-bit deltas from what clients hold (32: whole state)",
    )
    range_dtype: RangeDtype = setting("fp16", "dtype of the per-row ranges and of 16-bit passthrough")

    def validate(self) -> CompressionSettings:
        """Raise :class:`ValueError` naming the first bad setting; return ``self`` otherwise."""
        check_choices(self)
        budget = self.byte_budget
        if isinstance(budget, bool) or not isinstance(budget, int | str):
            raise ValueError(f"byte-budget takes bytes or <r>b; got {budget!r}")
        if not _budget_spec(str(budget)):
            raise ValueError(
                f"byte-budget takes a number of bytes >= 1 or <r>b with 0 < r <= {max(ALL_BITS)}; "
                f"got {budget!r}"
            )
        if self.broadcast_bits not in ALL_BITS:
            raise ValueError(f"broadcast-bits must be one of {ALL_BITS}, got {self.broadcast_bits}")
        for key, value in (("bits", self.bits), ("update-bits", self.update_bits)):
            if value not in ALL_BITS:
                raise ValueError(f"{key} must be one of {', '.join(map(str, ALL_BITS))}, got {value}")
        if self.bit_policy == "adaptive-budget" and not self.byte_budget and self.rate_schedule == "fixed":
            raise ValueError(
                "bit-policy adaptive-budget needs byte-budget (bytes, or e.g. 4b) or a rate-schedule"
            )
        if self.bit_policy == "adaptive-bandwidth" and not self.link_bandwidths:
            raise ValueError("bit-policy adaptive-bandwidth needs link-bandwidths")
        RateSchedule.parse(self.rate_schedule)  # its errors name rate-schedule
        return self


def _budget_spec(spec: str) -> bool:
    """Whether ``spec`` is empty (no budget), a number of bytes >= 1, or ``<r>b`` (what frames of
    ``r`` bits a value cost, ``0 < r <= 32``; adaptive widths meet a fractional ``r`` by mixing)."""
    spec = spec.strip()
    if not spec:
        return True
    if spec.endswith("b"):
        try:
            return 0 < float(spec[:-1]) <= max(ALL_BITS)  # NaN fails both
        except ValueError:
            return False
    try:
        return math.isfinite(float(spec)) and float(spec) >= 1
    except ValueError:
        return False
