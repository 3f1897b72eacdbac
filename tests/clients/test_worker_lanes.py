"""The node worker serves runs side by side: one run's long message does not hold up another's.

:class:`~clients.worker.RunLanes` is tested on its own (jobs are plain values), the cache's hold
on plain stand-ins for a message, and then a real worker process over its real channel, its
answer replaced by one that blocks until the test lets it go.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from flwr.app import ConfigRecord, RecordDict

from clients import node_client
from clients import worker as node_worker
from clients.worker import RunLanes
from clients.worker_link import SOCKET_NAME, WorkerError, call, make_worker_dir, write_node_config
from retexo_fl import protocol as P

ROOT = Path(__file__).resolve().parents[2]


def _wait_for(done: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


class _Recorder:
    """A lane handler that records what it answers and blocks on jobs named ``slow...``."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.active: dict[int, int] = {}
        self.most_at_once: dict[int, int] = {}

    def __call__(self, job: tuple[int, str]) -> None:
        run, name = job
        with self.lock:
            self.events.append(f"start {name}")
            self.active[run] = self.active.get(run, 0) + 1
            self.most_at_once[run] = max(self.most_at_once.get(run, 0), self.active[run])
        if name.startswith("slow"):
            assert self.release.wait(10), "the test never released a slow job"
        with self.lock:
            self.active[run] -= 1
            self.events.append(f"end {name}")
        if name.startswith("fail"):
            raise RuntimeError("a job that raises")


def test_a_slow_run_does_not_delay_another_runs_job():
    rec = _Recorder()
    lanes: RunLanes[tuple[int, str]] = RunLanes(rec, max_runs=2, max_queued=2, idle_s=1)
    try:
        assert lanes.submit(1, (1, "slow-a")) is None
        _wait_for(lambda: "start slow-a" in rec.events, "run 1's job to start")
        assert lanes.submit(2, (2, "b")) is None
        _wait_for(lambda: "end b" in rec.events, "run 2's job, while run 1's is in progress", timeout=5)
        assert "end slow-a" not in rec.events
    finally:
        rec.release.set()
    _wait_for(lambda: "end slow-a" in rec.events, "run 1's job to end")


def test_a_runs_jobs_are_answered_one_at_a_time_in_order():
    rec = _Recorder()
    lanes: RunLanes[tuple[int, str]] = RunLanes(rec, max_runs=2, max_queued=8, idle_s=1)
    names = ["slow-0", *[f"job-{i}" for i in range(1, 8)]]
    try:
        for name in names:
            assert lanes.submit(1, (1, name)) is None
        _wait_for(lambda: "start slow-0" in rec.events, "the first job to start")
        time.sleep(0.1)
        assert rec.events == ["start slow-0"]  # the rest wait behind it, not beside it
    finally:
        rec.release.set()
    _wait_for(lambda: len(rec.events) == 2 * len(names), "every job to end")
    assert rec.events == [e for name in names for e in (f"start {name}", f"end {name}")]
    assert rec.most_at_once == {1: 1}


def test_over_the_bounds_a_request_is_refused_naming_its_run():
    rec = _Recorder()
    lanes: RunLanes[tuple[int, str]] = RunLanes(rec, max_runs=2, max_queued=1, idle_s=1)
    try:
        assert lanes.submit(1, (1, "slow-a")) is None
        assert lanes.submit(2, (2, "slow-b")) is None
        _wait_for(lambda: {"start slow-a", "start slow-b"} <= set(rec.events), "both runs to start")
        refused = lanes.submit(3, (3, "c"))
        assert refused is not None and refused.startswith("run 3: refused")
        assert "2 other runs, at most 2 at once" in refused and "\n" not in refused
        assert lanes.submit(1, (1, "a2")) is None  # queued behind slow-a
        refused = lanes.submit(1, (1, "a3"))
        assert refused is not None and refused.startswith("run 1: refused")
        assert "1 of its messages already wait" in refused and "at most 1" in refused
        assert sorted(lanes.runs()) == [1, 2]
    finally:
        rec.release.set()
    _wait_for(lambda: "end a2" in rec.events, "run 1's queued job")
    assert "start c" not in rec.events and "start a3" not in rec.events


