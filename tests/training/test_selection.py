"""Best-validation selection and early stopping (patience, min-rounds), and what a stopped stage
sends and counts."""

from __future__ import annotations

import pytest
import torch

from retexo_fl.config import TrainConfig
from retexo_fl.coordinator.selection import StageTracker
from retexo_fl.metrics import RunRecorder
from retexo_fl.runner import train


def _feed(tracker: StageTracker, accuracies: list[float]) -> int:
    """Record rounds 1.. with these accuracies until the tracker says stop; rounds recorded."""
    for r, acc in enumerate(accuracies, start=1):
        tracker.record(r, {"w": torch.tensor([float(r)])}, acc)
        if tracker.should_stop:
            return r
    return len(accuracies)


def test_patience_counts_rounds_without_a_gain_and_keeps_the_best_state():
    t = StageTracker(0, patience=2)
    # Best at round 2; rounds 3 and 4 bring no gain (an equal accuracy is no gain).
    assert _feed(t, [0.5, 0.6, 0.6, 0.55, 0.9]) == 4
    assert (t.best_round, t.best_val) == (2, 0.6) and float(t.best_state["w"]) == 2.0


def test_patience_and_min_rounds_count_rounds_when_rounds_are_validated_every_few():
    """``validate-every 2``: records at rounds 2, 4, 6, ... A stage stops at the first record at
    least ``patience`` rounds after its best and at least ``min_rounds`` rounds in."""
    t = StageTracker(0, patience=4, min_rounds=6)
    for r, acc in ((2, 0.5), (4, 0.6), (6, 0.6)):
        t.record(r, {"w": torch.tensor(float(r))}, acc)
        assert not t.should_stop, r
    t.record(8, {"w": torch.tensor(8.0)}, 0.55)
    assert t.should_stop and (t.best_round, t.stale, t.last_round) == (4, 4, 8)
    assert t.figures(1.0)["rounds_run"] == 8
    early = StageTracker(0, patience=2, min_rounds=6)
    for r in (2, 4):
        early.record(r, {}, 0.5 if r == 2 else 0.4)
    assert early.stale == 2 and not early.should_stop  # 4 rounds in: min-rounds holds it back


def test_a_pace_is_read_by_round_whatever_rounds_were_validated():
    from retexo_fl.coordinator.selection import pace_by_round

    every = [{"round": r, "val_accuracy": a} for r, a in ((1, 0.5), (2, 0.6), (3, 0.7))]
    assert pace_by_round(every) == [0.5, 0.6, 0.7]
    sparse = [{"round": r, "val_accuracy": a} for r, a in ((2, 0.5), (4, 0.7), (5, 0.6))]
    assert pace_by_round(sparse) == [0.0, 0.5, 0.5, 0.7, 0.6]
    t = StageTracker(0)
    t.race(pace_by_round(sparse), after=4, margin=0.05)
    t.record(2, {}, 0.6)
    assert not t.behind_pace  # round 2: before the race's round 4
    t.record(4, {}, 0.62)
    assert t.behind_pace  # by round 4 the other had 0.7


@pytest.mark.parametrize(("first", "second"), [(20, 18), (74, 72), (50, 48), (14, 12)])
def test_a_race_keeps_a_training_exactly_the_margin_behind(first, second):
    """A race stops a training "more than the margin" behind: a gap of exactly 0.02 (2 of 100
    validation nodes) is not, whatever float rounding makes of it (0.20 - 0.18 comes out above
    0.02); 3 of 100 is."""
    for behind, stops in ((second, False), (second - 1, True)):
        t = StageTracker(0)
        t.race([first / 100] * 8, after=8, margin=0.02)
        for r in range(1, 9):
            t.record(r, {}, behind / 100)
        assert t.behind_pace is stops, (first, behind)


def test_min_rounds_holds_early_stopping_back():
    accs = [0.7, 0.6, 0.6, 0.6, 0.6, 0.6, 0.8]
    assert _feed(StageTracker(0, patience=2), accs) == 3
    assert _feed(StageTracker(0, patience=2, min_rounds=5), accs) == 5
    assert _feed(StageTracker(0, patience=0, min_rounds=2), accs) == len(accs)  # 0: never stops


