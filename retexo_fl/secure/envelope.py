"""Sealed payloads: X25519 + HKDF-SHA256 per direction, AES-256-GCM with the routing as associated data."""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

MAGIC = b"RXE1"
KINDS = {"deg": 1, "halo": 2, "eager": 3}
# magic, kind, stage, round, source, destination: in clear, and authenticated.
_HEAD = struct.Struct(">4sBHIII")
NONCE_BYTES = 12
TAG_BYTES = 16
#: Bytes a sealed payload adds to its frame.
ENVELOPE_BYTES = _HEAD.size + NONCE_BYTES + TAG_BYTES


class EnvelopeError(ValueError):
    """A sealed payload that is not what its header claims: tampered, replayed, misrouted or cut."""


@dataclass(frozen=True)
class Route:
    """Where a payload belongs: what it is, when it was sent, who sent it to whom.

    Args:
        kind (str): one of :data:`KINDS` (``"deg"``, ``"halo"``, ``"eager"``).
        stage (int): the stage it was sent in.
        round (int): the round it was sent in.
        src (int): the sending client.
        dst (int): the receiving client.
    """

    kind: str
    stage: int
    round: int
    src: int
    dst: int

    def header(self) -> bytes:
        """The clear, authenticated header: magic, kind, stage, round, source, destination."""
        return _HEAD.pack(MAGIC, KINDS[self.kind], self.stage, self.round, self.src, self.dst)


def _key(own: X25519PrivateKey, peer: bytes, run_id: int, src: int, dst: int) -> bytes:
    shared = own.exchange(X25519PublicKey.from_public_bytes(peer))
    return HKDF(
        algorithm=hashes.SHA256(),
        length=32,
        salt=struct.pack(">Q", run_id & (2**64 - 1)),
        info=f"retexo-fl boundary v1 {src}->{dst}".encode(),
    ).derive(shared)


class Envelopes:
    """One client's sealed channels to and from each peer.

    Each direction has its own AES-256-GCM key, derived with HKDF-SHA256 from the X25519 shared
    secret, salted with the run id (so no key outlives its run) and labelled with the direction.
    Nonces are 96 random bits per payload. The associated data is the run id and the header
    (kind, stage, round, source, destination), so a payload opened anywhere but its
    destination, at any other stage or round, or altered in any byte, fails authentication.

    Args:
        own_id (int): this client.
        key (X25519PrivateKey): its X25519 private key.
        run_id (int): the run, known to every party.
        directory (dict[int, bytes]): every party's public key (``{client id: 32 bytes}``).
    """

    def __init__(self, own_id: int, key: X25519PrivateKey, run_id: int, directory: dict[int, bytes]) -> None:
        self.own_id, self.run_id = own_id, run_id
        self._aad_run = struct.pack(">Q", run_id & (2**64 - 1))
        self._send = {
            q: AESGCM(_key(key, pub, run_id, own_id, q)) for q, pub in directory.items() if q != own_id
        }
        self._recv = {
            p: AESGCM(_key(key, pub, run_id, p, own_id)) for p, pub in directory.items() if p != own_id
        }

    def seal(self, frame: bytes, route: Route) -> bytes:
        """Encrypt ``frame`` for ``route``'s destination.

        Args:
            frame (bytes): the plaintext payload.
            route (Route): where it goes; its source must be this client.

        Returns:
            ``header | nonce | ciphertext and tag``, :data:`ENVELOPE_BYTES` longer than ``frame``.

        Raises:
            EnvelopeError: if the route's source is not this client or its destination has no channel.
        """
        if route.src != self.own_id or route.dst not in self._send:
            raise EnvelopeError(f"client {self.own_id}: no channel for {route}")
        head = route.header()
        nonce = os.urandom(NONCE_BYTES)
        return head + nonce + self._send[route.dst].encrypt(nonce, frame, self._aad_run + head)

    def open(self, blob: bytes, kind: str, stage: int, src: int, min_round: int = 0) -> tuple[bytes, int]:
        """The frame in ``blob`` from client ``src``, and the round it was sent in.

        Args:
            blob (bytes): the sealed payload.
            kind (str): the kind it must have been sealed as (a key of :data:`KINDS`).
            stage (int): the stage it must have been sealed in.
            src (int): the client it must come from.
            min_round (int, optional): the oldest round accepted. (default: :obj:`0`)

        Returns:
            ``(frame, round)``.

        Raises:
            EnvelopeError: naming ``src`` when the payload is cut, was sealed for another
                destination, kind or stage, is older than ``min_round``, or fails authentication.
        """
        where = f"client {self.own_id}: payload from client {src} ({kind}, stage {stage})"
        blob = bytes(blob)
        if len(blob) < ENVELOPE_BYTES:
            raise EnvelopeError(f"{where}: {len(blob)} bytes, shorter than an envelope ({ENVELOPE_BYTES})")
        magic, k, st, rnd, s, d = _HEAD.unpack_from(blob)
        if magic != MAGIC:
            raise EnvelopeError(f"{where}: not a sealed payload (magic {magic!r}); is encryption off there?")
        if s != src or d != self.own_id:
            raise EnvelopeError(f"{where}: misrouted, sealed by client {s} for client {d}")
        if k != KINDS[kind] or st != stage:
            raise EnvelopeError(f"{where}: replayed, sealed as kind {k} at stage {st}")
        if rnd < min_round:
            raise EnvelopeError(f"{where}: replayed, sealed in round {rnd}, expected round >= {min_round}")
        if src not in self._recv:
            raise EnvelopeError(f"{where}: client {src} is not in the key directory")
        head, nonce = blob[: _HEAD.size], blob[_HEAD.size : _HEAD.size + NONCE_BYTES]
        try:
            frame = self._recv[src].decrypt(nonce, blob[_HEAD.size + NONCE_BYTES :], self._aad_run + head)
        except InvalidTag:
            raise EnvelopeError(f"{where}: failed authentication (tampered, truncated or forged)") from None
        return frame, rnd
