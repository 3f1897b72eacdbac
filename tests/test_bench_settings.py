"""The benchmarks' fixed settings: what they claim to spell out, they spell out."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from retexo_fl.cli import _config_from_args, build_parser

BENCH = Path(__file__).resolve().parents[1] / "bench"

#: TrainConfig's training defaults at commit 6514f59 (2026-11-23), the "previous defaults" that
#: bench/rounds.py compares against: 5 stages x 200 rounds, one SGD step a round, server Adam.
#: Read from that commit's retexo_fl/config.py, not from a run.
DEFAULTS_2026_11_23 = {
    "model": "gcn", "stages": 5, "central_layers": 2, "hidden": 256, "pass_embedding": "hidden",
    "self_training": 0, "pseudo_threshold": 0.9, "pseudo_per_class": 0, "rounds": 200,
    "local_epochs": 1, "optimizer": "sgd", "momentum": 0.0, "lr": 1.0, "server_optimizer": "adam",
    "server_lr": 0.01, "weight_decay": 0.0005, "dropout": 0.5, "input_dropout": 0.5,
    "norm": "layer", "heads": 4, "patience": 0, "min_rounds": 0, "precompute": False,
    "drift_correction": "none", "bits": 32, "bit_policy": "fixed", "update_bits": 32,
    "broadcast_bits": 32, "range_dtype": "fp16",
}  # fmt: skip

#: Settings added since, whose defaults must still mean "off" for the previous defaults to hold.
ADDED_SINCE_OFF = {
    "halo_gradients": False, "boundary_noise": 0.0, "boundary_clip": 0.0,
    "secure_aggregation": False,
}  # fmt: skip


def _load(name: str) -> ModuleType:
    """``bench/<name>.py`` as a module; ``sys.path`` as it was (the script adds ``bench/`` itself)."""
    saved = list(sys.path)
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path[:] = saved


def test_rounds_previous_flags_give_the_previous_defaults():
    """A default that changes after PREVIOUS was written must be pinned in it, or this fails.

    It failed once: PREVIOUS lacked ``--self-training 0`` and ``--norm layer`` after those defaults
    changed, so the "previous" row ran 10 stages (2,000 rounds) with no norm.
    """
    rounds = _load("rounds")
    args = build_parser().parse_args(["train", "--dataset", "Cora", *rounds.PREVIOUS])
    config = _config_from_args(args)
    got = {name: getattr(config, name) for name in DEFAULTS_2026_11_23 | ADDED_SINCE_OFF}
    assert got == DEFAULTS_2026_11_23 | ADDED_SINCE_OFF


def test_robustness_gap_standard_error_pairs_runs_by_seed():
    """The gap's standard error is that of the differences split by split: a lazy run that
    trails its split's reference by the same amount on every split has none, however far the
    splits' accuracies spread; runs without a pair (another seed or split) are left out."""
    robustness = _load("robustness")
    ref = [{"seed": s, "test_accuracy": a} for s, a in ((0, 0.60), (1, 0.70), (2, 0.80), (7, 0.5))]
    steady = [{"seed": s, "test_accuracy": a} for s, a in ((0, 0.58), (1, 0.68), (2, 0.78))]
    assert robustness.paired_gap_se(steady, ref) == pytest.approx(0.0, abs=1e-12)
    # gaps -0.02, +0.02, -0.06: stdev 0.04, over sqrt(3)
    noisy = [{"seed": s, "test_accuracy": a} for s, a in ((0, 0.58), (1, 0.72), (2, 0.74), (5, 0.1))]
    assert robustness.paired_gap_se(noisy, ref) == pytest.approx(0.04 / 3**0.5)
    assert robustness.paired_gap_se(noisy[:1], ref) is None
    # a seed's run on another split is not its pair
    other_split = [dict(r, split_index=1) for r in steady]
    assert robustness.paired_gap_se(other_split, ref) is None


def _row(method: str, seed: int, val: float, test: float, **extra: object) -> dict:
    return {
        "_graph": "g",
        "_method": method,
        "seed": seed,
        "val_accuracy": val,
        "test_accuracy": test,
        **extra,
    }


#: What a lazy row carries besides its accuracies, for :func:`summarize`.
_LAZY = {"rounds": 10, "bytes_total": 1, "wall_seconds": 1.0, "kept_stage": 0, "stage0_val": 0.5}


def test_robustness_table_gives_the_gcns_wall_seconds_where_its_runs_have_them():
    """A cell carries the centralized GCN's mean wall seconds beside lazy's; rows saved without
    them (by hand) leave the figure out rather than fail."""
    robustness = _load("robustness")
    lazy = _row("lazy", 0, 0.6, 0.65, _part="metis-4", _tag="t", **_LAZY)
    timed = [_row("central-gcn", s, 0.7, 0.7, wall_seconds=w) for s, w in ((0, 3.0), (1, 5.0))]
    assert robustness.summarize([*timed, lazy])[0]["central-gcn_wall_seconds"] == pytest.approx(4.0)
    untimed = [timed[0], _row("central-gcn", 1, 0.7, 0.7)]
    assert "central-gcn_wall_seconds" not in robustness.summarize([*untimed, lazy])[0]


