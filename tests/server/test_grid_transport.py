"""The Grid transport waiting for its SuperNodes: it says so, and names what to do when it gives up."""

from __future__ import annotations

import pytest

from retexo_fl.coordinator.transport import ClientFailure
from server import grid_transport
from server.grid_transport import GridTransport


class _Grid:
    def __init__(self, nodes: list[int]) -> None:
        self.nodes = nodes

    def get_node_ids(self) -> list[int]:
        return self.nodes


def test_a_run_short_of_supernodes_reports_the_wait_then_names_the_remedy(monkeypatch):
    lines: list[str] = []
    monkeypatch.setattr(grid_transport, "log", lambda level, fmt, *args: lines.append(fmt % args))
    monkeypatch.setattr(grid_transport, "WAIT_REPORT_S", 0.0)
    with pytest.raises(ClientFailure, match=r"only 2 of 3 clients connected within client-timeout 1s: start"):
        GridTransport(_Grid([5, 9]), timeout=1.0).connect(3)
    assert lines and all(line.startswith("waiting for clients: 2 of 3 connected") for line in lines)


def test_enough_supernodes_connect_at_once_in_node_order():
    assert GridTransport(_Grid([9, 5, 7]), timeout=1.0).connect(2) == [5, 7]
