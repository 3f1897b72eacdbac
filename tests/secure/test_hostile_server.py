"""A malicious server, driving real clients through the Flower ClientApp: every attack is refused
or reported.

Each client is the real ``clients.app`` ClientApp (its mods included) with a node config of its
own: a partition folder, a work folder, an identity key and, where the test says, pinned keys.
The server is the library's stage machine over a transport that lets the test tamper with every
request before the client sees it, as a server that controls the relay can.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import RecordDict

from clients import node_client
from clients.app import app as client_app
from clients.records import from_flower, to_flower
from clients.worker import request_message
from retexo_fl import protocol as P
from retexo_fl.config import TrainConfig
from retexo_fl.coordinator.baseline_run import BaselineRun
from retexo_fl.coordinator.stages import LazyStageMachine
from retexo_fl.coordinator.transport import Batch, ClientFailure
from retexo_fl.data.partition import save_partition
from retexo_fl.data.partitioners import partition_graph
from retexo_fl.metrics import RunRecorder
from retexo_fl.protocol import Records
from retexo_fl.secure.keys import write_identities
from retexo_fl.training.inprocess import InProcessTransport
from retexo_fl.training.lazy import run_lazy

Tamper = Callable[[str, int, Records], Records]
CFG = dict(
    clients=3, model="gcn", stages=2, hidden=8, rounds=3, patience=0, min_rounds=0, seed=0, self_training=0
)


class ClientAppTransport(InProcessTransport):
    """Every request goes through the real ClientApp of the addressed node; ``tamper`` sees
    (and may rewrite) each one first, as the relaying server can."""

    engine = "clientapp-test"

    def __init__(
        self, node_configs: list[dict[str, Any]], tamper: Tamper | None = None, evict: bool = False
    ) -> None:
        super().__init__([])
        self.clients = list(node_configs)  # what connect() counts
        self.node_configs = node_configs
        self.tamper = tamper
        self.evict = evict  # every message finds no cached client: rebuilt from its own config
        self.sent = 0

    def send(self, kind: str, requests: dict[int, Records], phase: str, stage: int) -> Batch:
        batch = Batch()
        for a, req in requests.items():
            if self.tamper is not None:
                req = self.tamper(kind, a, req)
            if self.evict:  # as a node worker that dropped the run, or a process per message
                node_client.forget([int(req[P.CONFIG][P.RUN_KEY])])
            header = {
                "type": kind,
                "run_id": 7,
                "message_id": f"{self.sent}-{a}",
                "node_id": a + 1,
            }
            msg, context = request_message(header, to_flower(req), self.node_configs[a])
            reply = client_app(msg, context)
            if reply.has_error():
                batch.failures[a] = f"replied with an error: {reply.error.reason}"
            else:
                batch.replies[a] = from_flower(RecordDict(reply.content))
        self.sent += 1
        return batch


@pytest.fixture(scope="module")
def nodes(sbm, tmp_path_factory):
    """Three parties' partitions and long-term keys (with the pins they exchanged out of band)."""
    tmp = tmp_path_factory.mktemp("hostile")
    parts = partition_graph(sbm, 3, "random", seed=0)
    dirs = [save_partition(p, tmp / f"part-{i}") for i, p in enumerate(parts)]
    keys = write_identities(3, tmp / "keys")
    return dirs, keys


def _node_configs(nodes, work: Path, pins: bool = True, **extra: Any) -> list[dict[str, Any]]:
    dirs, keys = nodes
    out = []
    for i, d in enumerate(dirs):
        config = {
            P.NODE_PARTITION_DIR: str(d),
            P.NODE_WORK_DIR: str(work),
            P.NODE_IDENTITY_KEY: str(keys / f"client-{i}.key"),
            **extra,
        }
        if pins:
            config[P.NODE_PINNED_KEYS] = str(keys / "pins.json")
        out.append(config)
    return out


