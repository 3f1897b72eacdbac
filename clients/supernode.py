"""``retexo-fl supernode``: Flower's own SuperNode, with a node worker and without its long sleeps.

    retexo-fl supernode [--worker-base DIR] [--trusted-entities FILE] [--insecure-no-pinned-keys]
                        <flower-supernode flags>

Every other ``flower-supernode`` flag (``--superlink``, TLS, ``--auth-supernode-private-key``,
``--node-config``, ...) passes through unchanged to the pinned Flower's SuperNode, which runs
in this process. Before it starts, this command:

1. refuses to start without this party's identity key and pins (node config ``identity-key``
   and ``pinned-keys``, both readable and well-formed) unless ``--insecure-no-pinned-keys`` is
   given: without pins the server hands out the keys that seal boundary rows and secure
   aggregation shares, and can read both;
2. makes a worker folder (0700, with a new 32-byte secret and this node config;
   :mod:`clients.worker_link`) and starts the node worker (:mod:`clients.worker`) on it,
   restarting the worker whenever it dies. The worker answers under that node config only;
3. adds ``worker='<folder>'`` to ``--node-config``, so this node's ClientApp forwards every
   message to the worker (:mod:`clients.shim`) instead of importing torch and loading the
   partition again;
4. has the SuperNode start Flower's SuperExec with warm ClientApp launches that run the
   *installed* app (:mod:`clients.warm_superexec`, :mod:`clients.approval`): a run whose FAB's
   app code is not the installed app's is refused before any of it runs, unless an entity in
   ``--trusted-entities`` (Flower's YAML format) signed it; and shortens the SuperNode's fixed
   sleeps (:mod:`clients.flower_patch`), polling for tasks every 50 ms.

``--isolation process`` is refused: the ClientApp launcher that checks the run's app is the one
this command starts. Flower's ``--trusted-entities`` (Flower Hub signatures over the whole FAB)
is this command's own flag here, with signatures over the app code (:mod:`clients.approval`).
``flower-supernode`` on its own still works, running the coordinator's code
(``docs/deployment.md`` says what that means).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from clients.approval import (
    INSTALLED_DIGEST_ENV,
    TRUSTED_ENTITIES_ENV,
    AppNotApproved,
    installed_digest,
    load_trusted_entities,
)
from clients.flower_patch import (
    SUPEREXEC_POLL_ENV,
    shorten_object_pulls,
    shorten_supernode_sleeps,
    use_warm_superexec,
)
from clients.worker_link import WorkerError, make_worker_dir, write_node_config
from retexo_fl import protocol as P

#: A worker that dies this many times within :data:`RESTART_WINDOW` seconds is not restarted
#: again: something is wrong with the node, not with one message.
MAX_RESTARTS, RESTART_WINDOW = 5, 60.0

#: The worker's environment, wherever the node's own does not set these.
#:
#: - glibc's malloc: blocks of 4 MiB and more (a conv stage's per-edge tensors) get mappings of
#:   their own, handed back to the system when freed. With glibc's sliding default they stay in
#:   the heap, and the worker's resident memory keeps every stage's peak: 1,027 MB at the peak of
#:   a whole run on the edge test's graph (40,000 nodes, 2 million edges, ``--profile edge``),
#:   876-884 MB with these, at some seconds of page faults (`bench/worker_memory.py`, 2026-11-24).
#: - OpenMP's wait policy: torch's CPU threads otherwise spin after every parallel region, waiting
#:   for the next one. A worker waits for messages most of the time, and shares the host with
#:   the SuperNode, its SuperExec and the ClientApps it starts. Sampled with three nodes on the
#:   same 2 cores (Cora, 12 rounds, one run each), the workers used 41 s of CPU with spinning
#:   threads and 14 s passive, and the median round went from 1.86 to 0.91 s (bench/README.md,
#:   2026-11-24).
WORKER_ENV = {
    "MALLOC_MMAP_THRESHOLD_": "4194304",
    "MALLOC_TRIM_THRESHOLD_": "4194304",
    "OMP_WAIT_POLICY": "PASSIVE",
}


class WorkerSupervisor:
    """Runs the node worker on ``folder`` and starts a new one whenever it exits.

    Args:
        folder (Path): the worker folder.
        command (list[str], optional): the worker's command line (default:
            ``python -m clients.worker FOLDER --parent-pid <this process>``).
    """

    def __init__(self, folder: Path, command: list[str] | None = None) -> None:
        self.folder = folder
        self.command = command or [
            sys.executable, "-m", "clients.worker", str(folder), "--parent-pid", str(os.getpid()),
        ]  # fmt: skip
        self.proc: subprocess.Popen | None = None
        self.starts: list[float] = []
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="retexo-fl-node-worker", daemon=True)

    def start(self) -> WorkerSupervisor:
        """Start the worker and the thread that restarts it."""
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stopping.is_set():
            now = time.monotonic()
            self.starts = [t for t in self.starts if now - t < RESTART_WINDOW] + [now]
            if len(self.starts) > MAX_RESTARTS:
                print(
                    f"retexo-fl supernode: the node worker died {MAX_RESTARTS} times in "
                    f"{RESTART_WINDOW:.0f}s; not restarting it (messages to this node now fail)",
                    file=sys.stderr,
                    flush=True,
                )
                return
            if len(self.starts) > 1 and _installed_app_changed():
                print(
                    "retexo-fl supernode: the installed app changed since this node started; not "
                    "restarting the node worker with other code than the runs are admitted against "
                    "(restart the node to run the new code; messages to this node now fail)",
                    file=sys.stderr,
                    flush=True,
                )
                return
            self.proc = subprocess.Popen(self.command, env={**WORKER_ENV, **os.environ})
            code = self.proc.wait()
            if not self._stopping.is_set():
                print(
                    f"retexo-fl supernode: node worker {self.proc.pid} exited ({code}); starting a new "
                    "one from node-local state",
                    file=sys.stderr,
                    flush=True,
                )

    def stop(self) -> None:
        """Stop the worker and do not restart it."""
        self._stopping.set()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def with_node_config(argv: list[str], key: str, value: str) -> list[str]:
    """``argv`` with ``key='value'`` added to its ``--node-config`` (or a new one).

    Raises:
        ValueError: ``argv``'s node config already sets ``key``.
    """
    item = f"{key}='{value}'"
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--node-config" and i + 1 < len(out):
            current, at = out[i + 1], i + 1
        elif arg.startswith("--node-config="):
            current, at = arg.split("=", 1)[1], i
        else:
            continue
        if any(part.split("=", 1)[0].strip() == key for part in current.split()):
            raise ValueError(f"--node-config sets {key!r}: `retexo-fl supernode` sets it itself")
        merged = f"{current} {item}".strip()
        out[at] = merged if at == i + 1 else f"--node-config={merged}"
        return out
    return [*out, "--node-config", item]


class SupernodeRefused(ValueError):
    """``retexo-fl supernode`` will not start with these flags; the message says why."""


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value ``argv`` gives ``flag`` (``--flag VALUE`` or ``--flag=VALUE``), or None."""
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def node_config_of(argv: list[str]) -> dict[str, Any]:
    """The node config ``argv``'s ``--node-config`` sets, parsed as Flower parses it."""
    from flwr.common.config import parse_config_args

    text = flag_value(argv, "--node-config")
    return parse_config_args([text]) if text is not None else {}


