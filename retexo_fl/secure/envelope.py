"""Sealed payloads: X25519 + HKDF-SHA256 per direction, AES-256-GCM with the routing as associated data."""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from retexo_fl.secure.keys import public_bytes

MAGIC = b"RXE2"
KINDS = {"deg": 1, "halo": 2, "eager": 3, "share": 4}
#: Kinds a receiver numbers apart from the others: secure aggregation's shares are opened when a
#: round is unmasked, before frames sealed earlier (setup's degrees, a round's halo rows) arrive.
#: Both orders stay strict, and the authenticated kind keeps one order's payloads out of the other.
SEPARATE_KINDS = ("share",)
# magic, kind, stage, round, source, destination, channel counter: in clear, and authenticated.
_HEAD = struct.Struct(">4sBHIIIQ")
NONCE_BYTES = 12
TAG_BYTES = 16
#: Bytes a sealed payload adds to its frame.
ENVELOPE_BYTES = _HEAD.size + NONCE_BYTES + TAG_BYTES
#: Bytes of a client's contribution to the run transcript.
CONTRIBUTION_BYTES = 32


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

    def header(self, counter: int) -> bytes:
        """The clear, authenticated header: magic, kind, stage, round, source, destination and the
        direction's ``counter``."""
        return _HEAD.pack(MAGIC, KINDS[self.kind], self.stage, self.round, self.src, self.dst, counter)


def transcript_hash(
    run_id: int, directory: dict[int, bytes], contributions: dict[int, bytes], run_config: bytes = b""
) -> bytes:
    """SHA-256 of the run's key-setup transcript: the run key, the run config's digest, and every
    party's id, public key and fresh random contribution, in id order.

    Every party contributes, so no transcript repeats while one party is honest: a server that
    reuses a run key, or replays an old directory, still gets new channel keys.

    Args:
        run_id (int): the server's run key.
        directory (dict[int, bytes]): client id -> 32-byte public key.
        contributions (dict[int, bytes]): client id -> its :data:`CONTRIBUTION_BYTES` random bytes.
        run_config (bytes, optional): the digest of the run config the party was sent: parties
            handed different configs derive different keys, and their payloads do not open.
            (default: ``b""``)
    """
    h = hashlib.sha256(b"retexo-fl transcript v2")
    h.update(struct.pack(">Q", run_id & (2**64 - 1)))
    h.update(struct.pack(">H", len(run_config)) + run_config)
    for pid in sorted(directory):
        h.update(struct.pack(">I", pid) + directory[pid] + contributions[pid])
    return h.digest()


#: The HKDF label of a channel's payload keys.
BOUNDARY_LABEL = b"retexo-fl boundary v2"
#: The HKDF label of a pair's boundary-plan tag key (:meth:`Envelopes.plan_tag`).
PLAN_LABEL = b"retexo-fl plan tag v1"


def _key(
    shared: bytes,
    keys: tuple[bytes, bytes],
    transcript: bytes,
    src: int,
    dst: int,
    me: int,
    label: bytes = BOUNDARY_LABEL,
) -> bytes:
    """One direction's key (``src`` to ``dst``) of a channel, from its X25519 ``shared`` secret
    and ``keys``, (this party's public key, the peer's); ``label`` names what the key is for."""
    mine, peer = keys
    src_pub, dst_pub = (mine, peer) if src == me else (peer, mine)
    # Like libsodium's crypto_kx and Noise: the key binds both public keys, the direction and the
    # whole transcript, not only the shared secret and a server-chosen salt.
    info = label + struct.pack(">II", src, dst) + src_pub + dst_pub
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=transcript, info=info).derive(shared)


