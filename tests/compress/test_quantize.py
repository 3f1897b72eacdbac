"""Stochastic row quantization: unbiased, bounded error, exact passthrough, constant rows, bad input."""

from __future__ import annotations

import math

import pytest
import torch

from retexo_fl.compress import native, quantize
from retexo_fl.compress.quantize import CodecError, dequantize_rows, quantize_rows

CUDA = pytest.mark.cuda


def _step(q) -> torch.Tensor:
    return (q.hi.float() - q.lo.float()) / (2.0 ** q.bits.to(q.lo.device).float() - 1.0)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_unbiased_within_the_variance_bound(bits):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 16, generator=gen) * torch.linspace(0.1, 10, 8)[:, None]
    draws = 2000
    total = torch.zeros_like(x)
    sq = torch.zeros_like(x)
    for _ in range(draws):
        q = quantize_rows(x, bits, generator=gen)
        y = dequantize_rows(q)
        total += y
        sq += (y - x) ** 2
    step = _step(q)[:, None]
    # Per element Var = step^2 p (1 - p) <= step^2 / 4; the mean of N draws has std <= step / (2 sqrt N).
    bound = 5 * step / (2 * math.sqrt(draws))
    assert ((total / draws - x).abs() <= bound).all()
    # A round-to-nearest quantizer (biased) would miss this by far: its error reaches step / 2.
    assert (sq / draws <= step**2 / 4 * 1.25 + 1e-12).all()


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_error_per_element_within_one_step(bits):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(300, 33, generator=gen) * 3 + 1
    q = quantize_rows(x, bits, generator=gen)
    err = (dequantize_rows(q) - x).abs()
    step = _step(q)[:, None]
    assert (err <= step * (1 + 1e-5)).all()
    # Against the true range: the fp16 range is rounded outward by at most an ulp at each end.
    true_range = (x.amax(1) - x.amin(1))[:, None]
    slack = (x.abs().amax(1)[:, None]) * 2.0**-10 * 2
    assert (err <= (true_range + slack) / (2**bits - 1)).all()
    assert (
        q.lo.dtype == torch.float16
        and (q.lo.float() <= x.amin(1)).all()
        and (q.hi.float() >= x.amax(1)).all()
    )


def test_passthrough_32_is_exact_and_16_is_half():
    x = torch.randn(5, 7)
    assert torch.equal(dequantize_rows(quantize_rows(x, 32)), x)
    assert torch.equal(dequantize_rows(quantize_rows(x, 16)), x.half().float())
    assert torch.equal(dequantize_rows(quantize_rows(x, 16, half="bf16")), x.bfloat16().float())


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_constant_rows(bits):
    x = torch.tensor([[0.5] * 9, [0.0] * 9, [0.1] * 9, [-3.0] * 9])
    y = dequantize_rows(quantize_rows(x, bits, generator=torch.Generator().manual_seed(0)))
    assert torch.isfinite(y).all()
    assert torch.equal(y[:2], x[:2]) and torch.equal(y[3], x[3])  # exact in fp16: step 0
    assert (y[2] - 0.1).abs().max() < 1e-4  # 0.1 is not: it rounds between its fp16 neighbours


def test_mixed_widths_match_per_row_widths():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(40, 12, generator=gen)
    widths = torch.tensor([1, 2, 4, 8] * 10)
    q = quantize_rows(x, widths, generator=gen)
    err = (dequantize_rows(q) - x).abs()
    assert (err <= _step(q)[:, None] * (1 + 1e-5)).all()
    assert err[widths == 8].max() < err[widths == 1].max()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("bits", [4, 16, 32])
def test_non_finite_input_is_refused_with_its_origin(bad, bits):
    x = torch.zeros(6, 4)
    x[3, 1] = bad
    with pytest.raises(CodecError, match=r"stage 2, client 5.*first row 3"):
        quantize_rows(x, bits, where="stage 2, client 5")


def test_out_of_range_values_and_bad_widths():
    assert quantize_rows(torch.full((2, 3), 1e6), 4).half == "bf16"  # past fp16: bf16 holds it
    assert torch.isfinite(dequantize_rows(quantize_rows(torch.full((2, 3), 1e6), 4, half="bf16"))).all()
    with pytest.raises(CodecError, match="spans more than float32"):
        quantize_rows(torch.tensor([[3e38, -3e38]]), 4)
    with pytest.raises(CodecError, match="one of"):
        quantize_rows(torch.ones(2, 3), 3)
    with pytest.raises(CodecError, match="per-row"):
        quantize_rows(torch.ones(2, 3), torch.tensor([16, 4]))


@pytest.mark.parametrize("shape", [(0, 8), (5, 0)])
def test_an_empty_block_decodes_where_it_was_encoded(shape):
    # "meta" stands in for a GPU: the block's codes, and so its decoded rows, stay on the input's
    # device (they were made on the CPU, and a CUDA caller mixed them with its own rows).
    q = quantize_rows(torch.empty(*shape, device="meta"), 8)
    assert q.data.device.type == "meta"
    assert dequantize_rows(q).device.type == "meta" and dequantize_rows(q).shape == shape


