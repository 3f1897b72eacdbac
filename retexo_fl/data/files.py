"""A user's graph as plain files: an edge-list CSV, node features, labels; or a heterophilous npz.

Two ``--dataset`` forms read files a user brings rather than a PyG class:

``files:edges=E.csv,features=F,labels=L.csv[,id-column=NAME][,label-column=NAME]``
    * ``edges``: one edge a line, its first two columns the endpoint ids; a header line is
      optional (it is one when its first two fields are not both integers); further columns
      (weights, timestamps) are ignored. Edges are taken as undirected, duplicates and self
      loops dropped.
    * ``features``: a ``.csv`` (node id, then one number a column; header optional), a ``.json``
      bag of ids (``{"<node id>": [feature id, ...]}``, multi-hot, as the MUSAE social graphs
      ship) or an ``.npz`` (one array, or the first of ``x``, ``features``, ``node_features``:
      row ``i`` is node ``i``).
    * ``labels``: a CSV with a header, one node a line. The node id is in column ``id-column``
      (default: the first) and the label in ``label-column`` (default: the second of two
      columns; name it when there are more). Integer labels are kept (``-1`` or an empty
      field: unlabeled); any other values (``True``/``False``, class names) are numbered in
      sorted order.

    Nodes are the ids the feature and label files name. Integer ids keep their numeric order
    (so ids ``0..N-1`` stay node ``0..N-1``); other ids are numbered in sorted order. A node
    without a feature row gets zeros; an edge endpoint that no file names is an error.

``PATH.npz`` in the format of PyG's ``HeterophilousGraphDataset`` (``node_features``,
``node_labels``, ``edges [E, 2]`` and optional ``train_masks``/``val_masks``/``test_masks``
``[S, N]``), e.g. the filtered Chameleon and Squirrel graphs.

Every error is a :class:`FileGraphError` (a :class:`~retexo_fl.data.errors.DatasetError`)
naming the file and, for a text file, the line.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch_geometric.data import Data

from retexo_fl.data.edges import undirected_coalesced
from retexo_fl.data.errors import DatasetError

#: The keys of a ``files:`` spec; ``edges``, ``features`` and ``labels`` are required.
FILE_KEYS = ("edges", "features", "labels", "id-column", "label-column")
#: The arrays of an npz in ``HeterophilousGraphDataset``'s format.
HETEROPHILOUS_KEYS = ("node_features", "node_labels", "edges")


class FileGraphError(DatasetError):
    """A plain graph file cannot be read; the message names the file (and line)."""

    def __init__(self, path: Path | str, reason: str, line: int | None = None) -> None:
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {reason}")
        self.path, self.line, self.reason = str(path), line, reason

    def __reduce__(self) -> tuple[type, tuple[str, str, int | None]]:
        # Rebuilt from its parts when unpickled (a worker process or a Ray actor raised it).
        return type(self), (self.path, self.reason, self.line)


def parse_files_spec(spec: str) -> dict[str, str]:
    """The ``key=value`` pairs after ``files:`` (``edges``, ``features``, ``labels`` required).

    Raises:
        FileGraphError: on an unknown or repeated key, a pair without ``=`` or a missing file key.
    """
    out: dict[str, str] = {}
    for part in spec.split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or not value.strip():
            raise FileGraphError("--dataset", f"files: expected key=value, got {part!r}")
        if key not in FILE_KEYS:
            raise FileGraphError("--dataset", f"files: unknown key {key!r}; known: {', '.join(FILE_KEYS)}")
        if key in out:
            raise FileGraphError("--dataset", f"files: {key} given twice")
        out[key] = value.strip()
    missing = [k for k in ("edges", "features", "labels") if k not in out]
    if missing:
        raise FileGraphError(
            "--dataset",
            f"files: missing {', '.join(missing)} (use files:edges=E.csv,features=F.json,labels=L.csv)",
        )
    return out


def load_files_graph(spec: str) -> Data:
    """Read a ``files:`` graph (see the module docs) as ``Data`` without split masks.

    Args:
        spec (str): what follows ``files:`` in ``--dataset``.

    Shapes:
        - **output:** ``x`` ``[N, F]`` float32, ``y`` ``[N]`` int64 (``-1`` unlabeled),
          ``edge_index`` ``[2, E]`` (undirected, coalesced)

    Raises:
        FileGraphError: naming the file and line of the first problem.
    """
    keys = parse_files_spec(spec)
    paths = {k: Path(keys[k]) for k in ("edges", "features", "labels")}
    for name, path in paths.items():
        if not path.is_file():
            raise FileGraphError(path, f"no such {name} file")
    label_ids, label_values = _read_labels(paths["labels"], keys.get("id-column"), keys.get("label-column"))
    feats = _read_features(paths["features"])
    index = _node_index([*label_ids, *feats.ids], paths)
    n = len(index)
    y = torch.full((n,), -1, dtype=torch.long)
    y[torch.tensor([index[_canonical(i)] for i in label_ids], dtype=torch.long)] = torch.tensor(label_values)
    x = torch.zeros(n, feats.width, dtype=torch.float32)
    if feats.ids:
        x[torch.tensor([index[_canonical(i)] for i in feats.ids], dtype=torch.long)] = feats.rows
    src, dst = _read_edges(paths["edges"], index)
    edge_index = undirected_coalesced(torch.stack([torch.from_numpy(src), torch.from_numpy(dst)]), n)
    data = Data(x=x, y=y, edge_index=edge_index)
    data.name = paths["edges"].stem
    return data


def load_heterophilous_npz(path: Path) -> Data:
    """Read an npz in ``HeterophilousGraphDataset``'s format (masks ``[S, N]`` become ``[N, S]``).

    Raises:
        FileGraphError: on a missing or malformed array.
    """
    try:
        arrays = np.load(path, allow_pickle=False)
    except Exception as exc:  # zip or format errors of any kind: the file is not a usable npz
        raise FileGraphError(path, f"cannot be read as an npz ({exc})") from exc
    with arrays:
        missing = [k for k in HETEROPHILOUS_KEYS if k not in arrays.files]
        if missing:
            raise FileGraphError(
                path,
                f"missing array(s) {', '.join(missing)}; an npz graph needs {', '.join(HETEROPHILOUS_KEYS)}",
            )
        x, y, edges = (arrays[k] for k in HETEROPHILOUS_KEYS)
        n = x.shape[0] if x.ndim == 2 else -1
        if x.ndim != 2:
            raise FileGraphError(path, f"node_features must be [N, F], got shape {list(x.shape)}")
        if y.shape != (n,):
            raise FileGraphError(path, f"node_labels must be [N] = [{n}], got shape {list(y.shape)}")
        if edges.ndim != 2 or edges.shape[1] != 2:
            raise FileGraphError(path, f"edges must be [E, 2], got shape {list(edges.shape)}")
        if edges.size and (edges.min() < 0 or edges.max() >= n):
            raise FileGraphError(path, f"edges name a node outside 0..{n - 1}")
        data = Data(
            x=torch.from_numpy(np.asarray(x, dtype=np.float32)),
            y=torch.from_numpy(np.asarray(y, dtype=np.int64)),
            edge_index=undirected_coalesced(torch.from_numpy(edges.astype(np.int64).T.copy()), n),
        )
        for key, field in (
            ("train_masks", "train_mask"),
            ("val_masks", "val_mask"),
            ("test_masks", "test_mask"),
        ):
            if key in arrays.files:
                mask = arrays[key]
                if mask.ndim != 2 or mask.shape[1] != n:
                    raise FileGraphError(path, f"{key} must be [S, N] with N = {n}, got {list(mask.shape)}")
                data[field] = torch.from_numpy(mask.astype(bool).T.copy())
    data.name = path.stem
    return data


# -- readers ---------------------------------------------------------------------------------


def _rows(path: Path) -> Iterator[tuple[int, list[str]]]:
    """``(line number, fields)`` of each non-blank CSV line."""
    try:
        with path.open(newline="", encoding="utf-8") as fh:
            for line, row in enumerate(csv.reader(fh), start=1):
                if row and any(f.strip() for f in row):
                    yield line, [f.strip() for f in row]
    except UnicodeDecodeError as exc:
        raise FileGraphError(path, f"not UTF-8 text ({exc.reason})") from exc
    except csv.Error as exc:
        raise FileGraphError(path, f"malformed CSV ({exc})") from exc


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def _read_labels(path: Path, id_column: str | None, label_column: str | None) -> tuple[list[str], list[int]]:
    rows = _rows(path)
    first = next(rows, None)
    if first is None:
        raise FileGraphError(path, "empty labels file")
    _, header = first
    if all(_is_int(f) for f in header):
        raise FileGraphError(path, "the labels file needs a header line naming its columns", 1)

    def column(name: str | None, default: int | None, what: str) -> int:
        if name is None:
            if default is None:
                raise FileGraphError(
                    path,
                    f"{len(header)} columns ({', '.join(header)}): name the {what} with "
                    f"{what}=NAME in the files: spec",
                    1,
                )
            return default
        if name not in header:
            raise FileGraphError(path, f"no column {name!r} (columns: {', '.join(header)})", 1)
        return header.index(name)

    id_col = column(id_column, 0, "id-column")
    label_col = column(label_column, 1 if len(header) == 2 else None, "label-column")
    if id_col == label_col:
        raise FileGraphError(path, f"id and label are the same column {header[id_col]!r}", 1)
    ids: list[str] = []
    raw: list[str] = []
    lines: dict[str, int] = {}
    for line, row in rows:
        if len(row) != len(header):
            raise FileGraphError(path, f"{len(row)} fields, the header has {len(header)}", line)
        node = row[id_col]
        if not node:
            raise FileGraphError(path, "empty node id", line)
        if node in lines:
            # A repeated row with the same label is harmless (MUSAE's Twitch FR file has one,
            # its other columns a view count apart); two different labels for one node are not.
            first = raw[ids.index(node)]
            if row[label_col] == first:
                continue
            raise FileGraphError(
                path,
                f"node {node!r} labelled twice, {first!r} on line {lines[node]} and {row[label_col]!r}",
                line,
            )
        lines[node] = line
        ids.append(node)
        raw.append(row[label_col])
    if not ids:
        raise FileGraphError(path, "no label lines after the header")
    given = [v for v in raw if v != ""]
    if all(_is_int(v) for v in given):
        values = [int(v) if v != "" else -1 for v in raw]
        bad = next((i for i, v in enumerate(values) if v < -1), None)
        if bad is not None:
            raise FileGraphError(
                path, f"label {values[bad]} < -1 (use -1 or empty for unlabeled)", lines[ids[bad]]
            )
    else:  # categories: numbered in sorted order, so True/False -> 1/0
        classes = {c: i for i, c in enumerate(sorted(set(given)))}
        values = [classes[v] if v != "" else -1 for v in raw]
    return ids, values


class _Features:
    def __init__(self, ids: list[str], rows: torch.Tensor, width: int) -> None:
        self.ids, self.rows, self.width = ids, rows, width


def _read_features(path: Path) -> _Features:
    suffix = path.suffix.lower()
    if suffix == ".json":
        return _read_bag_of_ids(path)
    if suffix == ".csv":
        return _read_feature_csv(path)
    if suffix == ".npz":
        return _read_feature_npz(path)
    raise FileGraphError(path, f"unknown features format {suffix!r}: use .csv, .json (bag of ids) or .npz")


def _read_bag_of_ids(path: Path) -> _Features:
    try:
        with path.open(encoding="utf-8") as fh:
            obj = json.load(fh)
    except json.JSONDecodeError as exc:
        raise FileGraphError(path, f"invalid JSON: {exc.msg}", exc.lineno) from exc
    except (UnicodeDecodeError, RecursionError) as exc:
        raise FileGraphError(path, f"cannot be read as JSON ({type(exc).__name__})") from exc
    if not isinstance(obj, dict):
        raise FileGraphError(
            path, f"expected an object {{node id: [feature ids]}}, got a {type(obj).__name__}"
        )
    ids = list(obj)
    nodes: list[int] = []
    cols: list[int] = []
    for row, key in enumerate(ids):
        feats = obj[key]
        if not isinstance(feats, list) or not all(
            isinstance(f, int) and not isinstance(f, bool) for f in feats
        ):
            raise FileGraphError(path, f"node {key!r}: expected a list of integer feature ids")
        if any(f < 0 for f in feats):
            raise FileGraphError(path, f"node {key!r}: negative feature id {min(feats)}")
        nodes.extend([row] * len(feats))
        cols.extend(feats)
    width = max(cols) + 1 if cols else 0
    rows = torch.zeros(len(ids), width, dtype=torch.float32)
    if cols:
        rows[torch.tensor(nodes), torch.tensor(cols)] = 1.0
    return _Features(ids, rows, width)


def _read_feature_csv(path: Path) -> _Features:
    ids: list[str] = []
    values: list[list[float]] = []
    width = None
    for line, row in _rows(path):
        if len(row) < 2:
            raise FileGraphError(path, "a feature line needs a node id and at least one value", line)
        try:
            nums = [float(v) for v in row[1:]]
        except ValueError:
            if not ids and line == 1:  # a header line
                continue
            raise FileGraphError(path, f"non-numeric feature value in {row[1:]!r}", line) from None
        if width is None:
            width = len(nums)
        elif len(nums) != width:
            raise FileGraphError(path, f"{len(nums)} feature values, earlier lines have {width}", line)
        if not all(np.isfinite(nums)):
            raise FileGraphError(path, "a feature value is not finite", line)
        ids.append(row[0])
        values.append(nums)
    if width is None:
        raise FileGraphError(path, "no feature lines")
    return _Features(ids, torch.tensor(values, dtype=torch.float32), width)


def _read_feature_npz(path: Path) -> _Features:
    try:
        arrays = np.load(path, allow_pickle=False)
    except Exception as exc:  # any zip/format error: not a usable npz
        raise FileGraphError(path, f"cannot be read as an npz ({exc})") from exc
    with arrays:
        names = [k for k in ("x", "features", "node_features") if k in arrays.files]
        if not names and len(arrays.files) != 1:
            raise FileGraphError(
                path, f"arrays {arrays.files}: name the features x, features or node_features"
            )
        x = arrays[names[0] if names else arrays.files[0]]
    if x.ndim != 2:
        raise FileGraphError(path, f"features must be [N, F], got shape {list(x.shape)}")
    rows = torch.from_numpy(np.asarray(x, dtype=np.float32))
    if not torch.isfinite(rows).all():
        raise FileGraphError(path, "a feature value is not finite")
    return _Features([str(i) for i in range(x.shape[0])], rows, x.shape[1])


def _node_index(ids: list[str], paths: dict[str, Path]) -> dict[str, int]:
    """Node id -> row: integer ids in numeric order (keyed by their canonical spelling, so ``07``
    and ``7`` are one node), other ids sorted; mixed ids are refused."""
    unique = set(ids)
    ints = [_is_int(i) for i in unique]
    if all(ints):
        by_value: dict[int, str] = {}
        for i in unique:
            v = int(i)
            if v in by_value:  # "7" and "07"
                raise FileGraphError(
                    paths["labels"], f"node ids {by_value[v]!r} and {i!r} are the same number"
                )
            by_value[v] = i
        return {str(v): row for row, v in enumerate(sorted(by_value))}
    elif any(ints):
        raise FileGraphError(paths["labels"], "node ids mix integers and names; use one kind")
    else:
        ordered = sorted(unique)
    return {node: row for row, node in enumerate(ordered)}


def _canonical(node: str) -> str:
    """An integer id in its canonical spelling (``"07"`` -> ``"7"``); other ids unchanged."""
    try:
        return str(int(node))
    except ValueError:
        return node


def _read_edges(path: Path, index: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
    src: list[int] = []
    dst: list[int] = []
    for line, row in _rows(path):
        if len(row) < 2:
            raise FileGraphError(path, "an edge line needs two node ids", line)
        a, b = _canonical(row[0]), _canonical(row[1])
        if a not in index or b not in index:
            if line == 1 and not (_is_int(a) and _is_int(b)):
                continue  # a header line
            unknown = a if a not in index else b
            raise FileGraphError(
                path, f"node {unknown!r} is in neither the features nor the labels file", line
            )
        src.append(index[a])
        dst.append(index[b])
    return np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
