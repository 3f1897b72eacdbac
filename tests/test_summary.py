"""The typed run summary: ``summary.json``'s keys, written and read back by one class."""

from __future__ import annotations

import json

import pytest

from retexo_fl.config import TrainConfig
from retexo_fl.metrics import RunRecorder
from retexo_fl.runner import train
from retexo_fl.summary import RunSummary

# The keys scripts read from summary.json (bench/, users' notebooks): a rename breaks them, so a
# rename must fail here. Lazy, in process, no secure aggregation.
LAZY_KEYS = {
    "mode", "engine", "test_accuracy", "val_accuracy", "bytes_total", "bytes_boundary", "bytes_model",
    "stages", "wall_seconds", "config", "clients", "bytes_boundary_raw", "bytes_model_raw",
    "bit_histogram", "kept_stage", "kept_pass", "stage_results", "passes", "resumed", "lost_clients",
    "missing_payloads", "messages", "messages_per_stage", "bytes_per_client", "boundary_privacy",
    "privacy", "secure_aggregation",
}  # fmt: skip
EAGER_EXTRA = {"bytes_halo_refresh", "local_steps"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for mode in ("lazy", "eager", "centralized"):
        folder = tmp_path_factory.mktemp(mode)
        cfg = TrainConfig.resolve(
            mode=mode, dataset="sbm:200,3,6,0.8", clients=3, method="random", rounds=2, self_training=0,
            out_dir=str(folder),
        )  # fmt: skip
        summary = train(cfg, RunRecorder(str(folder), stream=None))
        out[mode] = (summary, json.loads((folder / "summary.json").read_text()))
    return out


def test_summary_json_keeps_its_keys(runs):
    summary, written = runs["lazy"]
    assert isinstance(summary, RunSummary)
    assert set(written) == LAZY_KEYS
    written = runs["eager"][1]
    assert set(written) == (LAZY_KEYS - {"kept_stage", "kept_pass", "stage_results", "passes", "resumed"}) | (
        EAGER_EXTRA
    )
    written = runs["centralized"][1]
    assert set(written) == {
        "mode", "engine", "test_accuracy", "val_accuracy", "bytes_total", "bytes_boundary", "bytes_model",
        "stages", "wall_seconds", "config",
    }  # fmt: skip


def test_a_written_summary_reads_back_equal(runs):
    for summary, written in runs.values():
        back = RunSummary.from_dict(written)
        assert back.to_dict() == written
        assert back.test_accuracy == summary.test_accuracy == summary["test_accuracy"]
    eager = RunSummary.from_dict(runs["eager"][1])
    assert eager.extra["local_steps"] == runs["eager"][0]["local_steps"]  # the mode's own figures
    assert eager.kept_stage is None and "kept_stage" not in eager


def test_reading_a_summary_without_its_figures_names_them():
    with pytest.raises(ValueError, match="a run summary needs engine, val_accuracy"):
        RunSummary.from_dict({"mode": "lazy", "test_accuracy": 0.5, "bytes_total": 0, "bytes_boundary": 0,
                              "bytes_model": 0})  # fmt: skip
