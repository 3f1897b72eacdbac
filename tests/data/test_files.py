"""A user's graph as plain files (edge-list CSV, CSV / JSON / npz features, label CSV) and npz graphs."""

from __future__ import annotations

import json
import pickle
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from retexo_fl.data.datasets import DatasetError, load_dataset
from retexo_fl.data.edges import undirected_coalesced
from retexo_fl.data.files import _EDGE_COMMENT, FileGraphError, load_files_graph
from retexo_fl.data.partition import PartitionError

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "datasets"

# A 5-node graph built in memory: what the files below describe.
X = torch.tensor([[1, 0, 0, 1], [0, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 0], [0, 0, 1, 0]], dtype=torch.float32)
Y = torch.tensor([1, 0, -1, 1, 0])  # node 2 unlabeled
EDGES = [(0, 1), (1, 2), (2, 3), (3, 0), (3, 4), (1, 0)]  # (1, 0) repeats (0, 1) the other way


def _write(folder: Path, features: str = "json") -> str:
    (folder / "edges.csv").write_text("from,to\n" + "".join(f"{a},{b}\n" for a, b in EDGES))
    # Labels as categories (False/True), an extra column, ids not in order, one label left empty.
    rows = [(i, ["False", "True"][int(y)] if y >= 0 else "") for i, y in enumerate(Y.tolist())]
    (folder / "target.csv").write_text(
        "views,mature,new_id\n" + "".join(f"{100 + i},{lab},{i}\n" for i, lab in reversed(rows))
    )
    if features == "json":
        bag = {str(i): [j for j in range(4) if X[i, j]] for i in range(5)}
        (folder / "features.json").write_text(json.dumps(bag))
    elif features == "csv":
        lines = [f"{i}," + ",".join(str(float(v)) for v in X[i].tolist()) for i in range(5)]
        (folder / "features.csv").write_text("id,a,b,c,d\n" + "\n".join(lines) + "\n")
    else:
        np.savez(folder / "features.npz", x=X.numpy())
    return (
        f"files:edges={folder / 'edges.csv'},features={folder / ('features.' + features)},"
        f"labels={folder / 'target.csv'},id-column=new_id,label-column=mature"
    )


@pytest.mark.parametrize("features", ["json", "csv", "npz"])
def test_plain_files_load_equal_to_the_graph_built_in_memory(tmp_path, features):
    data = load_files_graph(_write(tmp_path, features)[len("files:") :])
    expected = undirected_coalesced(torch.tensor(EDGES).t(), 5)
    assert torch.equal(data.x, X)
    assert torch.equal(data.y, Y)
    assert torch.equal(data.edge_index, expected)
    assert data.edge_index.size(1) == 10  # 5 undirected edges, the repeat merged


@pytest.mark.parametrize("header", ["id,label", "label,id", "class,Node_ID", "node,y"])
def test_the_id_column_of_two_is_the_one_named_as_ids_are(tmp_path, header):
    # Without id-column: the column named id / node / node_id (any case), else the first; the
    # label is the other. "label,id" read its classes as node ids before (a "labelled twice" error).
    spec = _write(tmp_path, "csv").split(",id-column=")[0]
    first, second = header.split(",")
    id_first = first.lower() in ("id", "node", "node_id") or second.lower() not in ("id", "node", "node_id")
    rows = [(str(i), str(int(y)) if y >= 0 else "") for i, y in enumerate(Y.tolist())]
    lines = [f"{i},{lab}" if id_first else f"{lab},{i}" for i, lab in rows]
    (tmp_path / "target.csv").write_text(header + "\n" + "\n".join(lines) + "\n")
    data = load_files_graph(spec[len("files:") :])
    assert torch.equal(data.y, Y)
    assert torch.equal(data.x, X)


@pytest.mark.parametrize(
    "head, sep",
    [
        ("", ","),
        ("# Directed graph: edges.txt\n# Nodes: 5 Edges: 6\n# FromNodeId\tToNodeId\n", "\t"),  # SNAP
        ("% sym unweighted\n", " "),  # KONECT
        ("#\n", "  "),  # networkx's write_edgelist separates by one space; two read the same
    ],
)
def test_edge_lists_as_snap_and_konect_write_them_load_equal(tmp_path, head, sep):
    spec = _write(tmp_path)
    (tmp_path / "edges.csv").write_text(head + "".join(f"{a}{sep}{b}{sep}1.0\n" for a, b in EDGES))
    data = load_files_graph(spec[len("files:") :])
    assert torch.equal(data.edge_index, undirected_coalesced(torch.tensor(EDGES).t(), 5))
    # A first edge from a node whose id starts with '#' (a hashtag) is an edge, not a comment.
    assert _EDGE_COMMENT.match("#tag") is None and _EDGE_COMMENT.match("# x") and _EDGE_COMMENT.match("#")


@pytest.mark.parametrize("sep", [",", "\t"])
def test_comment_lines_inside_an_edge_list_are_skipped(tmp_path, sep):
    # Two lists concatenated, the second's header inside: "# ..." was blamed on separators.
    spec = _write(tmp_path)
    lines = [f"{a}{sep}{b}\n" for a, b in EDGES]
    (tmp_path / "edges.csv").write_text(
        "".join(lines[:3]) + "# second file, edges\n% more\n" + "".join(lines[3:])
    )
    data = load_files_graph(spec[len("files:") :])
    assert torch.equal(data.edge_index, undirected_coalesced(torch.tensor(EDGES).t(), 5))


def test_an_edge_list_that_mixes_separators_names_the_line(tmp_path):
    spec = _write(tmp_path)
    (tmp_path / "edges.csv").write_text("# a comment\n0 1\n1,2\n")
    _expect(spec, "edges.csv:3:", "an edge line needs two node ids")


@pytest.mark.parametrize(
    "text",
    [
        # networkx's write_edgelist(data=True), two attributes: a comma inside the dict
        "".join(f"{a} {b} {{'weight': 3, 'color': 'red'}}\n" for a, b in EDGES),
        # a quote in a comment cannot open a CSV field that swallows the file
        '# from ,"x\n' + "".join(f"{a},{b}\n" for a, b in EDGES),
        "".join(f"{a},{b}\r\n" for a, b in EDGES),  # Windows line ends
    ],
)
def test_edge_lists_with_attributes_quotes_in_comments_or_crlf_load_equal(tmp_path, text):
    spec = _write(tmp_path)
    (tmp_path / "edges.csv").write_text(text, newline="")
    data = load_files_graph(spec[len("files:") :])
    assert torch.equal(data.edge_index, undirected_coalesced(torch.tensor(EDGES).t(), 5))


