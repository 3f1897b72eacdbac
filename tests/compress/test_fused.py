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

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and HAVE_TRITON), reason="needs a GPU and Triton"
)


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
