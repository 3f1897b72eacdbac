r"""Double masking of encoded updates (Bonawitz et al., 2017; Bell et al., 2020): the server sums
masked vectors and learns only the sum.

Client :math:`i` sends :math:`y_i = x_i + \mathrm{PRG}(b_i) + \sum_{j > i} \mathrm{PRG}(s_{ij}) -
\sum_{j < i} \mathrm{PRG}(s_{ij})` modulo :math:`2^{32}`, where :math:`x_i` is its fixed-point update
(:mod:`retexo_fl.secure.fixedpoint`), :math:`b_i` a fresh random self seed and :math:`s_{ij} = s_{ji}`
the seed it agrees with each neighbour :math:`j` (:func:`pairwise_mask_seed`). Each pair's mask
is added by one side and subtracted by the other, so pairwise masks cancel in the sum of all
clients. The self mask hides :math:`x_i` even if the server later learns :math:`i`'s pairwise seeds
(a client that was only late, not dropped), and the server removes it for survivors only.

When client :math:`d` drops after others masked, its :math:`y_d` is missing, so each survivor's
mask with :math:`d` stays in the sum; the server removes it with :math:`s_{id}`
(:func:`unmask_sum`). Which seeds the server may rebuild (from Shamir shares,
:mod:`retexo_fl.secure.shamir`) is the protocol's to enforce: never a survivor's pairwise seeds
together with its self seed, and never the long-term identity key a seed was agreed with.

A seed masks one vector only: two vectors under the same mask differ by their plain difference.
Pair seeds bind the run's transcript, the stage and the round, so they repeat only if a client
masks the same stage and round twice, which the protocol must refuse
(:func:`retexo_fl.party.secure_reply.prepare` does).
"""

from __future__ import annotations

import struct

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from retexo_fl.secure.fixedpoint import DTYPE
from retexo_fl.secure.keys import parse_public, public_bytes

#: Bytes of a mask seed (an AES-256 key).
SEED_BYTES = 32
_LABEL = b"retexo-fl secagg mask v1"
_ZERO_NONCE = bytes(16)


def pairwise_mask_seed(
    own_private: X25519PrivateKey,
    peer_public: bytes,
    transcript: bytes,
    own_id: int,
    peer_id: int,
    stage: int,
    round_: int,
    terms: bytes = b"",
) -> bytes:
    """The mask seed two clients share for one stage and round; both sides derive the same one.

    X25519 agreement, then HKDF-SHA256 salted with the run transcript, its info binding both ids
    and public keys (lower id first, so both sides build the same bytes), the stage, the round and
    the round's masking terms: two clients that were sent different terms (member set, threshold,
    weight bound) derive different seeds, their masks do not cancel, and the sum the server
    unmasks is noise instead of a sum over a set it chose per client.

    Args:
        own_private (X25519PrivateKey): this client's mask key.
        peer_public (bytes): the peer's 32-byte public key.
        transcript (bytes): the run's transcript hash (:func:`retexo_fl.secure.envelope.transcript_hash`).
        own_id (int): this client.
        peer_id (int): the peer, not ``own_id``.
        stage (int): the stage the masked vector belongs to.
        round_ (int): the round it belongs to.
        terms (bytes, optional): the digest of the round's masking terms
            (:func:`retexo_fl.secure.round_encoding.round_terms`; default: none).

    Returns:
        The :data:`SEED_BYTES`-byte seed.

    Raises:
        ValueError: the ids are equal, an id, stage or round is negative or above 2**64 - 1, or the
            peer key is not 32 bytes or a low-order point (naming the pair).
    """
    where = f"mask seed of clients {own_id} and {peer_id}"
    if own_id == peer_id or not all(0 <= v < 2**64 for v in (own_id, peer_id, stage, round_)):
        raise ValueError(
            f"{where}: ids must differ and ids, stage {stage} and round {round_} be in [0, 2**64)"
        )
    peer = parse_public(peer_public, where)
    mine = public_bytes(own_private)
    (lo, lo_pub), (hi, hi_pub) = sorted([(own_id, mine), (peer_id, peer)])
    info = _LABEL + struct.pack(">QQQQ", lo, hi, stage, round_) + lo_pub + hi_pub + bytes(terms)
    try:
        shared = own_private.exchange(X25519PublicKey.from_public_bytes(peer))
    except ValueError:
        raise ValueError(f"{where}: the peer's public key is a low-order point") from None
    return HKDF(algorithm=hashes.SHA256(), length=SEED_BYTES, salt=bytes(transcript), info=info).derive(
        shared
    )