def test_a_node_named_like_a_comment_mark_is_an_edge_end_not_a_comment():
    assert _EDGE_COMMENT.match("%a,b") is None and _EDGE_COMMENT.match("#,b") is None
    assert _EDGE_COMMENT.match("% sym unweighted") and _EDGE_COMMENT.match("#")


def test_a_repeated_label_row_that_agrees_is_read_once(tmp_path):
    # As in MUSAE's Twitch FR target file: one node's row twice, its label the same.
    spec = _write(tmp_path)
    labels = tmp_path / "target.csv"
    labels.write_text(labels.read_text() + "999,True,3\n")
    data = load_files_graph(spec[len("files:") :])
    assert torch.equal(data.y, Y)


def test_loader_errors_survive_a_process_boundary():
    # Bench workers and Ray actors pickle what they raise: the error must come back whole.
    err = FileGraphError("labels.csv", "node '3' labelled twice", 7)
    back = pickle.loads(pickle.dumps(err))
    assert (type(back), str(back), back.path, back.line, back.reason) == (
        FileGraphError,
        "labels.csv:7: node '3' labelled twice",
        "labels.csv",
        7,
        "node '3' labelled twice",
    )
    part = pickle.loads(pickle.dumps(PartitionError("part-0", "x", "bad shape")))
    assert (str(part), part.field) == ("part-0: field 'x': bad shape", "x")


def test_a_files_graph_runs_through_load_dataset_with_a_split(tmp_path):
    data = load_dataset(_write(tmp_path), split="random:0.6,0.2,0.2", seed=0)
    assert data.name == "edges"
    labelled = data.train_mask | data.val_mask | data.test_mask
    assert not labelled[2] and int(labelled.sum()) == 4  # the unlabeled node is in no split


def _expect(spec: str, *fragments: str) -> None:
    with pytest.raises(FileGraphError) as err:
        load_dataset(spec, split="random:0.6,0.2,0.2")
    for f in fragments:
        assert f in str(err.value), str(err.value)
    assert isinstance(err.value, DatasetError)


def _files(folder: Path, edges: str, features: str, labels: str) -> str:
    """A ``files:`` spec's body for ``e.csv``, ``x.csv`` and ``y.csv`` in ``folder``, written."""
    for name, text in (("e.csv", edges), ("x.csv", features), ("y.csv", labels)):
        (folder / name).write_text(text)
    return f"edges={folder / 'e.csv'},features={folder / 'x.csv'},labels={folder / 'y.csv'}"


def test_malformed_files_fail_naming_the_file_and_line(tmp_path):
    spec = _write(tmp_path)
    edges = tmp_path / "edges.csv"
    edges.write_text("from,to\n0,1\n1,9\n")
    _expect(spec, f"{edges}:3", "'9'")
    edges.write_text("from,to\n0,1\n2\n")
    _expect(spec, f"{edges}:3", "two node ids")
    _write(tmp_path)
    labels = tmp_path / "target.csv"
    labels.write_text("views,mature,new_id\n1,True,0\n2,False\n")
    _expect(spec, f"{labels}:3", "2 fields")
    labels.write_text("views,mature,new_id\n1,True,0\n2,False,0\n")
    _expect(spec, f"{labels}:3", "labelled twice", "'True' on line 2 and 'False'")
    labels.write_text("a,b,c\n1,2,3\n")
    _expect(spec.replace(",id-column=new_id,label-column=mature", ""), str(labels), "label-column=NAME")
    _write(tmp_path)
    feats = tmp_path / "features.json"
    feats.write_text('{"0": [1, 2],\n "1": [oops]}')
    _expect(spec, f"{feats}:2", "invalid JSON")
    feats.write_text('{"0": [1, -2]}')
    _expect(spec, str(feats), "node '0'", "negative")
    _expect(spec.replace("features.json", "features.parquet"), "features.parquet", "no such features file")
    _expect("files:edges=a.csv", "missing features, labels")


def test_the_twitch_files_load_as_users_bring_them(tmp_path):
    src = SHARED / "Twitch" / "PTBR"
    if not src.is_dir():
        pytest.skip("the shared Twitch files are not beside the project")
    shutil.copytree(src, tmp_path / "PTBR")
    base = tmp_path / "PTBR" / "musae_PTBR"
    data = load_dataset(
        f"files:edges={base}_edges.csv,features={base}_features.json,labels={base}_target.csv,"
        "id-column=new_id,label-column=mature",
        split="random:0.6,0.2,0.2",
    )
    # Upstream's README: 1,912 nodes and 31,299 friendships; mature is False/True.
    assert data.num_nodes == 1912 and data.edge_index.size(1) == 2 * 31299
    assert set(data.y.tolist()) == {0, 1}
    rows = (tmp_path / "PTBR" / "musae_PTBR_target.csv").read_text().splitlines()[1:]
    first = rows[0].split(",")  # id,days,mature,views,partner,new_id
    assert int(data.y[int(first[5])]) == (first[2] == "True")
    bag = json.loads((tmp_path / "PTBR" / "musae_PTBR_features.json").read_text())
    assert torch.equal(data.x[7].nonzero().view(-1), torch.tensor(sorted(set(bag["7"]))))


def test_a_heterophilous_npz_loads_with_its_ten_splits(tmp_path):
    src = SHARED / "heterophilous-npz" / "chameleon_filtered.npz"
    if not src.is_file():
        pytest.skip("the shared npz graphs are not beside the project")
    path = tmp_path / "chameleon_filtered.npz"
    shutil.copy(src, path)
    raw = np.load(path)
    data = load_dataset(str(path), split="public", split_index=3)
    assert data.name == "chameleon_filtered" and data.num_nodes == 890
    assert torch.equal(data.x, torch.from_numpy(raw["node_features"]))
    assert torch.equal(data.train_mask, torch.from_numpy(raw["train_masks"][3]))
    assert data.edge_index.size(1) == 2 * len(
        {tuple(sorted(e)) for e in raw["edges"].tolist() if e[0] != e[1]}
    )
    np.savez(tmp_path / "broken.npz", node_features=raw["node_features"], edges=raw["edges"])
    _expect(str(tmp_path / "broken.npz"), "broken.npz", "node_labels")


