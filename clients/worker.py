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

Runs are served side by side. Flower's SuperExec starts a ClientApp per message, several at once,
and each run's server picks how long its messages take (a long training request, a huge member
list). So every Flower run id gets a lane of its own (:class:`RunLanes`): a thread that answers
that run's requests one at a time, in the order the worker received them. A message of one run
never waits for another run's, and one run's client state is never changed by two threads.
Bounds keep a server from exhausting the node: at most :data:`MAX_RUNS` runs at once and
:data:`MAX_QUEUED` requests waiting per run; a request over either is refused with one line
naming its run. A lane with nothing to do ends after :data:`IDLE_S` seconds, or at once when a
new run needs its place, and its run's clients leave the cache (:func:`forget_run`). A run key
is the server's to name, so two runs could name one client: they take turns on it
(:func:`clients.node_client.holding`).

Runs share the process: its CPU and its memory, not their random streams. A round's dropout
masks come from a generator of the round's own (:func:`retexo_fl.seeding.dropout_stream`), and a
model's initial weights are drawn under a lock right after seeding, so two runs that train at
once on one node each train bit for bit as alone.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar

from flwr.app import Context, Message, Metadata, RecordDict

from clients import node_client
from clients.node_client import answer, audit_target, holding
from clients.worker_link import (
    NODE_CONFIG_NAME,
    PID_NAME,
    SECRET_NAME,
    SOCKET_NAME,
    WorkerError,
    accept_caller,
    check_socket_path,
    check_worker_dir,
    read_node_config,
    read_secret,
    recv_content,
    send_content,
)

#: Runs answered at once, a thread each; a request of one more run is refused, naming the run,
#: unless a run with nothing to do gives up its place. The worker's memory holds a client per run.
MAX_RUNS = 4
#: Requests of one run that may wait behind the one being answered; one more is refused. Our
#: server sends a node one message of a run at a time, so this is room for resent ones.
MAX_QUEUED = 4
#: Seconds a lane with nothing to do waits for its run's next request before its thread ends and
#: its run's clients are dropped (a run that sends again later restores them from its work folder).
IDLE_S = 60.0
#: Connections open at once (being read, waiting in a lane, or being answered): every lane full,
#: plus some being read. The next caller waits in the socket's backlog until one closes.
MAX_OPEN = MAX_RUNS * (MAX_QUEUED + 1) + 8
#: Seconds one step of the channel may take (the caller's proof, reading its request, sending
#: the reply), so a caller that stopped gives its connection back. Answering is not bounded.
IO_TIMEOUT_S = 60.0
#: Modules a run imports only when it first needs them, imported on a thread as soon as the worker
#: listens. A worker starts with its SuperNode, usually long before a run, so these seconds of CPU
#: (PyG, with torch's compiler stack under it) mostly leave the run's critical path: on 3 nodes
#: sharing 2 cores that import had held a run's first GNN round for 5-8 s. A worker started
#: just before a run still pays part of it (10-19 s there, under the run's own load).
WARM_IMPORTS = ("torch_geometric.nn",)
#: Set once the imports ahead have ended (at once where none were started). Requests wait for it:
#: a request importing a module while the thread imports another could meet it halfway through a
#: shared dependency's import, where Python can hand one of them a half-initialized module.
IMPORTED_AHEAD = threading.Event()
IMPORTED_AHEAD.set()

Job = TypeVar("Job")


def _log(line: str) -> None:
    """One line on the worker's stderr (the SuperNode's log)."""
    print(f"node worker: {line}", file=sys.stderr, flush=True)


def request_message(
    header: dict[str, Any], content: RecordDict, node_config: dict[str, Any]
) -> tuple[Message, Context]:
    """The Flower message and context a shim's request stands for, under the node's own config.

    Args:
        header (dict[str, Any]): the request header (message type, run id, message id, node id).
        content (RecordDict): the message's content.
        node_config (dict[str, Any]): the node config from the worker folder; a request carries none.

    Returns:
        tuple[Message, Context]: what a ClientApp would have been given.
    """
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


class Request:
    """One caller's connection, holding one of the worker's :data:`MAX_OPEN` places.

    Args:
        conn (socket.socket): the accepted connection.
        slot (threading.Semaphore): released when the connection closes.
    """

    def __init__(self, conn: socket.socket, slot: threading.Semaphore) -> None:
        self.conn = conn
        self.slot = slot
        self.header: dict[str, Any] = {}
        self.content: RecordDict | None = None
        self._closed = False

    def close(self) -> None:
        """Close the connection and give its place back (once, whoever calls it)."""
        if not self._closed:
            self._closed = True
            self.conn.close()
            self.slot.release()


