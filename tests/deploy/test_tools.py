"""Flower's executables are found beside the running interpreter (a virtual environment used
without activating it), and a missing one is named (deploy/federation.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from deploy.federation import FederationProcesses, require_tool, tool_path


def test_the_interpreters_folder_comes_first_once():
    here = str(Path(sys.executable).parent)
    path = tool_path(os.pathsep.join(["/nowhere", here, "/usr/bin"]))
    assert path.split(os.pathsep) == [here, "/nowhere", "/usr/bin"]


def test_flower_is_found_with_an_empty_path(tmp_path):
    """As with `.venv/bin/python -m pytest` and no activated venv: PATH holds none of it."""
    for tool in ("flower-superlink", "flower-supernode", "flwr", "retexo-fl"):
        require_tool(tool, tool_path(""))
    fed = FederationProcesses(tmp_path / "fed")
    assert fed.env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)


def test_a_missing_tool_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"flower-nothing is not beside .* nor on PATH"):
        require_tool("flower-nothing", tool_path(""))
    fed = FederationProcesses(tmp_path / "fed")
    with pytest.raises(FileNotFoundError, match="flower-nothing"):
        fed.start("x", ["ip", "netns", "exec", "ns0", "flower-nothing", "--help"])
    assert fed.procs == {}


def test_a_hosts_ids_travel_as_ranges_that_read_back_the_same():
    from clients.device_host import parse_ids
    from deploy.federation import id_ranges

    assert id_ranges(list(range(1000))) == "0-999"
    for ids in ([0, 1, 2, 5, 7, 8], [3], [0, 2, 4], [9, 10, 11, 12, 20]):
        assert parse_ids(id_ranges(ids)) == ids


def test_stop_all_stops_what_a_process_started_in_a_session_of_its_own(tmp_path):
    """As the SuperLink's SuperExec and the ServerApp it starts: outside the SuperLink's group."""
    import time

    from deploy.federation import descendants

    fed = FederationProcesses(tmp_path / "fed")
    proc = fed.start("parent", ["bash", "-c", "setsid sleep 60 & sleep 60"])
    deadline = time.monotonic() + 10
    while len(descendants({proc.pid})) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    children = descendants({proc.pid})
    assert len(children) == 2  # the group's own sleep, and the one in a new session
    fed.stop_all()

    def alive() -> list[int]:
        return [pid for pid in children if Path(f"/proc/{pid}").exists() and "Z" not in _state(pid)]

    deadline = time.monotonic() + 10  # a killed process on a loaded machine takes a while to go
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert alive() == []


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def test_a_deployed_run_records_the_cut_its_parties_hold(tmp_path):
    """The server reads no partition: its run config recorded the app's defaults (Cora, its
    public split, METIS) for any cut. The cut's own settings are added where not given."""
    import tomllib

    from deploy.federation import cut_config
    from retexo_fl.cli import main

    parts = tmp_path / "parts"
    argv = ["partition", "--dataset", "sbm:200,3", "--clients", "2", "--method", "random"]
    assert main([*argv, "--split", "random:0.5,0.25,0.25", "--out", str(parts)]) == 0
    pairs = cut_config(parts, "stages=2 rounds='3'")
    read = tomllib.loads("\n".join(pairs.split(" ")))
    assert read["split"] == "random:0.5,0.25,0.25" and read["method"] == "random"
    assert read["split-index"] == 0 and read["dataset"]
    # What the run config sets stays its own.
    assert "split=" not in cut_config(parts, "split='random:0.6,0.2,0.2' stages=2")
    assert cut_config(tmp_path / "nothing", "") == ""
