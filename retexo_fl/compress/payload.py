"""The wire frame of a row block: a 15-byte header, then per-row widths and ranges, then the codes.

Layout (little endian)::

    magic "RXQ1" | bits u8 (1/2/4/8/16/32, or 0 = per-row widths) | half u8 (1 fp16, 2 bf16)
    | pad u8 | rows u32 | cols u32
    [rows x u8 widths, when bits == 0]
    [rows x lo, rows x hi in the half dtype, when quantized]
    codes (dense, per width group) or raw values (16 / 32 bits)

The header alone fixes the frame's exact size, so a truncated or padded frame is rejected before
any value is read.
"""

from __future__ import annotations

import struct

import numpy as np
import torch
from torch import Tensor

from retexo_fl.compress.quantize import (
    ALL_BITS,
    QUANT_BITS,
    RANGE_DTYPES,
    QuantizedRows,
    dequantize_rows,
    fixed_widths,
    packed_size,
    quantize_rows,
)

_HEADER = struct.Struct("<4sBBBII")
HEADER_BYTES = _HEADER.size
_MAGIC = b"RXQ1"
_HALF_CODES = {"fp16": 1, "bf16": 2}
_HALF_NAMES = {v: k for k, v in _HALF_CODES.items()}


class PayloadError(ValueError):
    """A boundary payload does not match its header or what the receiver expects."""


def frame_size(rows: int, cols: int, bits: int | Tensor) -> int:
    """Exact bytes of a frame for a ``[rows, cols]`` block at ``bits`` (a width or per-row widths).

    Args:
        rows (int): the block's rows.
        cols (int): its columns.
        bits (int | Tensor): one width from ``(1, 2, 4, 8, 16, 32)``, or ``[rows]`` widths from
            ``(1, 2, 4, 8)``.
    """
    if isinstance(bits, int):
        if bits in (16, 32):
            return HEADER_BYTES + rows * cols * bits // 8
        return HEADER_BYTES + 4 * rows + packed_size(rows * cols, bits)
    counts = torch.bincount(bits.view(-1).long(), minlength=9)
    body = sum(packed_size(int(counts[b]) * cols, b) for b in QUANT_BITS)
    return HEADER_BYTES + rows + 4 * rows + body


def _to_bytes(t: Tensor) -> bytes:
    return t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes()


def pack_frame(q: QuantizedRows) -> bytes:
    """Serialize a :class:`QuantizedRows` as a frame (see the module's layout).

    Args:
        q (QuantizedRows): the quantized block.
    """
    k, d = q.shape
    width = q.uniform_bits
    head = _HEADER.pack(_MAGIC, 0 if width is None else width, _HALF_CODES[q.half], 0, k, d)
    parts = [head]
    if width is None:
        parts.append(_to_bytes(q.bits))
    if q.lo.numel() or (width in QUANT_BITS):
        parts += [_to_bytes(q.lo), _to_bytes(q.hi)]
    parts.append(_to_bytes(q.data))
    return b"".join(parts)


def encode_rows(
    rows: Tensor,
    bits: int | Tensor = 32,
    *,
    generator: torch.Generator | None = None,
    half: str = "fp16",
    where: str = "rows",
) -> bytes:
    """Quantize (or pass through) a block and frame it; see :func:`quantize_rows`.

    Args:
        rows (Tensor): the block.
        bits (int | Tensor, optional): one width, or one per row. (default: :obj:`32`)
        generator (torch.Generator | None, optional): the stochastic rounding's random source.
            (default: :obj:`None`)
        half (str, optional): dtype of the ranges and of 16-bit passthrough, ``fp16`` or
            ``bf16``. (default: :obj:`"fp16"`)
        where (str, optional): names the stage / client in errors. (default: :obj:`"rows"`)

    Shapes:
        - **input:** ``rows`` ``[k, d]``, ``bits`` ``[k]`` when per row

    Raises:
        CodecError: as :func:`quantize_rows` does.
    """
    return pack_frame(quantize_rows(rows, bits, generator=generator, half=half, where=where))


