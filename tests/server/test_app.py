"""The ServerApp's run folder: one per Flower run under the app's ``out-dir``, never another's."""

from __future__ import annotations

import pytest

from retexo_fl.config import TrainConfig
from server.app import run_folder


def test_each_flwr_run_writes_its_own_folder_under_the_apps_out_dir(tmp_path):
    cfg = TrainConfig.resolve(out_dir=str(tmp_path / "runs"))
    assert run_folder(cfg, [], 7).out_dir == str(tmp_path / "runs" / "run-7")
    assert run_folder(cfg, [], 8).out_dir != run_folder(cfg, [], 7).out_dir
    # The submitter's own folder, a resumed run's, or none at all: as given.
    assert run_folder(cfg, ["out-dir"], 7).out_dir == str(tmp_path / "runs")
    assert run_folder(TrainConfig.resolve(), [], 7).out_dir == ""
    resumed = TrainConfig.resolve(out_dir=str(tmp_path / "a"), resume=str(tmp_path / "a"))
    assert run_folder(resumed, [], 7).out_dir == str(tmp_path / "a")


def test_a_folder_holding_a_finished_run_is_refused_before_anything_is_written(tmp_path):
    from server.app import run_server

    (tmp_path / "summary.json").write_text("{}")
    (tmp_path / "events.jsonl").write_text("kept\n")
    with pytest.raises(ValueError, match="holds a finished run"):
        run_server(None, TrainConfig.resolve(out_dir=str(tmp_path)))  # type: ignore[arg-type]
    assert (tmp_path / "events.jsonl").read_text() == "kept\n"
