"""The secret finder: each encoding of a client's raw data is found; clean values are not."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from retexo_fl.data.partitioners import partition_graph
from retexo_fl.secure.detect import SecretFinder, flatten_values
from retexo_fl.secure.envelope import MAGIC


@pytest.fixture(scope="module")
def client(sbm):
    part = partition_graph(sbm, 3, "metis", seed=0)[1]
    return part, SecretFinder(part)


def _leaks(part) -> dict[str, object]:
    x, y, e = np.asarray(part.x, np.float32), np.asarray(part.y), np.asarray(part.edges)
    ids = np.asarray(part.node_ids)
    local = np.searchsorted(ids, e)
    adjacency = np.zeros((len(ids), len(ids)), bool)
    adjacency[local[0], local[1]] = True
    return {
        "row times 2": x[5:6] * 2,
        "row plus 1e-6": x[5:6] + 1e-6,
        "rows negated and shifted": -3 * x[:2] + 7,
        "x transposed": x.T.copy(),
        "x flattened": x.reshape(-1),
        "x with an extra column": np.c_[x, np.ones(len(x))],
        "x as float16": x.astype(np.float16),
        "a float16 row inside a frame": b"HEAD" + x[3].astype(np.float16).tobytes(),
        "rows behind a forged envelope prefix": MAGIC + x[7:9].tobytes(),
        "a row in a number list": [float(v) for v in x[11]],
        "labels as uint8 bytes": y.astype(np.uint8).tobytes(),
        "labels as int32": y.astype(np.int32),
        "labels one-hot": np.eye(3)[y],
        "labels as a metric list": [float(v) for v in y],
        "labels as a JSON string": json.dumps({"y": y.tolist()}),
        "edges as float64": e.astype(np.float64),
        "edges beyond the first 16": e[:, 40:80].copy(),
        "edges flattened": e.reshape(-1).copy(),
        "edges as a bitmap": np.packbits(adjacency.reshape(-1)).tobytes(),
    }


ENCODINGS = [
    "row times 2", "row plus 1e-6", "rows negated and shifted", "x transposed", "x flattened",
    "x with an extra column", "x as float16", "a float16 row inside a frame",
    "rows behind a forged envelope prefix", "a row in a number list", "labels as uint8 bytes",
    "labels as int32", "labels one-hot", "labels as a metric list", "labels as a JSON string",
    "edges as float64", "edges beyond the first 16", "edges flattened", "edges as a bitmap",
]  # fmt: skip


def test_the_encodings_listed_are_the_ones_built(client):
    assert sorted(_leaks(client[0])) == sorted(ENCODINGS)


@pytest.mark.parametrize("name", ENCODINGS)
def test_each_encoding_is_found(client, name):
    part, finder = client
    assert finder.scan(_leaks(part)[name]), name


def test_clean_values_are_not_findings(client):
    part, finder = client
    rng = np.random.default_rng(0)
    f = np.asarray(part.x).shape[1]
    clean = [
        rng.standard_normal((64, f)).astype(np.float32),  # a model's weights
        rng.standard_normal(5000).astype(np.float32),
        rng.bytes(20_000),  # ciphertext
        [0.5, 12.0, 3.0],  # metrics
        json.dumps({"lr": 0.1, "stage": 2}),
        np.arange(600, dtype=np.int64),  # counts, ids of no edge
        np.zeros((len(part.node_ids), 3)),  # an all-zero one-hot-shaped array
    ]
    for value in clean:
        assert finder.scan(value) == [], type(value)


def test_every_row_is_searched_not_a_sample(client):
    part, finder = client
    x = np.asarray(part.x, np.float32)
    informative = int(((x != 0).sum(1) >= 2).sum())
    hits = finder.scan(x.T.copy())
    assert hits == [f"holds {informative} raw feature row(s) (up to scale and shift)"]


def test_json_values_are_walked_to_their_leaves():
    leaves = list(flatten_values({"a": [1.0, 2.0], "b": {"c": "text", "d": b"xy"}, "e": '{"f": [3, 4]}'}))
    assert [1.0, 2.0] in leaves and "text" in leaves and b"xy" in leaves and [3, 4] in leaves


def test_a_window_that_only_correlates_with_a_sparse_row_is_not_a_copy(sbm):
    """A packed update read as float64 holds a few huge values among small ones: where they fall
    on a two-word bag-of-words row's words, it correlates 0.9997 with that row, and an honest run's
    audit reported a leak. A copy maps the row's equal values (its zeros) to one value."""
    data = sbm.clone()
    f = 64
    x = np.zeros((data.num_nodes, f), np.float32)
    rng = np.random.default_rng(0)
    for i in range(data.num_nodes):  # bag-of-words rows of 2 to 6 words
        x[i, rng.choice(f, size=2 + i % 5, replace=False)] = 1.0
    data.x = torch.from_numpy(x)
    part = partition_graph(data, 3, "metis", seed=0)[0]
    finder = SecretFinder(part)
    row = np.asarray(part.x)[(np.asarray(part.x) != 0).sum(1) == 2][0]
    zrow = (row - row.mean()) / row.std()
    for scale in (1.0, 2.0, 4.0) * 8:  # a few land in the row's sketch bin, as it happened
        window = rng.normal(0.0, scale, f)  # other values where the row is 0 ...
        window[row != 0] = 1000.0  # ... and two large ones on its words
        z = (window - window.mean()) / window.std()
        assert z @ zrow / f > 0.999  # it correlates as a copy would
        assert finder.scan(window) == []
    # The row itself, scaled, shifted or re-typed, is still found.
    for copy in (3 * row + 1, row.astype(np.float16), -row):
        assert finder.scan(np.asarray(copy)), copy.dtype


def test_a_row_sent_through_stochastic_rounding_is_still_found(sbm):
    """Stochastic rounding, as the codecs do, sends a row's equal values as one of two
    neighbouring codes: a copy all the same, which the tie check must not reject."""
    data = sbm.clone()
    f = 64
    rng = np.random.default_rng(1)
    x = np.zeros((data.num_nodes, f), np.float32)
    for i in range(data.num_nodes):  # repeated values off any 8-bit grid
        x[i, rng.choice(f, size=12, replace=False)] = rng.choice([0.3, 0.7, 1.1, 1.9], size=12)
    data.x = torch.from_numpy(x)
    part = partition_graph(data, 3, "metis", seed=0)[0]
    finder = SecretFinder(part)
    row = np.asarray(part.x)[0]
    lo, step = row.min(), (row.max() - row.min()) / 255
    split = 0
    for _ in range(10):
        codes = np.floor((row - lo) / step + rng.random(f)).astype(np.uint8)
        split += len(np.unique(codes)) > len(np.unique(row))  # a value's ties went to two codes
        assert finder.scan(codes.astype(np.float32)), codes
    assert split >= 5
