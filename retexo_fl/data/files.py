"""A user's graph as plain files: an edge-list CSV, node features, labels; or a heterophilous npz.

Two ``--dataset`` forms read files a user brings rather than a PyG class:

``files:edges=E.csv,features=F,labels=L.csv[,id-column=NAME][,label-column=NAME]``
    * ``edges``: one edge a line, its first two columns the endpoint ids; a header line is
      optional (the first line is one when neither of its first two fields is a node id), and
      one naming the endpoint columns elsewhere (:func:`_endpoint_columns`) picks them; other
      columns (weights, timestamps) are ignored.
      Edges are taken as undirected, duplicates and self loops dropped; a file without an edge
      between two nodes is refused.
    * ``features``: a ``.csv`` (node id, then one number a column; header optional; with one, a
      column of text is skipped, as is the label column of a table that is both files), a ``.json``
      bag of ids (``{"<node id>": [feature id, ...]}``, multi-hot, as the MUSAE social graphs
      ship) or an ``.npz`` (one array, or the first of ``x``, ``features``, ``node_features``:
      row ``i`` is node ``i``).
    * ``labels``: a CSV with a header, one node a line. The node id is in column ``id-column``
      (default: the one column named ``id``, ``node`` or ``node_id``, in any case, else the
      first) and the label in ``label-column`` (default: the other of two columns; name it
      when there are more). Integer labels are kept (``-1`` or an empty
      field: unlabeled), written as floats too (``2.0``, ``-1.0``, as pandas writes an integer
      column with a gap); any other values (``True``/``False``, class names) are numbered in
      sorted order (a word among integer labels is an error). Integer labels are class indices,
      at most :data:`MAX_CLASSES` classes.

    Nodes are the ids the feature and label files name. Integer ids keep their numeric order
    (so ids ``0..N-1`` stay node ``0..N-1``) and are one node whatever their spelling in each
    file (``07`` in one, ``7`` in another); other ids are numbered in sorted order. A node
    without a feature row gets zeros; an edge endpoint that no file names is an error, and so
    is a node with two feature rows or one file naming a node twice in two spellings.

Files are comma-separated UTF-8 (a byte-order mark is allowed). The edges file may instead be
separated by tabs or spaces (its first edge line has no comma), as SNAP, KONECT and networkx's
``write_edgelist`` write edge lists, and its comment lines (``# ...``, ``% ...``) are skipped.

``PATH.npz`` in the format of PyG's ``HeterophilousGraphDataset`` (``node_features``,
``node_labels``, ``edges [E, 2]`` and optional ``train_masks``/``val_masks``/``test_masks``
``[S, N]``), e.g. the filtered Chameleon and Squirrel graphs.

Every error is a :class:`FileGraphError` (a :class:`~retexo_fl.data.errors.DatasetError`)
naming the file and, for a text file, the line.
"""

from __future__ import annotations

import contextlib
import csv
import itertools
import json
import logging
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

import numpy as np
import torch
from torch_geometric.data import Data

from retexo_fl.data.edges import undirected_coalesced
from retexo_fl.data.sources import FileGraphError, parse_files_spec

log = logging.getLogger(__name__)

#: Column names (any case) that make a labels file's column its id column when id-column is not given.
ID_COLUMN_NAMES = ("id", "node", "node_id", "nodeid", "node id")
#: The arrays of an npz in ``HeterophilousGraphDataset``'s format.
HETEROPHILOUS_KEYS = ("node_features", "node_labels", "edges")
#: Integer labels are class indices: a model's output is one column a class, so a label past this
#: (a year, an account number) is refused rather than sized into a head of that many columns.
MAX_CLASSES = 1 << 16
#: From this many classes, integer labels that leave most class indices unused (or that are
#: nearly one class a node) are said: a year or a count read as class indices.
SPARSE_CLASSES = 16
#: From this width, a bag of feature ids that leaves most columns unused is said (a stray id).
SPARSE_FEATURE_WIDTH = 4096
#: The largest finite float32: features are float32, and a larger value read from text would be inf.
FLOAT32_MAX = float(np.finfo(np.float32).max)
#: A bag-of-ids feature matrix is dense, nodes x (largest feature id + 1): past this many values
#: (8 GiB of float32) a stray feature id is far likelier than a graph that wide.
MAX_FEATURE_VALUES = 1 << 31


