"""``first-stage auto``: stage 0 trained as the MLP and as the local layer, the better kept.

The kept variant's run must go on exactly as a run with that variant fixed would, and the
second training's rounds and bytes must be counted; a client refuses a variant its run config
does not allow, and its round journal orders the two trainings.
"""

from __future__ import annotations

import pytest
import torch

from retexo_fl import protocol as P
from retexo_fl.config import TrainConfig
from retexo_fl.data.datasets import apply_split, synthetic_sbm
from retexo_fl.data.partitioners import partition_graph
from retexo_fl.party.eager_client import EagerClient
from retexo_fl.party.handlers import handle
from retexo_fl.party.lazy_client import LazyClient
from retexo_fl.training.lazy import run_lazy

BASE = {"stages": 3, "hidden": 16, "seed": 0, "self_training": 0}
#: auto's unraced form, the MLP first, one training after the other: each runs as its fixed
#: variant's stage 0 would (the parallel schedule, the default, is tested against it below).
UNRACED = {
    "first_stage": "auto",
    "first_stage_first": "mlp",
    "first_stage_race": 0,
    "first_stage_schedule": "sequential",
}


def _parts(homophily: float, feature_signal: float):
    data = synthetic_sbm(
        300, 3, avg_degree=8, homophily=homophily, num_features=8, feature_signal=feature_signal, seed=2
    )
    apply_split(data, "random:0.3,0.2,0.5", seed=2)
    return partition_graph(data, 3, "metis", seed=0)


@pytest.mark.slow
@pytest.mark.parametrize(
    "homophily, feature_signal, winner",
    [
        # Classes carried by the edges, weak features: the layer over a client's own edges wins
        # (measured: stage 0 validates 0.583 as the local layer, 0.450 as the MLP).
        (0.9, 0.1, "local"),
        # Edges mostly across classes, strong features: the MLP wins (0.900 against 0.717).
        (0.2, 0.8, "mlp"),
    ],
)
def test_auto_keeps_the_better_stage_0_and_goes_on_as_that_variant_would(homophily, feature_signal, winner):
    parts = _parts(homophily, feature_signal)
    auto = run_lazy(parts, TrainConfig.resolve(**BASE, **UNRACED))
    fixed = {v: run_lazy(parts, TrainConfig.resolve(**BASE, first_stage=v)) for v in ("mlp", "local")}
    stage0 = auto["stages"][0]
    trials = {t["variant"]: t for t in stage0["first_stage_trials"]}
    assert list(trials) == ["mlp", "local"]  # the MLP first, as first-stage mlp trains it
    for variant, run in fixed.items():  # each training is the fixed variant's stage 0
        ref = run["stages"][0]
        for key in ("val_accuracy", "val_loss", "best_round", "rounds_sent", "bytes_model"):
            assert trials[variant][key] == ref[key], (variant, key)
    # The better validation is kept (its accuracy, then its loss, as stages are kept).
    better = max(trials.values(), key=lambda t: (t["val_accuracy"], -t["val_loss"]))
    assert stage0["first_stage"] == better["variant"] == winner
    kept, other = fixed[winner], fixed["mlp" if winner == "local" else "local"]
    # From there the run is the kept variant's, to the bit: later stages, test, boundary bytes.
    assert auto["stage_results"] == kept["stage_results"]
    assert auto["test_accuracy"] == kept["test_accuracy"]
    assert auto["bytes_boundary"] == kept["bytes_boundary"] > 0
    # ... and the other training is counted: its rounds and its model bytes.
    assert stage0["rounds_sent"] == kept["stages"][0]["rounds_sent"] + other["stages"][0]["rounds_sent"]
    assert auto["bytes_model"] == kept["bytes_model"] + other["stages"][0]["bytes_model"]
    assert len(stage0["history"]) == stage0["rounds_run"]
    assert {row["first_stage"] for row in stage0["history"]} == {"mlp", "local"}


