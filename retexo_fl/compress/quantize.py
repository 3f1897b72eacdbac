"""Stochastic b-bit quantization of row blocks with a per-row range, dense bit packing (AdaQP).

A row ``x`` of ``d`` values is sent as its range ``[lo, hi]`` (fp16 or bf16, rounded outward
so every value lies inside) and ``d`` codes of ``b`` bits::

    step = (hi - lo) / (2^b - 1)
    q    = floor((x - lo) / step + u),  u ~ U(0, 1)
    x~   = lo + q * step

so ``E[x~] = x`` and ``|x~ - x| < step`` per element. A constant row whose value is exact in the
range dtype has ``step = 0`` and comes back exactly (no division by zero). 16 bits (fp16 or bf16)
and 32 bits (float32) are passthrough. Rows may carry different bit widths; their codes are then
packed group by group, in increasing bit width, each group in row order.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from retexo_fl.compress import native
from retexo_fl.compress.settings import ALL_BITS, PASS_BITS, QUANT_BITS, RANGE_DTYPE_NAMES

log = logging.getLogger(__name__)

RANGE_DTYPES = dict(zip(RANGE_DTYPE_NAMES, (torch.float16, torch.bfloat16), strict=True))
# Rows encoded per block: intermediates of a block stay in cache, so encode reads the input once.
_BLOCK_VALUES = 1 << 20


def _fused(t: Tensor) -> bool:
    """Whether the fused GPU kernels (:mod:`retexo_fl.compress.fused`) serve ``t``; imported
    only for CUDA tensors, so a CPU process never pays for importing Triton."""
    if not t.is_cuda:
        return False
    from retexo_fl.compress import fused

    return fused.usable(t)


def _one_pass(device: torch.device) -> bool:
    """Whether the torch ops run over a whole group at once rather than block by block.

    Blocks keep a CPU's intermediates in cache; on a GPU they only multiply kernel launches (a
    1,000,000 x 64 block was 61 blocks of five kernels each). Either way the codes are the same:
    the operations on each element, and their order, do not change.
    """
    return device.type != "cpu"


class CodecError(ValueError):
    """Input a codec refuses: non-finite values, unknown bit widths, ranges the dtype cannot hold."""


class RangeOverflow(CodecError):
    """Values beyond what the block's 16-bit dtype (fp16 or bf16) can hold."""


#: Where a block was sent with bf16 ranges for want of fp16's: said once per process and place.
_widened: set[str] = set()


@dataclass
class QuantizedRows:
    """A ``[k, d]`` row block in quantized form.

    Args:
        shape (tuple[int, int]): ``(k, d)`` of the original block.
        bits (Tensor): ``[k]`` uint8 bit width per row (all equal for a fixed-width block). On
            the host when the block was coded at one ``int`` width, wherever the codes are, so
            reading the width costs no device sync; per-row widths stay where they were given.
            Replaced, never written in place (one width is one byte viewed ``k`` times).
        lo (Tensor): ``[k]`` lower end of each row's range (fp16 / bf16); empty for passthrough.
        hi (Tensor): ``[k]`` upper end of each row's range; empty for passthrough.
        data (Tensor): uint8 codes, packed densely per bit-width group; raw values for passthrough.
        half (str, optional): the 16-bit passthrough dtype name (``fp16`` or ``bf16``) or range
            dtype name. (default: :obj:`"fp16"`)
    """

    shape: tuple[int, int]
    bits: Tensor
    lo: Tensor
    hi: Tensor
    data: Tensor
    half: str = "fp16"

    def __post_init__(self) -> None:
        # ``uniform_bits`` of the ``bits`` tensor it was read from, with that tensor's version:
        # scanning a million-row block's widths cost more host time than the GPU's whole
        # decode. An attribute, not a field: ``asdict`` and the constructor do not see it.
        self._width_read: tuple[Tensor, int, int | None] | None = None

    def _memo_key(self) -> tuple[Tensor, int] | None:
        # Inference tensors keep no version counter: their widths are read every time.
        return None if self.bits.is_inference() else (self.bits, self.bits._version)

    @property
    def uniform_bits(self) -> int | None:
        """The common bit width, or ``None`` when rows differ (32 for a block of no rows)."""
        bits, read, key = self.bits, self._width_read, self._memo_key()
        if read is not None and key is not None and read[0] is key[0] and read[1] == key[1]:
            return read[2]
        if bits.numel() == 0:
            width = 32
        else:
            first = int(bits[0])
            width = first if bool((bits == first).all()) else None
        self._width_read = None if key is None else (*key, width)
        return width

    def known_width(self, width: int) -> QuantizedRows:
        """This block, recorded as ``width`` bits in every row without a scan: for its encoder,
        or a frame whose header gave one width, which know it. A block of no rows keeps the
        width :attr:`uniform_bits` gives it (32).

        Args:
            width (int): the width every row has.
        """
        key = self._memo_key()
        if key is not None and self.bits.numel():
            self._width_read = (*key, width)
        return self

    @property
    def nbytes(self) -> int:
        """Bytes of codes and per-row ranges (what :func:`packed_size` predicts)."""
        return self.data.numel() + 2 * (self.lo.numel() + self.hi.numel())


