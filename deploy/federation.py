"""Run a whole federation on one machine as real processes: one SuperLink, N SuperNodes, ``flwr run``.

    python deploy/federation.py --partitions parts/ --out runs/fed \\
        [--tls certs/] [--keys keys/] [--run-config "stages=3 rounds='100'"] [--timeout 1800]

Each SuperNode is ``retexo-fl supernode`` (Flower's SuperNode with a long-lived node worker;
``--flower-supernode`` starts Flower's plain one instead) and gets its own fixed partition
(``part-<i>`` of ``--partitions``, written by ``retexo-fl partition``) through
``--node-config "partition-dir=..."``, with its identity key and the pins of every party
(``identity-key``, ``pinned-keys``: ``client-<i>.key`` and ``pins.json`` of ``--keys``, made
with ``retexo-fl keys --clients N`` when missing; one machine holds every key here, which is why
this launcher is a demonstration and a test, not a deployment). With ``--tls DIR`` the SuperLink
serves TLS with the certificate in DIR and requires SuperNode authentication; the launcher makes
missing key material with ``deploy/make_certs.py`` and registers every party's public key with
``flwr supernode register`` before its SuperNode starts. The run is submitted with
``flwr run . <connection>``, followed with ``flwr ls`` until it ends, and its run folder
(``--out``) is where the ServerApp writes it. Every process the launcher started is stopped by
process id (its whole process group: a SuperNode's SuperExec, ClientApps and node worker too)
when the run ends, fails, or on Ctrl-C.
Logs are in ``--work`` (default ``<out>/federation``).

The commands it runs are printed as they start (``$ ...``); ``deploy/README.md`` uses the same.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from retexo_fl import protocol as P
from retexo_fl.data.partition import cut_settings, partition_dirs, partition_folder_id

ROOT = Path(__file__).resolve().parents[1]
ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tool_path(path: str | None = None) -> str:
    """``PATH`` (default: this process's) with the running interpreter's folder first, so that
    Flower's executables and ``retexo-fl`` installed beside it are found (a virtual environment
    used without activating it), by us and by the processes Flower starts itself."""
    here = str(Path(sys.executable).parent)
    rest = (os.environ.get("PATH", "") if path is None else path).split(os.pathsep)
    return os.pathsep.join([here, *(p for p in rest if p and p != here)])


def require_tool(name: str, path: str) -> None:
    """Refuse to start a process whose program is missing, naming it and where it was looked for.

    Raises:
        FileNotFoundError: ``name`` is on neither ``path`` nor beside the running interpreter.
    """
    if shutil.which(name, path=path) is None:
        raise FileNotFoundError(
            f"{name} is not beside {sys.executable} nor on PATH; install the project there "
            "(pip install -e .) or put its folder on PATH"
        )


def _stat(pid: int | str) -> tuple[int, int] | None:
    """(parent id, start time) of process ``pid`` from ``/proc``, or None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[1]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def descendants(roots: set[int]) -> dict[int, int]:
    """Every living process descended from ``roots``: process id -> its start time (a process id
    reused later has another; empty where ``/proc`` is not there)."""
    children: dict[int, list[tuple[int, int]]] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
        if entry.name.isdigit() and (stat := _stat(entry.name)) is not None:
            children.setdefault(stat[0], []).append((int(entry.name), stat[1]))
    found: dict[int, int] = {}
    todo = list(roots)
    while todo:
        for child, started in children.get(todo.pop(), []):
            if child not in found:
                found[child] = started
                todo.append(child)
    return found


