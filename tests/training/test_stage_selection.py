"""The delivered lazy model is the stage with the best validation: a worse last stage is not kept."""

from __future__ import annotations

import pytest

from retexo_fl.config import TrainConfig
from retexo_fl.data.partitioners import partition_graph
from retexo_fl.training.lazy import run_lazy

# The chain's stages only: the sprint lane of stage 0, a candidate too where a lazy run over
# partitions trains it, is tested in tests/training/test_first_stage_auto.py.
BASE = {"stages": 3, "hidden": 16, "rounds": 10, "seed": 0, "self_training": 0, "first_stage_sprint": 0}
# lr 0 on the last stage: it never leaves its random initial weights, so it validates far below
# the stages before it (a last stage whose inputs carry nothing).
SPOILED = {**BASE, "lr": [1.0, 1.0, 0.0]}


def _check_spoiled(bad: dict, good: dict) -> None:
    results = bad["stage_results"]
    assert [r["stage"] for r in results] == [0, 1, 2]
    # The best accuracy, then the lowest loss, then the later stage.
    best_earlier = max(reversed(results[:2]), key=lambda r: (r["val_accuracy"], -r["val_loss"]))
    assert results[2]["val_accuracy"] < best_earlier["val_accuracy"] - 0.1
    assert bad["kept_stage"] == best_earlier["stage"] and bad["kept_pass"] == 0
    assert bad["val_accuracy"] == best_earlier["val_accuracy"]
    assert bad["test_accuracy"] == best_earlier["test_accuracy"]
    # Stages 0 and 1 trained as in the unspoiled run, and were tested the same.
    keys = ("stage", "val_accuracy", "test_accuracy")
    assert [{k: r[k] for k in keys} for r in results[:2]] == [
        {k: r[k] for k in keys} for r in good["stage_results"][:2]
    ]
    # Boundary rows are 32-bit: the same rows crossed, so the same boundary bytes.
    assert bad["bytes_boundary"] == good["bytes_boundary"] > 0


def test_a_worse_last_stage_delivers_an_earlier_stage(sbm):
    parts = partition_graph(sbm, 3, "metis", seed=0)
    good = run_lazy(parts, TrainConfig.resolve(**BASE))
    bad = run_lazy(parts, TrainConfig.resolve(**SPOILED))
    _check_spoiled(bad, good)
    # Never below stage 0: the delivered model validates at least as well as every stage.
    for summary in (good, bad):
        assert summary["val_accuracy"] == max(r["val_accuracy"] for r in summary["stage_results"])
        # Each stage's loss (the tie-break) is the one measured at its kept round.
        for result, stage in zip(summary["stage_results"], summary["stages"], strict=True):
            kept_round = [h for h in stage["history"] if h["round"] == stage["best_round"]]
            assert result["val_loss"] == kept_round[0]["val_loss"] > 0


def test_equal_accuracies_go_to_the_lower_validation_loss():
    from retexo_fl.coordinator.selection import keep_best_stage

    rows = [
        {"pass": 0, "stage": s, "val_accuracy": v, "val_loss": loss}
        for s, (v, loss) in enumerate(((0.8, 0.9), (0.8, 0.5), (0.8, 0.7), (0.6, 0.1)))
    ]
    assert keep_best_stage(rows)["stage"] == 1  # a lower loss at a lower accuracy does not count
    rows[2]["val_loss"] = 0.5
    assert keep_best_stage(rows)["stage"] == 2  # equal loss too: the later
    # A tied candidate without a finite loss (older checkpoints, an empty validation set): the
    # losses are not compared, and the later of the tied stages is kept.
    for missing in (None, float("nan")):
        rows[0]["val_loss"] = missing
        assert keep_best_stage(rows)["stage"] == 2
        del rows[0]["val_loss"]
        assert keep_best_stage(rows)["stage"] == 2


def test_ties_go_to_the_later_stage():
    from retexo_fl.coordinator.selection import keep_best_stage

    rows = [{"pass": 0, "stage": s, "val_accuracy": v} for s, v in enumerate((0.7, 0.8, 0.8))]
    assert keep_best_stage(rows)["stage"] == 2
    rows[2]["val_accuracy"] = 0.79
    assert keep_best_stage(rows)["stage"] == 1


def test_only_stages_measured_on_the_last_stages_members_compete():
    """Under secure aggregation there are no per-client rows, only the members whose figures were
    summed: a stage measured before a client was lost does not compete with the last one."""
    from retexo_fl.coordinator.selection import keep_best_stage

    rows = [
        {"pass": 0, "stage": 0, "val_accuracy": 0.9, "clients": [], "members": [0, 1, 2, 3]},
        {"pass": 0, "stage": 1, "val_accuracy": 0.7, "clients": [], "members": [0, 1, 2]},
        {"pass": 0, "stage": 2, "val_accuracy": 0.8, "clients": [], "members": [0, 1, 2]},
    ]
    assert keep_best_stage(rows)["stage"] == 2
    rows[0]["members"] = [0, 1, 2]
    assert keep_best_stage(rows)["stage"] == 0


@pytest.mark.slow
def test_both_engines_deliver_the_same_earlier_stage_with_the_same_bytes(tmp_path):
    from retexo_fl.metrics import RunRecorder
    from retexo_fl.runner import train
    from server.simulation import simulate

    common = {"dataset": "sbm:400,3,8,0.85", "clients": 3, "method": "metis", **SPOILED}
    sim = simulate(TrainConfig.resolve(**common, out_dir=str(tmp_path / "sim")))
    ref = train(TrainConfig.resolve(**common), RunRecorder(None, stream=None))
    good = train(TrainConfig.resolve(**{**common, "lr": 1.0}), RunRecorder(None, stream=None))
    _check_spoiled(ref, good)
    for key in (
        "kept_stage",
        "test_accuracy",
        "val_accuracy",
        "bytes_total",
        "bytes_model",
        "bytes_boundary",
    ):
        assert sim[key] == ref[key], key
    assert sim["stage_results"] == ref["stage_results"]