#: Cells that stand for a missing value, in lower case (R writes NA, pandas nan, UCI files ?) ...
MISSING_VALUES = frozenset({"", "na", "nan", "n/a", "null", "?"})
#: ... and the label values read as "unlabeled": those, and the documented -1.
MISSING_LABELS = MISSING_VALUES | {"-1", "-1.0"}


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
    paths = {k: Path(keys[k]).expanduser() for k in ("edges", "features", "labels")}
    for name, path in paths.items():
        if path.is_dir():
            raise FileGraphError(path, f"is a folder; the {name} file is wanted")
        if not path.is_file():
            raise FileGraphError(path, f"no such {name} file")
    labels = _read_labels(paths["labels"], keys.get("id-column"), keys.get("label-column"))
    label_ids, label_values = labels.ids, labels.values
    feats = _read_features(paths["features"], labels)
    numbered = (  # at 2 columns or more a data row is these integers by chance alone
        feats.width >= 2
        and bool(feats.ids)
        and feats.rows[0].tolist() in (list(range(feats.width)), list(range(1, feats.width + 1)))
    )
    labelled = {_canonical(i) for i in label_ids}
    whole, dropped = feats, None
    if numbered and feats.lines[0] == 1:
        # "name,0,1": the features CSV's header, its columns numbered as pandas names them, where
        # its id column is named as the labels' is, or names no labelled node: then it is a node
        # only if an edge names it (below).
        if feats.ids[0] != labels.header_id and _canonical(feats.ids[0]) not in labelled:
            dropped = feats.ids[0]
        if dropped is not None or feats.ids[0] == labels.header_id:
            feats = _Features(feats.path, feats.ids[1:], feats.lines[1:], feats.rows[1:], feats.width)
    if labels.header_id in set(feats.ids):  # "n0,1" on line 1: data, not column names
        raise FileGraphError(
            paths["labels"],
            f"the labels file needs a header line naming its columns (line 1's id column reads "
            f"{labels.header_id!r}, a node of the features file)",
            1,
        )
    index = _files_node_index(labels, feats, paths["features"])
    if feats.ids and not labelled & {_canonical(i) for i in feats.ids}:
        raise FileGraphError(
            paths["labels"],
            f"none of its {len(label_ids)} node ids (column {labels.header_id!r}, e.g. {label_ids[0]!r}) "
            f"has a row in {paths['features'].name} (e.g. {feats.ids[0]!r}): the files name nodes "
            "differently; name the labels' node id column with id-column=NAME",
        )
    try:
        src, dst = _read_edges(paths["edges"], index)
    except FileGraphError as exc:
        if dropped is None or not exc.reason.startswith(f"node {_canonical(dropped)!r} is in neither"):
            raise
        # an edge names it: a node with no label whose features are 0, 1, ..., not a header
        feats, dropped = whole, None
        index = _files_node_index(labels, feats, paths["features"])
        src, dst = _read_edges(paths["edges"], index)
    if dropped is not None:
        log.warning(
            "%s: line 1 (%r, then the numbers 0..) read as the header of numbered columns: no "
            "label or edge names it as a node",
            paths["features"].name, dropped,
        )  # fmt: skip
    n = len(index)
    y = torch.full((n,), -1, dtype=torch.long)
    y[torch.tensor([index[_canonical(i)] for i in label_ids], dtype=torch.long)] = torch.tensor(label_values)
    x = torch.zeros(n, feats.width, dtype=torch.float32)
    if feats.ids:
        x[torch.tensor([index[_canonical(i)] for i in feats.ids], dtype=torch.long)] = feats.rows
    without_row, without_label = n - len(feats.ids), n - len(label_ids)
    if without_row or without_label:
        # Legal (a node may have no features, or no label), but a sign of ids that do not match
        # between the files (1-based ids against an npz's rows 0..N-1, say): said, not silent.
        log.warning(
            "%s: of %d nodes, %d have no feature row (their features are zeros) and %d no line in "
            "%s (unlabeled); ids that differ between the files do this",
            paths["features"].name, n, without_row, without_label, paths["labels"].name,
        )  # fmt: skip
    edge_index = undirected_coalesced(torch.stack([torch.from_numpy(src), torch.from_numpy(dst)]), n)
    if edge_index.size(1) == 0:
        raise FileGraphError(
            paths["edges"],
            f"its {len(src)} edge line(s) are all self loops: a graph needs an edge between two nodes",
        )
    data = Data(x=x, y=y, edge_index=edge_index)
    data.name = paths["edges"].stem
    # The user's own names of the nodes and classes: each party's folders keep its nodes' (and
    # an --owners file names nodes by them), so a row of node_ids.npy can be told apart.
    data.node_names = sorted(index, key=index.__getitem__)
    if labels.class_names is not None:
        data.class_names = labels.class_names
    return data


def load_heterophilous_npz(path: Path) -> Data:
    """Read an npz in ``HeterophilousGraphDataset``'s format (masks ``[S, N]`` become ``[N, S]``).

    Raises:
        FileGraphError: on a missing or malformed array.
    """
    arrays = _open_npz(path)
    with arrays:
        missing = [k for k in HETEROPHILOUS_KEYS if k not in arrays.files]
        if missing:
            raise FileGraphError(
                path,
                f"missing array(s) {', '.join(missing)}; an npz graph needs {', '.join(HETEROPHILOUS_KEYS)}",
            )
        x, y, edges = (_array(arrays, k, path) for k in HETEROPHILOUS_KEYS)
        n = x.shape[0] if x.ndim == 2 else -1
        if x.ndim != 2:
            raise FileGraphError(path, f"node_features must be [N, F], got shape {list(x.shape)}")
        if y.shape != (n,):
            raise FileGraphError(path, f"node_labels must be [N] = [{n}], got shape {list(y.shape)}")
        if edges.ndim != 2 or edges.shape[1] != 2:
            raise FileGraphError(path, f"edges must be [E, 2], got shape {list(edges.shape)}")
        x = _numbers(x, path, "node_features", integral=False)
        y = _numbers(y, path, "node_labels", integral=True)
        edges = _numbers(edges, path, "edges", integral=True)
        if y.size and (y.min() < -1 or y.max() >= MAX_CLASSES):
            raise FileGraphError(
                path, f"node_labels must be class indices in -1..{MAX_CLASSES - 1} (-1: unlabeled)"
            )
        if edges.size and (edges.min() < 0 or edges.max() >= n):
            raise FileGraphError(path, f"edges name a node outside 0..{n - 1}")
        data = Data(
            x=torch.from_numpy(x),
            y=torch.from_numpy(y),
            edge_index=undirected_coalesced(torch.from_numpy(edges.T.copy()), n),
        )
        for key, field in (
            ("train_masks", "train_mask"),
            ("val_masks", "val_mask"),
            ("test_masks", "test_mask"),
        ):
            if key in arrays.files:
                mask = _array(arrays, key, path)
                if mask.ndim != 2 or mask.shape[1] != n:
                    raise FileGraphError(path, f"{key} must be [S, N] with N = {n}, got {list(mask.shape)}")
                if mask.dtype.kind not in "biuf" or not np.isin(mask, (0, 1)).all():
                    raise FileGraphError(path, f"{key} must hold booleans (or 0 / 1)")
                data[field] = torch.from_numpy(mask.astype(bool).T.copy())
    data.name = path.stem
    return data


# -- readers ---------------------------------------------------------------------------------


def _files_node_index(labels: _Labels, feats: _Features, features_path: Path) -> dict[str, int]:
    """:func:`_node_index` over a ``files:`` graph's labels and features, an npz's hint added."""
    try:
        return _node_index([labels, feats])
    except FileGraphError as exc:
        if features_path.suffix.lower() != ".npz":
            raise
        # An npz names no ids: its rows are nodes 0..N-1, which a file of named nodes cannot match.
        hint = f"; {features_path.name} is an npz, whose rows are the integer nodes 0..N-1"
        raise FileGraphError(exc.path, exc.reason + hint, exc.line) from None