def fixed_widths(k: int, bits: int) -> Tensor:
    """The ``[k]`` widths of a block coded at one ``bits``: one host byte viewed ``k`` times, not
    ``k`` bytes filled. A block's widths are replaced, never written in place (a write to this
    view writes every row's width).

    Args:
        k (int): rows.
        bits (int): the width of every row.
    """
    return torch.full((1,), bits, dtype=torch.uint8).expand(k)


def packed_size(count: int, bits: int) -> int:
    """Bytes that ``count`` values take at ``bits`` bits, packed densely.

    Args:
        count (int): the number of values.
        bits (int): bits per value.
    """
    return (count * bits + 7) // 8


def snap_bits(rate: float) -> int:
    """The widest codec width not above ``rate`` bits per value (at least 1 bit).

    Args:
        rate (float): bits per value, e.g. a :class:`~retexo_fl.compress.schedule.RateSchedule`'s.
    """
    return max([b for b in ALL_BITS if b <= rate + 1e-9] or [1])


def _round_out(values: Tensor, dtype: torch.dtype, down: bool) -> Tensor:
    """``values`` in ``dtype``, rounded toward -inf (``down``) or +inf, so the range stays a bound."""
    out = values.to(dtype)
    bad = out.float() > values if down else out.float() < values
    toward = torch.full((), float("-inf") if down else float("inf"), dtype=dtype, device=out.device)
    # where() over the whole block: indexing the half of the rows that need a step costs 3x more.
    return torch.where(bad, torch.nextafter(out, toward.expand_as(out)), out)


def _pack(codes: Tensor, bits: int, compiled: bool) -> Tensor:
    """Flat uint8 codes < 2^bits -> ``ceil(n * bits / 8)`` bytes, first value in the low bits."""
    if bits == 8:
        return codes
    if compiled:
        return native.pack(codes, bits)
    per = 8 // bits
    n = codes.numel()
    pad = (-n) % per
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    lanes = codes.view(-1, per)
    out = lanes[:, 0].clone()
    for i in range(1, per):
        out |= lanes[:, i] << (i * bits)
    return out


def _unpack(packed: Tensor, bits: int, count: int, compiled: bool) -> Tensor:
    if bits == 8:
        return packed[:count]
    if compiled:
        return native.unpack(packed, bits, count)
    per = 8 // bits
    mask = (1 << bits) - 1
    out = torch.empty(packed.numel(), per, dtype=torch.uint8, device=packed.device)
    for i in range(per):
        out[:, i] = (packed >> (i * bits)) & mask
    return out.view(-1)[:count]


