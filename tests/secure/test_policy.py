"""A party's policy: read from its node config, strict by default, and it refuses weaker runs by name."""

from __future__ import annotations

import math
import stat

import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from retexo_fl import protocol as P
from retexo_fl.cli import main
from retexo_fl.config import TrainConfig
from retexo_fl.secure.keys import KeyMaterialError, load_private_key, private_folder, save_private_key
from retexo_fl.secure.policy import POLICY_ENV, PartyPolicy, PolicyError


def test_the_default_policy_requires_encryption_and_nothing_else(monkeypatch):
    monkeypatch.delenv(POLICY_ENV, raising=False)
    policy = PartyPolicy.from_node_config({}, "client 0")
    assert policy == PartyPolicy() and policy.encrypt
    policy.check(TrainConfig.resolve(profile="exact"), "client 0")
    with pytest.raises(PolicyError, match="client 0: refusing the run, encrypt"):
        policy.check(TrainConfig.resolve(profile="exact", encrypt=False), "client 0")


def test_node_config_values_are_read_and_bad_ones_named(monkeypatch):
    monkeypatch.delenv(POLICY_ENV, raising=False)
    node = {
        P.NODE_ENCRYPT: "false",
        P.NODE_MIN_DP_NOISE: "0.5",
        P.NODE_MAX_DP_CLIP: 2,
        P.NODE_AUDIT_DIR: "/a",
    }
    policy = PartyPolicy.from_node_config(node, "client 1")
    assert (policy.encrypt, policy.min_dp_noise, policy.max_dp_clip, policy.audit_dir) == (
        False,
        0.5,
        2.0,
        "/a",
    )
    with pytest.raises(PolicyError, match="client 1: refusing the run, encrypt: node config value 'maybe'"):
        PartyPolicy.from_node_config({P.NODE_ENCRYPT: "maybe"}, "client 1")
    with pytest.raises(PolicyError, match="min-dp-noise: node config value '-1' must be >= 0"):
        PartyPolicy.from_node_config({P.NODE_MIN_DP_NOISE: "-1"}, "client 1")


def test_minimum_privacy_settings_are_enforced():
    policy = PartyPolicy(min_dp_noise=1.0, max_dp_clip=1.0)
    policy.check(TrainConfig.resolve(profile="exact", dp_noise=1.2, dp_clip=0.5), "client 2")
    with pytest.raises(PolicyError, match=r"dp-noise: 0.5 is below this party's minimum 1.0"):
        policy.check(TrainConfig.resolve(profile="exact", dp_noise=0.5), "client 2")
    with pytest.raises(PolicyError, match=r"dp-clip: 4.0 is above this party's maximum 1.0"):
        policy.check(TrainConfig.resolve(profile="exact", dp_noise=1.0, dp_clip=4.0), "client 2")
    with pytest.raises(
        PolicyError, match=r"dp-reproducible: the run's update noise would come from its seed"
    ):
        policy.check(TrainConfig.resolve(profile="exact", dp_noise=1.0, dp_reproducible=True), "client 2")
    rows = PartyPolicy.from_node_config({P.NODE_MIN_BOUNDARY_NOISE: "0.5"}, "client 2")
    rows.check(TrainConfig.resolve(profile="exact", boundary_clip=1.0, boundary_noise=0.5), "client 2")
    with pytest.raises(PolicyError, match=r"boundary-noise: 0.0 is below this party's minimum 0.5"):
        rows.check(TrainConfig.resolve(profile="exact"), "client 2")


def test_the_simulation_policy_travels_in_the_environment(monkeypatch, tmp_path):
    cfg = TrainConfig.resolve(
        profile="exact", identity_keys=str(tmp_path), audit=str(tmp_path / "audit"), dp_noise=0.3
    )
    policy = PartyPolicy.from_settings(cfg.security)
    monkeypatch.setenv(POLICY_ENV, policy.to_json())
    got = PartyPolicy.from_node_config({P.NODE_PARTITION_ID: 4}, "client 4")
    assert got == policy and got.identity_file(4) == str(tmp_path / "client-4.key")
    assert math.isinf(PartyPolicy.from_settings(TrainConfig.resolve(profile="exact").security).max_dp_clip)
    budget = PartyPolicy.from_node_config({P.NODE_MAX_BOUNDARY_EPSILON: "8"}, "client 4")
    assert budget.max_boundary_epsilon == 8 and math.isinf(got.max_boundary_epsilon)
    assert PartyPolicy.from_json(budget.to_json(), "client 4") == budget  # JSON has no infinity
    # Node config still wins over the environment.
    assert not PartyPolicy.from_node_config({P.NODE_ENCRYPT: False}, "client 4").encrypt
    monkeypatch.setenv(POLICY_ENV, "[not a policy")
    with pytest.raises(PolicyError, match=POLICY_ENV):
        PartyPolicy.from_node_config({}, "client 4")


