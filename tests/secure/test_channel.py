"""A party's sealed channels: frames open only for their peer, route and round; state survives."""

from __future__ import annotations

import pytest

from retexo_fl.secure.channel import PeerChannel
from retexo_fl.secure.envelope import ENVELOPE_BYTES, EnvelopeError
from retexo_fl.secure.keys import KeyMaterialError


def _pair() -> tuple[PeerChannel, PeerChannel, dict[int, bytes]]:
    a, b = PeerChannel(0), PeerChannel(1)
    directory = {0: a.public_key(), 1: b.public_key()}
    a.connect(directory, 42, {1})
    b.connect(directory, 42, {0})
    return a, b, directory


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


def test_disabled_channels_pass_frames_in_clear_and_unconnected_ones_refuse():
    assert PeerChannel(0, enabled=False).seal({1: b"x"}, "halo", 1) == {1: b"x"}
    with pytest.raises(RuntimeError, match="client 3: encryption is on but no key directory arrived"):
        PeerChannel(3).seal({1: b"x"}, "halo", 1)


def test_a_directory_with_another_key_for_this_party_is_refused():
    _, _, directory = _pair()
    with pytest.raises(KeyMaterialError, match="client 1: the key directory holds another key"):
        PeerChannel(1).connect(directory, 42, {0})


def test_state_survives_a_new_process():
    a, b, _ = _pair()
    again = PeerChannel(0)
    again.load_state(*a.to_state(), peers={1})
    assert again.public_key() == a.public_key()
    assert b.open(_from_a(again.seal({1: b"x"}, "halo", 1)), "halo", 1)[0] == {0: b"x"}
