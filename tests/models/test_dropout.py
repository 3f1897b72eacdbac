"""The 16-bit-lane dropout: nn.Dropout's distribution (p on a 2^-16 grid), scaling and modes."""

from __future__ import annotations

import math

import pytest
import torch

from retexo_fl.models.dropout import Dropout, dropout, keep_mask


@pytest.mark.parametrize("p", [0.1, 0.5, 0.8])
def test_elements_are_kept_with_probability_one_minus_p_and_scaled(p):
    torch.manual_seed(0)
    n = 400_000
    out = dropout(torch.ones(n), p)
    kept = out != 0
    # Binomial(n, 1 - p): 5 standard deviations, so a wrong comparison (keeping w < threshold)
    # fails for every p but 0.5, and a missing or wrong scale fails for all.
    sd = math.sqrt(n * p * (1 - p))
    assert abs(int(kept.sum()) - n * (1 - p)) < 5 * sd
    # Kept elements carry 1 / (1 - p'), p' being p on the 2^-16 grid the 16-bit lanes give.
    p_grid = round(p * 65536) / 65536
    assert abs(p_grid - p) <= 2**-17
    torch.testing.assert_close(out[kept], torch.full((int(kept.sum()),), 1 / (1 - p_grid)))


def test_the_output_is_unbiased_and_masks_are_independent_draws():
    torch.manual_seed(1)
    x = torch.randn(64, 8)
    draws = torch.stack([dropout(x, 0.5) for _ in range(4000)])
    # E[out] = x: each mean of 4,000 draws lies within 5 standard errors of x.
    se = x.abs() / math.sqrt(4000)
    assert bool(((draws.mean(0) - x).abs() < 5 * se + 1e-6).all())
    assert not torch.equal(draws[0], draws[1])


def test_modes_and_edge_probabilities():
    x = torch.randn(10, 4, requires_grad=True)
    module = Dropout(0.5).eval()
    assert module(x) is x  # evaluation: the input itself
    assert dropout(x, 0.0) is x
    zeros = dropout(x, 1.0)
    assert torch.equal(zeros, torch.zeros_like(x))
    zeros.sum().backward()  # still part of the graph, as nn.Dropout(1.0) is
    assert torch.equal(x.grad, torch.zeros_like(x))
    with pytest.raises(ValueError, match="dropout probability"):
        Dropout(1.5)  # nn.Dropout's own check
    with pytest.raises(ValueError, match="0 <= p < 1"):
        keep_mask((2,), 1.0, dtype=torch.float32, device=torch.device("cpu"))


def test_the_gradient_is_the_mask():
    torch.manual_seed(2)
    x = torch.randn(50, 6, requires_grad=True)
    torch.manual_seed(3)
    out = dropout(x, 0.3)
    out.sum().backward()
    torch.manual_seed(3)
    mask = keep_mask((50, 6), 0.3, dtype=torch.float32, device=torch.device("cpu"))
    torch.testing.assert_close(out, x.detach() * mask)
    torch.testing.assert_close(x.grad, mask)


def test_a_half_precision_input_keeps_its_dtype():
    out = dropout(torch.ones(1000, dtype=torch.bfloat16), 0.5)
    assert out.dtype == torch.bfloat16
    assert set(out.unique().tolist()) <= {0.0, 2.0}
