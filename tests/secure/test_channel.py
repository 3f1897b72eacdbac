"""A party's sealed channels: frames open only for their peer, route, run and order; state survives."""

from __future__ import annotations

import pytest

from retexo_fl.secure.channel import PeerChannel
from retexo_fl.secure.envelope import ENVELOPE_BYTES, EnvelopeError
from retexo_fl.secure.keys import KeyMaterialError


def _connect(a: PeerChannel, b: PeerChannel, run: int = 42) -> dict[int, bytes]:
    directory = {0: a.public_key(), 1: b.public_key()}
    contributions = {0: a.contribution(), 1: b.contribution()}
    a.connect(directory, run, {1}, contributions)
    b.connect(directory, run, {0}, contributions)
    return directory


def _pair() -> tuple[PeerChannel, PeerChannel, dict[int, bytes]]:
    a, b = PeerChannel(0), PeerChannel(1)
    return a, b, _connect(a, b)


def _from_a(sealed: dict[int, bytes]) -> dict[int, bytes]:
    """What the server relays to party 1 of what party 0 sealed for it: keyed by source."""
    return {0: sealed[1]}


def test_frames_open_only_on_their_route():
    a, b, _ = _pair()
    sealed = a.seal({1: b"rows"}, "halo", 2)
    assert len(sealed[1]) == len(b"rows") + ENVELOPE_BYTES
    assert b.open(_from_a(sealed), "halo", 2) == ({0: b"rows"}, 0)
    with pytest.raises(EnvelopeError):
        b.open(_from_a(sealed), "halo", 3)  # another stage
    with pytest.raises(EnvelopeError):
        b.open({0: sealed[1][:-1] + bytes([sealed[1][-1] ^ 1])}, "halo", 2)  # tampered


def test_replays_of_older_rounds_are_refused():
    a, b, _ = _pair()
    old = a.seal({1: b"r1"}, "eager", 0, 1)
    assert b.open(_from_a(a.seal({1: b"r2"}, "eager", 0, 2)), "eager", 0, 2)[1] == 2
    with pytest.raises(EnvelopeError):
        b.open(_from_a(old), "eager", 0, 2)


def test_reordered_payloads_are_refused_and_a_redelivery_opens():
    a, b, _ = _pair()
    first, second = a.seal({1: b"one"}, "halo", 1), a.seal({1: b"two"}, "halo", 1)
    assert b.open(_from_a(second), "halo", 1)[0] == {0: b"two"}
    with pytest.raises(EnvelopeError, match="replayed or reordered, numbered 1 after number 2"):
        b.open(_from_a(first), "halo", 1)
    # A resumed server delivers the same payload again, byte for byte: it opens.
    assert b.open(_from_a(second), "halo", 1)[0] == {0: b"two"}


def test_a_run_that_reuses_the_run_key_gets_other_keys():
    a, b, _ = _pair()
    sealed = a.seal({1: b"rows"}, "halo", 1)
    # The same parties and key pairs, the same run key, but fresh contributions: a new run.
    b2 = PeerChannel(1)
    b2.identity = b.identity
    a2 = PeerChannel(0)
    a2.identity = a.identity
    _connect(a2, b2, run=42)
    with pytest.raises(EnvelopeError, match="failed authentication"):
        b2.open(_from_a(sealed), "halo", 1)


def test_a_transcript_without_this_partys_contribution_is_refused():
    a, b = PeerChannel(0), PeerChannel(1)
    directory = {0: a.public_key(), 1: b.public_key()}
    stale = {0: bytes(32), 1: b.contribution()}  # a server replaying an old run's transcript
    with pytest.raises(KeyMaterialError, match="client 0: the transcript holds another contribution"):
        a.connect(directory, 42, {1}, stale)
    with pytest.raises(KeyMaterialError, match="contributions do not match the key directory"):
        a.connect(directory, 42, {1}, {1: b.contribution()})


def test_disabled_channels_pass_frames_in_clear_and_unconnected_ones_refuse():
    assert PeerChannel(0, enabled=False).seal({1: b"x"}, "halo", 1) == {1: b"x"}
    with pytest.raises(RuntimeError, match="client 3: encryption is on but no key directory arrived"):
        PeerChannel(3).seal({1: b"x"}, "halo", 1)


def test_a_directory_with_another_key_for_this_party_is_refused():
    _, _, directory = _pair()
    other = PeerChannel(1)
    with pytest.raises(KeyMaterialError, match="client 1: the key directory holds another key"):
        other.connect(directory, 42, {0}, {0: bytes(32), 1: other.contribution()})


