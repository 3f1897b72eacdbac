"""The compression section of a run configuration, and the values its settings may take.

This module is a leaf of the package graph (no torch, no :mod:`retexo_fl.config`):
:class:`~retexo_fl.config.TrainConfig` imports it to build and validate its ``compression``
section, and the codecs import the bit widths from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from retexo_fl.compress.schedule import RateSchedule

#: Widths the quantizer codes (bits per value).
QUANT_BITS = (1, 2, 4, 8)
#: Widths sent unquantized: 16 (the range dtype) and 32 (float32).
PASS_BITS = (16, 32)
#: Every width a frame may carry.
ALL_BITS = QUANT_BITS + PASS_BITS
#: Names of the 16-bit dtypes for row ranges and 16-bit passthrough.
RANGE_DTYPE_NAMES = ("fp16", "bf16")
#: How boundary rows get their widths (see :mod:`retexo_fl.compress.boundary`).
BIT_POLICIES = ("fixed", "adaptive-budget", "adaptive-bandwidth")


@dataclass(frozen=True)
class CompressionSettings:
    r"""Compression of boundary rows, model updates and model broadcasts (``docs/compression.md``).

    The ``compression`` section of :class:`~retexo_fl.config.TrainConfig`, and what
    :class:`~retexo_fl.compress.boundary.BoundaryEncoder` takes.

    Args:
        bits (int, optional): bits per value of boundary rows under the ``fixed`` policy, one of
            :obj:`ALL_BITS`. (default: :obj:`32`)
        bit_policy (str, optional): ``"fixed"``, ``"adaptive-budget"`` or
            ``"adaptive-bandwidth"``. (default: :obj:`"fixed"`)
        byte_budget (str, optional): bytes per client and exchange, or ``"<r>b"`` for what
            ``r``-bit frames cost; empty for none. (default: :obj:`""`)
        link_bandwidths (str, optional): ``"P:bw,P-Q:bw,default:bw"`` in bytes/s, or a JSON file of
            the same keys (``adaptive-bandwidth``). (default: :obj:`""`)
        time_budget (float, optional): seconds per exchange for ``adaptive-bandwidth``; :obj:`0`
            derives it from the byte budget. (default: :obj:`0.0`)
        rate_schedule (str, optional): ``"fixed"``, ``"linear:LO,HI"`` or ``"step:R0,R1,..."``
            (bits per value over exchanges). (default: :obj:`"fixed"`)
        update_bits (int, optional): bits per value of model updates (deltas with error feedback
            below 32). (default: :obj:`4`)
        broadcast_bits (int, optional): bits per value of the server's model broadcast (deltas
            below 32, the whole state at 32). (default: :obj:`4`)
        range_dtype (str, optional): dtype of the per-row ranges and of 16-bit passthrough,
            ``"fp16"`` or ``"bf16"``. (default: :obj:`"fp16"`)
    """

    bits: int = 32
    bit_policy: str = "fixed"
    byte_budget: str = ""
    link_bandwidths: str = ""
    time_budget: float = 0.0
    rate_schedule: str = "fixed"
    update_bits: int = 4
    broadcast_bits: int = 4
    range_dtype: str = "fp16"

    def validate(self) -> CompressionSettings:
        """Raise :class:`ValueError` naming the first bad setting; return ``self`` otherwise."""
        if self.broadcast_bits not in ALL_BITS:
            raise ValueError(f"broadcast-bits must be one of {ALL_BITS}, got {self.broadcast_bits}")
        if self.bits not in ALL_BITS or self.update_bits not in ALL_BITS:
            raise ValueError(
                f"bits and update-bits must be one of {ALL_BITS}, got {self.bits}, {self.update_bits}"
            )
        if self.bit_policy not in BIT_POLICIES:
            raise ValueError(f"bit-policy must be one of {BIT_POLICIES}, got {self.bit_policy!r}")
        if self.range_dtype not in RANGE_DTYPE_NAMES:
            raise ValueError(f"range-dtype must be fp16 or bf16, got {self.range_dtype!r}")
        if self.bit_policy == "adaptive-budget" and not self.byte_budget and self.rate_schedule == "fixed":
            raise ValueError(
                "bit-policy adaptive-budget needs byte-budget (bytes, or e.g. 4b) or a rate-schedule"
            )
        if self.bit_policy == "adaptive-bandwidth" and not self.link_bandwidths:
            raise ValueError("bit-policy adaptive-bandwidth needs link-bandwidths")
        RateSchedule.parse(self.rate_schedule)  # its errors name rate-schedule
        return self
