"""Emulated wide-area links: each party in its own network namespace behind a rate-limited veth.

    from wan import EmulatedWan, wan_unavailable

    with EmulatedWan(parties=3, rate_mbit=5) as wan:
        fed = FederationProcesses(work, host=wan.host_address)   # the SuperLink's Fleet API binds here
        fed.start_supernode(i, part, netns=wan.netns(i))

Layout: one bridge in the launching namespace holding ``wan.host_address`` (10.213.N.1/24,
the first such /24 no interface has yet, so that networks can coexist), and per party a
namespace ``<prefix>-<i>`` whose veth is enslaved to the bridge. Each party's link is shaped
in both directions with a token bucket (``tc ... tbf``): the host end's egress is the party's
downlink, the namespace end's egress its uplink. Parties reach nothing but the bridge, so the
SuperLink's Fleet API needs to listen on that one address only. netem (delay, loss) is not
available on these machines, so links have a rate, not a latency. Everything made is removed
by :meth:`EmulatedWan.down` (also when ``up`` fails half way, and on leaving the ``with``
block). Needs root (``CAP_NET_ADMIN``) and iproute2.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

SUBNETS = "10.213"  # bridges take 10.213.N.0/24 for the first free N; party i is .(i + 2)


def _ip(*args: str, netns: str | None = None) -> None:
    argv = ["ip", *(["-n", netns] if netns else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise WanError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")


def _tc(dev: str, rate_mbit: float, netns: str | None = None) -> None:
    # A bucket of 10 ms of traffic (at least 32 kB) keeps tbf from under-shooting the rate at
    # high rates; 400 ms of queue keeps it from dropping a TCP window's worth at low ones.
    burst = max(32_000, int(rate_mbit * 1e6 / 8 / 100))
    argv = [
        "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
        "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "400ms",
    ]  # fmt: skip
    if netns:
        argv = ["ip", "netns", "exec", netns, *argv]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise WanError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")


class WanError(RuntimeError):
    """The emulated network could not be made (or removed)."""


def wan_unavailable() -> str | None:
    """Why links cannot be emulated on this machine, or None when they can."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces and tc need root (CAP_NET_ADMIN)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"rflprobe{os.getpid() % 100000}"
    try:
        _ip("netns", "add", probe)
    except WanError as exc:
        return str(exc)
    try:
        _ip("link", "set", "lo", "up", netns=probe)
        _tc("lo", 10, netns=probe)
    except WanError as exc:
        return str(exc)
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def free_subnet() -> str:
    """The first ``10.213.N`` with no address on any interface of this namespace."""
    listed = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True).stdout
    for n in range(256):
        if f" {SUBNETS}.{n}." not in listed:
            return f"{SUBNETS}.{n}"
    raise WanError(f"every {SUBNETS}.N.0/24 is taken")


@dataclass(frozen=True)
class PartyLink:
    """One party's namespace and the address it has there."""

    party: int
    netns: str
    address: str


class EmulatedWan:
    """Namespaces, veths, a bridge and token-bucket shaping for ``parties`` parties.

    Args:
        parties: how many party namespaces to make.
        rate_mbit: each party's downlink rate in Mbit/s.
        uplink_mbit: each party's uplink rate (default: ``rate_mbit``).
        prefix: namespace / interface name prefix (default ``rfl<pid>``: unique per process).
    """

    def __init__(
        self, parties: int, rate_mbit: float, *, uplink_mbit: float | None = None, prefix: str = ""
    ) -> None:
        if parties < 1 or parties > 200:
            raise ValueError(f"parties must be in 1..200, got {parties}")
        if rate_mbit <= 0 or (uplink_mbit is not None and uplink_mbit <= 0):
            raise ValueError("link rates must be positive Mbit/s")
        self.parties = parties
        self.rate_mbit = rate_mbit
        self.uplink_mbit = uplink_mbit or rate_mbit
        # Interface names are at most 15 bytes: prefix + "h" + party number must fit.
        self.prefix = prefix or f"rfl{os.getpid() % 100000}"
        if len(self.prefix) > 10:
            raise ValueError(f"prefix {self.prefix!r} is longer than 10 characters")
        self.bridge = f"{self.prefix}br"
        self.host_address = ""  # set by up()
        self.links = [PartyLink(i, f"{self.prefix}-{i}", "") for i in range(parties)]
        self._made: list[tuple[str, str]] = []  # ("netns" | "link", name) in creation order

    def netns(self, party: int) -> str:
        return self.links[party].netns

    def up(self) -> EmulatedWan:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._made.append(("link", self.bridge))
            subnet = free_subnet()
            self.host_address = f"{subnet}.1"
            self.links = [PartyLink(k.party, k.netns, f"{subnet}.{k.party + 2}") for k in self.links]
            _ip("addr", "add", f"{self.host_address}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for link in self.links:
                host_if, node_if = f"{self.prefix}h{link.party}", f"{self.prefix}n{link.party}"
                _ip("netns", "add", link.netns)
                self._made.append(("netns", link.netns))
                _ip("link", "add", host_if, "type", "veth", "peer", "name", node_if)
                self._made.append(("link", host_if))
                _ip("link", "set", node_if, "netns", link.netns)
                _ip("link", "set", host_if, "master", self.bridge)
                _ip("link", "set", host_if, "up")
                _ip("addr", "add", f"{link.address}/24", "dev", node_if, netns=link.netns)
                _ip("link", "set", node_if, "up", netns=link.netns)
                _ip("link", "set", "lo", "up", netns=link.netns)
                _tc(host_if, self.rate_mbit)
                _tc(node_if, self.uplink_mbit, netns=link.netns)
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Remove everything :meth:`up` made (namespaces take their veth ends with them)."""
        for kind, name in reversed(self._made):
            argv = ["ip", "netns", "del", name] if kind == "netns" else ["ip", "link", "del", name]
            subprocess.run(argv, capture_output=True)
        self._made.clear()

    def __enter__(self) -> EmulatedWan:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    def exists(self) -> bool:
        """Whether any namespace of this network is still present."""
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        names = {line.split()[0] for line in listed.splitlines() if line.strip()}
        return any(link.netns in names for link in self.links)