def test_a_byte_order_mark_is_not_read_as_part_of_the_first_field(tmp_path):
    # Spreadsheet exports start with one: read as text, line 1's "\ufeff0" was no node id, so a
    # headerless edge list lost its first edge as a "header", and a named id column was missing.
    spec = _write(tmp_path)
    edges = tmp_path / "edges.csv"
    edges.write_text("".join(f"{a},{b}\n" for a, b in EDGES), encoding="utf-8-sig")
    labels = tmp_path / "target.csv"
    labels.write_text(labels.read_text(), encoding="utf-8-sig")
    feats = tmp_path / "features.json"
    feats.write_text(feats.read_text(), encoding="utf-8-sig")
    data = load_files_graph(spec[len("files:") :])
    assert torch.equal(data.edge_index, undirected_coalesced(torch.tensor(EDGES).t(), 5))
    assert torch.equal(data.y, Y) and torch.equal(data.x, X)


def test_integer_ids_are_one_node_whatever_each_file_spells_them(tmp_path):
    spec = _write(tmp_path, "csv")
    feats = tmp_path / "features.csv"
    lines = feats.read_text().splitlines()
    feats.write_text("\n".join([lines[0], *(f"0{line}" for line in lines[1:])]) + "\n")  # 00, 01 ...
    data = load_files_graph(spec[len("files:") :])
    assert torch.equal(data.x, X) and torch.equal(data.y, Y)


# Each case: (file to write, its text, fragments the error must hold). The files are those of
# ``_write(tmp_path, "csv")``; every case was a silent wrong load, a traceback, or an error that
# named another file before the loader checked it.
MALFORMED_TEXT = {
    "edges line 1 with a typo is not a header": (
        "edges.csv",
        "0,1a\n1,2\n",
        ["edges.csv:1", "'1a'"],
    ),
    "edges that hold only a header": ("edges.csv", "from,to\n", ["edges.csv", "no edge lines"]),
    # Tabs and spaces are edge-list separators (SNAP); semicolons are not.
    "edges separated by semicolons": ("edges.csv", "0;1\n1;2\n", ["edges.csv:1", "separated by semicolons"]),
    "labels without a header, class names": (
        "target.csv",
        "0,dog\n1,cat\n",
        ["target.csv:1", "needs a header line"],
    ),
    "labels separated by semicolons": (
        "target.csv",
        "new_id;mature\n0;1\n",
        ["target.csv:1", "separated by semicolons"],
    ),
    "a label past any class count": (
        "target.csv",
        "new_id,mature\n0,1\n1,100000000000000000000000\n",
        ["target.csv:3", "class indices"],
    ),
    "one node twice in two spellings": (
        "target.csv",
        "new_id,mature\n7,1\n07,0\n0,1\n",
        ["target.csv:3", "'7' on line 2 and '07' are the same number"],
    ),
    "a node with two feature rows": (
        "features.csv",
        "id,a,b,c,d\n0,1,0,0,1\n1,0,1,0,0\n1,7,7,7,7\n",
        ["features.csv:4", "node '1' has a feature row on line 3 too"],
    ),
    "a feature matrix without its id column": (
        "features.csv",
        "a,b,c,d\n1.5,0,0,1\n0.5,1,0,0\n",
        ["features.csv:2", "'1.5' is a name", "first column is the node id"],
    ),
    "a bag of ids naming one node twice": (
        "features.json",
        '{"0": [1], "1": [2], "0": [3]}',
        ["features.json", "node '0' has two feature lists"],
    ),
    "a bag of ids with a stray feature id": (
        "features.json",
        '{"0": [1], "3": [1099511627776]}',
        ["features.json", "node '3'", "feature id 1099511627776"],
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED_TEXT))
def test_each_malformed_file_fails_naming_it_rather_than_loading_wrong(tmp_path, case):
    name, text, fragments = MALFORMED_TEXT[case]
    spec = _write(tmp_path, "json" if name.endswith(".json") else "csv")
    if name.endswith(".json"):
        spec = spec.replace(",id-column=new_id,label-column=mature", "")
        (tmp_path / "target.csv").write_text(
            "new_id,mature\n" + "".join(f"{i},{int(v)}\n" for i, v in enumerate(Y.tolist()))
        )
    elif name == "target.csv":
        spec = spec.replace(",id-column=new_id,label-column=mature", "")
    (tmp_path / name).write_text(text)
    _expect(spec, *(str(tmp_path / f) if f.endswith(".csv") or f.endswith(".json") else f for f in fragments))


def _npz(folder: Path, **arrays: np.ndarray) -> str:
    base = {
        "node_features": np.eye(4, dtype=np.float32),
        "node_labels": np.array([0, 1, 0, 1]),
        "edges": np.array([[0, 1], [1, 2], [2, 3]]),
        "train_masks": np.array([[1, 1, 0, 0]], dtype=bool),
        "val_masks": np.array([[0, 0, 1, 0]], dtype=bool),
        "test_masks": np.array([[0, 0, 0, 1]], dtype=bool),
    }
    path = folder / "graph.npz"
    np.savez(path, **{**base, **arrays})
    return str(path)


@pytest.mark.parametrize(
    ("arrays", "fragment"),
    [
        (
            {"node_features": np.array([[np.nan, 0.0]] * 4, dtype=np.float32)},
            "node_features: a value is not finite",
        ),
        ({"node_labels": np.array(["a", "b", "a", "b"])}, "node_labels must be numbers"),
        ({"node_labels": np.array([0, 1.7, 0, 1])}, "node_labels must be integers, got 1.7"),
        ({"node_labels": np.array([0, 1, 0, 10**9])}, "class indices"),
        ({"edges": np.array([[0, 1.6]])}, "edges must be integers"),
        ({"train_masks": np.full((1, 4), 0.5)}, "train_masks must hold booleans (or 0 / 1)"),
    ],
    ids=["nan-features", "string-labels", "fractional-label", "huge-label", "fractional-edge", "float-mask"],
)
def test_an_npz_graphs_arrays_are_checked_before_they_are_cast(tmp_path, arrays, fragment):
    # Each was cast silently (1.7 -> 1, NaN features then "training diverged") or raised numpy's own error.
    path = _npz(tmp_path, **arrays)
    with pytest.raises(FileGraphError, match=re.escape(fragment)) as err:
        load_dataset(path, split="public")
    assert str(err.value).startswith(path)


