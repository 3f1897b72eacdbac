"""Kill a lazy Flower run mid-stage, resume it from its run folder, and get the uninterrupted result."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from retexo_fl.config import TrainConfig
from retexo_fl.metrics import RunRecorder
from retexo_fl.runner import train
from server.checkpoint import FileCheckpoints

SETTINGS = {
    "dataset": "sbm:500,3,8,0.85",
    "clients": 3,
    "model": "gcn",
    "stages": 3,
    "hidden": 16,
    "rounds": "4,12,12",
    "seed": 0,
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

    resumed = simulate(TrainConfig(resume=str(run)))
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