def test_idle_lanes_end_and_give_their_place_to_a_new_run():
    rec = _Recorder()
    ended: list[int] = []
    lanes: RunLanes[tuple[int, str]] = RunLanes(rec, max_runs=1, max_queued=1, idle_s=30, on_end=ended.append)
    assert lanes.submit(101, (101, "a")) is None
    _wait_for(lambda: "end a" in rec.events, "run 101's job")
    # Run 101 has nothing to do: a new run takes its place rather than being refused.
    assert lanes.submit(102, (102, "b")) is None
    _wait_for(lambda: "end b" in rec.events, "run 102's job")
    assert lanes.runs() == [102] and ended == [101]  # run 101's clients leave the worker's cache
    _wait_for(lambda: "run-101" not in {t.name for t in threading.enumerate()}, "run 101's thread to end")

    quick: RunLanes[tuple[int, str]] = RunLanes(
        rec, max_runs=1, max_queued=1, idle_s=0.2, on_end=ended.append
    )
    assert quick.submit(107, (107, "g")) is None
    _wait_for(lambda: quick.runs() == [], "an idle lane to end by itself")
    assert ended == [101, 107]
    _wait_for(lambda: "run-107" not in {t.name for t in threading.enumerate()}, "run 107's thread to end")
    assert quick.submit(107, (107, "h")) is None  # its run's next job starts a new lane
    _wait_for(lambda: "end h" in rec.events, "run 107's next job")


def test_a_job_that_raises_ends_only_itself():
    rec = _Recorder()
    lanes: RunLanes[tuple[int, str]] = RunLanes(rec, max_runs=1, max_queued=2, idle_s=1)
    assert lanes.submit(1, (1, "fail-a")) is None
    assert lanes.submit(1, (1, "b")) is None
    _wait_for(lambda: "end b" in rec.events, "the job after a failing one")


# -- the client cache: held clients ----------------------------------------------------------------
@dataclass
class _Metadata:
    message_type: str = P.TRAIN
    run_id: int = 1


@dataclass
class _Message:
    """What :func:`clients.node.cache_key` reads of a message."""

    content: dict
    metadata: _Metadata = field(default_factory=_Metadata)


@dataclass
class _Context:
    node_config: dict = field(default_factory=dict)
    node_id: int = 5


def _msg(run_key: int) -> _Message:
    return _Message({P.CONFIG: {P.RUN_KEY: run_key}})


@pytest.fixture
def cache(monkeypatch) -> Iterator[dict]:
    """The client cache, empty, with one run kept (a process that is not a node worker)."""
    monkeypatch.setattr(node_client, "_CACHE", {})
    monkeypatch.setattr(node_client, "_CURRENT", {})
    monkeypatch.setattr(node_client, "_RUN_SIZES", {})
    monkeypatch.setattr(node_client, "CACHED_RUNS", 1)
    yield node_client._CACHE


def _fill(clients: dict) -> None:
    with node_client._LOCK:
        for key, client in clients.items():
            node_client._cache(key, client, None)


def test_a_held_client_is_not_dropped_when_another_run_builds_one(cache):
    _fill({(1, "5"): "client-1", (2, "5"): "client-2", (3, "5"): "client-3"})
    with node_client.holding(_msg(1), _Context()) as key:  # type: ignore[arg-type]
        assert key == (1, "5")
        with node_client._LOCK:
            node_client._drop_old_runs(3)
        assert list(cache) == [(1, "5"), (3, "5")]  # run 1 is being answered: it stays
        node_client.forget([1])
        assert list(cache) == [(1, "5"), (3, "5")]
    with node_client._LOCK:
        node_client._drop_old_runs(3)
    assert list(cache) == [(3, "5")]
    node_client.forget([3])  # its run's lane ended
    assert cache == {} and node_client._HELD == {}


