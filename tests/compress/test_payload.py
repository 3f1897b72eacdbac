"""Row frames: exact sizes from the header, round trips, and frames that do not match are rejected."""

from __future__ import annotations

import struct

import pytest
import torch

from retexo_fl.compress.payload import HEADER_BYTES, PayloadError, decode_rows, encode_rows, frame_size
from retexo_fl.config import TrainConfig
from retexo_fl.protocol import config_from_json, config_to_json


@pytest.mark.parametrize("bits", [1, 2, 4, 8, 16, 32])
@pytest.mark.parametrize(("k", "d"), [(1, 1), (7, 5), (13, 64), (0, 8)])
def test_sizes_are_exact(bits, k, d):
    blob = encode_rows(torch.randn(k, d), bits)
    assert len(blob) == frame_size(k, d, bits)
    if bits in (16, 32):
        assert len(blob) == HEADER_BYTES + k * d * bits // 8
    else:
        assert len(blob) == HEADER_BYTES + 4 * k + (k * d * bits + 7) // 8
    assert decode_rows(blob, "client 1", k, d).shape == (k, d)


def test_mixed_width_frame_size_and_round_trip():
    widths = torch.tensor([8, 1, 1, 2, 4, 4, 1])
    x = torch.randn(7, 9)
    blob = encode_rows(x, widths, generator=torch.Generator().manual_seed(0))
    body = sum((int((widths == b).sum()) * 9 * b + 7) // 8 for b in (1, 2, 4, 8))
    assert len(blob) == frame_size(7, 9, widths) == HEADER_BYTES + 7 + 4 * 7 + body
    y = decode_rows(blob, "client 1", 7, 9)
    assert (y[0] - x[0]).abs().max() < (x[0].max() - x[0].min()) / 255 * 1.01


def test_32_bit_round_trip_is_exact():
    x = torch.randn(11, 3)
    assert torch.equal(decode_rows(encode_rows(x, 32), "client 2", 11, 3), x)


def _header(blob: bytes) -> tuple:
    return struct.unpack_from("<4sBBBII", blob)


def _with_header(blob: bytes, **fields) -> bytes:
    magic, bits, half, pad, k, d = _header(blob)
    vals = {"magic": magic, "bits": bits, "half": half, "pad": pad, "k": k, "d": d, **fields}
    head = struct.pack("<4sBBBII", *(vals[n] for n in ("magic", "bits", "half", "pad", "k", "d")))
    return head + blob[HEADER_BYTES:]


# Seeded: the frames name the parametrized cases below, and every collection (each worker of a
# parallel run) must name them alike.
GOOD = encode_rows(
    torch.randn(4, 6, generator=torch.Generator().manual_seed(1)),
    4,
    generator=torch.Generator().manual_seed(0),
)
MIXED = encode_rows(
    torch.randn(4, 6, generator=torch.Generator().manual_seed(2)),
    torch.tensor([1, 2, 4, 8]),
    generator=torch.Generator().manual_seed(0),
)


def _bf16_frame_with_ranges(lo: float, hi: float) -> bytes:
    """A 4 x 6 frame of 8-bit codes whose first row's range is ``[lo, hi]`` in bf16."""
    blob = bytearray(encode_rows(torch.randn(4, 6), 8, half="bf16"))
    bf16 = torch.tensor([lo, hi]).bfloat16().view(torch.int16).tolist()
    struct.pack_into("<h", blob, HEADER_BYTES, bf16[0])  # lo of row 0; his follow the 4 los
    struct.pack_into("<h", blob, HEADER_BYTES + 8, bf16[1])
    return bytes(blob)


def test_a_range_float32_cannot_step_across_is_refused_at_both_ends():
    # Each end is a finite bf16 value, but hi - lo overflows float32: every value would decode
    # to NaN (0 * inf), so the sender refuses the row and the receiver refuses the frame.
    from retexo_fl.compress.quantize import CodecError, quantize_rows

    with pytest.raises(CodecError, match="client 5: a row spans more than float32"):
        quantize_rows(torch.tensor([[-3e38, 3e38, 0.0]]), 8, half="bf16", where="client 5")
    assert torch.isfinite(decode_rows(_bf16_frame_with_ranges(-1e38, 1e38), "client 3", 4, 6)).all()
    with pytest.raises(PayloadError, match="client 3: a row range is wider than float32 can step"):
        decode_rows(_bf16_frame_with_ranges(-3e38, 3e38), "client 3", 4, 6)


@pytest.mark.parametrize(
    ("lo", "hi"),
    [(float("nan"), 1.0), (0.0, float("nan")), (float("-inf"), 1.0), (0.0, float("inf")), (2.0, 1.0)],
)
def test_a_range_that_is_not_a_finite_ordered_interval_is_refused(lo, hi):
    with pytest.raises(PayloadError, match="client 3: row ranges are not finite, ordered intervals"):
        decode_rows(_bf16_frame_with_ranges(lo, hi), "client 3", 4, 6)
    assert torch.isfinite(decode_rows(_bf16_frame_with_ranges(1.0, 1.0), "client 3", 4, 6)).all()


@pytest.mark.parametrize(
    ("blob", "needle"),
    [
        (GOOD[:5], "shorter than a header"),
        (GOOD[:-1], "frame has"),
        (GOOD + b"\0", "frame has"),
        (b"XXXX" + GOOD[4:], "bad magic"),
        (_with_header(GOOD, bits=3), "unknown bit width 3"),
        (_with_header(GOOD, bits=8), "frame has"),  # the header claims more bytes than came
        (_with_header(GOOD, half=9), "range dtype"),
        (_with_header(GOOD, k=5), "5 rows, boundary plan expects 4"),
        (_with_header(GOOD, d=7), "7 columns, expected 6"),
        (MIXED[:HEADER_BYTES] + bytes([3]) + MIXED[HEADER_BYTES + 1 :], "per-row widths"),
        # hi < lo in the first row's range: lo is at the body's start, hi 2 * 4 bytes later.
        (
            GOOD[:HEADER_BYTES]
            + b"\x00\x3c"
            + GOOD[HEADER_BYTES + 2 : HEADER_BYTES + 8]
            + b"\x00\xbc"
            + GOOD[HEADER_BYTES + 10 :],
            "ordered intervals",
        ),
        (encode_rows(torch.ones(2, 2), 32)[:HEADER_BYTES] + struct.pack("<4f", 1, float("nan"), 1, 1), "NaN"),
    ],
)
def test_bad_frames_name_the_source(blob, needle):
    with pytest.raises(PayloadError, match=f"client 3.*{needle}"):
        decode_rows(blob, "client 3", 4 if len(blob) > 40 else None, 6 if len(blob) > 40 else None)


def test_config_travels_as_json():
    cfg = TrainConfig.resolve(
        profile="exact", bits=4, bit_policy="adaptive-budget", byte_budget="4b", update_bits=8, rounds=[3, 2]
    )
    assert config_from_json(config_to_json(cfg)) == cfg
