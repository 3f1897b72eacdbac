"""The node-local channel between a ClientApp shim and its node worker (no torch on this side).

A worker folder is created 0700 by the node's user and holds two things:

- ``worker.sock``: the worker's Unix socket. Only the folder's owner can reach it;
- ``secret``: 32 random bytes (0600), made anew each time the folder is made;
- ``node-config.json``: the node config ``retexo-fl supernode`` was started with (0600). The
  worker answers with this one alone: a message names no node config, so neither the server nor
  the app code that forwards a message can change the party's policy, pins or folders.

A connection is accepted only if the peer runs as the worker's user (``SO_PEERCRED``) and answers
a fresh nonce with ``HMAC-SHA256(secret, nonce)``, so a process that can open the socket but
cannot read the secret (another user on the node, one whose folder mode was loosened) is refused
without learning anything.

A call is one request and one reply. Each is a JSON header frame followed by the content's Flower
objects (``RecordDict`` and its records and arrays, as ``deflate()`` writes them), so arrays cross
as bytes and neither side needs torch to move them. Frames are a 4-byte big-endian length and the
bytes.

Shapes:
    - **handshake:** the worker sends a 32-byte nonce, the caller its proof, the worker
      ``{"ok": true}`` or ``{"ok": false, "error"}``; until then nothing of the request is sent,
      so a caller whose worker died here may call the next one
    - **request header:** ``{"type", "run_id", "message_id", "node_id", "root", "objects"}``
    - **reply header:** ``{"ok": true, "root", "objects", "audit"}`` or
      ``{"ok": false, "error": "one line", "audit"}``
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
import stat
import struct
import tempfile
import time
from pathlib import Path
from typing import Any

from flwr.app import RecordDict
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents

SOCKET_NAME = "worker.sock"
SECRET_NAME = "secret"
NODE_CONFIG_NAME = "node-config.json"
PID_NAME = "worker.pid"
#: The longest socket path that binds on Linux and macOS alike (``sun_path`` holds 108 and 104
#: bytes, its closing NUL included): longer, ``bind`` fails with an error that names no folder.
MAX_SOCKET_PATH = 103
_LENGTH = struct.Struct(">I")
_MAX_FRAME = 1 << 31  # a frame is one Flower object; Flower's own chunks are at most 5 MiB
_DOMAIN = b"retexo-fl node worker v1"


class WorkerError(RuntimeError):
    """The worker cannot be reached, refused the caller, or died while answering.

    Args:
        message (str): one line.
        audit (dict, optional): where the worker said this failure is audited (a failure's reason
            leaves the node like any reply).
    """

    def __init__(self, message: str, audit: dict | None = None) -> None:
        super().__init__(message)
        self.audit = audit


def make_worker_dir(base: str | Path | None = None) -> Path:
    """A new worker folder (0700) with a new secret (0600) in ``base`` (default: the temp folder).

    Unix socket paths are limited to about 100 bytes, so the default is short
    (``/tmp/retexo-fl-worker-XXXXXXXX``).
    """
    folder = Path(tempfile.mkdtemp(prefix="retexo-fl-worker-", dir=base))  # mkdtemp makes it 0700
    try:
        check_socket_path(folder)
    except WorkerError:
        folder.rmdir()  # still empty: nothing is lost
        raise
    os.chmod(folder, 0o700)
    fd = os.open(folder / SECRET_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(32))
    return folder


def check_socket_path(folder: str | Path) -> None:
    """Refuse a worker folder whose socket path the kernel would not bind.

    Raises:
        WorkerError: naming the folder, its socket path's length and the limit.
    """
    path = os.fsencode(Path(folder).absolute() / SOCKET_NAME)
    if len(path) > MAX_SOCKET_PATH:
        raise WorkerError(
            f"worker folder {folder}: its socket path is {len(path)} bytes, a Unix socket's is at "
            f"most {MAX_SOCKET_PATH}; make the folder somewhere shorter (--worker-base)"
        )


def check_worker_dir(folder: str | Path) -> None:
    """Refuse a worker folder another user could enter or that another user owns.

    Raises:
        WorkerError: naming the folder and what is wrong with it.
    """
    st = os.stat(folder)
    if st.st_uid != os.getuid():
        raise WorkerError(f"worker folder {folder}: owned by uid {st.st_uid}, not this user ({os.getuid()})")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise WorkerError(f"worker folder {folder}: mode {stat.S_IMODE(st.st_mode):o}, must be 700")


def read_secret(folder: str | Path) -> bytes:
    """The worker folder's secret. Raises :class:`WorkerError` if it is missing or readable by others."""
    path = Path(folder) / SECRET_NAME
    try:
        st = os.stat(path)
        if stat.S_IMODE(st.st_mode) & 0o077:
            raise WorkerError(f"{path}: mode {stat.S_IMODE(st.st_mode):o}, must be 600")
        return path.read_bytes()
    except FileNotFoundError:
        raise WorkerError(f"{path}: no worker secret (not a folder `retexo-fl supernode` made?)") from None


def write_node_config(folder: str | Path, node_config: dict[str, Any]) -> Path:
    """Keep the node's own config in its worker folder (0600), for the worker to answer with."""
    path = Path(folder) / NODE_CONFIG_NAME
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(node_config, f)
    return path


