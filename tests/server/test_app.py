"""The ServerApp's run folder: one per Flower run under the app's ``out-dir``, never another's."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

from retexo_fl.config import TrainConfig
from server.app import run_folder
from server.checkpoint import resumed_config


def test_each_flwr_run_writes_its_own_folder_under_the_apps_out_dir(tmp_path):
    cfg = TrainConfig.resolve(out_dir=str(tmp_path / "runs"))
    assert run_folder(cfg, [], 7).out_dir == str(tmp_path / "runs" / "run-7")
    assert run_folder(cfg, [], 8).out_dir != run_folder(cfg, [], 7).out_dir
    # The submitter's own folder, a resumed run's, or none at all: as given.
    assert run_folder(cfg, ["out-dir"], 7).out_dir == str(tmp_path / "runs")
    assert run_folder(TrainConfig.resolve(), [], 7).out_dir == ""
    # A resumed run's folder is the one it resumes (resumed_config sets it): not the app's.
    resumed = TrainConfig.resolve(out_dir=str(tmp_path / "runs"), resume=str(tmp_path / "a"))
    assert run_folder(resumed, [], 7).out_dir == ""


def test_a_folder_holding_a_finished_run_is_refused_before_anything_is_written(tmp_path):
    from server.app import run_server

    (tmp_path / "summary.json").write_text("{}")
    (tmp_path / "events.jsonl").write_text("kept\n")
    with pytest.raises(ValueError, match="holds a finished run"):
        run_server(None, TrainConfig.resolve(out_dir=str(tmp_path)))  # type: ignore[arg-type]
    assert (tmp_path / "events.jsonl").read_text() == "kept\n"


def test_a_flwr_run_that_resumes_writes_in_the_resumed_folder(tmp_path):
    root = Path(__file__).resolve().parents[2]
    app = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    run = tmp_path / "run-5"
    run.mkdir()
    (run / "config.json").write_text("{}")  # a run folder: its config.json (defaults here)
    cfg = TrainConfig.from_run_config({**app, "resume": str(run)}, ["resume"])
    assert cfg.out_dir == "runs/flwr"  # the app's folder of runs, not this run's ...
    resumed = resumed_config(run_folder(cfg, ["resume"], 9))  # ... so the resumed run's own
    assert resumed.out_dir == str(run) and resumed.resume == str(run)
