"""One client's fixed graph partition: the on-disk format, its writer and its validating loader."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np

FORMAT_VERSION = 1
MANIFEST = "manifest.json"

# Direction bits of a cross edge, seen from the owner: IN means the remote node sends messages to
# the owned node (the owner aggregates it), OUT means the owned node sends to the remote one.
CROSS_IN = 1
CROSS_OUT = 2
CROSS_BOTH = CROSS_IN | CROSS_OUT

# file name -> (dtype kind, ndim) the loader requires of it; the manifest records its sha256
FILES: dict[str, tuple[str, int]] = {
    "node_ids.npy": ("i", 1),
    "x.npy": ("f", 2),
    "y.npy": ("i", 1),
    "train_mask.npy": ("b", 1),
    "val_mask.npy": ("b", 1),
    "test_mask.npy": ("b", 1),
    "edges.npy": ("i", 2),
    "cross_edges.npy": ("i", 2),
}

#: The user's own names of the owned nodes, row for row with ``node_ids.npy`` (a graph read from
#: plain files has them): a JSON list of strings beside the arrays, checksummed like them, not in
#: the manifest, whose size is bounded, and read into ``meta["node_names"]``.
NAMES_FILE = "node_names.json"

# Upper bound for integers a manifest declares (node counts, ids): a hostile manifest cannot ask
# for absurd sizes, and arrays are memory-mapped, so nothing is allocated from declared sizes.
_MAX_DECLARED = 1 << 40
# Classes a manifest may declare: a model's head allocates num_classes x hidden weights, so an
# absurd count must stop at the loader, not at the allocator (ogbn-papers100M has 172).
MAX_CLASSES = 1 << 16
# The largest manifest read (a real one is a few kB): a hostile file cannot cost memory or time.
_MAX_MANIFEST_BYTES = 1 << 20


class PartitionError(ValueError):
    """A partition on disk is missing, corrupt or inconsistent.

    Args:
        path (str | os.PathLike[str]): the file (or directory) that is wrong.
        field (str): the field inside it that is wrong.
        reason (str): what is wrong, in words.
    """

    def __init__(self, path: str | os.PathLike[str], field: str, reason: str) -> None:
        self.path = str(path)
        self.field = field
        self.reason = reason
        super().__init__(f"{self.path}: field '{field}': {reason}")

    def __reduce__(self) -> tuple[type, tuple[str, str, str]]:
        # Rebuilt from its parts when unpickled (a worker process or a Ray actor raised it).
        return type(self), (self.path, self.field, self.reason)


@dataclass
class Partition:
    """The data one client owns.

    Node rows are in the order of ``node_ids`` (strictly increasing global ids).

    Args:
        partition_id (int): this client's index in ``[0, num_partitions)``.
        num_partitions (int): number of clients the graph is split over.
        num_global_nodes (int): node count of the whole graph (bounds every global id).
        num_classes (int): number of label classes of the whole graph.
        node_ids (np.ndarray): ``[n]`` int64 global ids of the owned nodes, strictly increasing.
        x (np.ndarray): ``[n, F]`` float32 raw features.
        y (np.ndarray): ``[n]`` int64 labels, ``-1`` for unlabeled nodes.
        train_mask (np.ndarray): ``[n]`` bool training nodes (labeled only).
        val_mask (np.ndarray): ``[n]`` bool validation nodes (labeled only).
        test_mask (np.ndarray): ``[n]`` bool test nodes (labeled only); the three masks are
            pairwise disjoint.
        edges (np.ndarray): ``[2, E]`` int64 directed local edges ``(src, dst)`` in global ids,
            both owned.
        cross_edges (np.ndarray): ``[C, 4]`` int64 rows ``(owned id, remote id, remote owner,
            direction)``, direction a bitmask of :data:`CROSS_IN` and :data:`CROSS_OUT`.
        dataset (str, optional): name of the dataset the partition came from.
            (default: :obj:`"unknown"`)
        directed (bool, optional): whether the whole graph is directed (else every edge appears
            both ways). (default: :obj:`False`)
        residency_bound (bool, optional): the owner's data may not leave it; only the federated
            modes may train on it, and data-center mode only with ``--trusted-cluster``.
            (default: :obj:`True`)
        meta (dict, optional): free-form provenance written to the manifest (e.g. the partitioner
            and its seed). (default: :obj:`{}`)
    """

    partition_id: int
    num_partitions: int
    num_global_nodes: int
    num_classes: int
    node_ids: np.ndarray
    x: np.ndarray
    y: np.ndarray
    train_mask: np.ndarray
    val_mask: np.ndarray
    test_mask: np.ndarray
    edges: np.ndarray
    cross_edges: np.ndarray
    dataset: str = "unknown"
    directed: bool = False
    residency_bound: bool = True
    meta: dict = field(default_factory=dict)

    @property
    def num_nodes(self) -> int:
        """``n``: the number of owned nodes."""
        return int(self.node_ids.shape[0])

    @property
    def num_features(self) -> int:
        """``F``: the feature width."""
        return int(self.x.shape[1])

    def counts(self) -> dict[str, int]:
        """Counts a client may reveal at setup (no ids, no values).

        Returns:
            ``nodes``, ``features``, ``train``, ``val``, ``test``, ``edges`` and ``cross_edges``.
        """
        return {
            "nodes": self.num_nodes,
            "features": self.num_features,
            "train": int(self.train_mask.sum()),
            "val": int(self.val_mask.sum()),
            "test": int(self.test_mask.sum()),
            "edges": int(self.edges.shape[1]),
            "cross_edges": int(self.cross_edges.shape[0]),
        }


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def save_partition(part: Partition, directory: str | os.PathLike[str]) -> Path:
    """Write ``part`` to ``directory`` (created) as ``.npy`` files plus ``manifest.json``.

    The manifest is written last, through a temporary file, so a crash never leaves a directory
    that looks complete.

    Args:
        part (Partition): the partition.
        directory (str | os.PathLike[str]): the partition directory.

    Returns:
        The directory.
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    arrays = {
        "node_ids.npy": np.ascontiguousarray(part.node_ids, dtype=np.int64),
        "x.npy": np.ascontiguousarray(part.x, dtype=np.float32),
        "y.npy": np.ascontiguousarray(part.y, dtype=np.int64),
        "train_mask.npy": np.ascontiguousarray(part.train_mask, dtype=np.bool_),
        "val_mask.npy": np.ascontiguousarray(part.val_mask, dtype=np.bool_),
        "test_mask.npy": np.ascontiguousarray(part.test_mask, dtype=np.bool_),
        "edges.npy": np.ascontiguousarray(part.edges, dtype=np.int64).reshape(2, -1),
        "cross_edges.npy": np.ascontiguousarray(part.cross_edges, dtype=np.int64).reshape(-1, 4),
    }
    checksums = {}
    for name, arr in arrays.items():
        np.save(out / name, arr, allow_pickle=False)
        checksums[name] = _sha256(out / name)
    meta = dict(part.meta)
    names = meta.pop("node_names", None)
    if names is not None:
        (out / NAMES_FILE).write_text(json.dumps([str(v) for v in names]))
        checksums[NAMES_FILE] = _sha256(out / NAMES_FILE)
    manifest = {
        "format_version": FORMAT_VERSION,
        "dataset": part.dataset,
        "partition_id": int(part.partition_id),
        "num_partitions": int(part.num_partitions),
        "num_global_nodes": int(part.num_global_nodes),
        "num_classes": int(part.num_classes),
        "directed": bool(part.directed),
        "residency_bound": bool(part.residency_bound),
        "counts": part.counts(),
        "checksums": checksums,
        "meta": meta,
    }
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True))
    tmp.replace(out / MANIFEST)
    return out