def test_an_npz_object_array_is_refused_naming_the_array(tmp_path):
    path = tmp_path / "graph.npz"
    np.savez(
        path,
        node_features=np.eye(4, dtype=np.float32),
        node_labels=np.array([0, "b", 0, 1], dtype=object),
        edges=np.array([[0, 1]]),
    )
    _expect(str(path), str(path), "'node_labels' cannot be read")
    upper = tmp_path / "GRAPH.NPZ"  # the suffix's case does not send it to torch.load
    shutil.copy(_npz(tmp_path), upper)
    assert load_dataset(str(upper), split="public").num_nodes == 4


def test_labels_without_a_header_are_refused_when_their_ids_are_names_too(tmp_path):
    # "alice,1" on line 1 passed as column names, and alice's label was dropped without a word.
    (tmp_path / "e.csv").write_text("alice,bob\nbob,carol\n")
    (tmp_path / "x.csv").write_text("alice,1.0\nbob,0.0\ncarol,0.5\n")
    (tmp_path / "y.csv").write_text("alice,1\nbob,0\ncarol,1\n")
    spec = f"files:edges={tmp_path / 'e.csv'},features={tmp_path / 'x.csv'},labels={tmp_path / 'y.csv'}"
    _expect(spec, f"{tmp_path / 'y.csv'}:1", "'alice', a node of the features file")
    (tmp_path / "y.csv").write_text("name,label\nalice,1\nbob,0\ncarol,1\n")
    assert load_files_graph(spec[len("files:") :]).y.tolist() == [1, 0, 1]


def test_integer_labels_written_as_floats_stay_class_indices(tmp_path):
    # pandas writes an integer column with a gap as floats: "-1.0" was a class of its own, and
    # the classes were numbered as text ("10.0" before "2.0").
    spec = _write(tmp_path).replace(",id-column=new_id,label-column=mature", "")
    (tmp_path / "target.csv").write_text("id,label\n0,10.0\n1,2.0\n2,-1.0\n3,10.0\n4,\n")
    assert load_files_graph(spec[len("files:") :]).y.tolist() == [10, 2, -1, 10, -1]


def test_a_feature_header_of_number_names_is_not_a_node(tmp_path):
    # pandas writes a frame's column names 0, 1, ...: "name,0,1" read as a node "name", and the
    # labels file (header "name,label") was blamed for having no header.
    (tmp_path / "e.csv").write_text("alice,bob\nbob,carol\n")
    (tmp_path / "x.csv").write_text("name,0,1\nalice,1.0,0\nbob,0.0,1\ncarol,0.5,0.5\n")
    (tmp_path / "y.csv").write_text("name,label\nalice,1\nbob,0\ncarol,1\n")
    spec = f"edges={tmp_path / 'e.csv'},features={tmp_path / 'x.csv'},labels={tmp_path / 'y.csv'}"
    data = load_files_graph(spec)
    assert data.num_nodes == 3 and data.x.tolist() == [[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]]


def test_missing_value_tokens_in_a_labels_file_are_unlabeled(tmp_path, caplog):
    # R's NA, pandas' nan and -1 in a column of names each became a class of its own, and one
    # "unknown" among integer classes renumbered them in string order.
    (tmp_path / "e.csv").write_text("a,b\nb,c\nc,d\nd,e\n")
    (tmp_path / "x.csv").write_text("id,f\na,1\nb,0\nc,1\nd,0\ne,1\n")
    (tmp_path / "y.csv").write_text("id,label\na,cat\nb,NA\nc,dog\nd,nan\ne,-1\n")
    spec = f"edges={tmp_path / 'e.csv'},features={tmp_path / 'x.csv'},labels={tmp_path / 'y.csv'}"
    assert load_files_graph(spec).y.tolist() == [0, -1, 1, -1, -1]
    (tmp_path / "y.csv").write_text("id,label\na,10\nb,NaN\nc,2\nd,null\ne,0\n")
    with caplog.at_level("WARNING", logger="retexo_fl.data.files"):
        assert load_files_graph(spec).y.tolist() == [10, -1, 2, -1, 0]
    # Said, counted by token: a class that is named NA (a continent) would vanish otherwise.
    assert "1 label(s) 'NaN', 1 label(s) 'null' read as unlabeled" in caplog.text
    (tmp_path / "y.csv").write_text("id,label\na,none\nb,mild\nc,severe\nd,none\ne,mild\n")
    assert load_files_graph(spec).y.tolist() == [1, 0, 2, 1, 0]  # "none" is a class name


def test_a_features_csv_first_row_with_a_blank_is_an_error_not_a_header(tmp_path):
    # Taken for a header, node a's row was dropped and its features read as zeros.
    (tmp_path / "e.csv").write_text("a,b\nb,c\n")
    (tmp_path / "y.csv").write_text("id,label\na,0\nb,1\nc,0\n")
    spec = f"files:edges={tmp_path / 'e.csv'},features={tmp_path / 'x.csv'},labels={tmp_path / 'y.csv'}"
    for missing in ("", "NA"):
        (tmp_path / "x.csv").write_text(f"a,1.0,{missing},2.0\nb,0.0,1.0,1.0\nc,1.0,1.0,0.0\n")
        _expect(spec, f"{tmp_path / 'x.csv'}:1", "non-numeric feature value")
    # Column names still read as a header, numbered ones among them; so does pandas' to_csv
    # header (an unnamed index).
    for header in ("id,f0,f1,f2", ",0,1,2", "node,degree,0,1", "id,inf_rate,nan_count,inf"):
        (tmp_path / "x.csv").write_text(f"{header}\na,1.0,0.5,2.0\nb,0.0,1.0,1.0\nc,1.0,1.0,0.0\n")
        data = load_files_graph(spec[len("files:") :])
        assert data.x[0].tolist() == [1.0, 0.5, 2.0] and data.num_nodes == 3


