"""Shamir sharing: any threshold of shares rebuild the secret, fewer say nothing about it."""

from __future__ import annotations

import secrets

import pytest

from retexo_fl.secure.shamir import PRIME, SHARE_BYTES, ShareError, combine, split


def _lagrange_at_zero(xs: list[int], i: int) -> int:
    """The weight of point ``xs[i]``'s value in the polynomial's value at 0."""
    num, den = 1, 1
    for j, xj in enumerate(xs):
        if j != i:
            num, den = num * xj % PRIME, den * (xj - xs[i]) % PRIME
    return num * pow(den, -1, PRIME) % PRIME


def test_any_threshold_of_shares_rebuild_the_secret():
    for threshold, n in [(1, 1), (1, 3), (2, 2), (2, 5), (3, 5), (5, 8), (10, 10)]:
        secret = secrets.token_bytes(32)
        holders = [3 * k + 7 for k in range(n)]  # client ids, not 0..n-1
        shares = split(secret, threshold, holders)
        assert sorted(shares) == holders
        assert {len(s) for s in shares.values()} == {SHARE_BYTES}
        for start in range(n - threshold + 1):
            subset = {h: shares[h] for h in holders[start : start + threshold]}
            assert combine(subset, threshold) == secret
        assert combine(shares, threshold) == secret  # more than enough
    # Holder 0 is evaluated at 1, not at 0 (the secret).
    secret = secrets.token_bytes(32)
    assert split(secret, 2, [0, 1])[0] != secret.rjust(SHARE_BYTES, b"\0")


def test_fewer_than_threshold_shares_are_consistent_with_every_secret():
    for threshold in (2, 3):
        holders = list(range(threshold + 2))
        shares = split(secrets.token_bytes(32), threshold, holders)
        known = {h: shares[h] for h in holders[: threshold - 1]}  # what t-1 colluders hold
        xs = [h + 1 for h in known] + [holders[-1] + 1]
        weights = [_lagrange_at_zero(xs, i) for i in range(len(xs))]
        partial = sum(
            w * int.from_bytes(known[x - 1], "big") for w, x in zip(weights[:-1], xs[:-1], strict=True)
        )
        for candidate in (bytes(32), b"\xff" * 32, secrets.token_bytes(32)):
            # One more point completes a polynomial of degree t-1 through the known shares and
            # (0, candidate): every secret is as consistent with them as the true one.
            y = (int.from_bytes(candidate, "big") - partial) * pow(weights[-1], -1, PRIME) % PRIME
            forged = {**known, holders[-1]: y.to_bytes(SHARE_BYTES, "big")}
            assert combine(forged, threshold) == candidate


def test_a_damaged_share_moves_the_secret_or_is_refused():
    secret = secrets.token_bytes(32)
    shares = split(secret, 3, [0, 1, 2, 3])
    # Holder 1's weight at points 1, 2, 3 is -3: damage to its share moves the secret by -3 times
    # the damage. In the low bytes that is a different 32-byte secret, and nothing notices.
    low = {**shares, 1: shares[1][:-1] + bytes([shares[1][-1] ^ 0x01])}
    moved = combine(low, 3)
    assert moved != secret
    assert abs(int.from_bytes(moved, "big") - int.from_bytes(secret, "big")) == 3
    # In the high bytes the result no longer fits 32 bytes, and it is refused.
    high = {**shares, 1: shares[1][:1] + bytes([shares[1][1] ^ 0x01]) + shares[1][2:]}
    with pytest.raises(ShareError, match=r"holders \[0, 1, 2\] rebuild no 32-byte secret"):
        combine(high, 3)
    # A holder who knows the ids can shift the secret by any delta: Shamir has no integrity,
    # which is why shares travel only in the authenticated sealed channels.
    weight = _lagrange_at_zero([1, 2, 3], 1)
    assert weight == PRIME - 3
    shifted = (int.from_bytes(shares[1], "big") + 5 * pow(weight, -1, PRIME)) % PRIME
    chosen = combine({**shares, 1: shifted.to_bytes(SHARE_BYTES, "big")}, 3)
    assert int.from_bytes(chosen, "big") == (int.from_bytes(secret, "big") + 5) % PRIME


def test_bad_inputs_name_their_holder():
    secret = secrets.token_bytes(32)
    shares = split(secret, 2, [4, 5, 6])
    with pytest.raises(ShareError, match=r"1 shares \(holders \[4\]\), 2 needed"):
        combine({4: shares[4]}, 2)
    with pytest.raises(ShareError, match="holder 5: a share is 66 bytes, got 65"):
        combine({4: shares[4], 5: shares[5][1:]}, 2)
    with pytest.raises(ShareError, match="holder 5: share value is not below"):
        combine({4: shares[4], 5: PRIME.to_bytes(SHARE_BYTES, "big")}, 2)
    with pytest.raises(ShareError, match="holder -1: not a client id"):
        combine({4: shares[4], -1: shares[5]}, 2)
    with pytest.raises(ShareError, match="threshold must be an int >= 1, got 0"):
        combine(shares, 0)
    with pytest.raises(ShareError, match="holder 4: listed twice"):
        split(secret, 2, [4, 5, 4])
    with pytest.raises(ShareError, match="holder True: not a client id"):
        split(secret, 1, [True])
    with pytest.raises(ShareError, match=r"threshold must be 1 to 3 \(the holders\), got 4"):
        split(secret, 4, [1, 2, 3])
    with pytest.raises(ShareError, match="threshold must be 1 to 3"):
        split(secret, 0, [1, 2, 3])
    with pytest.raises(ShareError, match="a secret is 32 bytes, got 31"):
        split(secret[1:], 2, [1, 2, 3])
