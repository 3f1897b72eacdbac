"""Fused GPU kernels for the row codec (Triton): the torch ops' codes and values, bit for bit.

On a GPU the row codec's torch ops are a chain of whole-block passes: the dither, a multiply, an
add, a subtract, a clamp and a cast when encoding; a cast, a multiply and an add when decoding.
Each pass reads and writes the whole block, so a 1,000,000 x 64 block took 48 times a clone of it
to encode and decode on an H200. Here one kernel reads a block of rows once and writes its codes,
and one reads the codes and writes the rows.

**Equal to the torch ops.** Every float operation is rounded once and in the torch path's order
(:func:`retexo_fl.compress.quantize._quantize_group`): the kernels are launched with
``enable_fp_fusion=False``, so Triton never contracts a multiply and an add into one fused
multiply-add (one rounding instead of two), ``a - b`` is computed as ``a + (-b)`` (the same value
in IEEE arithmetic), and the cast to uint8 truncates as torch's does.
So a run's codes do not depend on whether Triton was there (tested on a GPU).

**When they are used:** for CUDA tensors, when Triton imports and ``RETEXO_FL_NATIVE`` is not
``0`` (the switch that also turns off the compiled CPU loops, :mod:`retexo_fl.compress.native`).
A kernel that fails to build or launch here (Triton needs a host C compiler, say) is reported
once, as a warning, and the torch ops serve from then on: the same codes, more slowly.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch
from torch import Tensor

from retexo_fl.compress import native

log = logging.getLogger(__name__)


class KernelUnavailable(RuntimeError):
    """The fused kernels failed here; the caller computes the same values with torch ops."""


#: Why the kernels failed on this machine, once they did: they are not tried again.
_broken: str | None = None

#: Rows one program of a kernel handles, and the widest column tile.
_ROWS = 32
_MAX_COLS = 128


try:  # Triton comes with torch's CUDA builds; without it the torch ops serve (quantize.py)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None

if triton is not None:

    @triton.jit
    def _row_scales(lo, hi, rows, live, per_level):
        # The torch path's scales on a GPU, rounding for rounding: step = (hi - lo) / levels,
        # which torch computes for a host scalar as (hi - lo) * (1 / levels), 1 / levels rounded
        # once on the host; inv = where(step > 0, 1 / max(step, tiny), 0), an IEEE division
        # (div_rn; Triton's "/" is an approximate one); offset = lo * inv.
        low = tl.load(lo + rows, mask=live, other=0.0).to(tl.float32)
        high = tl.load(hi + rows, mask=live, other=0.0).to(tl.float32)
        step = (high - low) * per_level
        one = tl.full(step.shape, 1.0, tl.float32)
        inv = tl.where(step > 0, tl.div_rn(one, tl.maximum(step, 1.1754943508222875e-38)), 0.0)
        return low, step, inv, low * inv

    @triton.jit
    def encode(
        x, table, shift, lo, hi, out, k, d, block, levels, per_level,
        ROWS: tl.constexpr, COLS: tl.constexpr,
    ):  # fmt: skip
        # One program: ROWS rows x COLS columns (grid: row tiles x column tiles).
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
        live = rows < k
        m = live[:, None] & (cols[None, :] < d)
        r = tl.load(shift + rows, mask=live, other=0.0)[:, None]
        _, _, inv, offset = _row_scales(lo, hi, rows, live, per_level)
        scale = inv[:, None]
        minus = -offset[:, None]
        at = rows[:, None] * d + cols[None, :]
        values = tl.load(x + at, mask=m, other=0.0)
        dither = tl.load(table + (rows % block)[:, None] * d + cols[None, :], mask=m, other=0.0)
        u = dither + r
        u = u - tl.floor(u)  # frac: u >= 0, so floor is trunc; exact (no product to contract)
        v = values * scale + u + minus  # three roundings: the launch turns off contraction
        v = tl.minimum(tl.maximum(v, 0.0), levels)
        tl.store(out + at, v.to(tl.uint8), mask=m)

    @triton.jit
    def ranges(
        x, lo, hi, status, k, d,
        BF16: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, TILES: tl.constexpr,
    ):  # fmt: skip
        # One program: ROWS whole rows, read once, TILES column tiles of COLS.
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        live = rows < k
        mn = tl.full([ROWS], float("inf"), tl.float32)
        mx = tl.full([ROWS], float("-inf"), tl.float32)
        bad = tl.zeros([ROWS], tl.int32)
        for tile in range(TILES):
            cols = tile * COLS + tl.arange(0, COLS)
            m = live[:, None] & (cols[None, :] < d)
            v = tl.load(x + rows[:, None] * d + cols[None, :], mask=m, other=0.0)
            finite = (v == v) & (tl.abs(v) < float("inf"))
            bad = tl.maximum(bad, tl.max(tl.where(m & ~finite, 1, 0), axis=1))
            mn = tl.minimum(mn, tl.min(tl.where(m, v, float("inf")), axis=1))
            mx = tl.maximum(mx, tl.max(tl.where(m, v, float("-inf")), axis=1))
        mn = mn + 0.0  # -0.0 becomes 0.0, as the torch path does
        mx = mx + 0.0
        dtype = tl.bfloat16 if BF16 else tl.float16
        # Round to nearest even, then one step outward where that moved the extreme inward: the
        # torch path's to() and nextafter(). Half bit patterns step by one in magnitude; a zero
        # steps to the smallest subnormal of the outward sign.
        low = mn.to(dtype)
        bits = low.to(tl.int16, bitcast=True).to(tl.int32)
        outward = tl.where((bits & 0x7FFF) == 0, -32767, tl.where(bits < 0, bits + 1, bits - 1))
        bits = tl.where(low.to(tl.float32) > mn, outward, bits)
        low = bits.to(tl.int16).to(dtype, bitcast=True)
        high = mx.to(dtype)
        bits = high.to(tl.int16, bitcast=True).to(tl.int32)
        outward = tl.where((bits & 0x7FFF) == 0, 1, tl.where(bits < 0, bits - 1, bits + 1))
        bits = tl.where(high.to(tl.float32) < mx, outward, bits)
        high = bits.to(tl.int16).to(dtype, bitcast=True)
        low32 = low.to(tl.float32)
        high32 = high.to(tl.float32)
        unbounded = (tl.abs(low32) == float("inf")) | (tl.abs(high32) == float("inf"))
        wide = tl.abs(high32 - low32) == float("inf")
        code = tl.where(bad > 0, 1, tl.where(unbounded, 2, tl.where(wide, 3, 0)))
        if BF16:
            # A float32 denormal extreme has a bf16 denormal range, whose conversion was not
            # checked against the torch path on a GPU: those blocks take the torch path.
            tiny = 1.1754943508222875e-38
            denormal = ((tl.abs(mn) < tiny) & (mn != 0.0)) | ((tl.abs(mx) < tiny) & (mx != 0.0))
            code = tl.where((code == 0) & denormal, 4, code)
        tl.store(lo + rows, low, mask=live)
        tl.store(hi + rows, high, mask=live)
        tl.store(status + rows, code.to(tl.int8), mask=live)

    @triton.jit
    def decode(codes, lo, hi, out, k, d, per_level, ROWS: tl.constexpr, COLS: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
        live = rows < k
        m = live[:, None] & (cols[None, :] < d)
        low, width, _, _ = _row_scales(lo, hi, rows, live, per_level)
        at = rows[:, None] * d + cols[None, :]
        code = tl.load(codes + at, mask=m, other=0).to(tl.float32)
        tl.store(out + at, code * width[:, None] + low[:, None], mask=m)


def usable(*tensors: Tensor) -> bool:
    """Whether the fused kernels serve these tensors: all on a CUDA device, Triton importable,
    and not turned off (``RETEXO_FL_NATIVE=0``)."""
    if os.environ.get(native.NATIVE_ENV, "1") == "0":
        return False
    return triton is not None and _broken is None and all(t.is_cuda for t in tensors)


def _launch(kernel, grid: tuple[int, int], *args: object, **options: object) -> None:
    """Launch ``kernel``; a failure to build or run it turns the kernels off, says why once and
    raises :class:`KernelUnavailable`."""
    global _broken
    try:
        kernel[grid](*args, **options)
    except Exception as exc:  # Triton's compiler, its launcher's C build, or the launch
        _broken = f"{type(exc).__name__}: {exc}"[:500]
        log.warning("the fused row-codec kernels are unavailable here (%s); using torch ops", _broken)
        raise KernelUnavailable(_broken) from exc


def _cols(d: int) -> int:
    return min(_MAX_COLS, max(16, 1 << (max(d, 1) - 1).bit_length()))


def row_ranges(x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, int]:
    """:func:`row_ranges_pending` with its fault code read (one host synchronization)."""
    lo, hi, status = row_ranges_pending(x, dtype)
    return lo, hi, int(status.max())


def row_ranges_pending(x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """Each row's range ``[lo, hi]`` in ``dtype`` (fp16 or bf16), rounded outward, in one read
    of the block: the torch path's ``aminmax``, ``to`` and ``nextafter``, bit for bit.

    The third value is each row's status, on the device and not yet read (so that the caller
    can queue the rest of its work first); its largest is 0 when every row can be coded here,
    else the largest of each row's code, 1 (the row holds NaN or Inf), 2 (its range is beyond
    ``dtype``), 3 (its range spans more than float32 can step across) or 4 (bf16 only: an
    extreme is a float32 denormal); the caller then takes the torch path, which raises naming
    the row for 1-3 and computes the ranges for 4.

    Shapes:
        - **input:** ``x`` ``[k, d]`` float32, ``k, d > 0``
        - **output:** ``lo``, ``hi`` ``[k]`` in ``dtype``, ``status`` ``[k]`` int8
    """
    k, d = x.shape
    lo = torch.empty(k, dtype=dtype, device=x.device)
    hi = torch.empty(k, dtype=dtype, device=x.device)
    status = torch.empty(k, dtype=torch.int8, device=x.device)
    _launch(
        ranges, (triton_cdiv(k, _ROWS), 1),
        x.contiguous(), lo, hi, status, k, d,
        BF16=dtype == torch.bfloat16, ROWS=_ROWS, COLS=_cols(d), TILES=triton_cdiv(d, _cols(d)),
        enable_fp_fusion=False,
    )  # fmt: skip
    return lo, hi, status


def per_level(levels: float) -> float:
    """``1 / levels`` rounded once to float32, as torch's GPU division by a host scalar takes it."""
    return float(np.float32(1.0) / np.float32(levels))