class Envelopes:
    """One client's sealed channels to and from each peer.

    Each direction has its own AES-256-GCM key, derived with HKDF-SHA256 from the X25519 shared
    secret, salted with the run's :func:`transcript_hash` and labelled with the direction and both
    public keys. Nonces are 96 random bits per payload. Each direction numbers its payloads; a
    receiver accepts only a number above the last it accepted (or that same payload again, byte
    for byte, as a resumed server re-delivers it), so replays and reordering are refused. The
    associated data is the transcript and the header (kind, stage, round, source, destination,
    number): a payload opened anywhere but its destination, in another run, stage or round, or
    altered in any byte, fails.

    Args:
        own_id (int): this client.
        key (X25519PrivateKey): its X25519 private key.
        transcript (bytes): the run's :func:`transcript_hash`.
        directory (dict[int, bytes]): the peers' public keys (``{client id: 32 bytes}``).
        counters (dict, optional): what :meth:`counters` returned before (a restored client).
            (default: :obj:`None`)
        lazy (bool, optional): derive a peer's keys when a payload first goes to or comes from
            it, not now: a restored client whose message seals and opens nothing (most train
            rounds of a lazy stage) derives none. At key setup they are derived at once, so
            that a bad peer key fails there. (default: :obj:`False`)
    """

    def __init__(
        self,
        own_id: int,
        key: X25519PrivateKey,
        transcript: bytes,
        directory: dict[int, bytes],
        counters: dict | None = None,
        lazy: bool = False,
    ) -> None:
        self.own_id, self.transcript = own_id, bytes(transcript)
        self._identity, self._mine = key, public_bytes(key)
        self._keys = {q: pub for q, pub in directory.items() if q != own_id}
        self._send: dict[int, AESGCM] = {}
        self._recv: dict[int, AESGCM] = {}
        self.peers = set(self._keys)
        if not lazy:
            for q in sorted(self.peers):
                self._channel(q)
        counters = counters or {}
        self._sent: dict[int, int] = {int(q): int(n) for q, n in counters.get("sent", {}).items()}
        self._accepted: dict[int, tuple[int, str]] = {
            int(p): (int(v[0]), str(v[1])) for p, v in counters.get("accepted", {}).items()
        }
        self._accepted_apart: dict[int, tuple[int, str]] = {
            int(p): (int(v[0]), str(v[1])) for p, v in counters.get("accepted_apart", {}).items()
        }

    def _channel(self, q: int) -> tuple[AESGCM, AESGCM]:
        """The (send, receive) ciphers of peer ``q``'s channel: one X25519 exchange, two keys."""
        if q not in self._send:
            me, (shared, keys) = self.own_id, self._shared(q)
            self._send[q] = AESGCM(_key(shared, keys, self.transcript, me, q, me))
            self._recv[q] = AESGCM(_key(shared, keys, self.transcript, q, me, me))
        return self._send[q], self._recv[q]

    def _shared(self, q: int) -> tuple[bytes, tuple[bytes, bytes]]:
        """Peer ``q``'s X25519 shared secret and the pair's public keys (this party's, then q's)."""
        keys = (self._mine, self._keys[q])
        return self._identity.exchange(X25519PublicKey.from_public_bytes(keys[1])), keys

    def plan_tag(self, src: int, dst: int, message: bytes) -> str | None:
        """A keyed tag (HMAC-SHA256, 32 hex digits) of ``message`` for the direction ``src`` to
        ``dst``, one of them this client: both ends of a pair compute the same tag, and nobody
        else can, so the server can check that two parties agree without testing guesses of what
        they agree on. ``None`` for a peer this client has no channel to (lost at key setup)."""
        q = dst if src == self.own_id else src
        if q not in self._keys:
            return None
        shared, keys = self._shared(q)
        key = _key(shared, keys, self.transcript, src, dst, self.own_id, PLAN_LABEL)
        return hmac.new(key, message, hashlib.sha256).hexdigest()[:32]

    def counters(self) -> dict:
        """Each direction's last number sent and last accepted (with its payload's digest)."""
        return {
            "sent": dict(self._sent),
            "accepted": {p: [n, d] for p, (n, d) in self._accepted.items()},
            "accepted_apart": {p: [n, d] for p, (n, d) in self._accepted_apart.items()},
        }

    def accepted(self) -> dict[int, tuple[int, str]]:
        """Each incoming direction's last accepted number and payload digest (see :meth:`rewind`)."""
        return dict(self._accepted)

    def rewind(self, accepted: dict[int, tuple[int, str]]) -> None:
        """Go back to what :meth:`accepted` returned at a train round's start: the same round sent
        again (a resumed server) re-delivers that round's payloads, which must open once more.
        Numbers never go below it, so payloads accepted before that round stay refused."""
        self._accepted = {int(p): (int(v[0]), str(v[1])) for p, v in accepted.items()}

    def seal(self, frame: bytes, route: Route) -> bytes:
        """Encrypt ``frame`` for ``route``'s destination, numbered next in its direction.

        Args:
            frame (bytes): the plaintext payload.
            route (Route): where it goes; its source must be this client.

        Returns:
            ``header | nonce | ciphertext and tag``, :data:`ENVELOPE_BYTES` longer than ``frame``.

        Raises:
            EnvelopeError: if the route's source is not this client or its destination has no channel.
        """
        if route.src != self.own_id or route.dst not in self._keys:
            raise EnvelopeError(f"client {self.own_id}: no channel for {route}")
        counter = self._sent.get(route.dst, 0) + 1
        self._sent[route.dst] = counter
        head = route.header(counter)
        nonce = os.urandom(NONCE_BYTES)
        return head + nonce + self._channel(route.dst)[0].encrypt(nonce, frame, self.transcript + head)

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
                destination, kind or stage, is older than ``min_round``, is numbered at or below
                one accepted before (replayed or reordered), or fails authentication.
        """
        where = f"client {self.own_id}: payload from client {src} ({kind}, stage {stage})"
        blob = bytes(blob)
        if len(blob) < ENVELOPE_BYTES:
            raise EnvelopeError(f"{where}: {len(blob)} bytes, shorter than an envelope ({ENVELOPE_BYTES})")
        magic, k, st, rnd, s, d, counter = _HEAD.unpack_from(blob)
        if magic != MAGIC:
            raise EnvelopeError(f"{where}: not a sealed payload (magic {magic!r}); is encryption off there?")
        if s != src or d != self.own_id:
            raise EnvelopeError(f"{where}: misrouted, sealed by client {s} for client {d}")
        if k != KINDS[kind] or st != stage:
            raise EnvelopeError(f"{where}: replayed, sealed as kind {k} at stage {st}")
        if rnd < min_round:
            raise EnvelopeError(f"{where}: replayed, sealed in round {rnd}, expected round >= {min_round}")
        if src not in self._keys:
            raise EnvelopeError(f"{where}: client {src} is not in the key directory")
        digest = hashlib.sha256(blob).hexdigest()
        order = self._accepted_apart if kind in SEPARATE_KINDS else self._accepted
        last, last_digest = order.get(src, (0, ""))
        if counter < last or (counter == last and digest != last_digest):
            raise EnvelopeError(
                f"{where}: replayed or reordered, numbered {counter} after number {last} was accepted"
            )
        head, nonce = blob[: _HEAD.size], blob[_HEAD.size : _HEAD.size + NONCE_BYTES]
        try:
            receive = self._channel(src)[1]
            frame = receive.decrypt(nonce, blob[_HEAD.size + NONCE_BYTES :], self.transcript + head)
        except InvalidTag:
            raise EnvelopeError(f"{where}: failed authentication (tampered, truncated or forged)") from None
        order[src] = (counter, digest)
        return frame, rnd
