"""Client failures: the server's policy (min-clients, on-missing-halo) and the clients' halo fill-in."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from retexo_fl.config import TrainConfig
from retexo_fl.data.partitioners import partition_graph
from retexo_fl.metrics import RunRecorder
from retexo_fl.plan import PlanMismatchError
from retexo_fl.training.lazy_client import LazyClient
from retexo_fl.training.transport import ClientFailure, Membership


def _members(**kw) -> Membership:
    m = Membership(TrainConfig(clients=4, **kw), RunRecorder(None, stream=None))
    for pid in range(4):
        m.claim(pid, 10 + pid)
    return m


def test_default_policy_ends_the_run_at_the_first_loss():
    with pytest.raises(ClientFailure, match=r"^client 2 failed during train$"):
        _members().lose(2, "train", "client 2 failed during train")


def test_min_clients_keeps_the_run_going_until_too_few_are_left():
    m = _members(min_clients=3, on_missing_halo="zero")
    m.lose(2, "stage 1 round 3", "client 2 did not reply to stage 1 round 3 within 5s")
    assert m.pids == [0, 1, 3]
    assert m.lost[0]["client"] == 2 and m.lost[0]["phase"] == "stage 1 round 3"
    with pytest.raises(ClientFailure, match=r"client 0 failed .*\(2 of 4 clients left, min-clients 3\)"):
        m.lose(0, "embed", "client 0 failed during embed")


def test_fail_halo_policy_ends_a_run_that_would_miss_boundary_rows():
    with pytest.raises(ClientFailure, match="on-missing-halo fail"):
        _members(min_clients=2).lose(1, "embed", "client 1 failed during embed")
    local = _members(min_clients=2, mode="local")  # no boundary rows to miss
    local.lose(1, "local round 2", "client 1 failed")
    assert local.pids == [0, 2, 3]


def test_an_unidentified_node_that_fails_ends_the_run():
    m = _members(min_clients=2, on_missing_halo="zero")
    assert m.name(12) == "client 2" and m.name(99) == "node 99"
    with pytest.raises(ClientFailure, match="node 99 did not reply"):
        m.lose(None, "setup", "node 99 did not reply to setup within 5s")


def test_two_nodes_claiming_one_partition_end_the_run():
    with pytest.raises(ClientFailure, match="nodes 12 and 15 both hold partition 2"):
        _members().claim(2, 15)


@pytest.mark.parametrize("policy", ["fail", "zero", "reuse-last"])
def test_clients_fill_a_lost_peers_halo_as_the_policy_says(sbm, policy):
    parts = partition_graph(sbm, 3, "random", seed=0)
    client = LazyClient(parts[0], TrainConfig(on_missing_halo=policy, hidden=4))
    client.advance(torch.randn(parts[0].num_nodes, 4))  # stage 1: 4-wide inputs
    k = {q: int(ids.size) for q, ids in client.plan.recv.items()}
    full = {q: torch.full((k[q], 4), float(q + 1)) for q in k}
    client.receive_halo(full)  # stage s: everyone delivered
    previous = client.halo.clone()
    if policy == "fail":
        with pytest.raises(PlanMismatchError, match=r"client 0: no rows received from client\(s\) \[2\]"):
            client.receive_halo({1: full[1] * 10})
        return
    client.receive_halo({1: full[1] * 10})  # stage s + 1: client 2 was lost
    lost = slice(k[1], k[1] + k[2])  # halo blocks are in peer order
    assert torch.equal(client.halo[: k[1]], full[1] * 10)
    want = torch.zeros(k[2], 4) if policy == "zero" else previous[lost]
    assert torch.equal(client.halo[lost], want)


def _corrupt_client_state_at_stage(
    base: Path, stage: int, client: int, started: float, done: threading.Event
) -> None:
    while not done.is_set():
        for path in base.glob(f"run-*/node-{client}/client-state.pt"):
            try:
                if path.stat().st_mtime > started and torch.load(path, weights_only=True)["stage"] == stage:
                    path.write_bytes(b"not a checkpoint")
                    return
            except Exception:  # being replaced right now: look again
                pass
        time.sleep(0.02)


@pytest.mark.slow
def test_a_client_dying_mid_stage_is_dropped_and_the_run_finishes(node_work_dir):
    from server.simulation import simulate

    started, done = time.time(), threading.Event()
    watcher = threading.Thread(
        target=_corrupt_client_state_at_stage, args=(node_work_dir, 1, 2, started, done), daemon=True
    )
    watcher.start()
    cfg = TrainConfig(
        dataset="sbm:300,3",
        clients=3,
        stages=3,
        hidden=8,
        rounds=[2, 15, 15],
        seed=0,
        min_clients=2,
        on_missing_halo="zero",
    )
    try:
        summary = simulate(cfg)
    finally:
        done.set()
        watcher.join(timeout=5)
    assert [c["client"] for c in summary["lost_clients"]] == [2]
    assert summary["lost_clients"][0]["phase"].startswith("stage 1")
    assert "client 2" in summary["lost_clients"][0]["reason"]
    assert summary["test_accuracy"] > 0.5  # the two others trained on; 3 classes
    assert time.time() - started < 240


@pytest.mark.slow
def test_a_client_that_hangs_is_timed_out_and_dropped():
    from server.simulation import simulate

    started = time.time()
    cfg = TrainConfig(
        mode="eager",
        dataset="sbm:300,3",
        clients=3,
        stages=2,
        hidden=8,
        rounds=6,
        seed=0,
        step_delay="1:40",  # client 1 takes 40 s per local step
        client_timeout=25,  # setup (partitions, Ray actors) must fit too, also on a loaded machine
        min_clients=2,
        on_missing_halo="reuse-last",
    )
    summary = simulate(cfg)
    lost = summary["lost_clients"]
    assert [c["client"] for c in lost] == [1]
    assert "did not reply to eager round 1 within 25s" in lost[0]["reason"]
    assert len(summary["local_steps"]) >= 5 and all(len(s) == 2 for s in summary["local_steps"])
    assert time.time() - started < 240