def quantize(x: Tensor, table: Tensor, shift: Tensor, lo: Tensor, hi: Tensor, levels: float) -> Tensor:
    """Codes of ``[k, d]`` rows ranged ``[lo, hi]``: ``clamp(x * inv + frac(table[i mod block] +
    shift[i]) - offset, 0, levels)`` cast to uint8, with the rows' scales (``inv``, ``offset``)
    computed in the kernel as the torch path computes them (:func:`quantize._scales`): queued
    from the host, they were eight small launches, and the GPU waited on them.

    Shapes:
        - **input:** ``x`` ``[k, d]``, ``table`` ``[block, d]``, ``shift`` ``[k]``, ``lo``, ``hi``
          ``[k]`` fp16 / bf16
        - **output:** ``[k, d]`` uint8
    """
    k, d = x.shape
    out = torch.empty(k, d, dtype=torch.uint8, device=x.device)
    grid = (triton_cdiv(k, _ROWS), triton_cdiv(d, _cols(d)))
    _launch(
        encode, grid,
        x.contiguous(), table.contiguous(), shift.contiguous(), lo.contiguous(), hi.contiguous(),
        out, k, d, table.shape[0], levels, per_level(levels),
        ROWS=_ROWS, COLS=_cols(d), enable_fp_fusion=False,
    )  # fmt: skip
    return out


def dequantize(codes: Tensor, lo: Tensor, hi: Tensor, levels: float) -> Tensor:
    """Rows ``codes * step + lo``, ``step = (hi - lo) / levels``, as the torch path computes them
    (two roundings for the rows, two for the step).

    Shapes:
        - **input:** ``codes`` ``[k, d]`` uint8, ``lo``, ``hi`` ``[k]`` fp16 / bf16
        - **output:** ``[k, d]`` float32
    """
    k, d = codes.shape
    out = torch.empty(k, d, dtype=torch.float32, device=codes.device)
    _launch(
        decode, (triton_cdiv(k, _ROWS), triton_cdiv(d, _cols(d))),
        codes.contiguous(), lo.contiguous(), hi.contiguous(), out, k, d, per_level(levels),
        ROWS=_ROWS, COLS=_cols(d), enable_fp_fusion=False,
    )  # fmt: skip
    return out


def triton_cdiv(a: int, b: int) -> int:
    return max(1, -(-a // b))