def test_ids_that_differ_between_the_files_are_said(tmp_path, caplog):
    # 1-based ids against an npz's rows 0..N-1 shifted every feature row by a node, silently.
    np.savez(tmp_path / "x.npz", x=np.eye(3, dtype=np.float32))
    (tmp_path / "e.csv").write_text("1,2\n2,3\n")
    (tmp_path / "y.csv").write_text("id,label\n1,0\n2,1\n3,0\n")
    spec = f"edges={tmp_path / 'e.csv'},features={tmp_path / 'x.npz'},labels={tmp_path / 'y.csv'}"
    with caplog.at_level("WARNING", logger="retexo_fl.data.files"):
        data = load_files_graph(spec)
    assert data.num_nodes == 4
    said = "of 4 nodes, 1 have no feature row (their features are zeros) and 1 no line in y.csv"
    assert said in caplog.text
    caplog.clear()
    (tmp_path / "e.csv").write_text("0,1\n1,2\n")
    (tmp_path / "y.csv").write_text("id,label\n0,0\n1,1\n2,0\n")
    with caplog.at_level("WARNING", logger="retexo_fl.data.files"):
        load_files_graph(spec)
    assert "no feature row" not in caplog.text


def test_a_folder_or_one_csv_given_for_a_graph_points_at_the_files_form(tmp_path):
    (tmp_path / "e.csv").write_text("0,1\n")
    (tmp_path / "y.csv").write_text("id,label\n0,0\n1,1\n")
    spec = f"files:edges={tmp_path / 'e.csv'},features={tmp_path},labels={tmp_path / 'y.csv'}"
    _expect(spec, str(tmp_path), "is a folder; the features file is wanted")  # was "no such file"
    with pytest.raises(DatasetError, match=re.escape("files:edges=E.csv,features=F,labels=L.csv")):
        load_dataset(str(tmp_path / "e.csv"), split="random:0.6,0.2,0.2")


def test_one_table_given_as_features_and_labels_does_not_feed_the_label_in(tmp_path, caplog):
    # A bank's one table (id, columns, is_fraud) as both files: the label column was read as a
    # feature, and a model of random labels tested 1.0.
    g = torch.Generator().manual_seed(0)
    n = 60
    y = torch.randint(0, 2, (n,), generator=g)
    feats = torch.rand(n, 2, generator=g)
    rows = "".join(f"{i},{feats[i, 0]:.4f},{int(y[i])},{feats[i, 1]:.4f}\n" for i in range(n))
    (tmp_path / "t.csv").write_text("id,balance,is_fraud,age\n" + rows)
    (tmp_path / "e.csv").write_text("s,t\n" + "".join(f"{i},{(i + 1) % n}\n" for i in range(n)))
    table = tmp_path / "t.csv"
    spec = f"edges={tmp_path / 'e.csv'},features={table},labels={table},label-column=is_fraud"
    with caplog.at_level("WARNING", logger="retexo_fl.data.files"):
        data = load_files_graph(spec)
    assert "column 'is_fraud' is the labels' label column: not read as a feature" in caplog.text
    assert data.x.shape == (n, 2) and torch.allclose(data.x, feats, atol=1e-4)
    assert torch.equal(data.y, y)
    # Class names in the label column: the table loads (it failed as a non-numeric feature).
    named = "".join(
        f"{i},{feats[i, 0]:.4f},{['ok', 'fraud'][int(y[i])]},{feats[i, 1]:.4f}\n" for i in range(n)
    )
    (tmp_path / "t.csv").write_text("id,balance,is_fraud,age\n" + named)
    data = load_files_graph(spec)
    assert data.x.shape == (n, 2) and torch.equal(data.y, 1 - y)  # "fraud" < "ok"
    # A column of text (a site) is a table's other column, not a feature: said, and skipped.
    sited = "".join(f"{i},{feats[i, 0]:.4f},{int(y[i])},{feats[i, 1]:.4f},H-{i % 3}\n" for i in range(n))
    (tmp_path / "t.csv").write_text("id,balance,is_fraud,age,site\n" + sited)
    with caplog.at_level("WARNING", logger="retexo_fl.data.files"):
        data = load_files_graph(spec)
    assert "column 'site' holds text ('H-0' on line 2): not read as a feature" in caplog.text
    assert torch.allclose(data.x, feats, atol=1e-4)
    # The label as a table's only value column leaves no feature: said, not a PyTorch error later.
    (tmp_path / "t.csv").write_text("id,is_fraud\n" + "".join(f"{i},{int(y[i])}\n" for i in range(n)))
    _expect("files:" + spec, f"{tmp_path / 't.csv'}: no feature columns")


def test_a_graph_without_node_features_is_refused_naming_the_file(tmp_path):
    # {} (or only empty lists) loaded as [N, 0] features, and training failed on an
    # uninitialized lazy parameter, naming no file.
    (tmp_path / "e.csv").write_text("0,1\n1,2\n")
    (tmp_path / "y.csv").write_text("id,label\n0,0\n1,1\n2,0\n")
    spec = f"files:edges={tmp_path / 'e.csv'},features={tmp_path / 'x.json'},labels={tmp_path / 'y.csv'}"
    for text in ("{}", '{"0": [], "1": []}'):
        (tmp_path / "x.json").write_text(text)
        _expect(spec, f"{tmp_path / 'x.json'}: no feature columns", "a column of ones")


@pytest.mark.parametrize(
    "text",
    [
        "edge_id,source,target\n0,0,1\n1,1,2\n2,2,3\n3,3,0\n4,3,4\n",  # endpoints named, not first
        ",source,target\n0,0,1\n1,1,2\n2,2,3\n3,3,0\n4,3,4\n",  # pandas' to_csv with its index
        "weight,Src,Dst\n0.5,0,1\n0.5,1,2\n1,2,3\n1,3,0\n2,3,4\n",
        # from and to may be a validity's years: the first two columns stay the endpoints.
        "a,b,from,to\n0,1,2,3\n1,2,0,3\n2,3,1,2\n3,0,1,3\n3,4,2,3\n",
    ],
    ids=["named-columns", "pandas-index", "any-case", "first-two-kept"],
)
def test_an_edge_lists_endpoint_columns_are_the_ones_its_header_names(tmp_path, text):
    # Read as its first two columns: (edge id, source), a wrong graph, silently; and a header
    # naming a pair elsewhere must not move endpoints that are the first two.
    spec = _write(tmp_path, "csv")
    (tmp_path / "edges.csv").write_text(text)
    data = load_files_graph(spec[len("files:") :])
    want = undirected_coalesced(torch.tensor([(0, 1), (1, 2), (2, 3), (3, 0), (3, 4)]).t(), 5)
    assert torch.equal(data.edge_index, want)