def cut_settings(folder: str | Path) -> dict[str, object]:
    """The settings a cut of partition folders was made with, as a run over it records them:
    ``dataset``, and of ``method``, ``split`` and ``split_index`` those its manifests hold
    (``partition`` writes them; older folders lack the split). Read from the first folder's
    manifest; empty where there is none or it cannot be read (loading the folders names why).
    """
    dirs = partition_dirs(folder)
    try:
        manifest = json.loads((dirs[0] / MANIFEST).read_text())
        out: dict[str, object] = {"dataset": str(manifest["dataset"])}
        meta = manifest.get("meta") or {}
        for key, kind in (("method", str), ("split", str), ("split_index", int)):
            if key in meta:
                out[key] = kind(meta[key])
    except (IndexError, OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}
    return out


def _manifest_int(manifest: dict, key: str, path: Path, lo: int, hi: int = _MAX_DECLARED) -> int:
    value = manifest.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise PartitionError(path, key, f"must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise PartitionError(path, key, f"must be in [{lo}, {hi}], got {value}")
    return value


def read_manifest(directory: str | os.PathLike[str]) -> dict:
    """Read and type-check ``manifest.json`` of a partition directory.

    Args:
        directory (str | os.PathLike[str]): the partition directory.

    Returns:
        The manifest, as a dict.

    Raises:
        PartitionError: if the directory or manifest is missing, the manifest is not a JSON
            object of the supported format version, or a field has the wrong type or range.
    """
    root = Path(directory)
    path = root / MANIFEST
    if not root.is_dir():
        raise PartitionError(root, "directory", "partition directory does not exist")
    if not path.is_file():
        raise PartitionError(path, "manifest", "missing manifest.json")
    size = path.stat().st_size
    if size > _MAX_MANIFEST_BYTES:
        raise PartitionError(
            path, "manifest", f"{size} bytes, more than a manifest holds ({_MAX_MANIFEST_BYTES})"
        )
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PartitionError(path, "manifest", f"not valid JSON ({exc})") from exc
    except RecursionError:
        raise PartitionError(path, "manifest", "not valid JSON (nested too deeply)") from None
    if not isinstance(manifest, dict):
        raise PartitionError(path, "manifest", "must be a JSON object")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise PartitionError(
            path, "format_version", f"unsupported version {version!r} (expected {FORMAT_VERSION})"
        )
    nparts = _manifest_int(manifest, "num_partitions", path, 1)
    _manifest_int(manifest, "partition_id", path, 0, nparts - 1)
    _manifest_int(manifest, "num_global_nodes", path, 1)
    _manifest_int(manifest, "num_classes", path, 1, MAX_CLASSES)
    for key in ("counts", "checksums"):
        if not isinstance(manifest.get(key), dict):
            raise PartitionError(path, key, "must be a JSON object")
    for key, default in (("directed", False), ("residency_bound", True)):
        if not isinstance(manifest.get(key, default), bool):
            raise PartitionError(path, key, "must be true or false")
    return manifest


#: Arrays files at least this large are memory-mapped, smaller ones read whole: a map holds a
#: file descriptor while its array lives, and a Ray actor that served a one-node-per-client
#: simulation's 2,708 clients (Cora) ran out of them ("Too many open files").
MMAP_MIN_BYTES = 1 << 20


def _load_array(root: Path, name: str, manifest: dict, verify: bool) -> np.ndarray:
    path = root / name
    if not path.is_file():
        raise PartitionError(path, name.removesuffix(".npy"), "file is missing")
    expected = manifest["checksums"].get(name)
    if verify:
        if not isinstance(expected, str):
            raise PartitionError(root / MANIFEST, f"checksums.{name}", "no checksum recorded")
        actual = _sha256(path)
        if actual != expected:
            raise PartitionError(
                path, "checksum", f"sha256 {actual[:16]}... does not match manifest {expected[:16]}..."
            )
    try:
        # Mapped first in every case: a header whose shape runs past the file fails here, where
        # reading it whole would first try to allocate what the header claims.
        arr = np.load(path, allow_pickle=False, mmap_mode="r")
        if path.stat().st_size < MMAP_MIN_BYTES:
            arr = np.array(arr)  # read whole: the map, and its file descriptor, are released now
    except (ValueError, OSError, EOFError, OverflowError) as exc:  # a header's shape past any file
        raise PartitionError(path, name.removesuffix(".npy"), f"not a readable .npy array ({exc})") from exc
    kind, ndim = FILES[name]
    if arr.ndim != ndim:
        raise PartitionError(path, "shape", f"expected {ndim} dimensions, got shape {arr.shape}")
    if arr.dtype.kind != kind and not (kind == "i" and arr.dtype.kind == "u"):
        raise PartitionError(path, "dtype", f"expected kind '{kind}', got {arr.dtype}")
    if kind == "f" and arr.dtype.itemsize < 4:  # float16 features lose what the sender had
        raise PartitionError(path, "dtype", f"expected float32 or float64, got {arr.dtype}")
    if (
        arr.dtype.kind == "u"
        and arr.dtype.itemsize >= 8
        and arr.size
        and int(arr.max()) > np.iinfo(np.int64).max
    ):
        # Cast to int64 below, 2**64 - 1 would become -1 (an "unlabeled" label, a valid id).
        raise PartitionError(path, "dtype", f"{arr.dtype} values above the int64 range")
    return np.asarray(arr)


def _file_stamp(root: Path) -> dict:
    """What a verified partition looked like: the manifest's hash and every file's size and mtime."""
    files = sorted(p for p in root.iterdir() if p.is_file())
    return {
        "manifest": _sha256(root / MANIFEST),
        "files": {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in files},
    }


def load_partition(
    directory: str | os.PathLike[str],
    *,
    verify_checksums: bool = True,
    stamp: str | os.PathLike[str] | None = None,
) -> Partition:
    """Load and fully validate one client's partition.

    Every check raises :class:`PartitionError` naming the file and field; nothing is repaired and
    nothing in the partition directory is written.

    Args:
        directory (str | os.PathLike[str]): the partition directory written by
            :func:`save_partition` or by hand.
        verify_checksums (bool, optional): check every file's sha256 against the manifest.
            (default: :obj:`True`)
        stamp (str | os.PathLike[str] | None, optional): a node-local file recording a past full
            verification. When the manifest and every file's size and modification time still
            match it, the sha256 pass (reading every byte) is skipped; all other checks still run.
            A deployed ClientApp starts a new process per message: this keeps a large partition
            from being hashed every time. (default: :obj:`None`)

    Raises:
        PartitionError: naming the file and field of the first check that fails.
    """
    root = Path(directory)
    manifest = read_manifest(root)
    stamp_path = Path(stamp) if stamp else None
    if verify_checksums and stamp_path is not None and stamp_path.is_file():
        try:
            verify_checksums = json.loads(stamp_path.read_text()) != _file_stamp(root)
        except (OSError, ValueError):
            verify_checksums = True
    part = _load_validated(root, manifest, verify_checksums)
    if stamp_path is not None and verify_checksums:
        stamp_path.parent.mkdir(parents=True, exist_ok=True)
        stamp_path.write_text(json.dumps(_file_stamp(root)))
    return part


def _load_names(root: Path, manifest: dict, n: int, verify: bool) -> list[str]:
    """The owned nodes' names (:data:`NAMES_FILE`): ``n`` strings, checksummed like the arrays."""
    path = root / NAMES_FILE
    if not path.is_file():
        raise PartitionError(path, "node_names", "file is missing (the manifest records its checksum)")
    if verify and _sha256(path) != manifest["checksums"][NAMES_FILE]:
        raise PartitionError(path, "checksum", "sha256 does not match the manifest")
    try:
        names = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as exc:
        raise PartitionError(path, "node_names", f"not valid JSON ({exc})") from None
    if not isinstance(names, list) or len(names) != n or not all(isinstance(v, str) for v in names):
        raise PartitionError(path, "node_names", f"must be a list of {n} strings, one per owned node")
    return names


def _load_validated(root: Path, manifest: dict, verify_checksums: bool) -> Partition:
    mpath = root / MANIFEST
    arrays = {name: _load_array(root, name, manifest, verify_checksums) for name in FILES}

    ids = arrays["node_ids.npy"].astype(np.int64, copy=False)
    n = ids.shape[0]
    n_global = manifest["num_global_nodes"]
    nparts = manifest["num_partitions"]
    pid = manifest["partition_id"]
    ncls = manifest["num_classes"]

    def fail(name: str, field_: str, reason: str) -> None:
        raise PartitionError(root / name, field_, reason)

    if n == 0:
        fail("node_ids.npy", "node_ids", "partition owns no nodes")
    if ids.min() < 0 or ids.max() >= n_global:
        fail("node_ids.npy", "node_ids", f"ids must lie in [0, {n_global}) (num_global_nodes)")
    if n > 1 and not bool(np.all(ids[1:] > ids[:-1])):
        dup = n - sorted_unique(ids).shape[0]
        reason = f"{dup} duplicate id(s)" if dup else "ids are not strictly increasing"
        fail("node_ids.npy", "node_ids", reason)

    x = arrays["x.npy"]
    if x.shape[0] != n:
        fail("x.npy", "shape", f"{x.shape[0]} rows for {n} owned nodes")
    if not np.isfinite(x).all():
        bad = int((~np.isfinite(x).all(axis=1)).sum())
        fail("x.npy", "x", f"{bad} row(s) contain NaN or Inf")
    y = arrays["y.npy"].astype(np.int64, copy=False)
    if y.shape[0] != n:
        fail("y.npy", "shape", f"{y.shape[0]} labels for {n} owned nodes")
    if y.size and (y.min() < -1 or y.max() >= ncls):
        fail("y.npy", "y", f"labels must lie in [-1, {ncls}) (num_classes; -1 = unlabeled)")

    masks = {}
    for split in ("train", "val", "test"):
        name = f"{split}_mask.npy"
        m = arrays[name]
        if m.shape[0] != n:
            fail(name, "shape", f"{m.shape[0]} entries for {n} owned nodes")
        if bool((m & (y < 0)).any()):
            fail(name, f"{split}_mask", "selects unlabeled nodes (label -1)")
        masks[split] = m
    for a, b in (("train", "val"), ("train", "test"), ("val", "test")):
        if bool((masks[a] & masks[b]).any()):
            fail(f"{a}_mask.npy", f"{a}_mask", f"overlaps {b}_mask")

    edges = arrays["edges.npy"].astype(np.int64, copy=False)
    if edges.shape[0] != 2:
        fail("edges.npy", "shape", f"expected [2, E], got {list(edges.shape)}")
    if edges.size and not np.isin(edges, ids).all():
        fail("edges.npy", "edges", "an endpoint is not an owned node (local edges join owned nodes)")

    cross = arrays["cross_edges.npy"].astype(np.int64, copy=False)
    if cross.shape[1:] != (4,):
        fail("cross_edges.npy", "shape", f"expected [C, 4], got {list(cross.shape)}")
    if cross.size:
        if not np.isin(cross[:, 0], ids).all():
            fail("cross_edges.npy", "owned_id", "an owned endpoint is not an owned node")
        if cross[:, 1].min() < 0 or cross[:, 1].max() >= n_global:
            fail("cross_edges.npy", "remote_id", f"ids must lie in [0, {n_global})")
        if np.isin(cross[:, 1], ids).any():
            fail("cross_edges.npy", "remote_id", "a remote endpoint is owned by this partition")
        owners = cross[:, 2]
        if owners.min() < 0 or owners.max() >= nparts or (owners == pid).any():
            fail("cross_edges.npy", "remote_owner", f"owners must lie in [0, {nparts}) and not be {pid}")
        d = cross[:, 3]
        if ((d < CROSS_IN) | (d > CROSS_BOTH)).any():
            fail("cross_edges.npy", "direction", "must be 1 (in), 2 (out) or 3 (both)")
        if not manifest.get("directed", False) and (d != CROSS_BOTH).any():
            fail("cross_edges.npy", "direction", "an undirected graph needs direction 3 on every row")
        # One remote node has one owner.
        order = np.lexsort((cross[:, 2], cross[:, 1]))
        r, o = cross[order, 1], cross[order, 2]
        if ((r[1:] == r[:-1]) & (o[1:] != o[:-1])).any():
            fail("cross_edges.npy", "remote_owner", "one remote id is given two different owners")

    part = Partition(
        partition_id=pid,
        num_partitions=nparts,
        num_global_nodes=n_global,
        num_classes=ncls,
        node_ids=ids,
        x=x,
        y=y,
        train_mask=masks["train"],
        val_mask=masks["val"],
        test_mask=masks["test"],
        edges=edges,
        cross_edges=cross,
        dataset=str(manifest.get("dataset", "unknown")),
        directed=bool(manifest.get("directed", False)),
        # A manifest that does not say is bound: residency is never assumed away.
        residency_bound=bool(manifest.get("residency_bound", True)),
        meta=dict(manifest["meta"]) if isinstance(manifest.get("meta"), dict) else {},
    )
    if NAMES_FILE in manifest["checksums"]:
        part.meta["node_names"] = _load_names(root, manifest, n, verify_checksums)
    for key, value in part.counts().items():
        declared = manifest["counts"].get(key)
        if declared != value:
            raise PartitionError(mpath, f"counts.{key}", f"declares {declared!r}, files hold {value}")
    return part


def load_partitions(directory: str | os.PathLike[str]) -> list[Partition]:
    """Load every ``part-*`` sub-directory of ``directory``, ordered by partition id.

    Args:
        directory (str | os.PathLike[str]): the folder of ``part-<id>/`` directories.

    Raises:
        PartitionError: if there is none, the ids are not ``0 .. P - 1`` of ``P``, a partition
            fails to load, or two partitions disagree on their cross edges.
    """
    root = Path(directory)
    if not root.exists():
        raise PartitionError(root, "directory", "does not exist")
    if not root.is_dir():
        raise PartitionError(root, "directory", "is a file, not a folder of part-<id> folders")
    dirs = partition_dirs(root)
    if not dirs:
        raise PartitionError(root, "directory", "no part-* sub-directories")
    loaded = sorted(((load_partition(d), d) for d in dirs), key=lambda pd: pd[0].partition_id)
    check_complete_cut(root, [(p.partition_id, p.num_partitions, d) for p, d in loaded])
    parts = [p for p, _ in loaded]
    check_cross_consistency(parts)
    return parts


def check_complete_cut(root: Path, found: list[tuple[int, int, Path]]) -> None:
    """Check that the partitions in ``root`` are one whole cut: each declares the same count
    ``P``, and ids ``0 .. P - 1`` appear once each.

    Args:
        root (Path): the folder of ``part-<id>/`` folders.
        found (list[tuple[int, int, Path]]): per folder, the partition id and count its manifest
            declares, and the folder.

    Raises:
        PartitionError: naming the folder at fault: a count no other declares, a partition two
            folders hold, or the ids missing from the cut.
    """
    counts: dict[int, list[Path]] = {}
    for _, count, folder in found:
        counts.setdefault(count, []).append(folder)
    if len(counts) > 1:
        (rare, folders), *_ = sorted(counts.items(), key=lambda kv: len(kv[1]))
        others = ", ".join(str(c) for c in sorted(counts) if c != rare)
        raise PartitionError(
            folders[0],
            "num_partitions",
            f"declares {rare} partitions where the others declare {others}: two cuts mixed",
        )
    declared = found[0][1]
    held: dict[int, Path] = {}
    for pid, _, folder in found:
        if pid in held:
            raise PartitionError(folder, "partition_id", f"holds partition {pid}, as {held[pid].name} does")
        held[pid] = folder
    missing = [pid for pid in range(declared) if pid not in held]
    extra = [pid for pid in held if pid >= declared]
    if extra:
        raise PartitionError(held[extra[0]], "partition_id", f"partition {extra[0]} of a cut of {declared}")
    if missing:
        names = ", ".join(f"part-{pid}" for pid in missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise PartitionError(
            root,
            "directory",
            f"the manifests declare {declared} partitions and {len(missing)} are missing ({names}): "
            "an interrupted or partial copy of the cut",
        )


def partition_dirs(directory: str | os.PathLike[str]) -> list[Path]:
    """The ``part-<id>`` sub-directories of ``directory`` in the order of their ids as numbers
    (``part-10`` after ``part-9``, where a name sort puts it after ``part-1``: launchers that
    hand out keys by position depend on it).

    Raises:
        PartitionError: naming a ``part-*`` folder whose id is not a non-negative integer.
    """
    return sorted((d for d in Path(directory).glob("part-*") if d.is_dir()), key=partition_folder_id)


def partition_folder_id(folder: str | os.PathLike[str]) -> int:
    """The id a ``part-<id>`` folder names.

    Raises:
        PartitionError: naming the folder, when ``<id>`` is not a non-negative integer.
    """
    name = Path(folder).name
    if not name.startswith("part-") or not name[len("part-") :].isdigit():
        why = "a partition folder is named part-<id>, <id> a number"
        raise PartitionError(Path(folder), "directory", why)
    return int(name[len("part-") :])


def check_disjoint(parts: list[Partition]) -> None:
    """Check that no node is owned by two partitions.

    Args:
        parts (list[Partition]): every partition of one graph.

    Raises:
        PartitionError: naming a node and both partitions that claim it.
    """
    ids = np.concatenate([np.asarray(p.node_ids, dtype=np.int64) for p in parts])
    owner = np.concatenate([np.full(len(p.node_ids), p.partition_id) for p in parts])
    order = np.argsort(ids, kind="stable")
    ids, owner = ids[order], owner[order]
    dup = np.flatnonzero(ids[1:] == ids[:-1])
    if dup.size:
        i = int(dup[0])
        a, b = int(owner[i]), int(owner[i + 1])
        raise PartitionError(
            f"part-{b}/node_ids.npy",
            "node_ids",
            f"node {int(ids[i])} is owned by client {a} and client {b} ({dup.size} such node(s))",
        )


def sorted_unique(values: np.ndarray, *, in_place: bool = False) -> np.ndarray:
    """The distinct values of an integer array, flattened and sorted: what ``np.unique`` returns,
    by one sort and a comparison of neighbours (numpy 2.4's hash-based ``np.unique`` took 10-15x
    longer on int64 keys, and a large graph's set-up calls it hundreds of times). NaNs, which
    ``np.unique`` merges, would stay apart: it is for integer keys.

    Args:
        values (np.ndarray): the values.
        in_place (bool, optional): sort ``values`` itself (when 1-D) instead of a copy.
            (default: :obj:`False`)
    """
    keys = values if in_place and values.ndim == 1 else np.ravel(values).copy()
    keys.sort()
    if keys.size < 2:
        return keys
    fresh = np.empty(keys.size, dtype=bool)
    fresh[0] = True
    np.not_equal(keys[1:], keys[:-1], out=fresh[1:])
    return keys if bool(fresh.all()) else keys[fresh]


def peer_order(peers: np.ndarray) -> np.ndarray:
    """The stable order that groups ``peers`` (a cross-edge table's remote-owner column) by
    value: ``np.argsort(peers, kind="stable")``, sorted as 16-bit keys where every peer fits
    (numpy sorts those by radix, 6x faster than int64's merge sort on a 300,000-node graph's
    650,000 cross edges a client; the same permutation, as the sort is stable)."""
    if peers.size and int(peers.min()) >= 0 and int(peers.max()) < 1 << 15:
        return np.argsort(peers.astype(np.int16), kind="stable")
    return np.argsort(peers, kind="stable")


def peer_runs(peers: np.ndarray) -> list[tuple[int, int, int]]:
    """``(peer, start, stop)`` of each run of equal values in ``peers``, grouped (by
    :func:`peer_order`): the rows of each peer's records."""
    if not peers.size:
        return []
    starts = np.flatnonzero(np.r_[True, peers[1:] != peers[:-1]])
    bounds = [*starts.tolist(), peers.size]
    return list(zip(peers[starts].tolist(), bounds[:-1], bounds[1:], strict=True))


#: Nodes in all from which work done once per partition (a client's set-up in process, the
#: cross-edge check's keys) runs on a pool of threads, one partition a task: its numpy and torch
#: work releases the interpreter lock, so the partitions' set-up overlaps as it does where each
#: party builds its own. Below, a pool costs more than it saves. On 2 cores, 8 clients of a
#: 300,000-node graph, the check and the clients: 1.14-1.53 s one after another, 0.83-1.08 s on
#: 2 threads (``bench/results/setup-2026-12-01-s37.txt``).
PARALLEL_NODES = 50_000
#: ... and where its partitions average this many nodes or more: one-node partitions (node
#: level) are set up by Python code that holds the interpreter lock, which a pool only adds to.
PARALLEL_PART_NODES = 1_000

_Out = TypeVar("_Out")


def map_partitions(fn: Callable[[Partition], _Out], parts: Sequence[Partition]) -> list[_Out]:
    """``[fn(p) for p in parts]``, on a pool of threads where the partitions hold
    :data:`PARALLEL_NODES` nodes or more in all and :data:`PARALLEL_PART_NODES` or more each on
    average; the results in ``parts``' order, and the first partition's error first.

    Args:
        fn (Callable[[Partition], Any]): what to do with one partition; must touch no state that
            another call does.
        parts (Sequence[Partition]): the partitions.
    """
    workers = min(len(parts), os.cpu_count() or 1)
    nodes = sum(int(p.num_nodes) for p in parts)
    if nodes < PARALLEL_NODES or nodes < PARALLEL_PART_NODES * len(parts) or workers < 2:
        return [fn(p) for p in parts]
    with ThreadPoolExecutor(workers, thread_name_prefix="partition") as pool:
        return list(pool.map(fn, parts))


def check_cross_consistency(parts: list[Partition]) -> None:
    """Check that every cross edge is mirrored by its remote owner.

    Args:
        parts (list[Partition]): every partition of one graph.

    Raises:
        PartitionError: naming both clients when p's view of its edges to q disagrees with q's,
            or when two partitions own one node (:func:`check_disjoint`).
    """
    check_disjoint(parts)
    flip = np.array([0, CROSS_OUT, CROSS_IN, CROSS_BOTH], dtype=np.int64)
    n = max((int(p.num_global_nodes) for p in parts), default=0) + 1
    # Each (node, remote node, direction) record as one int64 key, sorted and deduplicated per
    # (client, remote client): vectorized, where a set of tuples costs ~100 bytes and a Python
    # object per cross edge (tens of millions on a products-sized graph).

    def keys(p: Partition) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """Per peer ``q``: p's records of its edges with q, and q's view of them (q's node first)."""
        c = np.asarray(p.cross_edges, dtype=np.int64)
        if not c.size:
            return []
        # Both keys of every record at once, then grouped by peer (gathering two key columns,
        # not the whole table); each group is sorted in place.
        own, remote, way = c[:, 0], c[:, 1], c[:, 3]
        order = peer_order(c[:, 2])
        mine_all = ((own * n + remote) * 4 + way)[order]
        mirrored_all = ((remote * n + own) * 4 + flip[way])[order]  # q's view: its node first
        groups = []
        for q, lo, hi in peer_runs(c[order, 2]):
            mine = sorted_unique(mine_all[lo:hi], in_place=True)
            groups.append((q, mine, sorted_unique(mirrored_all[lo:hi], in_place=True)))
        return groups

    views: dict[tuple[int, int], np.ndarray] = {}
    mirrors: dict[tuple[int, int], np.ndarray] = {}
    for p, groups in zip(parts, map_partitions(keys, parts), strict=True):
        for q, mine, mirrored in groups:
            views[(p.partition_id, q)] = mine
            mirrors[(q, p.partition_id)] = mirrored
    empty = np.zeros(0, dtype=np.int64)
    for p, q in sorted(set(views) | set(mirrors)):
        mine, mirrored = views.get((p, q), empty), mirrors.get((p, q), empty)
        if not np.array_equal(mine, mirrored):
            diff = np.setxor1d(mine, mirrored, assume_unique=True).size
            raise PartitionError(
                f"part-{p}/cross_edges.npy",
                "cross_edges",
                f"client {p} and client {q} disagree on {diff} cross edge(s) between them",
            )
