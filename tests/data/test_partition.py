"""The partition format: round trip, and one clear error per kind of bad input, files untouched."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from retexo_fl.data import partition as partition_module
from retexo_fl.data.partition import (
    MANIFEST,
    PartitionError,
    check_cross_consistency,
    load_partition,
    load_partitions,
    map_partitions,
    partition_dirs,
    save_partition,
)
from retexo_fl.data.partitioners import partition_graph


@pytest.fixture()
def parts(sbm):
    return partition_graph(sbm, 3, "metis", seed=0)


@pytest.fixture()
def written(parts, tmp_path) -> Path:
    for p in parts:
        save_partition(p, tmp_path / f"part-{p.partition_id}")
    return tmp_path


def _tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_round_trip(parts, written):
    loaded = load_partitions(written)
    assert len(loaded) == len(parts)
    for a, b in zip(parts, loaded, strict=True):
        for field in ("node_ids", "x", "y", "train_mask", "val_mask", "test_mask", "edges", "cross_edges"):
            np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
        assert a.counts() == b.counts()
        assert b.num_classes == a.num_classes and b.num_global_nodes == a.num_global_nodes


def _rewrite(path: Path, arr: np.ndarray, fix_checksum: bool = True) -> None:
    """Replace one array file; by default also update its checksum so deeper checks are reached."""
    np.save(path, arr, allow_pickle=False)
    if fix_checksum:
        mpath = path.parent / MANIFEST
        m = json.loads(mpath.read_text())
        m["checksums"][path.name] = hashlib.sha256(path.read_bytes()).hexdigest()
        mpath.write_text(json.dumps(m))


def _load(name, d):
    return np.load(d / name)


CASES = {
    "checksum": (
        lambda d: _rewrite(d / "x.npy", _load("x.npy", d) + np.float32(1), fix_checksum=False),
        "x.npy",
        "checksum",
    ),
    "dtype": (lambda d: _rewrite(d / "x.npy", _load("x.npy", d).astype(np.int64)), "x.npy", "dtype"),
    "shape": (lambda d: _rewrite(d / "x.npy", _load("x.npy", d)[:-1]), "x.npy", "shape"),
    "ndim": (lambda d: _rewrite(d / "y.npy", _load("y.npy", d)[:, None]), "y.npy", "shape"),
    "nan": (
        lambda d: _rewrite(
            d / "x.npy",
            np.where(np.arange(_load("x.npy", d).shape[0])[:, None] == 3, np.nan, _load("x.npy", d)).astype(
                np.float32
            ),
        ),
        "x.npy",
        "'x'",
    ),
    "duplicate ids": (
        lambda d: _rewrite(
            d / "node_ids.npy", np.sort(np.r_[_load("node_ids.npy", d)[:-1], _load("node_ids.npy", d)[0]])
        ),
        "node_ids.npy",
        "duplicate",
    ),
    "id range": (
        lambda d: _rewrite(d / "node_ids.npy", _load("node_ids.npy", d) + 10**6),
        "node_ids.npy",
        "num_global_nodes",
    ),
    "label range": (lambda d: _rewrite(d / "y.npy", _load("y.npy", d) + 100), "y.npy", "'y'"),
    "masks overlap": (
        lambda d: _rewrite(d / "val_mask.npy", _load("train_mask.npy", d)),
        "train_mask.npy",
        "overlaps val_mask",
    ),
    "mask on unlabeled": (
        lambda d: _rewrite(d / "y.npy", np.where(_load("train_mask.npy", d), -1, _load("y.npy", d))),
        "train_mask.npy",
        "unlabeled",
    ),
    "local edge leaves": (
        lambda d: _rewrite(
            d / "edges.npy",
            np.c_[
                _load("edges.npy", d), [[_load("cross_edges.npy", d)[0, 1]], [_load("node_ids.npy", d)[0]]]
            ],
        ),
        "edges.npy",
        "not an owned node",
    ),
    "cross remote owned": (
        lambda d: _rewrite(
            d / "cross_edges.npy",
            np.r_[
                _load("cross_edges.npy", d),
                [[_load("node_ids.npy", d)[0], _load("node_ids.npy", d)[1], 1, 3]],
            ],
        ),
        "cross_edges.npy",
        "remote_id",
    ),
    "cross owner self": (
        lambda d: _rewrite(
            d / "cross_edges.npy", np.where(np.arange(4) == 2, 0, _load("cross_edges.npy", d))
        ),
        "cross_edges.npy",
        "remote_owner",
    ),
    "cross direction": (
        lambda d: _rewrite(
            d / "cross_edges.npy", np.where(np.arange(4) == 3, 7, _load("cross_edges.npy", d))
        ),
        "cross_edges.npy",
        "direction",
    ),
    "truncated": (
        lambda d: (d / "edges.npy").write_bytes((d / "edges.npy").read_bytes()[:40]),
        "edges.npy",
        "checksum",
    ),
    "missing file": (lambda d: (d / "y.npy").unlink(), "y.npy", "missing"),
    "manifest json": (lambda d: (d / MANIFEST).write_text("{not json"), MANIFEST, "not valid JSON"),
    "manifest version": (
        lambda d: (d / MANIFEST).write_text(
            json.dumps({**json.loads((d / MANIFEST).read_text()), "format_version": 99})
        ),
        MANIFEST,
        "format_version",
    ),
    "manifest counts": (
        lambda d: (d / MANIFEST).write_text(
            json.dumps(
                {
                    **json.loads((d / MANIFEST).read_text()),
                    "counts": {**json.loads((d / MANIFEST).read_text())["counts"], "nodes": 1},
                }
            )
        ),
        MANIFEST,
        "counts.nodes",
    ),
    "float16 x": (lambda d: _rewrite(d / "x.npy", _load("x.npy", d).astype(np.float16)), "x.npy", "float32"),
    "uint64 label wraps": (
        lambda d: _rewrite(
            d / "y.npy", np.where(np.arange(len(_load("y.npy", d))) == 0, 2**64 - 1, 0).astype(np.uint64)
        ),
        "y.npy",
        "above the int64 range",
    ),
    "huge classes": (
        lambda d: (d / MANIFEST).write_text(
            json.dumps({**json.loads((d / MANIFEST).read_text()), "num_classes": 2**40})
        ),
        MANIFEST,
        "num_classes",
    ),
    "nested manifest": (
        lambda d: (d / MANIFEST).write_text("[" * 100_000 + "]" * 100_000),
        MANIFEST,
        "nested",
    ),
    "huge declared": (
        lambda d: (d / MANIFEST).write_text(
            json.dumps({**json.loads((d / MANIFEST).read_text()), "num_global_nodes": 10**15})
        ),
        MANIFEST,
        "num_global_nodes",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_loader_errors_name_file_and_field(case, written):
    corrupt, fname, needle = CASES[case]
    d = written / "part-0"
    corrupt(d)
    before = _tree_digest(written)
    with pytest.raises(PartitionError) as info:
        load_partition(d)
    msg = str(info.value)
    assert fname in msg, msg
    assert needle in msg, msg
    assert _tree_digest(written) == before, "the loader must not touch the files"


def test_a_node_owned_by_two_partitions_is_refused(parts):
    both = [dataclasses.replace(p) for p in parts]
    stolen = int(parts[0].node_ids[0])
    ids = np.sort(np.r_[np.asarray(both[1].node_ids)[:-1], stolen])  # client 1 claims client 0's node
    both[1] = dataclasses.replace(both[1], node_ids=ids)
    with pytest.raises(PartitionError, match=rf"node {stolen} is owned by client 0 and client 1"):
        check_cross_consistency(both)


@pytest.mark.parametrize("threads", [False, True])
def test_mismatched_cross_edges_name_both_clients(parts, threads, monkeypatch):
    # On threads (map_partitions, as a large graph's check runs) as one after another.
    monkeypatch.setattr(partition_module, "PARALLEL_NODES", 0 if threads else 1 << 62)
    monkeypatch.setattr(partition_module, "PARALLEL_PART_NODES", 0)
    check_cross_consistency(parts)  # consistent as made
    p1 = parts[1]
    p1.cross_edges = p1.cross_edges[1:]
    with pytest.raises(PartitionError) as info:
        check_cross_consistency(parts)
    msg = str(info.value)
    assert "client 1" in msg and "client" in msg.replace("client 1", "", 1)


def test_partitions_mapped_on_threads_keep_their_order_and_the_first_error(parts, monkeypatch):
    monkeypatch.setattr(partition_module, "PARALLEL_NODES", 0)
    monkeypatch.setattr(partition_module, "PARALLEL_PART_NODES", 0)
    seen: list[str] = []

    def work(p):
        seen.append(threading.current_thread().name)
        if p.partition_id >= 1:
            raise ValueError(f"client {p.partition_id}")
        return p.partition_id

    assert map_partitions(lambda p: p.partition_id, parts) == [p.partition_id for p in parts]
    with pytest.raises(ValueError, match="client 1"):  # client 1's, though client 2 failed too
        map_partitions(work, parts)
    if (os.cpu_count() or 1) > 1:
        assert all(name.startswith("partition") for name in seen)  # the pool ran them
    # Small partitions on average (node level: one node each) stay in this thread.
    monkeypatch.setattr(partition_module, "PARALLEL_PART_NODES", 1 + max(p.num_nodes for p in parts))
    seen.clear()
    here = threading.current_thread().name
    assert map_partitions(lambda p: threading.current_thread().name, parts) == [here] * len(parts)
    monkeypatch.setattr(partition_module, "PARALLEL_NODES", 1 << 62)
    seen.clear()
    with pytest.raises(ValueError, match="client 1"):
        map_partitions(work, parts)
    assert seen == [threading.current_thread().name] * 2  # in this thread, stopped at the first


def test_load_partitions_requires_a_full_set(written, sbm, tmp_path):
    import shutil

    shutil.rmtree(written / "part-1")
    # The folder is at fault, not part-0 (which the message named before).
    with pytest.raises(PartitionError) as info:
        load_partitions(written)
    assert str(info.value).startswith(str(written)) and "part-0" not in str(info.value)
    assert "declare 3 partitions and 1 are missing (part-1)" in str(info.value)
    # Two cuts mixed: the folder whose manifest declares another count is named.
    other = partition_graph(sbm, 4, "metis", seed=0)[3]
    save_partition(other, written / "part-1")
    with pytest.raises(PartitionError, match=r"part-1.*declares 4 partitions where the others declare 3"):
        load_partitions(written)
    # Two folders holding one partition.
    shutil.rmtree(written / "part-1")
    shutil.copytree(written / "part-2", written / "part-1")
    with pytest.raises(PartitionError, match="holds partition 2, as part-1 does"):
        load_partitions(written)
    with pytest.raises(PartitionError, match="does not exist"):
        load_partitions(tmp_path / "nowhere")
    (tmp_path / "afile").write_text("")
    with pytest.raises(PartitionError, match="is a file"):
        load_partitions(tmp_path / "afile")


def test_partition_folders_are_ordered_by_their_ids_as_numbers(sbm, tmp_path):
    # A launcher hands the i-th folder the i-th party's key: part-10 must come after part-9.
    parts = partition_graph(sbm, 12, "random", seed=0)
    for p in parts:
        save_partition(p, tmp_path / f"part-{p.partition_id}")
    assert [d.name for d in partition_dirs(tmp_path)] == [f"part-{i}" for i in range(12)]
    assert [p.partition_id for p in load_partitions(tmp_path)] == list(range(12))
    (tmp_path / "part-x").mkdir()
    with pytest.raises(PartitionError, match="part-x"):
        partition_dirs(tmp_path)


def test_a_verification_stamp_skips_only_the_hashing(sbm, tmp_path):
    """A node-local stamp lets later loads skip sha256; any change to the files brings it back."""
    from retexo_fl.data.partitioners import partition_graph

    root = save_partition(partition_graph(sbm, 2, "metis", seed=0)[0], tmp_path / "part-0")
    stamp = tmp_path / "work" / "verified.json"
    load_partition(root, stamp=stamp)
    assert stamp.is_file()
    x = np.load(root / "x.npy")
    x[0, 0] += 1.0
    np.save(root / "x.npy", x)  # same size, new bytes and mtime: the stamp no longer matches
    with pytest.raises(PartitionError, match="checksum"):
        load_partition(root, stamp=stamp)


def _mapped(arr: np.ndarray) -> bool:
    """Whether ``arr`` is backed by a memory map (which holds a file descriptor while it lives)."""
    import mmap

    base = arr
    while base is not None:
        if isinstance(base, mmap.mmap | np.memmap):
            return True
        base = getattr(base, "base", None)
    return False


def test_small_arrays_are_read_whole_and_large_ones_mapped(parts, tmp_path, monkeypatch):
    import retexo_fl.data.partition as partition_module

    save_partition(parts[0], tmp_path / "p0")
    small = load_partition(tmp_path / "p0")
    assert not _mapped(small.x)  # thousands of one-node partitions in one process: no descriptors
    monkeypatch.setattr(partition_module, "MMAP_MIN_BYTES", 1)  # every file counts as large
    large = load_partition(tmp_path / "p0")
    assert _mapped(large.x) and np.array_equal(large.x, small.x)


def test_node_names_live_beside_the_arrays_checked_like_them(parts, tmp_path):
    """A graph read from files names its nodes: in the manifest (at most 1 MiB) the names of a
    partition of 70,000 or more nodes made it unreadable, so they are a file of their own."""
    part = dataclasses.replace(
        parts[0], meta={**parts[0].meta, "node_names": [f"patient-{i:09d}" for i in parts[0].node_ids]}
    )
    folder = save_partition(part, tmp_path / "part-0")
    manifest = json.loads((folder / MANIFEST).read_text())
    assert "node_names" not in manifest["meta"] and "node_names.json" in manifest["checksums"]
    assert load_partition(folder).meta["node_names"] == part.meta["node_names"]
    (folder / "node_names.json").write_text(json.dumps(["x"] * part.num_nodes))
    with pytest.raises(PartitionError, match=r"node_names\.json.*sha256 does not match"):
        load_partition(folder)
    (folder / "node_names.json").unlink()
    with pytest.raises(PartitionError, match=r"node_names\.json.*file is missing"):
        load_partition(folder)
