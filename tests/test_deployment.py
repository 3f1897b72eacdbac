"""A real federation on 127.0.0.1: SuperLink with TLS and SuperNode authentication, 3 SuperNodes.

Started with ``deploy/federation.py`` (the launcher users run), each process stopped by process
id at the end. The SuperNodes are ``retexo-fl supernode``s (a node worker each, pinned keys, and a
consortium they trust to sign releases); a FAB whose ClientApp was replaced is refused before any
of it runs, and the same FAB signed by the consortium runs. A federation where one SuperNode is
Flower's plain ``flower-supernode`` is tested in ``test_deployment_plain.py``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "deploy"))

from federation import FederationProcesses  # noqa: E402
from make_certs import main as make_certs  # noqa: E402

from clients.approval import APP_PACKAGES, SIGNATURES_FILE, app_digest, sign_digest, tree_files  # noqa: E402
from clients.worker_link import SOCKET_NAME, proof, read_secret, recv_frame, send_frame  # noqa: E402
from retexo_fl.cli import main as cli  # noqa: E402
from retexo_fl.config import TrainConfig  # noqa: E402
from retexo_fl.metrics import RunRecorder  # noqa: E402
from retexo_fl.runner import train  # noqa: E402
from retexo_fl.secure.keys import write_identities  # noqa: E402
from server.checkpoint import FileCheckpoints  # noqa: E402

# One process runs the whole module (``--dist loadgroup``): its module-scoped federation and
# device host are built once, not once in each process that draws one of its tests.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("deployment")]
# Two rounds a stage: a round's messages, not its count, are what a deployment can get wrong.
RUN = "profile='exact' stages=2 rounds='2' hidden=16 seed=1"


@pytest.fixture(scope="module")
def federation(data_root, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("federation")
    parts = tmp / "parts"
    argv = ["partition", "--dataset", "Cora", "--root", str(data_root), "--clients", "3", "--out", str(parts)]
    assert cli(argv) == 0
    certs = tmp / "certs"
    make_certs(["--out", str(certs), "--parties", "4"])  # party-3 is never registered
    keys = write_identities(3, tmp / "keys")
    signer = ed25519.Ed25519PrivateKey.generate()
    public = signer.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    (tmp / "trusted.yaml").write_text(f"consortium: {public.decode()}\n")
    # The SuperLink keeps its state in memory: its SQLite file made every round 2.5-3x as slow
    # on 2 cores (the launcher's default store runs in test_wan.py).
    fed = FederationProcesses(tmp / "work", tls=certs, database=False)
    fed.signer = signer  # type: ignore[attr-defined]
    try:
        fed.start_superlink()
        for i in range(3):
            fed.register(i)
            fed.start_supernode(
                i, parts / f"part-{i}", keys=keys, extra=("--trusted-entities", str(tmp / "trusted.yaml"))
            )
        yield fed, parts, tmp
    finally:
        fed.stop_all()
        for proc in fed.procs.values():
            assert proc.poll() is not None, "a federation process outlived the test"


def _replaced_app(tmp: Path, name: str, marker: Path) -> Path:
    """A copy of the app whose ClientApp, once imported, writes ``marker``: what a coordinator
    would submit to read a party's data."""
    project = tmp / name
    for pkg in APP_PACKAGES:
        shutil.copytree(ROOT / pkg, project / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    for file in ("pyproject.toml", SIGNATURES_FILE):
        shutil.copy(ROOT / file, project / file)
    app = project / "clients" / "app.py"
    app.write_text(app.read_text() + f"\nimport pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n")
    return project


def _submit(fed, project: Path, out: Path, run: str = RUN) -> int:
    return fed.submit(f"clients=3 out-dir='{out}' {run}", project)


def test_a_fab_with_a_replaced_clientapp_is_refused_before_any_of_it_runs(federation):
    fed, _, tmp = federation
    marker = tmp / "replaced-app-ran"
    project = _replaced_app(tmp, "replaced-app", marker)
    run_id = _submit(fed, project, tmp / "replaced")
    assert _wait_until_finished(fed, run_id, tmp / "replaced", timeout=120).startswith("finished:")
    logs = "".join((fed.work / f"supernode-{i}.log").read_text() for i in range(3))
    assert f"its code has app digest {app_digest(tree_files(project))}" in logs
    assert not marker.exists() and not (tmp / "replaced" / "summary.json").exists()


def test_a_release_signed_by_a_trusted_entity_runs(federation):
    fed, _, tmp = federation
    marker = tmp / "signed-app-ran"
    project = _replaced_app(tmp, "signed-app", marker)
    record = sign_digest(app_digest(tree_files(project)), fed.signer, "consortium")
    (project / SIGNATURES_FILE).write_text(json.dumps([record]))
    # One round of one stage: the release has to answer every kind of message, not train well.
    run_id = _submit(fed, project, tmp / "signed", "profile='exact' stages=1 rounds='1' hidden=16 seed=1")
    assert _wait_until_finished(fed, run_id, tmp / "signed") == "finished:completed"
    assert marker.read_text() == "ran"  # the release's own ClientApp answered


def test_unregistered_supernode_is_refused(federation):
    fed, parts, _ = federation
    proc = fed.start_supernode(9, parts / "part-0", key_party=3)
    assert proc.wait(timeout=90) != 0
    assert "Exit Code: 305" in (fed.work / "supernode-9.log").read_text()


def _in_process(parts: Path, rounds: int = 2) -> dict:
    """RUN in process. The engines agree (the simulation with the in-process run in
    tests/test_flower_simulation.py, every message kind across them in tests/test_resume.py), so
    a deployment is held to the in-process run: a simulation here would add a Ray start."""
    cfg = TrainConfig.resolve(
        profile="exact", partitions=str(parts), clients=3, stages=2, rounds=rounds, hidden=16, seed=1
    )
    return train(cfg, RunRecorder(None, stream=None)).to_dict()


def _run_and_wait_for_stage_1(fed, out: Path, extra: str = "") -> int:
    """Submit RUN (and ``extra``) into ``out``; return its run id once stage 1 has run a round."""
    run_id = fed.submit(f"clients=3 out-dir='{out}' {RUN} {extra}".strip())
    deadline = time.monotonic() + 200
    while time.monotonic() < deadline:
        try:
            ck = FileCheckpoints(str(out)).load()
            if ck.stage == 1 and ck.round_state is not None and ck.round_state.round > 0:
                return run_id
        except Exception:  # not written yet, or being replaced
            pass
        time.sleep(0.2)
    pytest.fail("the run did not reach stage 1")


def _wait_until_finished(fed, run_id: int, out: Path, timeout: float = 240) -> str:
    return str(fed.wait(run_id, timeout, out)["status"])


def _worker(fed, party: int) -> tuple[int, Path]:
    """The process id and folder of party ``party``'s current node worker (from its SuperNode's log)."""
    found = re.findall(
        r"node worker (\d+) listening on (\S+)", (fed.work / f"supernode-{party}.log").read_text()
    )
    assert found, f"supernode-{party} started no node worker"
    pid, sock = found[-1]
    return int(pid), Path(sock).parent


@pytest.fixture(scope="module")
def deployed(federation) -> dict:
    """The summary of RUN deployed on ``federation`` and never interrupted: the run the
    interrupted ones must equal. A fixture, not another test's leftover: ``pytest -n`` may hand
    the tests that compare with it to a process where that test never ran."""
    fed, _, tmp = federation
    out = tmp / "deployed"
    record = fed.run(f"clients=3 out-dir='{out}' {RUN}", timeout=240)  # a bound, not a target
    assert record["status"] == "finished:completed"
    return json.loads((out / "summary.json").read_text())


def test_deployed_run_matches_the_in_process_run(federation, deployed):
    fed, parts, _ = federation
    assert deployed["engine"] == "flower"
    in_process = _in_process(parts)
    assert deployed["test_accuracy"] == pytest.approx(in_process["test_accuracy"], abs=0.005)
    assert deployed["bytes_boundary"] == in_process["bytes_boundary"]
    for party in range(3):  # every message went to the node worker, none answered by itself
        assert _worker(fed, party)[0] > 0
        # ... which imported PyG while it waited for the run, not in its first GNN round
        log = (fed.work / f"supernode-{party}.log").read_text()
        assert "imported torch_geometric.nn ahead of the runs" in log


def test_a_node_worker_killed_mid_stage_restarts_and_the_run_ends_the_same(federation, deployed):
    fed, _, tmp = federation
    out = tmp / "worker-killed"
    run_id = _run_and_wait_for_stage_1(fed, out)
    pid, folder = _worker(fed, 1)
    # Hold the worker between two messages (it answers one caller at a time, so once this
    # handshake completes it is idle), then kill it there: the next message must find a new one.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as hold:
        hold.connect(str(folder / SOCKET_NAME))
        send_frame(hold, proof(read_secret(folder), recv_frame(hold)))
        assert json.loads(recv_frame(hold))["ok"]
        os.kill(pid, signal.SIGKILL)
    assert _wait_until_finished(fed, run_id, out) == "finished:completed"
    assert _worker(fed, 1)[0] != pid  # a new worker answered the rest
    got = json.loads((out / "summary.json").read_text())
    assert got["lost_clients"] == []
    for key in ("test_accuracy", "val_accuracy", "bytes_boundary", "bytes_model"):
        assert got[key] == deployed[key], key


def test_supernode_killed_mid_stage_ends_as_the_policy_says(federation):
    # Kills supernode-2 of the module's federation for good: it stays the last test of the module
    # to run a federated RUN (a process runs a module's tests in their order, also under -n).
    fed, _, tmp = federation
    out = tmp / "killed"
    # A worker's message takes well under a second here (15x margin); the time-out is most of
    # what the test waits: the lost node's.
    policy = "min-clients=2 on-missing-halo='zero' client-timeout=15.0"
    run_id = _run_and_wait_for_stage_1(fed, out, policy)
    _, folder = _worker(fed, 2)
    os.killpg(fed.procs["supernode-2"].pid, signal.SIGKILL)  # the SuperNode and its worker
    # Killed together, neither is left to remove the worker folder (its secret and node config).
    shutil.rmtree(folder, ignore_errors=True)
    _wait_until_finished(fed, run_id, out)  # bounded: the policy's time-out ends it, not a hang
    summary = json.loads((out / "summary.json").read_text())
    assert [c["client"] for c in summary["lost_clients"]] == [2]
    assert summary["lost_clients"][0]["phase"].startswith("stage 1")


# -- many devices in one process (`retexo-fl devices`) ----------------------------------------
# No self-training pass: it would run the same messages again.
NODE_RUN = "method='node' stages=2 rounds='2' hidden=16 seed=1 self-training=0"
DEVICES = 20


@pytest.fixture(scope="module")
def device_host(tmp_path_factory):
    """A SuperLink and one `retexo-fl devices` process holding every node of a 20-node graph, each
    node a party (its own Flower node, identity key and pins)."""
    tmp = tmp_path_factory.mktemp("devices")
    parts = tmp / "parts"
    argv = ["partition", "--dataset", f"sbm:{DEVICES},3,4,0.7", "--clients", str(DEVICES), "--method", "node"]
    assert cli([*argv, "--out", str(parts)]) == 0
    keys = write_identities(DEVICES, tmp / "keys")
    fed = FederationProcesses(tmp / "work", database=False)
    try:
        fed.start_superlink()
        # 0.2 s polls at most: the test's rounds wait on idle devices' polls, not on training.
        fed.start_device_host(0, parts, list(range(DEVICES)), keys, extra=("--max-poll", "0.2"))
        yield fed, parts, tmp
    finally:
        fed.stop_all()
        for proc in fed.procs.values():
            assert proc.poll() is not None, "a federation process outlived the test"


def test_devices_held_by_one_process_run_as_the_in_process_run(device_host):
    fed, parts, tmp = device_host
    out = tmp / "run"
    record = fed.run(f"clients={DEVICES} out-dir='{out}' {NODE_RUN}", timeout=240)  # a bound, not a target
    assert record["status"] == "finished:completed"
    deployed = json.loads((out / "summary.json").read_text())
    cfg = TrainConfig.resolve(
        partitions=str(parts),
        clients=DEVICES,
        method="node",
        stages=2,
        rounds=2,
        hidden=16,
        seed=1,
        self_training=0,
    )
    in_process = train(cfg, RunRecorder(None, stream=None)).to_dict()
    assert deployed["engine"] == "flower"
    assert deployed["test_accuracy"] == pytest.approx(in_process["test_accuracy"], abs=0.005)
    losses = [[s["val_loss"] for s in run["stage_results"]] for run in (deployed, in_process)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-4)  # every stage trained as in process
    for key in ("clients", "bytes_boundary", "bytes_total", "messages", "kept_stage"):
        assert deployed[key] == in_process[key], key
    # Twenty parties, one process: the host started no SuperExec, ClientApp or worker.
    host = fed.procs["devices-0"].pid
    children = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _parent(p) == host]
    log = (fed.work / "devices-0.log").read_text()
    assert children == [] and f"holding {DEVICES} devices (" in log
    assert "retexo-fl devices: imported torch_geometric.nn ahead of the runs in " in log


