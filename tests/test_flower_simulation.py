"""The Flower app in Flower's simulation engine computes what the in-process engine computes."""

from __future__ import annotations

import json

import pytest

from retexo_fl.config import TrainConfig
from retexo_fl.metrics import RunRecorder
from retexo_fl.party.state import read_state_file
from retexo_fl.runner import train


def _both_engines(cfg: TrainConfig, rec: RunRecorder | None = None) -> tuple[dict, dict]:
    """``cfg`` run in Flower's simulation engine (into its ``out_dir``) and in process."""
    from server.simulation import simulate

    sim = simulate(cfg)
    ref = train(
        TrainConfig.resolve(**{**cfg.to_dict(), "out_dir": ""}), rec or RunRecorder(None, stream=None)
    )
    return sim, ref


@pytest.mark.slow
def test_simulation_matches_in_process(tmp_path):
    cfg = TrainConfig.resolve(
        profile="exact",  # the settings below as given; the rest as before the round-efficient defaults
        dataset="sbm:500,3,8,0.85",
        clients=3,
        method="metis",
        model="gcn",
        hidden=16,
        stages=3,
        rounds=[6, 4],
        patience=2,
        seed=0,
        # Two local steps corrected by control variates (sent as 8-bit deltas from round 2 on).
        local_epochs=2,
        drift_correction="scaffold",
        # Compressed everywhere: adaptive-width boundary rows, 8-bit updates with error feedback,
        # and the model broadcast as 8-bit deltas.
        bit_policy="adaptive-budget",
        byte_budget="4b",
        update_bits=8,
        broadcast_bits=8,
        out_dir=str(tmp_path / "sim"),
    )
    sim, ref = _both_engines(cfg)
    # Both engines are deterministic for a seed: same weights, so the same accuracy and bytes.
    assert sim["test_accuracy"] == pytest.approx(ref["test_accuracy"], abs=1e-9)
    assert sim["bytes_boundary"] == ref["bytes_boundary"] > 0
    assert sim["bytes_model"] == ref["bytes_model"]
    assert [s["best_round"] for s in sim["stages"]] == [s["best_round"] for s in ref["stages"]]
    # Early stopping (patience 2) cuts the same rounds in both engines.
    assert [s["rounds_run"] for s in sim["stages"]] == [s["rounds_run"] for s in ref["stages"]]
    assert [s["rounds_sent"] for s in sim["stages"]] == [s["rounds_sent"] for s in ref["stages"]]
    assert sim["bit_histogram"] == ref["bit_histogram"] and len(sim["bit_histogram"]) > 1
    assert _bytes_curve(sim) == _bytes_curve(ref) and _bytes_curve(sim)[-1] == sim["bytes_total"]
    assert sim["bytes_boundary_raw"] == ref["bytes_boundary_raw"] > 2 * sim["bytes_boundary"]
    assert sim["bytes_model"] < 0.4 * sim["bytes_model_raw"]
    # Every message was measured: wire bytes exceed payload bytes, by little for boundary rows.
    traffic = sim["traffic"]
    assert traffic["bytes_wire"] > traffic["bytes_payload"] >= sim["bytes_boundary"]
    assert 1.0 < traffic["boundary_overhead"] < 1.5
    clients = {r["client"] for r in traffic["by_message"]}
    assert clients == {0, 1, 2}
    summary = json.loads((tmp_path / "sim" / "summary.json").read_text())
    assert summary["engine"] == "flower" and summary["test_accuracy"] == sim["test_accuracy"]


@pytest.mark.slow
def test_failing_client_ends_the_run_with_its_name(tmp_path):
    import numpy as np

    from retexo_fl.cli import main
    from retexo_fl.coordinator.transport import ClientFailure
    from server.simulation import simulate

    parts = tmp_path / "parts"
    assert (
        main(
            [
                "partition",
                "--dataset",
                "sbm:300,3",
                "--clients",
                "3",
                "--method",
                "metis",
                "--out",
                str(parts),
            ]
        )
        == 0
    )
    x = np.load(parts / "part-2" / "x.npy")
    x[0, 0] = np.nan
    np.save(parts / "part-2" / "x.npy", x)
    cfg = TrainConfig.resolve(partitions=str(parts), clients=3, stages=2, hidden=8, rounds=2, profile="exact")
    with pytest.raises(
        ClientFailure,
        match=r"failed during (key )?setup: client 2: PartitionError: .*part-2/x\.npy: field 'checksum'",
    ):
        simulate(cfg)


