"""The node worker and its channel, driven by the library's own stage machine (no SuperLink).

Every request of a whole lazy run goes through Flower records, the node-local channel and a real
worker process per client, exactly as a ClientApp shim sends it; the result must equal the
in-process engine's. Then a worker is SIGKILLed mid-stage, and two runs share the workers.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from flwr.app import RecordDict

import clients.worker as worker_module
from clients.records import from_flower, to_flower
from clients.supernode import WORKER_ENV, WorkerSupervisor, with_node_config
from clients.supernode import main as supernode_main
from clients.worker import IMPORTED_AHEAD, request_message, warm_imports
from clients.worker_link import (
    MAX_SOCKET_PATH,
    PID_NAME,
    SECRET_NAME,
    SOCKET_NAME,
    WorkerError,
    call,
    check_worker_dir,
    make_worker_dir,
    read_node_config,
    read_secret,
    recv_frame,
    send_frame,
    write_node_config,
)
from retexo_fl import protocol as P
from retexo_fl.config import TrainConfig
from retexo_fl.coordinator.stages import LazyStageMachine
from retexo_fl.coordinator.transport import Batch
from retexo_fl.data.loading import load_graph
from retexo_fl.data.partition import save_partition
from retexo_fl.data.partitioners import partition_graph
from retexo_fl.metrics import RunRecorder
from retexo_fl.protocol import Records
from retexo_fl.training.inprocess import InProcessTransport
from retexo_fl.training.lazy import run_lazy

pytestmark = pytest.mark.slow  # each worker is a process that imports torch (about 3 s)

CFG = {
    "dataset": "sbm:400,4",
    "clients": 2,
    "method": "random",
    "stages": 3,
    "rounds": 4,
    "hidden": 16,
    "profile": "exact",
}


class WorkerTransport(InProcessTransport):
    """The stage machine's transport over node workers: what a shim would send, as it sends it.

    Addresses index ``folders`` (one worker each); the rest is the in-process transport's.
    """

    engine = "worker-test"

    def __init__(self, folders: list[Path], run_id: int) -> None:
        super().__init__([])
        self.clients = list(folders)  # what connect() counts
        self.folders, self.run_id = folders, run_id
        self.sent = 0
        self.before_send: Any = None

    def send(self, kind: str, requests: dict[int, Records], phase: str, stage: int) -> Batch:
        if self.before_send is not None:
            self.before_send(self.sent)
        replies = {}
        for a, req in requests.items():
            header = {
                "type": kind,
                "run_id": self.run_id,
                "message_id": f"{self.sent}-{a}",
                "node_id": a + 1,
            }
            _, content = call(self.folders[a], header, to_flower(req), wait=60)
            replies[a] = from_flower(content)
        self.sent += 1
        return Batch(replies)


def _worker_pid(folder: Path, old: int | None = None, timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pid = int((folder / "worker.pid").read_text())
            if pid != old and (folder / SOCKET_NAME).exists():
                return pid
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"no worker listening in {folder}")


@contextlib.contextmanager
def _workers(tmp: Path, cfg: TrainConfig, base: Path):
    """One partition folder and one supervised node worker per client of ``cfg``, the workers'
    folders made in ``base``."""
    parts = partition_graph(load_graph(cfg), cfg.clients, cfg.method, seed=cfg.seed)
    dirs = [save_partition(p, tmp / f"part-{i}") for i, p in enumerate(parts)]
    folders = [make_worker_dir(base) for _ in parts]
    for folder, part in zip(folders, dirs, strict=True):  # what `retexo-fl supernode` writes
        node_config = {
            P.NODE_PARTITION_DIR: str(part),
            P.NODE_WORK_DIR: str(tmp / "work"),
            P.NODE_WORKER: str(folder),
        }
        write_node_config(folder, node_config)
    supervisors = [WorkerSupervisor(f).start() for f in folders]
    try:
        for f in folders:
            _worker_pid(f)
        yield cfg, parts, dirs, folders, tmp
    finally:
        for s in supervisors:
            s.stop()
            assert s.proc is not None and s.proc.poll() is not None


@pytest.fixture(scope="module")
def federation(tmp_path_factory, module_worker_base):
    cfg = TrainConfig.resolve(**CFG)
    with _workers(tmp_path_factory.mktemp("workers"), cfg, module_worker_base) as fed:
        yield fed


def _kill_once(transport: WorkerTransport, folder: Path, at: int) -> list[int]:
    """SIGKILL ``folder``'s worker once, before the transport's message number ``at``; the pids killed."""
    killed: list[int] = []

    def kill(sent: int) -> None:
        if sent == at and not killed:
            pid = _worker_pid(folder)
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    transport.before_send = kill
    return killed


def _summary(run: dict) -> tuple:
    stages = [(s["best_round"], s["val_accuracy"], s["rounds_sent"]) for s in run["stages"]]
    return run["test_accuracy"], run["val_accuracy"], run["bytes_boundary"], run["bytes_model"], stages


def test_worker_folder_is_the_users_alone(worker_base):
    folder = make_worker_dir(worker_base)
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(folder / SECRET_NAME).st_mode) == 0o600
    assert len(read_secret(folder)) == 32 and read_secret(folder) != read_secret(make_worker_dir(worker_base))
    check_worker_dir(folder)
    os.chmod(folder, 0o755)
    with pytest.raises(WorkerError, match="mode 755, must be 700"):
        check_worker_dir(folder)
    os.chmod(folder, 0o700)
    os.chmod(folder / SECRET_NAME, 0o644)
    with pytest.raises(WorkerError, match="must be 600"):
        read_secret(folder)


def test_a_folder_too_deep_for_a_socket_is_refused_naming_it(tmp_path, monkeypatch, capsys):
    """A socket path over the kernel's limit fails ``bind`` with no folder named: the folder is
    refused where it is made, naming it, and nothing is left behind; ``retexo-fl supernode``
    says so in one line before Flower starts."""
    deep = tmp_path / ("d" * max(1, MAX_SOCKET_PATH - len(str(tmp_path))))
    deep.mkdir()
    refused = rf"worker folder {deep}/retexo-fl-worker-\S+: its socket path is \d+ bytes"
    with pytest.raises(WorkerError, match=refused):
        make_worker_dir(deep)
    assert list(deep.iterdir()) == []
    # What supernode's main() sets in this process before it makes the folder, restored after.
    import clients.approval as approval

    monkeypatch.setenv(approval.INSTALLED_DIGEST_ENV, "")
    monkeypatch.setenv(approval.TRUSTED_ENTITIES_ENV, "")
    monkeypatch.setattr(approval, "_INSTALLED", approval._INSTALLED)
    assert supernode_main(["--insecure-no-pinned-keys", "--worker-base", str(deep), "--insecure"]) == 2
    assert "at most 103; make the folder somewhere shorter (--worker-base)" in capsys.readouterr().err
    assert list(deep.iterdir()) == []


def test_node_config_gets_the_worker_key():
    assert with_node_config(["--insecure"], "worker", "/w") == ["--insecure", "--node-config", "worker='/w'"]
    argv = ["--node-config", "partition-dir='/p'", "--insecure"]
    merged = ["--node-config", "partition-dir='/p' worker='/w'", "--insecure"]
    assert with_node_config(argv, "worker", "/w") == merged
    assert with_node_config(["--node-config=a=1"], "worker", "/w") == ["--node-config=a=1 worker='/w'"]
    with pytest.raises(ValueError, match="sets 'worker'"):
        with_node_config(["--node-config", "worker='/x'"], "worker", "/w")


def test_a_request_cannot_name_the_node_config(tmp_path, worker_base):
    """The worker answers under the node config ``retexo-fl supernode`` wrote into its folder; a
    request that carries one (a server's or a FAB's idea of this party's policy) changes nothing."""
    folder = make_worker_dir(worker_base)
    own = {P.NODE_PARTITION_DIR: "/parts/mine", P.NODE_PINNED_KEYS: "/keys/pins.json"}
    write_node_config(folder, own)
    assert stat.S_IMODE(os.stat(folder / "node-config.json").st_mode) == 0o600
    header = {"type": P.TRAIN, "run_id": 1, "node_id": 2, "node_config": {P.NODE_ENCRYPT: "false"}}
    _, context = request_message(header, to_flower({}), read_node_config(folder))
    assert context.node_config == own
    os.chmod(folder / "node-config.json", 0o644)
    with pytest.raises(WorkerError, match="must be 600"):
        read_node_config(folder)
    (folder / "node-config.json").unlink()
    with pytest.raises(WorkerError, match="no node config"):
        read_node_config(folder)


def test_no_worker_is_one_line_naming_the_socket(tmp_path, worker_base):
    folder = make_worker_dir(worker_base)
    with pytest.raises(WorkerError, match=r"no node worker at .*worker.sock after 0s") as err:
        call(folder, {}, to_flower({}), wait=0.2)
    assert "\n" not in str(err.value)


def test_the_worker_starts_with_passive_threads_and_a_returning_malloc(federation):
    """The supervisor's worker gets :data:`WORKER_ENV` wherever the node's environment is silent.

    Spinning OpenMP threads doubled the deployed round on a shared host, and the malloc settings
    keep the worker within the edge ceiling; both only act from the process's start.
    """
    _, _, _, folders, _ = federation
    raw = Path(f"/proc/{_worker_pid(folders[0])}/environ").read_bytes()
    env = dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)
    for key, value in WORKER_ENV.items():
        assert env.get(key) == os.environ.get(key, value), key


