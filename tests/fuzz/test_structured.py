"""Structure-aware fuzzing: inputs valid up to one layer, so that they reach the parser behind it.

Random bytes stop at the first check (a magic number, a JSON parse). These fuzzers build inputs
that pass every layer but one: ``.npy`` files with valid headers and hostile shapes and dtypes
(they reach NumPy's header parser and our shape checks), envelopes with valid headers and
flipped ciphertext (they reach AES-GCM), and manifests that are valid JSON with hostile nesting
and values (they reach the manifest checks). Every case still ends in the parser's own error.
``LAYERS`` counts which layer refused each case; the last test prints the counts and fails if a
layer was never reached (run with ``-s`` to see them).
"""

from __future__ import annotations

import collections
import json
import shutil

import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from retexo_fl.data.partition import PartitionError, load_partition
from retexo_fl.secure.envelope import _HEAD, NONCE_BYTES, EnvelopeError, Envelopes, Route, transcript_hash
from retexo_fl.secure.keys import public_bytes

FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
#: (fuzzer, layer that refused the case) -> cases.
LAYERS: collections.Counter[tuple[str, str]] = collections.Counter()


def _npy(descr: str, shape: tuple[int, ...], body: bytes, fortran: bool = False) -> bytes:
    """A ``.npy`` version 1.0 file with a valid header for ``shape`` and whatever ``body``."""
    header = repr({"descr": descr, "fortran_order": fortran, "shape": shape}).encode()
    pad = 64 - (10 + len(header) + 1) % 64
    header += b" " * pad + b"\n"
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + body


def _layer(message: str) -> str:
    """Which check refused a partition case, from the error's field."""
    for needle, layer in (
        ("not a readable .npy", "numpy header / body"),
        ("dtype", "dtype check"),
        ("shape", "shape check"),
        ("expected", "shape check"),
    ):
        if needle in message:
            return layer
    return "content checks"


ARRAYS = ["node_ids.npy", "x.npy", "y.npy", "train_mask.npy", "edges.npy", "cross_edges.npy"]
DESCRS = ["<f4", "<f2", "<f8", "<i8", "<u8", "|b1", "<i4", "<c8", ">f4"]
SHAPES = st.one_of(
    st.tuples(st.integers(0, 2**40)),
    st.tuples(st.integers(0, 2**31), st.integers(0, 2**31)),
    st.tuples(st.integers(0, 50), st.integers(0, 50)),
    st.tuples(st.integers(0, 4), st.integers(0, 4), st.integers(0, 4)),
    st.just(()),
)


@FUZZ
@given(st.sampled_from(ARRAYS), st.sampled_from(DESCRS), SHAPES, st.binary(max_size=2048), st.booleans())
def _npy_fuzz(good_partition, reseal, tmp_path, name, descr, shape, body, fortran):
    root = tmp_path / "p"
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(good_partition, root)
    (root / name).write_bytes(_npy(descr, shape, body, fortran))
    reseal(root)
    try:
        part = load_partition(root)
    except PartitionError as exc:
        assert str(root) in str(exc)
        LAYERS[("npy", _layer(str(exc)))] += 1
    else:  # a header and body that happen to be a valid array of the right shape
        assert part.num_nodes > 0
        LAYERS[("npy", "accepted")] += 1


_KEYS = [X25519PrivateKey.generate() for _ in range(2)]
_DIR = {i: public_bytes(k) for i, k in enumerate(_KEYS)}
_TRANSCRIPT = transcript_hash(9, _DIR, {0: bytes(32), 1: bytes([1]) * 32})


@FUZZ
@given(
    st.binary(max_size=300),
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 255)), min_size=1, max_size=4),
    st.booleans(),
)
def _envelope_fuzz(plain, flips, in_header):
    sender, receiver = Envelopes(0, _KEYS[0], _TRANSCRIPT, _DIR), Envelopes(1, _KEYS[1], _TRANSCRIPT, _DIR)
    original = sender.seal(plain, Route("halo", 3, 2, 0, 1))
    blob = bytearray(original)
    body = _HEAD.size + NONCE_BYTES
    if in_header:  # another round or counter, still a well-formed header for this receiver
        blob[7:11] = (int.from_bytes(blob[7:11], "big") + flips[0][1]).to_bytes(4, "big")  # the round
    else:
        for pos, delta in flips:
            blob[body + pos % (len(blob) - body)] ^= delta
    assume(bytes(blob) != original)  # flips that cancel out leave the payload as sealed
    with pytest.raises(EnvelopeError, match="client 0") as info:
        receiver.open(bytes(blob), "halo", 3, 0)
    assert "failed authentication" in str(info.value), str(info.value)
    LAYERS[("envelope", "AES-GCM")] += 1


def _nest(depth: int, leaf: object) -> object:
    out = leaf
    for i in range(depth):
        out = [out] if i % 2 else {"k": out}
    return out


MANIFEST_FIELDS = ["num_classes", "num_partitions", "partition_id", "num_global_nodes", "counts", "checksums"]


@FUZZ
@given(
    st.sampled_from(MANIFEST_FIELDS),
    st.one_of(
        st.integers(0, 10_000).map(lambda d: ("nested", d)),
        st.integers(-(2**70), 2**70).map(lambda v: ("value", v)),
        st.floats(allow_nan=True).map(lambda v: ("value", v)),
        st.text(max_size=20).map(lambda v: ("value", v)),
    ),
)
def _manifest_fuzz(good_partition, tmp_path, field, change):
    root = tmp_path / "m"
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(good_partition, root)
    manifest = json.loads((root / "manifest.json").read_text())
    how, value = change
    manifest[field] = _nest(value, 1) if how == "nested" else value
    try:
        text = json.dumps(manifest)
    except RecursionError:  # deeper than Python's json writer goes: write the nesting by hand
        text = json.dumps({**manifest, field: 0}).replace(
            '"' + field + '": 0', f'"{field}": ' + "[" * value + "]" * value
        )
    (root / "manifest.json").write_text(text)
    try:
        load_partition(root)
    except PartitionError as exc:
        assert "manifest.json" in str(exc) or str(root) in str(exc)
        LAYERS[("manifest", "nested" if "nested" in str(exc) else "field checks")] += 1
    else:  # the change kept the manifest valid (an equal value)
        LAYERS[("manifest", "accepted")] += 1


def _reached(fuzz, **fixtures) -> collections.Counter:
    """Run one fuzzer (its Hypothesis search), and count the layers its cases reached."""
    before = collections.Counter(LAYERS)
    fuzz(**fixtures)
    return LAYERS - before


# Each test runs its own fuzzer and checks it reached the layer it was built for: a fuzzer
# whose cases all stop at the first check would pass while testing nothing. No test depends on
# another having run first.
def test_valid_npy_headers_with_hostile_shapes_give_one_clear_error(good_partition, reseal, tmp_path):
    reached = _reached(_npy_fuzz, good_partition=good_partition, reseal=reseal, tmp_path=tmp_path)
    assert reached[("npy", "numpy header / body")] > 0
    assert reached[("npy", "shape check")] + reached[("npy", "dtype check")] > 0


def test_flipped_ciphertext_in_a_valid_envelope_fails_authentication():
    """The header is left valid (or changed to another valid route), so every case reaches AES-GCM."""
    assert _reached(_envelope_fuzz)[("envelope", "AES-GCM")] > 0


def test_valid_json_manifests_with_hostile_values_give_one_clear_error(good_partition, tmp_path):
    assert (
        _reached(_manifest_fuzz, good_partition=good_partition, tmp_path=tmp_path)[
            ("manifest", "field checks")
        ]
        > 0
    )