@pytest.mark.slow
def test_a_raced_second_training_stops_when_it_trails_and_the_run_is_the_first_variants():
    # Strong features, edges across classes: the MLP (trained first) wins, the local layer trails.
    parts = _parts(0.2, 0.8)
    full = run_lazy(parts, TrainConfig.resolve(**BASE, **UNRACED))
    race = {"first_stage_race": 4, "first_stage_race_margin": 0.02}
    raced = run_lazy(parts, TrainConfig.resolve(**{**BASE, **UNRACED, **race}))
    mlp = run_lazy(parts, TrainConfig.resolve(**BASE, first_stage="mlp"))
    full0, raced0 = full["stages"][0], raced["stages"][0]
    trials = {t["variant"]: t for t in raced0["first_stage_trials"]}
    # It can fail: an unraced local training runs its min-rounds and patience (measured: 21 rounds).
    assert trials["local"]["behind_pace"] and trials["local"]["rounds_run"] == 4
    assert full0["first_stage_trials"][1]["rounds_run"] > 4
    # The local training's rounds are the unraced one's first four, to the bit.
    local_rows = [r for r in raced0["history"] if r["first_stage"] == "local"]
    full_rows = [r for r in full0["history"] if r["first_stage"] == "local"]
    assert [r["val_accuracy"] for r in local_rows] == [r["val_accuracy"] for r in full_rows[:4]]
    # The MLP is kept, and the run goes on as first-stage mlp's: later stages, test, bytes.
    assert raced0["first_stage"] == full0["first_stage"] == "mlp"
    assert raced["stage_results"] == mlp["stage_results"] == full["stage_results"]
    assert raced["bytes_boundary"] == mlp["bytes_boundary"]
    # Five rounds sent: round 5's replies validate round 4's state, as early stopping counts.
    assert trials["local"]["rounds_sent"] == 5
    assert raced0["rounds_sent"] == mlp["stages"][0]["rounds_sent"] + 5
    assert raced["bytes_model"] < full["bytes_model"]


@pytest.mark.slow
def test_a_race_the_second_training_leads_changes_nothing():
    # Classes on the edges, weak features: the local layer leads from early on and is kept.
    parts = _parts(0.9, 0.1)
    settings = {**BASE, **UNRACED}
    full = run_lazy(parts, TrainConfig.resolve(**settings))
    race = {"first_stage_race": 4, "first_stage_race_margin": 0.02}
    raced = run_lazy(parts, TrainConfig.resolve(**{**settings, **race}))
    assert raced["stages"][0]["first_stage"] == "local"
    assert not raced["stages"][0]["first_stage_trials"][1]["behind_pace"]
    for key in ("stage_results", "test_accuracy", "bytes_total"):
        assert raced[key] == full[key], key


def test_the_local_layer_first_races_the_mlp_and_a_client_journals_the_trainings_in_that_order():
    # Classes on the edges: the local layer, trained first, leads; the MLP trails and is cut.
    parts = _parts(0.9, 0.1)
    settings = {**BASE, **UNRACED}
    full = run_lazy(parts, TrainConfig.resolve(**settings))
    race = {"first_stage_race": 4, "first_stage_race_margin": 0.02}
    first = TrainConfig.resolve(**{**settings, "first_stage_first": "local", **race})
    assert first.first_stage_order == ("local", "mlp")
    raced = run_lazy(parts, first)
    stage0 = raced["stages"][0]
    assert [t["variant"] for t in stage0["first_stage_trials"]] == ["local", "mlp"]
    mlp = stage0["first_stage_trials"][1]
    assert mlp["behind_pace"] and mlp["rounds_run"] == 4
    # Each training is its variant's, whatever the order: the local one as in the MLP-first run.
    local_first = stage0["first_stage_trials"][0]
    local_full = full["stages"][0]["first_stage_trials"][1]
    for key in ("val_accuracy", "val_loss", "best_round", "rounds_sent", "bytes_model"):
        assert local_first[key] == local_full[key], key
    assert stage0["first_stage"] == "local"
    assert raced["stage_results"] == full["stage_results"]
    assert stage0["rounds_sent"] < full["stages"][0]["rounds_sent"]