def test_the_channel_refuses_a_caller_without_the_secret(federation):
    *_, folders, _ = federation
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(folders[0] / SOCKET_NAME))
        nonce = recv_frame(sock)
        send_frame(sock, bytes(32))  # not HMAC(secret, nonce)
        verdict = json.loads(recv_frame(sock))
    assert len(nonce) == 32
    assert verdict == {"ok": False, "error": "the node worker refused this caller: wrong node secret"}
    # a caller that copies the socket but reads a secret of its own making is refused the same way
    fake = make_worker_dir(folders[0].parent)
    os.symlink(folders[0] / SOCKET_NAME, fake / SOCKET_NAME)
    with pytest.raises(WorkerError, match="wrong node secret"):
        call(fake, {}, to_flower({}), wait=5)


def test_worker_errors_come_back_as_one_line(federation):
    _, _, dirs, folders, _ = federation
    header = {"type": P.TRAIN, "run_id": 1, "node_id": 1, "node_config": {P.NODE_PARTITION_DIR: str(dirs[0])}}
    request = to_flower({P.CONFIG: {P.RUN_DIGEST: "0" * 32, P.RUN_KEY: 99}})
    with pytest.raises(WorkerError, match=r"^ValueError: a train message names run config '0+'"):
        call(folders[0], header, request)


