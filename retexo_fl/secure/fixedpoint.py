r"""Fixed-point encoding of float update vectors into :math:`\mathbb{Z}_{2^{32}}` for secure aggregation.

Masks only hide what lives in a finite group, so before masking each client turns its (already
clipped) float update into integers modulo :math:`2^{32}`, held in numpy ``uint32`` arrays whose
addition wraps around, as Flower's SecAgg+ does. The server only ever learns the wrapped sum, so
the encoding must make that sum decodable: each value :math:`x \in [-c, c]` becomes
:math:`q = \mathrm{round}(x \cdot 2^s) + K` with :math:`K = \lceil c \cdot 2^s \rceil`, an integer in
:math:`[0, 2K]`, and the sum of :math:`n` of them lies in :math:`[0, 2nK]`. It never wraps when

.. math:: 2 n K = 2 n \lceil c \cdot 2^s \rceil \le 2^{32} - 1,

which :class:`FixedPoint` checks at construction for the most clients it will sum. Rounding is
stochastic (up with probability equal to the fractional part), so the encoding is unbiased:
:math:`E[q - K] = x \cdot 2^s`. Each coordinate's rounding moves it by less than :math:`2^{-s}`,
so a decoded sum of :math:`n` vectors is within :math:`n \cdot 2^{-s}` of the float sum.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

#: Masked vectors and their sums are integers modulo this.
MODULUS = 2**32
#: Their numpy type: addition and subtraction of arrays wrap modulo :data:`MODULUS`.
DTYPE = np.uint32


def _fits(clip: float, clients: int, scale_bits: int) -> bool:
    return 2 * clients * math.ceil(math.ldexp(clip, scale_bits)) <= MODULUS - 1


def _check(clip: float, clients: int) -> None:
    if isinstance(clip, bool) or not (math.isfinite(clip) and clip > 0):
        raise ValueError(f"fixed point: clip must be a finite float > 0, got {clip!r}")
    if isinstance(clients, bool) or not isinstance(clients, int) or clients < 1:
        raise ValueError(f"fixed point: clients must be an int >= 1, got {clients!r}")


def max_scale_bits(clip: float, clients: int) -> int:
    """The largest ``scale_bits`` whose sums of up to ``clients`` vectors clipped to ``clip`` never wrap.

    Args:
        clip (float): the largest magnitude of an encoded value, > 0.
        clients (int): the most vectors summed, >= 1.

    Raises:
        ValueError: ``clip`` or ``clients`` is out of range, or no ``scale_bits`` >= 0 fits (``clip``
            too large for that many clients), naming both.
    """
    _check(clip, clients)
    limit = (MODULUS - 1) // (2 * clients)  # the largest offset K that fits
    if limit >= 1:
        # log2 in floats is an estimate near powers of two; the exact check settles it.
        bits = max(0, math.floor(math.log2(limit) - math.log2(clip)) + 1)
        while bits >= 0 and not _fits(clip, clients, bits):
            bits -= 1
        if bits >= 0:
            return bits
    raise ValueError(
        f"fixed point: no scale fits {clients} clients with clip {clip}: "
        f"2 * clients * ceil(clip) = {2 * clients * math.ceil(clip)} > 2**32 - 1"
    )


@dataclass(frozen=True)
class FixedPoint:
    r"""Floats in :math:`[-c, c]` to integers modulo :math:`2^{32}` at :math:`2^{-s}` resolution, and back.

    Values outside ``[-clip, clip]`` are clipped to it, not refused: clients clip their updates
    before encoding, and a float32 update clipped to a float64 ``clip`` may exceed it by an ulp.
    NaN and infinities are refused.

    Args:
        clip (float): the largest magnitude encoded, > 0.
        clients (int): the most vectors whose sum is decoded, >= 1.
        scale_bits (int, optional): :math:`s`, the fractional bits kept; :obj:`None` for the
            largest that fits (:func:`max_scale_bits`). (default: :obj:`None`)

    Raises:
        ValueError: ``clip`` or ``clients`` out of range, or ``2 * clients * ceil(clip * 2**scale_bits)
            > 2**32 - 1`` (a sum could wrap), naming the settings.
    """

    clip: float
    clients: int
    scale_bits: int | None = None

    def __post_init__(self) -> None:
        _check(self.clip, self.clients)
        if self.scale_bits is None:
            object.__setattr__(self, "scale_bits", max_scale_bits(self.clip, self.clients))
        s = self.scale_bits
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ValueError(f"fixed point: scale_bits must be an int >= 0, got {s!r}")
        if not _fits(self.clip, self.clients, s):
            raise ValueError(
                f"fixed point: clip {self.clip}, {self.clients} clients and scale_bits {s} let a sum "
                f"wrap (2 * clients * ceil(clip * 2**scale_bits) = "
                f"{2 * self.clients * math.ceil(math.ldexp(self.clip, s))} > 2**32 - 1); "
                f"use scale_bits <= {max_scale_bits(self.clip, self.clients)}"
            )

    @property
    def offset(self) -> int:
        r""":math:`K = \lceil c \cdot 2^s \rceil`, added to every encoded value to make it non-negative."""
        return math.ceil(math.ldexp(self.clip, self.scale_bits))

    def sum_error(self, n: int) -> float:
        """The worst-case per-coordinate error of a decoded sum of ``n`` vectors: ``n * 2**-scale_bits``.

        Each coordinate's stochastic rounding moves it by less than one step, :math:`2^{-s}`; the
        decoding itself is exact. The bound is strict.

        Args:
            n (int): how many vectors were summed.
        """
        return math.ldexp(n, -self.scale_bits)

    def encode(self, values: npt.ArrayLike, rng: np.random.Generator | None = None) -> np.ndarray:
        """``values`` clipped to ``[-clip, clip]``, scaled by ``2**scale_bits``, stochastically rounded
        and offset by :attr:`offset`.

        Args:
            values (npt.ArrayLike): the floats, any shape (a CPU tensor works).
            rng (np.random.Generator, optional): draws the rounding; :obj:`None` for one seeded
                from the OS. (default: :obj:`None`)

        Returns:
            ``uint32`` integers in ``[0, 2 * offset]``, the shape of ``values``.

        Raises:
            ValueError: a value is NaN or infinite (naming how many).
        """
        x = np.asarray(values, dtype=np.float64)
        bad = int(np.count_nonzero(~np.isfinite(x)))
        if bad:
            raise ValueError(f"fixed point: {bad} of {x.size} values to encode are NaN or infinite")
        # Scaling by a power of two is exact in float64, so the fractional part is exact too.
        scaled = np.ldexp(np.clip(x, -self.clip, self.clip), self.scale_bits)
        low = np.floor(scaled)
        rng = np.random.default_rng() if rng is None else rng
        up = rng.random(x.shape) < (scaled - low)
        return (low.astype(np.int64) + up + self.offset).astype(DTYPE)

    def decode_sum(self, total: np.ndarray, n: int) -> np.ndarray:
        """The float sum of the ``n`` vectors whose encodings add up to ``total`` (modulo ``2**32``).

        Args:
            total (np.ndarray): the ``uint32`` sum of ``n`` outputs of :meth:`encode`.
            n (int): how many were summed, 1 to ``clients``.

        Returns:
            float64, the shape of ``total``, within :meth:`sum_error` of the sum of the encoded floats.

        Raises:
            ValueError: ``total`` is not ``uint32``, ``n`` is out of range, or a coordinate exceeds
                ``2 * n * offset`` (not a sum of ``n`` encodings: wrongly unmasked, or a client sent
                more than its share), naming how many.
        """
        if not isinstance(total, np.ndarray) or total.dtype != DTYPE:
            raise ValueError(f"fixed point: a sum to decode is a uint32 array, got {type(total).__name__}")
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.clients:
            raise ValueError(f"fixed point: can decode a sum of 1 to {self.clients} vectors, not {n!r}")
        centred = total.astype(np.int64) - n * self.offset
        bad = int(np.count_nonzero(centred > n * self.offset))
        if bad:
            raise ValueError(
                f"fixed point: {bad} of {total.size} coordinates exceed {2 * n * self.offset}, "
                f"so this is not a sum of {n} encoded vectors"
            )
        return np.ldexp(centred.astype(np.float64), -self.scale_bits)


def field_sum(vectors: Iterable[np.ndarray]) -> np.ndarray:
    """The sum of ``uint32`` vectors modulo ``2**32``.

    Args:
        vectors (Iterable[np.ndarray]): one or more ``uint32`` arrays of one shape.

    Raises:
        ValueError: none given, or one is not ``uint32`` or has another shape (naming its position).
    """
    total: np.ndarray | None = None
    for k, v in enumerate(vectors):
        if not isinstance(v, np.ndarray) or v.dtype != DTYPE:
            raise ValueError(f"field sum: vector {k} is not a uint32 array")
        if total is None:
            total = v.copy()
        elif v.shape != total.shape:
            raise ValueError(f"field sum: vector {k} has shape {v.shape}, the first {total.shape}")
        else:
            total += v  # uint32 arrays wrap modulo 2**32
    if total is None:
        raise ValueError("field sum: no vectors to add")
    return total