def _check_own_pin(node_config: dict[str, Any], public: bytes, pins: dict[int, bytes]) -> None:
    """Refuse an identity key the pins do not hold, or hold for another client than the node's
    partition: a node started with another party's key file would be refused at every run's key
    setup, not at its start."""
    from retexo_fl.data.partition import read_manifest

    holders = sorted(pid for pid, pinned in pins.items() if pinned == public)
    key_file = node_config[P.NODE_IDENTITY_KEY]
    if not holders:
        pins_file = node_config[P.NODE_PINNED_KEYS]
        raise SupernodeRefused(f"identity key {key_file}: its public key is not in the pins ({pins_file})")
    folder = node_config.get(P.NODE_PARTITION_DIR)
    if folder is None or not (Path(str(folder)) / "manifest.json").is_file():
        return  # a simulated node's part is cut later: checked at key setup
    try:
        pid = int(read_manifest(str(folder))["partition_id"])
    except (OSError, ValueError, KeyError):
        return  # an unreadable partition is refused, naming its field, when it is loaded
    if pid not in holders:
        raise SupernodeRefused(
            f"identity key {key_file} is pinned for client {holders[0]}, and partition {folder} is "
            f"client {pid}'s: give this node client {pid}'s key"
        )


def _installed_app_changed() -> bool:
    """Whether the installed app's files differ from the digest this node took at its start: a
    worker started now would import code no run was admitted against."""
    from clients.approval import app_digest, installed_files

    pinned = os.environ.get(INSTALLED_DIGEST_ENV)
    return bool(pinned) and app_digest(installed_files()) != pinned