class _Ids:
    """The node ids one file names, in its order, with the line of each (``None``: no lines)."""

    def __init__(self, path: Path, ids: list[str], lines: list[int | None]) -> None:
        self.path, self.ids, self.lines = path, ids, lines


class _Labels(_Ids):
    def __init__(
        self,
        path: Path,
        ids: list[str],
        lines: list[int | None],
        values: list[int],
        header_id: str,
        header_label: str,
        class_names: list[str] | None = None,
    ) -> None:
        super().__init__(path, ids, lines)
        self.values, self.header_id, self.header_label = values, header_id, header_label
        self.class_names = class_names  # class i's name, where the labels are names


class _Features(_Ids):
    def __init__(
        self,
        path: Path,
        ids: list[str],
        lines: list[int | None],
        rows: torch.Tensor,
        width: int,
    ) -> None:
        super().__init__(path, ids, lines)
        self.rows, self.width = rows, width


@contextlib.contextmanager
def _text(path: Path) -> Iterator[TextIO]:
    """``path`` open as UTF-8 text (a leading byte-order mark skipped); its decoding and CSV
    faults, met while it is read, raised naming it."""
    try:
        with path.open(newline="", encoding="utf-8-sig") as fh:
            yield fh
    except UnicodeDecodeError as exc:
        hint = _compressed_hint(path)  # a compressed file has no lines to name
        line = None if hint else _first_undecodable_line(path)
        raise FileGraphError(path, f"not UTF-8 text ({exc.reason}){hint}", line) from exc
    except csv.Error as exc:
        raise FileGraphError(path, f"malformed CSV ({exc})") from exc


def _first_undecodable_line(path: Path) -> int | None:
    """The first line of ``path`` that is not UTF-8 (read again on the error's path only; the
    decoder's offset counts within its buffer, not the file)."""
    try:
        lines = path.read_bytes().splitlines()  # \r, \n and \r\n: the lines the text reader counts
    except OSError:
        return None
    for number, raw in enumerate(lines, start=1):
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            return number
    return None


#: The first bytes of compressed files a user may pass as they were downloaded.
_COMPRESSED = ((b"\x1f\x8b", "gzip", "gunzip"), (b"BZh", "bzip2", "bunzip2"), (b"\xfd7zXZ", "xz", "unxz"))


def _compressed_hint(path: Path) -> str:
    """Advice for a file that is not text because it is compressed (``.csv.gz`` renamed, say)."""
    try:
        with path.open("rb") as fh:
            head = fh.read(6)
    except OSError:
        return ""
    for magic, kind, tool in _COMPRESSED:
        if head.startswith(magic):
            return f"; it is {kind}-compressed: decompress it first ({tool})"
    if head.startswith(b"PK"):
        return "; it is a zip archive: extract the file from it first"
    return ""


#: Why a CSV record can span lines or swallow a file: a quote that opens a field and is never closed.
_QUOTE_HINT = 'a quote (") opens a field that no quote closes'


def _records(path: Path, lines: Iterator[str], first_line: int = 1) -> Iterator[tuple[int, list[str]]]:
    """``(line, fields)`` of each CSV record of ``lines``, numbered by the physical line it starts
    on (``lines``' first is ``first_line``); a CSV fault is refused naming that line. A field
    quoted across line breaks is one field (a free-text column, as pandas writes one); where a
    reader takes it as an id, a label or a number, :func:`_single_line` refuses it: an unclosed
    quote reads the rest of the file as one field."""
    reader = csv.reader(lines)
    start = first_line
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            hint = f": {_QUOTE_HINT}" if "field larger" in str(exc) or "EOF" in str(exc) else ""
            raise FileGraphError(path, f"malformed CSV ({exc}){hint}", start) from exc
        yield start, row
        start = first_line + reader.line_num


def _single_line(path: Path, line: int, *fields: str) -> None:
    """Refuse an id, label or number that spans lines (:func:`_records`), naming the line it opens on."""
    if any("\n" in f or "\r" in f for f in fields):
        raise FileGraphError(path, f"a field runs over several lines: {_QUOTE_HINT}?", line)


def _rows(path: Path) -> Iterator[tuple[int, list[str]]]:
    """``(line number, fields)`` of each non-blank CSV line."""
    with _text(path) as fh:
        for line, row in _records(path, fh):
            if row and any(f.strip() for f in row):
                yield line, [f.strip() for f in row]


#: A comment line at the top of an edge list: ``%`` (KONECT), or ``#`` then a blank (SNAP), so
#: that a first edge from a node named ``#tag`` is still an edge.
_EDGE_COMMENT = re.compile(r"^[#%](\s|$)")


def _spaced(line: str) -> bool:
    """Whether an edge list whose first edge line is ``line`` is separated by tabs or spaces:
    a tab, no comma, or (networkx's ``write_edgelist(data=True)``) an attribute dict opened
    before the first comma. ``New York,Boston`` stays comma-separated."""
    text = line.strip()
    if "\t" in text or ("," not in text and len(text.split()) >= 2):
        return True
    return "{" in text and text.index("{") < text.index(",")


def _edge_rows(path: Path) -> Iterator[tuple[int, list[str]]]:
    """``(line number, fields)`` of each edge line: comma-separated, or separated by tabs or
    spaces (:func:`_spaced`, decided on the first edge line); comment lines (``# ...``,
    ``% ...``) skipped, those before it read as lines, so a quote in one cannot open a CSV field,
    and those after it too (a concatenated list's second header)."""
    with _text(path) as fh:
        numbered = enumerate(fh, start=1)
        lines = ((n, t) for n, t in numbered if t.strip() and not _EDGE_COMMENT.match(t.strip()))
        first = next(lines, None)  # numbered goes on after it
        if first is None:
            return
        number, line = first
        if _spaced(line):
            for n, text in itertools.chain([(number, line)], numbered):
                if text.strip() and not _EDGE_COMMENT.match(text.strip()):
                    yield n, text.split()
            return
        for start, row in _records(path, itertools.chain([line], (text for _, text in numbered)), number):
            # "# note, with a comma": a comment; "#,b" stays an edge from node "#"
            if row and any(f.strip() for f in row) and not re.match(r"[#%]\s", row[0].strip()):
                yield start, [f.strip() for f in row]