def test_a_self_training_pass_builds_its_stage_0_as_the_kept_variant():
    parts = _parts(0.9, 0.1)
    settings = {**BASE, "stages": 2, "self_training": 1}
    auto = run_lazy(parts, TrainConfig.resolve(**settings, first_stage="auto"))
    assert auto["stages"][0]["first_stage"] == "local"
    kept = run_lazy(parts, TrainConfig.resolve(**settings, first_stage="local"))
    assert [s["stage"] for s in auto["stage_results"]] == [0, 1, 2, 3]
    # The second pass's stage 0 (stage 2) trained as the local layer, as the fixed run's did.
    assert auto["stage_results"] == kept["stage_results"]
    assert "first_stage_trials" not in auto["stages"][2]


def _client(first_stage: str, **settings) -> LazyClient:
    parts = _parts(0.9, 0.1)
    return LazyClient(parts[0], TrainConfig.resolve(**BASE, first_stage=first_stage, **settings))


def test_a_variant_the_run_config_does_not_allow_is_refused_naming_the_client():
    client = _client("mlp")
    client.set_first_stage("mlp")  # the config's own: accepted
    with pytest.raises(ValueError, match=r"client 0: first-stage local in a run whose first-stage is mlp"):
        client.set_first_stage("local")
    with pytest.raises(ValueError, match=r"client 0: first-stage 'gat' is not one of local, mlp"):
        _client("auto").set_first_stage("gat")
    # The sprint's lane is a variant only where first-stage-sprint trains one.
    with pytest.raises(ValueError, match=r"client 0: first-stage 'sprint' is not one of local, mlp$"):
        _client("auto", first_stage_sprint=0).set_first_stage("sprint")
    sprinting = _client("auto", first_stage_sprint=8, first_stage_schedule="parallel")
    sprinting.set_first_stage("sprint")
    with pytest.raises(ValueError, match=r"client 0: first-stage 'sprint' is not one of mlp, local$"):
        _client("mlp", first_stage_sprint=8).set_first_stage("sprint")
    # Under auto a layer-0 stage needs the variant named before its model is built.
    with pytest.raises(RuntimeError, match=r"client 0: first-stage auto, and no message named"):
        _client("auto").make_model()
    # An eager client takes no layer-0 variant.
    parts = _parts(0.9, 0.1)
    eager = EagerClient(parts[0], TrainConfig.resolve(**BASE, mode="eager"))
    with pytest.raises(ValueError, match=r"client 0: first-stage applies to lazy runs, this one is eager"):
        handle(eager, P.TRAIN, {P.CONFIG: {P.FIRST_STAGE: "mlp", P.ROUND: 1, P.STAGE: 0}})


def test_auto_is_refused_with_secure_aggregation_and_outside_lazy_mode():
    with pytest.raises(ValueError, match=r"first-stage auto trains stage 0 twice"):
        TrainConfig.resolve(clients=4, first_stage="auto", secure_aggregation=True).validate()
    with pytest.raises(ValueError, match=r"first-stage auto applies to lazy mode, not eager"):
        TrainConfig.resolve(mode="eager", first_stage="auto").validate()


def test_the_round_journal_takes_the_second_training_and_refuses_going_back():
    client = _client("auto", first_stage_first="mlp")
    client.set_first_stage("mlp")
    client.begin_round(1)
    client.begin_round(9)
    client.set_first_stage("local")  # the second training counts its rounds from 1 again
    client.begin_round(1)
    client.begin_round(2)
    client.set_first_stage("mlp")  # a server going back to the MLP's rounds once the local began
    with pytest.raises(ValueError, match=r"client 0: train round 10 of stage 0 after round 2 of stage 0"):
        client.begin_round(10)
    # The local layer first (first-stage-first local): the MLP's rounds come second.
    parts = _parts(0.9, 0.1)
    cfg = TrainConfig.resolve(**BASE, first_stage="auto")  # the local layer first by default
    assert cfg.first_stage_first == "local"
    local_first = LazyClient(parts[0], cfg)
    local_first.set_first_stage("local")
    local_first.begin_round(9)
    local_first.set_first_stage("mlp")
    local_first.begin_round(1)
    local_first.set_first_stage("local")
    with pytest.raises(ValueError, match=r"client 0: train round 10 of stage 0 after round 1 of stage 0"):
        local_first.begin_round(10)