def _lazy(
    nodes, work: Path, tamper: Tamper | None = None, pins: bool = True, evict: bool = False, **cfg: Any
) -> dict:
    config = TrainConfig.resolve(**{**CFG, "pinned_keys": str(nodes[1] / "pins.json"), **cfg})
    transport = ClientAppTransport(_node_configs(nodes, work, pins), tamper, evict)
    return LazyStageMachine(transport, config, RunRecorder(None, stream=None)).run()


@pytest.mark.slow
def test_an_honest_server_runs_to_the_end(nodes, sbm, tmp_path):
    out = _lazy(nodes, tmp_path, rounds=20)
    assert out["missing_payloads"] == {} and out["lost_clients"] == []
    # The same run in process (every party started from this command line) ends the same.
    cfg = TrainConfig.resolve(
        **{**CFG, "rounds": 20, "identity_keys": str(nodes[1]), "pinned_keys": str(nodes[1] / "pins.json")}
    )
    assert (
        out["test_accuracy"]
        == run_lazy(partition_graph(sbm, 3, "random", seed=0), cfg)["test_accuracy"]
        > 0.6
    )


def test_a_server_that_turns_encryption_off_is_refused(nodes, tmp_path):
    with pytest.raises(
        ClientFailure, match="refusing the run, encrypt: the run config turns payload encryption off"
    ):
        _lazy(nodes, tmp_path, encrypt=False)


def _rewrite_json(req: Records, key: str, **changes: Any) -> Records:
    """``req`` with the JSON object in its config entry ``key`` changed, as the server can."""
    value = {**json.loads(req[P.CONFIG][key]), **changes}
    return {**req, P.CONFIG: {**req[P.CONFIG], key: json.dumps(value)}}


def test_a_server_that_turns_encryption_off_mid_run_is_refused(nodes, tmp_path):
    def weaken(kind: str, address: int, req: Records) -> Records:
        # Every message but train carries the run config: here a weaker one.
        return _rewrite_json(req, P.RUN, encrypt=False) if kind == P.EMBED else req

    with pytest.raises(ClientFailure, match="refusing the run, encrypt"):
        _lazy(nodes, tmp_path, weaken)


def test_a_party_whose_policy_allows_plaintext_joins_a_plaintext_run(nodes, tmp_path):
    config = TrainConfig.resolve(**{**CFG, "encrypt": False})
    transport = ClientAppTransport(_node_configs(nodes, tmp_path, pins=False, **{P.NODE_ENCRYPT: "false"}))
    out = LazyStageMachine(transport, config, RunRecorder(None, stream=None)).run()
    assert out["lost_clients"] == [] and out["bytes_boundary"] > 0


def test_a_server_that_leaves_out_the_pins_is_refused(nodes, tmp_path):
    with pytest.raises(ClientFailure, match="pinned-keys: the run config pins no keys"):
        _lazy(nodes, tmp_path, pinned_keys="")


def test_a_server_that_swaps_a_key_is_refused(nodes, tmp_path):
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    from retexo_fl.secure.keys import public_bytes

    attacker = public_bytes(X25519PrivateKey.generate()).hex()

    def swap(kind: str, address: int, req: Records) -> Records:
        # Client 0 is told client 1's key is the attacker's.
        return _rewrite_json(req, P.KEYS, **{"1": attacker}) if kind == P.SETUP and address == 0 else req

    with pytest.raises(ClientFailure, match="client 0: the server's key for client 1 is not the pinned one"):
        _lazy(nodes, tmp_path, swap)
    # A server that names its own pin set (the attacker's keys) is refused before any key is
    # looked at: the party's own pins, not the server's run config, decide.
    with pytest.raises(ClientFailure, match="pinned-keys: the run config pins another key set"):
        other = tmp_path / "pins.json"
        other.write_text(json.dumps({"0": attacker, "1": attacker, "2": attacker}))
        _lazy(nodes, tmp_path / "other", swap, pinned_keys=str(other))


def _drop_one(kind: str, address: int, req: Records) -> Records:
    """Withhold client 1's halo payload from client 0 (stage 1's first round delivers it)."""
    payloads = req.get(P.PAYLOADS)
    key = P.delivery_key(P.HALO, 1)
    if kind == P.TRAIN and address == 0 and payloads and key in payloads:
        req = {**req, P.PAYLOADS: {k: v for k, v in payloads.items() if k != key}}
    return req


