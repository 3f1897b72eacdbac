"""Sealed payloads: only the destination opens them; tampered, replayed, misrouted or cut ones are refused."""

from __future__ import annotations

import dataclasses
import json

import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from retexo_fl.cli import main
from retexo_fl.config import TrainConfig
from retexo_fl.coordinator.federation import FederationView
from retexo_fl.data.partitioners import partition_graph
from retexo_fl.metrics import RunRecorder
from retexo_fl.party.lazy_client import LazyClient
from retexo_fl.secure import envelope
from retexo_fl.secure.envelope import (
    ENVELOPE_BYTES,
    NONCE_BYTES,
    EnvelopeError,
    Envelopes,
    Route,
    transcript_hash,
)
from retexo_fl.secure.keys import KeyMaterialError, check_directory, load_pins, public_bytes
from retexo_fl.training.inprocess import InProcessTransport
from retexo_fl.training.lazy import run_lazy

RUN = 123456789


def _transcript(directory: dict[int, bytes], run: int = RUN) -> bytes:
    return transcript_hash(run, directory, {p: bytes([p]) * 32 for p in directory})


@pytest.fixture
def parties():
    keys = {p: X25519PrivateKey.generate() for p in range(3)}
    directory = {p: public_bytes(k) for p, k in keys.items()}
    return {p: Envelopes(p, k, _transcript(directory), directory) for p, k in keys.items()}, keys, directory


def test_only_the_destination_opens(parties):
    env, _, _ = parties
    blob = env[0].seal(b"rows of client 0", Route("halo", 2, 0, 0, 1))
    assert len(blob) == len(b"rows of client 0") + ENVELOPE_BYTES
    assert b"rows of client 0" not in blob
    assert env[1].open(blob, "halo", 2, 0) == (b"rows of client 0", 0)
    # Misrouted: the server hands client 0's payload for client 1 to client 2.
    with pytest.raises(EnvelopeError, match=r"client 2: payload from client 0 .*misrouted"):
        env[2].open(blob, "halo", 2, 0)


def test_a_restored_channel_derives_a_peers_keys_when_a_payload_needs_them(parties, monkeypatch):
    env, keys, directory = parties
    exchanges = []
    real = envelope.X25519PublicKey

    class Counted:  # each X25519 exchange reads its peer's public key once
        @staticmethod
        def from_public_bytes(data):
            exchanges.append(data)
            return real.from_public_bytes(data)

    monkeypatch.setattr(envelope, "X25519PublicKey", Counted)
    eager = Envelopes(0, keys[0], _transcript(directory), directory)
    assert len(exchanges) == 2  # key setup: each peer's channel at once, one exchange for both ways
    exchanges.clear()
    lazy = Envelopes(0, keys[0], _transcript(directory), directory, eager.counters(), lazy=True)
    assert exchanges == [] and lazy.peers == {1, 2}
    # The keys it derives later are the channel's own, both ways.
    blob = lazy.seal(b"rows for client 1", Route("halo", 1, 0, 0, 1))
    assert env[1].open(blob, "halo", 1, 0) == (b"rows for client 1", 0)
    back = env[2].seal(b"rows for client 0", Route("halo", 1, 0, 2, 0))
    assert lazy.open(back, "halo", 1, 2) == (b"rows for client 0", 0)
    assert len(exchanges) == 2
    with pytest.raises(EnvelopeError, match="no channel"):  # no key for a stranger, lazy or not
        lazy.seal(b"x", Route("halo", 1, 0, 0, 7))


def test_tampered_payload_names_its_source(parties):
    env, _, _ = parties
    blob = bytearray(env[2].seal(b"x" * 64, Route("halo", 1, 0, 2, 0)))
    for pos in (len(blob) - 1, 30, 5):  # tag, nonce, header (stage byte)
        bad = bytearray(blob)
        bad[pos] ^= 0x01
        with pytest.raises(EnvelopeError, match="payload from client 2"):
            env[0].open(bytes(bad), "halo", 1, 2)