class _Lane(Generic[Job]):
    """One run's waiting requests, and whether its thread is answering one."""

    def __init__(self, run_id: int, lock: threading.Lock) -> None:
        self.run_id = run_id
        self.queue: deque[Job] = deque()
        self.ready = threading.Condition(lock)  # the lanes' one lock: submit and serve agree on it
        self.busy = False
        self.retired = False


class RunLanes(Generic[Job]):
    """A thread per run, answering that run's jobs one at a time in the order they were submitted.

    Runs do not wait for each other; a run's jobs never run on two threads at once. A run with
    nothing to do keeps its thread for ``idle_s`` seconds, or until a new run needs its place.

    Args:
        handle (Callable[[Job], None]): answers one job; what it raises is logged and ends that
            job only.
        max_runs (int, optional): runs with a lane at once. (default: :data:`MAX_RUNS`)
        max_queued (int, optional): jobs of one run waiting behind the one being answered.
            (default: :data:`MAX_QUEUED`)
        idle_s (float, optional): seconds a lane with nothing to do lives. (default: :data:`IDLE_S`)
        on_end (Callable[[int], None], optional): called with the run id when a lane ends
            (idle, or retired for a new run), under the lanes' lock: it must be quick and must not
            call back into the lanes. (default: :obj:`None`)
    """

    def __init__(
        self,
        handle: Callable[[Job], None],
        max_runs: int = MAX_RUNS,
        max_queued: int = MAX_QUEUED,
        idle_s: float = IDLE_S,
        on_end: Callable[[int], None] | None = None,
    ) -> None:
        self.handle = handle
        self.max_runs = max_runs
        self.max_queued = max_queued
        self.idle_s = idle_s
        self.on_end = on_end
        self._lock = threading.Lock()
        self._lanes: dict[int, _Lane[Job]] = {}

    def submit(self, run_id: int, job: Job) -> str | None:
        """Queue ``job`` in run ``run_id``'s lane (started if it has none).

        Args:
            run_id (int): Flower's run id (the SuperNode's, not the server's to choose).
            job (Job): what :attr:`handle` is given.

        Returns:
            str | None: None if queued; else why it is refused, one line naming the run.
        """
        with self._lock:
            lane = self._lanes.get(run_id)
            if lane is None:
                if len(self._lanes) >= self.max_runs and not self._retire_idle():
                    return (
                        f"run {run_id}: refused: this node's worker is answering {len(self._lanes)} "
                        f"other runs, at most {self.max_runs} at once; send it again when one ends"
                    )
                lane = self._lanes[run_id] = _Lane(run_id, self._lock)
                threading.Thread(target=self._serve, args=(lane,), name=f"run-{run_id}", daemon=True).start()
            elif len(lane.queue) >= self.max_queued:
                return (
                    f"run {run_id}: refused: {len(lane.queue)} of its messages already wait on this "
                    f"node behind the one being answered, at most {self.max_queued}"
                )
            lane.queue.append(job)
            lane.ready.notify()
        return None

    def runs(self) -> list[int]:
        """The run ids that have a lane now (answering, waiting, or idle within ``idle_s``)."""
        with self._lock:
            return list(self._lanes)

    def _retire_idle(self) -> bool:
        """End one lane with nothing to do, for a new run; False if every lane is busy.
        The caller holds the lock."""
        for lane in list(self._lanes.values()):
            if not lane.busy and not lane.queue:
                lane.retired = True
                lane.ready.notify()
                self._remove(lane)  # the run's next job starts a new lane
                return True
        return False

    def _remove(self, lane: _Lane[Job]) -> None:
        """Forget an ended lane, and say so (:attr:`on_end`). The caller holds the lock; a new
        lane of the same run can only start after this, so the two never overlap."""
        del self._lanes[lane.run_id]
        if self.on_end is not None:
            self.on_end(lane.run_id)

    def _serve(self, lane: _Lane[Job]) -> None:
        """The lane's thread: its jobs in order, until it has been idle ``idle_s`` or is retired."""
        while True:
            with self._lock:
                lane.busy = False
                deadline = time.monotonic() + self.idle_s
                while not lane.queue and not lane.retired:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    lane.ready.wait(left)
                if not lane.queue:  # idle too long, or retired: only an empty lane ends
                    if self._lanes.get(lane.run_id) is lane:
                        self._remove(lane)
                    return
                job = lane.queue.popleft()
                lane.busy = True
            try:
                self.handle(job)
            except Exception as exc:  # the lane outlives one job's failure; its run's next job is answered
                _log(f"run {lane.run_id}: {type(exc).__name__}: {exc}")