def test_a_dropped_payload_is_an_error_naming_its_sender(nodes, tmp_path):
    with pytest.raises(ClientFailure, match=r"client 0: .*no rows received from client\(s\) \[1\]"):
        _lazy(nodes, tmp_path, _drop_one)


def test_a_dropped_payload_under_zero_fill_is_counted_and_reported(nodes, tmp_path):
    out = _lazy(nodes, tmp_path, _drop_one, on_missing_halo="zero")
    assert out["missing_payloads"] == {"1": {"1->0": 1}}
    assert out["lost_clients"] == []


def test_a_payload_replayed_from_another_run_is_refused(nodes, tmp_path):
    captured: dict[str, Any] = {}
    key = P.delivery_key(P.HALO, 1)

    def capture(kind: str, address: int, req: Records) -> Records:
        captured.setdefault("run-key", req[P.CONFIG][P.RUN_KEY])
        if kind == P.TRAIN and address == 0 and key in req.get(P.PAYLOADS, {}):
            captured[key] = req[P.PAYLOADS][key]
        return req

    _lazy(nodes, tmp_path / "a", capture)
    node_client.forget({run for run, _ in node_client._CACHE})  # the parties start afresh (new
    # node processes) for the next run
    assert key in captured

    def replay(kind: str, address: int, req: Records) -> Records:
        # The same parties and long-term keys, even the old run's key: only the transcript
        # (each party's fresh contribution) is new.
        req = {**req, P.CONFIG: {**req[P.CONFIG], P.RUN_KEY: captured["run-key"]}}
        payloads = req.get(P.PAYLOADS)
        if kind == P.TRAIN and address == 0 and payloads and key in payloads:
            req = {**req, P.PAYLOADS: {**payloads, key: captured[key]}}
        return req

    with pytest.raises(ClientFailure, match=r"client 0: payload from client 1 .*failed authentication"):
        _lazy(nodes, tmp_path / "b", replay)


def test_reordered_payloads_are_refused(nodes, tmp_path):
    """Eager rows go every round: the server holds back client 1's round-1 rows to client 0,
    delivers the round-2 rows, then the held-back ones."""
    held: dict[str, bytes] = {}
    key = P.delivery_key(P.HALO, 1)  # eager rows are relayed as halo deliveries, sealed as eager

    def reorder(kind: str, address: int, req: Records) -> Records:
        payloads = req.get(P.PAYLOADS)
        if kind != P.TRAIN or address != 0 or not payloads or key not in payloads:
            return req
        rnd = int(req[P.CONFIG][P.ROUND])
        if not held:
            held[key] = payloads[key]
            return {**req, P.PAYLOADS: {k: v for k, v in payloads.items() if k != key}}
        if rnd >= 4:
            return {**req, P.PAYLOADS: {**payloads, key: held[key]}}
        return req

    cfg = TrainConfig.resolve(**{**CFG, "mode": "eager", "rounds": 6, "on_missing_halo": "reuse-last"})
    cfg = dataclasses.replace(cfg, pinned_keys=str(nodes[1] / "pins.json"))
    transport = ClientAppTransport(_node_configs(nodes, tmp_path), reorder)
    with pytest.raises(ClientFailure, match=r"client 0: payload from client 1 .*replayed"):
        BaselineRun(transport, cfg, RunRecorder(None, stream=None)).run()