def test_a_race_stops_a_training_that_trails_the_other_by_more_than_the_margin():
    pace = [0.5, 0.6, 0.7, 0.8, 0.8, 0.8]  # the first training, round by round
    behind = [0.4, 0.5, 0.55, 0.6, 0.9]
    t = StageTracker(0)
    t.race(pace, after=3, margin=0.1)
    # Round 3: best 0.55 against 0.7 - 0.1; not before round 3 (0.5 < 0.6 - 0.1 at round 2).
    assert _feed(t, behind) == 3
    assert t.behind_pace and "below the 0.7000 the other stage 0 reached" in t.stop_reason()
    assert t.figures(1.0)["behind_pace"] is True
    close = StageTracker(0)
    close.race(pace, after=3, margin=0.25)  # within 0.25 of it each round: runs on
    assert _feed(close, behind) == len(behind) and not close.behind_pace
    assert close.figures(1.0)["behind_pace"] is False
    late = StageTracker(0)
    late.race(pace[:2], after=3, margin=0.0)  # past the other's rounds: its best overall
    assert _feed(late, [0.5, 0.55, 0.59, 0.61]) == 3
    never = StageTracker(0)
    never.race(pace, after=0, margin=0.0)  # 0: no race
    assert _feed(never, behind) == len(behind)
    plain = StageTracker(0, patience=2)  # no race: early stopping alone, no race figure
    assert _feed(plain, behind) == len(behind) and "behind_pace" not in plain.figures(1.0)


