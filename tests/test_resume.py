"""Kill a lazy run's server, resume it from its run folder, and get the uninterrupted result.

Two ways: a Flower simulation killed mid-stage for real, and, at every phase boundary of a run
(every message any client answers, including between two clients of one batch), a server that
dies there while its clients keep their node-local state on disk.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from retexo_fl import protocol as P
from retexo_fl.config import TrainConfig
from retexo_fl.coordinator.stages import LazyStageMachine
from retexo_fl.coordinator.transport import Batch
from retexo_fl.data.datasets import apply_split, synthetic_sbm
from retexo_fl.data.partitioners import partition_graph
from retexo_fl.metrics import RunRecorder
from retexo_fl.party.handlers import HANDLERS, handle
from retexo_fl.party.lazy_client import LazyClient
from retexo_fl.protocol import Records
from retexo_fl.runner import train
from retexo_fl.training.inprocess import InProcessTransport
from server.checkpoint import FileCheckpoints

SETTINGS = {
    "dataset": "sbm:500,3,8,0.85",
    "clients": 3,
    "model": "gcn",
    "stages": 3,
    "hidden": 16,
    "rounds": "4,12,12",
    "seed": 0,
    "profile": "exact",
}
# Killed in the second pass of self-training: the clients' own labels must come back from their
# node-local state, or the resumed pass would train on other labels.
SELF_TRAINING = {**SETTINGS, "stages": 2, "rounds": "6,8", "self-training": 1, "pseudo-threshold": 0.5}


def _curve(summary: dict) -> list[float]:
    return [h[k] for s in summary["stages"] for h in s["history"] for k in ("val_accuracy", "train_loss")]


def _checkpoint_position(run) -> tuple[int, int]:
    try:
        ck = FileCheckpoints(str(run)).load()
    except Exception:  # not written yet, or being replaced right now
        return -1, -1
    return ck.stage, ck.round_state.round if ck.round_state else 0


@pytest.mark.slow
@pytest.mark.parametrize(
    ("settings", "kill_at"), [(SETTINGS, (1, 3)), (SELF_TRAINING, (3, 3))], ids=["plain", "self-training"]
)
def test_killed_run_resumes_to_the_uninterrupted_accuracy(tmp_path, settings, kill_at):
    from server.simulation import simulate

    run = tmp_path / "run"
    argv = [sys.executable, "-m", "retexo_fl.cli", "train", "--engine", "simulation", "--out", str(run)]
    for k, v in settings.items():
        argv += [f"--{k}", str(v)]
    proc = subprocess.Popen(argv, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline, killed_at = time.time() + 240, None
    try:
        while time.time() < deadline and proc.poll() is None:
            stage, round_ = _checkpoint_position(run)
            if (stage, round_) >= kill_at:
                os.killpg(proc.pid, signal.SIGKILL)  # the whole simulation: server, clients, Ray
                killed_at = (stage, round_)
                break
            time.sleep(0.2)
    finally:
        if proc.poll() is None and killed_at is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert killed_at is not None, f"the run ended or stalled before stage, round {kill_at}"
    assert killed_at[0] == kill_at[0] and not (run / "summary.json").exists()

    resumed = simulate(TrainConfig.resolve(profile="exact", resume=str(run)))
    assert resumed["resumed"] is True
    cfg = TrainConfig.from_mapping(settings)
    assert [s["stage"] for s in resumed["stages"]] == list(range(cfg.total_stages))

    whole = train(cfg, RunRecorder(None, stream=None))
    # Every weight, optimizer moment and byte counter came back: the same run, bit for bit.
    assert resumed["test_accuracy"] == pytest.approx(whole["test_accuracy"], abs=1e-9)
    assert resumed["val_accuracy"] == pytest.approx(whole["val_accuracy"], abs=1e-9)
    assert resumed["bytes_boundary"] == whole["bytes_boundary"]
    # Round by round, not only at the end (an easy graph's test accuracy hides small changes).
    assert _curve(resumed) == pytest.approx(_curve(whole), rel=1e-5)
    events = (run / "events.jsonl").read_text()
    last = cfg.total_stages - 1
    assert '"stage": 0' in events and f'"stage": {last}' in events  # one log across both halves


# -- a server killed at every phase boundary ------------------------------------------------------
# An MLP stage 0 takes the stage's five steps (not the default one), as when the variants each case
# keeps (below) were read off.
EVERY_BOUNDARY = dict(
    clients=3, model="gcn", stages=2, hidden=8, rounds=2, seed=0, patience=0, min_rounds=0, mlp_local_epochs=0
)
CODECS = {
    # The default self-training pass: the relabelling between passes, and a second pass whose
    # stages resume from the first's test rows and the clients' own labels.
    # One hop for the local stage 0 (two by default): the MLP wins stage 0 then, so this case
    # resumes the second training kept in parallel (the 8-bit case keeps the first, two hops).
    # And a sprint lane of stage 0 (first-stage-sprint) shorter than the others, which validates
    # above the kept stage 0: its last validation and its test come between their rounds.
    "32-bit": dict(local_hops=1, first_stage_sprint=1),
    # Compressed broadcasts and updates keep a view and an error-feedback residual on each client,
    # and SCAFFOLD control variates: all of it must come back exactly. Their state is per round
    # and per stage, which one pass covers; a second would double the messages and, as every
    # message is a resume of the rest of the run, about quadruple the test's time.
    "8-bit": dict(broadcast_bits=8, update_bits=8, bits=8, drift_correction="scaffold", self_training=0),
    # Masked replies and an unmask message a round: a round sent again gets the reply it got
    # first, the same survivor set gets the same answer, and the shares open again.
    "secure": dict(secure_aggregation=True, update_bits=8, self_training=0),
    # Stage 0 trained twice (first-stage auto), one training after the other: a server killed in
    # the second training, or after both, goes on with the variant it kept; compressed
    # broadcasts, so the kept variant's state is named by digest where clients hold it. (The
    # other cases train the two in parallel, the default: one message a client carries both
    # trainings' rounds, and each client holds each training's round state apart.)
    "auto": dict(
        first_stage="auto",
        first_stage_schedule="sequential",
        local_hops=1,  # the MLP kept, as in the 32-bit case
        broadcast_bits=8,
        update_bits=8,
        self_training=0,
    ),
}


class NodesOnDisk(InProcessTransport):
    """Clients as deployed nodes run them: each message builds the client afresh, restores it from
    its node-local folder, answers, and saves what changed.

    ``snapshots`` given, the whole run folder (every node's folder and the server's checkpoint)
    is copied to ``snapshots/<k>`` before the k-th message of the run is handled: exactly what a
    server that died there, waiting for that reply, leaves on disk. Resuming from each copy is a
    server killed at each message, without running the run up to it again for each."""

    def __init__(self, parts, cfg: TrainConfig, run, snapshots=None) -> None:
        super().__init__([])
        self.parts, self.cfg, self.run, self.snapshots = parts, cfg, run, snapshots
        self.folders = [run / f"node-{i}" for i in range(len(parts))]
        self.handled = 0
        self.kinds: list[str] = []  # the kind of each message handled, in order
        self.catch_up: list[int] = []  # the messages that brought deltas a client missed, or a KEEP
        self.chained = 0  # ... of them, those with deltas

    def connect(self, count: int) -> list[int]:
        return list(range(count))

    def send(self, kind: str, requests: dict[int, Records], phase: str, stage: int) -> Batch:
        replies = {}
        for address, request in requests.items():
            if self.snapshots is not None:
                shutil.copytree(self.run, self.snapshots / str(self.handled))
            client = LazyClient(self.parts[address], self.cfg)
            client.restore(self.folders[address])
            reply = handle(client, kind, request)
            if reply.changed:
                client.save(self.folders[address])
            replies[address] = reply.records
            if P.MODEL_BEFORE in request or request.get(P.CONFIG, {}).get(P.KEEP):
                self.catch_up.append(self.handled)
                self.chained += P.MODEL_BEFORE in request
            self.handled += 1
            self.kinds.append(kind)
        return Batch(replies)


def _run_on_disk(parts, cfg: TrainConfig, run, snapshots=None) -> tuple[dict, list[str]]:
    """A whole run with its nodes on disk; its summary and the kinds of the messages it handled."""
    run.mkdir(parents=True)
    transport = NodesOnDisk(parts, cfg, run, snapshots)
    store = FileCheckpoints(str(run / "server"))
    summary = LazyStageMachine(transport, cfg, RunRecorder(None, stream=None), store).run()
    return summary, transport.kinds


def _resume_on_disk(parts, cfg: TrainConfig, run) -> dict | None:
    """A new server process resuming from what ``run`` holds (``None``: no checkpoint yet)."""
    store = FileCheckpoints(str(run / "server"))
    if not store.path.exists():  # died before its first checkpoint: a new run, not a resume
        return None
    again = NodesOnDisk(parts, cfg, run)  # the nodes kept their folders
    return LazyStageMachine(again, cfg, RunRecorder(None, stream=None), store).run(resume=True)


@pytest.mark.slow
@pytest.mark.parametrize("codec", CODECS)
def test_a_server_killed_at_any_phase_boundary_resumes_bit_for_bit(tmp_path, codec):
    data = synthetic_sbm(150, 3, avg_degree=6, homophily=0.85, num_features=8, feature_signal=0.35, seed=1)
    apply_split(data, "random:0.3,0.2,0.5", seed=1)
    parts = partition_graph(data, 3, "random", seed=0)
    cfg = TrainConfig.resolve(**EVERY_BOUNDARY, **CODECS[codec])
    snapshots = tmp_path / "died-after"
    whole, kinds = _run_on_disk(parts, cfg, tmp_path / "whole", snapshots)
    messages = len(kinds)
    # Per client: key setup and setup, each stage's train rounds (and unmask messages) and last
    # validation, and the exchange (or, at the pass's end, the relabelling) between the stages,
    # which tests the stage's kept model; the last stage's test. Under secure aggregation each
    # stage's test is a message of its own. The default self-training pass runs every stage twice.
    per_round = 2 if cfg.secure_aggregation else 1
    runs = cfg.total_stages
    assert runs == (1 + cfg.self_training) * cfg.stages
    assert cfg.self_training == (1 if codec == "32-bit" else 0)
    training = 2 * per_round + 1  # a stage's rounds and its last validation
    stage0 = training
    if cfg.first_stage == "auto":  # stage 0 trained twice: in parallel, one message a round for both
        parallel = cfg.first_stage_schedule == "parallel"
        stage0 = 2 * per_round + 2 if parallel else 2 * training
        if "sprint" in cfg.first_stage_lanes:  # its last validation, and its test if it was tested
            stage0 += 1 + any(r.get("variant") == "sprint" for r in whole["stage_results"])
    tests = runs if cfg.secure_aggregation else 1
    assert messages == 3 * (2 + stage0 + (runs - 1) * training + (runs - 1) + tests)
    if cfg.first_stage == "auto":
        # Between them the cases resume both outcomes of stage 0's two trainings (the local
        # layer first, the MLP second). 32-bit and auto keep the second: clients hold its states.
        # 8-bit keeps the first (a tie on validation, the lower loss): clients hold the second's,
        # so the kept state goes whole to the embed that tests it (no message refused). Which
        # one wins is the seed's (dropout masks): this says which path each case covers.
        kept = {"32-bit": "mlp", "8-bit": "local", "auto": "mlp"}[codec]
        assert whole["stages"][0]["first_stage"] == kept
        # The sprint's lane (the default's 8 rounds, the 32-bit case's 1) validates above the kept
        # stage 0 in both parallel cases: tested, a candidate (not the model delivered here).
        sprinted = [r for r in whole["stage_results"] if r.get("variant") == "sprint"]
        assert len(sprinted) == (cfg.first_stage_schedule == "parallel")
        assert "kept_variant" not in whole
    assert sorted(int(p.name) for p in snapshots.iterdir()) == list(range(messages))
    # It can fail: a server that asks for a stage's last validation or its exchange again, once
    # clients moved on, finds them a stage ahead; a round sent again whose deliveries were opened
    # before is refused as a replay; one that died in the test has no weights to test.
    resumed = 0
    for die_after in range(messages):
        summary = _resume_on_disk(parts, cfg, snapshots / str(die_after))
        if summary is None:
            assert die_after < 6  # only before setup's checkpoint is there nothing to resume
            continue
        resumed += 1
        where = f"server died after {die_after} of {messages} messages"
        assert summary["resumed"] is True, where
        assert _curve(summary) == _curve(whole), where
        assert summary["test_accuracy"] == whole["test_accuracy"], where
        assert summary["passes"] == whole["passes"], where  # the first pass's test survives a resume
        assert summary["bytes_boundary"] == whole["bytes_boundary"], where
        assert summary["bytes_model"] == whole["bytes_model"], where
        assert [s["rounds_sent"] for s in summary["stages"]] == [s["rounds_sent"] for s in whole["stages"]]
        assert summary["bytes_total"] == whole["bytes_total"], where
    assert resumed == messages - 6


def test_a_run_resumed_from_an_older_config_keeps_the_settings_it_started_with(tmp_path):
    """A setting the run's config.json predates was not in force when it started: resuming takes
    its field default, not a level's default (a node-level run before clients-per-round trained
    every trainer each round, and keeps doing so)."""
    import dataclasses
    import json

    from server.checkpoint import resumed_config

    started = dataclasses.asdict(TrainConfig.resolve(method="node", clients=30))
    started.pop("extra")
    started.pop("clients_per_round")  # written before the setting existed
    (tmp_path / "config.json").write_text(json.dumps(started))
    resumed = resumed_config(TrainConfig(resume=str(tmp_path)))
    assert resumed.clients_per_round == 0
    assert (resumed.method, resumed.server_optimizer, resumed.server_lr) == ("node", "adam", 0.05)
    started["clients_per_round"] = 512  # written by this version: kept as written
    (tmp_path / "config.json").write_text(json.dumps(started))
    assert resumed_config(TrainConfig(resume=str(tmp_path))).clients_per_round == 512
    # It writes on in its own folder: another --out was silently never written before.
    assert resumed_config(TrainConfig(resume=str(tmp_path), out_dir=str(tmp_path))).out_dir == str(tmp_path)
    with pytest.raises(ValueError, match="a resumed run continues in its own folder"):
        resumed_config(TrainConfig(resume=str(tmp_path), out_dir=str(tmp_path / "elsewhere")))


def test_a_config_json_edited_since_the_start_is_refused_naming_the_setting(tmp_path):
    """The clients bound the start's config at setup and refuse any other: a resume from an edited
    config.json is refused before any engine starts, naming what changed (it failed at the
    clients' binding, with two digests)."""
    import json

    from retexo_fl.coordinator.checkpoint import Checkpoint
    from server.checkpoint import resumed_config

    cfg = TrainConfig.resolve(clients=3, out_dir=str(tmp_path))
    began = cfg.to_dict()
    began.pop("first_stage_race")  # a checkpoint of a release before the setting: its default
    FileCheckpoints(str(tmp_path)).save(Checkpoint(began, 7, [0, 1, 2], {}, {}, [], 0, 0))
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    resumed = resumed_config(TrainConfig(resume=str(tmp_path)))
    assert resumed.to_dict() == {**cfg.to_dict(), "resume": str(tmp_path)}
    edited = {**cfg.to_dict(), "lr": [0.5], "seed": 3}
    (tmp_path / "config.json").write_text(json.dumps(edited))
    with pytest.raises(ValueError, match=r"config.json: edited since the run started \(lr .*, seed 0 -> 3\)"):
        resumed_config(TrainConfig(resume=str(tmp_path)))
    # A finished run is not resumed: its summary would be rewritten by a second test.
    (tmp_path / "summary.json").write_text("{}")
    with pytest.raises(ValueError, match="the run finished"):
        resumed_config(TrainConfig(resume=str(tmp_path)))


@pytest.mark.slow
def test_a_node_level_server_killed_between_a_stage_test_and_its_embed_resumes_bit_for_bit(tmp_path):
    """One node a client, some holding no labelled node at all: a stage's embed brings the
    clients its rounds left out the stage's relayed rows, and tests the stage on those with a
    test node before they move on; the last stage's test reaches only the clients with a test
    node. A server killed at any message, the tests' and the embeds' included, resumes to the
    same run: a late frame is opened once, by the embed of a client that has not embedded yet,
    and a client asked to embed again answers the test counts it took before it moved on."""
    data = synthetic_sbm(24, 3, avg_degree=4, homophily=0.85, num_features=8, feature_signal=0.4, seed=3)
    apply_split(data, "random:0.25,0.25,0.25", seed=3)
    parts = partition_graph(data, 24, "node", seed=0)
    untested = {p.partition_id for p in parts if not int(p.test_mask.sum())}
    idle = {p.partition_id for p in parts if not int(p.train_mask.sum()) and not int(p.val_mask.sum())}
    left_out = untested & idle
    assert left_out and idle - left_out, "idle clients with and without a test node"
    cfg = TrainConfig.resolve(
        clients=24,
        model="gcn",
        stages=3,  # stage 1's embed is the one that carries late rows
        hidden=8,
        rounds=2,
        seed=0,
        patience=0,
        min_rounds=0,
        method="node",
        broadcast_bits=8,
        update_bits=8,
        self_training=0,
        clients_per_round=0,
    )
    snapshots = tmp_path / "died-after"
    late: list[int] = []  # clients whose embed brought them rows
    embed = HANDLERS[P.EMBED]

    def recording(client, request):
        if request.get(P.PAYLOADS):
            late.append(client.id)
        return embed(client, request)

    with pytest.MonkeyPatch.context() as m:
        m.setitem(HANDLERS, P.EMBED, recording)
        whole, kinds = _run_on_disk(parts, cfg, tmp_path / "whole", snapshots)
    assert late and set(late) <= idle, "late rows went with the embed, to who missed them"
    assert set(late) - left_out, "... tested clients among them, whose embed tests the stage"
    assert whole["messages"]["evaluate"] < 2 * 24, "the stages' tests went with their embeds"
    # Killed before each test and embed message (train rounds: the test above covers them). It
    # can fail: a client that opened a test's deliveries, its peer's degrees and rows, and is
    # sent the same test again refused the degrees as a replay until a test's and an embed's
    # deliveries were opened once per message.
    dies = [k for k, kind in enumerate(kinds) if kind in (P.EVALUATE, P.EMBED)]
    assert len(dies) < len(kinds) / 2
    for die_after in dies:
        summary = _resume_on_disk(parts, cfg, snapshots / str(die_after))
        assert summary is not None, "setup's checkpoint comes before any test"
        where = f"server died after {die_after} of {len(kinds)} messages"
        assert _curve(summary) == _curve(whole), where
        assert summary["test_accuracy"] == whole["test_accuracy"], where
        assert summary["passes"] == whole["passes"], where
        assert summary["bytes_boundary"] == whole["bytes_boundary"], where
        assert summary["bytes_model"] == whole["bytes_model"], where


@pytest.mark.slow
def test_a_node_level_server_killed_while_validators_catch_up_resumes_bit_for_bit(tmp_path):
    """``validate-every 2`` with a sample of the trainers each round: validators and resampled
    trainers catch up with the broadcast deltas they missed, and are told to keep the best view
    with their next message, however late. A server killed before any such message resumes to
    the same run: the resumed server knows who holds which view and who kept the best (it asks
    again with the same deltas), and a client sent the same catch-up again decodes it from the
    view its journal kept."""
    # A model large enough that a missed delta costs less than the state whole (else it goes whole).
    data = synthetic_sbm(24, 3, avg_degree=4, homophily=0.85, num_features=32, feature_signal=0.4, seed=3)
    apply_split(data, "random:0.4,0.3,0.3", seed=3)
    parts = partition_graph(data, 24, "node", seed=0)
    cfg = TrainConfig.resolve(
        clients=24,
        model="gcn",
        stages=2,
        hidden=32,
        rounds=6,
        seed=0,
        patience=0,
        min_rounds=0,
        method="node",
        broadcast_bits=4,
        update_bits=8,
        self_training=0,
        clients_per_round=3,
        validate_every=2,
    )
    run, snapshots = tmp_path / "whole", tmp_path / "died-after"
    run.mkdir()
    transport = NodesOnDisk(parts, cfg, run, snapshots)
    store = FileCheckpoints(str(run / "server"))
    whole = LazyStageMachine(transport, cfg, RunRecorder(None, stream=None), store).run()
    catch_up = transport.catch_up
    assert len(catch_up) > 10 and transport.chained, "validators and resampled trainers caught up"
    for die_after in catch_up[:: max(1, len(catch_up) // 12)]:
        summary = _resume_on_disk(parts, cfg, snapshots / str(die_after))
        assert summary is not None
        where = f"server died after {die_after} of {transport.handled} messages"
        assert _curve(summary) == _curve(whole), where
        assert summary["test_accuracy"] == whole["test_accuracy"], where
        assert summary["bytes_model"] == whole["bytes_model"], where
        assert summary["kept_stage"] == whole["kept_stage"], where
    # It can fail: a resumed server that took the last round's recipients for the only clients
    # holding a view (as a checkpoint of older code says) sends the validators the state whole,
    # and the model bytes differ.