def test_an_eager_round_without_any_rows_is_counted_not_trained_on_in_silence(nodes, tmp_path):
    def starve(kind: str, address: int, req: Records) -> Records:
        if kind == P.TRAIN and address == 0 and int(req[P.CONFIG][P.ROUND]) == 3:
            return {k: v for k, v in req.items() if k != P.PAYLOADS}  # no delivery at all
        return req

    cfg = TrainConfig.resolve(**{**CFG, "mode": "eager", "rounds": 4, "on_missing_halo": "zero"})
    cfg = dataclasses.replace(cfg, pinned_keys=str(nodes[1] / "pins.json"))
    transport = ClientAppTransport(_node_configs(nodes, tmp_path), starve)
    out = BaselineRun(transport, cfg, RunRecorder(None, stream=None)).run()
    senders = sorted(partition_graph_peers(nodes, 0))
    assert out["missing_payloads"] == {"0": {f"{q}->0": 1 for q in senders}}
    with pytest.raises(ClientFailure, match=r"client 0: .*no rows received from client\(s\)"):
        transport = ClientAppTransport(_node_configs(nodes, tmp_path / "fail"), starve)
        BaselineRun(
            transport, dataclasses.replace(cfg, on_missing_halo="fail"), RunRecorder(None, stream=None)
        ).run()


def test_a_server_that_sends_an_earlier_round_again_is_refused(nodes, tmp_path):
    """Round 1 skips the check that every peer's rows arrived (eager): a server sending it
    again later would have clients train on stale rows in silence."""

    def rewind(kind: str, address: int, req: Records) -> Records:
        if kind == P.TRAIN and int(req[P.CONFIG][P.ROUND]) == 3:
            return {**req, P.CONFIG: {**req[P.CONFIG], P.ROUND: 1}}
        return req

    cfg = TrainConfig.resolve(
        **{**CFG, "mode": "eager", "rounds": 4}, pinned_keys=str(nodes[1] / "pins.json")
    )
    transport = ClientAppTransport(_node_configs(nodes, tmp_path), rewind)
    with pytest.raises(
        ClientFailure,
        match=r"train round 1 of stage \d after round 2 of stage \d began: rounds only go forward",
    ):
        BaselineRun(transport, cfg, RunRecorder(None, stream=None)).run()


@pytest.mark.parametrize("named_by", ["partition-dir", "partition-id"])
def test_a_partys_release_budget_is_not_reset_by_a_new_run(nodes, tmp_path, named_by):
    """The run key that names a run's node state is the server's choice: starting the same
    federation again under a new one must not give a party a new budget. Two runs of 2 releases
    each (noise 2): the third release spends epsilon 9.81, the fourth 11.6, past the budget of 10,
    in the second run's second release. Whether the node config names the partition's folder or
    only its id (the folder then comes from the run config)."""
    by_id = named_by == "partition-id"
    cfg = TrainConfig.resolve(
        **{**CFG, "mode": "eager", "stages": 3, "rounds": 1, "boundary_clip": 1.0, "boundary_noise": 2.0},
        partitions=str(nodes[0][0].parent) if by_id else "",
    )
    cfg = dataclasses.replace(cfg, pinned_keys=str(nodes[1] / "pins.json"))
    budget = {P.NODE_MAX_BOUNDARY_EPSILON: "10"}

    def configs() -> list[dict[str, Any]]:
        out = _node_configs(nodes, tmp_path, **budget)
        for i, config in enumerate(out if by_id else []):
            del config[P.NODE_PARTITION_DIR]
            config[P.NODE_PARTITION_ID] = i
        return out

    BaselineRun(ClientAppTransport(configs()), cfg, RunRecorder(None, stream=None)).run()
    with pytest.raises(
        ClientFailure, match=r"release 2 of its boundary rows in this run would spend epsilon 11.6"
    ):
        transport = ClientAppTransport(configs())
        BaselineRun(transport, cfg, RunRecorder(None, stream=None)).run()
    assert len(list(tmp_path.glob("run-*"))) == 2  # two run keys, one node budget


