"""``retexo-fl devices``: which devices a host holds, what it refuses to start with, and how a
device's loop ends. The whole host against a real SuperLink is in tests/test_deployment.py."""

from __future__ import annotations

import contextlib
import re
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from clients.device_host import (
    MIN_POLL_S,
    DeviceHost,
    DeviceHostError,
    DeviceSpec,
    device_specs,
    main,
    parse_ids,
)
from retexo_fl import protocol as P
from retexo_fl.cli import main as cli


def test_ids_are_a_comma_list_of_ids_and_ranges():
    assert parse_ids("0-3,7, 9") == [0, 1, 2, 3, 7, 9]
    for bad in ("a", "3-", "-3", "1-b"):
        with pytest.raises(DeviceHostError, match="is not an id or an a-b range"):
            parse_ids(bad)


@pytest.fixture
def parts(tmp_path):
    out = tmp_path / "parts"
    argv = ["partition", "--dataset", "sbm:12,2,3,0.8", "--clients", "12", "--method", "node"]
    assert cli([*argv, "--out", str(out)]) == 0
    return out


def test_each_device_gets_its_folder_its_own_key_and_the_pins(parts, tmp_path):
    specs = device_specs(parts, [10, 2], tmp_path / "work", tmp_path / "keys")
    assert [s.name for s in specs] == ["part-10", "part-2"]
    assert specs[0].node_config == {  # its slot and folder are its own, whatever its node id
        P.NODE_PARTITION_DIR: str(parts / "part-10"),
        P.NODE_PARTITION_ID: 10,
        P.NODE_WORK_DIR: str(tmp_path / "work" / "part-10"),
        P.NODE_IDENTITY_KEY: str(tmp_path / "keys" / "client-10.key"),
        P.NODE_PINNED_KEYS: str(tmp_path / "keys" / "pins.json"),
    }
    every = device_specs(parts, None, tmp_path / "work", None)
    assert [s.name for s in every] == [f"part-{i}" for i in range(12)]  # part-10 after part-9
    assert all(P.NODE_IDENTITY_KEY not in s.node_config and s.auth_key is None for s in every)


def test_a_missing_folder_or_key_is_named(parts, tmp_path):
    with pytest.raises(DeviceHostError, match="no part-12 folder"):
        device_specs(parts, [0, 12], tmp_path, None)
    with pytest.raises(DeviceHostError, match=r"party-3: no SuperNode authentication key for part-3"):
        device_specs(parts, [3], tmp_path, None, tmp_path / "auth")
    with pytest.raises(DeviceHostError, match="no part-<id> folders"):
        device_specs(tmp_path / "work", None, tmp_path, None)
    with pytest.raises(DeviceHostError, match="a device named twice"):  # one key, two nodes
        device_specs(parts, parse_ids("0-2,1"), tmp_path, None)
    with pytest.raises(DeviceHostError, match="no device"):
        device_specs(parts, parse_ids(","), tmp_path, None)


def test_the_host_refuses_to_start_without_keys_or_with_unreadable_ones(parts, tmp_path, capsys):
    base = ["--superlink", "127.0.0.1:1", "--partitions", str(parts)]
    assert main([*base, "--insecure"]) == 2
    assert "no --keys" in capsys.readouterr().err
    assert main([*base, "--insecure-no-pinned-keys"]) == 2  # neither --insecure nor a CA
    assert "exactly one of --insecure and --root-certificates" in capsys.readouterr().err
    assert cli(["keys", "--clients", "12", "--out", str(tmp_path / "keys")]) == 0
    (tmp_path / "keys" / "client-4.key").write_text("not a key")
    assert main([*base, "--insecure", "--keys", str(tmp_path / "keys")]) == 2
    assert "part-4: " in capsys.readouterr().err


class _Conn:
    """A Fleet connection as Flower's: what its block raises is logged and swallowed. It yields
    ``messages`` (then nothing, ``empty`` times), then fails; ``get_run`` fails too."""

    def __init__(self, empty: int, messages: list | None = None, node_id: int = 7) -> None:
        self.pulls, self.empty, self.messages, self.node_id = 0, empty, list(messages or []), node_id

    def receive(self):
        if self.messages:
            return self.messages.pop(0), None
        self.pulls += 1
        if self.pulls > self.empty:
            raise ConnectionError("the SuperLink went away")
        return None

    def get_run(self, run_id: int):
        raise RuntimeError(f"run {run_id} unknown")

    @contextlib.contextmanager
    def open(self, spec: DeviceSpec):
        unused = lambda *a: pytest.fail("nothing was pulled")  # noqa: E731
        # flwr/client/grpc_rere_client/connection.py logs what its block raises, and returns
        with contextlib.suppress(Exception):
            yield (self.node_id, self.receive, unused, self.get_run, unused, unused, unused, unused)


def _message(kind: str, run_id: int) -> SimpleNamespace:
    return SimpleNamespace(metadata=SimpleNamespace(run_id=run_id, message_type=kind))