@pytest.mark.slow
def test_both_engines_keep_the_same_variant_with_the_same_results(tmp_path):
    from retexo_fl.metrics import RunRecorder
    from retexo_fl.runner import train
    from server.simulation import simulate

    # Short stages: both trainings and a conv stage after them are what the engines must agree on,
    # trained in parallel (the default): each round one Flower message a client carries both.
    short = {**BASE, "stages": 2, "rounds": 4, "min_rounds": 0, "patience": 0}
    parallel = {**UNRACED, "first_stage_schedule": "parallel", "first_stage_sprint": 3}
    common = {"dataset": "sbm:300,3,8,0.9", "clients": 3, "method": "metis", **short, **parallel}
    sim = simulate(TrainConfig.resolve(**common, out_dir=str(tmp_path / "sim")))
    ref = train(TrainConfig.resolve(**common), RunRecorder(None, stream=None))
    assert sim["stages"][0]["first_stage"] == ref["stages"][0]["first_stage"]
    assert [t["variant"] for t in sim["stages"][0]["first_stage_trials"]] == ["mlp", "local", "sprint"]
    assert sim["stages"][0]["first_stage_trials"] == [
        {**t, "seconds": s["seconds"]}
        for t, s in zip(
            ref["stages"][0]["first_stage_trials"], sim["stages"][0]["first_stage_trials"], strict=True
        )
    ]
    for key in (
        "test_accuracy",
        "val_accuracy",
        "bytes_total",
        "bytes_model",
        "bytes_boundary",
        "kept_stage",
    ):
        assert sim[key] == ref[key], key
    assert sim["stage_results"] == ref["stage_results"]


@pytest.mark.parametrize("homophily, feature_signal, first", [(0.9, 0.1, "local"), (0.2, 0.8, "mlp")])
def test_parallel_trains_the_same_two_trainings_in_the_longer_ones_rounds(homophily, feature_signal, first):
    # Raced, the leader first, so that the second training is cut early (the MLP trails on the
    # first graph, the local layer on the second) and the first goes on alone. No sprint: it
    # trains in parallel only (tested below).
    parts = _parts(homophily, feature_signal)
    race = {"first_stage_race": 4, "first_stage_race_margin": 0.02, "first_stage_first": first}
    race["first_stage_sprint"] = 0
    one_by_one = run_lazy(parts, TrainConfig.resolve(**{**BASE, **UNRACED, **race}))
    together = run_lazy(
        parts, TrainConfig.resolve(**BASE, **{**UNRACED, **race, "first_stage_schedule": "parallel"})
    )
    seq0, par0 = one_by_one["stages"][0], together["stages"][0]
    # Each training to the bit, its race included; only the wall seconds differ.
    drop = {"seconds"}
    assert [{k: v for k, v in t.items() if k not in drop} for t in par0["first_stage_trials"]] == [
        {k: v for k, v in t.items() if k not in drop} for t in seq0["first_stage_trials"]
    ]
    assert any(t.get("behind_pace") for t in par0["first_stage_trials"])
    # ... so the same variant is kept, and the run goes on the same: stages, test, every byte.
    assert par0["first_stage"] == seq0["first_stage"]
    for key in ("stage_results", "test_accuracy", "bytes_total", "bytes_model", "bytes_boundary"):
        assert together[key] == one_by_one[key], key
    # It can fail: in parallel the stage takes the longer training's rounds, not their sum.
    sent = [t["rounds_sent"] for t in par0["first_stage_trials"]]
    assert seq0["rounds_sent"] == sum(sent) and par0["rounds_sent"] == max(sent) < sum(sent)
    assert (par0["first_stage_schedule"], seq0["first_stage_schedule"]) == ("parallel", "sequential")
    # One train message a client a round: as many fewer as the shorter training's rounds.
    messages = [run["messages"]["train"] for run in (one_by_one, together)]
    assert messages[0] - messages[1] == 3 * min(sent)
    # Every round of the stage's history names its training, in the order they were read.
    assert {row["first_stage"] for row in par0["history"]} == {"mlp", "local"}