def unpack_frame(
    data: bytes, source: str, expect_rows: int | None = None, expect_cols: int | None = None
) -> QuantizedRows:
    """Parse a frame, checking magic, widths, dtype, exact size and the expected shape.

    Args:
        data (bytes): the frame.
        source (str): who sent it, for error messages (e.g. ``"client 3"``).
        expect_rows (int | None, optional): the rows the receiver's boundary plan expects.
            (default: :obj:`None`)
        expect_cols (int | None, optional): the columns it expects. (default: :obj:`None`)

    Raises:
        PayloadError: naming ``source`` and what does not match.
    """
    if len(data) < HEADER_BYTES:
        raise PayloadError(f"payload from {source}: {len(data)} bytes is shorter than a header")
    magic, bits, half_code, _, k, d = _HEADER.unpack_from(data)
    if magic != _MAGIC:
        raise PayloadError(f"payload from {source}: bad magic {magic!r}")
    if bits != 0 and bits not in ALL_BITS:
        raise PayloadError(f"payload from {source}: unknown bit width {bits}")
    if half_code not in _HALF_NAMES:
        raise PayloadError(f"payload from {source}: unknown range dtype code {half_code}")
    if expect_rows is not None and k != expect_rows:
        raise PayloadError(f"payload from {source}: {k} rows, boundary plan expects {expect_rows}")
    if expect_cols is not None and d != expect_cols:
        raise PayloadError(f"payload from {source}: {d} columns, expected {expect_cols}")
    half = _HALF_NAMES[half_code]
    offset = HEADER_BYTES
    if bits == 0:
        if len(data) < offset + k:
            raise PayloadError(f"payload from {source}: truncated inside the per-row widths")
        row_bits = torch.from_numpy(np.frombuffer(data, np.uint8, k, offset).copy())
        if not bool(torch.isin(row_bits, torch.tensor(QUANT_BITS, dtype=torch.uint8)).all()):
            raise PayloadError(f"payload from {source}: per-row widths outside {QUANT_BITS}")
        offset += k
        want = frame_size(k, d, row_bits)
    else:
        row_bits = fixed_widths(k, bits)
        want = frame_size(k, d, bits)
    if len(data) != want:
        raise PayloadError(
            f"payload from {source}: header says {k}x{d} at {bits or 'per-row'} bits ({want} bytes) "
            f"but the frame has {len(data)} bytes"
        )
    dtype = RANGE_DTYPES[half]
    empty = torch.empty(0, dtype=dtype)
    lo = hi = empty
    if bits not in (16, 32):
        raw = torch.from_numpy(np.frombuffer(data, np.uint8, 4 * k, offset).copy())
        lo, hi = raw[: 2 * k].view(dtype), raw[2 * k :].view(dtype)
        offset += 4 * k
        # One pass for the valid frame: a finite, non-negative float32 spread means finite,
        # ordered bounds that decode to numbers (an infinite or NaN bound spreads to Inf or NaN;
        # float32 holds every fp16 / bf16 difference's sign, so hi < lo never rounds to 0).
        spread = hi.float() - lo.float()
        if not bool((torch.isfinite(spread) & (spread >= 0)).all()):
            bounds = torch.cat([lo, hi])
            if not (bool(torch.isfinite(bounds).all()) and bool((hi >= lo).all())):
                raise PayloadError(f"payload from {source}: row ranges are not finite, ordered intervals")
            raise PayloadError(f"payload from {source}: a row range is wider than float32 can step")  # NaN
    body = torch.from_numpy(np.frombuffer(data, np.uint8, len(data) - offset, offset).copy())
    q = QuantizedRows((k, d), row_bits, lo, hi, body, half)
    if bits:
        q.known_width(bits)
    if bits in (16, 32):
        values = dequantize_rows(q)
        if not bool(torch.isfinite(values).all()):
            raise PayloadError(f"payload from {source}: values are NaN or Inf")
    return q


def split_frames(data: bytes, source: str, count: int) -> list[bytes]:
    """``count`` frames laid back to back -> the frames (each header fixes its own size).

    An eager frame with halo gradients is two frames joined this way: the rows for the peer,
    then the gradients of the peer's rows (either may have zero rows).

    Args:
        data (bytes): the joined frames.
        source (str): who sent them, for error messages.
        count (int): how many frames ``data`` must hold.

    Raises:
        PayloadError: naming ``source``: a frame is cut short, or bytes are left over.
    """
    out, offset = [], 0
    for i in range(count):
        if len(data) - offset < HEADER_BYTES:
            raise PayloadError(f"payload from {source}: frame {i + 1} of {count} is cut short")
        _, bits, _, _, k, d = _HEADER.unpack_from(data, offset)
        if bits == 0:
            if len(data) - offset < HEADER_BYTES + k:
                raise PayloadError(f"payload from {source}: frame {i + 1} of {count} is cut short")
            widths = np.frombuffer(data, np.uint8, k, offset + HEADER_BYTES)
            if not np.isin(widths, QUANT_BITS).all():
                raise PayloadError(f"payload from {source}: per-row widths outside {QUANT_BITS}")
            size = frame_size(k, d, torch.from_numpy(widths.copy()))
        elif bits in ALL_BITS:
            size = frame_size(k, d, int(bits))
        else:
            raise PayloadError(f"payload from {source}: unknown bit width {bits} in frame {i + 1}")
        if len(data) - offset < size:
            raise PayloadError(f"payload from {source}: frame {i + 1} of {count} is cut short")
        out.append(bytes(data[offset : offset + size]))
        offset += size
    if offset != len(data):
        raise PayloadError(f"payload from {source}: {len(data) - offset} bytes after {count} frames")
    return out


def decode_rows(
    data: bytes, source: str, expect_rows: int | None = None, expect_cols: int | None = None
) -> Tensor:
    """The float32 block of a frame (see :func:`unpack_frame` for the checks).

    Args:
        data (bytes): the frame.
        source (str): who sent it, for error messages.
        expect_rows (int | None, optional): the rows expected. (default: :obj:`None`)
        expect_cols (int | None, optional): the columns expected. (default: :obj:`None`)

    Shapes:
        - **output:** ``[k, d]`` float32

    Raises:
        PayloadError: naming ``source`` and what does not match.
    """
    return dequantize_rows(unpack_frame(data, source, expect_rows, expect_cols))