def _parent(proc: Path) -> int:
    try:
        return int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):  # gone meanwhile
        return -1


def test_a_device_host_refuses_a_replaced_app_before_any_of_it_runs(device_host):
    fed, _, tmp = device_host
    marker = tmp / "replaced-app-ran"
    project = _replaced_app(tmp, "replaced-app", marker)
    out = tmp / "replaced"
    run_id = fed.submit(f"clients={DEVICES} out-dir='{out}' {NODE_RUN}", project)
    assert _wait_until_finished(fed, run_id, out, timeout=120).startswith("finished:")
    log = (fed.work / "devices-0.log").read_text()
    assert f"its code has app digest {app_digest(tree_files(project))}" in log
    assert "a device host runs only its installed app" in log
    assert not marker.exists() and not (out / "summary.json").exists()
    assert fed.procs["devices-0"].poll() is None  # the host refused the run, and holds on


def test_a_device_host_holding_an_unregistered_key_is_refused(federation, tmp_path):
    """Under TLS with SuperNode authentication each device of a host signs in with its own key:
    a device whose key was never registered is refused, and the host stops naming it."""
    fed, parts, _ = federation
    auth = tmp_path / "auth"
    auth.mkdir()
    shutil.copy(fed.tls / "party-3", auth / "party-0")  # party-3 is never registered
    fed.start(
        "devices-9",
        [
            "retexo-fl", "devices", "--root-certificates", str(fed.tls / "ca.crt"),
            "--auth-keys", str(auth), "--superlink", f"127.0.0.1:{fed.fleet}",
            "--partitions", str(parts), "--ids", "0", "--insecure-no-pinned-keys",
        ],
    )  # fmt: skip
    assert fed.procs["devices-9"].wait(timeout=90) != 0
    log = (fed.work / "devices-9.log").read_text()
    assert "Exit Code: 305" in log and "retexo-fl devices: part-0: SystemExit" in log