def test_pins_are_checked_against_the_announced_set(tmp_path):
    main(["keys", "--clients", "2", "--out", str(tmp_path)])
    policy = PartyPolicy(pinned_keys=str(tmp_path / "pins.json"))
    own = policy.pins_digest()
    policy.check_pins(own, "client 0")
    with pytest.raises(PolicyError, match="pinned-keys: the run config pins no keys"):
        policy.check_pins(None, "client 0")
    with pytest.raises(PolicyError, match="pinned-keys: the run config pins another key set"):
        policy.check_pins("0" * 32, "client 0")
    PartyPolicy().check_pins(None, "client 0")  # a party without pins takes any


def test_private_keys_others_can_read_are_refused_and_never_overwritten(tmp_path, capsys):
    key = tmp_path / "keys" / "client-0.key"
    save_private_key(X25519PrivateKey.generate(), key)
    assert stat.S_IMODE(key.parent.stat().st_mode) == 0o700
    load_private_key(key)
    key.chmod(0o644)
    with pytest.raises(
        KeyMaterialError, match=r"client-0.key: a private key others can read or write \(mode 644\)"
    ):
        load_private_key(key)
    # `retexo-fl keys` over an old key refuses: its public half was pinned by the other parties,
    # and a new one would silently invalidate every pin (it rewrote keys and pins.json before).
    old = key.read_bytes()
    assert main(["keys", "--clients", "2", "--out", str(tmp_path / "keys")]) == 2
    assert "client-0.key: already exists" in capsys.readouterr().err
    assert key.read_bytes() == old and not (tmp_path / "keys" / "client-1.key").exists()
    assert main(["keys", "--clients", "0", "--out", str(tmp_path / "fresh")]) == 2
    assert "clients must be >= 1" in capsys.readouterr().err
    key.chmod(0o600)
    load_private_key(key)


def test_a_folder_others_can_enter_is_refused_and_left_as_it_was(tmp_path, capsys):
    shared = tmp_path / "project"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    assert main(["keys", "--clients", "1", "--out", str(shared)]) == 2
    assert "project: others can enter this folder (mode 755)" in capsys.readouterr().err
    assert stat.S_IMODE(shared.stat().st_mode) == 0o755 and not any(shared.iterdir())
    with pytest.raises(KeyMaterialError, match="others can enter"):
        save_private_key(X25519PrivateKey.generate(), shared / "node.key")
    assert not any(shared.iterdir())
    # A new folder, parents and all, is made private from birth.
    made = private_folder(shared / "keys" / "node-0")
    assert stat.S_IMODE(made.stat().st_mode) == 0o700


def test_a_nan_setting_is_refused_not_waved_through():
    # NaN fails every comparison, so "below the minimum" alone would let it pass.
    policy = PartyPolicy(min_boundary_noise=0.5)
    nan_cfg = TrainConfig.__new__(TrainConfig)
    nan_cfg.__dict__.update(
        TrainConfig.resolve(profile="exact", boundary_clip=1.0, boundary_noise=0.5).__dict__
    )
    nan_cfg.boundary_noise = float("nan")
    with pytest.raises(PolicyError, match="boundary-noise: nan is not a finite number"):
        policy.check(nan_cfg, "client 0")
    with pytest.raises(ValueError, match="boundary-noise takes a finite number"):
        TrainConfig.resolve(profile="exact", boundary_clip=1.0, boundary_noise=float("nan")).validate()


def test_a_party_that_requires_secure_aggregation_refuses_updates_in_clear(monkeypatch):
    monkeypatch.delenv(POLICY_ENV, raising=False)
    policy = PartyPolicy.from_node_config({P.NODE_SECURE_AGGREGATION: "true"}, "client 3")
    assert policy.secure_aggregation
    policy.check(TrainConfig.resolve(profile="exact", secure_aggregation=True), "client 3")
    with pytest.raises(PolicyError, match="client 3: refusing the run, secure-aggregation: the run config"):
        policy.check(TrainConfig.resolve(profile="exact"), "client 3")
    # A party started with it on its own command line requires it too, and the setting travels
    # to simulated parties in the policy's JSON.
    mine = PartyPolicy.from_settings(TrainConfig.resolve(profile="exact", secure_aggregation=True).security)
    assert PartyPolicy.from_json(mine.to_json(), "client 3") == mine and mine.secure_aggregation
