"""DP-FedAvg: clipped, noised aggregates and the privacy Flower's RDP accountant reports."""

from __future__ import annotations

import math

import pytest
import torch

from retexo_fl.config import TrainConfig
from retexo_fl.coordinator.privacy import UpdatePrivacy
from retexo_fl.data.partitioners import partition_graph
from retexo_fl.training.lazy import run_lazy

pytest.importorskip("dp_accounting")


def _states(n: int, scale: float) -> tuple[dict, list[dict]]:
    base = {"w": torch.zeros(50, 40), "b": torch.zeros(40)}
    gen = torch.Generator().manual_seed(0)
    return base, [
        {k: v + scale * torch.randn(v.shape, generator=gen) for k, v in base.items()} for _ in range(n)
    ]


def _norm(state: dict) -> float:
    return math.sqrt(sum(float((v.double() ** 2).sum()) for v in state.values()))


def test_updates_are_clipped_and_the_noise_has_the_stated_scale():
    base, states = _states(4, scale=10.0)  # every update far beyond the clipping norm
    quiet = UpdatePrivacy(noise=1e-9, clip=2.0, clients=4, delta=1e-5, seed=0)
    mean = quiet.aggregate(base, base, states, (0, 1))
    assert quiet.clipped == 4 and _norm(mean) <= 2.0 + 1e-6
    loud = UpdatePrivacy(noise=3.0, clip=2.0, clients=4, delta=1e-5, seed=0)
    zero = [dict(base) for _ in range(4)]  # no signal: the aggregate is the noise alone
    noise = loud.aggregate(base, base, zero, (0, 1))
    values = torch.cat([v.flatten() for v in noise.values()])
    assert float(values.std()) == pytest.approx(3.0 * 2.0 / 4, rel=0.05)
    again = UpdatePrivacy(noise=3.0, clip=2.0, clients=4, delta=1e-5, seed=0).aggregate(
        base, base, zero, (0, 1)
    )
    assert all(torch.equal(noise[k], again[k]) for k in noise)  # seeded: reproducible


def test_the_default_noise_is_secret_and_never_written_anywhere_public(tmp_path, monkeypatch):
    """With the run seed, every client (and any reader of config.json) could regenerate the
    noise and subtract it from the released model; the default key is the server's alone."""
    base = {"w": torch.zeros(30, 20)}
    zero = [dict(base) for _ in range(3)]
    known = UpdatePrivacy(noise=1.0, clip=1.0, clients=3, delta=1e-5, seed=0).aggregate(
        base, base, zero, (0, 1)
    )
    secret, other = (UpdatePrivacy(noise=1.0, clip=1.0, clients=3, delta=1e-5) for _ in range(2))
    first = secret.aggregate(base, base, zero, (0, 1))["w"]
    assert not torch.equal(first, known["w"])  # not the noise of a known seed ...
    assert not torch.equal(first, other.aggregate(base, base, zero, (0, 1))["w"])  # ... nor another run's
    assert secret.spent()["noise_seed"] == "secret"

    # Whole runs: the key comes from the OS, is never written to the run folder, and two runs
    # of one config release different models; the summary says which noise it was.
    from retexo_fl.coordinator import privacy
    from retexo_fl.metrics import RunRecorder
    from retexo_fl.runner import train

    keys: list[int] = []
    draw = privacy.secrets.randbits

    def recorded(k: int) -> int:
        value = draw(k)
        if k == 256:  # the noise key (run keys are drawn here too)
            keys.append(value)
        return value

    monkeypatch.setattr(privacy.secrets, "randbits", recorded)
    cfg = dict(
        dataset="sbm:200,3", clients=3, model="gcn", stages=2, hidden=8, rounds=3, seed=0, dp_noise=1.0
    )
    quiet = RunRecorder(None, stream=None)
    runs = [train(TrainConfig.resolve(**cfg, out_dir=str(tmp_path / f"run-{i}"))) for i in range(2)]
    assert len(keys) == 2 and keys[0] != keys[1]
    assert runs[0]["privacy"]["noise_seed"] == "secret"
    assert _curve(runs[0]) != _curve(runs[1])
    written = "".join(f.read_text() for f in tmp_path.rglob("*") if f.is_file() and f.suffix != ".png")
    assert '"noise_seed": "secret"' in written
    assert not any(str(k) in written or f"{k:x}" in written for k in keys)
    again = [train(TrainConfig.resolve(**cfg, dp_reproducible=True), quiet) for _ in range(2)]
    assert again[0]["privacy"]["noise_seed"] == "run seed" and _curve(again[0]) == _curve(again[1])


def _curve(summary: dict) -> list[float]:
    return [h[k] for s in summary["stages"] for h in s["history"] for k in ("val_accuracy", "train_loss")]