def test_a_run_whose_lane_ended_leaves_the_cache(cache, monkeypatch):
    monkeypatch.setattr(node_worker, "_RUN_KEYS", {})
    for run_key in range(10):  # a server that names a new run key every message
        node_worker._note_run_key(5, run_key)
    assert list(node_worker._RUN_KEYS[5]) == [6, 7, 8, 9]  # bounded: MAX_RUNS, most recent
    _fill({(9, "5"): "client-9", (2, "5"): "client-2", (42, "5"): "other run's"})
    node_worker.forget_run(5)
    assert list(cache) == [(2, "5"), (42, "5")] and node_worker._RUN_KEYS == {}


def test_one_client_is_held_by_one_thread_at_a_time(cache):
    inside: list[str] = []
    first_in = threading.Event()

    def hold(name: str, run_key: int) -> None:
        with node_client.holding(_msg(run_key), _Context()):  # type: ignore[arg-type]
            inside.append(f"in {name}")
            first_in.set()
            time.sleep(0.3)
            inside.append(f"out {name}")

    first = threading.Thread(target=hold, args=("a", 1))
    first.start()
    assert first_in.wait(5)
    same = threading.Thread(target=hold, args=("b", 1))  # another run naming run key 1
    other = threading.Thread(target=hold, args=("c", 2))
    same.start()
    other.start()
    for t in (first, same, other):
        t.join(timeout=10)
        assert not t.is_alive()
    assert inside.index("out a") < inside.index("in b")  # run key 1: one at a time
    assert inside.index("in c") < inside.index("out a")  # run key 2: beside it
    assert node_client._HELD == {}


# -- a real worker process, its answer replaced --------------------------------------------------
#: The worker, with its answer replaced by one that logs and, for a message id ``slow...``, blocks
#: until the test writes ``release-<message id>`` (30 s at most). Only two runs at once.
WORKER = r"""
import sys, time
from pathlib import Path
from flwr.app import ConfigRecord, RecordDict
import clients.worker as worker

folder, logs, parent = sys.argv[1], Path(sys.argv[2]), sys.argv[3]

def answer(msg, context):
    mid = msg.metadata.message_id
    with open(logs / "log", "a") as f:
        f.write(f"start {mid}\n")
    if mid.startswith("slow"):
        deadline = time.monotonic() + 30
        while not (logs / f"release-{mid}").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    with open(logs / "log", "a") as f:
        f.write(f"end {mid}\n")
    return RecordDict({"reply": ConfigRecord({"message": mid})})

worker.answer = answer
worker.MAX_RUNS = 2
sys.exit(worker.main([folder, "--parent-pid", parent]))
"""


@dataclass
class _Worker:
    folder: Path
    logs: Path

    def events(self) -> list[str]:
        path = self.logs / "log"
        return path.read_text().splitlines() if path.exists() else []

    def release(self, message_id: str) -> None:
        (self.logs / f"release-{message_id}").touch()


@pytest.fixture(scope="module")
def worker(tmp_path_factory, module_worker_base) -> Iterator[_Worker]:
    tmp = tmp_path_factory.mktemp("lanes")
    folder, logs = make_worker_dir(module_worker_base), tmp / "logs"
    logs.mkdir()
    write_node_config(folder, {P.NODE_WORK_DIR: str(tmp / "work")})
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    command = [sys.executable, "-c", WORKER, str(folder), str(logs), str(os.getpid())]
    proc = subprocess.Popen(command, cwd=ROOT, env=env)
    try:
        _wait_for(
            lambda: (folder / SOCKET_NAME).exists() or proc.poll() is not None, "the worker", timeout=120
        )
        assert proc.poll() is None, "the worker exited"
        yield _Worker(folder, logs)
    finally:
        proc.kill()  # by its process id
        proc.wait(timeout=30)


