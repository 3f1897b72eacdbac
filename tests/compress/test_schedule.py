"""Variable-rate schedules: parsing, rates over exchanges, snapping to codec widths."""

from __future__ import annotations

import pytest

from retexo_fl.compress.quantize import snap_bits
from retexo_fl.compress.schedule import RateSchedule


def test_rates():
    assert [RateSchedule.parse("fixed").rate(t, 4, 8) for t in range(4)] == [8, 8, 8, 8]
    assert [RateSchedule.parse("linear:2,8").rate(t, 4, 32) for t in range(4)] == [2, 4, 6, 8]
    assert [RateSchedule.parse("step:1,4").rate(t, 4, 32) for t in range(4)] == [1, 4, 4, 4]
    assert RateSchedule.parse("linear:2,8").rate(0, 1, 32) == 2


def test_snap():
    assert [snap_bits(r) for r in (0.5, 1, 3.9, 4, 6, 8, 15, 16, 40)] == [1, 1, 2, 4, 4, 8, 8, 16, 32]


@pytest.mark.parametrize("spec", ["linear:2", "step:", "steps:1", "linear:0,8", "step:a"])
def test_bad_specs(spec):
    with pytest.raises(ValueError, match="rate-schedule"):
        RateSchedule.parse(spec)