@pytest.mark.slow
def test_client_failing_mid_stage_ends_the_run_with_its_name(tmp_path, node_work_dir, reloading_app):
    """Client 2's saved stage inputs are corrupted once stage 1 has begun: its next message, which
    loads them (an actor whose client holds the state the node's context names would not:
    ``reloading_clientapp.py`` makes every actor load node 2's), fails."""
    import threading
    import time

    from retexo_fl.coordinator.transport import ClientFailure
    from server.simulation import simulate

    started = time.time()
    base = node_work_dir  # this test's own node folders: no other run's state is touched
    done = threading.Event()

    def corrupt_when_stage_1_starts() -> None:
        while not done.is_set():
            for path in base.glob("run-*/node-2/client-state.pt"):
                try:
                    fresh = path.stat().st_mtime > started
                    if fresh and read_state_file(path)["stage"] == 1:
                        path.write_bytes(b"not a checkpoint")
                        return
                except Exception:  # the file is being replaced right now: look again
                    pass
            time.sleep(0.02)

    watcher = threading.Thread(target=corrupt_when_stage_1_starts, daemon=True)
    watcher.start()
    cfg = TrainConfig.resolve(
        dataset="sbm:300,3", clients=3, stages=2, hidden=8, rounds=[2, 40], seed=0, profile="exact"
    )
    try:
        with pytest.raises(ClientFailure, match=r"client 2 failed during stage 1 round \d+: client 2: "):
            simulate(cfg, client_app=reloading_app)
    finally:
        done.set()
        watcher.join(timeout=5)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eager", "local"])
def test_baselines_match_in_process(tmp_path, mode):
    cfg = TrainConfig.resolve(
        profile="exact",  # the settings below as given; the rest as before the round-efficient defaults
        mode=mode,
        dataset="sbm:300,3,8,0.85",
        clients=3,
        method="random",
        model="gcn",
        hidden=8,
        stages=3,
        rounds=4,
        seed=0,
        bits=8,
        update_bits=8,
        broadcast_bits=8 if mode == "eager" else 32,
        out_dir=str(tmp_path / "sim"),
    )
    sim, ref = _both_engines(cfg)
    assert sim["mode"] == ref["mode"] == mode
    assert sim["test_accuracy"] == pytest.approx(ref["test_accuracy"], abs=1e-9)
    assert sim["val_accuracy"] == pytest.approx(ref["val_accuracy"], abs=1e-9)
    assert sim["bytes_boundary"] == ref["bytes_boundary"]
    assert sim["bytes_model"] == ref["bytes_model"] > 0
    assert sim["bit_histogram"] == ref["bit_histogram"]
    assert (sim["bytes_boundary"] > 0) == (mode == "eager")
    assert sim["local_steps"] == ref["local_steps"] == [[1, 1, 1]] * 4
    # The curve ends with the last round; eager's halo refresh before the test comes after it.
    assert sim["bytes_halo_refresh"] == ref["bytes_halo_refresh"]
    assert (sim["bytes_halo_refresh"] > 0) == (mode == "eager")
    assert _bytes_curve(sim) == _bytes_curve(ref)
    assert _bytes_curve(sim)[-1] + sim["bytes_halo_refresh"] == sim["bytes_total"]


def _bytes_curve(summary: dict) -> list[int]:
    return [h["bytes_total"] for s in summary["stages"] for h in s["history"]]


@pytest.mark.slow
def test_time_based_rounds_in_simulation(tmp_path):
    from server.simulation import simulate

    cfg = TrainConfig.resolve(
        profile="exact",  # the settings below as given; the rest as before the round-efficient defaults
        mode="local",
        dataset="sbm:300,3,8,0.85",
        clients=3,
        method="random",
        hidden=8,
        stages=2,
        rounds=3,
        round_seconds=0.4,
        step_delay="1:0.15",
        out_dir=str(tmp_path / "sim"),
    )
    steps = simulate(cfg)["local_steps"]
    assert len(steps) == 3
    for fast0, slow, fast2 in steps:  # the slowed client does few steps; nobody waits for it
        assert slow <= 4 and min(fast0, fast2) > 2 * slow


@pytest.mark.slow
def test_self_training_in_simulation_matches_in_process(tmp_path, node_work_dir):
    from clients.node import cut_folder
    from clients.node_client import write_cut

    cfg = TrainConfig.resolve(
        profile="exact",  # the settings below as given; the rest as before the round-efficient defaults
        dataset="sbm:400,3,8,0.85",
        clients=3,
        method="metis",
        hidden=16,
        stages=2,
        rounds=[8, 6],
        seed=0,
        self_training=1,
        pseudo_threshold=0.5,
        out_dir=str(tmp_path / "sim"),
    )
    # A stale cut where the nodes look for theirs (another seed's, as an earlier version or a
    # half-finished run could leave): the simulation writes its own cut over it.
    write_cut(TrainConfig.resolve(**{**cfg.to_dict(), "seed": 1}), cut_folder(node_work_dir, cfg))
    sim, ref = _both_engines(cfg, RunRecorder(tmp_path / "ref", stream=None))
    events = [json.loads(line) for line in (tmp_path / "ref" / "events.jsonl").read_text().splitlines()]
    (relabel,) = [e for e in events if e["event"] == "relabel"]
    assert relabel["train_nodes"] > sum(c["train"] for c in ref["clients"])  # labels were added
    # The pseudo-labels are made and kept on the nodes, across messages: both engines train the
    # second pass on the same labels, so they agree to the bit.
    assert len(sim["stages"]) == len(ref["stages"]) == 4
    assert sim["test_accuracy"] == pytest.approx(ref["test_accuracy"], abs=1e-9)
    assert [s["val_accuracy"] for s in sim["stages"]] == [s["val_accuracy"] for s in ref["stages"]]
    assert sim["bytes_boundary"] == ref["bytes_boundary"] and sim["bytes_model"] == ref["bytes_model"]