@pytest.mark.cuda
def test_gpu_matches_cpu_bounds():
    x = torch.randn(1000, 64, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = quantize_rows(x, 4, generator=gen)
    assert q.data.is_cuda
    assert ((dequantize_rows(q) - x).abs() <= _step(q)[:, None] * (1 + 1e-5)).all()


@pytest.mark.parametrize("bits", [1, 4, 8])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_one_pass_over_a_group_gives_the_blockwise_codes(bits, device, monkeypatch):
    # A GPU runs the torch ops over a whole group at once; a CPU block by block (cache). Both
    # must give the same bytes: here 3 blocks of 7 rows and a remainder of 2, each way, with the
    # compiled CPU loops off so that both are the torch ops.
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    monkeypatch.setattr(quantize, "_BLOCK_VALUES", 7 * 5)
    x = torch.randn(23, 5, device=device) * torch.logspace(-3, 3, 23, device=device)[:, None]
    out = {}
    for one_pass in (False, True):
        monkeypatch.setattr(quantize, "_one_pass", lambda device, one_pass=one_pass: one_pass)
        q = quantize_rows(x, bits, generator=torch.Generator(device=device).manual_seed(3))
        out[one_pass] = (q.data, q.lo, q.hi, dequantize_rows(q))
    for blockwise, whole in zip(out[False], out[True], strict=True):
        assert torch.equal(blockwise, whole)
    assert not torch.equal(out[True][3], x)  # quantized: a test that compared x to itself would pass


def test_fused_kernels_that_fail_here_give_way_to_the_torch_ops(monkeypatch, caplog):
    # A GPU machine where Triton cannot build its kernels (no host C compiler, say): the first
    # launch fails, is reported once, and the torch ops give the same codes from then on.
    from retexo_fl.compress import fused

    class Unbuildable:
        launches = 0

        def __getitem__(self, grid):
            def launch(*args, **options):
                Unbuildable.launches += 1
                raise RuntimeError("cannot find a C compiler")

            return launch

    monkeypatch.setenv(native.NATIVE_ENV, "0")
    x = torch.randn(50, 7)
    reference = quantize_rows(x, 4, generator=torch.Generator().manual_seed(2))
    monkeypatch.setattr(fused, "ranges", Unbuildable(), raising=False)
    monkeypatch.setattr(fused, "encode", Unbuildable(), raising=False)
    monkeypatch.setattr(fused, "decode", Unbuildable(), raising=False)
    monkeypatch.setattr(fused, "_broken", None)
    tried = {"n": 0}

    def as_if_on_a_gpu(t):  # the kernels are offered until they fail once
        tried["n"] += 1
        return fused._broken is None

    monkeypatch.setattr(quantize, "_fused", as_if_on_a_gpu)
    q = quantize_rows(x, 4, generator=torch.Generator().manual_seed(2))
    assert torch.equal(q.data, reference.data)
    assert torch.equal(dequantize_rows(q), dequantize_rows(reference))
    assert Unbuildable.launches == 1  # tried once; nothing was offered after the failure
    assert fused._broken == "RuntimeError: cannot find a C compiler"
    assert "fused row-codec kernels are unavailable here" in caplog.text


def test_a_block_past_fp16_is_sent_in_bf16_and_said_once(caplog):
    # A client whose values grew past 65504 (a diverging update, features in the millions):
    # its frame carries bf16 ranges, the receiver decodes it from the frame's own header, and
    # the codes are those of a bf16 call with the same random source.
    from retexo_fl.compress.payload import encode_rows, unpack_frame

    quantize._widened.clear()
    x = torch.randn(30, 6)
    x[4] *= 1e6
    q = quantize_rows(x, 4, generator=torch.Generator().manual_seed(1), where="client 3, update")
    want = quantize_rows(x, 4, generator=torch.Generator().manual_seed(1), half="bf16")
    assert q.half == "bf16" and torch.equal(q.data, want.data) and torch.equal(q.lo, want.lo)
    assert ((dequantize_rows(q) - x).abs() <= _step(q)[:, None] * (1 + 1e-5)).all()
    back = unpack_frame(encode_rows(x, 4, generator=torch.Generator().manual_seed(1)), "client 3")
    assert back.half == "bf16" and torch.equal(dequantize_rows(back), dequantize_rows(q))
    quantize_rows(x, 8, where="client 3, update")
    assert caplog.text.count("client 3, update: values exceed fp16's range") == 1  # once per place
    # Within fp16's range nothing changes.
    assert quantize_rows(torch.randn(5, 3), 4).half == "fp16"


@pytest.mark.parametrize("bits", [4, 8, 16])
def test_a_fixed_width_block_reads_its_width_without_a_scan(bits, monkeypatch):
    """A block coded at one width knows it: decoding and framing a million-row block scanned its
    widths twice on the host (1.3 ms against the GPU's 0.3 ms decode), and a framed block read
    back says its width in the header."""
    from retexo_fl.compress.payload import pack_frame, unpack_frame

    x = torch.randn(50, 6, generator=torch.Generator().manual_seed(0))
    q = quantize_rows(x, bits, generator=torch.Generator().manual_seed(1))
    framed = pack_frame(q)
    back = unpack_frame(framed, "client 0")

    def no_scan(*args, **kwargs):
        raise AssertionError("the widths were scanned")

    monkeypatch.setattr(torch.Tensor, "all", no_scan)
    assert q.uniform_bits == back.uniform_bits == bits
    assert q.bits.shape == (50,) and q.bits.stride() == (0,)  # one byte, viewed 50 times
    monkeypatch.undo()
    assert torch.equal(dequantize_rows(q), dequantize_rows(back))


def test_the_width_read_follows_the_widths_tensor():
    """The remembered width is that of the tensor it was read from, at that version: widths
    written in place, or a new widths tensor, are read again."""
    x = torch.randn(3, 4)
    q = quantize_rows(x, torch.tensor([8, 8, 4]))
    assert q.uniform_bits is None
    q.bits[2] = 8  # in place: a new version of the same tensor
    assert q.uniform_bits == 8
    q.bits = torch.tensor([2, 8, 8], dtype=torch.uint8)
    assert q.uniform_bits is None
    with torch.inference_mode():  # inference tensors keep no version: read every time
        assert quantize_rows(torch.randn(4, 3), 8).uniform_bits == 8
    assert quantize_rows(torch.randn(0, 3), 16).uniform_bits == 32  # no rows: 32, as before


@pytest.mark.parametrize("seeded", [True, False])
def test_the_fused_path_reads_its_fault_after_queueing_the_codes(seeded, monkeypatch):
    """On a GPU the fused ranges' status is read after the codes are queued; a block the status
    refuses goes to the torch checks with the random source as it was before the call. Here the
    kernels are stood in for by the torch ops, on the CPU."""
    from retexo_fl.compress import fused

    events: list[str] = []

    class Status:  # each row's status, unread until max() (the host sync on a GPU)
        def __init__(self, codes: torch.Tensor) -> None:
            self.codes = codes

        def max(self) -> torch.Tensor:
            events.append("status read")
            return self.codes.max()

    def pending(x, dtype):  # the kernel's contract: ranges, and each row's status unread
        try:
            lo, hi = quantize._row_ranges(x, "bf16" if dtype == torch.bfloat16 else "fp16", "rows", False)
        except CodecError:
            return (
                torch.zeros(x.shape[0], dtype=dtype),
                torch.zeros(x.shape[0], dtype=dtype),
                Status(torch.ones(x.shape[0], dtype=torch.int8)),
            )
        return lo, hi, Status(torch.zeros(x.shape[0], dtype=torch.int8))

    def unavailable(*args, **kwargs):
        events.append("codes queued")
        raise fused.KernelUnavailable("stood in for")

    def gen(seed: int) -> torch.Generator | None:
        if seeded:
            return torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        return None

    def state(g):
        return (g.get_state() if g is not None else torch.get_rng_state()).clone()

    monkeypatch.setenv(native.NATIVE_ENV, "0")
    x = torch.randn(40, 6, generator=torch.Generator().manual_seed(0))
    big = x.clone()
    big[3, 2] = 1e6  # past fp16: the block goes in bf16
    reference = quantize_rows(x, 8, generator=(g := gen(1)))
    after_reference = state(g)
    as_bf16 = quantize_rows(big, 8, generator=gen(1), half="bf16")
    calls = {"pending": 0}

    def counted(x, dtype):
        calls["pending"] += 1
        return pending(x, dtype)

    monkeypatch.setattr(quantize, "_fused", lambda t: True)
    monkeypatch.setattr(fused, "row_ranges_pending", counted)
    monkeypatch.setattr(fused, "quantize", unavailable)
    monkeypatch.setattr(fused, "dequantize", unavailable)

    q = quantize_rows(x, 8, generator=(g := gen(1)))
    assert calls["pending"] == 1
    assert events == ["codes queued", "status read"]  # the GPU is not left idle for the read
    assert torch.equal(q.data, reference.data) and torch.equal(q.lo, reference.lo)
    assert torch.equal(state(g), after_reference)
    widened = quantize_rows(big, 8, generator=gen(1))
    assert widened.half == "bf16" and torch.equal(widened.data, as_bf16.data)
    bad = x.clone()
    bad[5, 1] = float("nan")
    before = state(g := gen(2))
    with pytest.raises(CodecError, match="row 5"):
        quantize_rows(bad, 8, generator=g, where="stage 1, client 3")
    assert torch.equal(state(g), before)  # the refused block's draws were put back
