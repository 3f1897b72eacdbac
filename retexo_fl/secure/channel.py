"""One party's sealed channels to its peers: its identity key, the key directory, the envelopes."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from retexo_fl.secure.envelope import CONTRIBUTION_BYTES, Envelopes, Route, transcript_hash
from retexo_fl.secure.keys import (
    KeyMaterialError,
    check_directory,
    load_pins,
    load_private_key,
    private_bytes,
    public_bytes,
)

#: Read-only views made by :func:`frozen_directory` (by ``id``, the views themselves kept so that
#: no id is reused): nobody holds their dicts, so their contents cannot change.
_frozen: dict[int, Mapping[int, bytes]] = {}
_FROZEN_KEPT = 8
#: The last transcript hashed in this process, with the frozen maps it was hashed from.
_last_transcript: tuple[Mapping[int, bytes], Mapping[int, bytes], int, bytes, bytes] | None = None


def frozen_directory(
    directory: dict[int, bytes], contributions: dict[int, bytes]
) -> tuple[Mapping[int, bytes], Mapping[int, bytes]]:
    """Read-only views of a key directory and its transcript contributions just parsed, whose
    dicts the caller gives up: parties handed these very views share their transcript and keep
    the directory without a copy (in process, every party's setup carries the same directory).

    Args:
        directory (dict[int, bytes]): client id -> public key; no other reference may remain.
        contributions (dict[int, bytes]): client id -> transcript contribution; likewise.
    """
    views = MappingProxyType(directory), MappingProxyType(contributions)
    for view in views:
        _frozen[id(view)] = view
    while len(_frozen) > _FROZEN_KEPT:
        _frozen.pop(next(iter(_frozen)))
    return views


def _is_frozen(value: Mapping[int, bytes]) -> bool:
    return _frozen.get(id(value)) is value


#: Directories turned to hex for a node's state and hex directories parsed back, both ways
#: (``id`` -> the pair, the objects themselves kept so that no id is reused): every party of a
#: run holds the same directory, and a node-level run saves and loads thousands of states, so a
#: process keeps one view and one hex dict of it whichever way it met it first. A saved state
#: names its directory by that hex dict's digest, computed once for the dict.
_hex_of: dict[int, tuple[Mapping[int, bytes], dict[str, str]]] = {}
_view_of: dict[int, tuple[dict[str, str], Mapping[int, bytes]]] = {}
_PAIRS_KEPT = 4


def _pair(view: Mapping[int, bytes], hexed: dict[str, str]) -> None:
    """Remember that ``hexed`` is ``view`` in hex, for either lookup."""
    for memo, key, value in ((_hex_of, view, hexed), (_view_of, hexed, view)):
        memo[id(key)] = (key, value)  # type: ignore[assignment]
        while len(memo) > _PAIRS_KEPT:
            memo.pop(next(iter(memo)))


def _directory_hex(directory: Mapping[int, bytes]) -> dict[str, str]:
    """``directory`` as :meth:`PeerChannel.to_state` writes it (client id -> key hex), the same
    dict object for the same directory: a node's saved state names it by that dict's digest."""
    known = _hex_of.get(id(directory))
    if known is not None and known[0] is directory:
        return known[1]
    hexed = {str(q): k.hex() for q, k in directory.items()}
    if _is_frozen(directory):  # a read-only view: it cannot change under the memo
        _pair(directory, hexed)
    return hexed


def _directory_parsed(hexed: dict[str, str]) -> Mapping[int, bytes]:
    """A saved directory parsed back; the same frozen view for the same saved dict, and for the
    dict :func:`_directory_hex` made of a view, that view (node states of one process share the
    directory their loader read once, or their setup parsed)."""
    known = _view_of.get(id(hexed))
    if known is not None and known[0] is hexed:
        return known[1]
    directory = {int(q): bytes.fromhex(k) for q, k in hexed.items()}
    view, _ = frozen_directory(directory, {})
    _pair(view, hexed)
    return view


def _transcript(
    directory: Mapping[int, bytes],
    contributions: Mapping[int, bytes],
    run_id: int,
    run_config: bytes,
    where: str,
) -> bytes:
    """Check that every party in the directory has one contribution, then hash the transcript.

    Both are a pass over every party. In process, every party's setup hands over the same
    :func:`frozen_directory` views, which nobody can change: for those very objects the last
    result is reused, so n parties make one pass, not n. Other maps are checked and hashed
    each time.
    """
    global _last_transcript
    last = _last_transcript
    if (
        last is not None
        and last[0] is directory
        and last[1] is contributions
        and (last[2], last[3]) == (run_id, run_config)
    ):
        return last[4]
    if set(contributions) != set(directory) or any(
        len(c) != CONTRIBUTION_BYTES for c in contributions.values()
    ):
        raise KeyMaterialError(f"{where}: the transcript contributions do not match the key directory")
    transcript = transcript_hash(run_id, dict(directory), dict(contributions), run_config)
    if _is_frozen(directory) and _is_frozen(contributions):
        _last_transcript = (directory, contributions, run_id, run_config, transcript)
    return transcript


class PeerChannel:
    """End-to-end sealing of the frames one party relays through the server to its peers.

    The server only routes: it collects public keys and each party's random contribution to the
    run transcript, hands every party the directory, and forwards sealed frames it cannot open.
    With ``enabled=False`` frames pass in clear (debugging only).

    Args:
        party (int): this party's client (partition) id.
        enabled (bool, optional): seal frames. (default: :obj:`True`)
        identity_key (str, optional): this party's X25519 private key file; empty for a key pair
            made for this run. (default: ``""``)
        pinned_keys (str, optional): a JSON file ``{client id: public key hex}`` exchanged out of
            band; the directory must agree with it. (default: ``""``)
    """

    def __init__(
        self, party: int, enabled: bool = True, identity_key: str = "", pinned_keys: str = ""
    ) -> None:
        self.party = party
        self.enabled = enabled
        self.identity_key = identity_key
        self.pinned_keys = pinned_keys
        self.identity: X25519PrivateKey | None = None
        self.own_contribution: bytes | None = None
        self.directory: Mapping[int, bytes] | None = None
        self.transcript: bytes | None = None
        self.envelopes: Envelopes | None = None
        #: Sees every frame before it is sealed, as (kind, stage, round, peer, frame): the
        #: residency audit records what peers get, not only what the server relays.
        self.observer: Callable[[str, int, int, int, bytes], Any] | None = None

    @property
    def where(self) -> str:
        return f"client {self.party}"

    def public_key(self) -> bytes:
        """This party's X25519 public key (32 bytes): from its identity key file, or a key pair
        made for this run."""
        if self.identity is None:
            self.identity = (
                load_private_key(self.identity_key) if self.identity_key else X25519PrivateKey.generate()
            )
        return public_bytes(self.identity)

    def contribution(self) -> bytes:
        """This party's fresh random contribution to the run transcript (made once per run)."""
        if self.own_contribution is None:
            self.own_contribution = os.urandom(CONTRIBUTION_BYTES)
        return self.own_contribution

    def connect(
        self,
        directory: dict[int, bytes],
        run_id: int,
        peers: set[int],
        contributions: dict[int, bytes],
        allow_missing: bool = False,
        run_config: bytes = b"",
    ) -> None:
        """Derive the sealed channels to ``peers`` from the server's key directory and transcript.

        Args:
            directory (dict[int, bytes]): client id -> public key, as the server relayed it.
            run_id (int): the server's run key.
            peers (set[int]): the clients this party sends rows to or receives rows from.
            contributions (dict[int, bytes]): client id -> its transcript contribution, as relayed.
            allow_missing (bool, optional): a peer absent from the directory was lost at key
                setup: connect to the others (its rows will be missing, and are reported as
                such). (default: :obj:`False`)
            run_config (bytes, optional): the digest of the run config this party was sent, bound
                into the transcript. (default: ``b""``)

        Raises:
            KeyMaterialError: the directory misses a peer (unless ``allow_missing``), has another
                key or contribution for this party, lacks a contribution, disagrees with the
                pinned keys, or would replace the channels this party already set up in this run.
        """
        where = self.where
        pins = load_pins(self.pinned_keys) if self.pinned_keys else None
        check_directory(directory, pins, where)
        if directory.get(self.party) != self.public_key():
            raise KeyMaterialError(f"{where}: the key directory holds another key for this client")
        missing = sorted(q for q in peers if q not in directory)
        if missing and not allow_missing:
            raise KeyMaterialError(f"{where}: no public key for peer clients {missing}")
        if contributions.get(self.party) is None:
            raise KeyMaterialError(f"{where}: the transcript contributions do not match the key directory")
        # Without this party's own fresh contribution the transcript could be an old run's.
        if contributions[self.party] != self.contribution():
            raise KeyMaterialError(f"{where}: the transcript holds another contribution for this client")
        transcript = _transcript(directory, contributions, int(run_id), run_config, where)
        if self.transcript is not None:
            # Set up already: the same setup again (a retried message) keeps the channels and
            # their counters; another one would reset replay protection, so it is refused.
            if transcript == self.transcript:
                return
            raise KeyMaterialError(
                f"{where}: a second key setup with another transcript in the same run; refusing it "
                "(a server replaying an old run's setup, or re-keying this one)"
            )
        self._open(directory, transcript, peers, None)

    def _open(
        self,
        directory: Mapping[int, bytes],
        transcript: bytes,
        peers: set[int],
        counters: dict | None,
        lazy: bool = False,
    ) -> None:
        assert self.identity is not None
        # A read-only directory is kept as it is: in process the parties share one, not n copies.
        self.directory = directory if _is_frozen(directory) else dict(directory)
        self.transcript = transcript
        reachable = {q: directory[q] for q in peers if q in directory}  # lost at key setup: none
        self.envelopes = Envelopes(self.party, self.identity, transcript, reachable, counters, lazy=lazy)

    def _ready(self) -> Envelopes:
        if self.envelopes is None:
            raise RuntimeError(f"client {self.party}: encryption is on but no key directory arrived")
        return self.envelopes

    def plan_tag(self, src: int, dst: int, message: bytes) -> str | None:
        """A tag of ``message`` only the two ends of the direction ``src`` to ``dst`` can compute
        (:meth:`~retexo_fl.secure.envelope.Envelopes.plan_tag`); ``None`` without a channel."""
        if not self.enabled or self.envelopes is None:
            return None
        return self.envelopes.plan_tag(src, dst, message)

    def seal(self, frames: dict[int, bytes], kind: str, stage: int, round_: int = 0) -> dict[int, bytes]:
        """``frames`` (peer -> frame) sealed for their peers, or as they are when disabled."""
        if not self.enabled:
            return frames
        envelopes = self._ready()
        if self.observer is not None:
            for q, f in sorted(frames.items()):
                self.observer(kind, stage, round_, q, bytes(f))
        # A peer without a channel was lost at key setup: the server has nobody to relay to.
        return {
            q: envelopes.seal(f, Route(kind, stage, round_, self.party, q))
            for q, f in sorted(frames.items())
            if q in envelopes.peers
        }

    def open(
        self, blobs: dict[int, bytes], kind: str, stage: int, min_round: int = 0
    ) -> tuple[dict[int, bytes], int]:
        """Opened frames (source -> frame) and the newest round they were sealed in.

        Raises:
            EnvelopeError: a blob is tampered, replayed, reordered (older than ``min_round``, or
                numbered at or below one accepted before) or misrouted.
        """
        if not self.enabled:
            return blobs, 0
        envelopes = self._ready()
        out, newest = {}, 0
        for p, blob in blobs.items():
            out[p], rnd = envelopes.open(blob, kind, stage, p, min_round)
            newest = max(newest, rnd)
        return out, newest

    def accepted(self) -> dict[int, list] | None:
        """The incoming counters (``{peer: [number, digest]}``), or ``None`` before key setup."""
        if self.envelopes is None:
            return None
        return {p: [n, d] for p, (n, d) in self.envelopes.accepted().items()}

    def rewind(self, accepted: dict[int, list] | None) -> None:
        """Go back to incoming counters :meth:`accepted` returned (see :meth:`Envelopes.rewind`)."""
        if self.envelopes is not None and accepted is not None:
            self.envelopes.rewind({int(p): (int(v[0]), str(v[1])) for p, v in accepted.items()})

    def to_state(self) -> dict:
        """What a node keeps between messages: private key, contribution, directory, transcript
        and counters (hex and ints; the private key never leaves the node's work folder)."""
        return {
            "identity": None if self.identity is None else private_bytes(self.identity).hex(),
            "contribution": None if self.own_contribution is None else self.own_contribution.hex(),
            "directory": None if self.directory is None else _directory_hex(self.directory),
            "transcript": None if self.transcript is None else self.transcript.hex(),
            "counters": None if self.envelopes is None else self.envelopes.counters(),
        }

    def load_state(self, state: dict, peers: set[int]) -> None:
        """Restore what :meth:`to_state` returned (reopening the channels when it had them)."""
        if state.get("identity"):
            self.identity = X25519PrivateKey.from_private_bytes(bytes.fromhex(state["identity"]))
        if state.get("contribution"):
            self.own_contribution = bytes.fromhex(state["contribution"])
        if state.get("directory") and state.get("transcript"):
            directory = _directory_parsed(state["directory"])
            # Keys derived at setup already: each peer's again when a payload needs it.
            self._open(directory, bytes.fromhex(state["transcript"]), peers, state.get("counters"), lazy=True)
