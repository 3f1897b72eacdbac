"""A federation on 127.0.0.1 where one SuperNode is Flower's plain ``flower-supernode`` (a
ClientApp process per message, about 8 s a round), which must keep working beside two
``retexo-fl supernode``s.

A module of its own: ``test_deployment.py``'s TLS federation is module-scoped, and its idle
SuperLink and SuperNodes (about half a core while they poll) slowed this run past its limit on
2 cores.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "deploy"))
sys.path.insert(0, str(ROOT / "tests"))  # the run and its in-process twin, as test_deployment.py has them

from federation import FederationProcesses  # noqa: E402
from test_deployment import RUN, _in_process  # noqa: E402

from clients.flower_patch import SUPEREXEC_POLL_ENV  # noqa: E402
from retexo_fl.cli import main as cli  # noqa: E402

pytestmark = pytest.mark.slow


def test_plain_flower_supernode_still_works_beside_retexo_supernodes(data_root, tmp_path):
    """One node on Flower's own SuperNode (a ClientApp process per message, no worker), two on
    `retexo-fl supernode`: the run equals the simulation's."""
    parts = tmp_path / "parts"
    argv = ["partition", "--dataset", "Cora", "--root", str(data_root), "--clients", "3", "--out", str(parts)]
    assert cli(argv) == 0
    # State in memory: the SQLite file made each round 2.5-3x as slow on 2 cores, and a plain
    # SuperNode's rounds are the slowest of the suite already.
    fed = FederationProcesses(tmp_path / "work", database=False)
    out = tmp_path / "run"
    try:
        fed.start_superlink()
        # Flower's own knob (an environment variable its SuperExec reads), not a patch: the plain
        # SuperNode's code runs as shipped, and a ClientApp launch waits 50 ms for its task, not 1 s.
        poll = dict([SUPEREXEC_POLL_ENV])
        for i in range(3):
            fed.start_supernode(i, parts / f"part-{i}", worker=i != 2, env=None if i != 2 else poll)
        # One round a stage: a plain SuperNode pays seconds for every message.
        one_round = RUN.replace("rounds='2'", "rounds='1'")
        record = fed.run(f"clients=3 out-dir='{out}' {one_round}", timeout=300)
    finally:
        fed.stop_all()
    assert record["status"] == "finished:completed"
    deployed = json.loads((out / "summary.json").read_text())
    in_process = _in_process(parts, rounds=1)
    assert deployed["test_accuracy"] == pytest.approx(in_process["test_accuracy"], abs=0.005)
    assert deployed["bytes_boundary"] == in_process["bytes_boundary"]
    assert "node worker" not in (fed.work / "supernode-2.log").read_text()
    for proc in fed.procs.values():
        assert proc.poll() is not None, "a federation process outlived the test"
