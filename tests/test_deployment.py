"""A real federation on 127.0.0.1: SuperLink with TLS and SuperNode authentication, 3 SuperNodes.

Started with ``deploy/federation.py`` (the launcher users run), each process stopped by process
id at the end. One federation serves both tests: it is the slow part (about 1.5 s to start, then
about 8 s per deployed round, dominated by Flower's fixed polls and per-message ClientApp
processes).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "deploy"))

from federation import Federation  # noqa: E402
from make_certs import main as make_certs  # noqa: E402

from retexo_fl.cli import main as cli  # noqa: E402
from retexo_fl.config import TrainConfig  # noqa: E402
from server.checkpoint import FileCheckpoints  # noqa: E402

pytestmark = pytest.mark.slow
RUN = "stages=2 rounds='3' hidden=16 seed=1"


@pytest.fixture(scope="module")
def federation(data_root, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("federation")
    parts = tmp / "parts"
    argv = ["partition", "--dataset", "Cora", "--root", str(data_root), "--clients", "3", "--out", str(parts)]
    assert cli(argv) == 0
    certs = tmp / "certs"
    make_certs(["--out", str(certs), "--parties", "4"])  # party-3 is never registered
    fed = Federation(tmp / "work", tls=certs)
    try:
        fed.start_superlink()
        for i in range(3):
            fed.register(i)
            fed.start_supernode(i, parts / f"part-{i}")
        yield fed, parts, tmp
    finally:
        fed.stop_all()
        for proc in fed.procs.values():
            assert proc.poll() is not None, "a federation process outlived the test"


def test_unregistered_supernode_is_refused(federation):
    fed, parts, _ = federation
    proc = fed.start_supernode(9, parts / "part-0", key_party=3)
    assert proc.wait(timeout=90) != 0
    assert "Exit Code: 305" in (fed.work / "supernode-9.log").read_text()


def test_deployed_run_matches_simulation(federation):
    from server.simulation import simulate

    fed, parts, tmp = federation
    out = tmp / "deployed"
    t0 = time.time()
    record = fed.run(f"clients=3 out-dir='{out}' {RUN}", timeout=240)
    assert record["status"] == "finished:completed"
    deployed = json.loads((out / "summary.json").read_text())
    assert deployed["engine"] == "flower" and time.time() - t0 < 240
    settings = {"partitions": str(parts), "clients": 3, "stages": 2, "rounds": 3, "hidden": 16, "seed": 1}
    simulated = simulate(TrainConfig(**settings))
    assert deployed["test_accuracy"] == pytest.approx(simulated["test_accuracy"], abs=0.005)
    assert deployed["bytes_boundary"] == simulated["bytes_boundary"]


def test_supernode_killed_mid_stage_ends_as_the_policy_says(federation):
    fed, _, tmp = federation
    out = tmp / "killed"
    policy = "min-clients=2 on-missing-halo='zero' client-timeout=120.0"
    done = fed.flwr(
        "run",
        ".",
        "local-fed",
        "--format",
        "json",
        "--run-config",
        f"clients=3 out-dir='{out}' {RUN} {policy}",
    )
    run_id = json.loads(done.stdout)["run-id"]
    deadline = time.monotonic() + 200
    while time.monotonic() < deadline:  # wait for stage 1, then kill client 2's SuperNode
        try:
            ck = FileCheckpoints(str(out)).load()
            if ck.stage == 1 and ck.round_state is not None and ck.round_state.round > 0:
                break
        except Exception:  # not written yet, or being replaced
            pass
        time.sleep(0.5)
    else:
        pytest.fail("the run did not reach stage 1")
    os.killpg(fed.procs["supernode-2"].pid, signal.SIGKILL)
    killed = time.monotonic()
    while time.monotonic() < killed + 240:
        ls = fed.flwr("ls", "local-fed", "--run-id", str(run_id), "--format", "json")
        if json.loads(ls.stdout)["runs"][0]["status"].startswith("finished"):
            break
        time.sleep(2)
    summary = json.loads((out / "summary.json").read_text())
    assert [c["client"] for c in summary["lost_clients"]] == [2]
    assert summary["lost_clients"][0]["phase"].startswith("stage 1")
    assert time.monotonic() - killed < 240  # the policy's time-out, not a hang