def _lane(variant: str, round_: int, stage: int = 0, **config) -> dict:
    return {P.CONFIG: {P.FIRST_STAGE: variant, P.ROUND: round_, P.STAGE: stage, **config}}


def test_a_message_of_several_lanes_is_refused_unless_each_lane_trains_stage_0_as_its_variant():
    client = _client("auto")
    one = P.join_lanes({"local": _lane("local", 1), "mlp": _lane("mlp", 1)})
    assert one[P.CONFIG][P.LANES] == "local,mlp" and P.FIRST_STAGE not in one[P.CONFIG]
    assert set(P.split_lanes(one, "x")) == {"local", "mlp"}
    bad = {
        "a lane naming the other variant": P.join_lanes({"local": _lane("mlp", 1)}),
        "a lane of a later stage": P.join_lanes({"local": _lane("local", 1, stage=1)}),
    }
    for what, message in bad.items():
        with pytest.raises(
            ValueError, match=r"client 0: lane 'local' names first-stage .* a lane trains stage 0"
        ):
            handle(client, P.TRAIN, message), what
    stray = {**one, "other|arrays": {}}
    with pytest.raises(ValueError, match=r"client 0: record 'other\|arrays' belongs to no lane"):
        handle(client, P.TRAIN, stray)
    with pytest.raises(ValueError, match=r"client 0: lanes in a query.embed message; only train messages"):
        handle(client, P.EMBED, one)
    # A run whose config fixes stage 0's variant trains no lanes; nor one that trains its two
    # variants one after the other.
    fixed = r"client 0: a train message of several lanes; only first-stage auto"
    with pytest.raises(ValueError, match=fixed):
        handle(_client("local"), P.TRAIN, one)
    sequential = r"client 0: a message of several lanes in a run whose first-stage-schedule is sequential"
    with pytest.raises(ValueError, match=sequential):
        handle(_client("auto", first_stage_schedule="sequential"), P.TRAIN, one)
    # Every lane is a variant, checked before any lane trains; a lane delivers no payloads (stage
    # 0 reads no peer's rows, and a lane's round sent again would rewind the channel the lanes share).
    with pytest.raises(ValueError, match=r"client 0: lane 'gat' is not one of local, mlp, sprint"):
        handle(client, P.TRAIN, P.join_lanes({"mlp": _lane("mlp", 1), "gat": _lane("gat", 1)}))
    assert client.journal is None  # the mlp lane did not train first
    delivering = P.join_lanes({"local": {**_lane("local", 1), P.PAYLOADS: {"halo-from-1": b"x"}}})
    with pytest.raises(ValueError, match=r"client 0: lane 'local' delivers payloads"):
        handle(client, P.TRAIN, delivering)
    with pytest.raises(ValueError, match=r"client 0: lanes in a evaluate message; only train messages"):
        handle(client, P.EVALUATE, one)
    # Lanes do not nest: a lane's record naming another lane is refused, not trained twice.
    nested = {**one, "mlp|local|config": _lane("local", 1)[P.CONFIG]}
    with pytest.raises(ValueError, match=r"client 0: record 'mlp\|local\|config' belongs to no lane"):
        handle(client, P.TRAIN, nested)
    # Only a message of lanes enters them: lanes named in the config of any other is refused.
    for kind in (P.TRAIN, P.EVALUATE, P.EMBED):
        with pytest.raises(
            ValueError, match=r"client 0: lanes in the config of a message that carries no lanes"
        ):
            handle(client, kind, _lane("local", 1, lanes="local"))
    # A client that began stage 0's rounds one training at a time would start over in lanes.
    began = _client("auto")
    began.set_first_stage("local")
    began.begin_round(1)
    with pytest.raises(
        ValueError, match=r"client 0: a message of several lanes after stage 0's rounds began"
    ):
        handle(began, P.TRAIN, one)
    # ... and a client past stage 0 trains no lanes, whatever stage the message claims.
    began.stage = 1
    with pytest.raises(
        ValueError, match=r"client 0: a message of several lanes at stage 1; lanes train stage 0"
    ):
        handle(began, P.TRAIN, one)