def test_an_edge_list_of_self_loops_only_is_refused(tmp_path):
    spec = _write(tmp_path, "csv")
    (tmp_path / "edges.csv").write_text("a,b\n0,0\n3,3\n")
    _expect(spec, f"{tmp_path / 'edges.csv'}: its 2 edge line(s) are all self loops")


def test_labels_that_name_no_node_of_the_features_are_refused(tmp_path):
    # Twitch's target file without id-column=new_id: its "id" column (other ids) matched no
    # feature row, and every labelled node was an isolated zero-feature node, with a warning.
    spec = _write(tmp_path, "csv").replace(",id-column=new_id", ",id-column=views")
    _expect(spec, f"{tmp_path / 'target.csv'}: none of its 5 node ids (column 'views'", "id-column=NAME")


def test_compressed_and_float_id_files_say_what_they_are(tmp_path):
    import gzip

    spec = _write(tmp_path, "csv")
    plain = (tmp_path / "edges.csv").read_bytes()
    (tmp_path / "edges.csv").write_bytes(gzip.compress(plain))
    _expect(spec, f"{tmp_path / 'edges.csv'}: not UTF-8 text", "gzip-compressed: decompress it first")
    (tmp_path / "edges.csv").write_text("from,to\n0.0,1.0\n")
    _expect(spec, "node '0.0' is in neither", "an integer id written as a float")


def test_a_question_mark_is_unlabeled_and_a_word_among_integer_labels_is_an_error(tmp_path):
    spec = _files(tmp_path, "0,1\n1,2\n2,3\n", "id,a\n0,1\n1,2\n2,3\n3,4\n", "id,label\n0,1\n1,0\n2,?\n3,1\n")
    assert load_files_graph(spec).y.tolist() == [1, 0, -1, 1]
    # Read as names, "unknown" made every class a name numbered in string order (1, 10, 2).
    (tmp_path / "y.csv").write_text("id,label\n0,1\n1,10\n2,unknown\n3,2\n")
    _expect("files:" + spec, f"{tmp_path / 'y.csv'}:4", "label 'unknown' among integer labels")


def test_an_owners_file_places_each_node_with_its_party(tmp_path):
    from retexo_fl.data.files import read_owners

    names = ["P0", "P1", "P2", "P3"]
    path = tmp_path / "owners.csv"
    path.write_text("site,patient\nnorth,P2\nsouth,P0\nnorth,P1\neast,P3\n")  # the id named, not first
    owner, parties = read_owners(path, names, id_column="patient")
    assert parties == ["east", "north", "south"] and owner.tolist() == [2, 1, 1, 0]
    path.write_text("node,party\n0,1\n1,0\n2,1\n3,0\n")  # integer parties are party ids
    assert read_owners(path, ["0", "1", "2", "3"])[0].tolist() == [1, 0, 1, 0]
    bad = {
        "node,party\n0,1\n1,2\n2,1\n3,2\n": "no node is in party 0",
        "node,party\n0,-1\n1,0\n2,1\n3,0\n": "party -1: integer parties are party ids 0..P-1",
        "node,party\n0,a\n1,b\n2,a\n": "1 of the graph's 4 nodes have no party ('3')",
        "node,party\n0,a\n1,b\n2,a\n3,b\n9,a\n": "node '9' is not a node of the graph",
        "node,party\n0,a\n1,b\n2,a\n3,b\n1,a\n": "node '1' is on line 3 too",
        "0,a\n1,b\n2,a\n3,b\n": "needs a header line",
        "node,party,x\n0,a,1\n": "name the party's with --owner-column",
    }
    for text, fragment in bad.items():
        path.write_text(text)
        with pytest.raises(FileGraphError, match=re.escape(fragment)):
            read_owners(path, ["0", "1", "2", "3"])


def test_a_file_named_npz_that_is_not_one_says_what_it_is(tmp_path):
    # numpy reads any other file as a pickle and answered with advice on allow_pickle.
    (tmp_path / "text.npz").write_text("node,label\n0,1\n")
    np.save(tmp_path / "one.npy", np.eye(3, dtype=np.float32))
    shutil.copy(tmp_path / "one.npy", tmp_path / "one.npz")
    for name, what in (("text.npz", "not a zip archive"), ("one.npz", "a single .npy array")):
        with pytest.raises(FileGraphError, match=re.escape(f"{name}: not an npz file ({what})")):
            load_dataset(str(tmp_path / name), split="random:0.6,0.2,0.2")


def test_named_nodes_beside_an_npz_of_features_say_its_rows_are_the_ids(tmp_path):
    np.savez(tmp_path / "x.npz", x=np.eye(3, dtype=np.float32))
    (tmp_path / "e.csv").write_text("a,b\nb,c\n")
    (tmp_path / "y.csv").write_text("id,label\na,0\nb,1\nc,0\n")
    spec = f"files:edges={tmp_path / 'e.csv'},features={tmp_path / 'x.npz'},labels={tmp_path / 'y.csv'}"
    _expect(spec, f"{tmp_path / 'y.csv'}:2", "x.npz is an npz, whose rows are the integer nodes 0..N-1")


def test_table_columns_are_skipped_only_where_they_cannot_be_features(tmp_path, caplog):
    # A separate labels file: a feature column named like its label column is a feature (a "y"
    # coordinate beside a label named y).
    xy = "id,x,y\n0,1,5\n1,2,6\n2,3,7\n3,4,8\n"
    spec = _files(tmp_path, "0,1\n1,2\n2,3\n", xy, "id,y\n0,a\n1,b\n2,a\n3,b\n")
    assert load_files_graph(spec).x[:, 1].tolist() == [5.0, 6.0, 7.0, 8.0]
    # A word where a column holds numbers is an error naming its line, not a text column dropped.
    (tmp_path / "x.csv").write_text("id,x,z\n0,1,unknown\n1,2,6\n2,3,7\n3,4,8\n")
    _expect("files:" + spec, f"{tmp_path / 'x.csv'}:2", "non-numeric feature value")
    # A column of text through and through is skipped, and said.
    (tmp_path / "x.csv").write_text("id,x,site\n0,1,north\n1,2,south\n2,3,\n3,4,east\n")
    with caplog.at_level("WARNING", logger="retexo_fl.data.files"):
        assert load_files_graph(spec).x.tolist() == [[1.0], [2.0], [3.0], [4.0]]
    assert "column 'site' holds text ('north' on line 2)" in caplog.text