#: Flower run id -> the run keys its messages named last (at most :data:`MAX_RUNS`, oldest first),
#: so that the clients of a run whose lane ended are dropped (:func:`forget_run`): a node that
#: runs one run after another holds one client. Older keys' clients are the cache's to drop.
_RUN_KEYS: dict[int, dict[int, None]] = {}
_RUN_KEYS_LOCK = threading.Lock()


def _note_run_key(run_id: int, run_key: int) -> None:
    """Remember that run ``run_id`` named ``run_key`` (bounded: a server picks run keys).

    Args:
        run_id (int): Flower's run id.
        run_key (int): the run key its message named.
    """
    with _RUN_KEYS_LOCK:
        keys = _RUN_KEYS.setdefault(run_id, {})
        keys.pop(run_key, None)
        keys[run_key] = None  # most recent last
        while len(keys) > MAX_RUNS:
            del keys[next(iter(keys))]


def forget_run(run_id: int) -> None:
    """Drop the cached clients of a run whose lane ended (:class:`RunLanes`'s ``on_end``).

    Args:
        run_id (int): Flower's run id.
    """
    with _RUN_KEYS_LOCK:
        run_keys = _RUN_KEYS.pop(run_id, {})
    node_client.forget(run_keys)


def _failed(exc: Exception, audit: dict | None) -> tuple[dict[str, Any], None]:
    """The reply header of a request that raised: one line, and where it is audited."""
    return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "audit": audit}, None


def handle_request(
    header: dict[str, Any], content: RecordDict, node_config: dict[str, Any]
) -> tuple[dict[str, Any], RecordDict | None]:
    """The reply to one request, under ``node_config``; what the answer raises becomes the reply.

    Args:
        header (dict[str, Any]): the request header (message type, run id, message id, node id).
        content (RecordDict): the message's content.
        node_config (dict[str, Any]): the node's own config, from the worker folder.

    Returns:
        tuple[dict[str, Any], RecordDict | None]: the reply header and content (None on failure).
    """
    try:
        msg, context = request_message(header, content, node_config)
    except Exception as exc:  # no message: no client to audit as
        return _failed(exc, None)
    try:
        # The audit target is read while the client is held: another run cannot drop it between.
        with holding(msg, context) as (run_key, _):
            _note_run_key(msg.metadata.run_id, run_key)
            try:
                reply = answer(msg, context)
            except Exception as exc:  # the shim reports it as the ClientApp would have, in one line
                return _failed(exc, audit_target(msg, context))
            return {"ok": True, "audit": audit_target(msg, context)}, reply
    except Exception as exc:  # the message names no client (no config or run key): none built
        return _failed(exc, None)


def answer_request(request: Request, node_config: dict[str, Any]) -> None:
    """Answer a received request on its lane's thread, send the reply and close the connection.

    Args:
        request (Request): a request :func:`receive` read.
        node_config (dict[str, Any]): the node's own config.
    """
    try:
        if request.content is None:  # receive() queues only requests with content
            raise ValueError("a request without content")
        IMPORTED_AHEAD.wait()
        reply_header, reply = handle_request(request.header, request.content, node_config)
        send_content(request.conn, reply_header, reply)
    except Exception as exc:  # a caller that went away ends its call only
        _log(f"a call failed: {type(exc).__name__}: {exc}")
    finally:
        request.close()


def receive(request: Request, secret: bytes, lanes: RunLanes[Request]) -> None:
    """Authenticate a caller, read its request and queue it in its run's lane, or refuse it.

    It runs on a thread of its own per connection, so a slow caller delays no other.

    Args:
        request (Request): the new connection.
        secret (bytes): the worker folder's secret.
        lanes (RunLanes[Request]): where requests wait for their run's thread.
    """
    conn, queued = request.conn, False
    try:
        conn.settimeout(IO_TIMEOUT_S)
        refused = accept_caller(conn, secret)
        if refused:
            _log(f"refused a caller: {refused}")
            return
        request.header, request.content = recv_content(conn)
        if request.content is None:
            send_content(conn, {"ok": False, "error": "a request without content"}, None)
            return
        try:
            run_id = int(request.header["run_id"])
        except (KeyError, TypeError, ValueError) as exc:
            send_content(conn, _failed(exc, None)[0], None)
            return
        refusal = lanes.submit(run_id, request)
        if refusal is not None:
            _log(refusal)
            send_content(conn, {"ok": False, "error": refusal, "audit": None}, None)
            return
        queued = True
    except Exception as exc:  # a caller that went away or sent garbage ends its call only
        _log(f"a call failed: {type(exc).__name__}: {exc}")
    finally:
        if not queued:
            request.close()


