"""The 16-bit-lane dropout: nn.Dropout's distribution (p on a 2^-16 grid), scaling and modes, and
its counter hash, equal from first principles, in the compiled loop and in torch ops."""

from __future__ import annotations

import math

import pytest
import torch

from retexo_fl.compress import native
from retexo_fl.models.dropout import Dropout, dropout, hashed_lanes, keep_mask

# A compiler that fails to build shows here as skips, and in test_native as a failure.
HAVE_CC = native.library() is not None


@pytest.fixture(autouse=True)
def _pool_splits_from_65536(monkeypatch):
    """The masks here are small; the threads still split those of 65,536 elements or more, so
    that the compiled loops are also checked on words handed to the pool (at odd lengths too)."""
    monkeypatch.setattr(native, "_PARALLEL_WORK", 1 << 16)


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


def _splitmix64_lanes(key: int, n: int) -> list[int]:
    """The signed 16-bit lanes of splitmix64 over the counters ``key + (w + 1) * golden``, in Python
    integers (the published algorithm, no torch)."""
    mask, lanes, w = (1 << 64) - 1, [], 0
    while len(lanes) < n:
        w += 1
        z = (key + w * 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        z ^= z >> 31
        for j in range(4):
            v = (z >> (16 * j)) & 0xFFFF
            lanes.append(v - 65536 if v >= 32768 else v)
    return lanes[:n]


@pytest.mark.parametrize("key", [0, 1, -1, 2**62 + 12_345, -(2**63), 2**63 - 2])
def test_the_torch_lanes_are_splitmix64_of_the_counter(key):
    assert hashed_lanes(torch.tensor([key]), 41).tolist() == _splitmix64_lanes(key, 41)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)  # tells 0.0 from -0.0 and compares the scale's exact bits


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler: the torch ops serve")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [1, 3, 4, 5, 8, 37, 65_537, 200_003])
def test_the_compiled_mask_equals_the_torch_ops_bit_for_bit(n, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # with 2, the pool splits a mask of 65,536 or more by words
    try:
        for key in (0, -7, 2**61 + 3):
            for p in (0.1, 0.3, 0.5, 0.9):
                dropped = min(round(p * 65536), 65535)
                lo, scale = dropped - 32768, 65536 / (65536 - dropped)
                compiled = native.dropout_mask(torch.tensor([key]), n, lo, scale)
                ops = hashed_lanes(torch.tensor([key]), n).ge(lo).to(torch.float32).mul_(scale)
                assert torch.equal(_bits(compiled), _bits(ops)), (key, p, n)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_a_mask_is_the_same_with_and_without_the_compiled_loop(dtype, monkeypatch):
    masks = []
    for flag in ("1", "0"):
        monkeypatch.setenv(native.NATIVE_ENV, flag)
        torch.manual_seed(11)
        masks.append(keep_mask((300, 7), 0.3, dtype=dtype, device=torch.device("cpu")))
        masks.append(torch.randint(0, 1 << 30, (1,)))  # and what the generator draws next
    assert torch.equal(masks[0], masks[2]) and torch.equal(masks[1], masks[3])
    kept = masks[0] != 0
    assert 0.6 < float(kept.float().mean()) < 0.8


def test_a_mask_draws_one_int64_from_the_generator_whatever_its_size():
    # Chunked steps replay the generator's state and the batched cohort draws each member's
    # masks in turn: both rely on a mask's draw being one value, not one per element.
    for shape in [(1,), (5, 3), (1000, 64)]:
        torch.manual_seed(5)
        keep_mask(shape, 0.5, dtype=torch.float32, device=torch.device("cpu"))
        after_mask = torch.randint(0, 1 << 30, (4,))
        torch.manual_seed(5)
        torch.randint(-(2**63), 2**63 - 1, (1,), dtype=torch.int64)
        assert torch.equal(after_mask, torch.randint(0, 1 << 30, (4,)))


def _special_values(n: int) -> torch.Tensor:
    """Normal values with denormals, signed zeros, infinities and NaN among them."""
    x = torch.randn(n)
    specials = torch.tensor([1e-40, -1e-40, 0.0, -0.0, float("inf"), float("-inf"), float("nan"), 3e38])
    x[: min(n, 8)] = specials[: min(n, 8)]
    return x


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler: the masked product needs the loop")
@pytest.mark.parametrize("n", [1, 5, 8, 37, 200_003])
def test_the_fused_product_equals_input_times_mask_forward_and_backward(n, monkeypatch):
    import retexo_fl.models.dropout as module

    monkeypatch.setattr(module, "FUSED_MIN_ELEMENTS", 1)
    x0 = _special_values(n)
    weights = torch.randn(n)  # a gradient that is not all ones, and contiguous or not below
    results = []
    for fused in (True, False):
        monkeypatch.setattr(module, "FUSED_MIN_ELEMENTS", 1 if fused else 1 << 40)
        x = x0.clone().requires_grad_(True)
        torch.manual_seed(4)
        out = dropout(x, 0.3)
        (out * weights).sum().backward()
        results.append((out.detach(), x.grad))
    (fused_out, fused_grad), (plain_out, plain_grad) = results
    assert torch.equal(_bits(fused_out), _bits(plain_out))
    assert torch.equal(_bits(fused_grad), _bits(plain_grad))


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
def test_an_expanded_gradient_and_a_strided_input(monkeypatch):
    import retexo_fl.models.dropout as module

    base = torch.randn(300, 500)
    outs = []
    for threshold in (1, 1 << 40):
        monkeypatch.setattr(module, "FUSED_MIN_ELEMENTS", threshold)
        x = base.clone().requires_grad_(True)
        torch.manual_seed(6)
        out = dropout(x, 0.5)
        out.sum().backward()  # an expanded (stride 0) gradient
        outs.append((out.detach(), x.grad))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    # A transposed view is left to torch's product, which keeps its layout (a later matrix
    # product over another layout may round differently).
    monkeypatch.setattr(module, "FUSED_MIN_ELEMENTS", 1)
    view = base.t()
    assert dropout(view, 0.5).stride() == (view * 2.0).stride()


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
def test_second_derivatives_through_the_fused_product_are_the_plain_ones(monkeypatch):
    import retexo_fl.models.dropout as module

    x0, w0 = torch.randn(40, 30), torch.randn(40, 30)
    grads = []
    for threshold in (1, 1 << 40):
        monkeypatch.setattr(module, "FUSED_MIN_ELEMENTS", threshold)
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        torch.manual_seed(9)
        y = dropout(x * w, 0.3)
        (g,) = torch.autograd.grad((y * y).sum(), x, create_graph=True)
        assert g.requires_grad  # the gradient still depends on w
        (gw,) = torch.autograd.grad(g.sum(), w)
        grads.append((g.detach(), gw))
    assert torch.equal(_bits(grads[0][0]), _bits(grads[1][0]))
    assert torch.equal(_bits(grads[0][1]), _bits(grads[1][1]))


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
def test_a_backward_after_the_loops_are_switched_off_uses_torch_ops(monkeypatch):
    import retexo_fl.models.dropout as module

    monkeypatch.setattr(module, "FUSED_MIN_ELEMENTS", 1)
    x = torch.randn(500, requires_grad=True)
    weights = torch.randn(500)
    torch.manual_seed(10)
    out = dropout(x, 0.4)
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    (out * weights).sum().backward()
    torch.manual_seed(10)
    mask = keep_mask((500,), 0.4, dtype=torch.float32, device=torch.device("cpu"))
    assert torch.equal(_bits(x.grad), _bits(weights * mask))


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
def test_pool_threads_started_while_torch_flushed_do_not_flush_later(monkeypatch):
    # A new thread takes on the denormal mode of the thread that starts it: a pool started by a
    # large mask drawn while torch flushed must not go on flushing the loop's products.
    import retexo_fl.models.dropout as module

    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the pool serves 65,536 elements or more on 2 threads here
    monkeypatch.setattr(native, "_pool", None)  # started afresh below
    x = torch.full((300_000,), 1e-40)  # denormal, made before flushing (which would zero it)
    if not torch.set_flush_denormal(True):
        torch.set_num_threads(before)
        pytest.skip("this CPU cannot flush denormals")
    try:
        keep_mask((300_000,), 0.5, dtype=torch.float32, device=torch.device("cpu"))
    finally:
        torch.set_flush_denormal(False)
    try:
        monkeypatch.setattr(module, "FUSED_MIN_ELEMENTS", 1)
        torch.manual_seed(12)
        out = dropout(x, 0.5)
        torch.manual_seed(12)
        expected = x * keep_mask((300_000,), 0.5, dtype=torch.float32, device=torch.device("cpu"))
        assert torch.equal(_bits(out), _bits(expected)) and bool(out.any())
    finally:
        torch.set_num_threads(before)


@pytest.mark.cuda
def test_cuda_lanes_equal_the_cpu_lanes():
    # Signed int64 products wrap on the GPU as on the CPU: the same masks on either device.
    for key in (0, -1, 2**62 + 12_345, -(2**63)):
        cpu = hashed_lanes(torch.tensor([key]), 100_003)
        cuda = hashed_lanes(torch.tensor([key], device="cuda"), 100_003)
        assert torch.equal(cpu, cuda.cpu())


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
def test_while_torch_flushes_denormals_the_product_is_left_to_torch(monkeypatch):
    # Flushing is a thread's setting: torch's own product then flushes in some of its threads
    # and not in others (measured: half of 200,000 denormal products flushed on 2 threads), so
    # no loop of ours can be equal to it; the product goes to torch, as the codec's loops do.
    import retexo_fl.models.dropout as module

    monkeypatch.setattr(module, "FUSED_MIN_ELEMENTS", 1)
    calls = []
    fused = module._MaskedProduct.apply
    monkeypatch.setattr(module._MaskedProduct, "apply", lambda *a: calls.append(1) or fused(*a))
    x = torch.randn(1000)
    dropout(x, 0.5)
    assert calls == [1] and native.denormals_flushed() is False
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        assert native.denormals_flushed() is True
        dropout(x, 0.5)
        assert calls == [1]  # not fused this time
    finally:
        torch.set_flush_denormal(False)
    assert native.denormals_flushed() is False