def _separator_hint(fields: list[str]) -> str:
    """Advice for a line read as one field that another separator splits (a TSV named .csv)."""
    if len(fields) != 1:
        return ""
    for sep, name in (("\t", "tabs"), (";", "semicolons"), ("|", "bars"), (" ", "spaces")):
        if sep in fields[0].strip():
            return f"; the file looks separated by {name}, and files are read comma-separated"
    return ""


def _parses(text: str, kind: type[int] | type[float]) -> bool:
    """Whether ``kind(text)`` reads ``text`` (``int`` or ``float``)."""
    try:
        kind(text)
    except ValueError:
        return False
    return True


#: An integer as files write one: ASCII digits, an optional sign. Python's ``int`` also reads
#: ``"1_10"`` (110) and other scripts' digits, which would merge ids that differ as text.
_INTEGER = re.compile(r"[+-]?[0-9]+")


def _is_int(text: str) -> bool:
    return _INTEGER.fullmatch(text) is not None


def _is_integral(text: str) -> bool:
    """Whether ``text`` is a finite float with no fraction (``"2.0"``, ``"-1.0"``, ``"1e3"``;
    not ``"1_0"``, which Python's ``float`` reads as 10)."""
    if "_" in text:
        return False
    try:
        value = float(text)
    except ValueError:
        return False
    return math.isfinite(value) and value == int(value)


def _read_labels(path: Path, id_column: str | None, label_column: str | None) -> _Labels:
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
                    f"{what}=NAME in the files: spec{_separator_hint(header)}",
                    1,
                )
            return default
        if name not in header:
            raise FileGraphError(
                path, f"no column {name!r} (columns: {', '.join(header)}){_separator_hint(header)}", 1
            )
        return header.index(name)

    # Unnamed, the id is the column named as ids are ("id", "node", "node_id"), else the first:
    # a "label,id" header would otherwise read the classes as node ids.
    named = [i for i, name in enumerate(header) if name.strip().lower() in ID_COLUMN_NAMES]
    id_col = column(id_column, named[0] if len(named) == 1 else 0, "id-column")
    label_col = column(label_column, 1 - id_col if len(header) == 2 else None, "label-column")
    if id_col == label_col:
        raise FileGraphError(path, f"id and label are the same column {header[id_col]!r}", 1)
    if _is_int(header[id_col]):  # "0,dog": a first data line, not column names
        raise FileGraphError(
            path,
            f"the labels file needs a header line naming its columns (line 1's id column reads "
            f"{header[id_col]!r}, a node id)",
            1,
        )
    ids: list[str] = []
    raw: list[str] = []
    lines: dict[str, int] = {}
    for line, row in rows:
        if len(row) != len(header):
            raise FileGraphError(path, f"{len(row)} fields, the header has {len(header)}", line)
        node = row[id_col]
        _single_line(path, line, node, row[label_col])
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
    # Unlabeled, as the docs say (-1 or empty), and as other tools write a missing value (R's
    # NA, pandas' nan): read as names, each would have become a class of its own.
    missing: dict[str, int] = {}  # each token but the documented empty and -1, by count
    for i, v in enumerate(raw):
        if v.strip().lower() in MISSING_LABELS:
            if not _is_integral(v):  # not "", -1 or -1.0
                missing[v] = missing.get(v, 0) + 1
            raw[i] = ""
    if missing:  # said: a class named NA (a continent, say) would otherwise vanish silently
        log.warning(
            "%s: %s read as unlabeled (a missing value); if that is a class, give it another name",
            path.name, ", ".join(f"{count} label(s) {token!r}" for token, count in sorted(missing.items())),
        )  # fmt: skip
    given = [v for v in raw if v != ""]
    if given and not all(_is_int(v) for v in given) and all(_is_integral(v) for v in given):
        # "1.0", "-1.0": an integer column a spreadsheet or pandas wrote as floats (it does so
        # when a value is missing); as names, "-1.0" would be a class and "10.0" sort before "2.0".
        raw = [str(int(float(v))) if v != "" else v for v in raw]
        given = [v for v in raw if v != ""]
    if all(_is_int(v) for v in given):
        values = [int(v) if v != "" else -1 for v in raw]
        for node, value in zip(ids, values, strict=True):
            if value < -1:
                raise FileGraphError(path, f"label {value} < -1 (use -1 or empty for unlabeled)", lines[node])
            if value >= MAX_CLASSES:
                raise FileGraphError(
                    path,
                    f"label {value}: integer labels are class indices 0..C-1, at most {MAX_CLASSES} "
                    "classes (renumber the classes, or write them as names)",
                    lines[node],
                )
        distinct = {v for v in values if v >= 0}
        classes = max(distinct, default=-1) + 1
        if classes > SPARSE_CLASSES and (classes > 2 * len(distinct) or 2 * classes > len(given)):
            # years, counts: a head of that many outputs, most of them classes no node has
            log.warning(
                "%s: integer labels are class indices: %d classes for %d distinct labels on %d "
                "labelled nodes (largest %d); if column %r is not a class, name another "
                "(label-column=NAME), or renumber the classes 0..C-1",
                path.name, classes, len(distinct), len(given), classes - 1, header[label_col],
            )  # fmt: skip
    else:  # categories: numbered in sorted order, so True/False -> 1/0
        ints = [v for v in given if _is_integral(v)]
        words = [v for v in given if not _parses(v, float)]
        if words and len(ints) * 2 >= len(given):  # "1, 0, unknown": class indices and a stray word
            word = words[0]
            line = lines[ids[raw.index(word)]]
            raise FileGraphError(
                path,
                f"label {word!r} among integer labels: integer labels are class indices (write an "
                "unlabeled node as -1 or empty, or every class as a name)",
                line,
            )
        if header[label_col] in given:  # "alice,dog": line 1 was data, its label a class
            raise FileGraphError(
                path,
                f"the labels file needs a header line naming its columns (line 1's label "
                f"{header[label_col]!r} is also a label of later lines)",
                1,
            )
        # Numbers (ratings 1, 2, 3.5) in numeric order, names in string order.
        classes = {c: i for i, c in enumerate(sorted(set(given), key=None if words else float))}
        values = [classes[v] if v != "" else -1 for v in raw]
        return _Labels(
            path, ids, [lines[i] for i in ids], values, header[id_col], header[label_col], list(classes)
        )
    return _Labels(path, ids, [lines[i] for i in ids], values, header[id_col], header[label_col])


