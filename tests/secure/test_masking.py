"""Double masking: pair seeds agree, masks cancel or are removed exactly, a masked vector looks uniform."""

from __future__ import annotations

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from retexo_fl.secure.fixedpoint import FixedPoint, field_sum
from retexo_fl.secure.keys import public_bytes
from retexo_fl.secure.masking import expand, masked_update, pairwise_mask_seed, unmask_sum

TRANSCRIPT = bytes(range(32))


def _clients(ids: list[int], length: int, stage: int = 1, round_: int = 3):
    """Each client's encoded update, self seed and pair seeds with every other client."""
    keys = {i: X25519PrivateKey.generate() for i in ids}
    fp = FixedPoint(1.0, len(ids))
    rng = np.random.default_rng(0)
    encoded = {i: fp.encode(rng.normal(0, 0.3, length), rng) for i in ids}
    self_seeds = {i: bytes([i]) * 32 for i in ids}
    pair_seeds = {
        i: {
            j: pairwise_mask_seed(keys[i], public_bytes(keys[j]), TRANSCRIPT, i, j, stage, round_)
            for j in ids
            if j != i
        }
        for i in ids
    }
    return encoded, self_seeds, pair_seeds


def test_both_sides_derive_the_same_seed_and_it_never_repeats():
    a, b = X25519PrivateKey.generate(), X25519PrivateKey.generate()
    pa, pb = public_bytes(a), public_bytes(b)
    seed = pairwise_mask_seed(a, pb, TRANSCRIPT, 2, 9, 1, 4)
    assert len(seed) == 32
    assert pairwise_mask_seed(b, pa, TRANSCRIPT, 9, 2, 1, 4) == seed
    others = {
        pairwise_mask_seed(a, pb, TRANSCRIPT, 2, 9, 1, 5),  # next round
        pairwise_mask_seed(a, pb, TRANSCRIPT, 2, 9, 2, 4),  # next stage
        pairwise_mask_seed(a, pb, bytes(32), 2, 9, 1, 4),  # another run
        pairwise_mask_seed(a, pb, TRANSCRIPT, 2, 8, 1, 4),  # another id claimed for the peer
        pairwise_mask_seed(a, pb, TRANSCRIPT, 2, 9, 1, 4, bytes(32)),  # other round terms
    }
    assert seed not in others and len(others) == 5
    terms = bytes(range(32))
    assert pairwise_mask_seed(a, pb, TRANSCRIPT, 2, 9, 1, 4, terms) == pairwise_mask_seed(
        b, pa, TRANSCRIPT, 9, 2, 1, 4, terms
    )
    with pytest.raises(ValueError, match="mask seed of clients 2 and 2: ids must differ"):
        pairwise_mask_seed(a, pb, TRANSCRIPT, 2, 2, 1, 4)
    with pytest.raises(ValueError, match="mask seed of clients 2 and 9: a public key is 32 bytes"):
        pairwise_mask_seed(a, pb[:31], TRANSCRIPT, 2, 9, 1, 4)


def test_expansion_is_deterministic_and_seed_specific():
    seed = bytes(range(32))
    long = expand(seed, 1000)
    assert long.dtype == np.uint32 and long.shape == (1000,)
    assert np.array_equal(expand(seed, 10), long[:10])  # a prefix of one keystream
    assert not np.array_equal(expand(bytes(32), 10), long[:10])
    assert expand(seed, 0).shape == (0,)
    with pytest.raises(ValueError, match="a seed is 32 bytes, got 16"):
        expand(seed[:16], 4)


def test_pair_masks_cancel_when_every_client_is_present():
    ids = [0, 1, 4, 7]
    encoded, self_seeds, pair_seeds = _clients(ids, 2000)
    masked = [masked_update(encoded[i], i, self_seeds[i], pair_seeds[i]) for i in ids]
    plain = field_sum(encoded[i] for i in ids)
    # Without the self masks, the pair masks alone cancel in the sum.
    no_self = [masked[k] - expand(self_seeds[i], 2000) for k, i in enumerate(ids)]  # uint32 arithmetic wraps
    assert not any(np.array_equal(v, encoded[i]) for v, i in zip(no_self, ids, strict=True))
    assert np.array_equal(field_sum(no_self), plain)
    assert np.array_equal(unmask_sum(field_sum(masked), self_seeds, {}), plain)


def test_a_client_dropped_after_masking_is_unmasked_exactly():
    ids = [0, 1, 4, 7]
    for dropped in ids:  # the lowest, middle and highest id: both signs of the leftover masks
        encoded, self_seeds, pair_seeds = _clients(ids, 2000)
        survivors = [i for i in ids if i != dropped]
        total = field_sum(masked_update(encoded[i], i, self_seeds[i], pair_seeds[i]) for i in survivors)
        recovered = unmask_sum(
            total,
            {i: self_seeds[i] for i in survivors},
            {(i, dropped): pair_seeds[i][dropped] for i in survivors},
        )
        assert recovered.dtype == np.uint32
        assert np.array_equal(recovered, field_sum(encoded[i] for i in survivors))
        # The leftover pair masks are real: removing only the self masks is not enough.
        only_self = unmask_sum(total, {i: self_seeds[i] for i in survivors}, {})
        assert not np.array_equal(only_self, recovered)
    with pytest.raises(ValueError, match=r"pair \(1, 0\) is not \(survivor, dropped\)"):
        unmask_sum(total, {i: self_seeds[i] for i in [0, 1]}, {(1, 0): bytes(32)})


def test_a_masked_vector_looks_uniform_and_uncorrelated_with_the_update():
    n = 1 << 16
    encoded, self_seeds, pair_seeds = _clients([0, 1, 2], n)
    plain = encoded[1]
    masked = masked_update(plain, 1, self_seeds[1], pair_seeds[1])
    # The plain encoding is far from uniform: its top byte is nearly constant.
    expected = n / 256
    chi2_plain = ((np.bincount(plain >> 24, minlength=256) - expected) ** 2 / expected).sum()
    chi2 = ((np.bincount(masked >> 24, minlength=256) - expected) ** 2 / expected).sum()
    # 255 degrees of freedom: mean 255, std about 22.6; 400 is over 6 std above the mean.
    assert chi2 < 400 < chi2_plain
    low = ((np.bincount(masked & 0xFF, minlength=256) - expected) ** 2 / expected).sum()
    assert low < 400
    # The correlation of n independent pairs has std about 1/256.
    corr = np.corrcoef(masked.astype(np.float64), plain.astype(np.float64))[0, 1]
    assert abs(corr) < 0.03