def expand(seed: bytes, length: int) -> np.ndarray:
    """``length`` pseudorandom ``uint32`` values from ``seed``: the AES-256-CTR keystream under a zero
    nonce, read little-endian.

    A zero nonce is safe because every seed keys one mask only.

    Args:
        seed (bytes): the :data:`SEED_BYTES`-byte seed.
        length (int): how many values, >= 0.

    Raises:
        ValueError: ``seed`` is not 32 bytes or ``length`` is negative.
    """
    if len(seed) != SEED_BYTES:
        raise ValueError(f"mask expansion: a seed is {SEED_BYTES} bytes, got {len(seed)}")
    if length < 0:
        raise ValueError(f"mask expansion: length must be >= 0, got {length}")
    stream = Cipher(algorithms.AES(bytes(seed)), modes.CTR(_ZERO_NONCE)).encryptor()
    return np.frombuffer(stream.update(bytes(4 * length)), dtype="<u4").astype(DTYPE)


def _check_vector(vector: np.ndarray, where: str) -> None:
    if not isinstance(vector, np.ndarray) or vector.dtype != DTYPE:
        raise ValueError(f"{where}: expected a uint32 array, got {getattr(vector, 'dtype', type(vector))}")


def _mask(seed: bytes, like: np.ndarray) -> np.ndarray:
    return expand(seed, like.size).reshape(like.shape)


def masked_update(
    encoded: np.ndarray, own_id: int, self_seed: bytes | None, pair_seeds: dict[int, bytes]
) -> np.ndarray:
    r"""``encoded`` plus the self mask, plus the pair masks with higher ids, minus those with lower
    ids, modulo :math:`2^{32}`.

    Args:
        encoded (np.ndarray): the ``uint32`` fixed-point update, any shape.
        own_id (int): this client.
        self_seed (bytes | None): this client's fresh :data:`SEED_BYTES` random bytes for this
            vector; :obj:`None` for pair masks only (a sum that decodes only when every member's
            vector arrives, so that the server is never given a pair seed to unmask one).
        pair_seeds (dict[int, bytes]): ``{neighbour id: pairwise_mask_seed}``, not ``own_id``.

    Returns:
        The masked ``uint32`` vector, the shape of ``encoded``.

    Raises:
        ValueError: ``encoded`` is not ``uint32``, a seed is not 32 bytes, or ``pair_seeds`` holds
            ``own_id``.
    """
    where = f"client {own_id}: masking"
    _check_vector(encoded, where)
    if own_id in pair_seeds:
        raise ValueError(f"{where}: a pair seed with itself")
    out = encoded.copy() if self_seed is None else encoded + _mask(self_seed, encoded)
    for peer, seed in pair_seeds.items():
        if peer > own_id:
            out += _mask(seed, encoded)
        else:
            out -= _mask(seed, encoded)
    return out


def unmask_sum(
    masked_sum: np.ndarray,
    self_seeds: dict[int, bytes],
    dropped_pair_seeds: dict[tuple[int, int], bytes],
) -> np.ndarray:
    r"""The plain sum of the survivors' encoded updates, from the sum of their masked ones.

    Survivor :math:`i` added :math:`\mathrm{PRG}(s_{id})` for each dropped neighbour :math:`d > i`
    and subtracted it for :math:`d < i`; with :math:`y_d` absent nothing cancels it, so it is
    removed with the opposite sign here, as is every survivor's self mask.

    Args:
        masked_sum (np.ndarray): the ``uint32`` sum of the survivors' masked vectors.
        self_seeds (dict[int, bytes]): ``{survivor id: its self seed}``, one per survivor.
        dropped_pair_seeds (dict[tuple[int, int], bytes]): ``{(survivor id, dropped id): their pair
            seed}`` for every survivor and each of its dropped neighbours.

    Returns:
        A new ``uint32`` array: the sum of the survivors' :func:`masked_update` inputs.

    Raises:
        ValueError: ``masked_sum`` is not ``uint32``, a seed is not 32 bytes, or a pair's first id
            is not a survivor or its second is one (naming the pair).
    """
    _check_vector(masked_sum, "unmasking")
    out = masked_sum.copy()
    for seed in self_seeds.values():
        out -= _mask(seed, out)
    for (survivor, dropped), seed in dropped_pair_seeds.items():
        if survivor not in self_seeds or dropped in self_seeds:
            raise ValueError(
                f"unmasking: pair ({survivor}, {dropped}) is not (survivor, dropped); "
                f"survivors are {sorted(self_seeds)}"
            )
        if dropped > survivor:
            out -= _mask(seed, out)
        else:
            out += _mask(seed, out)
    return out
