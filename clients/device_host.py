"""``retexo-fl devices``: many one-node parties in one process, each its own Flower node.

    retexo-fl devices --superlink HOST:PORT --partitions DIR [--ids 0-99]
                      [--keys DIR | --insecure-no-pinned-keys] [--work-dir DIR]
                      [--insecure | --root-certificates CA.crt [--auth-keys DIR]]
                      [--max-poll S] [--polls-per-second N]

At one node per party every phone or edge device is a party. ``retexo-fl supernode`` is one
device: Flower's SuperNode, its SuperExec, a ClientApp process per message and a node worker
holding torch, about 0.5 GB of memory. Emulating hundreds of devices on one machine (a test, a
benchmark, a lab) that way needs hundreds of those process sets. This command is the emulation
host instead: one process that holds the ``part-<id>`` folders it is given (``--ids``), and for
each one opens its own connection to the SuperLink's Fleet API over gRPC with Flower's own
connection code (:func:`flwr.client.grpc_rere_client.connection.grpc_request_response`: it
registers, activates and heartbeats as that device's node, with its own authentication key under
TLS), pulls the device's messages and their objects, answers them with the installed ClientApp
(:data:`clients.app.app`, mods included) in this process, and pushes the replies. To the
SuperLink and the ServerApp each device is a SuperNode like any other.

What differs from one ``retexo-fl supernode`` per device, and why:

- **One process, one torch.** The devices' clients live in this process (as a node worker's
  client lives in its), each with its own Flower node, keys and work folder
  (``--work-dir``/``part-<id>``, found by the device's id, not by the node id the SuperLink hands
  out; a host refuses one node id given to two of its devices). Messages are pulled and pushed on
  a thread per device, and answered on one thread, one at a time: a device's training is then
  the run a lone device would make, and the host's CPU goes to one answer at a time.
- **The installed app only.** A device host never installs or imports a run's FAB. A run whose
  app code is not the installed app's (:func:`clients.approval.approve`) is refused before even
  its config is read, with an ``INVALID_FAB`` error reply to each of its messages; a signed
  release of other code needs a ``retexo-fl supernode`` (``--trusted-entities``), which runs each
  app in a process of its own.
- **Failures.** A message whose objects cannot be pulled or whose reply cannot be pushed is
  logged and the device goes on (as Flower's SuperNode does); an app that raises is answered with
  an error reply. A device whose connection fails, or that cannot sign in (Flower then ends the
  whole process), stops the host, which names it.
- **Polls that back off.** A device with nothing to do polls after 50 ms, then twice as long each
  time up to ``--max-poll`` (default 1 s), or up to ``devices / --polls-per-second`` seconds
  where that is longer (default 100 pulls a second for the whole host), so hundreds of idle
  devices do not saturate the SuperLink; a message resets its device's poll to 50 ms.

The devices of one host share its memory, CPU and failure: it is an emulator of many devices, not
a deployment of one. Every device keeps its own identity key and the pins (``--keys``: the
``client-<id>.key`` and ``pins.json`` of ``retexo-fl keys``), so sealed boundary rows and secure
aggregation are as they are between real devices, and nothing of a device's data leaves it in a
message. The host process itself can read every device it holds.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flwr.app import Context, Error, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.supercore.inflatable.inflatable_object import (
    get_all_nested_objects,
    get_object_tree,
    no_object_id_recompute,
)
from flwr.supercore.inflatable.inflatable_utils import pull_and_inflate_object_from_tree, push_objects
from flwr.supercore.run import RunNotRunningException

from retexo_fl import protocol as P

#: The first poll after a message, and the floor of the backoff (Flower's SuperNode sleeps 3 s
#: after an empty pull; ``retexo-fl supernode`` shortens it to 50 ms).
MIN_POLL_S = 0.05
#: Where an idle device's poll backs off to, by default.
MAX_POLL_S = 1.0
#: Pulls a second that a host's idle devices make at most, together, by default: an idle device
#: backs off to ``devices / POLLS_PER_S`` seconds where that is longer than ``max_poll``. A pull
#: costs Flower's SuperLink about 2 ms of one core (in memory; more with its database): 300
#: devices polling each second held it at one core for a whole run (810 s, 2026-11-29).
POLLS_PER_S = 100.0


class DeviceHostError(ValueError):
    """The host will not start with these devices; the message names the folder or file."""


@dataclass
class DeviceSpec:
    """One device the host holds.

    Args:
        name (str): how logs and errors name it (its partition folder's name, ``part-<id>``).
        node_config (dict[str, Any]): its node config, as ``--node-config`` gives a SuperNode.
        auth_key (Path, optional): its SuperNode authentication private key (TLS only).
    """

    name: str
    node_config: dict[str, Any]
    auth_key: Path | None = None


def parse_ids(text: str) -> list[int]:
    """``"0-3,7"`` -> ``[0, 1, 2, 3, 7]``.

    Raises:
        DeviceHostError: ``text`` is not a comma list of ids and ``a-b`` ranges.
    """
    ids: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise DeviceHostError(f"--ids {text!r}: {part!r} is not an id or an a-b range")
        ids.extend(range(int(lo), int(hi if sep else lo) + 1))
    return ids


def device_specs(
    partitions: Path,
    ids: list[int] | None,
    work_dir: Path,
    keys: Path | None,
    auth_keys: Path | None = None,
) -> list[DeviceSpec]:
    """The devices of ``partitions`` (every ``part-<id>``, or the ``ids`` given), with their keys.

    Args:
        partitions (Path): a folder of ``part-<id>`` folders (``retexo-fl partition``).
        ids (list[int], optional): the ids of the devices to hold (default: every folder).
        work_dir (Path): the base of the devices' work folders (each device's node config
            ``work-dir`` is ``work_dir/part-<id>``).
        keys (Path, optional): a folder of ``client-<id>.key`` and ``pins.json``
            (``retexo-fl keys``); None runs without pinned keys.
        auth_keys (Path, optional): a folder of ``party-<id>`` SuperNode authentication keys.

    Raises:
        DeviceHostError: naming a missing folder, id or key file, or an id given twice.
    """
    from retexo_fl.data.partition import PartitionError, partition_dirs, partition_folder_id

    try:
        found = {partition_folder_id(d): d for d in partition_dirs(partitions)}
    except PartitionError as exc:
        raise DeviceHostError(str(exc)) from None
    if not found:
        raise DeviceHostError(f"{partitions}: no part-<id> folders")
    wanted = sorted(found) if ids is None else ids
    if not wanted or len(set(wanted)) != len(wanted):
        raise DeviceHostError(f"--ids: {'no device' if not wanted else 'a device named twice'} ({ids})")
    missing = [i for i in wanted if i not in found]
    if missing:
        raise DeviceHostError(f"{partitions}: no part-{missing[0]} folder (--ids)")
    specs = []
    for i in wanted:
        # A work folder of its own, and the partition id as its slot: the device's saved state
        # is found by its folder, not by the node id the SuperLink hands out at each start.
        config: dict[str, Any] = {
            P.NODE_PARTITION_DIR: str(found[i]),
            P.NODE_PARTITION_ID: i,
            P.NODE_WORK_DIR: str(work_dir / found[i].name),
        }
        if keys is not None:
            config[P.NODE_IDENTITY_KEY] = str(keys / f"client-{i}.key")
            config[P.NODE_PINNED_KEYS] = str(keys / "pins.json")
        auth = auth_keys / f"party-{i}" if auth_keys is not None else None
        if auth is not None and not auth.is_file():
            raise DeviceHostError(f"{auth}: no SuperNode authentication key for part-{i}")
        specs.append(DeviceSpec(found[i].name, config, auth))
    return specs


@dataclass
class _Run:
    """What a device knows of a run: its config and context, or why this host refuses it."""

    run_config: dict[str, Any]
    refused: str = ""
    series_id: int = 0
    context: Context | None = None


#: Runs a device keeps what it knows of (their config and Flower context); the oldest goes first.
KEPT_RUNS = 8


@dataclass
class Device:
    """One device's node: its connection's loop, run by :meth:`run` on a thread of its own.

    A message that fails (its objects cannot be pulled, its reply cannot be pushed) is logged and
    the device goes on, as Flower's SuperNode does; an app that raises is answered with an error
    reply. Only the connection failing ends the device, and :attr:`error` then says why.

    Args:
        spec (DeviceSpec): the device.
        answer (Callable[[Message, Context], tuple[Message, float]]): answers a message (the
            host's, on its answering thread), with the seconds the answer took.
        connect (Callable[[DeviceSpec], Any]): opens the device's Fleet API connection (a
            context manager yielding Flower's connection tuple).
        stop (threading.Event): set to end the loop.
        max_poll (float): the longest wait between two pulls of an idle device.
        claim (Callable[[Device], None], optional): called once connected; raises to refuse the
            node id the SuperLink gave (another device of the host holds it).
    """

    spec: DeviceSpec
    answer: Callable[[Message, Context], tuple[Message, float]]
    connect: Callable[[DeviceSpec], Any]
    stop: threading.Event
    max_poll: float = MAX_POLL_S
    claim: Callable[[Device], None] | None = None
    node_id: int = 0
    error: str = ""
    runs: dict[int, _Run] = field(default_factory=dict)

    def run(self) -> None:
        """Connect, then pull, answer and push until :attr:`stop` is set."""
        try:
            with self.connect(self.spec) as conn:
                # Flower's connection logs and swallows what its block raises: say it here first.
                try:
                    self._loop(conn)
                except BaseException as exc:
                    self._failed(exc)
                    raise
        except BaseException as exc:  # flwr_exit raises SystemExit on this thread
            self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        if not self.stop.is_set() and not self.error:
            self.error = f"{type(exc).__name__}: {exc}"

    def _loop(self, conn: tuple) -> None:
        self.node_id, receive, *calls = conn
        if self.claim is not None:
            self.claim(self)
        wait = MIN_POLL_S
        while not self.stop.is_set():
            received = receive()
            if received is None:
                self.stop.wait(wait)
                wait = min(wait * 2, self.max_poll)
                continue
            wait = MIN_POLL_S
            self._serve(*received, *calls)

    def _log(self, text: str) -> None:
        print(f"{self.spec.name}: {text}", file=sys.stderr, flush=True)

    def _run_info(self, run_id: int, get_run: Callable, get_fab: Callable) -> _Run:
        """The run's config and whether this host runs it. Its FAB is read, never installed; a
        FAB that is not the installed app is refused before even its config is read."""
        if run_id not in self.runs:
            from flwr.common.config import get_fused_config_from_fab

            from clients.approval import approve

            run = get_run(run_id)
            fab = get_fab(run.fab_hash, run_id)
            try:
                if not approve(fab.content).runs_installed:  # signed by no one: approve() without
                    raise ValueError("a signed release")  # trusted entities admits no other app
                info = _Run(dict(get_fused_config_from_fab(fab.content, run)))
            except Exception as exc:  # AppNotApproved, or a FAB that is not even an archive
                info = _Run({}, f"{exc} (a device host runs only its installed app)")
                self._log(f"run {run_id} refused: {info.refused}")
            info.series_id = int(getattr(run, "series_id", 0) or 0)
            while len(self.runs) >= KEPT_RUNS:
                self.runs.pop(next(iter(self.runs)))
            self.runs[run_id] = info
        return self.runs[run_id]

    def _serve(
        self,
        message: Message,
        tree: Any,
        send: Callable,
        get_run: Callable,
        get_fab: Callable,
        pull_object: Callable,
        push_object: Callable,
        confirm: Callable,
    ) -> None:
        """Pull one message's objects, answer it, push the reply (Flower's own steps)."""
        run_id, kind = message.metadata.run_id, message.metadata.message_type
        try:
            info = self._run_info(run_id, get_run, get_fab)
            full = pull_and_inflate_object_from_tree(
                tree,
                lambda oid: pull_object(run_id, oid),
                lambda oid: confirm(run_id, oid),
                return_type=Message,
            )
            full.metadata.__dict__["_message_id"] = tree.object_id
            if info.context is None:  # one context per (device, run): it keeps the node's state
                info.context = Context(
                    run_id=run_id,
                    node_id=self.node_id,
                    node_config=self.spec.node_config,
                    state=RecordDict(),
                    run_config=info.run_config,
                    series_id=info.series_id,
                )
            if info.refused:
                code, reason = ErrorCode.INVALID_FAB, info.refused
            else:
                try:
                    reply, seconds = self.answer(full, info.context)
                    code = None
                except Exception as exc:  # the app's own mods report its errors; this is the rest
                    code, reason = ErrorCode.CLIENT_APP_RAISED_EXCEPTION, f"{type(exc).__name__}: {exc}"
            if code is not None:
                reply, seconds = Message(Error(code=code, reason=reason), reply_to=full), 0.0
            reply.metadata.__dict__["_message_id"] = reply.object_id
            with no_object_id_recompute():
                to_push, session = send(reply, get_object_tree(reply), seconds)
                push_objects(
                    get_all_nested_objects(reply),
                    lambda oid, content: push_object(run_id, session, oid, content),
                    object_ids_to_push=to_push,
                )
        except RunNotRunningException:  # the run ended (or was stopped) while this was in flight
            self.runs.pop(run_id, None)
        except Exception as exc:  # one message failed (as Flower's SuperNode, log it and go on)
            self._log(f"a {kind} message of run {run_id} failed: {type(exc).__name__}: {exc}")


def flower_connection(
    address: str, insecure: bool, root_certificates: Path | None
) -> Callable[[DeviceSpec], Any]:
    """A ``connect`` for :class:`Device`: Flower's gRPC request-response Fleet connection, with the
    SuperNode's retry policy and the device's authentication key."""
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key
    from flwr.common.constant import TRANSPORT_TYPE_GRPC_RERE
    from flwr.supernode.start_client_internal import _init_connection

    certificates = root_certificates.read_bytes() if root_certificates else None

    def connect(spec: DeviceSpec) -> Any:
        keys = None
        if spec.auth_key is not None:
            key = load_ssh_private_key(spec.auth_key.read_bytes(), None)
            if not isinstance(key, ec.EllipticCurvePrivateKey):
                raise DeviceHostError(f"{spec.auth_key}: not an EC private key (deploy/make_certs.py)")
            keys = (key, key.public_key())
        return _init_connection(
            transport=TRANSPORT_TYPE_GRPC_RERE,
            server_address=address,
            insecure=insecure,
            root_certificates=certificates,
            authentication_keys=keys,
        )

    return connect


class DeviceHost:
    """Holds the devices: starts a thread per device and answers their messages one at a time.

    Args:
        specs (list[DeviceSpec]): the devices.
        connect (Callable[[DeviceSpec], Any]): opens a device's connection
            (:func:`flower_connection`).
        max_poll (float): the longest wait between two pulls of an idle device, unless the
            devices need longer to stay within ``polls_per_s``. (default: 1.0)
        polls_per_s (float): pulls a second the idle devices make at most, together.
            (default: 100.0)
        app (Callable[[Message, Context], Message], optional): what answers (default: the
            installed ClientApp, :data:`clients.app.app`).

    Raises:
        DeviceHostError: a poll bound that is not positive.
    """

    def __init__(
        self,
        specs: list[DeviceSpec],
        connect: Callable[[DeviceSpec], Any],
        max_poll: float = MAX_POLL_S,
        app: Callable[[Message, Context], Message] | None = None,
        polls_per_s: float = POLLS_PER_S,
    ) -> None:
        if app is None:
            from clients.app import app as installed

            app = installed
        if polls_per_s <= 0 or max_poll <= 0:
            raise DeviceHostError(f"polls a second ({polls_per_s}) and --max-poll ({max_poll}) are positive")
        # Every device's messages are answered on this one thread, one at a time (the module's
        # doc says why); the devices' own threads only pull and push.
        self._answering = ThreadPoolExecutor(max_workers=1, thread_name_prefix="retexo-fl-answer")
        self._app, self.stop = app, threading.Event()
        self._node_ids: dict[int, str] = {}
        self._claims = threading.Lock()
        max_poll = max(max_poll, len(specs) / polls_per_s)
        self.devices = [
            Device(spec, self._answer, connect, self.stop, max_poll, self._claim) for spec in specs
        ]
        self.threads = [
            threading.Thread(target=d.run, name=f"device-{d.spec.name}", daemon=True) for d in self.devices
        ]

    def _claim(self, device: Device) -> None:
        """Refuse a node id that another device of this host holds: a SuperLink that hands one
        id to two devices must not get one device's replies for the other's messages."""
        with self._claims:
            holder = self._node_ids.setdefault(device.node_id, device.spec.name)
        if holder != device.spec.name:
            raise DeviceHostError(f"the SuperLink gave node id {device.node_id} to {holder} too")

    def _timed(self, msg: Message, context: Context) -> tuple[Message, float]:
        started = time.monotonic()
        return self._app(msg, context), time.monotonic() - started

    def _answer(self, msg: Message, context: Context) -> tuple[Message, float]:
        return self._answering.submit(self._timed, msg, context).result()

    def import_ahead(self, modules: tuple[str, ...]) -> Future:
        """Import ``modules`` on the answering thread before the answer to any message that
        reaches it later (called before :meth:`start`, before every one): a run's first GNN round
        then does not wait for PyG's import, and no answer imports a module while this import is
        halfway through a shared dependency. Each module's seconds, or its error, go to stderr."""
        from clients.worker import import_ahead

        def log(line: str) -> None:
            print(f"retexo-fl devices: {line}", file=sys.stderr, flush=True)

        return self._answering.submit(import_ahead, modules, log)

    def start(self) -> DeviceHost:
        """Start every device's thread."""
        for thread in self.threads:
            thread.start()
        return self

    def failed(self) -> list[str]:
        """``"<device>: <error>"`` for every device whose loop ended with an error."""
        return [f"{d.spec.name}: {d.error}" for d in self.devices if d.error]

    def close(self, timeout: float = 10.0) -> None:
        """Stop every device (each deactivates its node) and wait for their threads."""
        self.stop.set()
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._answering.shutdown(wait=False, cancel_futures=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="retexo-fl devices", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--superlink", required=True, help="the SuperLink's Fleet API, HOST:PORT")
    parser.add_argument("--partitions", required=True, help="folder of part-<id>/ (retexo-fl partition)")
    parser.add_argument(
        "--ids", default="", help="the devices to hold, e.g. 0-99,120 (default: every part-<id>)"
    )
    parser.add_argument("--keys", default="", help="folder of client-<id>.key and pins.json (retexo-fl keys)")
    parser.add_argument(
        "--insecure-no-pinned-keys",
        action="store_true",
        help="hold the devices without identity keys and pins (the server can then read sealed payloads)",
    )
    parser.add_argument("--work-dir", default="", help="base of the devices' work folders (default: temp)")
    parser.add_argument("--insecure", action="store_true", help="plain gRPC to the SuperLink (no TLS)")
    parser.add_argument("--root-certificates", default="", help="the CA certificate the SuperLink's TLS uses")
    parser.add_argument(
        "--auth-keys", default="", help="folder of party-<id> SuperNode authentication private keys"
    )
    parser.add_argument(
        "--max-poll",
        type=float,
        default=MAX_POLL_S,
        help="longest seconds between two pulls of an idle device (longer where --polls-per-second needs it)",
    )
    parser.add_argument(
        "--polls-per-second",
        type=float,
        default=POLLS_PER_S,
        help="pulls a second this host's idle devices make at most, together",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Hold the devices until interrupted, or until every device's loop has ended."""
    args = _parser().parse_args(argv)
    from clients.approval import installed_digest
    from clients.flower_patch import shorten_object_pulls
    from clients.node import default_work_base
    from clients.supernode import SupernodeRefused, check_pinned_keys

    installed_digest()  # taken now, as the code this process answers with is (kept for its runs)

    try:
        if args.insecure == bool(args.root_certificates):
            raise DeviceHostError("give exactly one of --insecure and --root-certificates")
        if not args.keys and not args.insecure_no_pinned_keys:
            raise DeviceHostError(
                "no --keys: without each device's identity key and the pins, the server chooses the "
                "keys that seal boundary rows and can read them; pass --insecure-no-pinned-keys to "
                "run without that protection"
            )
        specs = device_specs(
            Path(args.partitions).resolve(),
            parse_ids(args.ids) if args.ids else None,
            Path(args.work_dir).resolve() if args.work_dir else default_work_base(),
            Path(args.keys).resolve() if args.keys else None,
            Path(args.auth_keys).resolve() if args.auth_keys else None,
        )
        for spec in specs:
            try:
                check_pinned_keys(spec.node_config, args.insecure_no_pinned_keys)
            except SupernodeRefused as exc:
                raise DeviceHostError(f"{spec.name}: {exc}") from None
        certificates = Path(args.root_certificates) if args.root_certificates else None
        connect = flower_connection(args.superlink, args.insecure, certificates)
        host = DeviceHost(specs, connect, args.max_poll, polls_per_s=args.polls_per_second)
    except DeviceHostError as exc:
        print(f"retexo-fl devices: error: {exc}", file=sys.stderr)
        return 2
    from clients import node_client
    from clients.worker import MAX_RUNS, WARM_IMPORTS

    node_client.SOLE_WRITER = True  # this process alone answers, and saves, for its devices
    node_client.CACHED_RUNS = MAX_RUNS  # as a node worker: runs side by side keep their clients
    shorten_object_pulls()
    host.import_ahead(WARM_IMPORTS)  # as a node worker does, while the devices register
    host.start()
    print(
        f"retexo-fl devices: holding {len(specs)} devices (an idle device polls every "
        f"{host.devices[0].max_poll:.2f} s at most)",
        file=sys.stderr,
        flush=True,
    )
    code = 0
    try:
        while not host.failed() and any(t.is_alive() for t in host.threads):
            time.sleep(0.5)
    except KeyboardInterrupt:  # Ctrl-C, or Flower's reply to a SuperLink that refused a node
        code = 130
    finally:
        host.close()
    for line in host.failed():  # a device that failed stops the host: say which, and why
        print(f"retexo-fl devices: {line}", file=sys.stderr, flush=True)
        code = 1
    return code


if __name__ == "__main__":
    sys.exit(main())