def test_fractional_classes_are_numbered_in_numeric_order(tmp_path):
    # Ratings 1, 2, 3.5, 10 were refused as "words" among integer labels.
    labels = "id,label\n0,10\n1,2\n2,3.5\n3,1\n"
    data = load_files_graph(_files(tmp_path, "0,1\n1,2\n2,3\n", "id,a\n0,1\n1,2\n2,3\n3,4\n", labels))
    assert data.y.tolist() == [3, 1, 2, 0] and data.class_names == ["1", "2", "3.5", "10"]


def test_one_table_whose_id_column_is_not_first_pairs_each_nodes_features_with_its_label(tmp_path):
    """features= and labels= one table, its ids in a later column (named by id-column): the
    features are keyed by that column too, not by the first (here a permutation of the ids)."""
    n = 12
    rows = [(n - 1 - i, i, i % 3) for i in range(n)]  # seq, id, class
    table = "seq,id,f0,f1,f2,label\n" + "".join(
        f"{seq},{i}," + ",".join("1" if c == k else "0" for k in range(3)) + f",c{c}\n" for seq, i, c in rows
    )
    (tmp_path / "t.csv").write_text(table)
    (tmp_path / "e.csv").write_text("".join(f"{i},{(i + 1) % n}\n" for i in range(n)))
    t = tmp_path / "t.csv"
    data = load_files_graph(
        f"edges={tmp_path / 'e.csv'},features={t},labels={t},id-column=id,label-column=label"
    )
    assert data.node_names == [str(i) for i in range(n)]
    # seq stays a feature column (a number the user put there); f0..f2 one-hot the node's class
    assert torch.equal(data.x[:, 1:].argmax(1), data.y)
    assert torch.equal(data.x[:, 0], torch.tensor([float(n - 1 - i) for i in range(n)]))


def test_an_unclosed_quote_fails_naming_its_line_not_the_files_end(tmp_path):
    labels = "id,label\n" + "".join(f"{i},{'red' if i % 2 else 'blue'}\n" for i in range(8))
    bad = labels.replace("5,red", '5,"red')
    edges = "".join(f"{i},{i + 1}\n" for i in range(7))
    feats = "".join(f"{i},{i % 2}.0,1.0\n" for i in range(8))
    _expect(
        "files:" + _files(tmp_path, edges, feats, bad), "y.csv:7: a field runs over several lines", "quote"
    )
    bad_edges = edges.replace("3,4", '3,"4')
    _expect("files:" + _files(tmp_path, bad_edges, feats, labels), "e.csv:4: a field runs over several lines")
    # A quoted field that closes is one field: "4" is node 4.
    data = load_files_graph(_files(tmp_path, edges.replace("3,4", '3,"4"'), feats, labels))
    assert data.edge_index.size(1) == 14
    # Past csv's field limit (a long file after the quote), the error still names the line.
    long_edges = '0,"1\n' + "".join(f"{i},{i + 1}\n" for i in range(1, 7)) * 20000
    _expect(
        "files:" + _files(tmp_path, long_edges, feats, labels), "e.csv:1: malformed CSV", "no quote closes"
    )


def test_a_feature_past_float32_fails_naming_its_line(tmp_path):
    feats = "0,1.0\n1,1e40\n2,0.5\n"
    spec = _files(tmp_path, "0,1\n1,2\n", feats, "id,label\n0,a\n1,b\n2,a\n")
    _expect("files:" + spec, "x.csv:2: feature value 1e+40 does not fit float32")


def test_ids_are_integers_only_as_digits_and_only_a_float_id_gets_the_float_hint(tmp_path, caplog):
    # "1_10" and "11_0" are two nodes (Python's int reads both as 110)
    labels = "id,label\n1_10,a\n11_0,b\nx,a\n"
    data = load_files_graph(_files(tmp_path, "1_10,11_0\n11_0,x\n", "1_10,1.0\n11_0,0.0\nx,1.0\n", labels))
    assert data.node_names == ["11_0", "1_10", "x"] and data.num_nodes == 3
    spec = _files(tmp_path, "0,1\n1,99\n", "0,1.0\n1,0.0\n", "id,label\n0,a\n1,b\n")
    with pytest.raises(FileGraphError) as err:
        load_files_graph(spec)
    assert "node '99' is in neither" in str(err.value) and "float" not in str(err.value)
    _expect(
        "files:" + _files(tmp_path, "0,1\n1,2.0\n", "0,1.0\n1,0.0\n", "id,label\n0,a\n1,b\n"),
        "written as a float",
    )


def test_doubtful_reads_are_said(tmp_path, caplog):
    """Reads that are legal but often a mistake go to the log: integer labels that leave most
    class indices unused (years), a first edge line taken as a header though it names no column
    as headers do, a numbered features header that is not a node."""
    n = 30
    edges = "".join(f"n{i},n{(i + 1) % n}\n" for i in range(n))
    feats = "name,0,1\n" + "".join(f"n{i},{i % 2},1\n" for i in range(n))
    years = "id,year\n" + "".join(f"n{i},{[1999, 2005, 2012][i % 3]}\n" for i in range(n))
    with caplog.at_level("WARNING", logger="retexo_fl.data.files"):
        data = load_files_graph(_files(tmp_path, "ghost_a,ghost_b\n" + edges, feats, years))
    text = caplog.text
    assert "2013 classes for 3 distinct labels" in text
    assert "line 1 (ghost_a,ghost_b) read as a header" in text
    assert "line 1 ('name', then the numbers 0..) read as the header" in text
    assert data.num_nodes == n and "name" not in data.node_names
    caplog.clear()
    with caplog.at_level("WARNING", logger="retexo_fl.data.files"):  # a plain header: nothing said
        load_files_graph(
            _files(
                tmp_path,
                "source,target\n" + edges,
                feats.replace("name,0,1", "id,a,b"),
                years.replace("1999", "0").replace("2005", "1").replace("2012", "2"),
            )
        )
    assert "header" not in caplog.text and "classes" not in caplog.text


