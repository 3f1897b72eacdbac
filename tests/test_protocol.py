"""Boundary payload framing: exact round trip, and headers that do not match are rejected."""

from __future__ import annotations

import pytest
import torch

from retexo_fl.protocol import ROW_HEADER_BYTES, PayloadError, rows_from_bytes, rows_to_bytes


def test_round_trip_is_exact_and_sized():
    rows = torch.randn(7, 5)
    blob = rows_to_bytes(rows)
    assert len(blob) == ROW_HEADER_BYTES + 7 * 5 * 4
    assert torch.equal(rows_from_bytes(blob, source=2, expect_rows=7), rows)


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [(lambda b: b[:-4], "body has"), (lambda b: b"XXXX" + b[4:], "bad header"), (lambda b: b[:5], "shorter")],
)
def test_bad_payloads_name_the_source(mutate, needle):
    with pytest.raises(PayloadError, match=f"client 3.*{needle}"):
        rows_from_bytes(mutate(rows_to_bytes(torch.ones(2, 3))), source=3)


def test_row_count_checked_against_plan():
    with pytest.raises(PayloadError, match="boundary plan expects 4"):
        rows_from_bytes(rows_to_bytes(torch.ones(3, 2)), source=1, expect_rows=4)