def test_a_run_through_workers_equals_the_in_process_run(federation):
    cfg, parts, _, folders, _ = federation
    expected = run_lazy(parts, cfg)
    transport = WorkerTransport(folders, run_id=7)
    got = LazyStageMachine(transport, cfg, RunRecorder(None, stream=None)).run()
    assert _summary(got) == _summary(expected)


def test_a_worker_killed_mid_stage_restarts_from_node_state(federation):
    cfg, parts, _, folders, _ = federation
    expected = run_lazy(parts, cfg)
    transport = WorkerTransport(folders, run_id=8)
    # After stage 0 and a round of stage 1 (message 12 or so).
    killed = _kill_once(transport, folders[1], at=12)
    got = LazyStageMachine(transport, cfg, RunRecorder(None, stream=None)).run()
    assert killed and _worker_pid(folders[1], old=killed[0]) != killed[0]  # a new worker answered
    assert _summary(got) == _summary(expected)


def test_two_runs_on_one_node_do_not_share_state(federation):
    cfg, parts, _, folders, _ = federation
    other = TrainConfig.resolve(**{**CFG, "seed": 3, "hidden": 8})
    runs: dict[str, dict] = {}

    def run(name: str, c: TrainConfig) -> None:
        transport = WorkerTransport(folders, run_id=9)  # one node, one work base, one Flower run
        runs[name] = LazyStageMachine(transport, c, RunRecorder(None, stream=None)).run()

    threads = [threading.Thread(target=run, args=(n, c)) for n, c in (("x", cfg), ("y", other))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert _summary(runs["x"]) == _summary(run_lazy(parts, cfg))
    assert _summary(runs["y"]) == _summary(run_lazy(parts, other))


def test_secure_aggregation_through_workers_survives_a_killed_worker(tmp_path, worker_base):
    """Masked replies, sealed shares and unmask answers through three node workers, one of them
    killed between messages mid-stage: its ledger and last masked round come back from node-local
    state, and the run equals the in-process one."""
    cfg = TrainConfig.resolve(**{**CFG, "clients": 3, "secure_aggregation": True})
    with _workers(tmp_path, cfg, worker_base) as (cfg, parts, _, folders, _):
        expected = run_lazy(parts, cfg)
        transport = WorkerTransport(folders, run_id=7)
        killed = _kill_once(transport, folders[2], at=14)  # after stage 1's first train and unmask
        got = LazyStageMachine(transport, cfg, RunRecorder(None, stream=None)).run()
    assert killed and expected["secure_aggregation"]["rounds"] == 12
    assert _summary(got) == _summary(expected)
    assert got["secure_aggregation"] == expected["secure_aggregation"]


def test_a_worker_whose_supernode_was_killed_outright_takes_its_folder_with_it(tmp_path, worker_base):
    """A SIGKILLed SuperNode removes nothing itself; its worker leaves, removing the folder's
    secret, node config, socket and pid file, and the folder."""
    folder = make_worker_dir(worker_base)
    write_node_config(folder, {P.NODE_PARTITION_DIR: str(tmp_path / "none")})
    # A stand-in SuperNode: starts the worker as retexo-fl supernode does, then waits.
    code = (
        "import os, subprocess, sys, time; "
        f"subprocess.Popen([sys.executable, '-m', 'clients.worker', {str(folder)!r}, "
        "'--parent-pid', str(os.getpid())]); "
        "time.sleep(120)"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2])
    try:
        deadline = time.monotonic() + 60
        while not (folder / PID_NAME).is_file():  # the worker is up
            assert time.monotonic() < deadline, "the worker did not start"
            time.sleep(0.2)
        worker = int((folder / PID_NAME).read_text())
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        while folder.exists():
            assert time.monotonic() < deadline, f"{folder} is still there: {sorted(os.listdir(folder))}"
            time.sleep(0.2)
    finally:
        if parent.poll() is None:
            parent.kill()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{worker}").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not Path(f"/proc/{worker}").exists() or "Z" in Path(f"/proc/{worker}/stat").read_text().split()[2]