def test_a_server_that_asks_for_more_releases_than_a_partys_budget_is_refused(nodes, tmp_path):
    """Eager mode releases each conv layer's rows every round: the server decides how many
    releases there are, and each party counts its own against its budget. Noise 2 costs
    epsilon 5.3, 7.79, 9.81, 11.6 ... after 1, 2, 3, 4 releases (delta 1e-5): a budget of 10
    allows 3, and the fourth release (round 2's second layer) is refused, naming the budget."""
    cfg = TrainConfig.resolve(
        **{**CFG, "mode": "eager", "stages": 3, "rounds": 4, "boundary_clip": 1.0, "boundary_noise": 2.0},
        dp_delta=0.5,  # a large delta announced by the server makes no difference to the budget
    )
    cfg = dataclasses.replace(cfg, pinned_keys=str(nodes[1] / "pins.json"))
    budget = {P.NODE_MAX_BOUNDARY_EPSILON: "10"}
    transport = ClientAppTransport(_node_configs(nodes, tmp_path, **budget))
    with pytest.raises(
        ClientFailure,
        match=r"max-boundary-epsilon: release 4 of its boundary rows in this run would spend epsilon "
        r"11.6 \(delta 1e-05\) on each row's value, counting the 9.81 its earlier releases on this "
        r"node spent in every run \(.*boundary-releases.json\), above this party's budget 10",
    ):
        BaselineRun(transport, cfg, RunRecorder(None, stream=None)).run()
    # The count outlived each message's process: it is in the node-local state.
    from retexo_fl.party.state import ClientState

    saved = [ClientState.load(f) for f in sorted(tmp_path.glob("run-*/node-*"))]
    assert sorted(s.boundary_releases for s in saved if s is not None) == [2, 2, 2]
    # A budget with a run that does not noise its rows at all is refused before anything leaves.
    with pytest.raises(ClientFailure, match="boundary-noise: the run releases boundary rows without noise"):
        transport = ClientAppTransport(_node_configs(nodes, tmp_path / "plain", **budget))
        BaselineRun(
            transport, dataclasses.replace(cfg, boundary_noise=0.0), RunRecorder(None, stream=None)
        ).run()
    # A larger budget runs to the end.
    transport = ClientAppTransport(
        _node_configs(nodes, tmp_path / "rich", **{P.NODE_MAX_BOUNDARY_EPSILON: "20"})
    )
    out = BaselineRun(transport, cfg, RunRecorder(None, stream=None)).run()
    assert out["boundary_privacy"]["releases"] == 2 * 4


def partition_graph_peers(nodes, pid: int) -> set[int]:
    """The clients partition ``pid`` receives rows from, read from its saved cross edges."""
    from retexo_fl.data.partition import load_partition
    from retexo_fl.plan import BoundaryPlan

    return set(BoundaryPlan.from_partition(load_partition(nodes[0][pid])).recv)


# -- secure aggregation: the terms of a masked round are bound --------------------------------------
SECURE = {"secure_aggregation": True, "rounds": 3, "stages": 2}


def _secure(nodes, work: Path, tamper: Tamper) -> dict:
    return _lazy(nodes, work, tamper, **SECURE)


def _set(req: Records, **config: Any) -> Records:
    return {**req, P.CONFIG: {**req[P.CONFIG], **config}}


def test_a_weight_bound_that_changes_within_a_stage_is_refused_naming_it(nodes, tmp_path):
    """The attack: every client but one gets a huge weight bound, so their weights round to zero
    in the field and the unmasked "sum" is the one client's update."""

    def isolate(kind: str, address: int, req: Records) -> Records:
        if kind == P.TRAIN and int(req[P.CONFIG][P.ROUND]) == 2 and address != 0:
            return _set(req, **{P.SECAGG_BOUND: 1e8})
        return req

    with pytest.raises(ClientFailure, match=r"secagg-weight-bound 1e\+08 in round 2; round 1 of this stage"):
        _secure(nodes, tmp_path, isolate)


def test_per_client_terms_in_a_stages_first_round_do_not_unmask(nodes, tmp_path):
    """With no earlier round to compare with, a client cannot tell that others got other terms,
    but the terms are in its pair masks: they do not cancel, and the round does not decode (the
    field sum is pseudorandom: tests/secure/test_secagg.py)."""

    def isolate(kind: str, address: int, req: Records) -> Records:
        if kind == P.TRAIN and int(req[P.CONFIG][P.ROUND]) == 1 and address != 0:
            return _set(req, **{P.SECAGG_BOUND: 1e8})
        return req

    with pytest.raises(ClientFailure, match="does not decode"):
        _secure(nodes, tmp_path, isolate)