def _read_features(path: Path, labels: _Labels) -> _Features:
    suffix = path.suffix.lower()
    if suffix == ".json":
        feats = _read_bag_of_ids(path)
    elif suffix == ".csv":
        feats = _read_feature_csv(path, labels)
    elif suffix == ".npz":
        feats = _read_feature_npz(path)
    else:
        raise FileGraphError(
            path, f"unknown features format {suffix!r}: use .csv, .json (bag of ids) or .npz"
        )
    if feats.width == 0:
        raise FileGraphError(
            path,
            "no feature columns: every node's features would be empty; a graph without node "
            "features needs some to train on (a column of ones, or each node's degree)",
        )
    return feats


def _read_bag_of_ids(path: Path) -> _Features:
    def unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
        out: dict[str, object] = {}
        for key, value in pairs:
            if key in out:  # json.load would keep the last silently
                raise FileGraphError(path, f"node {key!r} has two feature lists")
            out[key] = value
        return out

    try:
        with path.open(encoding="utf-8-sig") as fh:
            obj = json.load(fh, object_pairs_hook=unique_keys)
    except json.JSONDecodeError as exc:
        raise FileGraphError(path, f"invalid JSON: {exc.msg}", exc.lineno) from exc
    except (UnicodeDecodeError, RecursionError) as exc:
        hint = _compressed_hint(path)
        raise FileGraphError(path, f"cannot be read as JSON ({type(exc).__name__}){hint}") from exc
    if not isinstance(obj, dict):
        raise FileGraphError(
            path, f"expected an object {{node id: [feature ids]}}, got a {type(obj).__name__}"
        )
    ids = list(obj)
    nodes: list[int] = []
    cols: list[int] = []
    widest = ""
    for row, key in enumerate(ids):
        feats = obj[key]
        if not isinstance(feats, list) or not all(
            isinstance(f, int) and not isinstance(f, bool) for f in feats
        ):
            raise FileGraphError(path, f"node {key!r}: expected a list of integer feature ids")
        if any(f < 0 for f in feats):
            raise FileGraphError(path, f"node {key!r}: negative feature id {min(feats)}")
        if feats and (not cols or max(feats) > max(cols)):
            widest = key
        nodes.extend([row] * len(feats))
        cols.extend(feats)
    width = max(cols) + 1 if cols else 0
    if len(ids) * width > MAX_FEATURE_VALUES:
        raise FileGraphError(
            path,
            f"node {widest!r}: feature id {width - 1} makes the multi-hot matrix {len(ids)} x {width}, "
            f"past {MAX_FEATURE_VALUES:,} values; number the feature ids 0..F-1",
        )
    used = len(set(cols))
    if width > SPARSE_FEATURE_WIDTH and width > 8 * used:
        log.warning(
            "%s: feature ids run to %d (node %r) but %d distinct ids are used: the multi-hot matrix "
            "is %d x %d; numbering the feature ids 0..F-1 would make it %d wide",
            path.name, width - 1, widest, used, len(ids), width, used,
        )  # fmt: skip
    try:
        rows = torch.zeros(len(ids), width, dtype=torch.float32)
    except RuntimeError as exc:  # out of memory on this machine, below the bound
        raise FileGraphError(path, f"the multi-hot matrix {len(ids)} x {width} does not fit ({exc})") from exc
    if cols:
        rows[torch.tensor(nodes), torch.tensor(cols)] = 1.0
    return _Features(path, ids, [None] * len(ids), rows, width)


def _read_feature_csv(path: Path, labels: _Labels) -> _Features:
    """A features CSV: node id, then one number a column.

    Where a header line names the columns, two kinds are not read, each said in the log: the
    label column, where the labels file is this file (one table of a node's columns given as both
    files would put each node's label among the inputs of the model that predicts it), and a
    column of text, with no number in it (a site, a name: a table's other columns). A word in a
    column of numbers is an error naming its line.
    """
    columns = _feature_header(path, labels)  # the value columns' names, where line 1 gives them
    skip = _unread_columns(path, columns, labels) if columns is not None else set()
    ids: list[str] = []
    lines: list[int | None] = []
    seen: dict[str, int] = {}
    values: list[list[float]] = []
    width = None
    for line, row in _feature_rows(path, labels):
        if len(row) < 2:
            raise FileGraphError(
                path, f"a feature line needs a node id and at least one value{_separator_hint(row)}", line
            )
        _single_line(path, line, row[0])
        if line == 1 and columns is not None:
            continue
        # the value columns read, by their place among the file's value columns
        kept = list(range(len(row) - 1))
        if skip and columns is not None and len(row) == len(columns) + 1:
            kept = [k for k in kept if k not in skip]
        try:
            nums = [float(row[k + 1]) for k in kept]
        except ValueError:
            k = next(k for k in kept if not _parses(row[k + 1], float))
            name = f" ({columns[k]!r})" if columns is not None and len(columns) == len(row) - 1 else ""
            reason = f"non-numeric feature value {row[k + 1]!r} in value column {k + 1}{name}"
            if "\n" in row[k + 1] or "\r" in row[k + 1]:
                reason += f"; it runs over several lines: {_QUOTE_HINT}?"
            raise FileGraphError(path, reason, line) from None
        if width is None:
            width = len(nums)
        elif len(nums) != width:
            raise FileGraphError(path, f"{len(nums)} feature values, earlier lines have {width}", line)
        if not all(np.isfinite(nums)):
            raise FileGraphError(path, "a feature value is not finite", line)
        with np.errstate(over="ignore"):  # read as float64: a value past float32's range becomes inf
            narrow = np.asarray(nums, dtype=np.float32)
        if not np.isfinite(narrow).all():
            big = nums[int(np.argmin(np.isfinite(narrow)))]
            raise FileGraphError(
                path, f"feature value {big:g} does not fit float32 (at most {FLOAT32_MAX:.4g})", line
            )
        if row[0] in seen:
            raise FileGraphError(
                path,
                f"node {row[0]!r} has a feature row on line {seen[row[0]]} too (a feature CSV's first "
                "column is the node id)",
                line,
            )
        seen[row[0]] = line
        ids.append(row[0])
        lines.append(line)
        values.append(nums)
    if width is None:
        raise FileGraphError(path, "no feature lines")
    return _Features(path, ids, lines, torch.tensor(values, dtype=torch.float32), width)