def test_robustness_attribution_splits_a_gap_into_lazy_training_and_the_partitioning():
    """--attribute: the one-client run's gap to the reference is lazy training's share, the rest
    the partitioning's, and the larger share names the cause of a cell more than 1 point below."""
    robustness = _load("robustness")
    whole, part = robustness.WHOLE_METHOD, robustness.WHOLE_PART
    rows = [
        # the GCN validates best, and tests 0.70 on both seeds
        *(_row("central-gcn", s, 0.70, 0.70) for s in (0, 1)),
        *(_row("central-mlp", s, 0.60, 0.80) for s in (0, 1)),
        # METIS trails by 5 points; the whole graph on one client (0.68, 0.70) by 1: the partitioning's 4
        *(_row("lazy", s, 0.6, 0.65, _part="metis-4", _tag="t", **_LAZY) for s in (0, 1)),
        # random-10 trails by 3 points: lazy training's 1 of them, the partitioning's 2
        *(_row("lazy", s, 0.6, 0.67, _part="random-10", _tag="t", **_LAZY) for s in (0, 1)),
        *(_row(whole, s, 0.6, a, _part=part, _tag="t") for s, a in ((0, 0.68), (1, 0.70))),
        # another tag's cell has no one-client runs: no split
        _row("lazy", 0, 0.6, 0.60, _part="metis-4", _tag="u", **_LAZY),
    ]  # fmt: skip
    cells = {(c["partitioning"], c["tag"]): c for c in robustness.summarize(rows)}
    assert set(cells) == {("metis-4", "t"), ("random-10", "t"), ("metis-4", "u")}
    metis, random10 = cells["metis-4", "t"], cells["random-10", "t"]
    assert metis["gap"] == pytest.approx(-0.05)
    assert metis["whole_gap"] == pytest.approx(-0.01)
    assert metis["partition_gap"] == pytest.approx(-0.04)
    assert random10["partition_gap"] == pytest.approx(-0.02)
    assert "whole_gap" not in cells["metis-4", "u"]
    assert robustness.cause(metis).startswith("the partitioning and federation")
    assert robustness.cause(random10).startswith("the partitioning and federation")
    assert robustness.cause(cells["metis-4", "u"]) is None
    # a cell whose one-client run trails further than the partitioning costs: lazy training's
    lazy_own = dict(metis, gap=-0.05, whole_gap=-0.04, partition_gap=-0.01, whole_gap_se=None)
    assert robustness.cause(lazy_own) == (
        "lazy training itself (one client holding the whole graph -4.0, the partitioning -1.0)"
    )
    # the one-client gaps -2 and 0 points: a standard error of 1 point, given with the share
    assert "the whole graph -1.0 ± 1.0, the partitioning -4.0" in robustness.cause(metis)
    # within 1 point: no cause to give
    assert robustness.cause(dict(metis, gap=-0.009)) is None


def test_codec_updates_are_the_states_a_lazy_stage_sends_timed_both_ways(tmp_path):
    import argparse
    import json

    import torch

    from retexo_fl.models.stage import StageModel

    codec = _load("codec")
    # The timed states are those of the stages they are named after (lazy runs use no norm).
    for (_, shapes), (kind, in_dim) in zip(codec.UPDATE_STATES, (("mlp", 2325), ("gcn", 32)), strict=True):
        model = StageModel(kind, in_dim, 32, 5, norm="none")
        assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == shapes
    out = tmp_path / "updates.json"
    args = argparse.Namespace(calls=2, repeats=1, out=str(out))
    assert codec.updates(args) == 0
    record = json.loads(out.read_text())
    rows = record["updates"]
    assert [(r["state"], r["bits"]) for r in rows] == [(s, b) for s, _ in codec.UPDATE_STATES for b in (4, 8)]
    paths = ("", "torch_ops_") if record["compiled_loops"] else ("",)
    assert all(r[f"{p}{t}_ms"] > 0 for r in rows for p in paths for t in ("encode", "decode"))
    assert rows[0]["values"] == 32 * 2325 + 32 + 5 * 32 + 5
    assert torch.get_num_threads() == record["threads"]


def test_codec_generated_compiles_the_ops_the_loops_stand_for():
    """``codec.py --generated`` compiles torch ops and compares them with the compiled loops:
    uncompiled, those ops must give the loops' ranges, codes and rows bit for bit (on rows with
    ties, rows of one value and rows that round inward), or a mismatch it reports would be the
    bench's own."""
    import pytest
    import torch

    from retexo_fl.compress import native

    if not native.usable(torch.zeros(1)):
        pytest.skip("no compiled loops here")
    codec = _load("codec")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(300, 48, generator=gen) * 3
    x[0] = 1.0  # one value: a zero span
    x[1, :] = torch.tensor(65504.0).nextafter(torch.tensor(0.0))  # rounds up to fp16's largest
    x[2, ::2] = -1.8987  # rounds inward to fp16: stepped outward
    table, shift = torch.rand(7, 48, generator=gen), torch.rand(300, generator=gen)
    lo, hi = native.row_ranges(x, torch.float16)
    assert all(torch.equal(a, b) for a, b in zip(codec._ranges_ops(x), (lo, hi), strict=True))
    codes = codec._loop_codes(x, table, shift, lo, hi).view(300, 48)
    assert torch.equal(codec._codes_ops(x, table, shift, lo, hi), codes)
    step = (hi.float() - lo.float()) / 255.0
    assert torch.equal(codec._decode_ops(codes, lo.float(), step), native.dequantize(codes, lo.float(), step))