def test_state_survives_a_new_process():
    a, b, _ = _pair()
    b.open(_from_a(a.seal({1: b"x"}, "halo", 1)), "halo", 1)
    again_a, again_b = PeerChannel(0), PeerChannel(1)
    again_a.load_state(a.to_state(), peers={1})
    again_b.load_state(b.to_state(), peers={0})
    assert again_a.public_key() == a.public_key() and again_a.contribution() == a.contribution()
    assert again_b.open(_from_a(again_a.seal({1: b"y"}, "halo", 1)), "halo", 1)[0] == {0: b"y"}
    # The counters came back too: what the first receiver accepted is not accepted once more as new.
    stale = a.seal({1: b"z"}, "halo", 1)  # numbered 2 by the old sender: the restored one sent 2 too
    with pytest.raises(EnvelopeError, match="replayed or reordered"):
        again_b.open(_from_a(stale), "halo", 1)


def test_a_second_setup_keeps_the_counters_or_is_refused():
    a, b, directory = _pair()
    first = a.seal({1: b"one"}, "halo", 1)
    b.open(_from_a(first), "halo", 1)
    b.open(_from_a(a.seal({1: b"two"}, "halo", 1)), "halo", 1)
    contributions = {0: a.contribution(), 1: b.contribution()}
    b.connect(directory, 42, {0}, contributions)  # the same setup again (a retried message)
    with pytest.raises(EnvelopeError, match="replayed or reordered"):  # its counters were kept
        b.open(_from_a(first), "halo", 1)
    with pytest.raises(KeyMaterialError, match="a second key setup with another transcript"):
        b.connect(directory, 43, {0}, contributions)  # would reset the counters: refused


def test_parties_of_one_process_share_one_parse_and_one_transcript_of_the_same_directory():
    # In process, every party's setup carries the same directory text: it is parsed once into
    # read-only maps, and the transcript hashed once for those maps. Another text is parsed anew.
    import json

    from retexo_fl.party import handlers
    from retexo_fl.secure import channel
    from retexo_fl.secure.envelope import transcript_hash

    a, b = PeerChannel(0), PeerChannel(1)
    keys = json.dumps({0: a.public_key().hex(), 1: b.public_key().hex()})
    contributions = json.dumps({0: a.contribution().hex(), 1: b.contribution().hex()})
    d0, c0 = handlers._key_directory(keys, contributions, "client 0")
    d1, c1 = handlers._key_directory(keys, contributions, "client 1")
    assert d0 is d1 and c0 is c1
    with pytest.raises(TypeError):
        d0[1] = a.public_key()  # type: ignore[index]  # nobody can change a shared directory
    a.connect(d0, 42, {1}, c0)
    b.connect(d1, 42, {0}, c1)
    assert channel._last_transcript is not None and channel._last_transcript[0] is d0
    assert a.transcript == b.transcript == transcript_hash(42, dict(d0), dict(c0))
    assert b.open(_from_a(a.seal({1: b"rows"}, "halo", 1)), "halo", 1) == ({0: b"rows"}, 0)
    # A server that hands one party another directory: that party parses and hashes its own.
    c = PeerChannel(1)
    swapped = json.dumps({0: a.public_key().hex(), 1: c.public_key().hex()})
    swapped_contributions = json.dumps({0: a.contribution().hex(), 1: c.contribution().hex()})
    d2, c2 = handlers._key_directory(swapped, swapped_contributions, "client 1")
    assert d2 is not d0 and d2[1] == c.public_key()
    c.connect(d2, 42, {0}, c2)
    assert c.transcript != a.transcript
    with pytest.raises(EnvelopeError):
        c.open(_from_a(a.seal({1: b"rows"}, "halo", 2)), "halo", 2)
    # Plain maps, or read-only views of dicts a caller still holds, are hashed every time and
    # never kept: the caller could change them.
    kept = channel._last_transcript
    _pair()
    from types import MappingProxyType

    held = {0: a.public_key(), 1: b.public_key()}
    d = PeerChannel(0)
    d.own_contribution = a.contribution()
    d.identity = a.identity
    d.connect(MappingProxyType(held), 42, {1}, MappingProxyType({0: a.contribution(), 1: b.contribution()}))
    assert channel._last_transcript is kept and d.directory is not held
