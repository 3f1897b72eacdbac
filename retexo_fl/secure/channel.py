"""One party's sealed channels to its peers: its identity key, the key directory, the envelopes."""

from __future__ import annotations

from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from retexo_fl.secure.envelope import Envelopes, Route
from retexo_fl.secure.keys import (
    KeyMaterialError,
    check_directory,
    load_pins,
    load_private_key,
    private_bytes,
    public_bytes,
)


class PeerChannel:
    """End-to-end sealing of the frames one party relays through the server to its peers.

    The server only routes: it collects public keys, hands every party the directory, and
    forwards sealed frames it cannot open. With ``enabled=False`` frames pass in clear
    (debugging only).

    Args:
        party (int): this party's client (partition) id.
        enabled (bool, optional): seal frames. (default: :obj:`True`)
        identity_keys (str, optional): a folder of ``client-<id>.key`` identity keys; empty for a
            key pair made for this run. (default: ``""``)
        pinned_keys (str, optional): a JSON file ``{client id: public key hex}`` exchanged out of
            band; the directory must agree with it. (default: ``""``)
    """

    def __init__(
        self, party: int, enabled: bool = True, identity_keys: str = "", pinned_keys: str = ""
    ) -> None:
        self.party = party
        self.enabled = enabled
        self.identity_keys = identity_keys
        self.pinned_keys = pinned_keys
        self.identity: X25519PrivateKey | None = None
        self.directory: dict[int, bytes] | None = None
        self.run_id = 0
        self.envelopes: Envelopes | None = None

    def public_key(self, identity_path: str = "") -> bytes:
        """This party's X25519 public key (32 bytes): from ``identity_path``, the identity-keys
        folder, or a key pair made for this run."""
        if self.identity is None:
            path = identity_path or (
                str(Path(self.identity_keys) / f"client-{self.party}.key") if self.identity_keys else ""
            )
            self.identity = load_private_key(path) if path else X25519PrivateKey.generate()
        return public_bytes(self.identity)

    def connect(self, directory: dict[int, bytes], run_id: int, peers: set[int]) -> None:
        """Derive the sealed channels to ``peers`` from the server's key ``directory``.

        Args:
            directory (dict[int, bytes]): client id -> public key, as the server relayed it.
            run_id (int): the run key both sides bind their keys to.
            peers (set[int]): the clients this party sends rows to or receives rows from.

        Raises:
            KeyMaterialError: the directory misses a peer, has another key for this party, or
                disagrees with the pinned keys.
        """
        where = f"client {self.party}"
        pins = load_pins(self.pinned_keys) if self.pinned_keys else None
        check_directory(directory, pins, where)
        if directory.get(self.party) != self.public_key():
            raise KeyMaterialError(f"{where}: the key directory holds another key for this client")
        missing = sorted(peers - set(directory))
        if missing:
            raise KeyMaterialError(f"{where}: no public key for peer clients {missing}")
        self.directory, self.run_id = dict(directory), int(run_id)
        assert self.identity is not None  # public_key() above made or loaded it
        self.envelopes = Envelopes(self.party, self.identity, self.run_id, {q: directory[q] for q in peers})

    def _ready(self) -> Envelopes:
        if self.envelopes is None:
            raise RuntimeError(f"client {self.party}: encryption is on but no key directory arrived")
        return self.envelopes

    def seal(self, frames: dict[int, bytes], kind: str, stage: int, round_: int = 0) -> dict[int, bytes]:
        """``frames`` (peer -> frame) sealed for their peers, or as they are when disabled."""
        if not self.enabled:
            return frames
        envelopes = self._ready()
        return {q: envelopes.seal(f, Route(kind, stage, round_, self.party, q)) for q, f in frames.items()}

    def open(
        self, blobs: dict[int, bytes], kind: str, stage: int, min_round: int = 0
    ) -> tuple[dict[int, bytes], int]:
        """Opened frames (source -> frame) and the newest round they were sealed in.

        Raises:
            EnvelopeError: a blob is tampered, replayed (older than ``min_round``) or misrouted.
        """
        if not self.enabled:
            return blobs, 0
        envelopes = self._ready()
        out, newest = {}, 0
        for p, blob in blobs.items():
            out[p], rnd = envelopes.open(blob, kind, stage, p, min_round)
            newest = max(newest, rnd)
        return out, newest

    def to_state(self) -> tuple[str | None, dict[int, str] | None, int]:
        """(private key hex, directory as hex, run id): what a node keeps between messages."""
        identity = None if self.identity is None else private_bytes(self.identity).hex()
        directory = None if self.directory is None else {q: k.hex() for q, k in self.directory.items()}
        return identity, directory, self.run_id

    def load_state(
        self, identity: str | None, directory: dict[int, str] | None, run_id: int, peers: set[int]
    ) -> None:
        """Restore what :meth:`to_state` returned (reconnecting to the peers when it had a directory)."""
        if identity:
            self.identity = X25519PrivateKey.from_private_bytes(bytes.fromhex(identity))
        if directory:
            self.connect({int(q): bytes.fromhex(k) for q, k in directory.items()}, run_id, peers)