def _other_config_to_all_but(victim: int, **changes: Any) -> Tamper:
    """The attack: in stage 0's masked round 2, every member but ``victim`` is sent the run
    config with ``changes`` (lr 0: no update at all, so the masked sum is the victim's alone);
    the honest config again afterwards, whole."""
    honest: dict[str, str] = {}

    def swap(kind: str, address: int, req: Records) -> Records:
        config = req[P.CONFIG]
        if P.RUN in config:
            honest.setdefault("run", str(config[P.RUN]))
        if address == victim or not honest:
            return req
        config = {k: v for k, v in config.items() if k != P.RUN_DIGEST}
        config[P.RUN] = honest["run"]
        req = {**req, P.CONFIG: config}
        if kind == P.TRAIN and int(config[P.STAGE]) == 0 and int(config[P.ROUND]) == 2:
            return _rewrite_json(req, P.RUN, **changes)
        return req

    return swap


@pytest.mark.parametrize("evict", [True, False], ids=["rebuilt", "cached"])
def test_a_run_config_other_than_setups_is_refused(nodes, tmp_path, evict):
    """A client rebuilt from a message (a node worker that dropped an idle run, or plain
    ``flower-supernode``'s process per message) takes that message's config: before the check,
    every member but one trained at lr 0 and the unmasked sum was that member's update, to 1e-7."""
    refused = r"refusing the run, run config: this message's \(\w+\) is not the one"
    with pytest.raises(ClientFailure, match=refused):
        _lazy(nodes, tmp_path, _other_config_to_all_but(0, lr=0.0), evict=evict, **SECURE)


def test_an_honest_run_whose_clients_are_rebuilt_every_message_runs_to_the_end(nodes, tmp_path):
    out = _lazy(nodes, tmp_path, evict=True, **SECURE)
    assert out["lost_clients"] == [] and out["test_accuracy"] > 0.5


def test_members_given_other_configs_derive_masks_that_do_not_cancel(nodes, tmp_path, monkeypatch):
    """The second line: with the clients' check switched off, the config's digest is still in
    every pair mask, so the round of mixed configs does not decode."""
    from retexo_fl.party.client import Client

    monkeypatch.setattr(Client, "check_run_config", lambda self, cfg: None)
    with pytest.raises(ClientFailure, match="does not decode"):
        _lazy(nodes, tmp_path, _other_config_to_all_but(0, lr=0.0), evict=True, **SECURE)


def test_a_member_set_that_drops_a_survivor_mid_stage_is_refused(nodes, tmp_path):
    """The cohort-differencing attack: round 1 masked by all three, round 2 (nearly the same
    model) by two of them; the difference of the sums would be the third client's update."""

    def drop(kind: str, address: int, req: Records) -> Records:
        if kind == P.TRAIN and int(req[P.CONFIG][P.ROUND]) == 2:
            return _set(req, **{P.SECAGG_MEMBERS: "[0, 1]"})
        return req

    with pytest.raises(ClientFailure, match=r"secagg-members drops \[2\] in round 2, who survived round 1"):
        _secure(nodes, tmp_path, drop)


def test_the_same_state_for_another_member_set_is_refused():
    from retexo_fl.party.secure_reply import _check_stage_terms
    from retexo_fl.secure.secagg import SecAggError

    last = {"round": 2, "bound": 90.0, "members": [0, 1, 2, 3], "survivors": None, "digest": "d"}
    with pytest.raises(SecAggError, match="sends the state round 2 of this stage was masked from"):
        _check_stage_terms(last, [0, 1, 3], 90.0, "d", 3, "client 0")
    _check_stage_terms(last, [0, 1, 3], 90.0, "e", 3, "client 0")  # a new state: a lost member may leave
    with pytest.raises(SecAggError, match=r"secagg-members adds \[4\]"):
        _check_stage_terms(last, [0, 1, 2, 3, 4], 90.0, "e", 3, "client 0")


