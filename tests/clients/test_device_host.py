"""``retexo-fl devices``: which devices a host holds, what it refuses to start with, and how a
device's loop ends. The whole host against a real SuperLink is in tests/test_deployment.py."""

from __future__ import annotations

import contextlib
import threading

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
    assert specs[0].node_config == {
        P.NODE_PARTITION_DIR: str(parts / "part-10"),
        P.NODE_WORK_DIR: str(tmp_path / "work"),
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
    """A Fleet connection that has no message for ``empty`` pulls, then fails."""

    def __init__(self, empty: int) -> None:
        self.pulls, self.empty, self.waits = 0, empty, []

    def receive(self):
        self.pulls += 1
        if self.pulls > self.empty:
            raise ConnectionError("the SuperLink went away")
        return None

    @contextlib.contextmanager
    def open(self, spec: DeviceSpec):
        unused = lambda *a: pytest.fail("nothing was pulled")  # noqa: E731
        yield (7, self.receive, unused, unused, unused, unused, unused, unused)


def test_an_idle_device_backs_off_and_a_failure_names_the_device(monkeypatch):
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


def test_a_device_that_cannot_connect_ends_alone():
    def refuse(spec: DeviceSpec):
        raise SystemExit(1)  # what Flower's flwr_exit raises when a node cannot register

    specs = [DeviceSpec("part-0", {}), DeviceSpec("part-1", {})]
    host = DeviceHost(specs, refuse, app=lambda m, c: m).start()
    for thread in host.threads:
        thread.join(10)
    assert host.failed() == ["part-0: SystemExit: 1", "part-1: SystemExit: 1"]