def import_ahead(modules: tuple[str, ...], log: Callable[[str], None]) -> None:
    """Import ``modules`` now, saying through ``log`` how long each took. A module that fails to
    import is named with its error and skipped: the message that needs it then raises in its own
    context, for its caller.

    Args:
        modules (tuple[str, ...]): dotted module names.
        log (Callable[[str], None]): takes one line.
    """
    for name in modules:
        start = time.monotonic()
        try:
            importlib.import_module(name)
        except Exception as exc:
            log(f"importing {name} ahead of the runs failed: {type(exc).__name__}: {exc}")
        else:
            log(f"imported {name} ahead of the runs in {time.monotonic() - start:.1f}s")


def warm_imports(modules: tuple[str, ...] = WARM_IMPORTS) -> None:
    """:func:`import_ahead` into this worker's log, then set :data:`IMPORTED_AHEAD`.

    Args:
        modules (tuple[str, ...], optional): dotted module names. (default: :data:`WARM_IMPORTS`)
    """
    try:
        import_ahead(modules, _log)
    finally:
        IMPORTED_AHEAD.set()


def _watch_parent(parent_pid: int, folder: Path) -> None:
    """Leave when the SuperNode that started this worker is gone (even if it was SIGKILLed), and
    take the worker folder's files with it: a SuperNode killed outright removes nothing, and its
    folder would keep the node's secret and node config."""
    while True:
        if os.getppid() != parent_pid:
            for name in (SOCKET_NAME, SECRET_NAME, NODE_CONFIG_NAME, PID_NAME):
                (folder / name).unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                folder.rmdir()  # empty, as the SuperNode made it; anything else stays
            os._exit(0)
        time.sleep(0.5)


def serve(folder: str | Path, parent_pid: int | None = None) -> None:
    """Listen on ``folder``'s socket and answer requests until the parent exits.

    Each connection is read on a thread of its own and answered on its run's lane
    (:class:`RunLanes`, bounded by :data:`MAX_RUNS` and :data:`MAX_QUEUED`); at most
    :data:`MAX_OPEN` connections are open at once.

    Args:
        folder (str | Path): the worker folder (0700: socket, secret and node config).
        parent_pid (int, optional): exit when this process is gone. (default: :obj:`None`)

    Raises:
        WorkerError: the folder is not the user's own 0700 folder, its socket path is too long
            for a Unix socket, or it has no secret or node config.
    """
    folder = Path(folder)
    node_client.SOLE_WRITER = True  # this process alone answers, and saves, for its node
    node_client.CACHED_RUNS = MAX_RUNS  # runs served side by side keep their clients
    check_worker_dir(folder)
    check_socket_path(folder)
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
        threading.Thread(target=_watch_parent, args=(parent_pid, folder), daemon=True).start()
    print(f"node worker {os.getpid()} listening on {path}", file=sys.stderr, flush=True)
    IMPORTED_AHEAD.clear()
    threading.Thread(target=warm_imports, name="warm-imports", daemon=True).start()
    # The bounds are read here, not bound as defaults, so that a test can lower them.
    lanes: RunLanes[Request] = RunLanes(
        lambda request: answer_request(request, node_config), MAX_RUNS, MAX_QUEUED, IDLE_S, forget_run
    )
    slots = threading.BoundedSemaphore(MAX_OPEN)
    while True:
        slots.acquire()  # at most MAX_OPEN connections: the next caller waits in the backlog
        conn, _ = server.accept()
        request = Request(conn, slots)
        threading.Thread(target=receive, args=(request, secret, lanes), daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    """``python -m clients.worker FOLDER [--parent-pid PID]``: serve until the parent exits.

    Args:
        argv (list[str], optional): the arguments (default: the command line's).

    Returns:
        int: 2 if the worker folder is unusable (said on stderr).
    """
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
