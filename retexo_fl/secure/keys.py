"""Client key pairs (X25519), the server-distributed key directory and out-of-band pins."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

KEY_BYTES = 32


class KeyMaterialError(ValueError):
    """A key file, directory entry or pin is missing, malformed, or does not match."""


def private_bytes(key: X25519PrivateKey) -> bytes:
    """The raw 32 bytes of an X25519 private key.

    Args:
        key (X25519PrivateKey): the key.
    """
    return key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())


def public_bytes(key: X25519PrivateKey | X25519PublicKey) -> bytes:
    """The raw 32 bytes of an X25519 public key (a private key's public half).

    Args:
        key (X25519PrivateKey | X25519PublicKey): the key or key pair.
    """
    pub = key.public_key() if isinstance(key, X25519PrivateKey) else key
    return pub.public_bytes(Encoding.Raw, PublicFormat.Raw)


def private_folder(path: str | os.PathLike[str]) -> Path:
    """``path`` as a folder only its owner can enter: created 0700, or an existing one checked.

    An existing folder others can enter is refused, not made private: it may be a folder the
    user shares on purpose (a home or project folder given as ``--out``), and what it already
    held was readable until now.

    Args:
        path (str | os.PathLike[str]): the folder.

    Raises:
        KeyMaterialError: ``path`` exists and others can enter, list or write it (naming it and
            its mode), or it is not a folder.
    """
    folder = Path(path)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not folder.is_dir():
        raise KeyMaterialError(f"{folder}: not a folder; private keys and client state need one")
    mode = stat.S_IMODE(folder.stat().st_mode)
    if mode & 0o077:
        raise KeyMaterialError(
            f"{folder}: others can enter this folder (mode {mode:o}); private keys and client state "
            f"go only in a folder its owner alone can enter: `chmod 700 {folder}`, or choose a new one"
        )
    return folder


def save_private_key(key: X25519PrivateKey, path: str | os.PathLike[str]) -> Path:
    """Write the raw 32-byte private key, readable by its owner only, in a folder only its owner
    can enter.

    Args:
        key (X25519PrivateKey): the key.
        path (str | os.PathLike[str]): the file; its folder is created (0700).

    Returns:
        The file's path.
    """
    out = Path(path)
    private_folder(out.parent)
    # A new 0600 file renamed over the old one: a reader holding an old 0644 key file open
    # never sees the new key through it.
    tmp = out.with_name(out.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(private_bytes(key))
    tmp.replace(out)
    return out


def load_private_key(path: str | os.PathLike[str]) -> X25519PrivateKey:
    """Read a raw 32-byte X25519 private key written by :func:`save_private_key`.

    Args:
        path (str | os.PathLike[str]): the identity key file.

    Raises:
        KeyMaterialError: if the file is missing, readable or writable by others than its owner,
            or not 32 bytes.
    """
    p = Path(path)
    if not p.is_file():
        raise KeyMaterialError(f"{p}: identity key file not found")
    mode = stat.S_IMODE(p.stat().st_mode)
    if mode & 0o077:
        raise KeyMaterialError(
            f"{p}: a private key others can read or write (mode {mode:o}); refusing it "
            f"(chmod 600 {p}, and replace the key if others may have read it)"
        )
    raw = p.read_bytes()
    if len(raw) != KEY_BYTES:
        raise KeyMaterialError(f"{p}: an X25519 private key is {KEY_BYTES} raw bytes, found {len(raw)}")
    return X25519PrivateKey.from_private_bytes(raw)


def parse_public(value: str | bytes, where: str) -> bytes:
    """A 32-byte public key from raw bytes or hex, or an error naming ``where``.

    Args:
        value (str | bytes): hex text or raw bytes.
        where (str): names the key in errors.

    Raises:
        KeyMaterialError: if ``value`` is not hex or not 32 bytes.
    """
    try:
        raw = bytes.fromhex(value) if isinstance(value, str) else bytes(value)
    except ValueError:
        raise KeyMaterialError(f"{where}: public key is not hex") from None
    if len(raw) != KEY_BYTES:
        raise KeyMaterialError(f"{where}: a public key is {KEY_BYTES} bytes, got {len(raw)}")
    return raw


def load_pins(path: str | os.PathLike[str]) -> dict[int, bytes]:
    """Read pinned keys: ``{"<client id>": "<public key hex>", ...}``, exchanged by the parties out of band.

    Args:
        path (str | os.PathLike[str]): the JSON file.

    Returns:
        ``{client id: 32-byte public key}``.

    Raises:
        KeyMaterialError: if the file is unreadable, not a JSON object, or holds a bad id or key.
    """
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


def pin_digest(pins: dict[int, bytes]) -> str:
    """A short digest of a pin set, the same for every party holding the same pins.

    Args:
        pins (dict[int, bytes]): ``{client id: public key}``.
    """
    text = "".join(f"{pid}:{key.hex()}\n" for pid, key in sorted(pins.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def check_directory(directory: dict[int, bytes], pins: dict[int, bytes] | None, where: str) -> None:
    """Refuse a key directory that disagrees with the pins (a server that swapped a key).

    Args:
        directory (dict[int, bytes]): the server's key directory, ``{client id: public key}``.
        pins (dict[int, bytes] | None): the pinned keys; empty or ``None`` accepts any directory.
        where (str): names the checking party in errors.

    Raises:
        KeyMaterialError: if a client in the directory has no pinned key or another key.
    """
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
    """One identity key per client (``client-<id>.key``) and ``pins.json`` with every public key.

    Args:
        clients (int): the number of clients.
        out (str | os.PathLike[str]): the folder to write into (created).

    Returns:
        The folder.

    Raises:
        KeyMaterialError: ``clients < 1``, or a key or ``pins.json`` already in the folder (an
            identity key is never overwritten: its pins were handed to the other parties).
    """
    if clients < 1:
        raise KeyMaterialError(f"clients must be >= 1, got {clients}")
    root = private_folder(out)
    taken = [root / f"client-{pid}.key" for pid in range(clients)] + [root / "pins.json"]
    for path in taken:
        if path.exists():
            raise KeyMaterialError(f"{path}: already exists; identity keys are never overwritten")
    pins = {}
    for pid in range(clients):
        key = X25519PrivateKey.generate()
        save_private_key(key, root / f"client-{pid}.key")
        pins[str(pid)] = public_bytes(key).hex()
    (root / "pins.json").write_text(json.dumps(pins, indent=2))
    return root


def fingerprint(public: bytes) -> str:
    """A public key's fingerprint, for parties to read to each other out of band: the first 16
    bytes of its SHA-256, in groups of four hex digits."""
    digest = hashlib.sha256(public).hexdigest()[:32]
    return ":".join(digest[i : i + 4] for i in range(0, 32, 4))


def write_own_identity(client: int, out: str | os.PathLike[str]) -> tuple[Path, Path]:
    """One party's own identity: ``client-<id>.key`` (0600, never leaves the party) and
    ``client-<id>.pub`` (``{"client": id, "public": hex}``, the one file that travels).

    Raises:
        KeyMaterialError: a key for this client is already there (it is never overwritten).
    """
    if client < 0:
        raise KeyMaterialError(f"client must be >= 0, got {client}")
    root = private_folder(out)
    key_path, pub_path = root / f"client-{client}.key", root / f"client-{client}.pub"
    if key_path.exists():
        raise KeyMaterialError(f"{key_path}: already exists; a party's identity key is never overwritten")
    key = X25519PrivateKey.generate()
    save_private_key(key, key_path)
    pub_path.write_text(json.dumps({"client": client, "public": public_bytes(key).hex()}) + "\n")
    return key_path, pub_path


def collect_pins(public_files: list[str | os.PathLike[str]], out: str | os.PathLike[str]) -> dict[int, bytes]:
    """Write the pins file ``out`` from the parties' ``client-<id>.pub`` files.

    Raises:
        KeyMaterialError: a file unreadable or malformed, or two files for one client, naming it.
    """
    pins: dict[int, bytes] = {}
    for path in map(Path, public_files):
        try:
            data = json.loads(path.read_text())
            client = int(data["client"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise KeyMaterialError(
                f"{path}: not a public key file of `retexo-fl keys --client` ({exc})"
            ) from None
        if client in pins:
            raise KeyMaterialError(f"{path}: a second public key for client {client}")
        pins[client] = parse_public(str(data.get("public", "")), str(path))
    Path(out).write_text(json.dumps({str(c): k.hex() for c, k in sorted(pins.items())}, indent=2) + "\n")
    return pins
