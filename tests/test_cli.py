"""The retexo-fl command line: partition then train, summaries, and clear errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from retexo_fl.cli import main
from retexo_fl.config import TrainConfig

SUMMARY_KEYS = {
    "test_accuracy",
    "val_accuracy",
    "bytes_total",
    "bytes_boundary",
    "bytes_model",
    "wall_seconds",
    "config",
    "stages",
}


def test_partition_then_train(tmp_path, capsys):
    parts = tmp_path / "parts"
    assert (
        main(
            [
                "partition",
                "--dataset",
                "sbm:400,3,8,0.85",
                "--clients",
                "3",
                "--method",
                "random",
                "--out",
                str(parts),
            ]
        )
        == 0
    )
    assert sorted(p.name for p in parts.iterdir()) == ["part-0", "part-1", "part-2"]
    run = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--partitions",
                str(parts),
                "--hidden",
                "16",
                "--stages",
                "3",
                "--rounds",
                "20,10",
                "--profile",
                "exact",
                "--out",
                str(run),
            ]
        )
        == 0
    )
    summary = json.loads((run / "summary.json").read_text())
    assert set(summary) >= SUMMARY_KEYS
    assert [s["rounds_run"] for s in summary["stages"]] == [20, 10, 10]
    config = json.loads((run / "config.json").read_text())
    assert config["rounds"] == [20, 10]
    # What trained, not the flags' defaults (Cora, 4): the folders' count and their dataset.
    assert (config["clients"], config["dataset"]) == (3, "sbm:400,3,8,0.85")
    assert (summary["config"]["clients"], summary["config"]["dataset"]) == (3, "sbm:400,3,8,0.85")
    assert (run / "val_accuracy.png").stat().st_size > 1000 and (run / "bytes.png").stat().st_size > 1000
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert sum(e["event"] == "round" for e in events) == 40
    err = capsys.readouterr().err
    assert "stage 2 round" in err and "test accuracy" in err


def test_centralized_on_cora(tmp_path, data_root):
    run = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--mode",
                "centralized",
                "--dataset",
                "Cora",
                "--root",
                str(data_root),
                "--hidden",
                "64",
                "--rounds",
                "100",
                "--out",
                str(run),
            ]
        )
        == 0
    )
    summary = json.loads((run / "summary.json").read_text())
    assert summary["test_accuracy"] >= 0.78


def test_corrupt_partition_is_a_clear_error(tmp_path, capsys):
    parts = tmp_path / "parts"
    main(["partition", "--dataset", "sbm:300,3", "--clients", "2", "--method", "metis", "--out", str(parts)])
    x = np.load(parts / "part-1" / "x.npy")
    x[0, 0] = np.nan
    np.save(parts / "part-1" / "x.npy", x)
    assert main(["train", "--partitions", str(parts), "--rounds", "1"]) == 2
    err = capsys.readouterr().err
    assert "part-1" in err and "x.npy" in err and "checksum" in err


def test_partitions_set_the_clients_and_a_refused_set_leaves_no_run_folder(tmp_path, capsys):
    import shutil

    parts = tmp_path / "parts"
    main(["partition", "--dataset", "sbm:300,3", "--clients", "3", "--method", "random", "--out", str(parts)])
    capsys.readouterr()
    run = tmp_path / "run"
    # An explicit --clients the folders do not hold is refused, naming both counts.
    train = ["train", "--partitions", str(parts), "--rounds", "1", "--out", str(run)]
    assert main([*train, "--clients", "8"]) == 2
    assert "--clients 8, but" in capsys.readouterr().err and not run.exists()
    # A cut with a partition missing: the folder is named, and no run folder is left behind.
    shutil.rmtree(parts / "part-1")
    assert main(train) == 2
    err = capsys.readouterr().err
    assert "declare 3 partitions and 1 are missing (part-1)" in err and not run.exists()


def test_a_run_over_partitions_records_the_cut_it_trains_on(tmp_path, capsys):
    import json

    parts = tmp_path / "parts"
    cut = [
        "--dataset",
        "sbm:300,3",
        "--clients",
        "3",
        "--method",
        "random",
        "--split",
        "random:0.5,0.25,0.25",
    ]
    main(["partition", *cut, "--out", str(parts)])
    run = tmp_path / "run"
    argv = ["train", "--partitions", str(parts), "--stages", "2", "--rounds", "2", "--out", str(run)]
    assert main(argv) == 0
    capsys.readouterr()
    recorded = json.loads((run / "config.json").read_text())
    # It recorded the flags' defaults: Cora, its public split, METIS.
    assert recorded["dataset"] == json.loads((parts / "part-0" / "manifest.json").read_text())["dataset"]
    assert (recorded["method"], recorded["split"], recorded["clients"]) == (
        "random",
        "random:0.5,0.25,0.25",
        3,
    )


def test_partition_with_owners_keeps_each_partys_nodes_with_it(tmp_path, capsys):
    import json

    import numpy as np

    from retexo_fl.data.partition import load_partition

    rng = np.random.default_rng(0)
    n, sites = 60, ["north", "south", "east"]
    rows = "".join(f"P{i:02d},{rng.random():.3f},{['flu', 'ok'][i % 2]},{sites[i % 3]}\n" for i in range(n))
    (tmp_path / "nodes.csv").write_text("patient,age,diagnosis,site\n" + rows)
    edges = "".join(f"P{rng.integers(n):02d},P{rng.integers(n):02d}\n" for _ in range(200))
    (tmp_path / "edges.csv").write_text("source,target\n" + edges)
    (tmp_path / "owners.csv").write_text(
        "patient,site\n" + "".join(f"P{i:02d},{sites[i % 3]}\n" for i in range(n))
    )
    nodes = tmp_path / "nodes.csv"
    dataset = f"files:edges={tmp_path / 'edges.csv'},features={nodes},labels={nodes},id-column=patient"
    argv = ["partition", "--dataset", dataset + ",label-column=diagnosis", "--split", "random:0.6,0.2,0.2"]
    argv += ["--owners", str(tmp_path / "owners.csv")]
    parts = tmp_path / "parts"
    assert main([*argv, "--clients", "4", "--out", str(parts)]) == 2
    assert "--clients 4, but" in capsys.readouterr().err
    for method in ("random", "metis"):  # metis, the default without --owners, too: nothing places
        assert main([*argv, "--method", method, "--out", str(parts)]) == 2
        assert "--method with --owners" in capsys.readouterr().err
    assert main([*argv, "--out", str(parts)]) == 0
    capsys.readouterr()
    for pid, site in enumerate(sorted(sites)):  # parties numbered in sorted order
        meta = load_partition(parts / f"part-{pid}").meta
        ids = np.load(parts / f"part-{pid}" / "node_ids.npy")
        assert (meta["party"], meta["method"], meta["class_names"]) == (site, "owners", ["flu", "ok"])
        # Each party holds exactly its own patients, and their names row for row.
        assert meta["node_names"] == [f"P{i:02d}" for i in ids]
        assert {sites[i % 3] for i in ids} == {site} and len(ids) == n // 3
    # Training over the folders records the cut, the owners' method included.
    run = tmp_path / "run"
    assert (
        main(["train", "--partitions", str(parts), "--stages", "2", "--rounds", "2", "--out", str(run)]) == 0
    )
    assert json.loads((run / "config.json").read_text())["method"] == "owners"


def test_two_run_folders_are_refused_not_the_last_taken(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--out", "runs/a", "--out-dir", "runs/b"])
    assert "--out-dir runs/b: the run folder is already given as runs/a" in capsys.readouterr().err


def test_unknown_setting_is_refused(capsys):
    # The flag's choices are the setting's declared Literal: argparse refuses before any work.
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--dataset", "sbm:100,2", "--model", "transformer", "--rounds", "1"])
    assert exit_.value.code == 2
    assert "--model: invalid choice: 'transformer'" in capsys.readouterr().err
    # The same value from a run config or a script is refused by name, too.
    with pytest.raises(
        ValueError, match="model must be one of gcn, sage, sage-max, gat, mlp; got 'transformer'"
    ):
        TrainConfig.from_mapping({"model": "transformer"})


def test_compression_flags(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--dataset", "sbm:300,3", "--clients", "3", "--method", "random", "--stages", "3"]
    argv += ["--rounds", "3", "--hidden", "16", "--bit-policy", "adaptive-budget"]
    argv += ["--update-bits", "8", "--rate-schedule", "step:2,6", "--out", str(out)]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["rate_schedule"] == "step:2,6" and summary["config"]["update_bits"] == 8
    assert summary["bytes_boundary"] < summary["bytes_boundary_raw"] / 4
    assert sum(summary["bit_histogram"].values()) > 0
    # A schedule's rate is the adaptive budget: the second exchange may spend more bits.
    first, second = (s["bytes_boundary_sent"] for s in summary["stages"][:2])
    assert second > first
    assert main(["train", "--dataset", "sbm:100,2", "--bits", "3", "--rounds", "1"]) == 2
    assert "bits must be one of 1, 2, 4, 8, 16, 32, got 3" in capsys.readouterr().err  # not update-bits


def test_the_apps_run_config_is_a_valid_train_config():
    # Every key a user can override with `flwr run --run-config` must name a setting; a typo in
    # pyproject.toml would otherwise surface only on a federation.
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    app_config = tomllib.loads(pyproject.read_text())["tool"]["flwr"]["app"]["config"]
    cfg = TrainConfig.from_mapping(app_config)
    assert {"self-training", "pseudo-threshold", "pseudo-per-class"} <= set(app_config)
    assert cfg.pseudo_per_class == 0 and cfg.pseudo_threshold == 0.6
    # ... and every setting the Flower app uses must be there: Flower refuses an override of a
    # key the table lacks (`--run-config "norm='none'"` failed that way). Left out: the settings
    # of modes the Flower app does not run (centralized, data-center).
    not_flower = {"central-layers", "algorithm", "procs", "replication", "trusted-cluster"}
    settings = {f.name.replace("_", "-") for f in dataclasses.fields(TrainConfig)} - {"extra"}
    assert sorted(settings - set(app_config) - not_flower) == []


def test_engines_come_from_entry_points_not_imports():
    from retexo_fl.cli import ENGINE_GROUP, engines, load_engine

    # pyproject.toml registers Flower's simulation engine; the library never imports server/.
    assert "simulation" in engines()
    assert load_engine("simulation").__module__ == "server.simulation"
    with pytest.raises(ValueError, match=f"engine 'warp'.*{ENGINE_GROUP}"):
        load_engine("warp")


def test_a_misspelt_flag_value_is_refused_not_read_as_false(tmp_path, capsys):
    # `--secure-aggregation on` ran without secure aggregation: every unknown word read as false.
    for words in (["--secure-aggregation", "ture"], ["--encrypt", "flase"]):
        with pytest.raises(SystemExit) as exit_:
            main(["train", "--dataset", "sbm:100,2", *words])
        assert exit_.value.code == 2
        assert f"{words[0]}: expected true or false (or yes / no, on / off, 1 / 0), got '{words[1]}'" in (
            capsys.readouterr().err
        )
    out = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--dataset",
                "sbm:100,2",
                "--mode",
                "local",
                "--clients",
                "3",
                "--rounds",
                "1",
                "--self-training",
                "0",
                "--secure-aggregation",
                "on",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert json.loads((out / "config.json").read_text())["secure_aggregation"] is True


def test_a_failed_rerun_leaves_the_earlier_run_folder_as_it_was(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", "--dataset", "sbm:100,2", "--mode", "centralized", "--rounds", "2", "--out", str(out)]
    assert main(args) == 0
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    # A bad split or device was found after config.json was rewritten and events.jsonl truncated
    # beside the old summary; a rerun into a finished folder is now refused as a whole.
    for extra in (["--split", "random:a,b"], ["--device", "tpu"], []):
        assert main([*args, *extra]) == 2
        capsys.readouterr()
    assert main(args) == 2
    assert "holds a finished run (summary.json)" in capsys.readouterr().err
    # Flower's simulation engine is held to the same check, before the server writes the folder.
    assert main(["train", "--engine", "simulation", "--dataset", "sbm:100,2", "--out", str(out)]) == 2
    assert "holds a finished run (summary.json)" in capsys.readouterr().err
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before
    # A partitioner that does not exist is refused before its folder is made.
    new = tmp_path / "new"
    assert main(["train", "--dataset", "sbm:100,2", "--method", "bogus", "--out", str(new)]) == 2
    assert "method must be one of" in capsys.readouterr().err and not new.exists()


def test_an_interrupted_run_is_neither_overwritten_nor_promised_a_resume_it_cannot_have(
    tmp_path, capsys, monkeypatch
):
    import retexo_fl.cli as cli

    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "checkpoint.pt").write_bytes(b"a checkpoint")
    args = ["train", "--dataset", "sbm:100,2", "--rounds", "1", "--out", str(out)]
    # A fresh run into a resumable run's folder: refused, the folder as it was.
    assert main(args) == 2
    assert "holds an interrupted run (checkpoint.pt): continue it with --resume" in capsys.readouterr().err
    assert sorted(f.name for f in out.iterdir()) == ["checkpoint.pt", "config.json"]

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_train", interrupted)  # the parser takes it when main builds it
    assert main(args) == 130
    hint = f"{out} holds the run so far: --resume {out} --engine simulation continues it"
    assert hint in capsys.readouterr().err
    fresh = tmp_path / "fresh"  # an in-process run keeps no checkpoint: no resume is offered
    assert main([*args[:-1], str(fresh)]) == 130
    assert "no checkpoint to resume from" in capsys.readouterr().err


def test_settings_given_with_resume_are_said_to_be_ignored(tmp_path, capsys, monkeypatch):
    import retexo_fl.cli as cli

    def engine(name):
        def run(cfg):
            raise ValueError(f"stopped before {name} started")

        return run

    monkeypatch.setattr(cli, "load_engine", engine)
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text("{}")
    resume = ["train", "--engine", "simulation", "--resume", str(out)]
    assert main([*resume, "--rounds", "8", "--seed", "5"]) == 2
    err = capsys.readouterr().err
    assert ": a resumed run trains with the settings it started with" in err
    assert "--rounds" in err and "--seed" in err


def test_partitions_go_to_a_new_folder_so_no_stale_part_is_left(tmp_path, capsys):
    parts = tmp_path / "parts"
    cut = ["partition", "--dataset", "sbm:200,4", "--split", "random:0.6,0.2,0.2", "--method", "random"]
    assert main([*cut, "--clients", "4", "--out", str(parts)]) == 0
    assert main([*cut, "--clients", "2", "--out", str(parts)]) == 2
    assert "not an empty folder" in capsys.readouterr().err
    assert sorted(p.name for p in parts.iterdir()) == ["part-0", "part-1", "part-2", "part-3"]


def test_an_interrupted_cut_leaves_no_partial_set(tmp_path, capsys, monkeypatch):
    import retexo_fl.data.partition as partition_module

    save = partition_module.save_partition
    written: list[str] = []

    def interrupted_after_two(part, directory):
        if len(written) == 2:
            raise KeyboardInterrupt
        written.append(str(directory))
        return save(part, directory)

    monkeypatch.setattr(partition_module, "save_partition", interrupted_after_two)
    parts = tmp_path / "parts"
    cut = ["partition", "--dataset", "sbm:200,4", "--clients", "4", "--method", "random", "--out", str(parts)]
    assert main(cut) == 130
    assert len(written) == 2 and not parts.exists()
    assert list(tmp_path.iterdir()) == []  # nor the staging folder
    parts.mkdir()  # an empty --out is taken, as before; interrupted, it stays empty
    assert main(cut) == 130 and list(parts.iterdir()) == []
    monkeypatch.setattr(partition_module, "save_partition", save)
    monkeypatch.chdir(parts)  # "--out ." (a folder that cannot be replaced by a rename)
    assert main([*cut[:-1], "."]) == 0
    assert sorted(p.name for p in parts.iterdir()) == ["part-0", "part-1", "part-2", "part-3"]
    fresh = tmp_path / "fresh"  # a new folder: the staging folder, renamed, with the usual mode
    assert main([*cut[:-1], str(fresh)]) == 0
    assert (fresh.stat().st_mode & 0o777) == 0o777 & ~_umask()


def _umask() -> int:
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_help_shows_each_default_as_the_flag_takes_it_and_what_modes_set_instead(capsys):
    from retexo_fl.config import LAZY_PARTITION_DEFAULTS, MODE_DEFAULTS

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "default adam,avg" in text and "['adam', 'avg']" not in text  # the flag refused that form
    # Read from the tables resolve() applies: a lazy run over partitions and centralized mode.
    lazy = "a lazy run over partitions (not the exact profile, secure aggregation, DP or boundary noise)"
    assert f"default 0.0; {lazy}: {LAZY_PARTITION_DEFAULTS['mlp_weight_decay']}" in text
    assert f"centralized mode: {MODE_DEFAULTS['centralized']['hidden']}" in text