def id_ranges(ids: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2,5,7-8"``: thousands of devices in a short command line."""
    out: list[str] = []
    for i in sorted(ids):
        if out and i == int(out[-1].rsplit("-", 1)[-1]) + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ",".join(out)


def cut_config(partitions: Path, run_config: str) -> str:
    """Run-config pairs for what the cut in ``partitions`` was made of (its dataset, split and
    partitioner: :func:`~retexo_fl.data.partition.cut_settings`) that ``run_config`` does not set:
    the server never reads a partition, and recorded the app's defaults (Cora, its public split).
    A cut of one node a party keeps the method the run config declares, as that picks the level's
    defaults."""
    pairs = []
    for key, value in cut_settings(partitions).items():
        name = key.replace("_", "-")
        if re.search(rf"(^|\s){re.escape(name)}\s*=", run_config) or (key == "method" and value == "node"):
            continue
        pairs.append(f"{name}={value}" if isinstance(value, int) else f"{name}={json.dumps(value)}")
    return " ".join(pairs)


class FederationProcesses:
    """The processes of one local federation, and how to stop them all.

    Args:
        work: folder for logs, the SuperLink database and ``FLWR_HOME``.
        tls: folder of key material (TLS + SuperNode authentication), or None for insecure.
        host: the address the SuperLink's Fleet API listens on and SuperNodes dial (default
            127.0.0.1; an emulated WAN's bridge address, see ``deploy/wan.py``). The ``flwr``
            CLI's control API stays on 127.0.0.1.
        database: the SuperLink's state: a file in ``work`` (default; it survives a SuperLink
            restart) or, with False, in memory. Measured on 2 cores with 3 SuperNodes, the file
            costs the SuperLink about 4x the CPU and a round about 3x the time
            (``bench/deploy_latency.py``).
    """

    def __init__(
        self, work: Path, tls: Path | None = None, host: str = "127.0.0.1", database: bool = True
    ) -> None:
        self.work, self.tls, self.host, self.database = work, tls, host, database
        self.work.mkdir(parents=True, exist_ok=True)
        self.home = self.work / "flwr-home"
        self.home.mkdir(exist_ok=True)
        self.env = {**os.environ, **ENV, "FLWR_HOME": str(self.home), "PATH": tool_path()}
        self.procs: dict[str, subprocess.Popen] = {}
        self.http, self.fleet = free_port(), free_port()
        #: The pins file the parties hold (set by :meth:`start_supernode` with keys): a party that
        #: pins keys refuses a run config that does not name the same pins.
        self.pins: Path | None = None

    # -- processes ---------------------------------------------------------------------------
    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        program = argv[4] if argv[:3] == ["ip", "netns", "exec"] else argv[0]  # ip netns exec NS prog
        require_tool(program, self.env["PATH"])
        print(f"$ {shlex.join(argv)}", flush=True)
        log = open(self.work / f"{name}.log", "wb")  # noqa: SIM115 (the process keeps it)
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**self.env, **(env or {})},
            start_new_session=True,
        )
        self.procs[name] = proc
        return proc

    def stop(self, name: str, sig: int = signal.SIGTERM) -> None:
        """Stop one process and everything it started (its process group)."""
        proc = self.procs.get(name)
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def stop_all(self) -> None:
        """Stop every process started here and everything they started. The SuperLink starts its
        SuperExec in a session of its own, and that starts the run's ServerApp: stopped with the
        SuperLink's group alone, a run interrupted mid-way left its ServerApp running."""
        started = descendants({proc.pid for proc in self.procs.values()})
        for name in reversed(list(self.procs)):  # SuperNodes first, the SuperLink last
            self.stop(name)
        for proc in self.procs.values():  # anything left in a group whose leader exited
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        for pid, start in started.items():  # and in groups of their own, if still the same process
            stat = _stat(pid)
            if stat is not None and stat[1] == start:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)

    def flwr(self, *args: str, timeout: float = 120, echo: bool = True) -> subprocess.CompletedProcess:
        require_tool("flwr", self.env["PATH"])
        argv = ["flwr", *args]
        if echo:
            print(f"$ {shlex.join(argv)}", flush=True)
        return subprocess.run(argv, capture_output=True, text=True, env=self.env, cwd=ROOT, timeout=timeout)

    # -- the federation ----------------------------------------------------------------------
    def start_superlink(self) -> None:
        security = ["--insecure"]
        if self.tls:
            security = [
                "--ssl-ca-certfile", str(self.tls / "ca.crt"),
                "--ssl-certfile", str(self.tls / "superlink.crt"),
                "--ssl-keyfile", str(self.tls / "superlink.key"),
                "--enable-supernode-auth",
            ]  # fmt: skip
        self.start(
            "superlink",
            [
                "flower-superlink", *security,
                "--host", "127.0.0.1", "--port", str(self.http),
                "--fleet-api-address", f"{self.host}:{self.fleet}",
                *(["--database", str(self.work / "superlink.db")] if self.database else []),
                "--disable-runtime-dependency-installation",
            ],
        )  # fmt: skip
        conn = [
            '[superlink]\ndefault = "local-fed"\n',
            "[superlink.local-fed]",
            f'address = "127.0.0.1:{self.http}"',
            f'root-certificates = "{self.tls / "ca.crt"}"' if self.tls else "insecure = true",
        ]
        (self.home / "config.toml").write_text("\n".join(conn) + "\n")
        self.wait_for_port(self.fleet, "superlink", self.host)

    def wait_for_port(self, port: int, name: str, host: str = "127.0.0.1", timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.procs[name].poll() is not None:
                raise RuntimeError(
                    f"{name} exited ({self.procs[name].returncode}); see {self.work / (name + '.log')}"
                )
            with socket.socket() as s:
                if s.connect_ex((host, port)) == 0:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"{name} did not listen on {host}:{port} within {timeout:.0f}s")

    def register(self, party: int) -> None:
        done = self.flwr("supernode", "register", str(self.tls / f"party-{party}.pub"), "local-fed")
        if done.returncode != 0:
            raise RuntimeError(f"registering party {party} failed: {done.stdout[-500:]} {done.stderr[-500:]}")

    def start_supernode(
        self,
        party: int,
        partition: Path,
        key_party: int | None = None,
        env: dict[str, str] | None = None,
        netns: str = "",
        worker: bool = True,
        keys: Path | None = None,
        extra: tuple[str, ...] = (),
    ) -> subprocess.Popen:
        """Start party ``party``'s SuperNode on ``partition`` (in network namespace ``netns``):
        ``retexo-fl supernode`` (a node worker, short polls), or with ``worker=False`` Flower's
        plain ``flower-supernode`` (a ClientApp process per message). With ``keys`` (a folder of
        ``retexo-fl keys``) the party holds its identity key and the pins; without, a
        ``retexo-fl supernode`` is started with ``--insecure-no-pinned-keys``. ``extra``: more
        flags for the SuperNode command."""
        node_config = f"{P.NODE_PARTITION_DIR}='{partition}' {P.NODE_WORK_DIR}='{self.work / 'node-work'}'"
        if keys is not None:
            own, self.pins = keys / f"client-{party}.key", keys / "pins.json"
            node_config += f" {P.NODE_IDENTITY_KEY}='{own}' {P.NODE_PINNED_KEYS}='{self.pins}'"
        ours = ["retexo-fl", "supernode", *([] if keys is not None else ["--insecure-no-pinned-keys"])]
        security = ["--insecure"]
        if self.tls:
            key = self.tls / f"party-{party if key_party is None else key_party}"
            security = [
                "--root-certificates",
                str(self.tls / "ca.crt"),
                "--auth-supernode-private-key",
                str(key),
            ]
        # `ip netns exec` execs the SuperNode in place: same process id, same process group.
        inside = ["ip", "netns", "exec", netns] if netns else []
        return self.start(
            f"supernode-{party}",
            [
                *inside, *(ours if worker else ["flower-supernode"]), *security,
                "--superlink", f"{self.host}:{self.fleet}",
                "--port", str(free_port()),
                "--node-config", node_config, *extra,
            ],
            env,
        )  # fmt: skip

    def start_device_host(
        self,
        host: int,
        partitions: Path,
        ids: list[int],
        keys: Path | None = None,
        extra: tuple[str, ...] = (),
    ) -> subprocess.Popen:
        """Start ``retexo-fl devices`` holding the ``part-<id>`` folders ``ids`` of ``partitions``
        as that many one-node parties (each its own Flower node; under TLS each authenticates with
        its ``party-<id>`` key, registered first). ``extra``: more flags for the command."""
        if keys is not None:
            self.pins = keys / "pins.json"
        security = ["--insecure"]
        if self.tls:
            security = ["--root-certificates", str(self.tls / "ca.crt"), "--auth-keys", str(self.tls)]
        return self.start(
            f"devices-{host}",
            [
                "retexo-fl", "devices", *security,
                "--superlink", f"{self.host}:{self.fleet}",
                "--partitions", str(partitions),
                "--ids", id_ranges(ids),
                "--work-dir", str(self.work / "node-work"),
                *(["--keys", str(keys)] if keys is not None else ["--insecure-no-pinned-keys"]),
                *extra,
            ],
        )  # fmt: skip

    def run_parties(
        self,
        parts: list[Path],
        out: Path,
        run_config: str,
        timeout: float,
        netns: list[str] | None = None,
        env: dict[str, str] | None = None,
        worker: bool = True,
        keys: Path | None = None,
        devices_per_host: int = 0,
        device_flags: tuple[str, ...] = (),
    ) -> dict:
        """SuperLink, one SuperNode per partition (registered first under TLS, in ``netns[i]``
        when given; holding its key of ``keys``), then the run into ``out``; returns :meth:`run`'s
        record. With ``devices_per_host`` the partitions are held that many at a time by
        ``retexo-fl devices`` hosts instead (``device_flags`` added to each). The caller stops
        the processes (:meth:`stop_all`)."""
        self.start_superlink()
        if devices_per_host:
            ids = [partition_folder_id(part) for part in parts]
            if self.tls:
                for i in ids:
                    self.register(i)
            for h, start in enumerate(range(0, len(ids), devices_per_host)):
                chunk = ids[start : start + devices_per_host]
                self.start_device_host(h, parts[0].parent, chunk, keys, device_flags)
        for i, part in enumerate(parts if not devices_per_host else []):
            if self.tls:
                self.register(i)
            self.start_supernode(i, part, env=env, netns=netns[i] if netns else "", worker=worker, keys=keys)
        config = f"clients={len(parts)} out-dir='{out}' {cut_config(parts[0].parent, run_config)}"
        return self.run(f"{config} {run_config}".strip(), timeout)

    def submit(self, run_config: str, app: str | Path = ".") -> int:
        """Submit the app in folder ``app`` (``flwr run``) with ``run_config``, naming the parties'
        pins in it when they hold some; returns the run id."""
        if self.pins is not None and "pinned-keys=" not in run_config:
            run_config = f"{run_config} pinned-keys='{self.pins}'"
        done = self.flwr("run", str(app), "local-fed", "--format", "json", "--run-config", run_config)
        try:
            run_id = int(json.loads(done.stdout)["run-id"])
        except (ValueError, KeyError):
            raise RuntimeError(f"flwr run failed: {done.stdout[-1000:]} {done.stderr[-1000:]}") from None
        print(f"run {run_id} submitted", flush=True)
        return run_id

    def run(self, run_config: str, timeout: float) -> dict:
        """Submit the app, follow it until it ends; returns ``flwr ls``'s record of the run."""
        run_id = self.submit(run_config)
        out = re.search(r"out-dir='([^']*)'", run_config)
        return self.wait(run_id, timeout, Path(out.group(1)) if out else None)

    def status(self, run_id: int, echo: bool = False) -> dict:
        """``flwr ls``'s record of run ``run_id`` (``{"status": "unknown"}`` if it gives none)."""
        ls = self.flwr("ls", "local-fed", "--run-id", str(run_id), "--format", "json", timeout=60, echo=echo)
        try:
            return json.loads(ls.stdout)["runs"][0]
        except (ValueError, KeyError, IndexError):
            return {"status": "unknown"}

    def wait(self, run_id: int, timeout: float, out: Path | None = None) -> dict:
        """Follow run ``run_id`` until it ends; returns ``flwr ls``'s record of it.

        Each ``flwr ls`` is a new Python process (about 1.5 s of CPU): it is asked every 10 s,
        and every 0.5 s once the run folder ``out`` has its ``summary.json`` (the ServerApp's
        last write), so that following a run does not slow the run it follows.
        """
        deadline = time.monotonic() + timeout
        last, asked = None, 0.0
        while time.monotonic() < deadline:
            finishing = out is not None and (out / "summary.json").is_file()
            if finishing or time.monotonic() - asked >= 10.0:
                record, asked = self.status(run_id, echo=last is None), time.monotonic()
                status = str(record.get("status", ""))
                if status != last:  # the poll is echoed once; after that, only status changes
                    print(f"run {run_id}: {status}", flush=True)
                    last = status
                if status.startswith("finished"):
                    return record
            time.sleep(0.5 if finishing else 0.2)
        raise TimeoutError(f"run {run_id} did not finish within {timeout:.0f}s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--partitions", required=True, help="folder of part-<i>/ written by `retexo-fl partition`"
    )
    parser.add_argument("--out", required=True, help="the run folder (summary.json, events.jsonl)")
    parser.add_argument("--tls", default="", help="key material folder: TLS + SuperNode authentication")
    parser.add_argument(
        "--keys",
        default="",
        help="identity keys and pins.json (retexo-fl keys; made when missing; default <work>/keys)",
    )
    parser.add_argument("--run-config", default="", help="extra run config, e.g. \"stages=3 rounds='100'\"")
    parser.add_argument("--work", default="", help="logs, database and FLWR_HOME (default <out>/federation)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds the run may take")
    parser.add_argument(
        "--flower-supernode",
        action="store_true",
        help="start Flower's plain flower-supernode (a ClientApp process per message) instead of "
        "`retexo-fl supernode` (a node worker per node)",
    )
    parser.add_argument(
        "--superlink-in-memory",
        action="store_true",
        help="keep the SuperLink's state in memory, not in a database file: less CPU a message (lost "
        "if the SuperLink restarts)",
    )
    parser.add_argument(
        "--device-max-poll",
        type=float,
        default=0.0,
        help="with --devices-per-host: the longest seconds between two pulls of an idle device "
        "(retexo-fl devices --max-poll; default its own)",
    )
    parser.add_argument(
        "--devices-per-host",
        type=int,
        default=0,
        help="emulate devices: hold this many partitions per `retexo-fl devices` process (each its "
        "own Flower node) instead of one `retexo-fl supernode` per partition",
    )
    parser.add_argument(
        "--wan-mbit",
        type=float,
        default=0.0,
        help="emulate a WAN: every SuperNode in its own network namespace behind a link of this "
        "many Mbit/s each way (root only; see deploy/wan.py)",
    )
    args = parser.parse_args(argv)

    if args.devices_per_host < 0 or (args.devices_per_host and (args.wan_mbit or args.flower_supernode)):
        print(
            "--devices-per-host: a positive count, without --wan-mbit or --flower-supernode (a host's "
            "devices share one process, one network namespace and the installed app)",
            file=sys.stderr,
        )
        return 2
    parts = partition_dirs(Path(args.partitions).resolve())
    if not parts:
        print(f"{args.partitions}: no part-* folders", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    tls = Path(args.tls).resolve() if args.tls else None
    wan = None
    if args.wan_mbit:
        from wan import EmulatedWan, wan_unavailable

        if reason := wan_unavailable():
            print(f"--wan-mbit: cannot emulate links here: {reason}", file=sys.stderr)
            return 2
        wan = EmulatedWan(len(parts), args.wan_mbit).up()
    host = wan.host_address if wan else "127.0.0.1"
    if tls:
        from make_certs import main as make_certs

        sans = ["--san", "127.0.0.1", "--san", "localhost"] + (["--san", host] if wan else [])
        make_certs(["--out", str(tls), "--parties", str(len(parts)), *sans])
    fed = FederationProcesses(
        Path(args.work).resolve() if args.work else out / "federation",
        tls,
        host,
        database=not args.superlink_in_memory,
    )
    keys = Path(args.keys).resolve() if args.keys else fed.work / "keys"
    if not (keys / "pins.json").is_file():
        from retexo_fl.secure.keys import write_identities

        write_identities(len(parts), keys)

    def interrupted(signum, frame):  # Ctrl-C or SIGTERM: stop everything, then leave
        fed.stop_all()
        if wan:
            wan.down()
        sys.exit(130)

    signal.signal(signal.SIGINT, interrupted)
    signal.signal(signal.SIGTERM, interrupted)
    try:
        netns = [wan.netns(i) for i in range(len(parts))] if wan else None
        record = fed.run_parties(
            parts,
            out,
            args.run_config,
            args.timeout,
            netns,
            worker=not args.flower_supernode,
            keys=keys,
            devices_per_host=args.devices_per_host,
            device_flags=("--max-poll", str(args.device_max_poll)) if args.device_max_poll else (),
        )
        status = record.get("status", "")
        summary = out / "summary.json"
        result = ""
        if summary.is_file():  # the figures a finished run reports, as `retexo-fl train` prints them
            test = json.loads(summary.read_text()).get("test_accuracy")
            result = f"; test accuracy {'-' if test is None else f'{test:.4f}'}"  # null: no test nodes
        print(f"run ended: {status}{result}; run folder {out}", flush=True)
        return 0 if status == "finished:completed" and summary.is_file() else 1
    finally:
        fed.stop_all()
        if wan:
            wan.down()


if __name__ == "__main__":
    sys.exit(main())