def test_a_threshold_other_than_the_run_configs_is_refused(nodes, tmp_path):
    def lower(kind: str, address: int, req: Records) -> Records:
        if kind == P.TRAIN:
            return _set(req, **{P.SECAGG_THRESHOLD: 4})
        return req

    with pytest.raises(ClientFailure, match="secagg-threshold 4; the run config's is 3"):
        _secure(nodes, tmp_path, lower)


def test_evaluate_serves_only_the_val_and_test_splits(nodes, tmp_path):
    """Evaluate returns exact counts per client: on the train split (or any other) they are
    label counts of nodes the run config never asked to be scored."""

    def train_split(kind: str, address: int, req: Records) -> Records:
        if kind == P.EVALUATE:
            return _set(req, **{P.SPLIT: "train"})
        return req

    with pytest.raises(ClientFailure, match="evaluate serves the val and test splits only, not 'train'"):
        _lazy(nodes, tmp_path, train_split)


@pytest.mark.parametrize(
    ("kind", "field", "value", "error"),
    [
        (P.TRAIN, P.SECAGG_MEMBERS, "[" * 100_000 + "]" * 100_000, "secagg-members is not a JSON list"),
        (
            P.TRAIN,
            P.SECAGG_MEMBERS,
            json.dumps(list(range(2_000))),
            "at most the 3 clients of the key directory",
        ),
        (P.SETUP, P.KEYS, '["a", "list"]', "keys must be a JSON object"),
        (P.SETUP, P.KEYS, "[" * 100_000 + "]" * 100_000, "keys is nested too deeply"),
        (P.TRAIN, P.ROUND, 2**70, "round '1180591620717411303424' is not a count"),
    ],
    ids=["nested-members", "2000-fake-members", "keys-as-list", "nested-keys", "huge-round"],
)
def test_malformed_fields_are_refused_naming_the_field(nodes, tmp_path, kind, field, value, error):
    def malform(k: str, address: int, req: Records) -> Records:
        if k == kind and (k != P.TRAIN or int(req[P.CONFIG][P.ROUND]) == 1):
            return _set(req, **{field: value})
        return req

    with pytest.raises(ClientFailure, match=re.escape(error)):
        _lazy(nodes, tmp_path, malform, secure_aggregation=True)


# -- secure aggregation: compressed updates on a grid, evaluations masked ---------------------------
def test_a_grid_sent_to_one_client_only_does_not_unmask(nodes, tmp_path):
    """A coarser grid for every client but one would shrink their codes' share of the sum; the
    grid is in the round's terms, so their masks no longer cancel and nothing decodes."""

    def coarsen(kind: str, address: int, req: Records) -> Records:
        grid = req[P.CONFIG].get(P.SECAGG_GRID)
        if kind == P.TRAIN and grid is not None and address != 0:
            clips = np.frombuffer(grid, "<f4") * 8
            return _set(req, **{P.SECAGG_GRID: clips.astype("<f4").tobytes()})
        return req

    with pytest.raises(ClientFailure, match="does not decode"):
        _secure(nodes, tmp_path, coarsen)


def test_a_grid_in_a_run_of_field_elements_is_refused_naming_it(nodes, tmp_path):
    def add_grid(kind: str, address: int, req: Records) -> Records:
        if kind == P.TRAIN and int(req[P.CONFIG][P.ROUND]) == 2:
            return _set(req, **{P.SECAGG_GRID: b"\0\0\x80?" * 8})
        return req

    with pytest.raises(ClientFailure, match="a secagg-grid for a run with update-bits 32"):
        _lazy(nodes, tmp_path, add_grid, **{**SECURE, "update_bits": 32})


