"""The node worker: one long-lived process that answers every message of its node.

``retexo-fl supernode`` starts it (``python -m clients.worker FOLDER --parent-pid PID``) and
starts a new one if it dies. It holds torch, the node's partition, the stage model and the
client state in memory across messages and stages, so a message costs the step it asks for, not
a Python start, an ``import torch`` and a partition load.

It keeps nothing that the node's work folder does not also hold: every answer that changes the
client is saved there before the reply goes out (as without a worker), so a new worker resumes
where a killed one stopped. It is the only process that writes its node's state
(:data:`clients.node_client.SOLE_WRITER`), so a cached client is not reloaded before each
message; after a message that raised, it is. Clients are cached per (run key, node), so two runs
on one node never share one.

Messages are answered one at a time, in arrival order: a SuperNode hands out one message at a
time, and torch state is not shared across threads here.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time
from pathlib import Path

from flwr.app import Context, Message, Metadata, RecordDict

from clients import node_client
from clients.node_client import answer, audit_target
from clients.worker_link import (
    PID_NAME,
    SOCKET_NAME,
    WorkerError,
    accept_caller,
    check_worker_dir,
    read_node_config,
    read_secret,
    recv_content,
    send_content,
)


def request_message(header: dict, content: RecordDict, node_config: dict) -> tuple[Message, Context]:
    """The Flower message and context a shim's request stands for, under the node's own config
    (``node_config``, from the worker folder; a request carries none)."""
    metadata = Metadata(
        run_id=int(header["run_id"]),
        message_id=str(header.get("message_id", "")),
        src_node_id=0,
        dst_node_id=int(header["node_id"]),
        reply_to_message_id="",
        group_id="",
        created_at=time.time(),
        ttl=0.0,
        message_type=str(header["type"]),
    )
    context = Context(
        run_id=int(header["run_id"]),
        node_id=int(header["node_id"]),
        node_config=dict(node_config),
        state=RecordDict(),
        run_config={},
    )
    return Message(content=content, metadata=metadata), context


def serve_connection(conn: socket.socket, secret: bytes, node_config: dict) -> None:
    """Authenticate one caller and answer its one request under ``node_config``."""
    refused = accept_caller(conn, secret)
    if refused:
        print(f"node worker: refused a caller: {refused}", file=sys.stderr, flush=True)
        return
    header, content = recv_content(conn)
    if content is None:
        send_content(conn, {"ok": False, "error": "a request without content"}, None)
        return
    msg = context = None
    try:
        msg, context = request_message(header, content, node_config)
        reply = answer(msg, context)
        target = audit_target(msg, context)
    except Exception as exc:  # the shim reports it as the ClientApp would have, in one line
        failed = {
            "ok": False,
            "error": f"{type(exc).__name__}: {exc}",
            "audit": None if msg is None or context is None else audit_target(msg, context),
        }
        send_content(conn, failed, None)
        return
    send_content(conn, {"ok": True, "audit": target}, reply)


def _watch_parent(parent_pid: int) -> None:
    """Leave when the SuperNode that started this worker is gone (even if it was SIGKILLed)."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(0)
        time.sleep(0.5)


def serve(folder: str | Path, parent_pid: int | None = None) -> None:
    """Listen on ``folder``'s socket and answer requests until the parent exits.

    Raises:
        WorkerError: the folder is not the user's own 0700 folder, or has no secret or node config.
    """
    folder = Path(folder)
    node_client.SOLE_WRITER = True  # this process alone answers, and saves, for its node
    check_worker_dir(folder)
    secret = read_secret(folder)
    node_config = read_node_config(folder)
    path = folder / SOCKET_NAME
    path.unlink(missing_ok=True)  # a killed worker's socket
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # the socket file is the user's alone, inside a folder that is too
    try:
        server.bind(str(path))
    finally:
        os.umask(old)
    server.listen(16)
    (folder / PID_NAME).write_text(str(os.getpid()))
    if parent_pid is not None:
        threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    print(f"node worker {os.getpid()} listening on {path}", file=sys.stderr, flush=True)
    while True:
        conn, _ = server.accept()
        with conn:
            try:
                serve_connection(conn, secret, node_config)
            except Exception as exc:  # a caller that went away or sent garbage ends its call only
                print(f"node worker: a call failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m clients.worker", description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="the worker folder (0700; socket and secret)")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    args = parser.parse_args(argv)
    try:
        serve(args.folder, args.parent_pid)
    except WorkerError as exc:
        print(f"node worker: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