def _is_word(value: str) -> bool:
    """A cell that is neither a number nor a missing value's token."""
    return not _parses(value, float) and value.strip().lower() not in MISSING_VALUES


def _feature_rows(path: Path, labels: _Labels) -> Iterator[tuple[int, list[str]]]:
    """A features CSV's lines (:func:`_rows`), each with its node id first. That is the first
    column, but in a table that is the labels file too, the labels' id column (``id-column``):
    read from the first column, a table whose ids are not first would pair each node's features
    with another node's label."""
    rows = _rows(path)
    if path.resolve() != labels.path.resolve():
        yield from rows
        return
    first = next(rows, None)
    if first is None:
        return
    k = first[1].index(labels.header_id) if first[0] == 1 and labels.header_id in first[1] else 0
    for line, row in itertools.chain([first], rows):
        yield line, ([row[k], *row[:k], *row[k + 1 :]] if 0 < k < len(row) else row)


def _feature_header(path: Path, labels: _Labels) -> list[str] | None:
    """A features CSV's value column names, where its line 1 is a header: a word among its values
    ("degree", "pop_2019"), or an empty id field (pandas' ``to_csv`` index). A line 1 whose only
    non-numbers are blanks or NA is a node's row with missing values (an error, not a header
    guess that would drop the node silently)."""
    first = next(_feature_rows(path, labels), None)
    if first is None or first[0] != 1 or len(first[1]) < 2:
        return None
    row = first[1]
    return row[1:] if not row[0] or any(_is_word(v) for v in row[1:]) else None


def _unread_columns(path: Path, columns: list[str], labels: _Labels) -> set[int]:
    """The value columns of a features CSV with a header (``columns``) that are not read (see
    :func:`_read_feature_csv`), each said in the log: a second pass over the file, which looks
    only at the columns whose first value is text."""
    skip: set[int] = set()
    same_table = path.resolve() == labels.path.resolve()
    if same_table and labels.header_label in columns:
        log.warning(
            "%s: column %r is the labels' label column: not read as a feature", path.name, labels.header_label
        )
        skip.add(columns.index(labels.header_label))
    if same_table:  # ids from id-column: an unnamed first column is pandas' row index, not a value
        for k, name in enumerate(columns):
            if not name or re.fullmatch(r"Unnamed: \d+", name):
                log.warning("%s: an unnamed column (a row index) not read as a feature", path.name)
                skip.add(k)
    text: dict[int, tuple[str, int]] = {}  # column -> its first value and line
    numeric: set[int] = set()
    for line, row in _feature_rows(path, labels):
        if line == 1 or len(row) != len(columns) + 1:
            continue  # the header, and rows the reader refuses
        if not text and not numeric:  # the first data row: which columns may be text
            text = {k: (v, line) for k, v in enumerate(row[1:]) if k not in skip and _is_word(v)}
            if not text:
                break
            continue
        numeric.update(k for k in text if _parses(row[k + 1], float))
    for k, (value, line) in text.items():
        if k not in numeric:  # a word among numbers stays: the reader names its line
            log.warning(
                "%s: column %r holds text (%r on line %d): not read as a feature",
                path.name,
                columns[k],
                value,
                line,
            )
            skip.add(k)
    return skip


def _array(arrays: np.lib.npyio.NpzFile, key: str, path: Path) -> np.ndarray:
    """One array of an npz; an object array (which needs pickle) or a corrupt member is refused."""
    try:
        return arrays[key]
    except Exception as exc:  # object arrays (allow_pickle=False), truncated members, bad headers
        raise FileGraphError(path, f"array {key!r} cannot be read ({exc})") from exc


def _numbers(values: np.ndarray, path: Path, what: str, *, integral: bool) -> np.ndarray:
    """``values`` as float32 features (finite) or int64 ids and labels (exactly integral)."""
    if values.dtype.kind not in "biuf":
        raise FileGraphError(path, f"{what} must be numbers, got dtype {values.dtype}")
    if not integral:
        out = np.asarray(values, dtype=np.float32)
        if not np.isfinite(out).all():
            raise FileGraphError(path, f"{what}: a value is not finite")
        return out
    if values.dtype.kind == "f":
        fractional = values != np.round(values)  # NaN too
        if fractional.any():
            raise FileGraphError(path, f"{what} must be integers, got {values[fractional].flat[0]}")
        if not np.isfinite(values).all():
            raise FileGraphError(path, f"{what} must be integers, got an infinite value")
        if values.size and np.abs(values).max() >= 2**53:
            raise FileGraphError(path, f"{what}: a value past 2**53 cannot be an exact float")
    return np.asarray(values, dtype=np.int64)