class _Call(threading.Thread):
    """One request through the channel, as a ClientApp shim sends it, on a thread of its own."""

    def __init__(self, folder: Path, run: int, message_id: str) -> None:
        super().__init__(daemon=True)
        self.folder, self.run_id, self.message_id = folder, run, message_id
        self.reply: dict | None = None
        self.error: Exception | None = None

    def run(self) -> None:
        header = {"type": P.TRAIN, "run_id": self.run_id, "message_id": self.message_id, "node_id": 1}
        content = RecordDict({P.CONFIG: ConfigRecord({P.RUN_KEY: self.run_id})})
        try:
            _, reply = call(self.folder, header, content, wait=30)
            self.reply = None if reply is None else dict(reply["reply"])
        except Exception as exc:
            self.error = exc

    def result(self, timeout: float = 40) -> dict:
        self.join(timeout)
        assert not self.is_alive(), f"{self.message_id} (run {self.run_id}): no reply in {timeout}s"
        if self.error is not None:
            raise self.error
        assert self.reply is not None
        return self.reply


@pytest.mark.slow  # a worker process that imports torch
def test_a_workers_slow_run_does_not_delay_another_and_keeps_its_order(worker):
    slow = _Call(worker.folder, 1, "slow-a1")
    slow.start()
    try:
        _wait_for(lambda: "start slow-a1" in worker.events(), "run 1's slow message to start")
        queued = _Call(worker.folder, 1, "a2")  # run 1's next message waits behind its first
        queued.start()
        other = _Call(worker.folder, 2, "b1")
        other.start()
        assert other.result(timeout=15) == {"message": "b1"}  # today: 30 s behind run 1's message
        assert slow.is_alive() and "end slow-a1" not in worker.events()
        assert "start a2" not in worker.events()
    finally:
        worker.release("slow-a1")
    assert slow.result() == {"message": "slow-a1"}
    assert queued.result() == {"message": "a2"}
    run1 = [e for e in worker.events() if e.endswith(("a1", "a2"))]
    assert run1 == ["start slow-a1", "end slow-a1", "start a2", "end a2"]


@pytest.mark.slow  # a worker process that imports torch
def test_a_worker_refuses_a_run_over_the_bound_naming_it(worker):
    busy = [_Call(worker.folder, run, f"slow-{run}") for run in (11, 12)]
    for c in busy:
        c.start()
    try:
        _wait_for(lambda: {"start slow-11", "start slow-12"} <= set(worker.events()), "two runs at once")
        refused = _Call(worker.folder, 13, "c")
        refused.start()
        with pytest.raises(WorkerError, match=r"^run 13: refused: .*at most 2 at once") as err:
            refused.result(timeout=15)
        assert "\n" not in str(err.value)
    finally:
        for c in busy:
            worker.release(c.message_id)
    for c in busy:
        assert c.result() == {"message": c.message_id}
    assert "start c" not in worker.events()


def test_a_cached_client_is_current_only_at_the_version_its_context_names(cache, monkeypatch):
    from flwr.app import Context, RecordDict

    context = Context(run_id=1, node_id=5, node_config={}, state=RecordDict(), run_config={})
    key = (1, "5")
    assert node_client.state_version(context) is None
    assert not node_client.holds_current(key, None)  # not cached: loaded
    node_client._CURRENT[key] = None  # loaded before any save named a version
    assert not node_client.holds_current(key, None)  # an unnamed state may be anyone's: loaded
    node_client.saved(context, key)  # this process saved it: a new version, in the context too
    version = node_client.state_version(context)
    assert version is not None and node_client.holds_current(key, version)
    # Another actor answered the node's next message and saved: its version differs, so this
    # process's client is stale and is loaded again.
    other = Context(run_id=1, node_id=5, node_config={}, state=RecordDict(), run_config={})
    node_client.saved(other, (9, "9"))
    assert not node_client.holds_current(key, node_client.state_version(other))
    monkeypatch.setattr(node_client, "SOLE_WRITER", True)  # the node worker: its cache is the truth
    assert node_client.holds_current(key, None)
