"""Dataset registry: real Planetoid files, splits, a user's own Data file, synthetic SBM graphs."""

from __future__ import annotations

import re

import pytest
import torch
from torch_geometric.data import Data

from retexo_fl.data.datasets import (
    DatasetError,
    apply_split,
    load_dataset,
    split_without_test,
    synthetic_sbm,
)


def test_cora_public_split(cora):
    assert cora.num_nodes == 2708 and cora.edge_index.size(1) == 10556
    assert cora.x.shape == (2708, 1433)
    assert [int(cora[k].sum()) for k in ("train_mask", "val_mask", "test_mask")] == [140, 500, 1000]


def test_citeseer_loads(data_root):
    data = load_dataset("citeseer", data_root)
    assert data.num_nodes == 3327 and int(data.train_mask.sum()) == 120


def test_per_class_split_is_seeded(data_root):
    a = load_dataset("Cora", data_root, split="per-class:40,500,1000", seed=1)
    b = load_dataset("Cora", data_root, split="per-class:40,500,1000", seed=1)
    c = load_dataset("Cora", data_root, split="per-class:40,500,1000", seed=2)
    assert torch.equal(a.train_mask, b.train_mask) and not torch.equal(a.train_mask, c.train_mask)
    assert torch.bincount(a.y[a.train_mask]).tolist() == [40] * 7
    assert int(a.val_mask.sum()) == 500 and int(a.test_mask.sum()) == 1000
    assert not (a.train_mask & a.val_mask).any() and not (a.val_mask & a.test_mask).any()


def test_user_graph_with_unlabeled_nodes(tmp_path):
    data = synthetic_sbm(200, 4, seed=0)
    data.y[:50] = -1
    path = tmp_path / "mine.pt"
    torch.save(data, path)
    with pytest.raises(DatasetError, match="no split masks"):
        load_dataset(str(path))
    loaded = load_dataset(str(path), split="random:0.6,0.2,0.2", seed=0)
    union = loaded.train_mask | loaded.val_mask | loaded.test_mask
    assert not union[:50].any(), "unlabeled nodes stay out of every split"
    assert int(union.sum()) == 150
    assert loaded.name == "mine"


def test_bad_user_files(tmp_path):
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(DatasetError, match=r"junk\.pt"):
        load_dataset(str(tmp_path / "junk.pt"))
    torch.save({"x": 1}, tmp_path / "dict.pt")
    with pytest.raises(DatasetError, match="expected torch_geometric Data"):
        load_dataset(str(tmp_path / "dict.pt"))


def test_unknown_dataset_and_bad_split(data_root):
    with pytest.raises(DatasetError, match="unknown dataset"):
        load_dataset("NoSuchGraph", data_root)
    data = synthetic_sbm(50, 2, seed=0)
    with pytest.raises(DatasetError, match="bad split"):
        apply_split(data, "random:0.9,0.9,0.1", 0)


def test_sbm_size_and_determinism():
    a = synthetic_sbm(5000, 5, avg_degree=20, seed=3)
    b = synthetic_sbm(5000, 5, avg_degree=20, seed=3)
    assert torch.equal(a.edge_index, b.edge_index) and torch.equal(a.x, b.x)
    avg = a.edge_index.size(1) / a.num_nodes
    assert 17 < avg <= 20, avg  # a few duplicate pairs collapse
    same = (a.y[a.edge_index[0]] == a.y[a.edge_index[1]]).float().mean()
    assert 0.75 < same < 0.9  # homophily 0.8 plus chance hits of the uniform draw
    spec = load_dataset("sbm:1000,4", "unused")
    assert spec.num_nodes == 1000 and int(spec.train_mask.sum()) == 600


def _saved(folder, **fields):
    data = Data(
        x=torch.eye(4),
        y=torch.tensor([0, 1, 0, 1]),
        edge_index=torch.tensor([[0, 1, 2], [1, 2, 3]]),
    )
    for key, value in fields.items():
        data[key] = value
    path = folder / "mine.pt"
    torch.save(data, path)
    return str(path)


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"edge_index": torch.tensor([[0, 1], [1, 9]])}, "names node 9, outside 0..3"),
        ({"edge_index": torch.tensor([[0, 1], [1, -1]])}, "names node -1"),
        ({"edge_index": torch.tensor([[0.0, 1.0], [1.0, 2.0]])}, "integer node ids"),
        ({"x": torch.ones(4)}, "'x' must be a [N, F] tensor, got [4]"),
        ({"x": torch.tensor([[float("nan")]] * 4)}, "not a finite real number"),
        ({"y": torch.tensor([0.0, 1.5, 0.0, 1.0])}, "integer class indices"),
        ({"y": torch.tensor([0, 1, 0, 2**40])}, "class indices in -1.."),
        ({"x": torch.eye(4).to_sparse()}, "'x' must be a dense tensor"),
    ],
    ids=[
        "edge-past-n",
        "negative-edge",
        "float-edges",
        "x-1d",
        "nan-x",
        "fractional-y",
        "huge-y",
        "sparse-x",
    ],
)
def test_a_saved_data_file_is_checked_before_training_reads_it(tmp_path, fields, fragment):
    # Each trained on silently (a -1 endpoint was written to a partition), or failed deep in
    # partitioning with an IndexError, or as "training diverged" for NaN features.
    path = _saved(tmp_path, **fields)
    with pytest.raises(DatasetError, match=re.escape(fragment)) as err:
        load_dataset(path, split="random:0.5,0.25,0.25")
    assert str(err.value).startswith(path)