def test_a_client_holds_each_lanes_round_state_apart_until_it_moves_on():
    client = _client("auto")
    client.set_first_stage("local", lane=True)
    client.begin_round(1)
    client.view = local_view = {"w": torch.ones(2)}
    client.set_first_stage("mlp", lane=True)  # the other lane starts empty, as a first training does
    assert client.view is None and client.journal is None
    client.begin_round(1)
    client.view = mlp_view = {"w": torch.zeros(2)}
    client.begin_round(2)
    client.set_first_stage("local", lane=True)
    assert client.view is local_view and client.journal[0] == [0, 0, 1]
    client.begin_round(2)  # each lane's rounds go forward on their own
    # A message naming a variant without lanes (the stage's test and embed) takes that lane.
    client.set_first_stage("mlp")
    assert client.view is mlp_view and client.journal[0] == [0, 1, 2]
    snapshot = client.snapshot()
    assert snapshot.lane == "mlp" and snapshot.lanes["local"]["journal"][0] == [0, 0, 2]
    client.drop_lanes()
    assert client.lanes == {} and client.lane is None and client.view is mlp_view


def test_a_client_whose_reply_answers_one_lane_of_two_is_lost_naming_the_lane():
    from retexo_fl.coordinator.stages import LazyStageMachine
    from retexo_fl.metrics import RunRecorder
    from retexo_fl.training.inprocess import InProcessTransport

    class DropsTheMlpLane(InProcessTransport):
        """Client 1's replies to stage 0's rounds lose their MLP lane."""

        def send(self, kind, requests, phase, stage):
            batch = super().send(kind, requests, phase, stage)
            if 1 in batch.replies and P.has_lanes(requests.get(1, {})):
                batch.replies[1] = {k: v for k, v in batch.replies[1].items() if not k.startswith("mlp|")}
            return batch

    parts = _parts(0.9, 0.1)
    cfg = TrainConfig.resolve(
        **BASE, clients=3, first_stage="auto", min_clients=2, on_missing_halo="zero", rounds=3, min_rounds=0
    )
    transport = DropsTheMlpLane([LazyClient(p, cfg) for p in parts])
    summary = LazyStageMachine(transport, cfg, RunRecorder(None, stream=None)).run()
    # The run goes on without it (min-clients 2), its loss names the lane its reply lacked.
    lost = summary["lost_clients"]
    assert [(c["client"], c["phase"]) for c in lost] == [(1, "stage 0 round 1")]
    assert "client 1: its reply answers no lane mlp" in lost[0]["reason"]
    assert [c["client"] for c in summary["clients"]] == [0, 2]


@pytest.mark.parametrize("schedule", ["sequential", "parallel"])
def test_the_kept_first_training_is_named_by_digest_after_clients_missed_rounds_of_the_second(schedule):
    # Sampled trainers and validators asked every fourth round: clients that missed rounds of the
    # second training are sent its state whole again. Each must still hold the first training's
    # best, kept here (classes on the edges, no feature signal: the local layer, trained first).
    data = synthetic_sbm(300, 3, avg_degree=8, homophily=0.95, num_features=8, feature_signal=0.0, seed=2)
    apply_split(data, "random:0.3,0.2,0.5", seed=2)
    parts = partition_graph(data, 6, "metis", seed=0)
    settings = {**BASE, "stages": 2, "broadcast_bits": 8, "update_bits": 8, "rounds": 30}
    sampled = {"fraction_train": 0.2, "validate_every": 4, "first_stage_race": 0}
    cfg = TrainConfig.resolve(**settings, **sampled, first_stage="auto", first_stage_schedule=schedule)
    out = run_lazy(parts, cfg)
    assert out["stages"][0]["first_stage"] == "local" == cfg.first_stage_order[0]
    # It can fail: one after the other, a second whole state used to move the second training's
    # view over the first's, and two clients' embeds were refused (not held) and sent again.
    assert out["messages_per_stage"]["0"]["embed"] == 6