def test_epsilon_follows_the_gaussian_mechanism():
    """RDP accounting is never looser than the zCDP bound ``rho + 2 sqrt(rho ln(1/delta))``,
    ``rho = T / (2 sigma^2)``, nor far below it."""
    base, states = _states(3, scale=1.0)
    eps = {}
    for sigma in (1.0, 2.0):
        dp = UpdatePrivacy(noise=sigma, clip=1.0, clients=3, delta=1e-5, seed=0)
        for r in range(50):
            dp.aggregate(base, base, states, (0, r))
        spent = dp.spent()
        assert spent["releases"] == 50
        rho = 50 / (2 * sigma**2)
        bound = rho + 2 * math.sqrt(rho * math.log(1e5))
        assert 0.5 * bound < spent["epsilon"] <= bound
        eps[sigma] = spent["epsilon"]
    assert eps[2.0] < eps[1.0] / 2  # more noise, much less privacy spent


def test_private_lazy_training_reports_its_budget(sbm):
    parts = partition_graph(sbm, 3, "metis", seed=0)
    cfg = TrainConfig.resolve(
        profile="exact",
        model="gcn",
        stages=2,
        hidden=16,
        rounds=30,
        seed=0,
        dp_noise=0.3,
        dp_clip=1.0,
        dp_reproducible=True,
    )
    out = run_lazy(parts, cfg)
    assert out["privacy"]["releases"] == 60 and 0 < out["privacy"]["epsilon"] < math.inf
    plain = run_lazy(
        parts, TrainConfig.resolve(profile="exact", model="gcn", stages=2, hidden=16, rounds=30, seed=0)
    )
    assert plain["privacy"] is None
    # 3 classes: the noisy run still learns (well above chance), and pays for its privacy.
    assert 0.45 < out["test_accuracy"] < plain["test_accuracy"]


@pytest.mark.slow
def test_private_training_is_the_same_in_flower():
    from retexo_fl.metrics import RunRecorder
    from retexo_fl.runner import train
    from server.simulation import simulate

    cfg = TrainConfig.resolve(
        profile="exact",
        dataset="sbm:400,3,8,0.85",
        clients=3,
        model="gcn",
        stages=2,
        hidden=16,
        rounds=8,
        seed=0,
        dp_noise=0.5,
        dp_reproducible=True,  # the engines draw the same noise only from a seed they share
    )
    sim = simulate(cfg)
    ref = train(cfg, RunRecorder(None, stream=None))
    assert sim["privacy"]["releases"] == ref["privacy"]["releases"] == 16
    assert sim["privacy"]["epsilon"] == pytest.approx(ref["privacy"]["epsilon"])
    assert sim["test_accuracy"] == pytest.approx(ref["test_accuracy"], abs=1e-9)


@pytest.mark.parametrize("schedule", ["sequential", "parallel"])
def test_stage_0s_second_training_draws_noise_of_its_own(sbm, monkeypatch, schedule):
    """Under ``first-stage auto`` both trainings of stage 0 release a noisy aggregate each round.
    Drawn from the same seed, their noise would cancel in the difference of the two broadcasts,
    which every client holds: the second training's releases are seeded apart."""
    import retexo_fl.coordinator.round_aggregation as aggregation

    tags: list[tuple[int, ...]] = []
    real = aggregation.aggregate_round

    def spy(state, view, states, weights, privacy, tag):
        tags.append(tag)
        return real(state, view, states, weights, privacy, tag)

    monkeypatch.setattr(aggregation, "aggregate_round", spy)
    parts = partition_graph(sbm, 3, "metis", seed=0)
    settings = dict(
        model="gcn", stages=2, hidden=16, rounds=3, min_rounds=0, patience=0, seed=0, self_training=0
    )
    dp = dict(dp_noise=0.3, dp_clip=1.0, dp_reproducible=True, first_stage_race=0)
    cfg = TrainConfig.resolve(**settings, **dp, first_stage="auto", first_stage_schedule=schedule)
    out = run_lazy(parts, cfg)
    stage0 = [t for t in tags if t[0] == 0]
    # Three rounds of each training; the first's tags as before the auto stage (stage, round).
    assert sorted(stage0) == [(0, 1), (0, 1, 1), (0, 2), (0, 2, 1), (0, 3), (0, 3, 1)]
    assert len(set(tags)) == len(tags) and out["privacy"]["releases"] == len(tags)
    # ... and so are the noises: one release each, none twice.
    priv = UpdatePrivacy(0.3, 1.0, 3, 1e-5, seed=7)
    base, states = _states(3, 0.1)
    first, second = (priv.aggregate(base, base, states, tag) for tag in [(0, 1), (0, 1, 1)])
    assert not torch.equal(first["w"], second["w"])
