"""Client failures: the server's policy (min-clients, on-missing-halo) and the clients' halo fill-in."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from retexo_fl import protocol as P
from retexo_fl.config import TrainConfig
from retexo_fl.coordinator.stages import LazyStageMachine
from retexo_fl.coordinator.transport import ClientFailure, Membership
from retexo_fl.data.partitioners import partition_graph
from retexo_fl.metrics import RunRecorder
from retexo_fl.party.lazy_client import LazyClient
from retexo_fl.party.state import read_state_file
from retexo_fl.plan import PlanMismatchError
from retexo_fl.training.inprocess import InProcessTransport


def _members(**kw) -> Membership:
    m = Membership(TrainConfig.resolve(profile="exact", clients=4, **kw), RunRecorder(None, stream=None))
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


def test_a_node_lost_before_it_said_its_partition_is_dropped_as_the_policy_says():
    m = Membership(
        TrainConfig.resolve(profile="exact", clients=4, min_clients=3, on_missing_halo="zero"),
        RunRecorder(None, stream=None),
    )
    assert m.name(99) == "node 99"
    m.lose(None, "key setup", "node 99 did not reply to key setup within 5s")  # nobody claimed yet
    assert m.lost[0]["client"] is None and m.lost[0]["phase"] == "key setup"
    with pytest.raises(
        ClientFailure, match=r"node 98 did not reply .*\(2 of 4 clients left, min-clients 3\)"
    ):
        m.lose(None, "key setup", "node 98 did not reply to key setup within 5s")
    with pytest.raises(ClientFailure, match=r"^node 99 did not reply to setup within 5s$"):
        _members().lose(None, "setup", "node 99 did not reply to setup within 5s")  # default policy


@pytest.mark.parametrize("phase", [P.HELLO, P.SETUP])
@pytest.mark.parametrize("encrypt", [True, False])
def test_min_clients_covers_key_setup_and_setup(sbm, phase, encrypt):
    """A node silent at key setup or setup is lost; with min-clients the run goes on without it,
    and its peers report its rows missing."""
    if phase == P.HELLO and not encrypt:
        pytest.skip("without encryption there is no key setup")
    cfg = TrainConfig.resolve(
        profile="exact",
        clients=3,
        stages=2,
        hidden=8,
        rounds=3,
        min_clients=2,
        on_missing_halo="zero",
        encrypt=encrypt,
        seed=0,
    )
    clients = [LazyClient(p, cfg) for p in partition_graph(sbm, 3, "random", seed=0)]

    class SilentAt(InProcessTransport):
        def send(self, kind, requests, phase_, stage):
            silent = {a: f"did not reply to {phase_} within 5s" for a in requests if a == 2 and kind == phase}
            batch = super().send(kind, {a: r for a, r in requests.items() if a not in silent}, phase_, stage)
            batch.failures.update(silent)
            return batch

    out = LazyStageMachine(SilentAt(clients), cfg, RunRecorder(None, stream=None)).run()
    assert [(e["client"], e["phase"]) for e in out["lost_clients"]] == [
        (2 if phase == P.SETUP and encrypt else None, "key setup" if phase == P.HELLO else "setup")
    ]
    assert sorted(c["client"] for c in out["clients"]) == [0, 1]
    # Clients 0 and 1 filled in client 2's rows (degrees and stage-1 halo), and said so.
    pairs = {pair for stage in out["missing_payloads"].values() for pair in stage}
    assert pairs == {"2->0", "2->1"}
    with pytest.raises(ClientFailure, match="did not reply"):
        strict = TrainConfig.resolve(
            profile="exact", clients=3, stages=2, hidden=8, rounds=3, encrypt=encrypt, seed=0
        )
        LazyStageMachine(
            SilentAt([LazyClient(p, strict) for p in partition_graph(sbm, 3, "random", seed=0)]),
            strict,
            RunRecorder(None, stream=None),
        ).run()


def test_two_nodes_claiming_one_partition_end_the_run():
    with pytest.raises(ClientFailure, match="nodes 12 and 15 both hold partition 2"):
        _members().claim(2, 15)


@pytest.mark.parametrize("policy", ["fail", "zero", "reuse-last"])
def test_clients_fill_a_lost_peers_halo_as_the_policy_says(sbm, policy):
    parts = partition_graph(sbm, 3, "random", seed=0)
    client = LazyClient(parts[0], TrainConfig.resolve(profile="exact", on_missing_halo=policy, hidden=4))
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
                if path.stat().st_mtime > started and read_state_file(path)["stage"] == stage:
                    path.write_bytes(b"not a checkpoint")
                    return
            except Exception:  # being replaced right now: look again
                pass
        time.sleep(0.02)


@pytest.mark.slow
def test_a_client_dying_mid_stage_is_dropped_and_the_run_finishes(node_work_dir, reloading_app):
    # Its state is corrupted on disk: loaded before every message (reloading_app), it fails.
    from server.simulation import simulate

    started, done = time.time(), threading.Event()
    watcher = threading.Thread(
        target=_corrupt_client_state_at_stage, args=(node_work_dir, 1, 2, started, done), daemon=True
    )
    watcher.start()
    cfg = TrainConfig.resolve(
        profile="exact",
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
        summary = simulate(cfg, client_app=reloading_app)
    finally:
        done.set()
        watcher.join(timeout=5)
    assert [c["client"] for c in summary["lost_clients"]] == [2]
    assert summary["lost_clients"][0]["phase"].startswith("stage 1")
    assert "client 2" in summary["lost_clients"][0]["reason"]
    assert summary["test_accuracy"] > 0.5  # the two others trained on; 3 classes


@pytest.mark.slow
def test_a_client_that_hangs_is_timed_out_and_dropped():
    from server.simulation import simulate

    cfg = TrainConfig.resolve(
        profile="exact",
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
