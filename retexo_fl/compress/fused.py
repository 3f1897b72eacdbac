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
    def encode(
        x, table, shift, inv, offset, out, k, d, block, levels, ROWS: tl.constexpr, COLS: tl.constexpr
    ):
        # One program: ROWS rows x COLS columns (grid: row tiles x column tiles).
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
        live = rows < k
        m = live[:, None] & (cols[None, :] < d)
        r = tl.load(shift + rows, mask=live, other=0.0)[:, None]
        scale = tl.load(inv + rows, mask=live, other=0.0)[:, None]
        minus = -tl.load(offset + rows, mask=live, other=0.0)[:, None]
        at = rows[:, None] * d + cols[None, :]
        values = tl.load(x + at, mask=m, other=0.0)
        dither = tl.load(table + (rows % block)[:, None] * d + cols[None, :], mask=m, other=0.0)
        u = dither + r
        u = u - tl.floor(u)  # frac: u >= 0, so floor is trunc; exact (no product to contract)
        v = values * scale + u + minus  # three roundings: the launch turns off contraction
        v = tl.minimum(tl.maximum(v, 0.0), levels)
        tl.store(out + at, v.to(tl.uint8), mask=m)

    @triton.jit
    def decode(codes, lo, step, out, k, d, ROWS: tl.constexpr, COLS: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
        live = rows < k
        m = live[:, None] & (cols[None, :] < d)
        low = tl.load(lo + rows, mask=live, other=0.0)[:, None]
        width = tl.load(step + rows, mask=live, other=0.0)[:, None]
        at = rows[:, None] * d + cols[None, :]
        code = tl.load(codes + at, mask=m, other=0).to(tl.float32)
        tl.store(out + at, code * width + low, mask=m)


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


def quantize(x: Tensor, table: Tensor, shift: Tensor, inv: Tensor, offset: Tensor, levels: float) -> Tensor:
    """Codes of ``[k, d]`` rows: ``clamp(x * inv + frac(table[i mod block] + shift[i]) - offset,
    0, levels)`` cast to uint8, as the torch path computes them.

    Shapes:
        - **input:** ``x`` ``[k, d]``, ``table`` ``[block, d]``, ``shift``, ``inv``, ``offset`` ``[k]``
        - **output:** ``[k, d]`` uint8
    """
    k, d = x.shape
    out = torch.empty(k, d, dtype=torch.uint8, device=x.device)
    grid = (triton_cdiv(k, _ROWS), triton_cdiv(d, _cols(d)))
    _launch(
        encode, grid,
        x.contiguous(), table.contiguous(), shift.contiguous(), inv.contiguous(), offset.contiguous(),
        out, k, d, table.shape[0], levels, ROWS=_ROWS, COLS=_cols(d), enable_fp_fusion=False,
    )  # fmt: skip
    return out


def dequantize(codes: Tensor, lo: Tensor, step: Tensor) -> Tensor:
    """Rows ``codes * step + lo`` (two roundings, as the torch path).

    Shapes:
        - **input:** ``codes`` ``[k, d]`` uint8, ``lo``, ``step`` ``[k]`` float32
        - **output:** ``[k, d]`` float32
    """
    k, d = codes.shape
    out = torch.empty(k, d, dtype=torch.float32, device=codes.device)
    _launch(
        decode,
        (triton_cdiv(k, _ROWS), triton_cdiv(d, _cols(d))),
        codes.contiguous(),
        lo.contiguous(),
        step.contiguous(),
        out,
        k,
        d,
        ROWS=_ROWS,
        COLS=_cols(d),
        enable_fp_fusion=False,
    )
    return out


def triton_cdiv(a: int, b: int) -> int:
    return max(1, -(-a // b))