def test_accuracy_or_loss_waits_out_a_plateau_the_loss_still_descends():
    # The curve of a GCN stage on a social graph: every node predicted as the majority class for
    # rounds 1-6 (a flat accuracy) while the validation loss falls, then the minority learned.
    accs = [0.741] * 6 + [0.745, 0.752, 0.760]
    losses = [0.70, 0.66, 0.64, 0.62, 0.61, 0.60, 0.59, 0.58, 0.57]

    def feed(metric: str) -> int:
        t = StageTracker(0, patience=3, stop_metric=metric)
        for r, (acc, loss) in enumerate(zip(accs, losses, strict=True), start=1):
            t.record(r, {"w": torch.tensor([float(r)])}, acc, val_loss=loss)
            if t.should_stop:
                return r
        return len(accs)

    assert feed("accuracy") == 4  # three rounds without a higher accuracy
    assert feed("accuracy-or-loss") == len(accs)
    t = StageTracker(0, patience=2, stop_metric="accuracy-or-loss")
    # A loss that stops falling (less than LOSS_GAIN relative) is no progress either.
    for r, loss in enumerate([0.5, 0.4999, 0.4998], start=1):
        t.record(r, {}, 0.7, val_loss=loss)
    assert t.should_stop and t.best_round == 1
    with pytest.raises(ValueError, match="stop-metric"):
        StageTracker(0, stop_metric="loss")


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"patience": -1}, "patience, min-rounds and warm-min-rounds must be >= 0"),
        ({"min_rounds": -3}, "patience, min-rounds and warm-min-rounds must be >= 0"),
        ({"warm_min_rounds": -1}, "patience, min-rounds and warm-min-rounds must be >= 0"),
        ({"patience": 3, "rounds": [10, 0]}, "patience 3 needs rounds >= 1; stage 1 has 0 rounds"),
        ({"local_epochs": 0}, r"local-epochs must be in \[1, 100000\]"),
        ({"local_epochs": [1, -1]}, r"local-epochs must be in \[1, 100000\].*stage 1"),
        ({"rounds": -1}, r"rounds must be in \[0, 1000000\]"),
        ({"validate_every": 0}, "validate-every must be a whole number >= 1, got 0"),
        ({"validate_every": 1.5}, "validate-every takes a whole number; got 1.5"),
    ],
)
def test_settings_that_cannot_work_are_refused(values, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig.resolve(**values).validate()


def test_zero_local_epochs_is_fine_with_a_time_budget():
    TrainConfig.resolve(profile="exact", mode="local", local_epochs=0, round_seconds=0.5).validate()


def test_a_stopped_stage_counts_exactly_the_rounds_it_sent():
    base = dict(
        profile="exact", dataset="sbm:400,3,8,0.8", clients=3, method="metis", hidden=8, stages=3, seed=0
    )
    quiet = RunRecorder(None, stream=None)
    # One round per stage gives each stage's model bytes per round (32-bit: every round the same).
    per_round = [s["bytes_model"] for s in train(TrainConfig.resolve(**base, rounds=1), quiet)["stages"]]
    # Stopping on accuracy alone: a falling validation loss would keep these stages going.
    run = train(
        TrainConfig.resolve(**base, rounds=40, patience=3, min_rounds=5, stop_metric="accuracy"), quiet
    )
    stopped = 0
    for s, b in zip(run["stages"], per_round, strict=True):
        assert len(s["history"]) == s["rounds_run"] >= 5
        if s["rounds_run"] < 40:  # stopped: the round whose replies carried the deciding validation
            stopped += 1
            assert s["rounds_run"] - s["best_round"] >= 3
            assert s["rounds_sent"] == s["rounds_run"] + 1
        else:
            assert s["rounds_sent"] == 40
        assert s["bytes_model"] == s["rounds_sent"] * b
    assert stopped >= 1  # the setting must exercise early stopping, or this test proves nothing
    assert run["bytes_model"] == sum(s["bytes_model"] for s in run["stages"])


def test_progress_lines_name_pass_and_stage_and_wait_for_a_validation():
    cfg = TrainConfig(stages=3, self_training=1)
    assert [cfg.stage_name(s) for s in (0, 2, 3, 5)] == [
        "pass 1 stage 0",
        "pass 1 stage 2",
        "pass 2 stage 0",
        "pass 2 stage 2",
    ]
    assert TrainConfig(stages=3, self_training=0).stage_name(2) == "stage 2"
    t = StageTracker(3, name=cfg.stage_name(3))
    assert t.progress_line(1, 16) is None  # no validation yet: no "best 0.0000@0"
    t.record(1, {"w": torch.tensor([1.0])}, 0.5)
    assert t.progress_line(1, 16) == "pass 2 stage 0 round    1/16  val 0.5000  best 0.5000@1"


def test_each_progress_line_gives_the_round_its_validation_is_of(tmp_path):
    """A round's replies validate the previous round's result: a line names that round (it
    named the round whose replies carried it, and the stage's last validation had no line)."""
    import io
    import json
    import re

    from retexo_fl.data.datasets import apply_split, synthetic_sbm
    from retexo_fl.data.partitioners import partition_graph
    from retexo_fl.training.lazy import run_lazy

    data = synthetic_sbm(300, 3, avg_degree=6, num_features=8, seed=2)
    apply_split(data, "random:0.3,0.2,0.5", seed=2)
    stream = io.StringIO()
    cfg = TrainConfig(stages=2, rounds=4, min_rounds=4, self_training=0, first_stage="mlp", seed=0)
    run_lazy(partition_graph(data, 3, "random", seed=0), cfg, RunRecorder(tmp_path, stream=stream))
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    recorded = {(e["stage"], e["round"]): e["val_accuracy"] for e in events if e["event"] == "round"}
    said = re.findall(r"stage (\d) round +(\d+)/4 .*?val (\d\.\d{4})", stream.getvalue())
    assert [(int(s), int(r)) for s, r, _ in said] == sorted(recorded)  # 4 rounds: a line each
    for stage, round_, val in said:
        assert float(val) == round(recorded[(int(stage), int(round_))], 4)


@pytest.mark.parametrize(
    ("every", "rounds", "lines"),
    [(1, 20, [1, 4, 8, 12, 16, 20]), (7, 100, [7, 21, 42, 63, 84, 100]), (3, 20, [3, 6, 9, 12, 18, 20])],
)
def test_validating_every_few_rounds_still_gives_about_five_lines_a_stage(every, rounds, lines):
    # Lines come with recorded validations: with validate-every 7 and 100 rounds none of them
    # fell on a multiple of 20 but the last.
    t = StageTracker(0)
    said = []
    for r in [*range(every, rounds + 1, every), *([rounds] if rounds % every else [])]:
        t.record(r, {"w": torch.tensor([1.0])}, 0.5)
        if t.progress_line(r, rounds, last=r == rounds):
            said.append(r)
    assert said == lines


def test_warm_stages_have_their_own_minimum_rounds():
    # A self-training pass's stages start from the previous pass's weights: warm-min-rounds holds
    # them, min-rounds the fresh stages of the first pass.
    cfg = TrainConfig(
        dataset="sbm:300,3,8,0.85", clients=3, method="metis", hidden=8, stages=2, rounds=30, patience=1,
        min_rounds=12, warm_min_rounds=2, self_training=1, stop_metric="accuracy", seed=0,
    )  # fmt: skip
    run = train(cfg, RunRecorder(None, stream=None))
    first, second = run["stages"][:2], run["stages"][2:]
    assert len(second) == 2
    assert all(s["rounds_run"] >= 12 for s in first)
    assert all(s["rounds_run"] >= 2 for s in second)
    # The setting must bite, or this proves nothing: a warm stage stopped before 12 rounds.
    assert min(s["rounds_run"] for s in second) < 12
