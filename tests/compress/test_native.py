"""The compiled row-codec loops: bit-equal to the torch ops, a private cache, a clean fallback."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import stat
from pathlib import Path

import pytest
import torch

from retexo_fl.compress import native
from retexo_fl.compress.quantize import CodecError, dequantize_rows, quantize_rows

HAVE_CC = native._compiler() is not None
#: The loops' real threshold for splitting rows across threads, read before any test lowers it.
PARALLEL_WORK = native._PARALLEL_WORK


@pytest.fixture(autouse=True)
def _pool_splits_small_blocks(monkeypatch):
    """The blocks here are small; the threads still split them, so that every test also checks
    the loops on rows handed to the pool (at odd row counts too)."""
    monkeypatch.setattr(native, "_PARALLEL_WORK", 1 << 12)


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """The module as if never loaded, caching into a folder of this test's own."""
    cache = tmp_path / "kernels"
    monkeypatch.setenv(native.CACHE_ENV, str(cache))
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_tried", False)
    return cache


def _encode_both(x, bits, monkeypatch, seed=3, half="fp16"):
    """The same block encoded and decoded with the compiled loops and with torch ops alone."""
    out = []
    for flag in ("1", "0"):
        monkeypatch.setenv(native.NATIVE_ENV, flag)
        q = quantize_rows(x, bits, generator=torch.Generator().manual_seed(seed), half=half)
        out.append((q, dequantize_rows(q)))
    monkeypatch.delenv(native.NATIVE_ENV)
    return out


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Compares bit patterns, so 0.0 against -0.0 or two NaNs are told apart.
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
    a, b = a.view(as_int[a.element_size()]), b.view(as_int[b.element_size()])
    return a.shape == b.shape and torch.equal(a, b)


def test_a_machine_with_a_compiler_builds_the_loops():
    if not HAVE_CC:
        pytest.skip("no C compiler on this machine: the torch ops serve")
    # A compiler that is present but fails to build must not pass unnoticed as "no compiler".
    assert native.library() is not None


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
@pytest.mark.parametrize("bits", [1, 2, 4, 8, "mixed"])
@pytest.mark.parametrize("shape", [(1, 1), (7, 3), (4_099, 37), (70_000, 16)])
def test_codes_ranges_and_decoded_values_equal_the_torch_ops(bits, shape, monkeypatch):
    gen = torch.Generator().manual_seed(sum(shape))
    k, d = shape
    x = torch.randn(k, d, generator=gen) * torch.rand(k, 1, generator=gen) * 50
    x[0] = -0.0  # a constant row, and a signed zero the reductions may order either way
    if k > 2:
        x[1] = 3.25
        x[2, 0] = 0.0
        x[2, -1] = -0.0
    widths = torch.tensor([1, 2, 4, 8])[torch.randint(0, 4, (k,), generator=gen)] if bits == "mixed" else bits
    (qn, yn), (qt, yt) = _encode_both(x, widths, monkeypatch)
    assert _bits_equal(qn.data, qt.data)
    assert _bits_equal(qn.lo, qt.lo) and _bits_equal(qn.hi, qt.hi)
    assert _bits_equal(yn, yt)
    # Equal, and right: within one step of the input.
    step = (qn.hi.float() - qn.lo.float()) / (2.0 ** qn.bits.float() - 1.0)
    assert ((yn - x).abs() <= step[:, None] * (1 + 1e-5)).all()


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
@pytest.mark.parametrize("bits", [1, 8, "mixed"])
def test_bf16_ranges_over_every_scale_equal_the_torch_ops(bits, monkeypatch):
    # Rows from denormal to 1e37 in magnitude, with bf16 ranges (8 bits of mantissa: most ends
    # are rounded outward), split across the threads.
    gen = torch.Generator().manual_seed(7)
    k, d = 20_000, 12
    scale = 10.0 ** torch.empty(k, 1).uniform_(-40, 37, generator=gen)
    x = torch.randn(k, d, generator=gen) * scale
    widths = torch.tensor([1, 2, 4, 8])[torch.randint(0, 4, (k,), generator=gen)] if bits == "mixed" else bits
    (qn, yn), (qt, yt) = _encode_both(x, widths, monkeypatch, half="bf16")
    assert _bits_equal(qn.data, qt.data) and _bits_equal(qn.lo, qt.lo) and _bits_equal(qn.hi, qt.hi)
    assert _bits_equal(yn, yt)


