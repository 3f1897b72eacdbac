"""Client key pairs (X25519), the server-distributed key directory and out-of-band pins."""

from __future__ import annotations

import json
import os
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

KEY_BYTES = 32


class KeyMaterialError(ValueError):
    """A key file, directory entry or pin is missing, malformed, or does not match."""


def private_bytes(key: X25519PrivateKey) -> bytes:
    return key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())


def public_bytes(key: X25519PrivateKey | X25519PublicKey) -> bytes:
    pub = key.public_key() if isinstance(key, X25519PrivateKey) else key
    return pub.public_bytes(Encoding.Raw, PublicFormat.Raw)


def save_private_key(key: X25519PrivateKey, path: str | os.PathLike[str]) -> Path:
    """Write the raw 32-byte private key, readable by its owner only."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(private_bytes(key))
    return out


def load_private_key(path: str | os.PathLike[str]) -> X25519PrivateKey:
    p = Path(path)
    if not p.is_file():
        raise KeyMaterialError(f"{p}: identity key file not found")
    raw = p.read_bytes()
    if len(raw) != KEY_BYTES:
        raise KeyMaterialError(f"{p}: an X25519 private key is {KEY_BYTES} raw bytes, found {len(raw)}")
    return X25519PrivateKey.from_private_bytes(raw)


def parse_public(value: str | bytes, where: str) -> bytes:
    """A 32-byte public key from raw bytes or hex, or an error naming ``where``."""
    try:
        raw = bytes.fromhex(value) if isinstance(value, str) else bytes(value)
    except ValueError:
        raise KeyMaterialError(f"{where}: public key is not hex") from None
    if len(raw) != KEY_BYTES:
        raise KeyMaterialError(f"{where}: a public key is {KEY_BYTES} bytes, got {len(raw)}")
    return raw


def load_pins(path: str | os.PathLike[str]) -> dict[int, bytes]:
    """``{"<client id>": "<public key hex>", ...}``, exchanged by the parties out of band."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise KeyMaterialError(f"{p}: pinned keys file unreadable ({exc})") from None
    if not isinstance(data, dict):
        raise KeyMaterialError(f"{p}: pinned keys must be a JSON object of client id -> public key hex")
    out = {}
    for k, v in data.items():
        try:
            pid = int(k)
        except ValueError:
            raise KeyMaterialError(f"{p}: {k!r} is not a client id") from None
        out[pid] = parse_public(v, f"{p}, client {pid}")
    return out


def check_directory(directory: dict[int, bytes], pins: dict[int, bytes] | None, where: str) -> None:
    """Refuse a key directory that disagrees with the pins (a server that swapped a key)."""
    if not pins:
        return
    for pid, key in sorted(directory.items()):
        pinned = pins.get(pid)
        if pinned is None:
            raise KeyMaterialError(f"{where}: client {pid} has no pinned key; refusing its unpinned key")
        if pinned != key:
            raise KeyMaterialError(
                f"{where}: the server's key for client {pid} is not the pinned one "
                f"({key.hex()[:16]}... != {pinned.hex()[:16]}...): refusing to talk to it"
            )


def write_identities(clients: int, out: str | os.PathLike[str]) -> Path:
    """One identity key per client (``client-<id>.key``) and ``pins.json`` with every public key."""
    root = Path(out)
    pins = {}
    for pid in range(clients):
        key = X25519PrivateKey.generate()
        save_private_key(key, root / f"client-{pid}.key")
        pins[str(pid)] = public_bytes(key).hex()
    (root / "pins.json").write_text(json.dumps(pins, indent=2))
    return root