def test_robustness_rows_carry_each_stage_and_each_stage_0_trainings_seconds():
    """A lazy row splits its wall by stage, and under first-stage auto stage 0's by training, from
    the run's own summary: no second run is needed to see where a run's time went."""
    from retexo_fl.config import TrainConfig
    from retexo_fl.metrics import RunRecorder
    from retexo_fl.runner import train

    robustness = _load("robustness")
    common = {
        "dataset": "sbm:300,3,8,0.9", "clients": 3, "method": "metis", "stages": 2, "hidden": 16,
        "seed": 0, "self_training": 0, "rounds": 3, "min_rounds": 0, "patience": 0,
    }  # fmt: skip
    labels = {"_graph": "g", "_method": "lazy", "_part": "metis-3"}
    auto = {**common, "first_stage": "auto", "first_stage_race": 0}
    summary = train(TrainConfig.resolve(**auto), RunRecorder(None, stream=None))
    row = robustness.run_row({**labels, **auto}, summary)
    assert "dataset" not in row and row["_graph"] == "g"
    stages = summary["stages"]
    assert row["stage_seconds"] == [s["seconds"] for s in stages] and len(stages) == 2
    assert all(s > 0 for s in row["stage_seconds"])
    assert sum(row["stage_seconds"]) <= row["wall_seconds"]
    trials = {t["variant"]: t for t in stages[0]["first_stage_trials"]}
    assert row["stage0_trial_seconds"] == {v: t["seconds"] for v, t in trials.items()}
    assert set(row["stage0_trial_seconds"]) == {"mlp", "local", "sprint"}
    # In parallel (the default over partitions) the trainings share stage 0's rounds: each one's
    # seconds run to where it ended, the stage's to where the longer one did.
    assert stages[0]["first_stage_schedule"] == "parallel"
    assert max(row["stage0_trial_seconds"].values()) == row["stage_seconds"][0]
    assert max(row["stage0_trial_rounds"].values()) == stages[0]["rounds_sent"]
    # One after the other, each training's seconds and rounds add up to the stage's.
    sequential = {**auto, "first_stage_schedule": "sequential"}
    one_by_one = train(TrainConfig.resolve(**sequential), RunRecorder(None, stream=None))
    row = robustness.run_row({**labels, **sequential}, one_by_one)
    stage0 = one_by_one["stages"][0]
    assert sum(row["stage0_trial_seconds"].values()) <= row["stage_seconds"][0]
    assert sum(row["stage0_trial_rounds"].values()) == stage0["rounds_sent"]
    # one stage-0 training: nothing to split
    fixed = {**common, "first_stage": "mlp"}
    alone = train(TrainConfig.resolve(**fixed), RunRecorder(None, stream=None))
    plain = robustness.run_row({**labels, **fixed}, alone)
    assert "stage0_trial_seconds" not in plain and len(plain["stage_seconds"]) == 2


def test_a_robustness_row_reads_the_chains_stages_and_the_sprint_apart():
    """A tested sprint lane's row in ``stage_results`` (it names its ``variant``) is not stage 0:
    ``stage0_val`` and ``stage_vals`` are the chain's, the sprint's figures its own."""
    robustness = _load("robustness")
    stage = {"pass": 0, "val_loss": 1.0, "eligible": True}
    summary = {
        "test_accuracy": 0.7,
        "val_accuracy": 0.8,
        "wall_seconds": 1.0,
        "kept_stage": 0,
        "kept_variant": "sprint",
        "stage_results": [
            {**stage, "stage": 0, "val_accuracy": 0.8, "test_accuracy": 0.7, "variant": "sprint"},
            {**stage, "stage": 0, "val_accuracy": 0.6, "test_accuracy": 0.65},
            {**stage, "stage": 1, "val_accuracy": 0.75, "test_accuracy": 0.72},
        ],
    }
    row = robustness.run_row({"_graph": "g"}, summary)
    assert (row["stage0_val"], row["stage_vals"], row["stage_tests"]) == (0.6, [0.6, 0.75], [0.65, 0.72])
    assert (row["sprint_val"], row["sprint_test"], row["kept_variant"]) == (0.8, 0.7, "sprint")
    del summary["kept_variant"], summary["stage_results"][0]
    assert not {"sprint_val", "kept_variant"} & set(robustness.run_row({"_graph": "g"}, summary))
