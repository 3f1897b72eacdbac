"""Fixed-point encoding: sums decode within the stated bound, rounding is unbiased, nothing wraps."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from retexo_fl.secure.fixedpoint import MODULUS, FixedPoint, field_sum, max_scale_bits


def test_decoded_sum_is_within_the_stated_bound_of_the_float_sum():
    rng = np.random.default_rng(0)
    for clip, clients in [(1.0, 5), (0.3, 100), (7.5, 3)]:
        fp = FixedPoint(clip, clients)
        updates = rng.uniform(-clip, clip, size=(clients, 5000))
        updates[:, :2] = [clip, -clip]  # the edges of the range
        total = field_sum(fp.encode(u, rng) for u in updates)
        err = np.abs(fp.decode_sum(total, clients) - updates.sum(axis=0)).max()
        assert err <= fp.sum_error(clients), (clip, clients, err, fp.sum_error(clients))
        # A sum of fewer clients decodes too.
        part = field_sum(fp.encode(u, rng) for u in updates[:2])
        assert np.abs(fp.decode_sum(part, 2) - updates[:2].sum(axis=0)).max() <= fp.sum_error(2)


def test_stochastic_rounding_is_unbiased():
    fp = FixedPoint(1.0, 1, scale_bits=4)  # steps of 1/16: 0.3 lies between 0.25 and 0.3125
    x = np.full(200_000, 0.3)
    decoded = fp.decode_sum(fp.encode(x, np.random.default_rng(1)), 1)
    assert set(np.unique(decoded)) == {0.25, 0.3125}
    # Nearest rounding would give 0.3125 (bias 0.0125); the mean's std here is about 5e-5.
    assert abs(decoded.mean() - 0.3) < 5e-4


def test_the_scale_is_the_largest_whose_sums_never_wrap():
    assert max_scale_bits(1.0, 2) == 29  # 2 clients * 2 * 2**29 = 2**31; 2**30 would give 2**32
    for clip, clients in [(1.0, 2), (0.1, 1000), (3.7, 7), (1e-12, 10), (1000.0, 100_000)]:
        bits = max_scale_bits(clip, clients)
        fp = FixedPoint(clip, clients)
        assert fp.scale_bits == bits
        assert 2 * clients * fp.offset <= MODULUS - 1
        with pytest.raises(ValueError, match=rf"clip {clip}, {clients} clients and scale_bits {bits + 1}"):
            FixedPoint(clip, clients, scale_bits=bits + 1)
        # The worst case, every client at +clip: the sum is the largest value and does not wrap.
        # (numpy's uint32 sum wraps as field_sum does, without a loop over 100,000 clients.)
        top = fp.encode(np.full((clients, 3), clip)).sum(axis=0, dtype=np.uint32)
        assert np.allclose(fp.decode_sum(top, clients), clients * clip)
        bottom = fp.encode(np.full((clients, 3), -clip)).sum(axis=0, dtype=np.uint32)
        assert np.allclose(fp.decode_sum(bottom, clients), -clients * clip)
    with pytest.raises(ValueError, match=r"no scale fits 10 clients with clip 1000000000\.0"):
        max_scale_bits(1e9, 10)


def test_bad_settings_and_values_are_refused():
    with pytest.raises(ValueError, match="clip must be a finite float > 0"):
        FixedPoint(0.0, 3)
    with pytest.raises(ValueError, match="clients must be an int >= 1"):
        FixedPoint(1.0, 0)
    fp = FixedPoint(1.0, 3, scale_bits=16)
    with pytest.raises(ValueError, match="1 of 3 values to encode are NaN or infinite"):
        fp.encode([0.0, math.nan, 1.0])
    # Out of range is clipped (a float32 update clipped to a float64 clip may exceed it by an ulp).
    enc = fp.encode(torch.tensor([5.0, -5.0, np.float32(0.1)]), np.random.default_rng(0))
    assert enc[0] == 2 * fp.offset and enc[1] == 0
    with pytest.raises(ValueError, match="a sum of 1 to 3 vectors, not 4"):
        fp.decode_sum(enc, 4)
    with pytest.raises(ValueError, match="not a sum of 1 encoded vectors"):
        fp.decode_sum(enc + np.uint32(1), 1)
    with pytest.raises(ValueError, match="vector 1 has shape"):
        field_sum([enc, enc[:2]])