def test_mlp_local_epochs_sets_the_steps_of_an_mlp_stage_0_alone():
    part = _parts(0.9, 0.1)[0]
    cfg = TrainConfig.resolve(**BASE, local_epochs=5, mlp_local_epochs=2, first_stage="mlp")
    mlp = LazyClient(part, cfg)
    state = mlp.make_model().state_dict()
    assert mlp.step_budget() == (2, None)
    mlp.train(state, 1)
    assert mlp.last_steps == 2
    # The local layer over the client's own edges, and a conv stage, keep local-epochs.
    local = LazyClient(part, TrainConfig.resolve(**{**cfg.to_dict(), "first_stage": "local"}))
    assert local.step_budget() == (5, None)
    mlp.advance(mlp.embeddings(state))
    assert mlp.layer == 1 and mlp.step_budget() == (5, None)
    unset = LazyClient(part, TrainConfig.resolve(**{**cfg.to_dict(), "mlp_local_epochs": 0}))
    assert unset.step_budget() == (5, None)  # 0: the stage's local-epochs
    with pytest.raises(ValueError, match="mlp-local-epochs"):
        TrainConfig.resolve(**BASE, mlp_local_epochs=-1).validate()


#: Stage 0 in parallel without the sprint (a lazy run over partitions trains one by default).
PARALLEL = {
    **BASE,
    "stages": 2,
    "first_stage": "auto",
    "first_stage_schedule": "parallel",
    "first_stage_sprint": 0,
}


@pytest.mark.slow
def test_the_sprint_is_a_candidate_for_the_delivered_model_and_the_chain_goes_on_as_without_it():
    # Edges mostly within classes, middling features: the sprint (the local layer over three hops
    # of the client's own subgraph, dropout 0.2) validates above every stage of the chain
    # (measured: 1.000 against 0.983 and 0.983), so it is tested and delivered.
    parts = _parts(0.7, 0.3)
    without = run_lazy(parts, TrainConfig.resolve(**PARALLEL))
    sprinting = run_lazy(parts, TrainConfig.resolve(**{**PARALLEL, "first_stage_sprint": 4}))
    stage0 = sprinting["stages"][0]
    trials = {t["variant"]: t for t in stage0["first_stage_trials"]}
    assert list(trials) == ["local", "mlp", "sprint"]
    assert trials["sprint"]["rounds_sent"] == 4 < trials["local"]["rounds_sent"]  # its own rounds
    # Never embedded: the chain is the run without it, to the bit; only its model bytes are added.
    assert stage0["first_stage"] == without["stages"][0]["first_stage"] == "local"
    chain = [r for r in sprinting["stage_results"] if "variant" not in r]
    assert chain == without["stage_results"]
    assert sprinting["bytes_boundary"] == without["bytes_boundary"] > 0
    assert sprinting["bytes_model"] == without["bytes_model"] + trials["sprint"]["bytes_model"]
    assert {row["first_stage"] for row in stage0["history"]} == {"local", "mlp", "sprint"}
    # A candidate: tested and, validating best, delivered. It costs two messages to each of the 3
    # clients: the validation of its last round (the other lanes' rounds go on) and its test.
    row = next(r for r in sprinting["stage_results"] if r.get("variant") == "sprint")
    assert row["val_accuracy"] == trials["sprint"]["val_accuracy"] > max(r["val_accuracy"] for r in chain)
    assert (sprinting["kept_stage"], sprinting["kept_variant"]) == (0, "sprint")
    assert sprinting["test_accuracy"] == row["test_accuracy"] != without["test_accuracy"]
    assert sprinting["messages"]["evaluate"] == without["messages"]["evaluate"] + 2 * 3
    assert "kept_variant" not in without