def test_evaluations_travel_masked_and_the_server_learns_only_their_sum(nodes, tmp_path):
    """Every evaluate reply (stage validation, every test) holds one masked 12-byte vector and no
    figure in clear; the summary's per-client rows are gone, the sums are there. Whatever model
    the server sends (the class-bias model that counts each client's labels included), it gets
    the members' sum."""
    seen: list[Records] = []

    class Watching(ClientAppTransport):
        def send(self, kind, requests, phase, stage):
            batch = super().send(kind, requests, phase, stage)
            if kind == P.EVALUATE:
                seen.extend(batch.replies.values())
            return batch

    config = TrainConfig.resolve(**{**CFG, "pinned_keys": str(nodes[1] / "pins.json"), **SECURE})
    transport = Watching(_node_configs(nodes, tmp_path))
    out = LazyStageMachine(transport, config, RunRecorder(None, stream=None)).run()
    assert len(seen) >= 3 * 3  # three clients: two stage validations and a test at least
    for reply in seen:
        assert P.METRICS not in reply or P.CORRECT not in reply[P.METRICS]
        assert len(reply[P.MASKED][P.VECTOR]) == 12
    assert out["clients"] == [] and out["secure_aggregation"]["evaluations_masked"] >= 3
    assert 0.4 < out["test_accuracy"] <= 1.0  # a sum that decoded: 3 classes, chance is 0.33


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({P.SECAGG_MEMBERS: "[0, 1]"}, r"secagg-members \[0, 1\] for an evaluation; it must be the survivor"),
        ({P.SECAGG_EVAL: 1}, "secagg-evaluation 1 after 1; each evaluation takes a new one"),
    ],
    ids=["leave-one-out", "counter-reused"],
)
def test_an_evaluation_under_other_terms_is_refused(nodes, tmp_path, change, error):
    """Leaving one client out of an evaluation (its sum minus the full one's would be that
    client's figures) and reusing a counter (two vectors under one mask) are refused."""

    def tamper(kind: str, address: int, req: Records) -> Records:
        return _set(req, **change) if kind == P.EVALUATE else req

    with pytest.raises(ClientFailure, match=error):
        _secure(nodes, tmp_path, tamper)


def test_a_run_for_another_number_of_clients_than_the_nodes_cut_is_refused_naming_both(nodes, tmp_path):
    with pytest.raises(ClientFailure, match=r"part 0 of a 3-client cut, and the run config says clients=2"):
        _lazy(nodes, tmp_path, clients=2)


def test_a_client_built_from_a_refused_config_is_not_kept_for_the_next_message(nodes, tmp_path):
    """A cache miss (a worker that dropped the run) builds the client from the message's config:
    refused, it must not stay cached, or the next message with the honest config would find it
    and train by the refused one."""
    seen: dict[str, Any] = {}

    class Retry(ClientAppTransport):
        def send(self, kind: str, requests: dict[int, Records], phase: str, stage: int) -> Batch:
            if kind != P.TRAIN or 0 not in requests or seen:
                return super().send(kind, requests, phase, stage)
            config = {k: v for k, v in requests[0][P.CONFIG].items() if k != P.RUN_DIGEST}
            key = int(config[P.RUN_KEY])
            node_client.forget([key])
            honest = seen["honest"] = str(honest_run)
            swapped = {**config, P.RUN: json.dumps({**json.loads(honest), "lr": [0.0]})}
            first = super().send(kind, {0: {**requests[0], P.CONFIG: swapped}}, phase, stage)
            seen["first"] = first.failures.get(0, "accepted")
            retry = {**requests, 0: {**requests[0], P.CONFIG: {**config, P.RUN: honest}}}
            out = super().send(kind, retry, phase, stage)
            seen["lr"] = [c.cfg.lr for k, c in node_client._CACHE.items() if k[0] == key]
            return out

    config = TrainConfig.resolve(**{**CFG, "pinned_keys": str(nodes[1] / "pins.json")})
    honest_run = P.config_to_json(config)
    transport = Retry(_node_configs(nodes, tmp_path))
    out = LazyStageMachine(transport, config, RunRecorder(None, stream=None)).run()
    assert "refusing the run, run config" in seen["first"]
    assert seen["lr"] and all(lr == config.lr for lr in seen["lr"]) and out["lost_clients"] == []