#: A bound, not a target: the import took 10-19 s with a deployed run's processes on 2 cores.
IMPORT_BOUND_S = 120


def test_a_worker_imports_what_runs_need_once_it_listens(tmp_path, worker_base):
    """PyG is imported on a thread as soon as the worker listens, before any run asks for it: the
    first conv stage of a run no longer pays that import in its first round."""
    folder = make_worker_dir(worker_base)
    write_node_config(folder, {P.NODE_PARTITION_DIR: str(tmp_path / "none")})
    log = tmp_path / "worker.log"
    with log.open("w") as err:
        worker = subprocess.Popen(
            [sys.executable, "-m", "clients.worker", str(folder)],
            cwd=Path(__file__).resolve().parents[2],
            stderr=err,
        )
    try:
        deadline = time.monotonic() + IMPORT_BOUND_S
        while "ahead of the runs" not in log.read_text():
            assert worker.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
    finally:
        worker.kill()
        worker.wait(timeout=10)
    # Its own lines only: torch or PyG may warn on stderr in between.
    lines = [line for line in log.read_text().splitlines() if line.startswith("node worker")]
    assert "listening on" in lines[0], lines
    assert lines[1].startswith("node worker: imported torch_geometric.nn ahead of the runs in "), lines


def test_a_module_that_fails_to_import_ahead_is_said_and_left_to_the_message_that_needs_it(capsys):
    IMPORTED_AHEAD.clear()
    warm_imports(("json", "retexo_fl.no_such_module"))
    assert IMPORTED_AHEAD.is_set()  # requests waiting for the imports go on, also after a failure
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("node worker: imported json ahead of the runs in ")
    assert lines[1] == (
        "node worker: importing retexo_fl.no_such_module ahead of the runs failed: "
        "ModuleNotFoundError: No module named 'retexo_fl.no_such_module'"
    )


def test_requests_wait_for_the_imports_ahead(monkeypatch):
    """A request is answered only once the imports ahead have ended, never beside them."""
    answered = threading.Event()

    def handle(header: dict, content: Any, node_config: dict) -> tuple[dict, Any]:
        answered.set()
        return {"ok": True}, None

    monkeypatch.setattr(worker_module, "handle_request", handle)
    ours, theirs = socket.socketpair()
    slot = threading.BoundedSemaphore(1)
    slot.acquire()  # as serve() does before it accepts
    request = worker_module.Request(ours, slot)
    request.content = RecordDict({})
    IMPORTED_AHEAD.clear()
    try:
        answering = threading.Thread(target=worker_module.answer_request, args=(request, {}), daemon=True)
        answering.start()
        assert not answered.wait(0.5), "answered while the imports ahead were running"
    finally:
        IMPORTED_AHEAD.set()
    assert answered.wait(10)
    answering.join(10)
    assert not answering.is_alive() and slot.acquire(blocking=False)  # answered and given back
    theirs.close()