def _open_npz(path: Path) -> np.lib.npyio.NpzFile:
    """``path`` opened as an npz (a zip of ``.npy`` arrays), or an error saying what it is instead:
    numpy reads any other file as one pickled object and answers with advice on ``allow_pickle``."""
    with path.open("rb") as fh:
        head = fh.read(4)
    if not head.startswith(b"PK"):
        what = "a single .npy array" if head.startswith(b"\x93NUM") else "not a zip archive"
        raise FileGraphError(
            path, f"not an npz file ({what}{_compressed_hint(path)}): save arrays with numpy.savez"
        )
    try:
        return np.load(path, allow_pickle=False)
    except Exception as exc:  # any zip/format error: not a usable npz
        raise FileGraphError(path, f"cannot be read as an npz ({exc})") from exc


def _read_feature_npz(path: Path) -> _Features:
    arrays = _open_npz(path)
    with arrays:
        names = [k for k in ("x", "features", "node_features") if k in arrays.files]
        if not names and len(arrays.files) != 1:
            raise FileGraphError(
                path, f"arrays {arrays.files}: name the features x, features or node_features"
            )
        x = _array(arrays, names[0] if names else arrays.files[0], path)
    if x.ndim != 2:
        raise FileGraphError(path, f"features must be [N, F], got shape {list(x.shape)}")
    rows = torch.from_numpy(_numbers(x, path, "features", integral=False))
    n = x.shape[0]
    return _Features(path, [str(i) for i in range(n)], [None] * n, rows, x.shape[1])


def _node_index(sources: list[_Ids]) -> dict[str, int]:
    """Node id -> row over every file's ids: integer ids in numeric order, keyed by their
    canonical spelling (``07`` in one file and ``7`` in another are one node), other ids sorted.

    Raises:
        FileGraphError: naming the file and line of an id of the other kind where ids mix
            integers and names, or of an integer id one file spells twice (``7`` and ``07``).
    """
    kinds = {
        (src.path, node, line): _is_int(node)
        for src in sources
        for node, line in zip(src.ids, src.lines, strict=True)
    }
    ints = sum(kinds.values())
    if 0 < ints < len(kinds):
        odd = ints * 2 < len(kinds)  # report an id of the minority kind: the likelier mistake
        path, node, line = next(key for key, is_int in kinds.items() if is_int == odd)
        kind, other = ("an integer", "names") if odd else ("a name", "integers")
        raise FileGraphError(
            path,
            f"node id {node!r} is {kind}, while most node ids in the files are {other}: use one kind "
            "of id in every file (a feature CSV's first column is the node id)",
            line,
        )
    if not ints:
        return {node: row for row, node in enumerate(sorted({n for src in sources for n in src.ids}))}
    values: set[int] = set()
    for src in sources:
        spelled: dict[int, tuple[str, int | None]] = {}
        for node, line in zip(src.ids, src.lines, strict=True):
            value = int(node)
            if value in spelled and spelled[value][0] != node:
                first, first_line = spelled[value]
                where = f" on line {first_line}" if first_line is not None else ""
                reason = f"node ids {first!r}{where} and {node!r} are the same number"
                raise FileGraphError(src.path, reason, line)
            spelled[value] = (node, line)
        values.update(spelled)
    return {str(v): row for row, v in enumerate(sorted(values))}


def _canonical(node: str) -> str:
    """An integer id in its canonical spelling (``"07"`` -> ``"7"``); other ids unchanged."""
    return str(int(node)) if _is_int(node) else node


#: Header names of an edge list's two endpoint columns (any case), where they are not its first two.
ENDPOINT_COLUMNS = (
    ("source", "target"), ("src", "dst"), ("from", "to"), ("u", "v"), ("head", "tail"),
    ("node1", "node2"), ("node_1", "node_2"), ("id1", "id2"), ("id_1", "id_2"),
    ("source_id", "target_id"), ("src_id", "dst_id"), ("from_id", "to_id"),
)  # fmt: skip


#: Header names of an edge list's first column that say it is not an endpoint (an edge's own id).
EDGE_ID_COLUMNS = ("", "id", "edge", "edge_id", "edgeid", "eid", "index", "idx")
#: Words of an edge list's header names (``user_id``, ``citing``, ``from_node``, ``a``): a first
#: line whose two fields hold none is read as a header all the same, but said (it may be an edge
#: between two nodes no file names).
_HEADER_NAME = re.compile(
    r"(.*_)?(id|ids|node|nodes|vertex|src|dst|source|target|from|to|cit(ing|ed|es)?|user|friend|"
    r"follow(er|ee|s)?|head|tail|item|parent|child|in|out|start|end|left|right|sender|receiver|"
    r"neighbou?r)(_?(id|\d+|[ab]))?|[uvabijxy](_?(id|\d+))?",
    re.IGNORECASE,
)


def _header_like(name: str) -> bool:
    """Whether ``name`` reads as an edge list's column name (:data:`_HEADER_NAME`)."""
    return _HEADER_NAME.fullmatch(name.strip()) is not None or name.strip().lower() in EDGE_ID_COLUMNS


def _endpoint_columns(header: list[str]) -> tuple[int, int]:
    """The endpoint columns an edge list's header line names, where they are not its first two:
    a pair of :data:`ENDPOINT_COLUMNS` once the header's first two names show they are not the
    endpoints (the first is an edge id or pandas' unnamed index, or one of the two is an endpoint
    name in another place: ``weight,src,dst``); else the first two (``a,b,from,to`` keeps ``a``
    and ``b``: ``from`` and ``to`` may be times)."""
    names = [h.strip().lower() for h in header]
    pairs = [(names.index(a), names.index(b)) for a, b in ENDPOINT_COLUMNS if a in names and b in names]
    if (0, 1) in pairs:
        return 0, 1
    ends = {name for pair in ENDPOINT_COLUMNS for name in pair}
    if pairs and (names[0] in EDGE_ID_COLUMNS or names[0] in ends or names[1] in ends):
        return min(pairs)
    if len(names) >= 3 and not names[0]:  # pandas' unnamed index, its columns named otherwise
        return 1, 2
    return 0, 1


