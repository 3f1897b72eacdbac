"""Fuzzing the parsers that take bytes from others: frames, envelopes and partition folders.

Every hostile input must end in the parser's own error (naming the source, file or field),
never in another exception. Each fuzzer is bounded (``max_examples``) so CI time stays fixed.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from retexo_fl.compress.payload import PayloadError, decode_rows, encode_rows
from retexo_fl.data.partition import PartitionError, load_partition
from retexo_fl.secure.envelope import EnvelopeError, Envelopes, Route, transcript_hash
from retexo_fl.secure.keys import public_bytes

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(
    st.binary(max_size=400),
    st.one_of(st.none(), st.integers(0, 20)),
    st.one_of(st.none(), st.integers(0, 20)),
)
def test_random_bytes_never_crash_the_frame_decoder(blob, rows, cols):
    try:
        out = decode_rows(blob, "client 9", rows, cols)
    except PayloadError as exc:
        assert "client 9" in str(exc)
    else:
        assert out.dtype == torch.float32 and bool(torch.isfinite(out).all())


@FUZZ
@given(
    st.sampled_from([1, 2, 4, 8, 16, 32]),
    st.integers(1, 6),
    st.integers(1, 9),
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=4),
    st.integers(-8, 8),
)
def test_mutated_frames_are_refused_or_decode_to_the_declared_shape(bits, k, d, flips, resize):
    gen = torch.Generator().manual_seed(k * 31 + d)
    frame = bytearray(encode_rows(torch.randn(k, d, generator=gen), bits, generator=gen))
    for pos, value in flips:
        frame[pos % len(frame)] = value
    if resize > 0:
        frame += bytes(resize)
    elif resize < 0:
        del frame[resize:]
    try:
        out = decode_rows(bytes(frame), "client 4", k, d)
    except PayloadError as exc:
        assert "client 4" in str(exc)
    else:
        assert out.shape == (k, d) and bool(torch.isfinite(out).all())


_KEYS = [X25519PrivateKey.generate() for _ in range(2)]
_DIR = {i: public_bytes(k) for i, k in enumerate(_KEYS)}
_TRANSCRIPT = transcript_hash(5, _DIR, {0: bytes(32), 1: bytes([1]) * 32})
_SENDER, _RECEIVER = Envelopes(0, _KEYS[0], _TRANSCRIPT, _DIR), Envelopes(1, _KEYS[1], _TRANSCRIPT, _DIR)


@FUZZ
@given(
    st.binary(min_size=0, max_size=200),
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 255)), max_size=3),
)
def test_any_change_to_an_envelope_is_refused(plain, flips):
    blob = bytearray(_SENDER.seal(plain, Route("halo", 1, 0, 0, 1)))
    changed = False
    for pos, delta in flips:
        blob[pos % len(blob)] ^= delta
        changed = True
    if not changed:
        assert _RECEIVER.open(bytes(blob), "halo", 1, 0)[0] == plain
        return
    if bytes(blob) == bytes(_SENDER.seal(plain, Route("halo", 1, 0, 0, 1))):  # flips cancelled out
        return
    try:
        opened, _ = _RECEIVER.open(bytes(blob), "halo", 1, 0)
    except EnvelopeError as exc:
        assert "payload from client 0" in str(exc)
    else:  # only possible if the flips undid each other
        assert opened == plain


@FUZZ
@given(st.binary(max_size=120))
def test_random_bytes_never_open_as_an_envelope(blob):
    with pytest.raises(EnvelopeError, match="payload from client 0"):
        _RECEIVER.open(blob, "deg", 0, 0)


# ---- partition folders ------------------------------------------------------------------------


ARRAYS = [
    "node_ids.npy",
    "x.npy",
    "y.npy",
    "train_mask.npy",
    "val_mask.npy",
    "test_mask.npy",
    "edges.npy",
    "cross_edges.npy",
]


def _hostile_array(name: str, kind: str, arr: np.ndarray, value: int) -> np.ndarray:
    a = np.array(arr)
    if kind == "negative" and a.size:
        a.flat[value % a.size] = -abs(value) - 1
    elif kind == "huge" and a.size:
        a = a.astype(np.int64) if a.dtype.kind != "f" else a
        a.flat[value % a.size] = 2**62
    elif kind == "nan" and a.size:
        a = a.astype(np.float32)
        a.flat[value % a.size] = np.nan
    elif kind == "truncate":
        a = a[: max(0, a.shape[0] - 1 - value % 3)]
    elif kind == "transpose" and a.ndim == 2:
        a = a.T
    elif kind == "dtype":
        a = a.astype(np.complex64) if value % 2 else a.astype(object).astype(str)
    elif kind == "duplicate" and a.shape[0] > 1:
        a[-1] = a[0]
    elif kind == "flat":
        a = a.reshape(-1)
    return a


@FUZZ
@given(
    st.sampled_from(ARRAYS),
    st.sampled_from(["negative", "huge", "nan", "truncate", "transpose", "dtype", "duplicate", "flat"]),
    st.integers(0, 10_000),
)
def test_adversarial_partition_arrays_give_one_clear_error(
    good_partition, reseal, tmp_path, name, kind, value
):
    root = tmp_path / f"p-{name}-{kind}-{value}"
    shutil.copytree(good_partition, root)
    hostile = _hostile_array(name, kind, np.load(root / name), value)
    np.save(root / name, hostile, allow_pickle=False)
    reseal(root)
    try:
        part = load_partition(root)
    except PartitionError as exc:
        assert str(root) in str(exc) and "field" in str(exc)
    else:  # the change kept the partition valid (e.g. a NaN in an integer array became an int)
        assert part.num_nodes > 0 and np.isfinite(part.x).all()


@FUZZ
@given(
    st.sampled_from(
        [
            "format_version",
            "partition_id",
            "num_partitions",
            "num_global_nodes",
            "num_classes",
            "directed",
            "residency_bound",
            "counts",
            "checksums",
        ]
    ),
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.text(max_size=5),
        st.lists(st.integers(), max_size=2),
    ),
)
def test_adversarial_manifests_give_one_clear_error(good_partition, tmp_path, key, value):
    root = tmp_path / "p"
    if root.exists():
        shutil.rmtree(root)
    shutil.copytree(good_partition, root)
    m = json.loads((root / "manifest.json").read_text())
    m[key] = value
    (root / "manifest.json").write_text(json.dumps(m))
    try:
        load_partition(root)
    except PartitionError as exc:
        assert "manifest.json" in str(exc) or str(root) in str(exc)


@FUZZ
@given(st.sampled_from([*ARRAYS, "manifest.json"]), st.integers(0, 10**6), st.integers(0, 255), st.booleans())
def test_corrupt_bytes_on_disk_give_one_clear_error(good_partition, tmp_path, name, pos, value, cut):
    root = tmp_path / "p"
    if root.exists():
        shutil.rmtree(root)
    shutil.copytree(good_partition, root)
    raw = bytearray((root / name).read_bytes())
    if cut:
        raw = raw[: pos % max(1, len(raw))]
    else:
        raw[pos % len(raw)] = value
    (root / name).write_bytes(bytes(raw))
    try:
        load_partition(root)
    except PartitionError as exc:
        assert str(root) in str(exc)