@pytest.mark.slow
def test_secure_aggregation_on_cora_matches_in_process_and_plain(tmp_path, data_root):
    """Masked replies, sealed shares and the unmask message through Flower's simulation engine:
    the same weights as in process, and the accuracy of plain aggregation on Cora."""
    cfg = TrainConfig.resolve(
        profile="exact",  # the settings below as given; the rest as before the round-efficient defaults
        dataset="Cora",
        data_root=str(data_root),
        clients=4,
        method="metis",
        model="gcn",
        hidden=16,
        stages=2,
        rounds=6,
        seed=0,
        local_epochs=5,  # five local steps a round, averaged: learns Cora in a few rounds
        server_optimizer="avg",
        server_lr=1.0,
        norm="none",
        secure_aggregation=True,
        out_dir=str(tmp_path / "sim"),
    )
    sim, ref = _both_engines(cfg)
    plain_cfg = TrainConfig.resolve(**{**cfg.to_dict(), "out_dir": "", "secure_aggregation": False})
    plain = train(plain_cfg, RunRecorder(None, stream=None))
    # The field encoding's rounding is seeded and the masks cancel exactly: both engines agree
    # bit for bit, and the ~1e-7 decoding error moves no prediction against plain FedAvg.
    accuracies = (sim["test_accuracy"], ref["test_accuracy"], plain["test_accuracy"])
    assert accuracies[0] == accuracies[1] == accuracies[2] > 0.65, accuracies  # 0.698 measured
    assert sim["bytes_model"] == ref["bytes_model"]
    assert sim["secure_aggregation"] == ref["secure_aggregation"]
    assert sim["secure_aggregation"]["rounds"] == 12 and sim["secure_aggregation"]["unmask_messages"] == 48
    unmask = [r for r in sim["traffic"]["by_message"] if r["message"] == "query.unmask"]
    assert len({r["client"] for r in unmask}) == 4


def test_virtual_nodes_reserve_a_share_of_the_gpus_when_the_device_may_be_one():
    # Ray hides the GPUs from a virtual node that reserves none: --device auto would find none.
    from server.simulation import gpus_for_clients

    assert gpus_for_clients(TrainConfig(clients=4, device="auto"), gpus=1) == 0.25
    assert gpus_for_clients(TrainConfig(clients=2, device="cuda"), gpus=4) == 1.0
    assert gpus_for_clients(TrainConfig(clients=4, device="cpu"), gpus=1) == 0.0
    assert gpus_for_clients(TrainConfig(clients=4, device="auto"), gpus=0) == 0.0


def test_the_actor_pool_is_one_more_than_the_cores_and_no_more_than_the_clients(monkeypatch):
    import flwr.simulation.ray_transport.ray_actor as ray_actor

    from server.simulation import actor_cpus

    class _Ray:  # what Flower's pool sizing reads: each Ray node's resources
        cores = 0

        def nodes(self) -> list[dict]:
            return [{"Resources": {"CPU": float(self.cores)}}]

    ray = _Ray()
    monkeypatch.setattr(ray_actor, "ray", ray)
    for cores, clients, actors in [(2, 2708, 3), (16, 2708, 17), (2, 2, 2), (4, 1, 1), (1, 10, 2)]:
        ray.cores = cores
        resources = {"num_cpus": actor_cpus(clients, cores), "num_gpus": 0.0}
        assert ray_actor.pool_size_from_resources(resources) == actors, (cores, clients)


@pytest.mark.slow
def test_node_level_in_simulation_matches_in_process(tmp_path):
    """One node per client, 40 clients, most of whom neither train nor validate: Flower's engine
    sends the same messages (no train message to the latter) and ends with the same accuracy and
    bytes as the in-process engine. Three of the eight trainers a round and validation every
    second round: sampled trainers and validators catch up with the broadcast deltas they missed
    (31 such messages in process), and are told to keep the best view late."""
    cfg = TrainConfig.resolve(
        dataset="sbm:40,3,6,0.85",
        split="random:0.2,0.2,0.6",
        clients=40,
        method="node",
        stages=3,
        rounds=5,
        patience=0,
        self_training=0,
        hidden=16,
        seed=0,
        clients_per_round=3,
        validate_every=2,
        out_dir=str(tmp_path / "sim"),
    )
    sim, ref = _both_engines(cfg)
    assert sim["test_accuracy"] == pytest.approx(ref["test_accuracy"], abs=1e-9)
    assert sim["bytes_boundary"] == ref["bytes_boundary"] > 0
    assert sim["bytes_model"] == ref["bytes_model"]
    assert sim["messages"] == ref["messages"]
    assert sim["messages"]["train"] < 3 * 5 * 40  # rounds went only to who trains or validates
