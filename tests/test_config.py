"""TrainConfig: one flat set of user-facing keys, grouped into sections each package validates."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import tomllib

from retexo_fl.compress.settings import CompressionSettings
from retexo_fl.config import SECTIONS, TrainConfig
from retexo_fl.data.settings import DataSettings
from retexo_fl.datacenter.settings import DatacenterSettings
from retexo_fl.secure.settings import SecuritySettings

ROOT = Path(__file__).resolve().parents[1]

# The user-facing keys (run config and CLI, kebab-case). Users write these in pyproject.toml,
# scripts and `flwr run --run-config`: a rename breaks them, so a rename must fail here.
USER_KEYS = {
    "mode", "dataset", "data-root", "split", "split-index", "clients", "method", "partitions",
    "seed", "model", "stages", "central-layers", "eager-model", "hidden", "pass-embedding", "self-training",
    "pseudo-threshold", "pseudo-per-class", "pass-init", "rounds", "local-epochs", "optimizer", "momentum",
    "lr", "server-optimizer", "server-lr", "weight-decay", "dropout", "input-dropout", "norm",
    "heads", "root-weight", "first-stage", "patience", "min-rounds", "warm-min-rounds", "stop-metric",
    "drift-correction", "halo-gradients",
    "precompute",
    "device", "round-seconds", "step-delay",
    "profile", "threads",
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
    with pytest.raises(ValueError, match="unknown section 'network'"):
        TrainConfig.from_sections(network=DataSettings())
    with pytest.raises(TypeError, match="section 'data' must be a DataSettings"):
        TrainConfig.from_sections(data=CompressionSettings())


def test_from_mapping_reads_kebab_keys_and_per_stage_lists():
    cfg = TrainConfig.from_mapping({"rounds": "200,100", "server-lr": "0.01,0.005", "bit-policy": "fixed"})
    assert cfg.rounds == [200, 100] and cfg.server_lr == [0.01, 0.005]
    assert [cfg.per_stage("rounds", s) for s in range(4)] == [200, 100, 100, 100]
    with pytest.raises(ValueError, match="unknown setting 'bitz'"):
        TrainConfig.from_mapping({"bitz": 4})


@pytest.mark.parametrize(
    ("values", "section", "message"),
    [
        ({"clients": 0}, "data", "clients must be >= 1"),
        ({"stages": 0}, "architecture", "stages must be >= 1"),
        ({"pass_embedding": "both"}, "architecture", "pass-embedding"),
        ({"mode": "gossip"}, "training", "mode must be one of"),
        ({"server_optimizer": "sgd"}, "training", "server-optimizer"),
        ({"bits": 3}, "compression", "bits and update-bits"),
        ({"bit_policy": "adaptive-bandwidth"}, "compression", "needs link-bandwidths"),
        ({"dp_delta": 1.0}, "security", "dp-delta"),
        ({"boundary_noise": 1.0}, "security", "boundary-noise needs boundary-clip"),
        ({"secure_aggregation": True, "encrypt": False}, "security", "secure-aggregation needs encrypt"),
        ({"secagg_clip": 0.0}, "security", "secagg-clip must be"),
        ({"on_missing_halo": "guess"}, "failures", "on-missing-halo"),
        ({"algorithm": "4d"}, "datacenter", "algorithm must be one of"),
    ],
)
def test_each_section_validates_its_own_keys(values, section, message):
    cfg = TrainConfig(**values)
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
        TrainConfig(mode="datacenter", algorithm="2d", procs=3).validate()
    # Only a data-center run needs procs to form the algorithm's grid.
    TrainConfig(mode="lazy", algorithm="2d", procs=3).validate()
    with pytest.raises(ValueError, match="self-training applies to lazy and centralized"):
        TrainConfig(mode="eager", self_training=1).validate()


def test_edge_profile_fills_only_what_was_left_at_its_default():
    edge = TrainConfig(profile="edge", bits=4)
    assert (edge.device, edge.threads, edge.chunk_rows) == ("cpu", 1, 4096)
    assert (edge.bits, edge.update_bits, edge.broadcast_bits) == (
        4,
        4,
        4,
    )  # updates and broadcasts: already 4-bit by default


def test_a_replaced_mode_brings_its_defaults_as_a_new_config_does():
    eager = TrainConfig(mode="eager")
    assert TrainConfig().replace(mode="eager") == eager
    # dataclasses.replace passes every field: the lazy defaults stay (what replace() is for).
    plain = dataclasses.replace(TrainConfig(), mode="eager")
    assert (plain.hidden, eager.hidden) == (32, 64) and plain != eager
    # What a config was given stays given, whatever the new mode's default is.
    mine = TrainConfig(hidden=16, seed=3).replace(mode="eager")
    assert (mine.hidden, mine.seed, mine.rounds) == (16, 3, eager.rounds)
    assert TrainConfig(profile="exact").replace(clients=7) == TrainConfig(profile="exact", clients=7)


def test_the_apps_run_config_is_a_valid_train_config():
    app = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    cfg = TrainConfig.from_mapping({k: v for k, v in app.items() if k.replace("-", "_") in _flat_names()})
    assert cfg.mode in ("lazy", "eager", "local")


def test_a_run_config_value_set_by_the_submitter_is_kept_even_at_the_lazy_default():
    app = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    fused = {**app, "mode": "eager", "hidden": 32}  # Flower's run config: pyproject's, then overrides
    asked = TrainConfig.from_run_config(fused, overridden=["mode", "hidden"])
    assert (asked.mode, asked.hidden, asked.rounds) == ("eager", 32, TrainConfig(mode="eager").rounds)
    # Without the submitter's keys, 32 reads as "not given" and eager's own width applies.
    assert TrainConfig.from_run_config(fused).hidden == TrainConfig(mode="eager").hidden == 64


def test_section_defaults_are_the_flat_defaults():
    # Each key's default is written twice (the flat field users see, the section that validates
    # it): a default changed in one place only must fail here.
    flat = TrainConfig()
    for name, cls in SECTIONS.items():
        assert getattr(flat, name) == cls(), name


def test_secure_aggregation_settings_that_cannot_work_are_refused_by_name():
    TrainConfig(secure_aggregation=True, clients=4, secagg_threshold=3).validate()
    for values, message in (
        ({"clients": 2}, "3 or more clients"),
        ({"mode": "centralized"}, "federated modes"),
        ({"drift_correction": "scaffold"}, "no drift-correction"),
        ({"clients": 4, "secagg_threshold": 2}, "secagg-threshold must be 3 to 4 for 4 clients"),
        ({"clients": 4, "secagg_threshold": 5}, "secagg-threshold must be 3 to 4 for 4 clients"),
    ):
        with pytest.raises(ValueError, match=message):
            TrainConfig(**{"secure_aggregation": True, **values}).validate()
