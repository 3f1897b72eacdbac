"""Clipped, noised boundary rows: the mechanism, its accounting, and what a run releases."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from retexo_fl.config import TrainConfig
from retexo_fl.data.partitioners import partition_graph
from retexo_fl.party.lazy_client import LazyClient
from retexo_fl.secure.boundary_noise import (
    ReleaseLedger,
    gaussian_epsilon,
    load_epsilon,
    release_load,
    release_rows,
)
from retexo_fl.training.eager import run_eager
from retexo_fl.training.lazy import run_lazy


def test_rows_are_clipped_then_noised_at_the_stated_scale():
    rows = torch.randn(4000, 16) * 5
    clipped = release_rows(rows, clip=1.5, noise=0.0)
    assert float(clipped.norm(dim=1).max()) <= 1.5 + 1e-5
    small = rows[:1] / 100  # a row inside the ball is left as it is
    assert torch.allclose(release_rows(small, 1.5, 0.0), small)
    noisy = release_rows(rows, clip=1.5, noise=2.0, generator=torch.Generator().manual_seed(0))
    std = float((noisy - clipped).std())
    assert abs(std - 3.0) < 0.05  # 64,000 draws: the std of the std estimate is about 0.01
    with pytest.raises(ValueError, match="boundary-clip must be > 0"):
        release_rows(rows, clip=0.0, noise=1.0)


def test_epsilon_matches_the_closed_form_of_gaussian_rdp():
    # T releases of a Gaussian mechanism with noise multiplier s = sigma / 2 (sensitivity 2C):
    # eps(a) = T a / (2 s^2) + log(1/delta) / (a - 1), minimized over a > 1 at
    # a* = 1 + sqrt(2 s^2 log(1/delta) / T), giving T / (2 s^2) + sqrt(2 T log(1/delta)) / s.
    for sigma, releases, delta in [(4.0, 4, 1e-5), (8.0, 100, 1e-5), (20.0, 1, 1e-6)]:
        s = sigma / 2
        best = releases / (2 * s**2) + math.sqrt(2 * releases * math.log(1 / delta)) / s
        got = gaussian_epsilon(sigma, releases, delta)
        assert best <= got <= best * 1.03, (sigma, releases, got, best)  # a grid of orders, not a*
    assert gaussian_epsilon(1.0, 0, 1e-5) == 0.0 and math.isinf(gaussian_epsilon(0.0, 3, 1e-5))
    assert gaussian_epsilon(2.0, 10, 1e-5) > gaussian_epsilon(2.0, 5, 1e-5) > gaussian_epsilon(4.0, 5, 1e-5)


def test_peers_get_noised_rows_and_the_owner_keeps_its_own(sbm):
    cfg = TrainConfig.resolve(
        profile="exact", clients=3, stages=3, hidden=8, encrypt=False, boundary_clip=1.0, boundary_noise=0.5
    )
    part = partition_graph(sbm, 3, "random", seed=0)[0]
    client = LazyClient(part, cfg)
    emb = torch.rand(part.num_nodes, 8)
    rows = client.advance(emb)
    # Its own next stage reads its rows clipped (one scale with the halo), never noised.
    assert torch.allclose(client.owned, release_rows(emb, 1.0, 0.0))
    q = sorted(rows)[0]
    exact = client.plan.rows_for(release_rows(emb, 1.0, 0.0))[q]
    assert rows[q].shape == exact.shape and not torch.allclose(rows[q], exact, atol=0.1)
    again = LazyClient(part, cfg)
    # Fresh noise from the OS, not from the run's seed (which every party knows): the same
    # client, config and rows release other values.
    assert not torch.equal(again.advance(emb)[q], rows[q])


def test_a_run_reports_what_its_rows_keep(sbm):
    parts = partition_graph(sbm, 3, "random", seed=0)
    cfg = TrainConfig.resolve(
        model="gcn", stages=3, hidden=16, rounds=30, seed=0, encrypt=False, profile="exact"
    )
    plain = run_lazy(parts, cfg)
    assert plain["boundary_privacy"] is None
    noisy = run_lazy(parts, dataclasses.replace(cfg, boundary_clip=1.0, boundary_noise=0.05))
    got = noisy["boundary_privacy"]
    assert got["releases"] == 2 and got["epsilon"] == gaussian_epsilon(0.05, 2, cfg.dp_delta)
    # Little noise costs little (measured: the same to within a few points on this graph).
    assert noisy["test_accuracy"] > plain["test_accuracy"] - 0.1
    eager = run_eager(
        parts, dataclasses.replace(cfg, mode="eager", rounds=5, boundary_clip=1.0, boundary_noise=1.0)
    )
    assert eager["boundary_privacy"]["releases"] == 5 * 2  # every round, every conv layer's rows


def test_a_ledger_adds_releases_at_any_noise_and_keeps_each_partitions_apart(tmp_path):
    """Rényi DP of Gaussian releases adds up as the sum of 1 / sigma^2: k releases at one noise
    spend what gaussian_epsilon says, and releases at two noises what their summed load does."""
    path = tmp_path / "node" / "ledger.json"
    for k in range(1, 5):
        ledger = ReleaseLedger(path, "part-0")
        with ledger.spending() as spent:
            ledger.add(release_load(2.0))
        assert load_epsilon(spent + release_load(2.0), 1e-5) == pytest.approx(gaussian_epsilon(2.0, k, 1e-5))
    other = ReleaseLedger(path, "part-1")
    with other.spending() as spent:
        assert spent == 0.0  # another partition's rows: its own count
        other.add(release_load(1.0))
    with ReleaseLedger(path, "part-0").spending() as spent:
        assert spent == pytest.approx(4 / 2.0**2)
    mixed = load_epsilon(release_load(1.0) + release_load(2.0), 1e-5)
    assert gaussian_epsilon(2.0, 2, 1e-5) < mixed < gaussian_epsilon(1.0, 2, 1e-5)
    assert math.isinf(load_epsilon(release_load(0.0), 1e-5)) and load_epsilon(0.0, 1e-5) == 0.0


def test_an_unreadable_ledger_is_an_error_naming_it_not_an_unspent_budget(tmp_path):
    path = tmp_path / "ledger.json"
    path.write_text("[1, 2")
    unreadable = pytest.raises(ValueError, match=r"ledger\.json: boundary release ledger unreadable")
    with unreadable, ReleaseLedger(path, "part-0").spending():
        pass