def test_replayed_payload_is_refused(parties):
    env, _, _ = parties
    stage1 = env[0].seal(b"stage 1 rows", Route("halo", 1, 0, 0, 1))
    with pytest.raises(EnvelopeError, match="replayed, sealed as kind 2 at stage 1"):
        env[1].open(stage1, "halo", 2, 0)  # presented again at stage 2
    with pytest.raises(EnvelopeError, match="replayed"):
        env[1].open(stage1, "deg", 0, 0)
    round3 = env[0].seal(b"eager rows", Route("eager", 0, 3, 0, 1))
    assert env[1].open(round3, "eager", 0, 0, min_round=3)[1] == 3
    with pytest.raises(EnvelopeError, match="sealed in round 3, expected round >= 4"):
        env[1].open(round3, "eager", 0, 0, min_round=4)


def test_truncated_and_foreign_payloads(parties):
    env, keys, directory = parties
    blob = env[0].seal(b"y" * 100, Route("deg", 0, 0, 0, 1))
    with pytest.raises(EnvelopeError, match="failed authentication"):
        env[1].open(blob[:-5], "deg", 0, 0)
    with pytest.raises(EnvelopeError, match="shorter than an envelope"):
        env[1].open(blob[:20], "deg", 0, 0)
    with pytest.raises(EnvelopeError, match="not a sealed payload"):
        env[1].open(b"RXQ1" + b"\0" * 60, "deg", 0, 0)
    # Another run derives other keys: a payload of an earlier run does not open.
    other_run = Envelopes(1, keys[1], _transcript(directory, RUN + 1), directory)
    with pytest.raises(EnvelopeError, match="failed authentication"):
        other_run.open(blob, "deg", 0, 0)


def test_nonces_never_repeat(parties):
    env, _, _ = parties
    route = Route("halo", 1, 0, 0, 1)
    nonces = {env[0].seal(b"same", route)[-(NONCE_BYTES + 4 + 16) : -(4 + 16)] for _ in range(2000)}
    assert len(nonces) == 2000


def test_pins_catch_a_swapped_key(tmp_path):
    assert main(["keys", "--clients", "3", "--out", str(tmp_path)]) == 0
    pins = load_pins(tmp_path / "pins.json")
    assert sorted(pins) == [0, 1, 2] and (tmp_path / "client-1.key").stat().st_mode & 0o777 == 0o600
    check_directory(pins, pins, "client 0")
    swapped = {**pins, 2: public_bytes(X25519PrivateKey.generate())}
    with pytest.raises(KeyMaterialError, match="key for client 2 is not the pinned one"):
        check_directory(swapped, pins, "client 0")
    (tmp_path / "bad.json").write_text(json.dumps({"0": "abcd"}))
    with pytest.raises(KeyMaterialError, match="client 0: a public key is 32 bytes"):
        load_pins(tmp_path / "bad.json")


def test_clients_refuse_a_directory_that_disagrees_with_the_pins(sbm, tmp_path):
    main(["keys", "--clients", "3", "--out", str(tmp_path)])
    cfg = TrainConfig.resolve(
        profile="exact", clients=3, identity_keys=str(tmp_path), pinned_keys=str(tmp_path / "pins.json")
    )
    clients = [LazyClient(p, cfg) for p in partition_graph(sbm, 3, "random", seed=0)]
    FederationView(
        InProcessTransport(clients), cfg, RunRecorder(None, stream=None)
    ).setup()  # honest: pins match
    directory = {c.id: c.public_key() for c in clients}
    directory[1] = public_bytes(X25519PrivateKey.generate())  # a server that swapped client 1's key
    contributions = {c.id: c.channel.contribution() for c in clients}
    with pytest.raises(KeyMaterialError, match="client 0: the server's key for client 1"):
        clients[0].connect(directory, 7, contributions)


def test_encryption_changes_bytes_by_envelopes_only(sbm):
    parts = partition_graph(sbm, 3, "random", seed=0)
    cfg = TrainConfig.resolve(model="gcn", stages=3, hidden=16, rounds=20, seed=0, profile="exact")
    sealed = run_lazy(parts, cfg)
    plain = run_lazy(parts, dataclasses.replace(cfg, encrypt=False))
    assert sealed["test_accuracy"] == plain["test_accuracy"]
    frames = sum(len({r[2] for r in p.cross_edges.tolist()}) for p in parts)  # peers per client
    # Degrees once, then the rows after each stage but the last: three rounds of frames.
    assert sealed["bytes_boundary"] - plain["bytes_boundary"] == 3 * frames * ENVELOPE_BYTES
