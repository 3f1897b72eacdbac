"""Emulated WAN links (deploy/wan.py): rates hold, everything made is removed, a federation runs over them.

Skipped, with the reason, where the machine does not allow network namespaces and tc (not root,
no iproute2). Addresses are the emulated networks' own (10.213.N.0/24 on bridges the tests make).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "deploy"))

from federation import FederationProcesses  # noqa: E402
from wan import EmulatedWan, WanError, wan_unavailable  # noqa: E402

from retexo_fl.cli import main as cli  # noqa: E402

REASON = wan_unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"cannot emulate WAN links: {REASON}")

SENDER = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
s.sendall(b"x" * int(sys.argv[3]))
s.close()
"""
READER = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
n = len(s.recv(65536))
t = time.perf_counter()  # from the first byte: the connection set-up is not the link's rate
while chunk := s.recv(65536):
    n += len(chunk)
print(n, n * 8 / (time.perf_counter() - t) / 1e6)
"""


def _receive_all(conn: socket.socket) -> int:
    n = 0
    while chunk := conn.recv(65536):
        n += len(chunk)
    return n


def uplink_mbit(wan: EmulatedWan, nbytes: int) -> float:
    """Party 0 sends ``nbytes`` to the host address; the measured rate in Mbit/s."""
    in_party = ["ip", "netns", "exec", wan.netns(0), sys.executable]
    with socket.create_server((wan.host_address, 0)) as srv:
        port = srv.getsockname()[1]
        sender = subprocess.Popen([*in_party, "-c", SENDER, wan.host_address, str(port), str(nbytes)])
        srv.settimeout(30)
        conn, _ = srv.accept()
        t0 = time.perf_counter()
        with conn:
            got = _receive_all(conn)
        seconds = time.perf_counter() - t0
        assert sender.wait(timeout=30) == 0
    assert got == nbytes
    return got * 8 / seconds / 1e6


def downlink_mbit(wan: EmulatedWan, nbytes: int) -> float:
    """The host sends ``nbytes`` to party 0, which measures the rate it reads at, in Mbit/s."""
    in_party = ["ip", "netns", "exec", wan.netns(0), sys.executable]
    with socket.create_server((wan.host_address, 0)) as srv:
        port = srv.getsockname()[1]
        reader = subprocess.Popen(
            [*in_party, "-c", READER, wan.host_address, str(port)],
            stdout=subprocess.PIPE,
            text=True,
        )
        srv.settimeout(30)
        conn, _ = srv.accept()
        with conn:
            conn.sendall(b"x" * nbytes)
        got, rate = reader.communicate(timeout=60)[0].split()
    assert int(got) == nbytes
    return float(rate)


def _shaped_rate(dev: str, netns: str | None = None) -> str:
    """The rate of ``dev``'s token bucket, as ``tc`` reports it (``"2Mbit"``)."""
    inside = ["ip", "netns", "exec", netns] if netns else []
    argv = [*inside, "tc", "qdisc", "show", "dev", dev]
    shown = subprocess.run(argv, capture_output=True, text=True).stdout
    match = re.search(r"\btbf\b.*?\brate (\S+)", shown)
    assert match, f"no token bucket on {dev}: {shown!r}"
    return match.group(1)


def test_each_direction_has_its_own_rate():
    """The host end shapes the party's downlink, the party's end its uplink. Measured transfer
    rates (1.4-2.4 Mbit/s up, 5.6-9.6 down on these links) belong to bench/wan_compare.py; this
    checks the shaping itself, and that bytes flow."""
    with EmulatedWan(1, rate_mbit=8, uplink_mbit=2, prefix="rfltr") as wan:
        assert _shaped_rate("rfltrh0") == "8Mbit"
        assert _shaped_rate("rfltrn0", netns=wan.netns(0)) == "2Mbit"
        assert uplink_mbit(wan, 20_000) > 0 and downlink_mbit(wan, 20_000) > 0


def _netns_names() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


def test_everything_made_is_removed_also_when_setup_fails():
    wan = EmulatedWan(2, rate_mbit=10, prefix="rfltw")
    with wan:
        assert {"rfltw-0", "rfltw-1"} <= _netns_names()
        clash = EmulatedWan(1, rate_mbit=10, prefix="rfltw")  # the same names: `ip` refuses
        with pytest.raises(WanError, match="rfltwbr"):
            clash.up()
        assert wan.exists(), "a failed second network removed the first one's namespaces"
        with EmulatedWan(1, rate_mbit=10, prefix="rfltv") as other:  # networks coexist
            assert other.host_address != wan.host_address
            assert uplink_mbit(other, 20_000) > 0
    assert not wan.exists()
    assert not {"rfltw-0", "rfltw-1"} & _netns_names()
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert "rfltw" not in links


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="parties"):
        EmulatedWan(0, rate_mbit=5)
    with pytest.raises(ValueError, match="rates"):
        EmulatedWan(2, rate_mbit=0)
    with pytest.raises(ValueError, match="prefix"):
        EmulatedWan(2, rate_mbit=5, prefix="a-very-long-prefix")


def in_other_netns(pid: int, timeout: float = 10.0) -> bool:
    """Whether ``pid`` has entered a network namespace other than ours (``ip netns exec`` does
    so just after it starts)."""
    ours = os.readlink("/proc/self/ns/net")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.readlink(f"/proc/{pid}/ns/net") != ours:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.slow
def test_federation_runs_with_each_supernode_behind_its_own_link(data_root, tmp_path):
    parts = tmp_path / "parts"
    argv = ["partition", "--dataset", "Cora", "--root", str(data_root), "--clients", "2", "--out", str(parts)]
    assert cli(argv) == 0
    out = tmp_path / "run"
    with EmulatedWan(2, rate_mbit=50) as wan:
        fed = FederationProcesses(tmp_path / "work", host=wan.host_address)
        try:
            fed.start_superlink()
            nodes = [fed.start_supernode(i, parts / f"part-{i}", netns=wan.netns(i)) for i in range(2)]
            for node in nodes:
                assert in_other_netns(node.pid), "a SuperNode is not in its own namespace"
            record = fed.run(f"clients=2 out-dir='{out}' stages=2 rounds='1' hidden=16", timeout=240)
        finally:
            fed.stop_all()
        for proc in fed.procs.values():
            assert proc.poll() is not None, "a federation process outlived the test"
    assert not wan.exists()
    assert record["status"] == "finished:completed", (fed.work / "superlink.log").read_text()[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["engine"] == "flower"
    assert summary["bytes_boundary"] > 0 and 0.0 < summary["test_accuracy"] <= 1.0