def test_an_idle_device_backs_off_and_a_failed_connection_names_the_device(monkeypatch):
    conn = _Conn(empty=8)
    host = DeviceHost([DeviceSpec("part-5", {})], conn.open, max_poll=0.2, app=lambda m, c: m)
    waits: list[float] = []
    monkeypatch.setattr(threading.Event, "wait", lambda self, t=None: waits.append(t))
    host.devices[0].run()  # on this thread: the loop ends when the connection fails
    assert waits == [MIN_POLL_S, 0.1, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2]
    assert host.devices[0].node_id == 7
    assert host.failed() == ["part-5: ConnectionError: the SuperLink went away"]
    # 300 idle devices within 100 pulls a second: each backs off to 3 s, not 0.2.
    many = DeviceHost([DeviceSpec(f"part-{i}", {}) for i in range(300)], conn.open, 0.2, lambda m, c: m)
    assert {d.max_poll for d in many.devices} == {3.0}
    with pytest.raises(DeviceHostError, match="are positive"):
        DeviceHost([DeviceSpec("part-0", {})], conn.open, 0.2, lambda m, c: m, polls_per_s=0)


def test_a_message_that_fails_is_logged_and_the_device_goes_on(monkeypatch, capsys):
    conn = _Conn(empty=2, messages=[_message("train", 5)])
    host = DeviceHost([DeviceSpec("part-3", {})], conn.open, app=lambda m, c: m)
    monkeypatch.setattr(threading.Event, "wait", lambda self, t=None: None)
    host.devices[0].run()
    assert "part-3: a train message of run 5 failed: RuntimeError: run 5 unknown" in capsys.readouterr().err
    assert conn.pulls == 3  # it pulled again after the failed message, until the connection failed
    assert host.failed() == ["part-3: ConnectionError: the SuperLink went away"]


def test_answers_wait_for_the_imports_ahead(tmp_path, monkeypatch, capsys):
    """The host imports PyG on its answering thread before it answers anything, as a node worker
    does: an answer queued meanwhile runs once the import is whole; a module that fails to import
    is named, and answering goes on."""
    (tmp_path / "slow_import_ahead.py").write_text("import time\ntime.sleep(0.5)\nWHOLE = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "slow_import_ahead", raising=False)
    seen: list[bool] = []

    def app(msg, context):
        seen.append(getattr(sys.modules.get("slow_import_ahead"), "WHOLE", False))
        return msg

    host = DeviceHost([DeviceSpec("part-0", {})], _Conn(empty=0).open, app=app)
    done = host.import_ahead(("slow_import_ahead", "retexo_fl.no_such_module"))
    msg = _message("train", 3)
    assert host._answer(msg, None)[0] is msg and seen == [True] and done.done()
    host._answering.shutdown()  # no device thread was started
    lines = capsys.readouterr().err.splitlines()
    took = r"retexo-fl devices: imported slow_import_ahead ahead of the runs in \d+\.\ds"
    assert re.fullmatch(took, lines[0])
    assert lines[1] == (
        "retexo-fl devices: importing retexo_fl.no_such_module ahead of the runs failed: "
        "ModuleNotFoundError: No module named 'retexo_fl.no_such_module'"
    )


def test_two_devices_given_one_node_id_are_refused():
    conn = _Conn(empty=10**6, node_id=11)
    specs = [DeviceSpec("part-0", {}), DeviceSpec("part-1", {})]
    host = DeviceHost(specs, conn.open, app=lambda m, c: m).start()
    deadline = time.monotonic() + 10
    while not host.failed() and time.monotonic() < deadline:
        time.sleep(0.01)
    host.close()
    assert host.failed() in (
        ["part-1: DeviceHostError: the SuperLink gave node id 11 to part-0 too"],
        ["part-0: DeviceHostError: the SuperLink gave node id 11 to part-1 too"],
    )


def test_a_device_that_cannot_connect_is_named():
    def refuse(spec: DeviceSpec):
        raise SystemExit(1)  # what Flower's flwr_exit raises when a node cannot register

    specs = [DeviceSpec("part-0", {}), DeviceSpec("part-1", {})]
    host = DeviceHost(specs, refuse, app=lambda m, c: m).start()
    for thread in host.threads:
        thread.join(10)
    assert host.failed() == ["part-0: SystemExit: 1", "part-1: SystemExit: 1"]


def test_flowers_connection_is_the_one_this_host_was_written_for():
    """The host opens each device's node with Flower's private ``_init_connection`` (the pinned
    range, flwr>=1.38,<1.40): another Flower must fail here, not in a deployment."""
    import inspect

    from flwr.client.grpc_rere_client import connection
    from flwr.supernode.start_client_internal import _init_connection

    params = set(inspect.signature(_init_connection).parameters)
    assert {"transport", "server_address", "insecure", "root_certificates", "authentication_keys"} <= params
    # What the host unpacks: node id, receive, then send, get_run, get_fab, pull, push, confirm.
    order = ["node_id", "receive", "send", "get_run", "get_fab", "pull_object", "push_object"]
    source = inspect.getsource(connection.grpc_request_response)
    yielded = source[source.index("yield (") : source.index(")", source.index("yield ("))]
    assert [w.strip() for w in yielded[len("yield (") :].split(",") if w.strip()] == [
        *order,
        "confirm_message_received",
    ]
