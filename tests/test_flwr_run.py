"""`flwr run .` through Flower's local simulation SuperLink, and no SuperLink left behind."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _superlinks() -> set[int]:
    out = subprocess.run(["pgrep", "-f", "flower-superlink.*--simulation"], capture_output=True, text=True)
    return {int(p) for p in out.stdout.split()}


@pytest.mark.slow
def test_flwr_run_writes_a_run_folder_and_stops_its_superlink(tmp_path):
    before = _superlinks()
    out = tmp_path / "run"
    env = {**os.environ, "FLWR_HOME": str(tmp_path / "flwr-home")}
    proc = subprocess.run(
        [
            str(ROOT / "deploy" / "flwr-run-local.sh"),
            "2",
            "--run-config",
            f"dataset='sbm:300,3' stages=2 rounds='3' hidden=8 out-dir='{out}'",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["engine"] == "flower" and summary["config"]["clients"] == 2
    # The default self-training pass runs both stages a second time, and stage 0 is trained
    # twice (first-stage auto, the default over partitions: 3 rounds each, too few to race), in
    # the same rounds (first-stage-schedule parallel: one Flower message a client carries both),
    # beside the sprint's lane (first-stage-sprint, 8 rounds at most: these 3).
    assert [s["rounds_run"] for s in summary["stages"]] == [3, 3, 3, 3]
    assert summary["stages"][0]["first_stage_schedule"] == "parallel"
    trials = summary["stages"][0]["first_stage_trials"]
    assert [(t["variant"], t["rounds_run"]) for t in trials] == [("local", 3), ("mlp", 3), ("sprint", 3)]
    assert summary["stages"][0]["first_stage"] in ("mlp", "local")
    assert _superlinks() <= before, "the script must stop the SuperLink it started"
