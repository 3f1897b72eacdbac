"""The wire vocabulary: the run config travels once per node, train messages name it by digest,
and payload keys parse back to what built them (and nothing else)."""

from __future__ import annotations

import pytest

from retexo_fl import protocol as P
from retexo_fl.config import TrainConfig
from retexo_fl.coordinator.federation import FederationView
from retexo_fl.metrics import RunRecorder
from retexo_fl.training.inprocess import InProcessTransport


def _federation(**kw) -> FederationView:
    return FederationView(InProcessTransport([]), TrainConfig.resolve(**kw), RunRecorder(None, stream=None))


def test_train_messages_carry_the_digest_not_the_config():
    fed = _federation(hidden=16, rounds=[60, 200])
    train = fed.content(by_digest=True, stage=0, round=3)[P.CONFIG]
    setup = fed.content(**{P.KEYS: "{}"})[P.CONFIG]
    assert P.RUN not in train
    assert train[P.RUN_DIGEST] == P.config_digest(fed.run_json)
    assert setup[P.RUN] == fed.run_json and P.config_from_json(setup[P.RUN]) == fed.cfg
    assert P.RUN_DIGEST not in setup
    assert train[P.RUN_KEY] == setup[P.RUN_KEY] == fed.run_key
    assert len(fed.run_json) > 500  # what each train message no longer carries


def test_payload_keys_round_trip_and_refuse_anything_else():
    assert P.parse_outgoing_key(P.outgoing_key(12)) == 12
    assert P.parse_delivery_key(P.delivery_key(P.HALO, 3)) == (P.HALO, 3)
    assert P.parse_delivery_key(P.delivery_key(P.DEGREES, 0)) == (P.DEGREES, 0)
    for bad in ("from-1", "to-", "to--1", "to-1x", "1"):
        with pytest.raises(ValueError, match="expected 'to-<client id>'"):
            P.parse_outgoing_key(bad)
    for bad in ("halo-1", "secret-from-1", "halo-from-x", "to-1"):
        with pytest.raises(ValueError, match=r"expected 'deg\|halo-from-<client id>'"):
            P.parse_delivery_key(bad)


def test_missed_deltas_round_trip_in_order_and_refuse_anything_else():
    steps = [{"w": b"a", "b": b"b"}, {"w": b"c", "b": b"d"}, {"w": b"e", "b": b"f"}]
    record = P.chain_record(steps)
    assert record["2/w"] == b"e" and P.chain_frames(dict(reversed(list(record.items()))), "c") == steps
    assert P.chain_frames({}, "c") == []
    for bad in ({"w": b"x"}, {"x/w": b"x"}, {"0/": b"x"}, {f"{P.MAX_CHAIN}/w": b"x"}):
        with pytest.raises(ValueError, match="client 3: model-before key"):
            P.chain_frames(bad, "client 3")
    with pytest.raises(ValueError, match=r"steps \[0, 2\] are not 0, 1"):
        P.chain_frames({"0/w": b"x", "2/w": b"y"}, "client 3")


def test_a_run_config_text_is_parsed_once_and_each_caller_gets_its_own_copy(monkeypatch):
    """Thousands of one-node clients in one process read the same run config: it is parsed and
    validated once; each gets an equal object of its own, so no caller's change reaches another."""
    monkeypatch.setattr(P, "_parsed_configs", {})
    parsed = []
    real = TrainConfig.from_mapping
    monkeypatch.setattr(TrainConfig, "from_mapping", lambda values: parsed.append(1) or real(values))
    text = P.config_to_json(TrainConfig.resolve(clients=7, hidden=24))
    first, second = P.config_from_json(text), P.config_from_json(text)
    assert first == second and first is not second and first.hidden == 24 and first.clients == 7
    assert len(parsed) == 1
    first.hidden = 99  # the copy handed out is not the one kept
    assert P.config_from_json(text).hidden == 24
    other = P.config_to_json(TrainConfig.resolve(clients=7, hidden=16))
    assert P.config_from_json(other).hidden == 16 and len(parsed) == 2


def test_a_stage_a_sealed_header_cannot_hold_is_refused_naming_it():
    """A sealed payload's header holds the stage in 16 bits: a message naming a larger stage is
    refused as a bad count before any payload is sealed, not by the header's packing."""
    from retexo_fl.secure.envelope import Route

    P.count_entries({P.STAGE: P.MAX_STAGE, P.ROUND: P.MAX_COUNT}, "client 1")
    Route("halo", P.MAX_STAGE, 1, 0, 1).header(1)  # the largest stage fits its header
    with pytest.raises(ValueError, match=r"client 1: stage '65536' is not a count in \[0, 65535\]"):
        P.count_entries({P.STAGE: P.MAX_STAGE + 1}, "client 1")
    with pytest.raises(ValueError, match=r"client 1: round '-1' is not a count in \[0, 2147483647\]"):
        P.count_entries({P.ROUND: -1}, "client 1")


def test_the_bound_config_digest_ignores_the_servers_folders_and_settings_left_at_default(monkeypatch):
    from retexo_fl.config import TrainConfig

    cfg = TrainConfig.resolve(clients=3)
    bound = P.client_config_digest(cfg)
    # A resumed run: its server's own folders differ, and nothing a client reads.
    assert P.client_config_digest(TrainConfig.resolve(clients=3, out_dir="/a", resume="/a")) == bound
    assert P.client_config_digest(TrainConfig.resolve(clients=3, lr=0.0)) != bound
    # A newer release's setting, at its default: the run's clients keep the digest they bound.
    newer = TrainConfig.resolve(clients=3)
    plain = TrainConfig.to_dict
    monkeypatch.setattr(TrainConfig, "to_dict", lambda self: {**plain(self), "new_setting": 7})
    monkeypatch.setattr(P, "_field_defaults", lambda: {**plain(TrainConfig()), "new_setting": 7})
    assert P.client_config_digest(newer) == bound