def _dither(k: int, d: int, generator: torch.Generator | None, device: torch.device) -> tuple[Tensor, Tensor]:
    """The random draws of a ``[k, d]`` group's stochastic rounding: ``(table, shift)``.

    Drawing k*d uniforms costs more than the rest of the encoder together, so the dither of
    element (i, j) is frac(D[i mod block, j] + r_i): D one [block, d] draw, r one draw per row.
    Each dither is U(0, 1) (r_i is uniform and independent of D), which is all unbiasedness
    needs; rows stay pairwise independent column by column.
    """
    block = max(1, min(k, _BLOCK_VALUES // max(d, 1)))
    table = torch.rand(block, d, generator=generator, device=device)
    shift = torch.rand(k, generator=generator, device=device)
    return table, shift


def _scales(lo: Tensor, hi: Tensor, bits: int) -> tuple[Tensor, Tensor, float]:
    """``(inv, offset, levels)`` of rows ranged ``[lo, hi]`` at ``bits``: a value's code is
    ``floor(x * inv - offset + dither)``."""
    levels = float((1 << bits) - 1)
    step = (hi.float() - lo.float()) / levels
    inv = torch.where(step > 0, 1.0 / step.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    return inv, lo.float() * inv, levels


def _quantize_group(
    x: Tensor, lo: Tensor, hi: Tensor, bits: int, generator: torch.Generator | None, compiled: bool
) -> Tensor:
    """Codes of a ``[k, d]`` group whose rows all use ``bits``; flat ``[k * d]`` uint8."""
    k, d = x.shape
    table, shift = _dither(k, d, generator, x.device)
    if not compiled and _fused(x):
        from retexo_fl.compress import fused

        try:
            return fused.quantize(x, table, shift, lo, hi, float((1 << bits) - 1)).view(-1)
        except fused.KernelUnavailable:
            pass  # the torch ops below, on the same dither: the same codes
    if compiled:
        levels = float((1 << bits) - 1)
        inv, offset = native.row_scales(lo, hi, levels)
    else:
        inv, offset, levels = _scales(lo, hi, bits)
    return _group_codes(x, table, shift, inv, offset, levels, compiled)


def _group_codes(
    x: Tensor, table: Tensor, shift: Tensor, inv: Tensor, offset: Tensor, levels: float, compiled: bool
) -> Tensor:
    """Codes of a ``[k, d]`` group from its dither (:func:`_dither`) and scales (:func:`_scales`)."""
    k, d = x.shape
    block = table.shape[0]
    if compiled:
        return native.quantize(x, table, shift, inv, offset, levels).view(-1)
    # The same single-rounding float32 operations as the compiled loop, in its order, so codes
    # are equal with and without a compiler (native.py).
    codes = torch.empty(k, d, dtype=torch.uint8, device=x.device)
    if _one_pass(x.device):
        # Rows [0, whole) as [blocks, block, d], so table row i mod block broadcasts; then the rest.
        whole = k - k % block
        spans = [(0, whole, block), (whole, k, k - whole)] if whole < k else [(0, k, block)]
        for start, stop, rows in spans:
            if stop == start:
                continue
            shape = (-1, rows, 1)
            u = torch.add(table[:rows], shift[start:stop].view(shape)).frac_()
            v = torch.mul(x[start:stop].view(-1, rows, d), inv[start:stop].view(shape))
            v.add_(u).sub_(offset[start:stop].view(shape))
            codes[start:stop] = v.clamp_(0.0, levels).view(-1, d)
        return codes.view(-1)
    for start in range(0, k, block):
        stop = min(k, start + block)
        u = torch.add(table[: stop - start], shift[start:stop, None]).frac_()
        # v = (x - lo) / step + u, floored by the uint8 cast (v >= 0); clamp guards round-off.
        v = torch.mul(x[start:stop], inv[start:stop, None]).add_(u).sub_(offset[start:stop, None])
        codes[start:stop] = v.clamp_(0.0, levels)
    return codes.view(-1)


def _width_groups(row_bits: Tensor, uniform: int | None) -> list[tuple[int, Tensor | None]]:
    """``(bits, rows)`` per width present, in increasing width; ``rows`` is ``None`` for all rows."""
    if uniform is not None:
        return [(uniform, None)]  # one width: no per-width scans of the row widths
    groups = []
    for b in QUANT_BITS:
        sel = (row_bits == b).nonzero().view(-1)
        if sel.numel() == row_bits.numel():
            return [(b, None)]
        if sel.numel():
            groups.append((b, sel))
    return groups


def _refuse_nonfinite(x: Tensor, bad_rows: Tensor, where: str) -> None:
    bad = bad_rows.nonzero().view(-1)
    if bad.numel():
        raise CodecError(
            f"{where}: {bad.numel()} row(s) hold NaN or Inf (first row {int(bad[0])}); refusing to send them"
        )


def _row_ranges(x: Tensor, half: str, where: str, compiled: bool) -> tuple[Tensor, Tensor]:
    """Each row's ``[lo, hi]`` in the ``half`` dtype, rounded outward; raises :class:`CodecError`
    on a row that cannot be coded."""
    if compiled:
        ranges = native.row_ranges(x.contiguous(), RANGE_DTYPES[half])
        if ranges is not None:  # one pass, the same ranges as the checks below give
            return ranges
        mn, mx, bad_rows = native.row_extremes(x.contiguous())
    else:
        mn, mx = torch.aminmax(x, dim=1)  # NaN and Inf propagate into the row extremes
        bad_rows = ~(torch.isfinite(mn) & torch.isfinite(mx))
    _refuse_nonfinite(x, bad_rows, where)
    # -0.0 becomes 0.0: which zero a row's extreme is depends on the reduction order.
    mn, mx = mn + 0.0, mx + 0.0
    lo = _round_out(mn, RANGE_DTYPES[half], down=True)
    hi = _round_out(mx, RANGE_DTYPES[half], down=False)
    if not (bool(torch.isfinite(lo).all()) and bool(torch.isfinite(hi).all())):
        advice = "use bf16 ranges or 32 bits" if half == "fp16" else "use 32 bits"
        raise RangeOverflow(f"{where}: values exceed the {half} range; {advice}")
    if not bool(torch.isfinite(hi.float() - lo.float()).all()):  # bf16 ends near +-3e38
        raise CodecError(f"{where}: a row spans more than float32 can step across; use 32 bits")
    return lo, hi


def _fused_ranges(x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor] | None:
    """The rows' ranges from the fused kernel (one read of the block) with each row's status,
    not yet read, or ``None`` where the kernel does not serve. A status above 0 means the torch
    checks must take the block, to name its fault."""
    if not _fused(x):
        return None
    from retexo_fl.compress import fused

    try:
        return fused.row_ranges_pending(x, dtype)
    except fused.KernelUnavailable:
        return None


def _rng_state(generator: torch.Generator | None, device: torch.device) -> Tensor:
    """The random source's state (a CUDA generator's is its seed and offset, held on the host:
    reading it waits for nothing)."""
    if generator is not None:
        return generator.get_state()
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_rng_state(generator: torch.Generator | None, device: torch.device, state: Tensor) -> None:
    """Put back a state :func:`_rng_state` read from the same source."""
    if generator is not None:
        generator.set_state(state)
    elif device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def _quantize_fused(
    x: Tensor, bits: int, ranges: tuple[Tensor, Tensor, Tensor], generator: torch.Generator | None
) -> tuple[Tensor, Tensor, Tensor] | None:
    """``(lo, hi, packed codes)`` of a block at one width, with the fused ranges' status read
    only after the codes are queued, or ``None`` (the random source as it was) when a row
    needs the torch checks.

    Reading the status at once left the GPU idle while the host queued the scales, the dither
    and the encoder, a third of a million-row encode; the codes of a refused block are dropped.
    """
    lo, hi, status = ranges
    state = _rng_state(generator, x.device)
    packed = _pack(_quantize_group(x, lo, hi, bits, generator, False), bits, False)
    if int(status.max()) == 0:
        return lo, hi, packed
    # The refused block's dither was drawn: the torch path draws it again, as a call that never
    # tried the kernels would (so a block retried in bf16 gets the codes a bf16 call gives).
    _set_rng_state(generator, x.device, state)
    return None


def quantize_rows(
    x: Tensor,
    bits: int | Tensor,
    *,
    generator: torch.Generator | None = None,
    half: str = "fp16",
    where: str = "rows",
) -> QuantizedRows:
    """Quantize a ``[k, d]`` float block, every row at ``bits`` or row ``i`` at ``bits[i]``.

    A block whose values exceed fp16's range (65504) is sent in bf16 instead (its ranges, or its
    values at 16 bits): the frame records its dtype, so a receiver decodes it either way, and a
    client whose values grew large is not dropped from the run for it. The first such block of
    each place is logged. ``generator`` is drawn from only once the dtype is settled, so the
    codes are those a ``half="bf16"`` call gives.

    Args:
        x (Tensor): values (any float dtype; computed in float32).
        bits (int | Tensor): one width from ``(1, 2, 4, 8, 16, 32)``, or a tensor of widths from
            ``(1, 2, 4, 8)``, one per row.
        generator (torch.Generator | None, optional): the random source of the stochastic rounding
            (on ``x``'s device). (default: :obj:`None`)
        half (str, optional): dtype of the per-row ranges and of 16-bit passthrough, ``fp16`` or
            ``bf16``. (default: :obj:`"fp16"`)
        where (str, optional): names the stage / client in error messages. (default: :obj:`"rows"`)

    Shapes:
        - **input:** ``x`` ``[k, d]``, ``bits`` ``[k]`` when per row
        - **output:** a :class:`QuantizedRows` of shape ``(k, d)``

    Raises:
        CodecError: on a block that is not 2-D, an unknown ``half``, NaN / Inf, an unknown width,
            a number of widths other than ``k``, or a range bf16 cannot represent.
    """
    try:
        return _quantize_rows(x, bits, generator, half, where)
    except RangeOverflow:
        if half != "fp16":
            raise
    place = where.split(",")[0]
    if place not in _widened:
        _widened.add(place)
        log.warning("%s: values exceed fp16's range; sending such blocks in bf16", where)
    return _quantize_rows(x, bits, generator, "bf16", where)


def quantize_stacked(
    x: Tensor,
    bits: int,
    generators: Sequence[torch.Generator | None],
    *,
    half: str = "fp16",
    wheres: Sequence[str] | None = None,
) -> list[QuantizedRows]:
    """Quantize many equally shaped blocks, each with its own random source: equal, block for
    block and bit for bit, to :func:`quantize_rows` on each.

    Many small clients of one process (one node each) send updates of the same shapes; each
    :func:`quantize_rows` call costs about 0.3 ms of checks and launches for a few thousand
    values. Here the ranges, checks and scales are computed once over all blocks; each block's
    dither is drawn from its own generator, in the order :func:`quantize_rows` draws it, and
    coded by the same loop. A stack that one width cannot serve in one pass (16 or 32 bits, an
    empty block, a device other than the CPU), or any block a check refuses, is quantized block
    by block, so that errors and a block widened to bf16 are exactly those of the one-block call.

    Args:
        x (Tensor): ``[n, k, d]``: ``n`` blocks of ``[k, d]`` values.
        bits (int): one width from ``(1, 2, 4, 8, 16, 32)`` for every block.
        generators (Sequence[torch.Generator | None]): block ``i``'s random source.
        half (str, optional): dtype of the per-row ranges, ``fp16`` or ``bf16``.
            (default: :obj:`"fp16"`)
        wheres (Sequence[str], optional): names block ``i``'s sender in errors.
            (default: ``"rows"`` for each)

    Shapes:
        - **input:** ``x`` ``[n, k, d]``
        - **output:** ``n`` :class:`QuantizedRows` of shape ``(k, d)``

    Raises:
        CodecError: as :func:`quantize_rows` does on the first block it refuses.
    """
    n = x.shape[0]
    names = list(wheres) if wheres is not None else ["rows"] * n
    if len(generators) != n or len(names) != n:
        raise ValueError(f"{n} blocks need {n} generators and names, got {len(generators)} and {len(names)}")

    def one_by_one() -> list[QuantizedRows]:
        return [
            quantize_rows(x[i], bits, generator=generators[i], half=half, where=names[i]) for i in range(n)
        ]

    if x.dim() != 3 or bits not in QUANT_BITS or half not in RANGE_DTYPES or x.device.type != "cpu":
        return one_by_one()
    _, k, d = x.shape
    flat = x.detach().float().reshape(n * k, d).contiguous()
    if n == 0 or k == 0 or d == 0:
        return one_by_one()
    compiled = native.usable(flat)
    try:
        lo, hi = _row_ranges(flat, half, "rows", compiled)
    except CodecError:
        return one_by_one()  # the block's own call names it (or sends it in bf16)
    inv, offset, levels = _scales(lo, hi, bits)
    row_bits = fixed_widths(k, bits)
    out = []
    for i in range(n):
        rows = slice(i * k, (i + 1) * k)
        table, shift = _dither(k, d, generators[i], flat.device)
        codes = _group_codes(flat[rows], table, shift, inv[rows], offset[rows], levels, compiled)
        block = QuantizedRows((k, d), row_bits, lo[rows], hi[rows], _pack(codes, bits, compiled), half)
        out.append(block.known_width(bits))
    return out


def _quantize_rows(
    x: Tensor, bits: int | Tensor, generator: torch.Generator | None, half: str, where: str
) -> QuantizedRows:
    if x.dim() != 2:
        raise CodecError(f"{where}: rows must be 2-D, got shape {tuple(x.shape)}")
    if half not in RANGE_DTYPES:
        raise CodecError(f"{where}: range dtype must be fp16 or bf16, got {half!r}")
    k, d = x.shape
    x = x.detach().float()
    empty = torch.empty(0, dtype=RANGE_DTYPES[half], device=x.device)
    if isinstance(bits, int):
        if bits not in ALL_BITS:
            raise CodecError(f"{where}: bit width must be one of {ALL_BITS}, got {bits}")
        if bits in PASS_BITS:
            dtype = torch.float32 if bits == 32 else RANGE_DTYPES[half]
            advice = "use bf16 or 32 bits" if half == "fp16" else "use 32 bits"
            overflow = RangeOverflow(f"{where}: values overflow {half}; {advice}")
            if x.numel() and native.usable(x):  # passthrough: the only use of the loops here
                x = x.contiguous()
                mn, mx, bad_rows = native.row_extremes(x)
                _refuse_nonfinite(x, bad_rows, where)
                # Rounding is monotonic: a row overflows exactly when one of its extremes does.
                if bits == 16 and not bool(torch.isfinite(torch.cat([mn, mx]).to(dtype)).all()):
                    raise overflow
                values = x.to(dtype)
            else:
                values = x.to(dtype).contiguous()
                bad_rows = ~torch.isfinite(values).all(dim=1)  # also catches fp16 overflow
                if bits == 16 and bool(bad_rows.any()) and bool(torch.isfinite(x[bad_rows]).all()):
                    raise overflow
                _refuse_nonfinite(x, bad_rows, where)
            data = values.view(-1).view(torch.uint8)
            row_bits = fixed_widths(k, bits)
            return QuantizedRows((k, d), row_bits, empty, empty, data, half).known_width(bits)
        # On the host, as for passthrough: reading one width back is then no device round trip.
        row_bits = fixed_widths(k, bits)
    else:
        row_bits = bits.to(device=x.device, dtype=torch.uint8).view(-1)
        if row_bits.numel() != k:
            raise CodecError(f"{where}: {row_bits.numel()} bit widths for {k} rows")
        if not bool(torch.isin(row_bits, torch.tensor(QUANT_BITS, device=x.device, dtype=torch.uint8)).all()):
            raise CodecError(f"{where}: per-row bit widths must be in {QUANT_BITS}")
    if k == 0 or d == 0:
        lo = hi = torch.zeros(k, dtype=RANGE_DTYPES[half], device=x.device)
        codes = torch.empty(0, dtype=torch.uint8, device=x.device)  # where a block's codes live
        return QuantizedRows((k, d), row_bits, lo, hi, codes, half)
    compiled = native.usable(x)  # decided once for the whole block
    pending = None if compiled else _fused_ranges(x, RANGE_DTYPES[half])
    ready = None
    if pending is not None and isinstance(bits, int):
        done = _quantize_fused(x, bits, pending, generator)
        if done is not None:
            return QuantizedRows((k, d), row_bits, *done, half).known_width(bits)
    elif pending is not None and int(pending[2].max()) == 0:
        ready = pending[:2]
    lo, hi = ready if ready is not None else _row_ranges(x, half, where, compiled)
    parts = []
    for b, sel in _width_groups(row_bits, bits if isinstance(bits, int) else None):
        xs, ls, hs = (x, lo, hi) if sel is None else (x[sel], lo[sel], hi[sel])
        parts.append(_pack(_quantize_group(xs, ls, hs, b, generator, compiled), b, compiled))
    out = QuantizedRows((k, d), row_bits, lo, hi, torch.cat(parts) if len(parts) > 1 else parts[0], half)
    return out.known_width(bits) if isinstance(bits, int) else out


def dequantize_rows(q: QuantizedRows) -> Tensor:
    """The float32 ``[k, d]`` block a :class:`QuantizedRows` stands for.

    Args:
        q (QuantizedRows): the quantized block.

    Shapes:
        - **output:** ``[k, d]`` float32, on ``q.data``'s device
    """
    k, d = q.shape
    if k == 0 or d == 0:
        return torch.zeros(k, d, device=q.data.device)
    width = q.uniform_bits
    if width in PASS_BITS and q.lo.numel() == 0:
        dtype = torch.float32 if width == 32 else RANGE_DTYPES[q.half]
        return q.data.view(dtype).float().view(k, d)
    compiled = native.usable(q.data)  # decided once for the whole block
    if compiled and width in QUANT_BITS and q.lo.dtype == q.hi.dtype == RANGE_DTYPES[q.half]:
        return native.dequantize_packed(q.data, width, k, d, q.lo, q.hi)  # one pass, the same values
    fused = not compiled and _fused(q.data)
    groups = _width_groups(q.bits, width if width in QUANT_BITS else None)
    # The loops return a whole group's rows: with one group they are the output itself.
    out = None if (compiled or fused) and len(groups) == 1 else torch.empty(k, d, device=q.data.device)
    offset = 0
    for b, sel in groups:
        n = (k if sel is None else sel.numel()) * d
        size = packed_size(n, b)
        codes = _unpack(q.data[offset : offset + size], b, n, compiled).view(-1, d)
        offset += size
        lo, hi = (q.lo, q.hi) if sel is None else (q.lo[sel], q.hi[sel])
        rows = None
        if fused:
            from retexo_fl.compress import fused as kernels

            with contextlib.suppress(kernels.KernelUnavailable):  # else the torch ops: the same values
                rows = kernels.dequantize(codes, lo, hi, float((1 << b) - 1))
        if rows is None:
            lo, hi = lo.float(), hi.float()
            step = (hi - lo) / float((1 << b) - 1)
            if compiled:
                rows = native.dequantize(codes, lo, step)
            elif fused:
                rows = torch.mul(codes.float(), step[:, None]).add_(lo[:, None])
        if rows is not None:
            if out is None:
                return rows
            out[sel] = rows
        elif sel is None and _one_pass(codes.device):
            torch.mul(codes.float(), step[:, None], out=out).add_(lo[:, None])
        elif sel is None:
            block = max(1, _BLOCK_VALUES // max(d, 1))
            for start in range(0, k, block):  # blockwise, so the float codes stay in cache
                stop = min(k, start + block)
                # codes * step + lo, one rounding each, as the compiled loop does it
                torch.mul(codes[start:stop].float(), step[start:stop, None], out=out[start:stop])
                out[start:stop].add_(lo[start:stop, None])
        else:
            out[sel] = torch.mul(codes.float(), step[:, None]).add_(lo[:, None])
    return out