def test_a_graph_without_a_labelled_node_or_a_rounded_away_set_is_refused(tmp_path):
    path = _saved(tmp_path, y=torch.full((4,), -1))
    with pytest.raises(DatasetError, match="no node is labelled"):
        load_dataset(path, split="random:0.5,0.25,0.25")
    # Two labelled nodes cannot fill three sets: a validation accuracy of an empty set read 0.0.
    path = _saved(tmp_path, y=torch.tensor([0, 1, -1, -1]))
    with pytest.raises(DatasetError, match="over 2 labelled nodes leaves the validation set empty"):
        load_dataset(path, split="random:0.6,0.2,0.2")
    loaded = load_dataset(path, split="random:0.5,0.5,0")  # a share of 0 asks for no test set
    assert int(loaded.train_mask.sum()) == 1 and not loaded.test_mask.any()


def test_a_registered_dataset_that_cannot_be_downloaded_fails_naming_it(tmp_path, monkeypatch):
    # Offline, PyG's download raised aiohttp's connection error, a traceback that named no dataset.
    import socket

    def unreachable(*args, **kwargs):
        raise OSError("network unreachable")

    monkeypatch.setattr(socket.socket, "connect", unreachable)
    monkeypatch.setattr(socket, "getaddrinfo", unreachable)
    with pytest.raises(DatasetError, match=r"Cora: cannot be read or downloaded under --data-root"):
        load_dataset("Cora", tmp_path / "empty")


class _RunsCode:
    """A pickle that runs code when loaded (a file a run config could name)."""

    def __init__(self, canary: str) -> None:
        self.canary = canary

    def __reduce__(self):
        return (open, (self.canary, "w"))


def test_a_saved_file_that_would_run_code_is_refused_and_runs_none(tmp_path):
    canary = tmp_path / "ran"
    torch.save(_RunsCode(str(canary)), tmp_path / "graph.pt")
    with pytest.raises(DatasetError, match=r"graph\.pt: refused: .*could run code"):
        load_dataset(str(tmp_path / "graph.pt"), tmp_path)
    assert not canary.exists()
    # A Data of tensors still loads as before.
    data = Data(x=torch.ones(4, 2), edge_index=torch.tensor([[0, 1], [1, 2]]), y=torch.tensor([0, 1, 0, 1]))
    torch.save(data, tmp_path / "ok.pt")
    assert load_dataset(str(tmp_path / "ok.pt"), tmp_path, split="random:0.5,0.25,0.25").num_nodes == 4


def test_public_split_masks_some_missing_or_overlapping_are_refused(tmp_path):
    # A saved Data with a training mask alone ended in a KeyError traceback ('val_mask').
    only_train = _saved(tmp_path, train_mask=torch.tensor([True, True, False, False]))
    with pytest.raises(DatasetError, match="has no val_mask, test_mask: pass a split"):
        load_dataset(only_train, split="public")
    # Overlapping masks trained on the test nodes without a word.
    same = torch.tensor([True, True, True, False])
    overlapping = _saved(tmp_path, train_mask=same, val_mask=same, test_mask=~same)
    with pytest.raises(DatasetError, match="train_mask and val_mask overlap on 3 node"):
        load_dataset(overlapping, split="public")


@pytest.mark.parametrize(
    "split,fragment",
    [("random:0.5,0,0.5", "VAL is 0"), ("per-class:2.5,10,10", "whole numbers")],
)
def test_a_split_without_validation_nodes_or_a_fractional_k_is_refused(tmp_path, split, fragment):
    # Without validation nodes every stage kept its first round (best val 0.0000 at round 1);
    # per-class:2.5 trained on 2 a class.
    with pytest.raises(DatasetError, match=fragment):
        load_dataset(_saved(tmp_path), split=split)


def test_a_run_without_test_nodes_reports_no_test_accuracy(tmp_path):
    # A test share of 0 reported 0.0 (lazy) or NaN (centralized, not JSON) as the test accuracy.
    import json

    from retexo_fl.config import TrainConfig
    from retexo_fl.metrics import RunRecorder
    from retexo_fl.runner import train

    data = synthetic_sbm(120, 3, avg_degree=4, homophily=0.8, num_features=8, seed=0)
    path = tmp_path / "g.pt"
    torch.save(Data(x=data.x, y=data.y, edge_index=data.edge_index), path)
    for mode in ("centralized", "lazy"):
        out = tmp_path / mode
        cfg = TrainConfig.resolve(
            dataset=str(path), split="random:0.6,0.4,0", mode=mode, clients=2, method="random",
            stages=2, rounds=2, self_training=0, device="cpu", out_dir=str(out),
        )  # fmt: skip
        summary = train(cfg, RunRecorder(str(out), stream=None))
        assert summary.test_accuracy is None and "no test nodes" in summary.line()

        def refuse(constant: str) -> None:
            raise ValueError(f"{constant} in summary.json")

        text = (out / "summary.json").read_text()
        written = json.loads(text, parse_constant=refuse)  # strict JSON: no NaN anywhere
        assert written["test_accuracy"] is None and written["val_accuracy"] > 0
        rows = written["stages"] + written.get("stage_results", [])
        assert all(r.get("test_accuracy") is None for r in rows)  # not 0.0 or NaN per stage
    assert split_without_test("random:0.6,0.4,0") and not split_without_test("random:0.6,0.2,0.2")
    assert not split_without_test("public")