def test_a_dataset_that_is_a_folder_or_a_missing_file_says_which_forms_there_are(tmp_path):
    with pytest.raises(DatasetError, match="is a folder, not a dataset name"):
        load_dataset(str(tmp_path))
    with pytest.raises(DatasetError, match="no such file, and not a dataset name"):
        load_dataset(str(tmp_path / "nothere.csv"))
    (tmp_path / "d.npz").mkdir()
    with pytest.raises(FileGraphError, match="is a folder"):
        load_dataset(str(tmp_path / "d.npz"))


def test_an_edge_line_with_an_empty_or_semicolon_field_says_so(tmp_path):
    feats, labels = "0,1.0\n1,0.0\n2,1.0\n", "id,label\n0,a\n1,b\n2,a\n"
    _expect(
        "files:" + _files(tmp_path, "0,1\n1,\n", feats, labels),
        "e.csv:2: node '' is in neither",
        "an empty field",
    )
    _expect("files:" + _files(tmp_path, "0,1\n1;2,0\n", feats, labels), "e.csv:2", "separated by semicolons")
    # a name with a space is a name, not a sign of another separator
    spec = _files(tmp_path, "a,b\nb,New York\n", "a,1.0\nb,0.0\nc,1.0\n", "id,label\na,x\nb,y\nc,x\n")
    with pytest.raises(FileGraphError) as err:
        load_files_graph(spec)
    assert "node 'New York' is in neither" in str(err.value) and "separated" not in str(err.value)


def test_a_first_feature_row_of_0_1_is_a_node_when_an_edge_names_it(tmp_path, caplog):
    """Width-2 one-hot features whose first node has no label: line 1 reads "a,0,1" as pandas'
    numbered header would; an edge names node a, so it stays a node, and nothing is said."""
    spec = _files(tmp_path, "a,b\nb,c\n", "a,0,1\nb,1,0\nc,1,0\n", "id,label\nb,0\nc,1\n")
    with caplog.at_level("WARNING", logger="retexo_fl.data.files"):
        data = load_files_graph(spec)
    assert data.node_names == ["a", "b", "c"]
    assert torch.equal(data.x[0], torch.tensor([0.0, 1.0]))
    assert "numbered columns" not in caplog.text
    # pandas' own header, its id column named as the labels' is: dropped without a word
    caplog.clear()
    with caplog.at_level("WARNING", logger="retexo_fl.data.files"):
        data = load_files_graph(
            _files(tmp_path, "1,2\n2,3\n", "id,0,1\n1,.5,.3\n2,.1,.2\n3,.4,.4\n", "id,label\n1,0\n2,1\n3,0\n")
        )
    assert data.num_nodes == 3 and "numbered columns" not in caplog.text


def test_free_text_over_several_lines_is_a_field_and_a_label_over_several_is_refused(tmp_path):
    labels = 'id,label,desc\n0,a,"hello\nworld"\n1,b,plain\n2,a,x\n'
    data = load_files_graph(
        _files(tmp_path, "0,1\n1,2\n", "0,1.0\n1,0.0\n2,1.0\n", labels) + ",label-column=label"
    )
    assert data.y.tolist() == [0, 1, 0]
    feats = 'id,site,f1\n0,"north\nwing",1.0\n1,south,0.0\n2,east,1.0\n'
    data = load_files_graph(_files(tmp_path, "0,1\n1,2\n", feats, "id,label\n0,a\n1,b\n2,a\n"))
    assert data.x.tolist() == [[1.0], [0.0], [1.0]]
    _expect(
        "files:" + _files(tmp_path, "0,1\n1,2\n", feats, 'id,label\n0,"a\n1,b\n2,a\n'),
        "y.csv:2: a field runs over",
    )


def test_the_float32_bound_is_float32s_own_and_a_bad_value_names_its_column(tmp_path):
    top = "3.4028235e+38"  # float32's largest, as numpy writes it: finite in float32
    data = load_files_graph(_files(tmp_path, "0,1\n", f"0,{top}\n1,0\n", "id,label\n0,a\n1,b\n"))
    assert torch.isfinite(data.x).all()
    feats = "id,site,f1,f2\n1,x,0.5,1\n2,y,0.1,2\n3,z,0.2,abc\n"
    _expect(
        "files:" + _files(tmp_path, "1,2\n2,3\n", feats, "id,label\n1,a\n2,b\n3,a\n"),
        "x.csv:4",
        "'abc' in value column 3 ('f2')",
    )


def test_one_tables_unnamed_index_column_is_not_a_feature(tmp_path, caplog):
    table = ",id,f1,label\n" + "".join(f"{k},n{k},{k % 2}.5,{'xy'[k % 2]}\n" for k in range(6))
    (tmp_path / "t.csv").write_text(table)
    (tmp_path / "e.csv").write_text("".join(f"n{k},n{k + 1}\n" for k in range(5)))
    t = tmp_path / "t.csv"
    with caplog.at_level("WARNING", logger="retexo_fl.data.files"):
        data = load_files_graph(
            f"edges={tmp_path / 'e.csv'},features={t},labels={t},id-column=id,label-column=label"
        )
    assert data.x.shape == (6, 1) and "unnamed column (a row index)" in caplog.text


def test_common_edge_headers_are_read_without_a_warning(tmp_path, caplog):
    feats, labels = "0,1.0\n1,0.0\n2,1.0\n", "id,label\n0,a\n1,b\n2,a\n"
    for header in ("user_id,friend_id", "citing,cited", "node_a,node_b", "a,b", "from_node,to_node"):
        caplog.clear()
        with caplog.at_level("WARNING", logger="retexo_fl.data.files"):
            load_files_graph(_files(tmp_path, f"{header}\n0,1\n1,2\n", feats, labels))
        assert "read as a header" not in caplog.text, header


def test_an_undecodable_line_is_named_with_any_line_ending(tmp_path):
    (tmp_path / "x.csv").write_text("0,1.0\n1,0.0\n")
    (tmp_path / "y.csv").write_text("id,label\n0,a\n1,b\n")
    (tmp_path / "e.csv").write_bytes(b"a,b\r0,1\r\xff,1\r")
    spec = f"files:edges={tmp_path / 'e.csv'},features={tmp_path / 'x.csv'},labels={tmp_path / 'y.csv'}"
    _expect(spec, "e.csv:3: not UTF-8 text")
