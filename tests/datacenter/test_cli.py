"""``retexo-fl train --mode datacenter`` end to end: residency refused, then exact full-graph training."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from retexo_fl.cli import main

COMMON = ["--dataset", "Cora", "--rounds", "30", "--hidden", "16", "--dropout", "0", "--seed", "1"]


@pytest.mark.slow
def test_datacenter_on_partitions_matches_centralized(data_root, tmp_path, capsys):
    parts = tmp_path / "parts"
    assert (
        main(
            [
                "partition",
                "--dataset",
                "Cora",
                "--root",
                str(data_root),
                "--clients",
                "4",
                "--out",
                str(parts),
            ]
        )
        == 0
    )
    base = [*COMMON, "--data-root", str(data_root)]

    # Partitions are residency-bound by default: refused, nothing started.
    assert main(["train", "--mode", "datacenter", "--partitions", str(parts), *base]) == 2
    assert "residency-bound" in capsys.readouterr().err

    run = tmp_path / "dc"
    argv = ["train", "--mode", "datacenter", "--algorithm", "2d", "--procs", "4", "--partitions", str(parts)]
    assert main([*argv, "--trusted-cluster", *base, "--out", str(run)]) == 0
    dc = json.loads((run / "summary.json").read_text())

    assert main(["train", "--mode", "centralized", *base, "--out", str(tmp_path / "central")]) == 0
    central = json.loads((tmp_path / "central" / "summary.json").read_text())

    # Without dropout both are the same model, weights and optimizer on the same graph.
    assert dc["test_accuracy"] == pytest.approx(central["test_accuracy"], abs=0.005)
    assert dc["test_accuracy"] > 0.7
    shared = {
        "mode",
        "test_accuracy",
        "val_accuracy",
        "bytes_total",
        "bytes_boundary",
        "bytes_model",
        "stages",
    }
    assert shared <= dc.keys() and shared <= central.keys()
    assert dc["mode"] == "datacenter" and dc["algorithm"] == "2d" and dc["procs"] == 4
    assert dc["bytes_total"] >= dc["bytes_boundary"] + dc["bytes_model"] > 0
    history = dc["stages"][0]["history"]
    assert len(history) == 30 and history[-1]["bytes_total"] == pytest.approx(dc["bytes_total"], rel=1e-6)


@pytest.mark.slow
def test_torchrun_entry_point(tmp_path):
    """The multi-host line docs/datacenter.md gives, on one host: torchrun starts the processes itself."""
    torchrun = shutil.which("torchrun") or pytest.skip("torchrun not on PATH")
    summary = tmp_path / "summary.json"
    cmd = [
        torchrun,
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "retexo_fl.datacenter",
        "--algorithm",
        "1.5d",
        "--dataset",
        "sbm:300,3,8,0.9",
        "--rounds",
        "3",
        "--hidden",
        "8",
        "--summary",
        str(summary),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    s = json.loads(summary.read_text())
    assert s["procs"] == 2 and s["algorithm"] == "1.5d" and s["replication"] == 2
    assert len(s["stages"][0]["history"]) == 3
    assert s["per_epoch"]["spmm_bytes_measured"] == pytest.approx(s["per_epoch"]["spmm_bytes_predicted"])