def read_node_config(folder: str | Path) -> dict[str, Any]:
    """The node config kept in the worker folder.

    Raises:
        WorkerError: missing, readable by others, or not a JSON object of scalars.
    """
    path = Path(folder) / NODE_CONFIG_NAME
    try:
        if stat.S_IMODE(os.stat(path).st_mode) & 0o077:
            raise WorkerError(f"{path}: mode {stat.S_IMODE(os.stat(path).st_mode):o}, must be 600")
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise WorkerError(f"{path}: no node config (not a folder `retexo-fl supernode` made?)") from None
    except ValueError as exc:
        raise WorkerError(f"{path}: not JSON ({exc})") from None
    if not isinstance(data, dict) or not all(isinstance(v, (str, int, float, bool)) for v in data.values()):
        raise WorkerError(f"{path}: the node config must be a JSON object of scalar values")
    return data


def proof(secret: bytes, nonce: bytes) -> bytes:
    """What a caller answers to ``nonce``: it shows the secret without revealing it."""
    return hmac.new(secret, _DOMAIN + nonce, hashlib.sha256).digest()


# -- frames --------------------------------------------------------------------------------------
def send_frame(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_LENGTH.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("the channel closed mid-frame")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def recv_frame(sock: socket.socket) -> bytes:
    (n,) = _LENGTH.unpack(_recv_exact(sock, _LENGTH.size))
    if n > _MAX_FRAME:
        raise ConnectionError(f"a frame of {n} bytes is larger than any this channel sends")
    return _recv_exact(sock, n)


def send_content(sock: socket.socket, header: dict[str, Any], content: RecordDict | None) -> None:
    """``header`` (made JSON) and, if given, ``content``'s Flower objects."""
    objects = get_all_nested_objects(content) if content is not None else {}
    if content is not None:
        header = {**header, "root": content.object_id, "objects": list(objects)}
    send_frame(sock, json.dumps(header).encode())
    for obj in objects.values():
        send_frame(sock, obj.deflate())


def recv_content(sock: socket.socket) -> tuple[dict[str, Any], RecordDict | None]:
    """A header and the content it announces (None if it announces none)."""
    header = json.loads(recv_frame(sock))
    if "root" not in header:
        return header, None
    contents = {oid: recv_frame(sock) for oid in header["objects"]}
    content = inflate_object_from_contents(header["root"], contents)
    if not isinstance(content, RecordDict):
        raise ConnectionError(f"the channel announced a {type(content).__name__}, not a RecordDict")
    return header, content


# -- the caller's side -----------------------------------------------------------------------------
def call(
    folder: str | Path,
    header: dict[str, Any],
    content: RecordDict,
    wait: float = 60.0,
) -> tuple[dict[str, Any], RecordDict | None]:
    """Send one request to the worker in ``folder`` and return its reply.

    A worker that is restarting (its supervisor starts a new one when one dies) is waited for up
    to ``wait`` seconds; a connection is never retried once the request has gone out, since the
    worker may have acted on it.

    Args:
        folder (str | Path): the worker folder (node config ``worker``).
        header (dict): the request header (message type, run id, node id and config).
        content (RecordDict): the message's content.
        wait (float, optional): seconds to wait for a worker to listen. (default: ``60.0``)

    Raises:
        WorkerError: one line saying what happened (absent, refused, died, or what the worker
            raised); the ClientApp's error mod prefixes the node's name.
    """
    try:
        check_worker_dir(folder)
        secret = read_secret(folder)
    except (OSError, WorkerError) as exc:
        raise WorkerError(f"node worker unusable: {exc}") from None
    path = str(Path(folder) / SOCKET_NAME)
    deadline = time.monotonic() + wait
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            send_frame(sock, proof(secret, recv_frame(sock)))
            verdict = json.loads(recv_frame(sock))
            break
        except (FileNotFoundError, ConnectionError, OSError) as exc:
            # Nothing of the request has been sent: a worker that is (re)starting, or one that
            # died with this connection in its queue, is waited for and the call made again.
            sock.close()
            if time.monotonic() >= deadline:
                raise WorkerError(
                    f"no node worker at {path} after {wait:.0f}s ({type(exc).__name__}); "
                    "is `retexo-fl supernode` running?"
                ) from None
            time.sleep(0.05)
    with sock:
        if not verdict.get("ok"):
            raise WorkerError(str(verdict.get("error", "the node worker refused this caller")))
        try:
            send_content(sock, header, content)
            reply, reply_content = recv_content(sock)
        except (ConnectionError, OSError) as exc:
            raise WorkerError(
                f"the node worker died while answering ({exc}); it restarts from node state"
            ) from None
    if not reply.get("ok"):
        audit = reply.get("audit")
        raise WorkerError(
            str(reply.get("error", "the node worker refused the request")),
            audit if isinstance(audit, dict) else None,
        )
    return reply, reply_content


# -- the worker's side -----------------------------------------------------------------------------
def peer_uid(sock: socket.socket) -> int | None:
    """The uid of the process at the other end (Linux ``SO_PEERCRED``; None where unsupported)."""
    if not hasattr(socket, "SO_PEERCRED"):
        return None
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def accept_caller(conn: socket.socket, secret: bytes) -> str | None:
    """Authenticate a new connection and tell the caller the verdict; returns why it is
    refused, or None if it may send its request."""
    uid = peer_uid(conn)
    nonce = secrets.token_bytes(32)
    send_frame(conn, nonce)
    answered = recv_frame(conn)
    if uid is not None and uid != os.getuid():
        refused: str | None = f"uid {uid} is not the worker's user"
    elif not hmac.compare_digest(answered, proof(secret, nonce)):
        refused = "wrong node secret"
    else:
        refused = None
    verdict: dict[str, object] = {"ok": refused is None}
    if refused is not None:
        verdict["error"] = f"the node worker refused this caller: {refused}"
    send_frame(conn, json.dumps(verdict).encode())
    return refused
