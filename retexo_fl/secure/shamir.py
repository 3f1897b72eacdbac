r"""Shamir secret sharing of 32-byte secrets (mask seeds, mask keys) over the prime field :math:`2^{521} - 1`.

Secure aggregation must remove a dropped client's masks without that client: before masking,
each client splits its secrets among its peers so that any ``threshold`` of them can rebuild a
secret and fewer learn nothing about it (Shamir, 1979). A secret is the constant term of a
random polynomial of degree ``threshold - 1``; holder ``h`` gets its value at ``h + 1`` (never at
0, which is the secret). The field is the Mersenne prime :math:`p = 2^{521} - 1`, so any 32-byte
secret is one field element. A share is its value as :data:`SHARE_BYTES` big-endian bytes, the
same length whatever the value, so a share's length tells nothing about it.

Shamir sharing has no integrity: a share altered by :math:`e` moves the rebuilt secret by
:math:`e` times that share's Lagrange weight, a value its holder can compute, so it can move the
secret wherever it likes, and damage to a share's low bytes yields another valid secret.
:func:`combine` refuses only results too large for a secret. Shares must travel in the
authenticated sealed channels (:mod:`retexo_fl.secure.envelope`), which refuse altered ones.
"""

from __future__ import annotations

import secrets

#: The field's modulus, the Mersenne prime 2**521 - 1.
PRIME = 2**521 - 1
#: Bytes of a secret.
SECRET_BYTES = 32
#: Bytes of a share: one field element, big-endian.
SHARE_BYTES = (PRIME.bit_length() + 7) // 8


class ShareError(ValueError):
    """A secret, share, holder or threshold that sharing or rebuilding refuses."""


def _check_holder(holder: object) -> int:
    # Evaluation points are holder + 1, in [1, p - 1]: never 0 (the secret) and all distinct.
    if isinstance(holder, bool) or not isinstance(holder, int) or not 0 <= holder < PRIME - 1:
        raise ShareError(f"holder {holder!r}: not a client id (an int in [0, 2**521 - 2))")
    return holder


def split(secret: bytes, threshold: int, holders: list[int]) -> dict[int, bytes]:
    """Shares of ``secret``, one per holder, any ``threshold`` of which rebuild it.

    Args:
        secret (bytes): the :data:`SECRET_BYTES`-byte secret.
        threshold (int): how many shares rebuild it, 1 to ``len(holders)``; fewer reveal nothing.
        holders (list[int]): the distinct client ids receiving a share.

    Returns:
        ``{holder: SHARE_BYTES-byte share}``.

    Raises:
        ShareError: ``secret`` is not 32 bytes, ``threshold`` is out of range, or a holder id is
            invalid or repeated (naming it).
    """
    secret = bytes(secret)
    if len(secret) != SECRET_BYTES:
        raise ShareError(f"secret sharing: a secret is {SECRET_BYTES} bytes, got {len(secret)}")
    seen: set[int] = set()
    for h in holders:
        if _check_holder(h) in seen:
            raise ShareError(f"holder {h}: listed twice")
        seen.add(h)
    if isinstance(threshold, bool) or not isinstance(threshold, int) or not 1 <= threshold <= len(seen):
        raise ShareError(
            f"secret sharing: threshold must be 1 to {len(seen)} (the holders), got {threshold!r}"
        )
    coefficients = [int.from_bytes(secret, "big")] + [secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    shares = {}
    for h in holders:
        x, y = h + 1, 0
        for c in reversed(coefficients):  # Horner
            y = (y * x + c) % PRIME
        shares[h] = y.to_bytes(SHARE_BYTES, "big")
    return shares


def combine(shares: dict[int, bytes], threshold: int) -> bytes:
    """The secret that ``threshold`` of ``shares`` rebuild (Lagrange interpolation at 0).

    The ``threshold`` shares of the lowest holder ids are used; others are not checked.

    Args:
        shares (dict[int, bytes]): ``{holder: share}`` as :func:`split` made them.
        threshold (int): the threshold they were split with, >= 1.

    Returns:
        The :data:`SECRET_BYTES`-byte secret.

    Raises:
        ShareError: ``threshold`` < 1, fewer than ``threshold`` shares, a holder id is invalid, a
            share is not :data:`SHARE_BYTES` bytes or not below the prime (naming its holder), or
            the shares rebuild a value too large for a secret (damaged or mixed up; most damage to
            a share's high bytes shows this way, damage to its low bytes does not).
    """
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1:
        raise ShareError(f"secret sharing: threshold must be an int >= 1, got {threshold!r}")
    if len(shares) < threshold:
        raise ShareError(
            f"secret sharing: {len(shares)} shares (holders {sorted(shares)}), {threshold} needed to rebuild"
        )
    points = []
    for h in sorted(shares, key=_check_holder)[:threshold]:
        share = bytes(shares[h])
        if len(share) != SHARE_BYTES:
            raise ShareError(f"holder {h}: a share is {SHARE_BYTES} bytes, got {len(share)}")
        y = int.from_bytes(share, "big")
        if y >= PRIME:
            raise ShareError(f"holder {h}: share value is not below the field's prime")
        points.append((h + 1, y))
    secret = 0
    for i, (xi, yi) in enumerate(points):
        num, den = 1, 1
        for j, (xj, _) in enumerate(points):
            if j != i:
                num = num * xj % PRIME
                den = den * (xj - xi) % PRIME
        secret = (secret + yi * num * pow(den, -1, PRIME)) % PRIME
    if secret >= 2 ** (8 * SECRET_BYTES):
        raise ShareError(
            f"secret sharing: holders {[x - 1 for x, _ in points]} rebuild no {SECRET_BYTES}-byte secret; "
            "a share is damaged or from another secret"
        )
    return secret.to_bytes(SECRET_BYTES, "big")