def check_partition(node_config: dict[str, Any]) -> None:
    """Load and verify the node's ``partition-dir`` (every file against its checksum), so that a
    corrupt or hand-edited folder stops the node at its start, in the party's own log, rather than
    fail every run's first message at the coordinator.

    Raises:
        SupernodeRefused: naming the file and field that is wrong.
    """
    folder = node_config.get(P.NODE_PARTITION_DIR)
    if folder is None:
        return  # a simulated node's part is cut later, from the run config
    from retexo_fl.data.partition import PartitionError, load_partition

    try:
        load_partition(str(folder))
    except PartitionError as exc:
        raise SupernodeRefused(f"partition-dir: {exc}") from None
    except OSError as exc:  # unreadable (permissions, a folder gone while read)
        raise SupernodeRefused(f"partition-dir {folder}: {exc}") from None


def check_pinned_keys(node_config: dict[str, Any], insecure: bool) -> str:
    """Refuse a node config without a usable identity key and pins unless ``insecure``.

    Returns:
        A warning to print ("" when the keys are there).

    Raises:
        SupernodeRefused: a key or the pins missing (without ``insecure``) or unreadable.
    """
    from retexo_fl.secure.keys import KeyMaterialError, load_pins, load_private_key, public_bytes

    missing = [k for k in (P.NODE_IDENTITY_KEY, P.NODE_PINNED_KEYS) if not node_config.get(k)]
    if missing and not insecure:
        raise SupernodeRefused(
            f"--node-config sets no {' and no '.join(missing)}: without this party's own identity key "
            "and the pins every party agreed on out of band, the server chooses the keys that seal "
            "boundary rows and secure-aggregation shares and can read them. Make them with "
            "`retexo-fl keys` (deploy/README.md, step 2), or pass --insecure-no-pinned-keys to "
            "run without that protection"
        )
    try:
        key = pins = None
        if node_config.get(P.NODE_IDENTITY_KEY):
            key = load_private_key(str(node_config[P.NODE_IDENTITY_KEY]))
        if node_config.get(P.NODE_PINNED_KEYS):
            pins = load_pins(str(node_config[P.NODE_PINNED_KEYS]))
    except KeyMaterialError as exc:
        raise SupernodeRefused(str(exc)) from None
    if key is not None and pins is not None:
        _check_own_pin(node_config, public_bytes(key), pins)
    if missing:
        return (
            "WARNING: --insecure-no-pinned-keys: this party accepts whatever keys the server hands "
            "out; the server can open every boundary row and secure-aggregation share it relays"
        )
    return ""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="retexo-fl supernode",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False,
        allow_abbrev=False,  # Flower's `--insecure` is not short for `--insecure-no-pinned-keys`
    )
    parser.add_argument(
        "--worker-base",
        default=None,
        help="where the worker folder is made (default: the temp folder; at most 65 bytes long, as "
        "the worker's socket path inside it must fit a Unix socket's 103)",
    )
    parser.add_argument(
        "--trusted-entities",
        default=None,
        help="YAML file of key id -> ssh-ed25519 public key (Flower's format): a run whose app code "
        "differs from the installed app's runs only if one of them signed it (retexo-fl release sign)",
    )
    parser.add_argument(
        "--insecure-no-pinned-keys",
        action="store_true",
        help="start without an identity key and pins (the server can then read sealed payloads)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the SuperNode with a node worker; returns its exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, flower_argv = _parser().parse_known_args(argv)
    if "-h" in flower_argv or "--help" in flower_argv:
        print(_parser().format_help())
        print("flower-supernode's flags, passed through:\n")
    from flwr.supercore.exit import ExitCode, add_exit_handler, flwr_exit
    from flwr.supernode.cli import flower_supernode  # Flower's own SuperNode, this process

    try:
        if flag_value(flower_argv, "--isolation") == "process":
            raise SupernodeRefused(
                "--isolation process: the ClientApp launcher that checks the run's app is the one "
                "this command starts (subprocess isolation, the default)"
            )
        node_config = node_config_of(flower_argv)
        warning = check_pinned_keys(node_config, ours.insecure_no_pinned_keys)
        check_partition(node_config)
        if ours.trusted_entities:
            trusted = Path(ours.trusted_entities).resolve()
            load_trusted_entities(trusted)  # a malformed file stops the node now, not at a run
            os.environ[TRUSTED_ENTITIES_ENV] = str(trusted)  # inherited by the ClientApp launches
        else:
            os.environ.pop(TRUSTED_ENTITIES_ENV, None)
    except (SupernodeRefused, AppNotApproved, ValueError) as exc:
        print(f"retexo-fl supernode: error: {exc}", file=sys.stderr)
        return 2
    # The code that answers is what the worker and the warm SuperExec import now: every run's
    # app is compared with it, not with files installed after this start.
    os.environ[INSTALLED_DIGEST_ENV] = installed_digest()
    if warning:
        print(f"retexo-fl supernode: {warning}", file=sys.stderr, flush=True)
    try:
        folder = make_worker_dir(ours.worker_base)
    except (WorkerError, OSError) as exc:  # a path too long for a socket, or a base not there
        print(f"retexo-fl supernode: error: {exc}", file=sys.stderr)
        return 2
    try:
        flower_argv = with_node_config(flower_argv, P.NODE_WORKER, str(folder))
    except ValueError as exc:
        shutil.rmtree(folder, ignore_errors=True)
        print(f"retexo-fl supernode: error: {exc}", file=sys.stderr)
        return 2
    write_node_config(folder, {**node_config, P.NODE_WORKER: str(folder)})
    shorten_supernode_sleeps()
    shorten_object_pulls()
    use_warm_superexec()
    os.environ.setdefault(*SUPEREXEC_POLL_ENV)  # inherited by the SuperExec Flower starts
    supervisor = WorkerSupervisor(folder)
    if not ("-h" in flower_argv or "--help" in flower_argv):
        supervisor.start()
    add_exit_handler(supervisor.stop, run_before_force_exit=True)
    sys.argv = ["flower-supernode", *flower_argv]
    try:
        flower_supernode()
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    finally:
        supervisor.stop()
        shutil.rmtree(folder, ignore_errors=True)
    # Flower's loop returns when its stream to the SuperLink ends without a retry (a CANCELLED
    # stream after the SuperLink restarted): its HTTP API thread would then keep this process
    # alive and offline for good. Exit, through Flower's handlers, so that the party's service
    # manager starts the node again.
    flwr_exit(
        ExitCode.SUPERNODE_CONNECTION_ERROR,
        "retexo-fl supernode: the connection to the SuperLink ended and Flower does not open it "
        "again; this node exits so that its service manager can restart it",
    )