def _read_edges(path: Path, index: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
    src: list[int] = []
    dst: list[int] = []
    ia, ib = 0, 1
    for k, (line, row) in enumerate(_edge_rows(path)):
        if len(row) <= max(ia, ib):
            raise FileGraphError(path, f"an edge line needs two node ids{_separator_hint(row)}", line)
        _single_line(path, line, row[ia], row[ib])
        a, b = _canonical(row[ia]), _canonical(row[ib])
        if a not in index or b not in index:
            if k == 0 and a not in index and b not in index and not (_is_int(a) and _is_int(b)):
                ia, ib = _endpoint_columns(row)  # a header line: neither field names a node
                if not any(_header_like(h) for h in row[:2]):
                    # "ghost_a,ghost_b": a header of unusual names, or an edge between two nodes
                    # no file names; either way, said
                    log.warning(
                        "%s: line %d (%s) read as a header: neither field is a node of the "
                        "features or labels file",
                        path.name, line, ",".join(row[:4]),
                    )  # fmt: skip
                continue
            unknown = a if a not in index else b
            hint = (
                " (an integer id written as a float: write it as the integer)"
                if _is_integral(unknown) and not _is_int(unknown)
                else _separator_hint([unknown])
                if any(c in unknown for c in ";|")  # "0; 1"
                else (" (an empty field)" if not unknown else "")
            )
            raise FileGraphError(
                path, f"node {unknown!r} is in neither the features nor the labels file{hint}", line
            )
        src.append(index[a])
        dst.append(index[b])
    if not src:
        raise FileGraphError(path, "no edge lines: a graph needs at least one edge")
    return np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)


def read_owners(
    path: Path, names: list[str], id_column: str | None = None, owner_column: str | None = None
) -> tuple[np.ndarray, list[str]]:
    """Each node's party from a CSV (``partition --owners``): where the graph's nodes already
    are, rather than where a partitioner would put them.

    Args:
        path (Path): a CSV with a header line, one node a line.
        names (list[str]): node ``i``'s id as the graph's files name it (``data.node_names``;
            ``"0".."N-1"`` for a graph without names).
        id_column (str, optional): the node id's column; default the one column named ``id``,
            ``node`` or ``node_id``, in any case, else the first. (default: :obj:`None`)
        owner_column (str, optional): the party's column; default the other of two columns.
            (default: :obj:`None`)

    Returns:
        ``(owner, parties)``: ``owner`` ``[N]`` int64, party ``owner[i]`` holding node ``i``;
        ``parties[p]`` the file's name of party ``p``. Integer parties are party ids, which must
        be ``0..P-1``; other names are numbered in sorted order.

    Raises:
        FileGraphError: naming the file and line: no header, an unknown column, a node the graph
            does not have or named twice, a node of the graph without a party, integer parties
            with a gap.
    """
    if path.is_dir():
        raise FileGraphError(path, "is a folder; --owners takes a CSV file")
    if not path.is_file():
        raise FileGraphError(path, "no such owners file")
    rows = _rows(path)
    first = next(rows, None)
    if first is None:
        raise FileGraphError(path, "empty owners file")
    _, header = first
    lowered = [h.strip().lower() for h in header]

    def column(name: str | None, default: int | None, flag: str) -> int:
        if name is None:
            if default is None:
                raise FileGraphError(
                    path,
                    f"{len(header)} columns ({', '.join(header)}): name the party's with {flag}"
                    f"{_separator_hint(header)}",
                    1,
                )
            return default
        if name not in header:
            raise FileGraphError(
                path, f"no column {name!r} (columns: {', '.join(header)}){_separator_hint(header)}", 1
            )
        return header.index(name)

    named = [i for i, h in enumerate(lowered) if h in ID_COLUMN_NAMES]
    id_col = column(id_column, named[0] if len(named) == 1 else 0, "--owner-id-column")
    owner_col = column(owner_column, 1 - id_col if len(header) == 2 else None, "--owner-column")
    if id_col == owner_col:
        raise FileGraphError(path, f"node id and party are the same column {header[id_col]!r}", 1)
    index = {_canonical(n): i for i, n in enumerate(names)}
    if _canonical(header[id_col]) in index:  # "7,hospital-a": a first data line, not names
        raise FileGraphError(path, "the owners file needs a header line naming its columns", 1)
    owner_of: dict[int, str] = {}
    line_of: dict[int, int] = {}
    for line, row in rows:
        if len(row) != len(header):
            raise FileGraphError(path, f"{len(row)} fields, the header has {len(header)}", line)
        _single_line(path, line, row[id_col], row[owner_col])
        node, party = _canonical(row[id_col]), row[owner_col]
        if node not in index:
            raise FileGraphError(path, f"node {row[id_col]!r} is not a node of the graph", line)
        if not party:
            raise FileGraphError(path, f"node {row[id_col]!r} has no party", line)
        i = index[node]
        if i in owner_of:
            raise FileGraphError(path, f"node {row[id_col]!r} is on line {line_of[i]} too", line)
        owner_of[i], line_of[i] = party, line
    if len(owner_of) < len(names):
        absent = [names[i] for i in range(len(names)) if i not in owner_of]
        shown = ", ".join(repr(a) for a in absent[:5]) + (", ..." if len(absent) > 5 else "")
        reason = (
            f"{len(absent)} of the graph's {len(names)} nodes have no party ({shown}): every node needs one"
        )
        raise FileGraphError(path, reason)
    values = list(owner_of.values())
    if all(_is_int(v) for v in values):
        ids = sorted({int(v) for v in values})
        if ids[0] < 0:
            party = str(ids[0])
            line = line_of[next(i for i, p in owner_of.items() if _is_int(p) and int(p) == ids[0])]
            raise FileGraphError(path, f"party {party}: integer parties are party ids 0..P-1", line)
        if ids != list(range(len(ids))):
            gap = next(i for i in range(len(ids) + 1) if i not in set(ids))
            raise FileGraphError(
                path, f"integer parties are party ids 0..P-1, and no node is in party {gap}: renumber them"
            )
        parties = [str(i) for i in ids]
        number = {v: int(v) for v in set(values)}
    else:
        parties = sorted(set(values))
        number = {p: i for i, p in enumerate(parties)}
    owner = np.empty(len(names), dtype=np.int64)
    for i, party in owner_of.items():
        owner[i] = number[party]
    return owner, parties
