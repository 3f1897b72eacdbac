"""TrainConfig: one flat set of user-facing keys, grouped into sections each package validates."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import tomllib

from retexo_fl.compress.settings import CompressionSettings
from retexo_fl.config import (
    MODES,
    PER_STAGE,
    SECTIONS,
    ModelSettings,
    TrainConfig,
    TrainingSettings,
    parse_list,
    settings,
)
from retexo_fl.data.settings import DataSettings
from retexo_fl.datacenter.settings import DatacenterSettings
from retexo_fl.secure.settings import SecuritySettings

ROOT = Path(__file__).resolve().parents[1]

# The user-facing keys (run config and CLI, kebab-case). Users write these in pyproject.toml,
# scripts and `flwr run --run-config`: a rename breaks them, so a rename must fail here.
USER_KEYS = {
    "mode", "dataset", "data-root", "split", "split-index", "clients", "method", "partitions",
    "seed", "model", "stages", "central-layers", "eager-model", "hidden", "pass-embedding", "self-training",
    "pseudo-threshold", "pseudo-per-class", "pass-init", "rounds", "local-epochs", "mlp-local-epochs",
    "mlp-weight-decay", "optimizer", "momentum", "lr", "server-optimizer", "server-lr", "weight-decay",
    "dropout", "input-dropout", "norm", "heads", "root-weight", "gnn-input-rms-floor", "first-stage",
    "first-stage-first", "first-stage-race", "first-stage-race-margin", "first-stage-schedule", "local-hops",
    "first-stage-sprint", "first-stage-sprint-hops", "first-stage-sprint-dropout",
    "patience", "min-rounds", "warm-min-rounds", "stop-metric",
    "drift-correction", "halo-gradients", "fraction-train", "clients-per-round", "validate-every",
    "precompute",
    "device", "round-seconds", "step-delay",
    "profile", "threads", "cohorts",
    "chunk-rows", "bits", "bit-policy", "byte-budget", "link-bandwidths", "time-budget",
    "rate-schedule", "update-bits", "broadcast-bits", "range-dtype", "encrypt", "identity-keys",
    "pinned-keys", "dp-noise", "dp-clip", "dp-delta", "dp-reproducible",
    "boundary-clip", "boundary-noise", "secure-aggregation", "secagg-threshold", "secagg-clip",
    "min-clients", "on-missing-halo",
    "client-timeout", "resume", "audit", "algorithm", "procs", "replication", "trusted-cluster",
    "out-dir",
}  # fmt: skip


def _flat_names() -> set[str]:
    return {f.name for f in dataclasses.fields(TrainConfig)} - {"extra"}


def test_user_facing_keys_are_unchanged():
    assert {n.replace("_", "-") for n in _flat_names()} == USER_KEYS


def test_every_key_belongs_to_exactly_one_section():
    owners: dict[str, list[str]] = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            owners.setdefault(f.name, []).append(section)
    assert set(owners) == _flat_names()
    assert {k: v for k, v in owners.items() if len(v) > 1} == {}


def test_sections_mirror_the_flat_fields_and_are_read_only():
    cfg = TrainConfig(dataset="CiteSeer", bits=4, encrypt=False, min_clients=2, procs=8, hidden=64)
    assert cfg.data == DataSettings(**{**dataclasses.asdict(DataSettings()), "dataset": "CiteSeer"})
    assert cfg.compression.bits == 4 and isinstance(cfg.compression, CompressionSettings)
    assert cfg.security.encrypt is False and isinstance(cfg.security, SecuritySettings)
    assert cfg.failures.min_clients == 2
    assert cfg.datacenter == DatacenterSettings(procs=8)
    assert cfg.architecture.hidden == 64 and cfg.architecture.model == cfg.model
    assert set(cfg.sections()) == set(SECTIONS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.compression.bits = 8  # type: ignore[misc]


def test_from_sections_round_trips_and_refuses_strangers():
    cfg = TrainConfig(dataset="PubMed", stages=3, rounds=[50, 20], bits=8, dp_noise=0.5, algorithm="2d")
    again = TrainConfig.from_sections(extra={"note": 1}, **cfg.sections())
    assert dataclasses.replace(again, extra={}) == cfg and again.extra == {"note": 1}
    # An omitted section takes its defaults.
    only = TrainConfig.from_sections(compression=CompressionSettings(bits=2))
    assert only.bits == 2 and only.hidden == TrainConfig().hidden
    # Omitted sections take the given mode's defaults (resolve); a given section is given whole.
    eager = TrainConfig.from_sections(training=TrainingSettings(mode="eager", self_training=0))
    assert (eager.hidden, eager.update_bits) == (64, 32)  # architecture, compression: eager's
    assert eager.rounds == TrainingSettings().rounds  # the training section as given
    with pytest.raises(ValueError, match="unknown section 'network'"):
        TrainConfig.from_sections(network=DataSettings())
    with pytest.raises(TypeError, match="section 'data' must be a DataSettings"):
        TrainConfig.from_sections(data=CompressionSettings())


def test_from_mapping_reads_kebab_keys_and_per_stage_lists():
    cfg = TrainConfig.from_mapping({"rounds": "200,100", "server-lr": "0.01,0.005", "bit-policy": "fixed"})
    assert cfg.rounds == [200, 100] and cfg.server_lr == [0.01, 0.005]
    assert [cfg.per_stage("rounds", s) for s in range(4)] == [200, 100, 100, 100]
    with pytest.raises(ValueError, match=r"unknown setting 'bitz' \(did you mean 'bits'\?\)"):
        TrainConfig.from_mapping({"bitz": 4})
    with pytest.raises(ValueError, match=r"unknown setting 'Rounds' \(did you mean 'rounds'\?\)"):
        TrainConfig.from_mapping({"Rounds": 4})  # an edited config.json's key in another case
    with pytest.raises(ValueError, match=r"unknown setting 'qqqq'$"):
        TrainConfig.from_mapping({"qqqq": 4})


@pytest.mark.parametrize(
    ("values", "section", "message"),
    [
        ({"clients": 0}, "data", "clients must be >= 1"),
        ({"stages": 0}, "architecture", r"stages must be in \[1, 64\]"),
        ({"pass_embedding": "both"}, "architecture", "pass-embedding"),
        ({"mode": "gossip"}, "training", "mode must be one of"),
        ({"server_optimizer": "sgd"}, "training", "server-optimizer"),
        ({"bits": 3}, "compression", "bits must be one of"),
        ({"bit_policy": "adaptive-bandwidth"}, "compression", "needs link-bandwidths"),
        ({"dp_delta": 1.0}, "security", "dp-delta"),
        ({"boundary_noise": 1.0}, "security", "boundary-noise needs boundary-clip"),
        ({"secure_aggregation": True, "encrypt": False}, "security", "secure-aggregation needs encrypt"),
        ({"secagg_clip": 0.0}, "security", "secagg-clip must be"),
        ({"on_missing_halo": "guess"}, "failures", "on-missing-halo"),
        ({"algorithm": "4d"}, "datacenter", "algorithm must be one of"),
        # Each of these ran before: typed from a run config, or out of range, and read by torch.
        (
            {"secure_aggregation": "false"},
            "security",
            "secure-aggregation takes true or false; got the text 'false': write it unquoted "
            r"\(secure-aggregation=false\)",
        ),
        ({"hidden": "64"}, "architecture", "hidden takes a whole number; got '64'"),
        ({"hidden": 0}, "architecture", r"hidden must be in \[1, 65536\]"),
        # Sizes a server's run config could set to take a party's memory or machine for good.
        ({"hidden": 10**9}, "architecture", r"hidden must be in \[1, 65536\], got 1000000000"),
        ({"heads": 1000}, "architecture", r"heads must be in \[1, 64\]"),
        ({"local_epochs": 10**12}, "training", r"local-epochs must be in \[1, 100000\]"),
        ({"rounds": 10**9}, "training", r"rounds must be in \[0, 1000000\]"),
        ({"self_training": 1000}, "training", "self-training must be at most 64 passes"),
        ({"mlp_local_epochs": 10**6}, "training", r"mlp-local-epochs must be in \[0, 100000\]"),
        ({"dropout": 1.5}, "architecture", r"dropout must be in \[0, 1\)"),
        ({"input_dropout": [0.5, 1.0]}, "architecture", r"input-dropout must be in \[0, 1\)"),
        ({"rounds": 2.5}, "training", "rounds takes a whole number; got 2.5"),
        ({"lr": float("nan")}, "training", "lr takes a finite number"),
        ({"lr": -1.0}, "training", "lr must be >= 0 and server-lr > 0"),
        ({"momentum": 1.0}, "training", r"momentum must be in \[0, 1\)"),
        ({"seed": 2**70}, "training", "seed must be in"),
        ({"rounds": [2, 2, 2, 2]}, "training", "rounds has 4 values for 3 stage"),
        ({"round_seconds": -1.0, "mode": "local"}, "training", "round-seconds must be >= 0"),
        ({"round_seconds": 0.5}, "training", "round-seconds applies to local and eager"),
        ({"client_timeout": float("nan")}, "failures", "client-timeout takes a finite number"),
        ({"stages": "2"}, "architecture", "stages takes a whole number; got '2'"),
        ({"dp_noise": "0.5"}, "security", "dp-noise takes a number; got '0.5'"),
        ({"bits": "8"}, "compression", "bits takes a whole number; got '8'"),
    ],
)
def test_each_section_validates_its_own_keys(values, section, message):
    cfg = TrainConfig.resolve(**values)
    # Sections whose checks need a key of another section take it as an argument.
    context = {"training": {"stages": cfg.stages}, "failures": {"clients": cfg.clients}}
    with pytest.raises(ValueError, match=message):
        getattr(cfg, section).validate(**context.get(section, {}))
    # TrainConfig.validate runs every section's checks.
    with pytest.raises(ValueError, match=message):
        cfg.validate()


def test_checks_across_sections():
    with pytest.raises(ValueError, match=r"min-clients must be in \[0, clients=4\]"):
        TrainConfig(clients=4, min_clients=5).validate()
    with pytest.raises(ValueError, match="square"):
        TrainConfig.resolve(mode="datacenter", algorithm="2d", procs=3).validate()
    # Only a data-center run needs procs to form the algorithm's grid.
    TrainConfig.resolve(mode="lazy", algorithm="2d", procs=3).validate()
    with pytest.raises(ValueError, match="self-training applies to lazy and centralized"):
        TrainConfig.resolve(mode="eager", self_training=1).validate()


def test_edge_profile_fills_only_what_was_left_at_its_default():
    edge = TrainConfig.resolve(profile="edge", bits=4)
    assert (edge.device, edge.threads, edge.chunk_rows) == ("cpu", 1, 4096)
    assert (edge.bits, edge.update_bits, edge.broadcast_bits) == (
        4,
        4,
        4,
    )  # updates and broadcasts: already 4-bit by default


def test_a_config_is_what_it_was_given_however_it_was_built():
    # Built by name or by dataclasses.replace, the same settings are the same config: no
    # constructor remembers what it was given.
    assert TrainConfig(mode="eager") == dataclasses.replace(TrainConfig(), mode="eager")
    assert TrainConfig(mode="eager").hidden == TrainConfig().hidden == 32
    # Mode defaults come from one function, whatever else was given with the mode.
    eager = TrainConfig.resolve(mode="eager")
    lazy = TrainConfig()
    changed = {
        f.name for f in dataclasses.fields(TrainConfig) if getattr(eager, f.name) != getattr(lazy, f.name)
    }
    assert changed == {
        "mode", "hidden", "rounds", "local_epochs", "server_optimizer", "server_lr", "patience",
        "min_rounds", "warm_min_rounds", "self_training", "update_bits", "broadcast_bits", "halo_gradients",
    }  # fmt: skip
    assert (eager.hidden, eager.rounds, eager.halo_gradients, eager.update_bits) == (64, 100, True, 32)
    # What a caller gives stays given, whatever the mode's default is.
    mine = TrainConfig.resolve(hidden=16, seed=3, mode="eager")
    assert (mine.hidden, mine.seed, mine.rounds) == (16, 3, eager.rounds)
    assert TrainConfig.resolve(hidden=32, mode="eager").hidden == 32
    assert TrainConfig.resolve(profile="exact", clients=7) == dataclasses.replace(
        TrainConfig.resolve(profile="exact"), clients=7
    )
    # boundary-noise turns eager's halo gradients off, unless they were given.
    assert TrainConfig.resolve(mode="eager", boundary_clip=1.0, boundary_noise=1.0).halo_gradients is False
    assert TrainConfig.resolve(mode="eager", boundary_noise=1.0, halo_gradients=True).halo_gradients


def test_every_setting_is_declared_once_with_a_type_default_and_doc():
    infos = settings()
    assert [i.name for i in infos] == [f.name for f in dataclasses.fields(TrainConfig)][:-1]
    for info in infos:
        assert info.doc and info.annotation, info.name
        field = next(f for f in dataclasses.fields(TrainConfig) if f.name == info.name)
        # The flat field is the section's own declaration, not a copy kept in step by hand.
        assert field.metadata["doc"] == info.doc and getattr(TrainConfig(), info.name) == info.default
    # Literal types are what validation and the CLI's choices enforce.
    choices = {i.key: i.choices for i in infos if i.choices}
    assert choices["mode"] == ("lazy", "eager", "local", "centralized", "datacenter")
    assert choices["norm"] == ("layer", "none") and choices["range-dtype"] == ("fp16", "bf16")
    assert set(PER_STAGE) == {
        "rounds", "local_epochs", "lr", "weight_decay", "server_optimizer", "server_lr", "dropout",
        "input_dropout",
    }  # fmt: skip
    with pytest.raises(ValueError, match="norm must be one of layer, none; got 'batch'"):
        TrainConfig(norm="batch").validate()
    # A per-stage enumeration takes a comma list of its choices, each checked; a per-stage
    # number takes only numbers.
    per_stage = TrainConfig.from_mapping({"server-optimizer": "adam,avg", "lr": "0.5,1e-2"})
    assert per_stage.server_optimizer == ["adam", "avg"] and per_stage.lr == [0.5, 0.01]
    assert per_stage.per_stage("server_optimizer", 2) == "avg"
    with pytest.raises(ValueError, match=r"weight-decay must be >= 0, got -0\.1 for stage 1"):
        TrainConfig.from_mapping({"weight-decay": "5e-3,-0.1"}).validate()
    with pytest.raises(ValueError, match="mlp-weight-decay must be >= 0"):
        TrainConfig.resolve(mlp_weight_decay=-1.0).validate()
    decay = TrainConfig.from_mapping({"weight-decay": "5e-3,5e-4"})
    assert decay.weight_decay == [0.005, 0.0005] and decay.per_stage("weight_decay", 3) == 0.0005
    assert TrainConfig.from_mapping({"weight-decay": "0"}).per_stage("weight_decay", 0) == 0.0
    with pytest.raises(ValueError, match="server-optimizer must be one of avg, adam; got 'sgd'"):
        TrainConfig.from_mapping({"server-optimizer": "adam,sgd"})
    with pytest.raises(ValueError, match=r"lr takes a number or one per stage \(a comma list\); got 'x'"):
        TrainConfig.from_mapping({"lr": "0.5,x"})
    with pytest.raises(ValueError, match=r"server-lr takes a number .*; got 'fast'"):
        TrainConfig.from_mapping({"server-lr": "0.05,fast"})  # a per-stage default (a list) too
    # Each section's docstring lists its settings, generated from the same declarations.
    assert "hidden (int, optional): hidden width (default: 32)" in ModelSettings.__doc__


# Keys of pyproject.toml's run-config table whose value is not the setting's default, and why.
APP_VALUES_OF_THEIR_OWN = {"out-dir": "runs/flwr"}  # flwr run writes each run under the app folder


def test_the_apps_run_config_table_is_checked_against_the_declarations():
    app = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert set(app) == USER_KEYS - {"central-layers", "algorithm", "procs", "replication", "trusted-cluster"}
    for info in settings():
        if info.key not in app:
            continue  # data-center settings: `flwr run` never trains in that mode
        value = parse_list(app[info.key]) if info.per_stage else app[info.key]
        assert value == APP_VALUES_OF_THEIR_OWN.get(info.key, info.default), info.key
    cfg = TrainConfig.from_mapping(app)
    assert cfg.mode in ("lazy", "eager", "local")


def test_a_run_config_value_set_by_the_submitter_is_kept_even_at_the_lazy_default():
    app = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    fused = {**app, "mode": "eager", "hidden": 32}  # Flower's run config: pyproject's, then overrides
    asked = TrainConfig.from_run_config(fused, overridden=["mode", "hidden"])
    assert (asked.mode, asked.hidden, asked.rounds) == ("eager", 32, TrainConfig.resolve(mode="eager").rounds)
    # Without the submitter's keys, 32 reads as "not given" and eager's own width applies.
    assert TrainConfig.from_run_config(fused).hidden == TrainConfig.resolve(mode="eager").hidden == 64


def test_one_node_per_client_takes_the_node_level_defaults_where_nothing_was_given():
    node = TrainConfig.resolve(method="node")
    assert (node.server_optimizer, node.server_lr, node.clients_per_round) == ("adam", 0.05, 512)
    assert TrainConfig.resolve(method="metis").clients_per_round == 0
    # Where every client must take every round, no cap is set (and the run is not refused).
    for every_round in ({"secure_aggregation": True, "clients": 150}, {"dp_noise": 0.5},
                        {"drift_correction": "scaffold"}):  # fmt: skip
        cfg = TrainConfig.resolve(method="node", **every_round)
        assert cfg.clients_per_round == 0 and cfg.server_lr == 0.05
        cfg.validate()
    assert TrainConfig.resolve(method="node", clients_per_round=0).clients_per_round == 0  # given wins
    for bad in (2.5, -1, True):
        with pytest.raises(ValueError, match=r"clients-per-round (takes|must be) a whole number"):
            TrainConfig.resolve(method="node", clients_per_round=bad).validate()
    assert TrainConfig.resolve(method="node", server_lr=0.1).server_lr == 0.1  # given wins
    metis = TrainConfig.resolve(method="metis")
    assert (metis.server_optimizer, metis.server_lr) == (["adam", "avg"], [0.05, 1.0])
    assert TrainConfig.resolve(method="node", profile="exact").server_lr == 0.01  # exact is exact
    assert TrainConfig.resolve(method="node", mode="eager").server_optimizer == "adam"  # eager's own
    # Through Flower's run config: pyproject's list-valued defaults count as not given (they
    # were compared with a missing default before, so every list-valued key read as given).
    app = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    fused = {**app, "method": "node"}
    for cfg in (TrainConfig.from_run_config(fused), TrainConfig.from_run_config(fused, ["method"])):
        assert (cfg.server_optimizer, cfg.server_lr, cfg.clients_per_round) == ("adam", 0.05, 512)
    assert TrainConfig.from_run_config({**app, "mode": "eager"}).server_lr == 0.01


def test_a_lazy_run_over_partitions_trains_stage_0_both_ways_where_it_can():
    lazy = TrainConfig.resolve(method="metis")
    assert (lazy.first_stage, lazy.first_stage_order, lazy.first_stage_race) == ("auto", ("local", "mlp"), 8)
    assert lazy.first_stage_race_margin == 0.02
    assert TrainConfig().first_stage == "mlp"  # the section's value; resolve applies the default
    # Where auto cannot or should not run, stage 0 stays the MLP, and the run validates.
    for elsewhere in (
        {"method": "node"},  # a client's own subgraph is its node: local is the MLP
        {"profile": "exact"},
        {"secure_aggregation": True, "clients": 4},  # a client masks a stage's rounds once
        {"dp_noise": 0.5},  # a second stage 0 would spend privacy budget
        {"boundary_noise": 0.5, "boundary_clip": 1.0},  # rows accounted one node each
        {"mode": "eager"},
        {"mode": "centralized"},
    ):
        cfg = TrainConfig.resolve(**elsewhere)
        assert cfg.first_stage == "mlp" and cfg.mlp_local_epochs == 0, elsewhere
        assert cfg.mlp_weight_decay == 0 and cfg.gnn_input_rms_floor == 0, elsewhere
        cfg.validate()
    assert lazy.mlp_local_epochs == 1 and TrainConfig().mlp_local_epochs == 0
    assert TrainConfig.resolve(mlp_local_epochs=3).mlp_local_epochs == 3  # given wins
    assert lazy.mlp_weight_decay == 5e-3 and TrainConfig().mlp_weight_decay == 0
    assert TrainConfig.resolve(mlp_weight_decay=0).mlp_weight_decay == 0  # given wins
    assert lazy.gnn_input_rms_floor == 0.25 and TrainConfig().gnn_input_rms_floor == 0
    assert TrainConfig.resolve(gnn_input_rms_floor=0).gnn_input_rms_floor == 0  # given wins
    with pytest.raises(ValueError, match=r"gnn-input-rms-floor must be in \[0, 10\]"):
        TrainConfig.resolve(gnn_input_rms_floor=-0.1).validate()
    assert TrainConfig.resolve(first_stage="mlp").first_stage == "mlp"  # given wins
    # Through Flower's run config: pyproject's "mlp" is the section default, so not given ...
    app = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert TrainConfig.from_run_config(app).first_stage == "auto"
    assert TrainConfig.from_run_config(app).mlp_local_epochs == 1
    assert TrainConfig.from_run_config(app).mlp_weight_decay == 5e-3
    assert TrainConfig.from_run_config(app).gnn_input_rms_floor == 0.25
    assert TrainConfig.from_run_config(app, []).first_stage == "auto"
    # ... unless the submitter set it.
    assert TrainConfig.from_run_config(app, ["first-stage"]).first_stage == "mlp"


def test_secure_aggregation_settings_that_cannot_work_are_refused_by_name():
    TrainConfig(secure_aggregation=True, clients=4, secagg_threshold=3).validate()
    TrainConfig(secure_aggregation=True, clients=200).validate()  # the most that is measured
    for values, message in (
        ({"clients": 2}, "3 or more clients"),
        ({"mode": "centralized"}, "federated modes"),
        ({"drift_correction": "scaffold"}, "no drift-correction"),
        ({"clients": 4, "secagg_threshold": 2}, "secagg-threshold must be 3 to 4 for 4 clients"),
        ({"clients": 4, "secagg_threshold": 5}, "secagg-threshold must be 3 to 4 for 4 clients"),
        # A complete masking graph at node level (one node per client) is refused by name.
        ({"clients": 201, "method": "node"}, "secure-aggregation with 201 clients: .* above 200 clients"),
    ):
        with pytest.raises(ValueError, match=message):
            TrainConfig.resolve(**{"secure_aggregation": True, **values}).validate()


def test_a_run_configs_toml_integer_is_a_byte_budget_and_edge_keeps_eagers_models_8_bit():
    # Flower reads byte-budget=100000 as a TOML integer: bytes, as the text "100000" is.
    cfg = TrainConfig.from_mapping({"bit-policy": "adaptive-budget", "byte-budget": 100000})
    assert cfg.byte_budget == 100000
    for mode in ("eager", "local"):  # their models travel 32-bit by default; the edge profile's are 8
        edge = TrainConfig.resolve(mode=mode, profile="edge")
        assert (edge.update_bits, edge.broadcast_bits, edge.bits) == (8, 8, 8)
        assert TrainConfig.resolve(mode=mode, profile="edge", update_bits=32).update_bits == 32


@pytest.mark.parametrize("budget", [True, 1.5, -5, "abc", "0b", "nanb", "33b"])
def test_a_byte_budget_that_names_no_budget_is_refused_before_the_run(budget):
    # Each validated and then failed mid-run in the codec (or, for True, as "'True'" not a float).
    with pytest.raises(ValueError, match="byte-budget takes"):
        TrainConfig.from_mapping({"bit-policy": "adaptive-budget", "byte-budget": budget})


def test_a_folder_given_as_a_path_is_text_in_the_config():
    cfg = TrainConfig.resolve(out_dir=Path("/tmp/run"), data_root=Path("/tmp/data")).validate()
    assert (cfg.out_dir, cfg.data_root) == ("/tmp/run", "/tmp/data")
    json.dumps(cfg.to_dict())  # config.json and the messages' configs are JSON


def test_an_edited_app_config_value_is_kept_and_one_at_its_default_leaves_room_for_the_mode():
    app = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    # The app's own out-dir (every flwr run's folder goes there) is not dropped as "not given".
    assert TrainConfig.from_run_config(app, []).out_dir == "runs/flwr"
    edited = TrainConfig.from_run_config({**app, "hidden": 48, "mode": "eager"}, [])
    assert (edited.hidden, edited.rounds) == (48, TrainConfig.resolve(mode="eager").rounds)
    assert TrainConfig.from_run_config({**app, "mode": "eager"}, []).hidden == 64  # eager's own


def test_a_setting_the_run_does_not_read_is_named_with_why():
    from retexo_fl.config import ignored_settings

    lazy = TrainConfig.resolve()
    assert ignored_settings(lazy, ["algorithm", "secagg-threshold", "hidden", "heads", "dp_clip"]) == [
        "algorithm applies to datacenter mode, not lazy: ignored",
        "secagg-threshold acts with secure-aggregation only: ignored",
        "heads acts with model gat only: ignored",
        "dp-clip acts with dp-noise only: ignored",
    ]
    assert ignored_settings(TrainConfig.resolve(model="gat"), ["heads"]) == []
    # One of several values: local-hops is read by a local stage 0, alone or under auto.
    assert ignored_settings(TrainConfig.resolve(first_stage="mlp"), ["local-hops"]) == [
        "local-hops acts with first-stage local or auto only: ignored"
    ]
    for first_stage in ("local", "auto"):
        assert ignored_settings(TrainConfig.resolve(first_stage=first_stage), ["local-hops"]) == []
    # server-lr per stage: the GNN stages' avg applies the mean update as it is (0.03 did nothing).
    assert ignored_settings(TrainConfig.resolve(stages=3, server_lr=[0.01, 0.03]), ["server-lr"]) == [
        "server-lr is not read at stages 1, 2: server-optimizer avg takes no learning rate there "
        "(server-optimizer adam does)"
    ]
    assert ignored_settings(TrainConfig.resolve(server_optimizer="adam", server_lr=0.1), ["server_lr"]) == []
    secure = TrainConfig.resolve(secure_aggregation=True, clients=4)
    assert ignored_settings(secure, ["secagg-threshold"]) == []
    # first-stage auto is the lazy default over partitions: its race settings are read there ...
    assert ignored_settings(lazy, ["first-stage-race"]) == []
    # ... and not where stage 0 is one variant, nor in eager mode at all.
    assert ignored_settings(TrainConfig.resolve(first_stage="mlp"), ["first-stage-race"]) == [
        "first-stage-race acts with first-stage auto only: ignored"
    ]
    # The sprint is a lane of the parallel schedule: one after the other, there is none.
    assert ignored_settings(lazy, ["first-stage-sprint"]) == []
    sequential = TrainConfig.resolve(first_stage_sprint=8, first_stage_schedule="sequential")
    assert (sequential.first_stage, sequential.first_stage_lanes) == ("auto", ("local", "mlp"))
    assert ignored_settings(sequential, ["first-stage-sprint"]) == [
        "first-stage-sprint acts with first-stage-schedule parallel only: ignored"
    ]
    eager = TrainConfig.resolve(mode="eager")
    assert ignored_settings(eager, ["first-stage-race", "eager-model", "pseudo-threshold"]) == [
        "first-stage-race applies to lazy mode, not eager: ignored",
        "pseudo-threshold acts with self-training only: ignored",
    ]
    # A folder of partitions holds the graph, its split and its cut: what would make them is unread.
    # (method is read: method node picks the node-level defaults over a folder of partitions)
    given = ["dataset", "split", "split-index", "data-root", "method"]
    assert ignored_settings(TrainConfig.resolve(partitions="parts"), given) == [
        f"{key} is read only without partitions: ignored" for key in given[:-1]
    ]
    assert ignored_settings(lazy, given) == []
    # Every declared condition names a setting that exists, with a value it can take.
    names = {info.name: info for info in settings()}
    for info in settings():
        if info.needs:
            name, _, wanted = info.needs.partition("=")
            assert name in names, info.key
            for value in wanted.split("|") if wanted else ():  # each of several values
                assert not names[name].choices or value in names[name].choices, info.key
        assert set(info.modes) <= set(MODES), info.key


def test_the_cli_warns_of_a_setting_its_run_ignores(tmp_path, capsys):
    from retexo_fl.cli import main

    argv = ["train", "--dataset", "sbm:120,2", "--clients", "2", "--rounds", "1", "--stages", "1"]
    assert main([*argv, "--self-training", "0", "--secagg-threshold", "2", "--algorithm", "2d"]) == 0
    err = capsys.readouterr().err
    assert "warning: --secagg-threshold acts with secure-aggregation only: ignored" in err
    assert "warning: --algorithm applies to datacenter mode, not lazy: ignored" in err
