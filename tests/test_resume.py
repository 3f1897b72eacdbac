"""Kill a lazy Flower run mid-stage, resume it from its run folder, and get the uninterrupted result."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from retexo_fl.config import TrainConfig
from retexo_fl.metrics import RunRecorder
from retexo_fl.runner import train

SETTINGS = {
    "dataset": "sbm:500,3,8,0.85",
    "clients": 3,
    "model": "gcn",
    "stages": 3,
    "hidden": 16,
    "rounds": "4,12,12",
    "seed": 0,
}


def _checkpoint_position(path) -> tuple[int, int]:
    try:
        ck = torch.load(path, weights_only=False)
    except Exception:  # not written yet
        return -1, -1
    return ck["stage"], (ck["stage_state"] or {}).get("round", 0)


@pytest.mark.slow
def test_killed_run_resumes_to_the_uninterrupted_accuracy(tmp_path):
    from server.simulation import simulate

    run = tmp_path / "run"
    argv = [sys.executable, "-m", "retexo_fl.cli", "train", "--engine", "simulation", "--out", str(run)]
    for k, v in SETTINGS.items():
        argv += [f"--{k}", str(v)]
    proc = subprocess.Popen(argv, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline, killed_at = time.time() + 240, None
    try:
        while time.time() < deadline and proc.poll() is None:
            stage, round_ = _checkpoint_position(run / "checkpoint.pt")
            if (stage, round_) >= (1, 3):
                os.killpg(proc.pid, signal.SIGKILL)  # the whole simulation: server, clients, Ray
                killed_at = (stage, round_)
                break
            time.sleep(0.2)
    finally:
        if proc.poll() is None and killed_at is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert killed_at is not None, "the run ended or stalled before stage 1 round 3"
    assert killed_at[0] == 1 and not (run / "summary.json").exists()

    resumed = simulate(TrainConfig(resume=str(run)))
    assert resumed["resumed"] is True
    assert [s["stage"] for s in resumed["stages"]] == [0, 1, 2]

    cfg = TrainConfig.from_mapping(SETTINGS)
    whole = train(cfg, RunRecorder(None, stream=None))
    # Every weight, optimizer moment and byte counter came back: the same run, bit for bit.
    assert resumed["test_accuracy"] == pytest.approx(whole["test_accuracy"], abs=1e-9)
    assert resumed["val_accuracy"] == pytest.approx(whole["val_accuracy"], abs=1e-9)
    assert resumed["bytes_boundary"] == whole["bytes_boundary"]
    events = (run / "events.jsonl").read_text()
    assert '"stage": 0' in events and '"stage": 2' in events  # one event log across both halves
