"""``bench/selection_rules.py``: each rule's replay picks the round its definition names."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _rules():
    sys.path.insert(0, str(BENCH))
    try:
        import selection_rules
    finally:
        sys.path.remove(str(BENCH))
    return selection_rules


def _curve(vals, tests, variant=None):
    rows = [
        {"round": i + 1, "val_accuracy": v, "test_accuracy": t}
        for i, (v, t) in enumerate(zip(vals, tests, strict=True))
    ]
    return [{**r, "first_stage": variant} for r in rows] if variant else rows


def test_raw_takes_the_best_reading_and_smoothing_the_best_stretch():
    sr = _rules()
    # Stage 0 (two trainings): one lucky spike at 0.70; stage 1 steady at 0.66-0.68.
    stage0 = _curve([0.5, 0.70, 0.5], [0.1, 0.2, 0.3], "local") + _curve([0.6, 0.6], [0.4, 0.5], "mlp")
    stage1 = _curve([0.66, 0.68, 0.67], [0.6, 0.7, 0.8])
    run = {"stages": [{"history": stage0}, {"history": stage1}]}
    assert len(sr.segments(run)) == 3  # each stage-0 training is its own curve
    assert sr.chosen_test(run, sr.RULES["raw"]) == 0.2  # the spike
    assert sr.chosen_test(run, sr.RULES["trail2"]) == 0.8  # (0.68 + 0.67) / 2 beats (0.5 + 0.7) / 2
    # A window at a curve's end holds fewer rounds: (0.68 + 0.67) / 2 beats 0.67 around round 2.
    assert sr.chosen_test(run, sr.RULES["center1"]) == 0.8
    # Ties: the first round of a stage, the later stage.
    tied = {"stages": [{"history": _curve([0.6, 0.6], [0.1, 0.2])}, {"history": _curve([0.6], [0.3])}]}
    assert sr.chosen_test(tied, sr.RULES["raw"]) == 0.3
    table = sr.table([{"graph": "g", "part": "p", **run}, {"graph": "g", "part": "p", **tied}])
    assert table["cells"]["g p"]["raw"] == (0.2 + 0.3) / 2
    assert table["summary"]["raw"]["worst_change_points"] == 0.0
