"""The validation plot's curves: one per pass, stage and layer-0 variant, named as the log names them."""

from __future__ import annotations

from retexo_fl.config import TrainConfig
from retexo_fl.plots import curves


def _rows(n: int, variant: str | None = None) -> list[dict]:
    extra = {"first_stage": variant} if variant else {}
    return [{"round": r, "val_accuracy": 0.1 * r, **extra} for r in range(1, n + 1)]


def test_a_stage_0_trained_as_both_variants_draws_one_curve_each():
    stage = {"stage": 0, "history": _rows(3, "local") + _rows(2, "mlp")}
    got = curves(stage)
    assert [(label, [h["round"] for h in rows]) for label, rows in got] == [
        ("stage 0 (local)", [1, 2, 3]),
        ("stage 0 (mlp)", [1, 2]),
    ]


def test_the_stages_of_a_self_training_pass_are_named_by_pass():
    # As the progress lines name them (TrainConfig.stage_name: passes from 1); they said pass 1
    # for the log's pass 2.
    cfg = TrainConfig(stages=3, self_training=1)
    labels = [label for label, _ in curves({"stage": 4, "history": _rows(2)}, per_pass=3)]
    assert labels == [cfg.stage_name(4)] == ["pass 2 stage 1"]
    assert [label for label, _ in curves({"stage": 3, "history": _rows(2, "mlp")}, per_pass=3)] == [
        "pass 2 stage 0 (mlp)"
    ]
    assert curves({"stage": 1, "history": []}) == []