def _every_half(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of a 16-bit float dtype, as float32."""
    values = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype).float()
    return values[torch.isfinite(values)]


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
@pytest.mark.parametrize("half", ["fp16", "bf16"])
def test_one_pass_ranges_and_scales_equal_the_torch_ops_at_every_half_value(half, monkeypatch):
    # Each row's ends are the compiled loop's own float -> half rounding and its step outward
    # (quantize.py's torch ops cast and call nextafter): checked at every finite half value,
    # the float32 values either side of it, and the midpoints between neighbours (where rounding
    # to nearest even decides), denormal halves and signed zeros included.
    from retexo_fl.compress.quantize import RANGE_DTYPES, _row_ranges, _scales

    dtype = RANGE_DTYPES[half]
    h = _every_half(dtype)
    mids = ((h[:-1].double() + h[1:].double()) / 2).float()
    up, down = torch.nextafter(h, torch.tensor(float("inf"))), torch.nextafter(h, torch.tensor(float("-inf")))
    x = torch.cat([h, mids, up, down, torch.tensor([0.0, -0.0, 1e-45, -1e-45])])
    x = x[x.abs() <= torch.finfo(dtype).max]  # past the dtype's largest value: the next test
    rows = torch.stack([x, x.roll(1)], dim=1)  # and each value paired with another, both ends
    rows = rows[torch.isfinite(rows[:, 0] - rows[:, 1])]  # a span float32 steps across
    for block in (x[:, None], rows):
        got = native.row_ranges(block.contiguous(), dtype)
        assert got is not None
        want = _row_ranges(block, half, "rows", compiled=False)
        assert _bits_equal(got[0], want[0]) and _bits_equal(got[1], want[1])
        for bits in (1, 4, 8):
            inv, offset, levels = _scales(*want, bits)
            got_inv, got_offset = native.row_scales(*got, levels)
            assert _bits_equal(got_inv, inv) and _bits_equal(got_offset, offset)


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
def test_a_block_the_one_pass_ranges_refuse_is_left_to_the_torch_checks(monkeypatch):
    x = torch.randn(300, 5)
    assert native.row_ranges(x, torch.float16) is not None
    x[7, 2] = 7e4  # past fp16: the block goes in bf16, with the ranges a bf16 call gives
    assert native.row_ranges(x, torch.float16) is None and native.row_ranges(x, torch.bfloat16) is not None
    (qn, yn), (qt, yt) = _encode_both(x, 4, monkeypatch)
    assert qn.half == qt.half == "bf16"
    assert _bits_equal(qn.data, qt.data) and _bits_equal(qn.lo, qt.lo) and _bits_equal(yn, yt)
    x[9, 0] = float("nan")
    assert native.row_ranges(x, torch.bfloat16) is None
    with pytest.raises(CodecError, match=r"1 row\(s\) hold NaN or Inf \(first row 9\)"):
        quantize_rows(x, 4, where="client 2")


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_packed_codes_decode_in_one_pass_as_unpacking_and_dequantizing_do(bits, monkeypatch):
    # 3 columns: most rows start inside a byte; 50,001 rows: split across threads at odd rows.
    x = torch.randn(50_001, 3) * torch.rand(50_001, 1) * 9
    q = quantize_rows(x, bits, generator=torch.Generator().manual_seed(bits))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        three = dequantize_rows(q)
        torch.set_num_threads(1)
        one = dequantize_rows(q)
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    assert _bits_equal(one, three) and _bits_equal(one, dequantize_rows(q))
    monkeypatch.delenv(native.NATIVE_ENV)
    codes = native.unpack(q.data, bits, x.numel()) if bits < 8 else q.data
    step = (q.hi.float() - q.lo.float()) / float((1 << bits) - 1)
    assert _bits_equal(one, native.dequantize(codes.view(-1, 3), q.lo.float(), step))


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
def test_flushing_denormals_hands_the_work_to_the_torch_ops():
    x = torch.randn(10, 4)
    assert native.usable(x)
    can_flush = torch.set_flush_denormal(True)  # False where the CPU cannot flush
    try:
        flushing = native.usable(x)
    finally:
        torch.set_flush_denormal(False)
    assert flushing is not can_flush
    assert native.usable(x)


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
def test_a_loop_is_split_across_threads_once_its_work_outweighs_the_pool(monkeypatch):
    """Handing rows to the pool costs about 90 us; a stage-0 weight of 74,400 values is coded in
    about 16 us on one thread, so every loop keeps it on the caller's thread; a block of 2^23
    values is split by every loop. On one thread nothing is split."""
    monkeypatch.setattr(native, "_PARALLEL_WORK", PARALLEL_WORK)
    calls: list[tuple[str, int]] = []
    over_rows = native._over_rows

    def counting(k, d, run, cost=1.0):
        name = run.__qualname__.split(".")[0]
        count = [0]

        def counted(s, e):
            count[0] += 1
            run(s, e)

        over_rows(k, d, counted, cost)
        calls.append((name, count[0]))

    monkeypatch.setattr(native, "_over_rows", counting)
    key = torch.tensor([5], dtype=torch.int64)

    def every_loop(k: int, d: int) -> dict[str, int]:
        calls.clear()
        x = torch.randn(k, d)
        lo, hi = native.row_ranges(x, torch.float16)
        native.row_extremes(x)
        inv, offset = native.row_scales(lo, hi, 15.0)
        codes = native.quantize(x, torch.rand(min(k, 64), d), torch.rand(k), inv, offset, 15.0)
        native.dequantize(codes.view(k, d), lo.float(), (hi.float() - lo.float()) / 15)
        packed = native.pack(codes.view(-1), 4)
        native.unpack(packed, 4, k * d)
        native.dequantize_packed(packed, 4, k, d, lo, hi)
        native.dropout_mask(key, k * d, 0, 2.0)
        native.dropout_apply(x, key, 0, 2.0)
        return dict(calls)

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        small = every_loop(32, 2325)
        loops = {"row_ranges", "row_extremes", "quantize", "dequantize", "pack", "unpack"}
        loops |= {"dequantize_packed", "dropout_mask", "dropout_apply"}
        assert set(small) == loops and set(small.values()) == {1}, small
        large = every_loop(1 << 17, 64)
        assert set(large.values()) == {2}, large
        torch.set_num_threads(1)
        assert set(every_loop(1 << 17, 64).values()) == {1}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
def test_the_result_does_not_depend_on_threads_or_layout(monkeypatch):
    x = torch.randn(64, 50_000).t()  # not contiguous; 50,000 rows, so the rows are split
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = quantize_rows(x, 8, generator=torch.Generator().manual_seed(0))
        torch.set_num_threads(3)
        three = quantize_rows(x.contiguous(), 8, generator=torch.Generator().manual_seed(0))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one.data, three.data) and torch.equal(one.lo, three.lo)
    assert torch.equal(dequantize_rows(one), dequantize_rows(three))


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_rows_are_found_by_the_loops(bad):
    x = torch.randn(40_000, 8)
    x[31_337, 5] = bad
    assert native.usable(x)
    with pytest.raises(CodecError, match=r"client 2: 1 row\(s\) hold NaN or Inf \(first row 31337\)"):
        quantize_rows(x, 8, where="client 2")


@pytest.mark.parametrize("flag", ["1", "0"])
def test_passthrough_widths_widen_past_fp16_and_refuse_non_finite_rows_either_way(flag, monkeypatch):
    monkeypatch.setenv(native.NATIVE_ENV, flag)
    x = torch.randn(70_000, 4)
    x[50_000, 1] = 7e4  # past fp16's largest value, 65504
    widened = quantize_rows(x, 16)  # past fp16: the block goes in bf16, which holds it
    assert widened.half == "bf16"
    assert torch.equal(dequantize_rows(widened), x.bfloat16().float())
    assert torch.equal(dequantize_rows(quantize_rows(x, 32)), x)
    x[60_000, 2] = float("nan")
    for bits in (16, 32):
        with pytest.raises(CodecError, match=r"1 row\(s\) hold NaN or Inf \(first row 60000\)"):
            quantize_rows(x, bits, half="bf16")


@pytest.mark.parametrize("bits", [1, 4, 8, 16, 32])
def test_empty_blocks_either_way(bits, monkeypatch):
    for shape in ((3, 0), (0, 3)):
        (qn, yn), (qt, yt) = _encode_both(torch.empty(*shape), bits, monkeypatch)
        assert yn.shape == yt.shape == shape and qn.nbytes == qt.nbytes


def test_the_switch_and_a_missing_compiler_fall_back_to_the_torch_ops(fresh, monkeypatch):
    x = torch.randn(300, 9)
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    assert native.library() is None and not native.usable(x)
    monkeypatch.delenv(native.NATIVE_ENV)
    monkeypatch.setenv("CC", str(fresh / "no-such-compiler"))
    assert native.library() is None
    q = quantize_rows(x, 4, generator=torch.Generator().manual_seed(0))
    step = (q.hi.float() - q.lo.float()) / 15
    assert ((dequantize_rows(q) - x).abs() <= step[:, None] * (1 + 1e-5)).all()
    assert not fresh.exists() or not list(fresh.glob("*.so"))


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
def test_the_library_is_cached_once_in_a_private_folder(fresh, monkeypatch):
    lib = native.library()
    assert lib is not None
    built = list(fresh.glob("rows-*.so"))
    assert len(built) == 1 and stat.S_IMODE(fresh.stat().st_mode) == 0o700
    first = built[0].stat().st_mtime_ns
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_lib", None)
    assert native.library() is not None
    assert built[0].stat().st_mtime_ns == first  # reused, not rebuilt
    assert [p.name for p in fresh.iterdir()] == [built[0].name]  # no build folders left behind


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
def test_a_folder_others_can_write_is_never_loaded_from(fresh, monkeypatch):
    fresh.mkdir(mode=0o700)
    # A library under the very name this machine's build takes, planted in a folder anyone
    # can write to: it must be neither loaded nor replaced.
    planted = native._build(native._compiler(), fresh)
    os.chmod(fresh, 0o777)
    before = planted.stat().st_mtime_ns
    assert native.library() is not None
    assert [p.name for p in fresh.iterdir()] == [planted.name] and planted.stat().st_mtime_ns == before
    assert not _loaded_from(fresh)


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
def test_a_library_others_can_write_is_built_over(fresh, monkeypatch):
    fresh.mkdir(mode=0o700)
    planted = native._build(native._compiler(), fresh)
    os.chmod(planted, 0o777)  # the folder is private, but the file is not
    assert native.library() is not None
    assert stat.S_IMODE(planted.stat().st_mode) == 0o700  # a new build replaced it
    assert _loaded_from(fresh)


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
def test_a_folder_under_one_others_can_write_is_not_trusted(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # no sticky bit: anyone may rename what is inside
    inner = shared / "mine"
    inner.mkdir(mode=0o700)
    assert native._trusted_folder(tmp_path) and not native._trusted_folder(inner)
    os.chmod(shared, 0o1777)  # sticky, as /tmp is: only the owner renames its entries
    assert native._trusted_folder(inner)


def test_a_path_through_a_symlink_is_not_trusted(tmp_path):
    """Every folder of the resolved path is this user's, but the link could be repointed between
    the check and the load by whoever owns the folder it sits in."""
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    assert native._trusted_folder(real)
    assert not native._trusted_folder(tmp_path / "link")


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
def test_a_cache_folder_that_cannot_be_made_builds_in_a_temp_folder(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(native.CACHE_ENV, str(blocker / "kernels"))  # mkdir fails under a file
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_tried", False)
    assert native.library() is not None


def _loaded_from(folder) -> bool:
    """Whether the loaded library's file lies in ``folder``."""
    maps = Path("/proc/self/maps").read_text().splitlines()
    return any(str(folder) in line and "rows-" in line for line in maps)


def _codes_digest(args) -> str:
    return hashlib.sha256(native.quantize(*args).numpy().tobytes()).hexdigest()


def _encode_in_child(queue, args) -> None:
    queue.put(_codes_digest(args))


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="no fork here")
def test_a_forked_child_encodes_after_its_parent_used_the_thread_pool():
    k, d = 100_000, 16
    gen = torch.Generator().manual_seed(0)
    args = (torch.randn(k, d, generator=gen), torch.rand(64, d, generator=gen), torch.rand(k, generator=gen),
            torch.full((k,), 20.0), torch.full((k,), -80.0), 255.0)  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        expected = _codes_digest(args)  # the parent's pool now has threads
        # The child calls the loops alone: torch's own OpenMP regions can hang after a fork
        # (libgomp), whatever this module does, so the child runs none.
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()
        child = ctx.Process(target=_encode_in_child, args=(queue, args))
        child.start()
        child.join(timeout=60)
    finally:
        torch.set_num_threads(threads)
    if child.is_alive():
        child.kill()
        pytest.fail("a forked child hung on the thread pool it inherited")
    assert child.exitcode == 0 and queue.get(timeout=5) == expected
