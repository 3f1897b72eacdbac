"""Each CAGNET algorithm trains exactly what one process trains and moves what its formula says."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch
import torch.nn.functional as F

from retexo_fl.config import TrainConfig
from retexo_fl.datacenter.graph import FullGraph
from retexo_fl.datacenter.launch import run_datacenter
from retexo_fl.datacenter.model import ReferenceGCN, initial_weights
from retexo_fl.datacenter.trainer import schedule
from retexo_fl.datacenter.volumes import epoch_spmm_bytes

RUNS = [("1d", 4), ("1.5d", 4), ("2d", 4), ("3d", 8)]
EPOCHS = 5


def random_graph(n: int = 240, feats: int = 10, classes: int = 3, seed: int = 0) -> FullGraph:
    """A directed random graph with arbitrary positive weights: A != A.T, so the backward
    products really need the transposed blocks."""
    rng = np.random.default_rng(seed)
    e = 8 * n
    src, dst = rng.integers(0, n, e), rng.integers(0, n, e)
    a = sp.csr_matrix((rng.uniform(0.05, 0.5, e), (dst, src)), shape=(n, n)) + 0.5 * sp.eye(n)
    a = sp.csr_matrix(a)
    a.sum_duplicates()
    perm = rng.permutation(n)
    masks = {k: torch.zeros(n, dtype=torch.bool) for k in ("train", "val", "test")}
    masks["train"][perm[: int(0.4 * n)]] = True
    masks["val"][perm[int(0.4 * n) : int(0.6 * n)]] = True
    masks["test"][perm[int(0.6 * n) :]] = True
    return FullGraph(
        adjacency=a,
        x=torch.from_numpy(rng.standard_normal((n, feats)).astype(np.float32)),
        y=torch.from_numpy(rng.integers(0, classes, n)),
        masks=masks,
        name="random",
        num_classes=classes,
    )


def config(algorithm: str, procs: int) -> TrainConfig:
    # Three layers: 3D's products alternate orientation, so both orientations and both
    # transposed orientations run. Widths 10 / 8 / 3 split unevenly over 2D/3D column groups.
    return TrainConfig.resolve(
        profile="exact",
        mode="datacenter",
        algorithm=algorithm,
        procs=procs,
        central_layers=3,
        hidden=8,
        rounds=EPOCHS,
        dropout=0.3,
        seed=3,
    ).validate()


def reference(
    cfg: TrainConfig, graph: FullGraph
) -> tuple[list[float], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Plain single-process full-batch training: torch.sparse.mm on the whole adjacency."""
    epochs, lr, dropout = schedule(cfg)
    init = initial_weights(graph.x.shape[1], cfg.hidden, graph.num_classes, cfg.central_layers, cfg.seed)
    coo = graph.adjacency.tocoo()
    adj = torch.sparse_coo_tensor(
        np.vstack([coo.row, coo.col]), torch.from_numpy(coo.data.astype(np.float32)), coo.shape
    ).coalesce()
    model = ReferenceGCN(init, adj, dropout, cfg.seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=cfg.weight_decay)
    train = graph.masks["train"]
    losses = []
    for epoch in range(1, epochs + 1):
        model.train()
        opt.zero_grad()
        loss = F.cross_entropy(model(graph.x, epoch)[train], graph.y[train], reduction="sum") / int(
            train.sum()
        )
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [
        (w.detach(), b.detach()) for w, b in zip(model.params.weights, model.params.biases, strict=True)
    ]


@pytest.fixture(scope="module")
def graph() -> FullGraph:
    return random_graph()


@pytest.fixture(scope="module")
def runs(graph) -> dict[str, dict]:
    return {a: run_datacenter(config(a, p), graph=graph, keep_weights=True) for a, p in RUNS}


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", [a for a, _ in RUNS])
def test_training_equals_single_process(runs, graph, algorithm):
    summary = runs[algorithm]
    losses, weights = reference(config("1d", 1), graph)
    got = [h["train_loss"] for h in summary["stages"][0]["history"]]
    assert len(got) == EPOCHS
    np.testing.assert_allclose(got, losses, rtol=1e-5, atol=1e-6)
    assert losses[-1] < losses[0]  # it trained
    for (w, b), (rw, rb) in zip(summary["final_weights"], weights, strict=True):
        torch.testing.assert_close(w, rw, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(b, rb, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", [a for a, _ in RUNS])
def test_measured_bytes_match_formula(runs, graph, algorithm):
    summary = runs[algorithm]
    procs = summary["procs"]
    widths = summary["graph"]["widths"]
    assert widths == [8, 8, 3]
    predicted = epoch_spmm_bytes(algorithm, graph.num_nodes, graph.adjacency.nnz, widths, procs, 2)
    per_epoch = summary["per_epoch"]
    assert per_epoch["spmm_bytes_predicted"] == pytest.approx(predicted)
    assert per_epoch["spmm_bytes_measured"] == pytest.approx(predicted, rel=0.10)
    if algorithm != "1.5d":  # 1.5D's processes differ by design (a team's own block is not sent)
        # Processes differ by how many nonzeros their blocks hold: self loops make the diagonal
        # blocks denser, so one process's volume is near the mean, not equal to it.
        for p in summary["communication"]:
            spmm = sum(
                r["bytes_received"]
                for r in p["collectives"]
                if r["category"] == "spmm" and r["phase"] == "train"
            )
            assert spmm / EPOCHS == pytest.approx(predicted, rel=0.20), p["rank"]


@pytest.mark.slow
def test_every_byte_sent_is_received(runs):
    for algorithm, summary in runs.items():
        sent = sum(r["bytes_sent"] for p in summary["communication"] for r in p["collectives"])
        received = sum(r["bytes_received"] for p in summary["communication"] for r in p["collectives"])
        assert sent == received > 0, algorithm
        assert summary["bytes_total"] == received
        assert summary["bytes_boundary"] > 0 and summary["bytes_model"] > 0


def test_formulas_by_hand():
    from retexo_fl.datacenter.volumes import spmm_bytes

    n, nnz, f = 100, 1000, 8
    assert spmm_bytes("1d", n, nnz, f, 4) == 4 * f * n * 3 / 4
    assert spmm_bytes("2d", n, nnz, f, 4) == (12 * nnz + 4 * n * f) / 4
    assert spmm_bytes("3d", n, nnz, f, 8) == (12 * nnz + 8 * n * f) / 8
    # 1.5D with c = 1 is 1D; with c = P it is a pure all-reduce of the whole product.
    assert spmm_bytes("1.5d", n, nnz, f, 4, replication=1) == spmm_bytes("1d", n, nnz, f, 4)
    assert spmm_bytes("1.5d", n, nnz, f, 4, replication=4) == 4 * 2 * 3 / 4 * n * f
