"""The fused GPU kernels of the row codec give the torch ops' codes and rows, bit for bit."""

from __future__ import annotations

import pytest
import torch

from retexo_fl.compress import native, quantize
from retexo_fl.compress.quantize import dequantize_rows, quantize_rows

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not HAVE_TRITON, reason="needs Triton")]


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("shape", [(1, 1), (23, 5), (1000, 64), (4099, 130)])
def test_fused_kernels_give_the_torch_ops_codes(bits, shape, monkeypatch):
    # Rows of very different scales, so that one rounding more or less (a fused multiply-add)
    # would change codes somewhere; several dither blocks and a remainder.
    monkeypatch.setattr(quantize, "_BLOCK_VALUES", 7 * shape[1])
    k, d = shape
    x = torch.randn(k, d, device="cuda") * torch.logspace(-4, 4, k, device="cuda")[:, None]
    out = {}
    for env in ("1", "0"):  # 0: the torch ops (the switch also turns off the compiled CPU loops)
        monkeypatch.setenv(native.NATIVE_ENV, env)
        assert quantize._fused(x) == (env == "1")
        q = quantize_rows(x, bits, generator=torch.Generator(device="cuda").manual_seed(5))
        out[env] = (q.data, q.lo, q.hi, dequantize_rows(q))
    for fused, ops in zip(out["1"], out["0"], strict=True):
        assert torch.equal(fused, ops)


def test_mixed_widths_go_through_the_kernels_group_by_group(monkeypatch):
    x = torch.randn(300, 16, device="cuda")
    widths = torch.tensor([1, 2, 4, 8], device="cuda").repeat(75)
    out = {}
    for env in ("1", "0"):
        monkeypatch.setenv(native.NATIVE_ENV, env)
        q = quantize_rows(x, widths, generator=torch.Generator(device="cuda").manual_seed(1))
        out[env] = (q.data, dequantize_rows(q))
    assert torch.equal(out["1"][0], out["0"][0]) and torch.equal(out["1"][1], out["0"][1])


@pytest.mark.parametrize("half", ["fp16", "bf16"])
@pytest.mark.parametrize("shape", [(1, 1), (23, 5), (1000, 64), (300, 130), (50, 300)])
def test_fused_row_ranges_are_the_torch_ranges_bit_for_bit(half, shape):
    # Rows from 1e-9 to 3e3 in scale, all-negative and all-positive rows, zero rows of either
    # sign and a row whose minimum is a tiny negative: every rounding branch of the outward step.
    from retexo_fl.compress import fused

    k, d = shape
    x = torch.randn(k, d, device="cuda") * torch.logspace(-9, 3.5, k, device="cuda")[:, None]
    x[::7] = -x[::7].abs()
    x[::11] = x[::11].abs()
    if k > 7:  # float32 denormals too
        x[3], x[4], x[5, 0], x[6], x[7, 0] = 0.0, -0.0, -1e-30, 1e-40, -1e-40
    if half == "bf16" and k > 7:
        # Denormal extremes have denormal bf16 ranges: such a block takes the torch path.
        assert fused.row_ranges(x, torch.bfloat16)[2] == 4
        x[6], x[7, 0] = 1.0, -1.0
    lo, hi, fault = fused.row_ranges(x, quantize.RANGE_DTYPES[half])
    want_lo, want_hi = quantize._row_ranges(x, half, "rows", compiled=False)
    assert fault == 0
    assert torch.equal(lo.view(torch.int16), want_lo.view(torch.int16))
    assert torch.equal(hi.view(torch.int16), want_hi.view(torch.int16))


@pytest.mark.parametrize(
    ("half", "value", "fault", "message"),
    [
        ("fp16", float("nan"), 1, "hold NaN or Inf"),
        ("bf16", float("inf"), 1, "hold NaN or Inf"),
        ("bf16", 1e39, 1, "hold NaN or Inf"),  # beyond float32: inf once stored
        ("fp16", 1e5, 2, None),
        ("fp16", 65510.0, 2, None),  # rounds to 65504, a step outward is inf
        ("fp16", -7e4, 2, None),
        ("bf16", 3e38, 3, "spans more than float32"),
    ],
)
def test_a_block_the_fused_ranges_refuse_raises_the_torch_paths_error(half, value, fault, message):
    from retexo_fl.compress import fused

    x = torch.randn(40, 8, device="cuda")
    # Through float64: torch refuses to store a Python float float32 cannot hold (1e39), the
    # cast rounds it to inf as a float32 computation would.
    x[17, 3] = torch.tensor(value, dtype=torch.float64).float()
    if fault == 3:
        x[17, 2] = -value
    assert fused.row_ranges(x, quantize.RANGE_DTYPES[half])[2] == fault
    if message is None:  # beyond fp16: the block is coded in bf16, as the torch path does
        widened = quantize_rows(x, 8, half=half, generator=torch.Generator(device="cuda").manual_seed(3))
        bf16 = quantize_rows(x, 8, half="bf16", generator=torch.Generator(device="cuda").manual_seed(3))
        assert widened.half == "bf16" and torch.equal(widened.data, bf16.data)
        return
    before = torch.cuda.get_rng_state(x.device)
    with pytest.raises(quantize.CodecError, match=message):
        quantize_rows(x, 8, half=half, where="rows")
    # The refused block's dither, drawn from the default generator, was put back.
    assert torch.equal(torch.cuda.get_rng_state(x.device), before)