def test_a_sprint_that_validates_below_the_kept_stage_0_costs_no_test_and_changes_no_result():
    # Edges within classes, weak features: the sprint validates 0.883, the local layer 0.950.
    parts = _parts(0.9, 0.1)
    without = run_lazy(parts, TrainConfig.resolve(**PARALLEL))
    sprinting = run_lazy(parts, TrainConfig.resolve(**{**PARALLEL, "first_stage_sprint": 4}))
    sprint = sprinting["stages"][0]["first_stage_trials"][-1]
    assert (
        sprint["variant"] == "sprint"
        and sprint["val_accuracy"] < sprinting["stage_results"][0]["val_accuracy"]
    )
    for key in ("stage_results", "test_accuracy", "kept_stage", "bytes_boundary"):
        assert sprinting[key] == without[key], key
    assert "kept_variant" not in sprinting
    # Only the validation of its last round: its test is not sent.
    assert sprinting["messages"]["evaluate"] == without["messages"]["evaluate"] + 3


def test_a_client_refuses_the_sprint_outside_stage_0s_lanes_and_evaluations(monkeypatch):
    from retexo_fl.party import handlers

    # A coordinator that names the sprint in an embed would have the client release rows of a
    # model over more hops of its own subgraph than any it embeds; in a train message of one lane
    # it would train the sprint as the chain's stage 0. (The handlers proper are stubbed: what is
    # checked is which messages reach them.)
    for kind in (P.TRAIN, P.EVALUATE):
        monkeypatch.setitem(
            handlers.HANDLERS, kind, lambda client, request: handlers.Reply({P.METRICS: {}}, False)
        )
    client = _client("auto", first_stage_sprint=8, first_stage_schedule="parallel")
    refused = r"client 0: first-stage sprint in a {} message at stage 0; the sprint trains in stage 0's lanes"
    with pytest.raises(ValueError, match=refused.format("query.embed")):
        handle(client, P.EMBED, _lane("sprint", 1))
    with pytest.raises(ValueError, match=refused.format("train")):
        handle(client, P.TRAIN, _lane("sprint", 1))
    assert client.first_stage is None  # refused before the client took the variant
    # In a lane of stage 0's train message it trains, and at stage 0 it is evaluated.
    reply = handle(client, P.TRAIN, P.join_lanes({"sprint": _lane("sprint", 1)}))
    assert client.first_stage == "sprint" and P.lane_record("sprint", P.METRICS) in reply.records
    client.set_first_stage("local")
    handle(client, P.EVALUATE, _lane("sprint", 1, split="test"))
    assert client.first_stage == "sprint"
    client.stage = 1  # past stage 0 (as after its embed): not even in an evaluation
    with pytest.raises(ValueError, match=r"sprint in a evaluate message at stage 1"):
        handle(client, P.EVALUATE, _lane("sprint", 1, stage=1, split="val"))


def test_the_sprints_input_reads_its_own_hops_and_its_model_its_own_dropout():
    from retexo_fl.models.factory import stage_model_spec

    client = _client("auto", first_stage_sprint=8, first_stage_schedule="parallel", local_hops=2)
    adj = client.own_adjacency()
    client.set_first_stage("local")
    local = client.stage_input()
    client.set_first_stage("sprint")
    sprint = client.stage_input()
    torch.testing.assert_close(local, torch.sparse.mm(adj, client.owned))
    torch.testing.assert_close(sprint, torch.sparse.mm(adj, torch.sparse.mm(adj, client.owned)))
    client.set_first_stage("local")
    assert client.stage_input() is local  # each input propagated once per stage
    cfg, width, classes = client.cfg, client.owned.shape[1], client.part.num_classes
    assert stage_model_spec(cfg, 0, width, classes, "sprint")[4] == 0.2
    assert stage_model_spec(cfg, 0, width, classes, "local")[4] == 0.5
    assert stage_model_spec(cfg, 0, width, classes, "sprint")[0] == "gcn"  # the local layer
